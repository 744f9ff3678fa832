"""A worker's decode-length history comes from its model's succeeded jobs in SQL: all of them when it
starts, then what the other workers finish (real migrated SQLite)."""

from __future__ import annotations

from datetime import timedelta

import pytest

from app.db.models import Job, Tenant
from app.db.session import session_scope
from app.services.transitions import utcnow
from gpu_runtime.scheduler.decode_length import DecodeLengthHistory
from workers.decode_history import PeerLengths, finished_lengths, history_key, seed

pytestmark = pytest.mark.integration


def _tenant(db_url: str, name: str) -> str:
    with session_scope(db_url) as s:
        t = Tenant(name=name)
        s.add(t)
        s.flush()
        return t.id


def _job(tenant: str, status: str, app: str | None, tokens: int | None, finished_at, model: str = "m",
         kind: str = "batch", worker: str | None = None) -> Job:
    return Job(tenant_id=tenant, kind=kind, tier="paid", model=model, status=status, prompt="x", sampling={},
               app_id=app, completion_tokens=tokens, finished_at=finished_at, worker_id=worker)


def test_history_is_seeded_from_succeeded_jobs_of_the_model(db_url):
    now = utcnow()
    tenant = _tenant(db_url, "h")
    with session_scope(db_url) as s:
        def job(status, app, tokens, model="m", age=0.0):
            return _job(tenant, status, app, tokens, now - timedelta(seconds=age), model=model)

        s.add_all([job("succeeded", "summ", n, age=10 - i) for i, n in enumerate((90, 100, 110))]
                  + [job("succeeded", None, 7), job("failed", "summ", 4000), job("cancelled", "summ", 3),
                     job("succeeded", "summ", 5000, model="other"), job("running", "summ", None)])
    with session_scope(db_url) as s:
        lengths = finished_lengths(s, "m")
        own, summ = history_key(None, tenant, "batch"), history_key("summ", tenant, "batch")  # no app_id: by kind
        assert len({own, summ, history_key(None, tenant, "interactive"), history_key("summ", "other", "batch")}) == 4
        assert sorted(lengths) == sorted([(summ, 90), (summ, 100), (summ, 110), (own, 7)])
        assert [n for app, n in lengths if app == summ] == [90, 100, 110]  # oldest first
        assert finished_lengths(s, "m", limit=2)[-1] == (own, 7)  # the newest ones
    history = DecodeLengthHistory()
    assert history.predict(summ, 4096) == 4096  # nothing known: max_tokens
    seed(history, lengths)
    assert history.predict(summ, 4096) == 120  # mean 100 + 2 std 10


def test_peer_lengths_reads_what_other_workers_finished_since_the_last_read(db_url):
    start = utcnow()
    tenant = _tenant(db_url, "p")

    def finish(app, tokens, worker, after_s, model="m"):
        with session_scope(db_url) as s:
            s.add(_job(tenant, "succeeded", app, tokens, start + timedelta(seconds=after_s), model=model,
                       kind="interactive", worker=worker))

    finish("chat", 5, "w2", -1.0)  # before this worker started: the seed's, not the peers'
    peers = PeerLengths("m", "w1", since=start)
    finish("chat", 40, "w2", 1.0)
    finish("chat", 41, "w1", 2.0)  # its own: recorded by its engine already
    finish("chat", 42, "w3", 3.0)
    finish("chat", 43, "w2", 3.5, model="other")
    finish(None, 44, None, 4.0)
    with session_scope(db_url) as s:
        chat = history_key("chat", tenant, "interactive")
        assert peers.read(s) == [(chat, 40), (chat, 42), (history_key(None, tenant, "interactive"), 44)]
        assert peers.read(s) == []  # each job once
    finish("chat", 45, "w2", 5.0)
    with session_scope(db_url) as s:
        assert peers.read(s) == [(chat, 45)]
    # a worker of "m" serving the LoRA adapter "m-lora" too learns the adapter's lengths apart from the model's
    served = PeerLengths(("m", "m-lora"), "w1", since=start + timedelta(seconds=4.5))
    finish("chat", 8, "w2", 6.0, model="m-lora")
    finish("chat", 46, "w2", 6.5)
    finish("chat", 9, "w2", 7.0, model="unserved-lora")
    with session_scope(db_url) as s:
        adapted = history_key("chat", tenant, "interactive", "m-lora")
        assert adapted != chat and served.read(s) == [(chat, 45), (adapted, 8), (chat, 46)]
        assert (adapted, 8) in finished_lengths(s, ("m", "m-lora"))
