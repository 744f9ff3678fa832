"""A starting worker's decode-length history comes from its model's succeeded jobs in SQL."""

from __future__ import annotations

from datetime import timedelta

from app.db.models import Job, Tenant
from app.db.session import session_scope
from app.services.transitions import utcnow
from gpu_runtime.scheduler.decode_length import DecodeLengthHistory
from workers.decode_history import finished_lengths, seed


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
        assert sorted(lengths, key=str) == sorted([("summ", 90), ("summ", 100), ("summ", 110), (None, 7)], key=str)
        assert [n for app, n in lengths if app == "summ"] == [90, 100, 110]  # oldest first
        assert finished_lengths(s, "m", limit=2)[-1] == (None, 7)  # the newest ones
    history = DecodeLengthHistory()
    assert history.predict("summ", 4096) == 4096  # nothing known: max_tokens
    seed(history, lengths)
    assert history.predict("summ", 4096) == 120  # mean 100 + 2 std 10
