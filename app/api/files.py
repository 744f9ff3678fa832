"""OpenAI Files API (``purpose=batch``): upload (multipart, with ``expires_after``), list, get, content, delete; its
errors in Anthropic's shape to Anthropic's SDK, whose beta files API calls these paths (``SharedPathRoute``)."""

from __future__ import annotations

import json
import logging
import os
import re
from datetime import timedelta
from pathlib import Path
from typing import Annotated, Literal
from urllib.parse import quote

from fastapi import APIRouter, File, Form, Query, UploadFile
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import Response, StreamingResponse
from pydantic import ValidationError
from sqlalchemy import or_, select

from app.api.anthropic_messages import SharedPathRoute
from app.api.deps import CurrentPrincipal, SessionDep, SettingsDep
from app.api.errors import openai_responses
from app.batch import storage
from app.db import pagination
from app.db.models import File as FileRow
from app.db.models import utcnow
from app.openai_schemas import OpenAIError, list_page

log = logging.getLogger(__name__)

router = APIRouter(prefix="/v1/files", tags=["files"], route_class=SharedPathRoute, responses=openai_responses(401))

# a Literal, so the OpenAPI document lists the purposes and a wrong one is a 400 naming them
UploadPurpose = Literal[storage.UPLOAD_PURPOSES]  # type: ignore[valid-type]
MAX_FILENAME_CHARS = 255  # the column holds 500; no file system takes a longer name
# room for the multipart envelope around an upload (boundaries, the parts' headers, purpose and expires_after): the
# body limit of /v1/files is the largest file plus this, and the file itself is held to the largest file
UPLOAD_ENVELOPE_BYTES = 64 * 1024
_UNQUOTABLE = re.compile(r'[^\x20-\x7e]|["\\]')  # what a quoted-string filename cannot carry as is


def content_disposition(filename: str) -> str:
    """``attachment`` with the name twice (RFC 6266): an ASCII ``filename=`` for old clients, with
    quotes, backslashes and anything non-ASCII replaced, and the exact name as RFC 5987's
    ``filename*=UTF-8''...`` (a header is Latin-1 bytes: ``résumé_✓.jsonl`` cannot go in raw)."""
    fallback = _UNQUOTABLE.sub("_", filename) or "download"
    exact = quote(filename.encode("utf-8", "backslashreplace"), safe="")
    return f"attachment; filename=\"{fallback}\"; filename*=UTF-8''{exact}"


def clean_filename(name: str | None) -> str:
    """The upload's base name (a client may send a path), without control characters, capped."""
    name = re.sub(r"[\x00-\x1f\x7f]", "", (name or "").replace("\\", "/").rsplit("/", 1)[-1])
    return name[:MAX_FILENAME_CHARS] or "upload.jsonl"


def _no_such_file(file_id: str) -> OpenAIError:
    return OpenAIError(404, f"No such File object: {file_id}", param="id", code="file_not_found")


def _own(session, principal, file_id: str) -> FileRow:
    row = storage.tenant_file(session, principal.tenant_id, file_id)
    if row is None:
        raise _no_such_file(file_id)
    return row


def lifetime(anchor: str | None, seconds: str | None, purpose: str, batch_days: float) -> timedelta | None:
    """How long the upload lives: its ``expires_after`` (the official client sends the object as the form fields
    ``expires_after[anchor]`` and ``expires_after[seconds]``), else the default of its purpose (None: kept)."""
    if anchor is None and seconds is None:
        return timedelta(days=batch_days) if purpose == "batch" and batch_days > 0 else None
    try:
        return storage.ExpiresAfter(anchor=anchor, seconds=seconds).lifetime  # type: ignore[arg-type]
    except ValidationError as exc:
        raise OpenAIError(400, "expires_after needs anchor 'created_at' and seconds from 3600 (an hour) to 2592000 "
                               f"(30 days): {exc.errors()[0]['msg']}", param="expires_after") from None


def _one_field(raw: str, anchor: str | None, seconds: str | None) -> tuple[str | None, str | None]:
    """``expires_after`` sent as one form field holding its JSON object: its anchor and seconds (a curl user's form;
    it was ignored, and the purpose's default applied, without a word)."""
    if anchor is not None or seconds is not None:
        raise OpenAIError(400, "give expires_after either as one JSON field or as expires_after[anchor] and "
                               "expires_after[seconds], not both", param="expires_after")
    try:
        value = json.loads(raw)
    except ValueError:
        value = None
    if not isinstance(value, dict) or not set(value) <= {"anchor", "seconds"}:
        raise OpenAIError(400, "expires_after as one field is a JSON object with anchor 'created_at' and seconds, "
                               "e.g. {\"anchor\": \"created_at\", \"seconds\": 3600}", param="expires_after")
    return (None if (a := value.get("anchor")) is None else str(a),
            None if (n := value.get("seconds")) is None else str(n))


@router.post("", responses=openai_responses(400, 413))
async def upload_file(session: SessionDep, principal: CurrentPrincipal, settings: SettingsDep,
                      file: Annotated[UploadFile, File()],
                      purpose: Annotated[UploadPurpose, Form()],
                      expires_anchor: Annotated[str | None, Form(alias="expires_after[anchor]")] = None,
                      expires_seconds: Annotated[str | None, Form(alias="expires_after[seconds]")] = None,
                      expires_after: Annotated[str | None, Form(description=(
                          "the object as one JSON field (`-F 'expires_after={\"anchor\": \"created_at\", "
                          "\"seconds\": 3600}'`), instead of the two bracketed fields the official client sends"
                      ))] = None) -> dict:
    if expires_after is not None:
        expires_anchor, expires_seconds = _one_field(expires_after, expires_anchor, expires_seconds)
    lives = lifetime(expires_anchor, expires_seconds, purpose, settings.batch_file_expiry_days)
    if not file.size:
        raise OpenAIError(400, "the file is empty", param="file")
    if file.size > settings.max_file_bytes:
        raise OpenAIError(413, f"the file is {file.size} bytes, over the largest upload of "
                               f"{settings.max_file_bytes} bytes; upload a smaller file or split it", param="file")
    # copied from Starlette's spool in pieces: an upload is never held whole in memory
    await file.seek(0)
    row = await run_in_threadpool(storage.save_file, session, settings.data_dir, principal.tenant_id,
                                  clean_filename(file.filename), purpose, file.file, lives)
    return storage.file_object(row)


@router.get("", responses=openai_responses(400))
def list_files(session: SessionDep, principal: CurrentPrincipal, purpose: str | None = None,
               limit: Annotated[int, Query(ge=1, le=10_000)] = 10_000, after: str | None = None,
               order: Annotated[Literal["asc", "desc"], Query(description="by creation: desc newest first")] = "desc",
               ) -> dict:
    newest_first = order == "desc"
    q = select(FileRow).where(FileRow.tenant_id == principal.tenant_id, FileRow.deleted.is_(False),
                              FileRow.purpose.not_in(storage.NOT_IN_FILES_API),
                              or_(FileRow.expires_at.is_(None), FileRow.expires_at > utcnow()))
    if purpose:
        q = q.where(FileRow.purpose == purpose)
    # the cursor file may be deleted or expired by now (a loop that deletes as it lists): its row still places it
    try:
        rows = pagination.rows_after(session, q, FileRow, principal.tenant_id, after, limit, newest_first)
    except pagination.UnknownCursor as exc:
        raise OpenAIError(400, exc.says("after", "files"), param="after") from None
    return list_page(rows, None, limit, storage.file_object)


@router.get("/{file_id}", responses=openai_responses(404))
def get_file(file_id: str, session: SessionDep, principal: CurrentPrincipal) -> dict:
    return storage.file_object(_own(session, principal, file_id))


def _download_headers(row: FileRow, size: int) -> dict[str, str]:
    """GET's and HEAD's headers of a file's content of ``size`` bytes."""
    return {"Content-Disposition": content_disposition(row.filename), "Content-Length": str(size)}


@router.get("/{file_id}/content", response_class=Response,
            responses={200: {"content": {"application/jsonl": {}}, "description": "the file's bytes"},
                       **openai_responses(404)})
def file_content(file_id: str, session: SessionDep, principal: CurrentPrincipal) -> Response:
    """The file's bytes, streamed from storage a piece at a time (a batch's output file may be hundreds of MiB)."""
    row = _own(session, principal, file_id)
    try:
        handle = storage.open_content(row)
    except FileNotFoundError:  # deleted since it was read (it expired, or a DELETE raced this request)
        raise _no_such_file(file_id) from None
    return StreamingResponse(storage.content_pieces(handle), media_type="application/jsonl",
                             headers=_download_headers(row, os.fstat(handle.fileno()).st_size))


# HEAD is GET's answer without its body (RFC 9110), not an operation of its own: the document lists GET only
@router.head("/{file_id}/content", response_class=Response, include_in_schema=False)
def file_content_head(file_id: str, session: SessionDep, principal: CurrentPrincipal) -> Response:
    """What GET answers, its headers alone: the content's size is read from disk, not the content."""
    row = _own(session, principal, file_id)
    try:
        size = Path(row.path).stat().st_size
    except FileNotFoundError:  # as GET: deleted since it was read
        raise _no_such_file(file_id) from None
    return Response(media_type="application/jsonl", headers=_download_headers(row, size))


@router.delete("/{file_id}", responses=openai_responses(404))
def delete_file(file_id: str, session: SessionDep, principal: CurrentPrincipal) -> dict:
    if not storage.delete_file(session, _own(session, principal, file_id)):  # another DELETE came first
        raise _no_such_file(file_id)
    return {"id": file_id, "object": "file", "deleted": True}
