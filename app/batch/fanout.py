"""Fan-out: a validated input file becomes batch-class jobs: one per valid line, or one per choice of a line
of several (``n``, or several prompts).

Every job's TTLT deadline is the batch's ``expires_at`` (created_at + completion_window).
Invalid lines are kept in ``data_dir/batches/<id>/invalid.jsonl`` for the error file.
"""

from __future__ import annotations

import json
import logging
from datetime import timedelta
from pathlib import Path

from sqlalchemy import delete, select, update

from app.anthropic_schemas import ENDPOINT as MESSAGES
from app.auth import Principal
from app.gc_pause import full_collections_paused
from app.batch import lines as batch_lines
from app.batch import queue_limit
from app.batch.events import batch_ended
from app.batch.finalize import line_numbers_path, maybe_finalize, result_file
from app.batch.objects import REFUSED_LINE, invalid_line, unrun_line
from app.batch.storage import read_content
from app.db.models import STAGED, Batch, File, Job, JobEvent, JobStatus
from app.db.session import read_then_write, session_scope, write_after_read, write_guard
from app.openai_schemas import parse_window
from app.services.dispatch import Sendable, send_dispatched
from app.services.job_writer import JobRows, stage_mark, write_staged
from app.services.jobs import JobValidationError, choice_links, job_values
from app.services.transitions import as_utc, utcnow
from app.services.truncation import fit_response
from app.services.workers import held_context_length
from app.settings import Settings

log = logging.getLogger(__name__)

# rows per transaction while a batch's jobs are written: SQLite's one write lock is held for one chunk at a time
STAGE_CHUNK = 1000


def batch_dir(data_dir: Path, batch_id: str) -> Path:
    path = Path(data_dir) / "batches" / batch_id
    path.mkdir(parents=True, exist_ok=True)
    return path


def invalid_path(data_dir: Path, batch_id: str) -> Path:
    return Path(data_dir) / "batches" / batch_id / "invalid.jsonl"


def start_batch(settings: Settings, batch_id: str, parsed: batch_lines.ParsedFile | None = None) -> None:
    """Validates the batch's input file and creates + dispatches its jobs (a background task). ``parsed``: the
    file's lines as ``batch_lines.parse_file`` reads them, where the caller has them already (a message batch's
    create checked each request so): the file is not read and parsed again."""
    try:
        with full_collections_paused():  # its lines, specs and rows live until written (app/gc_pause.py)
            _start(settings, batch_id, parsed)
    except Exception:
        log.exception("batch %s failed during validation", batch_id)  # the cause stays in the log: it may name
        with session_scope(settings.sqlalchemy_url) as s, write_guard(s):  # paths, SQL and other lines' text
            _fail(s, batch_id, errors=[{"code": "internal_error", "line": None,
                                        "message": "the server failed to validate the input file (its log says "
                                                   "why); no request of this batch ran, so it can be sent again"}])
    # started, refused, cancelled or failed, the batch has left ``validating``: what is still staged is to be deleted
    # (this run's rest, or what a run that died or lost the start to this one left)
    try:
        _drop_staged(settings.sqlalchemy_url, batch_id)
    except Exception:  # left staged, they stay invisible and never run
        log.exception("could not delete batch %s's staged jobs", batch_id)


def _fail(session, batch_id: str, **values) -> None:
    """validating -> failed, and the batch.failed event with it (the caller commits)."""
    row = session.execute(update(Batch).where(Batch.id == batch_id, Batch.status == "validating").values(
        status="failed", failed_at=utcnow(), **values).returning(Batch.tenant_id, Batch.endpoint)).first()
    if row is not None:
        batch_ended(session, row.tenant_id, row.endpoint, "failed", batch_id)


def _start(settings: Settings, batch_id: str, parsed: batch_lines.ParsedFile | None) -> None:
    url = settings.sqlalchemy_url
    with session_scope(url) as s:
        batch = s.get(Batch, batch_id)
        try:
            content = read_content(s.get(File, batch.input_file_id)) if parsed is None else None
        except FileNotFoundError:  # deleted before it was read
            with write_after_read(s):
                _fail(s, batch_id, errors=[{"code": "invalid_file", "line": None, "param": "input_file_id",
                                            "message": f"the input file {batch.input_file_id} was deleted before "
                                                       "its lines were read"}])
            return
        endpoint, tier, tenant_id, key_id = batch.endpoint, batch.tier, batch.tenant_id, batch.api_key_id
        expires_at = as_utc(batch.expires_at)
    if parsed is None:
        parsed = batch_lines.parse_file(content, endpoint, parse_window(batch.completion_window), settings.tiers,
                                        settings.model)
    if parsed.file_errors:
        with session_scope(url) as s, write_guard(s):
            _fail(s, batch_id, errors=parsed.file_errors, total=parsed.total)
        log.info("batch %s failed validation: %s", batch_id, parsed.file_errors)
        return
    principal = Principal(key_id=key_id or "", tenant_id=tenant_id, tier=tier, is_admin=False)
    invalid_lines = list(parsed.invalid)
    jobs = []
    # the context the batch's jobs are held to, as the workers were read at its start (one read, not one a line)
    context = held_context_length(settings)
    requested = []  # the valid lines that became jobs: a cancel before they start stops them unrun
    for v in parsed.valid:
        try:
            jobs += _line_jobs(settings, principal, v, batch_id, endpoint, expires_at, context)
            requested.append(v)
        except JobValidationError as exc:  # an over-long message batch request in Anthropic's words, as its create
            why = exc.overflow.anthropic_message() if exc.overflow and endpoint == MESSAGES else str(exc)
            invalid_lines.append(batch_lines.InvalidLine(v.line_no, v.custom_id, f"line {v.line_no}: {why}",
                                                         "invalid_body"))
    invalid = [invalid_line(i.line_no, i.custom_id, i.code, i.message)
               for i in sorted(invalid_lines, key=lambda i: i.line_no)]
    path = invalid_path(settings.data_dir, batch_id)
    batch_dir(settings.data_dir, batch_id)
    path.write_text("".join(json.dumps(r) + "\n" for r in invalid))
    numbers = {v.custom_id: v.line_no for v in parsed.valid}  # the error file lists its lines in input order
    line_numbers_path(settings.data_dir, batch_id).write_text(json.dumps(numbers))
    dispatched_at = utcnow() if settings.redis_url else None
    rows = JobRows.of([(job, f"batch {batch_id}") for job in jobs], dispatched_at)
    with session_scope(url) as s:  # a read: a batch over its tenant's queue limit is refused before any row is written
        refused = _over_queue_limit(s, tenant_id, jobs)
    if refused:
        with session_scope(url) as s, write_guard(s):
            _fail(s, batch_id, errors=[refused], total=parsed.total)
        log.info("batch %s refused: %s", batch_id, refused["message"])
        return
    ok = _stage_and_start(url, batch_id, tenant_id, rows, jobs, dispatched_at, parsed.total, len(invalid))
    if ok is None:
        return
    if not ok:
        unrun = [] if endpoint == MESSAGES else [unrun_line(v.line_no, v.custom_id) for v in requested]
        lines = sorted(invalid + unrun, key=lambda r: r["id"].removeprefix(REFUSED_LINE).zfill(12))
        _end_cancelled(settings, batch_id, parsed.total, [json.dumps(r) for r in lines])
        return
    log.info("batch %s: %d jobs, %d invalid lines", batch_id, len(jobs), len(invalid))
    send_dispatched(settings, [Sendable.of(job) for job in jobs])
    if not jobs:
        with session_scope(url) as s:
            maybe_finalize(s, batch_id, settings.data_dir)


def _end_cancelled(settings: Settings, batch_id: str, total: int, failed: list[str]) -> None:
    """A batch cancelled while validating ran no request: this ends it cancelled, with its event, unless the cancel's
    fan-in did (maybe before its lines were read: it then knew none of them) or is finalizing it now, and either way
    it counts its lines (``total``, each one failed: refused, or an OpenAI batch's stopped unrun) and gives ``failed``
    (their error lines) as its error file in place of any that fan-in wrote. A message batch's unrun requests are in
    neither: its counts and results type them ``canceled``."""
    with session_scope(settings.sqlalchemy_url) as s, write_guard(s):
        batch = s.get(Batch, batch_id)
        # not started meanwhile; a finalizing cancel's fan-in writes no counts after it took the batch
        stopped = (Batch.id == batch_id, Batch.status.in_(("cancelling", "cancelled", "finalizing")),
                   Batch.cancelling_at.is_not(None))
        s.execute(update(Batch).where(*stopped).values(total=total, failed=len(failed)))
        if failed:
            _replace_error_file(s, settings, batch, stopped, failed)
        if s.execute(update(Batch).where(Batch.id == batch_id, Batch.status == "cancelling").values(
                status="cancelled", cancelled_at=utcnow())).rowcount:
            batch_ended(s, batch.tenant_id, batch.endpoint, "cancelled", batch_id)


def _replace_error_file(session, settings: Settings, batch: Batch, stopped: tuple, lines: list[str]) -> None:
    """``lines`` as the stopped batch's error file, the one a cancel's fan-in gave (its refused lines alone, or
    fewer) deleted; a finalizing fan-in keeps it (``maybe_finalize`` sets no error file over one set meanwhile)."""
    before = batch.error_file_id
    error_file = result_file(settings.data_dir, batch, "error", lines)
    if not session.execute(update(Batch).where(*stopped, Batch.error_file_id.is_not_distinct_from(before)).values(
            error_file_id=error_file.id)).rowcount:  # not stopped, or another writer's meanwhile
        Path(error_file.path).unlink(missing_ok=True)
        return
    session.add(error_file)
    if before is not None and (old := session.get(File, before)) is not None:
        Path(old.path).unlink(missing_ok=True)
        old.deleted = True


def _stage_and_start(url: str, batch_id: str, tenant_id: str, rows: JobRows, jobs: list[dict], dispatched_at,
                     total: int, invalid: int) -> bool | None:
    """Writes the batch's jobs staged (status ``STAGED``-<this run's mark>) in short transactions of
    ``STAGE_CHUNK`` rows (SQLite's write lock is taken and let go between them, so interactive submissions and
    workers' writes go on), then starts the batch and turns this run's rows queued/dispatched in one transaction:
    all or none of them become runnable. True: started; False: the batch left ``validating`` meanwhile (cancelled,
    or started by another run); None: refused (failed)."""
    mine = stage_mark()
    if not write_staged(url, rows.chunks(STAGE_CHUNK), mine,
                        lambda s: s.scalar(select(Batch.status).where(Batch.id == batch_id)) == "validating"):
        return False  # cancelled while staging: the rest is not written
    status = JobStatus.DISPATCHED.value if dispatched_at is not None else JobStatus.QUEUED.value
    with read_then_write(url) as s:  # one short transaction: no row is written here, only statuses change
        if refused := _over_queue_limit(s, tenant_id, jobs):  # again, in the transaction that starts the batch
            _fail(s, batch_id, errors=[refused], total=total)
            log.info("batch %s refused: %s", batch_id, refused["message"])
            return None
        ok = s.execute(update(Batch).where(Batch.id == batch_id, Batch.status == "validating").values(
            status="in_progress", in_progress_at=utcnow(), total=total, failed=invalid, completed=0,
            model=one_model(jobs))).rowcount == 1
        if ok:  # one statement over the batch_id index (a statement per chunk of ids takes several times as long)
            moved = s.execute(update(Job).where(Job.batch_id == batch_id, Job.status == mine).values(
                status=status)).rowcount
            if moved != len(jobs):  # rolled back with the batch's start: start_batch fails the batch
                raise RuntimeError(f"{len(jobs) - moved} of batch {batch_id}'s {len(jobs)} staged jobs went missing")
    return ok


def _drop_staged(url: str, batch_id: str) -> None:
    """Deletes the batch's staged jobs (any run's) and their events, ``STAGE_CHUNK`` at a time. Call it once the
    batch has left ``validating``: no run can start it then, so whatever is still staged is never to run."""
    while True:
        with read_then_write(url) as s:
            ids = list(s.scalars(select(Job.id).where(Job.batch_id == batch_id, Job.status.startswith(STAGED))
                                 .limit(STAGE_CHUNK)))
            if not ids:
                return
            s.execute(delete(JobEvent).where(JobEvent.job_id.in_(ids)))
            s.execute(delete(Job).where(Job.id.in_(ids)))


def _line_jobs(settings: Settings, principal: Principal, line: batch_lines.ValidLine, batch_id: str, endpoint: str,
               expires_at, context: int) -> list[dict]:
    """A valid line's jobs (their column values: no ORM object a row), due when the batch's window ends. Those of
    a line of several choices are numbered in OpenAI's order (``choice_index``), and usage counts the line's request
    and each prompt once, as online."""
    jobs: list[dict] = []
    for spec in line.specs:
        spec = spec.model_copy(update={"deadline_window_s": None, "deadline_at": expires_at})
        if (line.response or {}).get("truncation") == "auto":  # a Responses line: its oldest turns go if too long
            spec = fit_response(settings, spec, line.response)
        job = job_values(settings, principal, spec, batch_id=batch_id, custom_id=line.custom_id, endpoint=endpoint,
                         response=line.response, context=context)
        jobs.append(job)
    if len(jobs) > 1:
        for i, (job, links) in enumerate(zip(jobs, choice_links([job["id"] for job in jobs], line.n), strict=True)):
            job.update(choice_index=i, **links)
    return jobs


def one_model(jobs: list[dict]) -> str | None:
    """The model every one of a batch's jobs runs on (its Batch object's ``model``), as the fan-out resolved each
    line's; None where they name several (no one model processes the batch: OpenAI's batches have one) or there are
    none."""
    models = {job["model"] for job in jobs}
    return models.pop() if len(models) == 1 else None


def _over_queue_limit(session, tenant_id: str, jobs: list) -> dict | None:
    """The queue limit's error for the first model whose jobs would not fit (app/batch/queue_limit.py)."""
    tokens: dict[str, int] = {}
    for job in jobs:
        tokens[job["model"]] = tokens.get(job["model"], 0) + (job.get("prompt_tokens") or 0)
    return next(filter(None, (queue_limit.refusal(session, tenant_id, m, n) for m, n in tokens.items())), None)


def expires_at_for(created_at, window: str):
    return created_at + timedelta(seconds=parse_window(window))
