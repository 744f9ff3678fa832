"""The Files API's ``expires_after``: what an upload says (or its purpose's default) sets when it expires; from
then the API no longer shows it and the sweep deletes it. Real app over HTTP (the official client), real SQLite
migrated by Alembic."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import openai
import pytest
from sqlalchemy import update

from app.batch.storage import delete_expired_files
from app.db.models import Batch, File, new_id, utcnow
from app.db.session import session_scope

pytestmark = pytest.mark.integration

LINE = b'{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": {"messages": []}}\n'


@pytest.fixture
def oai(client, keys) -> openai.OpenAI:
    return openai.OpenAI(base_url=str(client.base_url) + "/v1", api_key=keys.paid, http_client=client, max_retries=0)


def expire_now(db_url: str, file_id: str) -> None:
    """Time passes for one file: its expiry moves into the past."""
    with session_scope(db_url) as s:
        s.execute(update(File).where(File.id == file_id).values(expires_at=utcnow() - timedelta(seconds=1)))
        s.commit()


def test_an_upload_lives_as_long_as_its_expires_after_says(oai, db_url):
    hour = oai.files.create(file=("in.jsonl", LINE), purpose="batch",
                            expires_after={"anchor": "created_at", "seconds": 3600})
    assert hour.expires_at == hour.created_at + 3600
    default = oai.files.create(file=("in.jsonl", LINE), purpose="batch")
    assert default.expires_at == default.created_at + 30 * 86400  # OpenAI's default for batch uploads
    kept = oai.files.create(file=("notes.jsonl", LINE), purpose="user_data")
    assert kept.expires_at is None
    assert oai.files.retrieve(hour.id).expires_at == hour.expires_at

    for bad in ({"anchor": "created_at", "seconds": 60}, {"anchor": "created_at", "seconds": 40 * 86400},
                {"anchor": "last_active_at", "seconds": 3600}):
        with pytest.raises(openai.BadRequestError) as exc:
            oai.files.create(file=("in.jsonl", LINE), purpose="batch", expires_after=bad)
        assert exc.value.body["param"] == "expires_after" and "3600" in exc.value.body["message"], exc.value.body


def test_expires_after_sent_as_one_json_field_sets_the_expiry_or_is_a_400_saying_how(client, keys):
    """A curl user's ``-F 'expires_after={...}'`` (one field, not the client's two bracketed ones) was ignored: the
    purpose's default applied without a word."""
    def upload(**fields):
        return client.post("/v1/files", headers={"Authorization": f"Bearer {keys.paid}"},
                           files={"file": ("in.jsonl", LINE)}, data={"purpose": "batch", **fields})
    r = upload(expires_after='{"anchor": "created_at", "seconds": 7200}')
    assert r.status_code == 200 and r.json()["expires_at"] == r.json()["created_at"] + 7200, r.text
    for fields in ({"expires_after": "7200"}, {"expires_after": '{"anchor": "created_at", "days": 1}'},
                   {"expires_after": '{"anchor": "created_at", "seconds": 60}'},
                   {"expires_after": '{"anchor": "created_at", "seconds": 7200}', "expires_after[seconds]": "7200"}):
        r = upload(**fields)
        assert r.status_code == 400 and r.json()["error"]["param"] == "expires_after", (fields, r.text)


def test_an_expired_file_is_gone_from_the_api_and_the_sweep_deletes_it(oai, db_url):
    gone = oai.files.create(file=("in.jsonl", LINE), purpose="batch")
    kept = oai.files.create(file=("notes.jsonl", LINE), purpose="user_data")
    expire_now(db_url, gone.id)
    with pytest.raises(openai.NotFoundError):
        oai.files.retrieve(gone.id)
    with pytest.raises(openai.NotFoundError):
        oai.files.content(gone.id)
    assert [f.id for f in oai.files.list().data] == [kept.id]
    with pytest.raises(openai.NotFoundError):  # a batch cannot start from it either
        oai.batches.create(input_file_id=gone.id, endpoint="/v1/chat/completions", completion_window="24h")

    with session_scope(db_url) as s:
        path = Path(s.get(File, gone.id).path)
        assert path.exists()
        assert delete_expired_files(s) == 1
        assert s.get(File, gone.id).deleted and not path.exists()
        assert not s.get(File, kept.id).deleted and Path(s.get(File, kept.id).path).exists()
        assert delete_expired_files(s) == 0
    assert oai.files.content(kept.id).content == LINE


def test_an_expired_upload_a_batch_still_validates_from_waits_for_it(oai, db_url, keys):
    src = oai.files.create(file=("in.jsonl", LINE), purpose="batch")
    expire_now(db_url, src.id)
    with session_scope(db_url) as s:
        s.add(Batch(id=new_id("batch"), tenant_id=keys.tenant_id, endpoint="/v1/chat/completions",
                    input_file_id=src.id, completion_window="24h", status="validating", tier="paid"))
        s.commit()
        assert delete_expired_files(s) == 0
        s.execute(update(Batch).where(Batch.input_file_id == src.id).values(status="in_progress"))
        s.commit()
        assert delete_expired_files(s) == 1


def test_a_batchs_output_expiry_out_of_range_is_a_400_naming_it(oai):
    src = oai.files.create(file=("in.jsonl", LINE), purpose="batch")
    with pytest.raises(openai.BadRequestError) as exc:
        oai.batches.create(input_file_id=src.id, endpoint="/v1/chat/completions", completion_window="24h",
                           output_expires_after={"anchor": "created_at", "seconds": 10})
    assert "output_expires_after" in (exc.value.body.get("param") or ""), exc.value.body
    assert oai.batches.list().data == []  # nothing was created
