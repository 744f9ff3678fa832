"""Anthropic's Message Batches in coserve's batch terms, and back.

A message batch is a ``Batch`` of endpoint ``/v1/messages``: its requests are kept as an input file of OpenAI
batch lines (``custom_id``, ``url``, ``body``: the request's ``params``), so the one fan-out, the batch-tier jobs
with the window's deadline, cancel and finalize run it. What the client sees is Anthropic's: the
``message_batch`` object (``message_batch``) and each request's result (``results``), read from the output and
error files finalize wrote.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Iterator
from typing import Any, BinaryIO

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from app.anthropic_schemas import ENDPOINT, error_body
from app.batch.objects import GIVEN_UP_IN_WINDOW, REFUSED_LINE, stopped_code
from app.db.models import Batch, Job, JobStatus
from app.services.transitions import as_utc

ID_PREFIX = "msgbatch"
WINDOW = "24h"  # docs.anthropic.com/en/docs/build-with-claude/batch-processing: a batch expires after 24 hours
ENDED = ("completed", "failed", "expired", "cancelled")
# an error-file code -> the result type of a request that did not succeed (any other code: errored)
RESULT_OF_CODE = {"batch_cancelled": "canceled", "batch_expired": "expired"}
LINE_PREFIX = re.compile(r"^line \d+: ")  # a refusal's message names its input line; a result names its custom_id


def input_line(custom_id: str, params: dict[str, Any]) -> bytes:
    """A request of the batch as its line of the input file the fan-out reads."""
    return (json.dumps({"custom_id": custom_id, "method": "POST", "url": ENDPOINT, "body": params}) + "\n").encode()


def input_lines(requests: Iterable[tuple[str, dict[str, Any]]]) -> Iterator[bytes]:
    """The batch's requests (custom_id, params) as the input file's lines, one at a time: ``storage.new_file``
    writes each as it comes, so the file (MBs for a batch of many requests) is never held whole."""
    return (input_line(cid, params) for cid, params in requests)


def processing_status(b: Batch) -> str:
    """Anthropic's ``processing_status`` of a batch's status: a finalizing batch is still in progress (its results
    are being written), or canceling when a cancel started it."""
    if b.status in ENDED:
        return "ended"
    return "canceling" if b.cancelling_at is not None else "in_progress"


def ended_at(b: Batch):  # noqa: ANN201 - a datetime or None
    return b.completed_at or b.cancelled_at or b.expired_at or b.failed_at


def request_counts(session: Session, b: Batch) -> dict[str, int]:
    """Anthropic's counts: every request processing until the batch ends, then each by its result (their sum is
    always the batch's requests)."""
    return page_request_counts(session, [b])[b.id]


def page_request_counts(session: Session, batches: list[Batch]) -> dict[str, dict[str, int]]:
    """``request_counts`` of each batch of a page, by id: the ended ones' stopped jobs counted in one grouped query
    (not one a batch), each by the result its error line gives it (``stopped_result``)."""
    ended = [b.id for b in batches if processing_status(b) == "ended"]
    stopped: dict[str, dict[str, int]] = {}
    if ended:
        for batch_id, status, in_window, n in session.execute(
                select(Job.batch_id, Job.status, GIVEN_UP_IN_WINDOW, func.count()).join(Batch, Batch.id == Job.batch_id)
                .where(Job.batch_id.in_(ended), Job.status.in_((JobStatus.CANCELLED.value, JobStatus.EXPIRED.value)))
                .group_by(Job.batch_id, Job.status, GIVEN_UP_IN_WINDOW)):
            kinds = stopped.setdefault(batch_id, {})
            kind = stopped_result(status, bool(in_window))
            kinds[kind] = kinds.get(kind, 0) + n
    return {b.id: _counts(b, stopped.get(b.id, {})) for b in batches}


def stopped_result(status: str, given_up_in_window: bool) -> str:
    """The result type of a request whose job a cancel or an expiry stopped: its error line's code's
    (``result_of_error``), so the counts say what the results say."""
    return RESULT_OF_CODE.get(stopped_code(status, given_up_in_window), "errored")


def _counts(b: Batch, stopped: dict[str, int]) -> dict[str, int]:
    """``stopped``: the ended batch's stopped requests by result type (canceled, expired; errored: counted below)."""
    counts = {"processing": 0, "succeeded": 0, "errored": 0, "canceled": 0, "expired": 0}
    if processing_status(b) != "ended":
        return counts | {"processing": b.total}
    counts |= {"succeeded": b.completed, "canceled": stopped.get("canceled", 0), "expired": stopped.get("expired", 0)}
    # requests the batch ended without (no job, no error-file line): cancelled before its fan-out, or failed
    unanswered = max(0, b.total - b.completed - b.failed)
    counts["canceled"] += unanswered if b.status == "cancelled" else 0
    counts["errored"] = max(0, b.total - counts["succeeded"] - counts["canceled"] - counts["expired"])
    return counts


def rfc3339(dt) -> str | None:  # noqa: ANN001 - a datetime or None
    return as_utc(dt).isoformat().replace("+00:00", "Z") if dt is not None else None


def message_batch(b: Batch, counts: dict[str, int], results_url: str) -> dict[str, Any]:
    """The ``message_batch`` object; ``results_url`` is shown once the batch has ended. ``archived_at`` (when its
    results stopped being available while the batch is still shown) is always null: a message batch's files never
    expire, and DELETE, which removes them, makes the batch a 404 too."""
    status = processing_status(b)
    return {"id": b.id, "type": "message_batch", "processing_status": status, "request_counts": counts,
            "ended_at": rfc3339(ended_at(b)), "created_at": rfc3339(b.created_at), "expires_at": rfc3339(b.expires_at),
            "cancel_initiated_at": rfc3339(b.cancelling_at), "archived_at": None,
            "results_url": results_url if status == "ended" else None}


def result_of_output(line: dict[str, Any]) -> dict[str, Any]:
    """An output-file line (a succeeded request: its body is the Message) as a result."""
    return {"custom_id": line["custom_id"], "result": {"type": "succeeded", "message": line["response"]["body"]}}


def result_of_error(line: dict[str, Any]) -> dict[str, Any]:
    """An error-file line as a result: canceled or expired with its batch, else errored (a request the fan-out
    refused is the client's to fix, 400's type; one whose job failed is the server's, 500's). A refusal's message
    loses the error file's ``line N: ``: a result names its request by ``custom_id``, as Anthropic's do."""
    error = line["error"]
    kind = RESULT_OF_CODE.get(error.get("code"))
    if kind is not None:
        return {"custom_id": line["custom_id"], "result": {"type": kind}}
    if line["id"].startswith(REFUSED_LINE):  # the fan-out refused it
        failed = error_body(400, LINE_PREFIX.sub("", error["message"], count=1))
    else:
        failed = error_body(500, error["message"])
    return {"custom_id": line["custom_id"], "result": {"type": "errored", "error": failed}}


def results(inputs: BinaryIO | None, outputs: BinaryIO | None, errors: BinaryIO | None,
            batch_errors: list[dict[str, Any]] | None, cancelled: bool = False) -> Iterator[dict[str, Any]]:
    """Each request's result, in the order of the requests: from the output and error files, or, for a request the
    batch ended without (no line in them), canceled where a cancel ended it before its fan-out ran, else errored
    with the batch's errors (it failed before any request ran). The files (open, seekable) are read a line at a
    time: only where each output and error line starts is held, by its custom_id (an error line's over an output
    line's), and a request's line is read again when its turn comes."""
    found: dict[str, tuple[Callable[[dict[str, Any]], dict[str, Any]], BinaryIO, int]] = {}
    for handle, convert in ((outputs, result_of_output), (errors, result_of_error)):
        for at, text in _lines(handle):
            found[json.loads(text)["custom_id"]] = (convert, handle, at)
    why = "; ".join(e.get("message", "") for e in batch_errors or ()) or "the batch failed before this request ran"
    # refused (the queue limit) is the client's to change; the server's own failure is 500's type
    status = 500 if any(e.get("code") == "internal_error" for e in batch_errors or ()) else 400
    for _, text in _lines(inputs):
        cid = json.loads(text)["custom_id"]
        if (where := found.get(cid)) is not None:
            convert, handle, at = where
            handle.seek(at)
            yield convert(json.loads(handle.readline()))
        else:
            yield {"custom_id": cid, "result": {"type": "canceled"} if cancelled else {
                "type": "errored", "error": error_body(status, why)}}


def _lines(handle: BinaryIO | None) -> Iterator[tuple[int, bytes]]:
    """``handle``'s lines that are not blank, from its start, each with the offset it starts at."""
    if handle is None:
        return
    handle.seek(0)
    at = 0
    for text in iter(handle.readline, b""):
        if text.strip():
            yield at, text
        at += len(text)
