"""Files API storage: content under ``data_dir/files/<id>``, metadata in the ``files`` table."""

from __future__ import annotations

import logging
from datetime import UTC
from pathlib import Path
from typing import Any

from sqlalchemy.orm import Session

from app.db.models import File, new_id, utcnow
from app.db.session import write_after_read

log = logging.getLogger(__name__)

UPLOAD_PURPOSES = ("batch", "user_data")


def files_dir(data_dir: Path) -> Path:
    path = Path(data_dir) / "files"
    path.mkdir(parents=True, exist_ok=True)
    return path


def save_file(session: Session, data_dir: Path, tenant_id: str, filename: str, purpose: str, content: bytes) -> File:
    """Writes the content, then the row (commits)."""
    file_id = new_id("file")
    path = files_dir(data_dir) / file_id
    path.write_bytes(content)
    row = File(id=file_id, tenant_id=tenant_id, filename=filename, purpose=purpose, bytes=len(content),
               path=str(path), created_at=utcnow(), deleted=False)
    with write_after_read(session):
        session.add(row)
        session.commit()
    return row


def read_content(row: File) -> bytes:
    return Path(row.path).read_bytes()


def get_file(session: Session, tenant_id: str | None, file_id: str) -> File | None:
    row = session.get(File, file_id)
    if row is None or row.deleted or (tenant_id is not None and row.tenant_id != tenant_id):
        return None
    return row


def delete_file(session: Session, row: File) -> None:
    Path(row.path).unlink(missing_ok=True)
    with write_after_read(session):
        row.deleted = True
        session.commit()


def file_object(row: File) -> dict[str, Any]:
    created = row.created_at if row.created_at.tzinfo else row.created_at.replace(tzinfo=UTC)
    return {"id": row.id, "object": "file", "bytes": row.bytes, "created_at": int(created.timestamp()),
            "filename": row.filename, "purpose": row.purpose, "status": "processed", "status_details": None}
