"""Files API storage: content under ``data_dir/files/<id>``, metadata in the ``files`` table.

A file may expire (``expires_after``; uploads for batches by default, as OpenAI's do): from its
``expires_at`` on the API no longer shows it, and the workers' sweeper deletes it.
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Iterable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any, BinaryIO, Literal

from pydantic import BaseModel, ConfigDict, Field
from sqlalchemy import exists, select, update
from sqlalchemy.orm import Session

from app.db.models import Batch, File, new_id, utcnow
from app.db.session import write_after_read
from app.services.transitions import as_utc

log = logging.getLogger(__name__)

UPLOAD_PURPOSES = ("batch", "user_data")
# a message batch's requests and results (Anthropic's Message Batches API has no files): the batch's alone, so the
# Files API neither shows nor deletes them (a tenant who deleted one there would lose the batch's results)
MESSAGE_BATCH_INPUT = "message_batch"
MESSAGE_BATCH_RESULTS = "message_batch_results"
NOT_IN_FILES_API = (MESSAGE_BATCH_INPUT, MESSAGE_BATCH_RESULTS)


class ExpiresAfter(BaseModel):
    """OpenAI's expiration policy of a file: ``seconds`` after its creation, an hour to 30 days."""

    model_config = ConfigDict(extra="forbid")
    anchor: Literal["created_at"] = Field(description="when the time starts: the file's creation")
    seconds: int = Field(ge=3600, le=30 * 24 * 3600, description="seconds after the anchor (3600 to 2592000)")

    @property
    def lifetime(self) -> timedelta:
        return timedelta(seconds=self.seconds)


def files_dir(data_dir: Path) -> Path:
    path = Path(data_dir) / "files"
    path.mkdir(parents=True, exist_ok=True)
    return path


def new_file(data_dir: Path, tenant_id: str, filename: str, purpose: str,
             content: bytes | BinaryIO | Iterable[bytes], lifetime: timedelta | None = None) -> File:
    """Writes the content (bytes, a file read from where it stands, or pieces written as they come: an upload or a
    batch's result file is never held whole in memory); its row is the caller's to add (the file exists once that
    commits)."""
    file_id = new_id("file")
    path = files_dir(data_dir) / file_id
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        with path.open("wb") as out:
            if hasattr(content, "read"):
                shutil.copyfileobj(content, out)
            else:
                out.writelines(content)
    now = utcnow()
    return File(id=file_id, tenant_id=tenant_id, filename=filename, purpose=purpose, bytes=path.stat().st_size,
                path=str(path), created_at=now, deleted=False,
                expires_at=now + lifetime if lifetime is not None else None)


def save_file(session: Session, data_dir: Path, tenant_id: str, filename: str, purpose: str,
              content: bytes | BinaryIO, lifetime: timedelta | None = None) -> File:
    """Writes the content, then the row (commits)."""
    row = new_file(data_dir, tenant_id, filename, purpose, content, lifetime)
    with write_after_read(session):
        session.add(row)
        session.commit()
    return row


CONTENT_PIECE_BYTES = 256 * 1024  # what a download holds of the file at a time


def read_content(row: File) -> bytes:
    return Path(row.path).read_bytes()


def open_content(row: File) -> BinaryIO:
    """The content, open to be read in pieces; raises FileNotFoundError where it was deleted. Once open it stays
    readable to the end, whatever deletes the file meanwhile (its bytes go with the last handle)."""
    return Path(row.path).open("rb")


def content_pieces(handle: BinaryIO) -> Iterator[bytes]:
    """``handle``'s bytes, ``CONTENT_PIECE_BYTES`` at a time, closing it once read (or once the reader stops)."""
    with handle:
        while piece := handle.read(CONTENT_PIECE_BYTES):
            yield piece


def expired(row: File) -> bool:
    return row.expires_at is not None and as_utc(row.expires_at) <= utcnow()


def get_file(session: Session, tenant_id: str | None, file_id: str) -> File | None:
    row = session.get(File, file_id)
    if row is None or row.deleted or expired(row) or (tenant_id is not None and row.tenant_id != tenant_id):
        return None
    return row


def tenant_file(session: Session, tenant_id: str, file_id: str) -> File | None:
    """The tenant's file as the Files API (and an OpenAI batch's ``input_file_id``) sees it: a message batch's
    files are none of it."""
    row = get_file(session, tenant_id, file_id)
    return None if row is None or row.purpose in NOT_IN_FILES_API else row


def delete_file(session: Session, row: File) -> bool:
    """Removes the content, then flags the row deleted; False when another deletion flagged it since it was read
    (two DELETEs at once: the later one is the 404 a client gets after a delete)."""
    Path(row.path).unlink(missing_ok=True)
    with write_after_read(session):
        flagged = session.execute(update(File).where(File.id == row.id, File.deleted.is_(False))
                                  .values(deleted=True)).rowcount == 1
        session.commit()
    return flagged


def delete_expired_files(session: Session, limit: int = 500) -> int:
    """Deletes the files whose time is up (content, then the row's flag), up to ``limit``; returns how many. An
    upload a batch still validates from waits until the batch has read it."""
    validating = exists().where(Batch.input_file_id == File.id, Batch.status == "validating")
    rows = list(session.scalars(select(File).where(File.deleted.is_(False), File.expires_at.is_not(None),
                                                  File.expires_at <= utcnow(), ~validating).limit(limit)))
    deleted = sum(delete_file(session, row) for row in rows)  # not one a DELETE took meanwhile
    if deleted:
        log.info("deleted %d expired files", deleted)
    return deleted


def file_object(row: File) -> dict[str, Any]:
    expires = int(as_utc(row.expires_at).timestamp()) if row.expires_at is not None else None
    return {"id": row.id, "object": "file", "bytes": row.bytes, "created_at": int(as_utc(row.created_at).timestamp()),
            "expires_at": expires, "filename": row.filename, "purpose": row.purpose, "status": "processed",
            "status_details": None}
