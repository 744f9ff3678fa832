"""Fan-in: when every job of a batch is terminal, write its output and error files.

``maybe_finalize`` is idempotent and safe to call from anywhere (API reads of the batch,
the cancel route, the workers' sweeper through ``workers.batch_tasks``): it refreshes
``request_counts``, expires a batch whose window ended, and the one caller that wins the
guarded ``in_progress|cancelling -> finalizing`` update writes the files. Their rows and the
final status commit together; a batch left finalizing by a caller that died is taken over
once ``STALLED_AFTER`` has passed.
"""

from __future__ import annotations

import heapq
import json
import logging
import math
import shutil
import sqlite3
from collections.abc import Callable, Iterable, Iterator
from contextlib import closing, contextmanager
from dataclasses import dataclass
from datetime import timedelta
from itertools import chain, groupby
from pathlib import Path
from typing import Any

from sqlalchemy import and_, case, func, or_, select, update
from sqlalchemy.orm import Session

from app.anthropic_schemas import ENDPOINT as MESSAGES
from app.batch.events import batch_ended
from app.batch.objects import REFUSED_LINE, job_error_line, outran_window, output_line
from app.batch.storage import MESSAGE_BATCH_RESULTS, new_file
from app.db.models import STAGED, Batch, File, Job, JobStatus
from app.db.session import write_after_read, write_guard
from app.services.cancel import stop_job_ids
from app.services.transitions import NOT_TERMINAL, as_utc, utcnow

log = logging.getLogger(__name__)

OPEN = ("in_progress", "cancelling")
ENDED = ("completed", "failed", "expired", "cancelled")
TERMINAL_JOB = [s.value for s in JobStatus if s.terminal]
STALLED_AFTER = timedelta(minutes=5)  # a batch finalizing this long lost the process that wrote its files


def stalled(batch: Batch) -> bool:
    """Whether ``batch`` has been finalizing so long that its writer must have died."""
    return (batch.status == "finalizing" and batch.finalizing_at is not None
            and as_utc(batch.finalizing_at) <= utcnow() - STALLED_AFTER)


def stalled_or_open():  # noqa: ANN201 - a SQL condition
    """Batches ``maybe_finalize`` may still finish: open, or stalled while finalizing."""
    return or_(Batch.status.in_(OPEN),
               and_(Batch.status == "finalizing", Batch.finalizing_at <= utcnow() - STALLED_AFTER))


def working_dirs(data_dir: Path) -> Path:
    """Where every batch's working folder is (``working_dir``)."""
    return Path(data_dir) / "batches"


def working_dir(data_dir: Path, batch_id: str) -> Path:
    """The batch's working files' folder: its refused lines, its valid lines' numbers, its fan-out runs' part files.
    Only its fan-in reads them (its counts, its error file's lines): they go once the batch has ended
    (``drop_working_dir``); its output and error files are Files API files, kept as their expiry says."""
    return working_dirs(data_dir) / batch_id


def drop_working_dir(data_dir: Path, batch_id: str) -> None:
    """Deletes the batch's working folder. Call it once nothing is to read it: the batch has ended, and no fan-out run
    of it is to give its refused lines to an error file (``fanout.start_batch``'s end, for a batch that never
    started). A run still going meanwhile loses its part files, as it does to ``drop_run_parts``."""
    shutil.rmtree(working_dir(data_dir, batch_id), ignore_errors=True)


def invalid_path(data_dir: Path, batch_id: str) -> Path:
    return working_dir(data_dir, batch_id) / "invalid.jsonl"


def _refused_count(data_dir: Path, batch_id: str) -> int:
    """How many lines the validation refused (its invalid.jsonl's lines, counted as read)."""
    path = invalid_path(data_dir, batch_id)
    if not path.exists():
        return 0
    with path.open("rb") as lines:
        return sum(1 for _ in lines)


def refused_lines(data_dir: Path, batch_id: str) -> Iterator[str]:
    """The error lines of the lines the validation refused, in input order, read a line at a time."""
    path = invalid_path(data_dir, batch_id)
    if not path.exists():
        return
    with path.open(encoding="utf-8", newline="\n") as lines:
        for text in lines:
            yield text.removesuffix("\n")


def numbered_refused_lines(data_dir: Path, batch_id: str) -> Iterator[tuple[int, str]]:
    """``refused_lines``, each with its input line number."""
    for text in refused_lines(data_dir, batch_id):
        yield _refused_line_number(text), text


def line_numbers_path(data_dir: Path, batch_id: str) -> Path:
    """Where the fan-out keeps its valid lines' numbers by custom_id, for the files' order: an SQLite table the fan-in
    looks a failed request's up in, one at a time (a 50,000-line batch's, loaded whole, held up to 28 MiB)."""
    return working_dir(data_dir, batch_id) / "lines.sqlite"


def _whole_line_numbers_path(data_dir: Path, batch_id: str) -> Path:
    """Where a batch fanned out before ``line_numbers_path`` kept them, as one JSON object (``{"a": 1, ...}``)."""
    return working_dir(data_dir, batch_id) / "lines.json"


def run_part(path: Path, mark: str) -> Path:
    """The part file one fan-out run (``mark``: its ``stage_mark``) writes ``path`` in before it replaces it: no other
    run's write truncates it."""
    return path.with_name(f"{path.stem}.{mark}.part")


def drop_run_parts(data_dir: Path, batch_id: str) -> None:
    """Deletes every run's part files of the batch (``run_part``, and SQLite's journal beside one): those of runs
    killed before their clean-up (SIGKILL), which no later run removed, and of a run that lost the start to another.
    Call it once the batch has left ``validating``: no run's part is to become the batch's file then."""
    for part in working_dir(data_dir, batch_id).glob(f"*.{STAGED}-*.part*"):
        part.unlink(missing_ok=True)


def keep_line_numbers(data_dir: Path, batch_id: str, numbered: Iterable[tuple[int, str]], mark: str) -> None:
    """The valid lines' ``(number, custom_id)`` written to ``line_numbers_path`` as they come, none held; ``mark``:
    the writing run's, whose part file no other run's write truncates (the last run's is kept)."""
    path = line_numbers_path(data_dir, batch_id)
    part = run_part(path, mark)
    part.unlink(missing_ok=True)
    try:
        with closing(sqlite3.connect(part)) as table, table:
            table.execute("CREATE TABLE line (custom_id TEXT PRIMARY KEY, line_no INTEGER NOT NULL) WITHOUT ROWID")
            table.executemany("INSERT INTO line VALUES (?, ?)", ((cid, line_no) for line_no, cid in numbered))
        part.replace(path)
    finally:
        part.unlink(missing_ok=True)


@contextmanager
def _input_order(data_dir: Path, batch_id: str) -> Iterator[Callable[[str | None], float]]:
    """The input line number of a valid line's custom_id, looked up one at a time (after every line where unknown: a
    batch fanned out before the numbers were kept)."""
    path = line_numbers_path(data_dir, batch_id)
    if not path.exists():
        legacy = _whole_line_numbers_path(data_dir, batch_id)  # a batch fanned out before they were kept in a table
        numbers = json.loads(legacy.read_text()) if legacy.exists() else {}
        yield lambda custom_id: numbers.get(custom_id, math.inf)
        return
    with closing(sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True)) as table:
        def line_number(custom_id: str | None) -> float:
            found = table.execute("SELECT line_no FROM line WHERE custom_id = ?", (custom_id,)).fetchone()
            return math.inf if found is None else found[0]

        yield line_number


def _refused_line_number(text: str) -> int:
    """An invalid.jsonl line's input line number, from its id (``batch_req_line_N``)."""
    return int(json.loads(text)["id"].removeprefix(REFUSED_LINE))


@dataclass(frozen=True)
class Counts:
    """A batch's requests (its valid lines) by where their jobs are: a request of several choices is done when all
    are, and completed only if all succeeded."""

    pending: int = 0
    completed: int = 0
    failed: int = 0


def _number(condition: Any) -> Any:
    """SQL: how many rows meet ``condition``."""
    return func.sum(case((condition, 1), else_=0))


def _of_batch(batch_id: str) -> tuple:
    """SQL: the batch's jobs, less those staged by a fan-out (not its jobs until it starts: app/batch/fanout.py)."""
    return Job.batch_id == batch_id, ~Job.status.startswith(STAGED)


def counts_of(session: Session, batch_ids: Iterable[str]) -> dict[str, Counts]:
    """Each batch's ``Counts``, one grouped query for them all (a page's); a batch without jobs is left out."""
    single = Job.choice_index.is_(None)  # a line's only job: its lines are counted by status, in a handful of groups
    lines = (select(Job.batch_id, single.label("single"), _number(Job.status.not_in(TERMINAL_JOB)).label("open"),
                    _number(Job.status == JobStatus.SUCCEEDED.value).label("ok"), func.count().label("jobs"))
             .where(Job.batch_id.in_(list(batch_ids)), ~Job.status.startswith(STAGED))
             .group_by(Job.batch_id, single, case((single, Job.status), else_=Job.custom_id))
             .subquery())
    c = lines.c
    done = c.open == 0  # a group of single lines counts its jobs (each a request), a line of choices counts once
    rows = session.execute(select(
        c.batch_id,
        func.sum(case((c.single, c.open), else_=case((c.open > 0, 1), else_=0))),
        func.sum(case((c.single, c.ok), else_=case((done & (c.ok == c.jobs), 1), else_=0))),
        func.sum(case((c.single, c.jobs - c.open - c.ok), else_=case((done & (c.ok < c.jobs), 1), else_=0))))
        .group_by(c.batch_id))
    return {batch_id: Counts(*(int(n or 0) for n in sums)) for batch_id, *sums in rows}


def _counts(session: Session, batch_id: str) -> Counts:
    return counts_of(session, [batch_id]).get(batch_id, Counts())


def fan_in_due(batch: Batch, counts: Counts) -> bool:
    """Whether ``maybe_finalize`` has more to do for an open batch than refresh its counts: its jobs all ended, its
    window ended, or it is cancelling (jobs a cancel that died left runnable)."""
    window_over = batch.expires_at is not None and as_utc(batch.expires_at) <= utcnow()
    return not counts.pending or window_over or batch.status == "cancelling"


FAN_IN_CHUNK = 100  # jobs read from SQL at a time: their answers are what a fan-in holds of its output file


def requests(session: Session, batch_id: str, *where: Any) -> Iterator[list[Job]]:
    """The batch's requests, read ``FAN_IN_CHUNK`` jobs at a time: a line's jobs together, in the order of its first
    job (by ``created_at``, then id), its choices in order; ``where``: only those of its jobs (the order is still all
    of them's)."""
    ranked = (select(Job.id, Job.custom_id, func.row_number().over(order_by=(Job.created_at, Job.id)).label("at"))
              .where(*_of_batch(batch_id)).subquery())
    lines = select(ranked.c.id, ranked.c.at,
                   func.min(ranked.c.at).over(partition_by=ranked.c.custom_id).label("first")).subquery()
    jobs = (select(Job).join(lines, lines.c.id == Job.id).where(*where)
            .order_by(lines.c.first, func.coalesce(Job.choice_index, 0), lines.c.at))
    with closing(session.scalars(jobs.execution_options(yield_per=FAN_IN_CHUNK))) as rows:
        for _, line in groupby(rows, key=lambda job: job.custom_id):
            yield list(line)


def _output_lines(session: Session, batch_id: str) -> Iterator[str]:
    """The output file's lines: the requests whose jobs all succeeded (a request of several choices answers whole)."""
    for line in requests(session, batch_id):
        if all(job.status == JobStatus.SUCCEEDED for job in line):
            yield json.dumps(output_line(line))


def _error_lines(session: Session, data_dir: Path, batch: Batch) -> Iterator[str]:
    """The error file's lines in input order, as read beside it: the refused lines (by line number) and the requests
    that failed (in their jobs' order, as the output file's), each with its first failed choice, merged as they are
    read (only failed jobs are read: no answer is)."""
    with _input_order(data_dir, batch.id) as line_number:
        refused = numbered_refused_lines(data_dir, batch.id)
        failed = ((line_number(line[0].custom_id), json.dumps(job_error_line(line[0], batch.expires_at)))
                  for line in requests(session, batch.id, Job.status != JobStatus.SUCCEEDED.value))
        for _, text in heapq.merge(refused, failed, key=lambda pair: pair[0]):  # a tie: the refused line first
            yield text


def _outran_window(session: Session, batch: Batch) -> bool:
    """Whether one of the batch's jobs was stopped by its window (``objects.outran_window``)."""
    expired = select(Job).where(*_of_batch(batch.id), Job.status == JobStatus.EXPIRED.value)
    with closing(session.scalars(expired.execution_options(yield_per=FAN_IN_CHUNK))) as jobs:
        return any(outran_window(job, batch.expires_at) for job in jobs)


def result_files(session: Session, data_dir: Path, batch: Batch) -> dict[str, File]:
    """The batch's output and error files (their contents written a line at a time; their rows the caller's to add)
    by the batch's column that names each, less one that would be empty."""
    made = ((key, result_file(data_dir, batch, name, lines))
            for key, name, lines in (("output_file_id", "output", _output_lines(session, batch.id)),
                                     ("error_file_id", "error", _error_lines(session, data_dir, batch))))
    return {key: row for key, row in made if row is not None}


def stop_jobs(session: Session, batch_id: str, to: JobStatus, detail: str, redis_url: str | None) -> int:
    """Moves every non-terminal job of the batch to ``to`` (cancelled/expired); running ones are aborted."""
    ids = list(session.scalars(select(Job.id).where(Job.batch_id == batch_id,
                                                    Job.status.in_([s.value for s in NOT_TERMINAL]))))
    return stop_job_ids(session, ids, to, detail, redis_url)


def result_file(data_dir: Path, batch: Batch, name: str, lines: Iterable[str]) -> File | None:
    """The batch's ``output`` or ``error`` file of ``lines``, written as they come (its row the caller's to add);
    None, and no file, where there are none."""
    lines = iter(lines)
    if (first := next(lines, None)) is None:
        return None
    lives = timedelta(seconds=batch.output_expires_after_s) if batch.output_expires_after_s else None
    purpose = MESSAGE_BATCH_RESULTS if batch.endpoint == MESSAGES else "batch_output"
    return new_file(data_dir, batch.tenant_id, f"{batch.id}_{name}.jsonl", purpose,
                    ((line + "\n").encode() for line in chain([first], lines)), lives)


def _cancelled_unstarted(batch: Batch) -> bool:
    """Whether ``batch`` is an OpenAI batch cancelled while validating (a message batch's total is its create's)."""
    return batch.cancelling_at is not None and batch.in_progress_at is None and batch.endpoint != MESSAGES


def maybe_finalize(session: Session, batch_id: str, data_dir: Path | None = None,
                   redis_url: str | None = None) -> bool:
    """True if this call finalized the batch (wrote its files and set its final status)."""
    if data_dir is None or redis_url is None:
        from app.settings import get_settings

        data_dir = data_dir or get_settings().data_dir
        redis_url = redis_url or get_settings().redis_url
    batch = session.get(Batch, batch_id, populate_existing=True)
    if batch is None or (batch.status not in OPEN and not stalled(batch)):
        return False
    cancelled = batch.cancelling_at is not None  # cancelling, or finalizing after it
    counts = _counts(session, batch_id)
    window_over = not cancelled and batch.expires_at is not None and as_utc(batch.expires_at) <= utcnow()
    if counts.pending and window_over:
        stop_jobs(session, batch_id, JobStatus.EXPIRED, "the batch's completion window ended", redis_url)
        counts = _counts(session, batch_id)
    elif counts.pending and batch.status == "cancelling":
        # a cancel stops the jobs a chunk a transaction (stop_job_ids): one that died partway left the rest runnable,
        # and the sweeper's call here stops them (a live cancel's remaining chunks find them ended: guarded updates)
        stop_jobs(session, batch_id, JobStatus.CANCELLED, "cancelled with its batch", redis_url)
        counts = _counts(session, batch_id)
    completed, failed = counts.completed, _refused_count(data_dir, batch_id) + counts.failed
    session.commit()
    if counts.pending:
        if (completed, failed) != (batch.completed, batch.failed):
            with write_guard(session):
                # counts read before another caller's newer ones, or its fan-in, are not written over them: a
                # request's end is final, so an open batch's counts only grow
                session.execute(update(Batch).where(
                    Batch.id == batch_id, Batch.status.in_(OPEN), Batch.completed <= completed,
                    Batch.failed <= failed).values(completed=completed, failed=failed))
                session.commit()
        return False
    mine = utcnow()  # this caller's finalizing, as the batch row holds it
    # an OpenAI batch cancelled before it started counts what it ended: its total was its validation's to write
    # (fanout._end_cancelled, later, writes its lines' over these), and one whose validation died wrote none
    unstarted = {"total": completed + failed} if _cancelled_unstarted(batch) else {}
    with write_guard(session):  # one caller wins; a stalled finalizing is taken over by one caller too
        won = session.execute(update(Batch).where(
            Batch.id == batch_id, Batch.status == batch.status, Batch.finalizing_at == batch.finalizing_at).values(
            status="finalizing", finalizing_at=mine, completed=completed, failed=failed, **unstarted)).rowcount == 1
        session.commit()
    if not won:
        return False
    # expired where the window stopped a job, judged from the jobs, not from whether this call stopped them (a
    # concurrent caller, the worker's sweeper or another poll, may have expired them between our reads), and as
    # their error lines say: a job the scheduler gave up on inside the window is the server's failure, not the window's
    expired = window_over and _outran_window(session, batch)
    files = result_files(session, data_dir, batch)
    # an error file the validation gave a batch cancelled while validating, while this finalized it, is kept: it knows
    # the lines this one may have read before they were written (fanout._end_cancelled)
    values: dict = {key: func.coalesce(getattr(Batch, key), row.id) if key == "error_file_id" else row.id
                    for key, row in files.items()}
    now = utcnow()
    # finalizing was this caller's lock on the files; a batch that ends cancelled or expired never went through
    # OpenAI's finalizing (in_progress -> finalizing -> completed), whose finalizing_at it then leaves null
    if cancelled:
        values.update(status="cancelled", cancelled_at=now, finalizing_at=None)
    elif expired:
        values.update(status="expired", expired_at=now, finalizing_at=None)
    else:
        values.update(status="completed", completed_at=now)
    # the files and the final status in one transaction: a finalize that dies before it leaves the batch
    # finalizing, for a later caller to take over once stalled; one taken over meanwhile writes nothing
    with write_after_read(session):
        given = session.execute(update(Batch).where(
            Batch.id == batch_id, Batch.status == "finalizing", Batch.finalizing_at == mine).values(**values)
            .returning(Batch.output_file_id, Batch.error_file_id)).first()
        still_mine = given is not None
        if still_mine:
            kept = {row.id for row in files.values() if row.id in given}
            for row in files.values():
                if row.id in kept:
                    session.add(row)
                else:
                    Path(row.path).unlink(missing_ok=True)
            # with the status, or not at all
            batch_ended(session, batch.tenant_id, batch.endpoint, values["status"], batch_id)
        session.commit()
    if not still_mine:
        for row in files.values():
            Path(row.path).unlink(missing_ok=True)
        log.warning("batch %s: another caller took its finalizing over", batch_id)
        return False
    if batch.in_progress_at is not None:
        # its files are written: nothing reads its working ones again. One cancelled before it started keeps them for
        # its fan-out run, which may still be reading its lines to give their error lines (fanout._end_cancelled)
        # and deletes them at its end
        drop_working_dir(data_dir, batch_id)
    log.info("batch %s %s: %d completed, %d failed", batch_id, values["status"], completed, failed)
    return True


def fan_in_page(session: Session, batches: list[Batch], data_dir: Path, redis_url: str | None) -> dict[str, Counts]:
    """A listed page's fan-in: its open batches' requests counted in one grouped query, and ``maybe_finalize`` run
    (each batch ``refresh``-ed) only for those it has more to do for (``fan_in_due``), so a page of running batches
    is read, not written one by one; the sweeper's ``finalize_open_batches`` writes their counts. Returns the counts
    of the batches still open, by id."""
    open_ = [b for b in batches if b.status in OPEN]
    counts = counts_of(session, [b.id for b in open_]) if open_ else {}
    for b in open_:
        if fan_in_due(b, counts.get(b.id, Counts())):
            maybe_finalize(session, b.id, data_dir, redis_url)
            session.refresh(b)
    return {b.id: counts.get(b.id, Counts()) for b in open_ if b.status in OPEN}


def cancel_batch(session: Session, batch: Batch, data_dir: Path, redis_url: str | None) -> bool:
    """validating|in_progress -> cancelling; pending jobs cancelled, running ones aborted; then fan-in. False where
    the batch was ending or had ended on its own before the cancel's update (it then changes nothing): a batch whose
    completion window ended before the cancel came is expired by it, as a poll would have (OpenAI cancels a batch in
    progress; one past its window is expired). ``batch`` is refreshed either way."""
    now = utcnow()
    window_open = or_(Batch.expires_at.is_(None), Batch.expires_at > now)
    with write_after_read(session):
        took = session.execute(update(Batch).where(
            Batch.id == batch.id, or_(Batch.status == "validating", and_(Batch.status == "in_progress", window_open)))
            .values(status="cancelling", cancelling_at=now)
            .execution_options(synchronize_session=False)).rowcount == 1  # refreshed below (SQLite's naive times)
        session.commit()
    session.refresh(batch)
    if not took and batch.status == "in_progress":  # its window ended before the cancel, unseen until now
        maybe_finalize(session, batch.id, data_dir, redis_url)
        session.refresh(batch)
        return False
    if not took and batch.status != "cancelling":  # cancelling already: this is a repeat that helps it on
        return False
    stop_jobs(session, batch.id, JobStatus.CANCELLED, "cancelled with its batch", redis_url)
    maybe_finalize(session, batch.id, data_dir, redis_url)
    session.refresh(batch)
    return True
