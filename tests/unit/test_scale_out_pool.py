"""ops/compose/SCALE-OUT.md sizes PostgreSQL's ``max_connections`` by the connections each worker and API process
opens: its figure is the pool a database server's engine really gets (kept plus overflow), and a process makes one
engine per database URL."""

from __future__ import annotations

import re

from app.db.session import get_engine, make_engine
from tests.conftest import ROOT


def test_the_scale_out_guide_states_the_pool_a_process_opens():
    url = "postgresql+psycopg2://coserve:secret@db-host:5432/coserve"  # building the engine connects to nothing
    pool = make_engine(url).pool
    opened = pool.size() + pool._max_overflow
    guide = " ".join(ROOT.joinpath("ops/compose/SCALE-OUT.md").read_text().split())
    stated = {int(n) for n in re.findall(r"pool of up to (\d+) connections", guide)}
    stated |= {int(n) for n in re.findall(r"x (\d+)", guide)}
    assert stated == {opened}, f"SCALE-OUT.md says {sorted(stated)} connections per process; the pool opens {opened}"
    assert get_engine(url) is get_engine(url)  # one pool per process and URL
