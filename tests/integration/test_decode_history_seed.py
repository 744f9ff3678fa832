"""A worker's decode-length history comes from its model's succeeded jobs in SQL: all of them when it
starts, then what the other workers finish (real migrated SQLite)."""

from __future__ import annotations

from datetime import timedelta

from app.db.models import Job, Tenant
from app.db.session import session_scope
from app.services.transitions import utcnow
from gpu_runtime.scheduler.decode_length import DecodeLengthHistory
from workers.decode_history import PeerLengths, finished_lengths, history_key, seed


def test_history_is_seeded_from_succeeded_jobs_of_the_model(db_url):
    now = utcnow()
    with session_scope(db_url) as s:
        t = Tenant(name="h")
        s.add(t)
        s.flush()

        def job(status, app, tokens, model="m", age=0.0):
            return Job(tenant_id=t.id, kind="batch", tier="paid", model=model, status=status, prompt="x",
                       sampling={}, app_id=app, completion_tokens=tokens, finished_at=now - timedelta(seconds=age))

        s.add_all([job("succeeded", "summ", n, age=10 - i) for i, n in enumerate((90, 100, 110))]
                  + [job("succeeded", None, 7), job("failed", "summ", 4000), job("cancelled", "summ", 3),
                     job("succeeded", "summ", 5000, model="other"), job("running", "summ", None)])
    with session_scope(db_url) as s:
        lengths = finished_lengths(s, "m")
        own, summ = history_key(None, t.id, "batch"), history_key("summ", t.id, "batch")  # no app_id: by kind
        assert len({own, summ, history_key(None, t.id, "interactive"), history_key("summ", "other", "batch")}) == 4
        assert sorted(lengths) == sorted([(summ, 90), (summ, 100), (summ, 110), (own, 7)])
        assert [n for app, n in lengths if app == summ] == [90, 100, 110]  # oldest first
        assert finished_lengths(s, "m", limit=2)[-1] == (own, 7)  # the newest ones
    history = DecodeLengthHistory()
    assert history.predict(summ, 4096) == 4096  # nothing known: max_tokens
    seed(history, lengths)
    assert history.predict(summ, 4096) == 120  # mean 100 + 2 std 10


def test_peer_lengths_reads_what_other_workers_finished_since_the_last_read(db_url):
    start = utcnow()
    with session_scope(db_url) as s:
        t = Tenant(name="p")
        s.add(t)
        s.flush()
        tenant = t.id

    def finish(app, tokens, worker, after_s, model="m"):
        with session_scope(db_url) as s:
            s.add(Job(tenant_id=tenant, kind="interactive", tier="paid", model=model, status="succeeded",
                      prompt="x", sampling={}, app_id=app, completion_tokens=tokens, worker_id=worker,
                      finished_at=start + timedelta(seconds=after_s)))

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
