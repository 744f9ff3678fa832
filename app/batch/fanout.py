"""Fan-out: a validated input file becomes batch-class jobs: one per valid line, or one per choice of a line
of several (``n``, or several prompts).

Every job's TTLT deadline is the batch's ``expires_at`` (created_at + completion_window).
Invalid lines are kept in ``data_dir/batches/<id>/invalid.jsonl`` for the error file, written as they are read.
"""

from __future__ import annotations

import heapq
import json
import logging
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager, nullcontext
from datetime import timedelta
from pathlib import Path
from typing import TextIO

from sqlalchemy import delete, select, update

from app.anthropic_schemas import ENDPOINT as MESSAGES
from app.auth import Principal
from app.gc_pause import full_collections_paused
from app.batch import lines as batch_lines
from app.batch import queue_limit
from app.batch.events import batch_ended
from app.batch.finalize import (ENDED, cancel_batch, drop_run_parts, drop_working_dir, invalid_path,
                                keep_line_numbers, maybe_finalize, numbered_refused_lines, result_file, run_part,
                                working_dir)
from app.batch.objects import invalid_line, unrun_line
from app.batch.storage import open_content
from app.db.models import STAGED, Batch, File, Job, JobEvent, JobStatus
from app.db.session import read_then_write, session_scope, write_after_read, write_guard
from app.openai_schemas import OpenAIError, openai_param, parse_window
from app.responses_schemas import in_responses_terms
from app.services.dispatch import Sendable, send_dispatched
from app.services.job_writer import JobRows, stage_mark, write_staged
from app.services.jobs import JobValidationError, choice_links, job_values
from app.services.transitions import as_utc, utcnow
from app.services.truncation import fit_response
from app.services.workers import grammar_backends, held_context_length
from app.settings import Settings

try:
    import fcntl
except ImportError:  # not POSIX: no liveness mark (fan_out_alive says alive, as a cancel assumed before)
    fcntl = None  # type: ignore[assignment]

log = logging.getLogger(__name__)

# rows per transaction while a batch's jobs are written: SQLite's one write lock is held for one chunk at a time
STAGE_CHUNK = 1000


def batch_dir(data_dir: Path, batch_id: str) -> Path:
    path = working_dir(data_dir, batch_id)
    path.mkdir(parents=True, exist_ok=True)
    return path


def start_batch(settings: Settings, batch_id: str, parsed: batch_lines.ParsedFile | None = None) -> None:
    """Validates the batch's input file and creates + dispatches its jobs (a background task). ``parsed``: the
    file's lines as ``batch_lines.parse_file`` reads them, where the caller has them already (a message batch's
    create checked each request so): the file is not read and parsed again. The run holds the batch's liveness mark
    (``fan_out_alive``) to its end."""
    with _alive(settings.data_dir, batch_id) as last_alive:
        _run(settings, batch_id, parsed, last_alive)


def _run(settings: Settings, batch_id: str, parsed: batch_lines.ParsedFile | None,
         last_alive: Callable[[], bool]) -> None:
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
    # (this run's rest, or what a run that died or lost the start to this one left), and so are the runs' part files
    try:
        _drop_staged(settings.sqlalchemy_url, batch_id)
    except Exception:  # left staged, they stay invisible and never run
        log.exception("could not delete batch %s's staged jobs", batch_id)
    drop_run_parts(settings.data_dir, batch_id)
    with session_scope(settings.sqlalchemy_url) as s:
        batch = s.get(Batch, batch_id)
        done = batch is None or _run_is_last_reader(batch)
    # another run still going reads the folder yet (a cancelled batch's refused lines, for its error file): the last
    # run to end deletes it
    if done and last_alive():
        drop_working_dir(settings.data_dir, batch_id)


def _run_is_last_reader(batch: Batch) -> bool:
    """Whether a fan-out run that has ended was the last to read the batch's working folder: the batch has ended, or
    left validating without starting (refused, or cancelled: the run gave the error file its refused lines), so no
    fan-in is to read it. A batch that started keeps it for its fan-in, which deletes it (``maybe_finalize``)."""
    return batch.status in ENDED or (batch.status != "validating" and batch.in_progress_at is None)


def _liveness_path(data_dir: Path, batch_id: str) -> Path:
    return batch_dir(data_dir, batch_id) / "fanout.lock"


@contextmanager
def _alive(data_dir: Path, batch_id: str) -> Iterator[Callable[[], bool]]:
    """This run's liveness mark: a shared flock of the batch's ``fanout.lock``, held while the run lasts (runs beside
    each other hold it together). The kernel lets it go however the process ends, SIGKILL too: a run that holds
    none is dead. Yields ``last_alive``, for the run's end: whether no other run holds the mark (this one then holds
    it alone, exclusively, to its end; otherwise it holds none: its work is done)."""
    if fcntl is None:
        yield lambda: True
        return
    with _liveness_path(data_dir, batch_id).open("a") as mark:
        fcntl.flock(mark, fcntl.LOCK_SH)

        def last_alive() -> bool:
            fcntl.flock(mark, fcntl.LOCK_UN)
            try:
                fcntl.flock(mark, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return False
            return True

        yield last_alive


def fan_out_alive(data_dir: Path, batch_id: str) -> bool:
    """Whether a run of the batch's fan-out is going (holds its liveness mark, ``_alive``); True where it cannot be
    known (no flock)."""
    if fcntl is None:
        return True
    with _liveness_path(data_dir, batch_id).open("a") as mark:
        try:
            fcntl.flock(mark, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
    return False  # the file closed: the lock this check took is let go


def cancel_and_count(session, settings: Settings, batch: Batch, later: Callable[..., None]) -> bool:
    """``finalize.cancel_batch`` (its answer), and for a batch cancelled while validating ``count_if_abandoned``
    handed to ``later`` (a route's ``BackgroundTasks.add_task``: it may read the whole input file)."""
    if not cancel_batch(session, batch, settings.data_dir, settings.redis_url):
        return False
    if batch.in_progress_at is None:
        later(count_if_abandoned, settings, batch.id)
    return True


def count_if_abandoned(settings: Settings, batch_id: str) -> bool:
    """After a cancel of a batch that was validating (a background task of the cancel, and the workers' sweeper's
    ``count_abandoned_cancels`` where the API died before that task ran). A fan-out that sees the cancel counts the
    batch's lines, writes its error file and deletes what its runs staged (``_end_cancelled``, ``start_batch``); one
    that died (killed) before it did, ``fan_out_alive`` false, leaves that to nobody (the sweeper restarts only
    batches still validating): the batch would end with no line counted, the dead run's staged jobs and part files
    kept for good. This runs the fan-out here: the batch cancelled, it stages nothing and counts the lines. A batch
    that started before the cancel is not touched (its counts are its jobs'). Returns whether it ran the fan-out."""
    with session_scope(settings.sqlalchemy_url) as s:
        batch = s.get(Batch, batch_id)
        unstarted = batch is not None and batch.cancelling_at is not None and batch.in_progress_at is None
        never_read = unstarted and _never_read(batch)
    # its folder gone: the run that saw the cancel counted the lines and, the last to read them, deleted it; or no
    # run ever made it (the create's API died before its fan-out): nothing counted them
    folder = working_dir(settings.data_dir, batch_id).exists()
    if not unstarted or not (folder or never_read) or fan_out_alive(settings.data_dir, batch_id):
        return False
    log.info("batch %s: cancelled while validating, and no fan-out is alive to count its lines; counting them here",
             batch_id)
    start_batch(settings, batch_id)
    return True


def _never_read(batch: Batch) -> bool:
    """Whether no fan-out run has read the lines of an OpenAI batch cancelled while validating: none counted them
    (``total`` 0) nor refused its file (``errors``). A message batch's total is its create's: its lines are
    counted."""
    return batch.endpoint != MESSAGES and not batch.total and not batch.errors


def _fail(session, batch_id: str, **values) -> None:
    """validating -> failed, and the batch.failed event with it (the caller commits)."""
    row = session.execute(update(Batch).where(Batch.id == batch_id, Batch.status == "validating").values(
        status="failed", failed_at=utcnow(), **values).returning(Batch.tenant_id, Batch.endpoint)).first()
    if row is not None:
        batch_ended(session, row.tenant_id, row.endpoint, "failed", batch_id)
    else:  # an OpenAI batch cancelled while validating stays cancelled, its errors saying why its file was refused
        session.execute(update(Batch).where(Batch.id == batch_id, Batch.cancelling_at.is_not(None),
                                            Batch.in_progress_at.is_(None), Batch.endpoint != MESSAGES).values(
            errors=values["errors"]))


def _start(settings: Settings, batch_id: str, parsed: batch_lines.ParsedFile | None) -> None:
    mine = stage_mark()
    # this run's refused lines, written as read; invalid.jsonl once the batch is to start (another run of the batch,
    # one that died or runs beside this one, writes its own: neither truncates the other's)
    part = run_part(invalid_path(settings.data_dir, batch_id), mine)
    try:
        _fan_out(settings, batch_id, parsed, mine, part)
    finally:
        part.unlink(missing_ok=True)


def _fan_out(settings: Settings, batch_id: str, parsed: batch_lines.ParsedFile | None, mine: str,
             part: Path) -> None:
    url = settings.sqlalchemy_url
    with session_scope(url) as s:
        batch = s.get(Batch, batch_id)
        try:  # read a line at a time: never held whole (200 MB, OpenAI's limit)
            handle = open_content(s.get(File, batch.input_file_id)) if parsed is None else None
        except FileNotFoundError:  # deleted before it was read
            with write_after_read(s):
                _fail(s, batch_id, errors=[{"code": "invalid_file", "line": None, "param": "input_file_id",
                                            "message": f"the input file {batch.input_file_id} was deleted before "
                                                       "its lines were read"}])
            return
        endpoint, tier, tenant_id, key_id = batch.endpoint, batch.tier, batch.tenant_id, batch.api_key_id
        expires_at, window_s = as_utc(batch.expires_at), parse_window(batch.completion_window)
    with handle if handle is not None else nullcontext():
        if refused := (batch_lines.file_refusal(handle) if handle is not None else None):
            _fail_validation(url, batch_id, [refused], 0)
            return
        batch_dir(settings.data_dir, batch_id)
        with part.open("w", encoding="utf-8", newline="\n") as refused_to:  # this run's: see _start
            # the backends the workers compile structured outputs with, read once as the batch starts (as its context)
            lines = (batch_lines.parse_lines(handle, endpoint, window_s, settings.tiers, settings.model,
                                             settings.engine_backend, grammar_backends(settings))
                     if handle is not None
                     else heapq.merge(parsed.valid, parsed.invalid, key=lambda line: line.line_no))
            principal = Principal(key_id=key_id or "", tenant_id=tenant_id, tier=tier, is_admin=False)
            # the context the batch's jobs are held to, as the workers were read at its start (one read, not one a line)
            fan = FanOut(settings, principal, batch_id, endpoint, expires_at, held_context_length(settings), refused_to)
            dispatched_at = utcnow() if settings.redis_url else None
            chunks = fan.job_rows(lines, dispatched_at)
            staged = write_staged(url, chunks, mine, lambda s: s.scalar(
                select(Batch.status).where(Batch.id == batch_id)) == "validating")
            fan.count(lines)  # cancelled while staging: the rest is not written, but each line is still counted
    file_errors = (parsed.file_errors if parsed is not None else []) + fan.duplicate_errors()
    if file_errors:
        _fail_validation(url, batch_id, file_errors, fan.total)
        return
    try:
        part.replace(invalid_path(settings.data_dir, batch_id))  # written as read, in input order
        keep_line_numbers(settings.data_dir, batch_id, fan.requested, mine)  # the error file's lines in input order
    except FileNotFoundError:  # another run ended the validation meanwhile and deleted every run's parts: it lost
        log.info("batch %s: another run of its fan-out ended its validation first", batch_id)
        return
    ok = staged and _start_staged(url, batch_id, tenant_id, mine, fan, dispatched_at, fan.refused)
    if ok is None:
        return
    if not ok:
        unrun = [] if endpoint == MESSAGES else fan.requested  # a message batch's are in neither (_end_cancelled)
        failed = heapq.merge(numbered_refused_lines(settings.data_dir, batch_id),
                             ((line_no, json.dumps(unrun_line(line_no, cid))) for line_no, cid in unrun),
                             key=lambda pair: pair[0])
        _end_cancelled(settings, batch_id, fan.total, fan.refused + len(unrun), (text for _, text in failed))
        return
    log.info("batch %s: %d jobs, %d invalid lines", batch_id, len(fan.sendables), fan.refused)
    for at in range(0, len(fan.sendables), STAGE_CHUNK):  # a send's messages are built whole: a chunk's at a time
        send_dispatched(settings, fan.sendables[at:at + STAGE_CHUNK])
    if not fan.sendables:
        with session_scope(url) as s:
            maybe_finalize(s, batch_id, settings.data_dir)


def _fail_validation(url: str, batch_id: str, errors: list[dict], total: int) -> None:
    with session_scope(url) as s, write_guard(s):
        _fail(s, batch_id, errors=errors, total=total)
    log.info("batch %s failed validation: %s", batch_id, errors)


class FanOut:
    """A batch's lines as they are read, in order: the valid ones' jobs built and handed on ``STAGE_CHUNK`` at a
    time (none held after it is written), its invalid lines' error lines written to ``refused_to`` (none held:
    their messages may be long), and what the batch's start needs of all of them kept: how many were refused, the
    valid ones' numbers, each model's prompt tokens (the queue limit), what is sent of each job."""

    def __init__(self, settings: Settings, principal: Principal, batch_id: str, endpoint: str, expires_at,
                 context: int, refused_to: TextIO) -> None:
        self.settings, self.principal, self.batch_id, self.endpoint = settings, principal, batch_id, endpoint
        self.expires_at, self.context, self.refused_to = expires_at, context, refused_to
        self.refused = 0  # the invalid lines written to ``refused_to``
        self.requested: list[tuple[int, str]] = []  # the valid lines that became jobs: a cancel stops them unrun
        self.custom_ids: list[tuple[str | None, int]] = []  # every line's, in order (duplicates fail the file)
        self.tokens: dict[str, int] = {}  # each model's jobs' prompt tokens
        self.sendables: list[Sendable] = []
        self.total = 0

    def job_rows(self, lines: Iterable[batch_lines.ValidLine | batch_lines.InvalidLine],
                 dispatched_at) -> Iterator[JobRows]:
        jobs: list[dict] = []
        for line in lines:
            self._read(line)
            if isinstance(line, batch_lines.ValidLine):
                jobs += self._jobs(line)
            else:
                self._refuse(line)
            if len(jobs) >= STAGE_CHUNK:
                yield JobRows.of([(job, f"batch {self.batch_id}") for job in jobs], dispatched_at)
                jobs = []
        if jobs:
            yield JobRows.of([(job, f"batch {self.batch_id}") for job in jobs], dispatched_at)

    def count(self, lines: Iterable[batch_lines.ValidLine | batch_lines.InvalidLine]) -> None:
        """The rest of the lines of a batch cancelled while it fanned out, counted as read: each refused, or a valid
        one stopped unrun (its jobs are not built: none is to be written)."""
        for line in lines:
            self._read(line)
            if isinstance(line, batch_lines.ValidLine):
                self.requested.append((line.line_no, line.custom_id))
            else:
                self._refuse(line)

    def _read(self, line: batch_lines.ValidLine | batch_lines.InvalidLine) -> None:
        self.total += 1
        self.custom_ids.append((line.custom_id, line.line_no))

    def _refuse(self, line: batch_lines.InvalidLine) -> None:
        """``line``'s error line written as it is read (so in input order), and counted."""
        self.refused_to.write(json.dumps(invalid_line(line.line_no, line.custom_id, line.code, line.message)) + "\n")
        self.refused += 1

    def _jobs(self, line: batch_lines.ValidLine) -> list[dict]:
        try:
            jobs = _line_jobs(self.settings, self.principal, line, self.batch_id, self.endpoint, self.expires_at,
                              self.context)
        except JobValidationError as exc:  # an over-long message batch request in Anthropic's words, as its create
            why = exc.overflow.anthropic_message() if exc.overflow and self.endpoint == MESSAGES else str(exc)
            if self.endpoint == "/v1/responses":  # in POST /v1/responses's terms, as its route refuses the job
                why = in_responses_terms(OpenAIError(400, why, param=openai_param(exc.param))).message
            self._refuse(batch_lines.InvalidLine(line.line_no, line.custom_id, f"line {line.line_no}: {why}",
                                                 "invalid_body"))
            return []
        self.requested.append((line.line_no, line.custom_id))
        for job in jobs:
            self.tokens[job["model"]] = self.tokens.get(job["model"], 0) + (job.get("prompt_tokens") or 0)
            self.sendables.append(Sendable.of(job))
        return jobs

    def duplicate_errors(self) -> list[dict]:
        return batch_lines.duplicate_errors(self.custom_ids)

    def one_model(self) -> str | None:
        """The model every one of the batch's jobs runs on (its Batch object's ``model``), as the fan-out resolved
        each line's; None where they name several (no one model processes the batch: OpenAI's batches have one) or
        there are none."""
        return next(iter(self.tokens)) if len(self.tokens) == 1 else None


def _end_cancelled(settings: Settings, batch_id: str, total: int, failed: int, lines: Iterable[str]) -> None:
    """A batch cancelled while validating ran no request: this ends it cancelled, with its event, unless the cancel's
    fan-in did (maybe before its lines were read: it then knew none of them) or is finalizing it now, and either way
    it counts its lines (``total``, ``failed`` of them: refused, or an OpenAI batch's stopped unrun) and gives
    ``lines`` (their error lines, written as they come) as its error file in place of any that fan-in wrote. A
    message batch's unrun requests are in neither: its counts and results type them ``canceled``."""
    with session_scope(settings.sqlalchemy_url) as s, write_guard(s):
        batch = s.get(Batch, batch_id)
        # not started meanwhile; a finalizing cancel's fan-in writes no counts after it took the batch
        stopped = (Batch.id == batch_id, Batch.status.in_(("cancelling", "cancelled", "finalizing")),
                   Batch.cancelling_at.is_not(None))
        s.execute(update(Batch).where(*stopped).values(total=total, failed=failed))
        if failed:
            _replace_error_file(s, settings, batch, stopped, lines)
        if s.execute(update(Batch).where(Batch.id == batch_id, Batch.status == "cancelling").values(
                status="cancelled", cancelled_at=utcnow())).rowcount:
            batch_ended(s, batch.tenant_id, batch.endpoint, "cancelled", batch_id)


def _replace_error_file(session, settings: Settings, batch: Batch, stopped: tuple, lines: Iterable[str]) -> None:
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


def _start_staged(url: str, batch_id: str, tenant_id: str, mine: str, fan: FanOut, dispatched_at,
                  invalid: int) -> bool | None:
    """Starts the batch whose jobs were written staged (status ``STAGED``-<this run's mark>, in short transactions
    of ``STAGE_CHUNK`` rows: SQLite's write lock is taken and let go between them, so interactive submissions and
    workers' writes go on) and turns this run's rows queued/dispatched in one transaction: all or none of them become
    runnable. True: started; False: the batch left ``validating`` meanwhile (cancelled, or started by another run);
    None: refused (failed: over its tenant's queue limit)."""
    status = JobStatus.DISPATCHED.value if dispatched_at is not None else JobStatus.QUEUED.value
    with read_then_write(url) as s:  # one short transaction: no row is written here, only statuses change
        if refused := _over_queue_limit(s, tenant_id, fan.tokens):
            if s.scalar(select(Batch.status).where(Batch.id == batch_id)) != "validating":
                return False  # cancelled meanwhile: its lines are counted as a cancelled batch's, not refused
            _fail(s, batch_id, errors=[refused], total=fan.total)
            log.info("batch %s refused: %s", batch_id, refused["message"])
            return None
        ok = s.execute(update(Batch).where(Batch.id == batch_id, Batch.status == "validating").values(
            status="in_progress", in_progress_at=utcnow(), total=fan.total, failed=invalid, completed=0,
            model=fan.one_model())).rowcount == 1
        if ok:  # one statement over the batch_id index (a statement per chunk of ids takes several times as long)
            moved = s.execute(update(Job).where(Job.batch_id == batch_id, Job.status == mine).values(
                status=status)).rowcount
            jobs = len(fan.sendables)
            if moved != jobs:  # rolled back with the batch's start: start_batch fails the batch
                raise RuntimeError(f"{jobs - moved} of batch {batch_id}'s {jobs} staged jobs went missing")
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


def _over_queue_limit(session, tenant_id: str, tokens: dict[str, int]) -> dict | None:
    """The queue limit's error for the first model whose jobs (``tokens``: their prompt tokens) would not fit
    (app/batch/queue_limit.py)."""
    return next(filter(None, (queue_limit.refusal(session, tenant_id, m, n) for m, n in tokens.items())), None)


def expires_at_for(created_at, window: str):
    return created_at + timedelta(seconds=parse_window(window))
