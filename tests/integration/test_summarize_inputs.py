"""What ``POST /v1/summarize`` answers for documents it cannot take: a 422 that points at the document to fix (real
app, migrated SQLite)."""

from __future__ import annotations

import pytest
from sqlalchemy import select

from app.db.models import SummarizationRun
from app.db.session import session_scope
from tests.conftest import Keys

pytestmark = pytest.mark.integration


def test_repeated_document_ids_are_refused_naming_each_id_and_where_it_repeats(client, keys, settings):
    """The 422 said only "document ids must be unique": a client that sent thousands of documents could not tell which
    ids repeat. Each repeat is an error at its own document, naming the id and the document it repeats."""
    text = "The cat sat. It was warm."
    ids = ["a", "b", "a", "c", "b", "a"]
    r = client.post("/v1/summarize", headers=Keys.header(keys.paid),
                    json={"documents": [{"id": i, "text": text} for i in ids], "deadline": "30m"})
    assert r.status_code == 422, r.text
    errors = r.json()["detail"]
    assert [e["loc"] for e in errors] == [["body", "documents", 2, "id"], ["body", "documents", 4, "id"],
                                          ["body", "documents", 5, "id"]], errors
    assert "'a'" in errors[0]["msg"] and "documents[0]" in errors[0]["msg"], errors
    assert "'b'" in errors[1]["msg"] and "documents[1]" in errors[1]["msg"], errors
    with session_scope(settings.sqlalchemy_url) as s:
        assert s.scalars(select(SummarizationRun)).all() == []
