"""Every ```bash and ```python block of README.md runs against a live stack, so the README cannot drift.

The stack is what ``coserve up`` leaves behind, in a scratch directory the blocks run in: the API
(uvicorn) and a real worker (the own engine on the tiny random model, served under the default
model's name), Redis, a migrated SQLite ``data/coserve.db``, the first-run ``data/credentials.json``
and the recorded Redis URL. Each block runs as the README prints it, in a fresh shell (bash) or
interpreter (python) with ``.venv/bin`` on PATH and no COSERVE_ variables, so one that leans on
another block's variables fails here. ``PLANS`` says how each block runs: as is, with a short
variant (a named edit of its text), or not at all (setup, long runs), and why. A block that no
plan names fails the test: a new README block must say how it is checked.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.conftest import ROOT, make_settings, model_dir_for, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.integration]

README = ROOT / "README.md"
README_URL = "http://127.0.0.1:8000"  # where `coserve up` serves; the live stack's URL replaces it
BLOCK_TIMEOUT_S = 90


@dataclass(frozen=True)
class Plan:
    """How the block whose text contains the plan's marker runs."""

    skip: str | None = None  # why it does not run at all
    edits: tuple[tuple[str, str, str], ...] = ()  # (old, new, why): a short variant, or a line left out
    expect: tuple[str, ...] = ()  # in its output
    files: tuple[str, ...] = ()  # it leaves these in the directory


PLANS: dict[str, Plan] = {
    "./scripts/setup.sh": Plan(skip="sets up .venv and starts `coserve up` / runs the whole suite: the stack "
                                    "this test starts is what it leaves behind"),
    'coserve submit "Name three rivers in Europe."': Plan(
        # JOB_ID is a job of this stack that missed its 1 ms TTFT: status explains the miss
        expect=("submitted job_", "first missed deadline", "token 1 (the first) was due 0.001 s",
                "nothing to cancel")),  # JOB_ID had succeeded
    "curl -s http://127.0.0.1:8000/v1/jobs": Plan(expect=('"kind":"batch"', '"deadline_at":')),
    'stream=True, extra_body={"ttft_ms": 1000': Plan(),
    "client.chat.completions.list(": Plan(expect=("[True] ['Hi!'] True",)),
    # the jobs the blocks before it ran are in the last day's usage
    "/v1/organization/usage/completions": Plan(expect=('"object":"page"', "organization.usage.completions.result",
                                                       '"service_tier":"priority"')),
    "client.conversations.create(": Plan(expect=("['message', 'message', 'message']",)),
    "coserve batch create requests.jsonl": Plan(
        edits=(("ops/demo_summarize.sh", ": ops/demo_summarize.sh",
                "80 prompts on the 135M model: tens of minutes on a CPU (tests/e2e/test_summarize_and_cli.py "
                "covers summarize)"),),
        # docs/ here is a one-page folder the test writes, not the repository's docs/
        expect=("completed",), files=("results.jsonl", "summaries.jsonl")),
    "coserve profile --grid small": Plan(
        edits=(("--out my_profile.json", "--out my_profile.json --model {model} --backend torch --repeats 1",
                "the tiny model on the own engine, once per shape: the default model (on vLLM) takes minutes"),
               ("--out sim/", "--out sim/ --requests 40",
                "40 requests per run instead of 300 (the default sweep still finds the knee)")),
        files=("my_profile.json", "sim/results.json", "sim/violations.png")),
    "vllm.entrypoints.openai.api_server": Plan(skip="a separate vLLM server on the 135M model: minutes to start "
                                                    "on a CPU (tests/vllm covers CoserveScheduler)"),
}

FENCE = re.compile(r"^```(\w+)\n(.*?)^```$", re.S | re.M)


@dataclass(frozen=True)
class Block:
    lang: str
    text: str
    line: int

    def plan(self) -> tuple[str, Plan]:
        named = [(marker, plan) for marker, plan in PLANS.items() if marker in self.text]
        assert len(named) == 1, (f"README.md line {self.line}: a ```{self.lang} block needs exactly one entry in "
                                 f"PLANS (found {[m for m, _ in named]}):\n{self.text}")
        return named[0]


def readme_blocks() -> list[Block]:
    text = README.read_text()
    return [Block(m.group(1), m.group(2), text.count("\n", 0, m.start()) + 1)
            for m in FENCE.finditer(text) if m.group(1) in ("bash", "python")]


def test_every_block_has_a_plan_and_every_plan_a_block():
    blocks = readme_blocks()
    assert len(blocks) >= 6
    used = {b.plan()[0] for b in blocks}
    assert used == set(PLANS), f"plans without a README block: {set(PLANS) - used}"
    for b in blocks:
        for old, _, why in b.plan()[1].edits:
            assert old in b.text and why, (b.line, old)


# ---------------------------------------------------------------- the stack
@pytest.fixture
def workdir(tmp_path) -> Path:
    return tmp_path / "checkout"


@pytest.fixture
def db_url(workdir) -> str:
    from app.db.migrate import upgrade

    (workdir / "data").mkdir(parents=True)
    url = f"sqlite:///{workdir / 'data' / 'coserve.db'}"
    upgrade(url)
    return url


@pytest.fixture
def settings(request, workdir, db_url, redis_url, tiny_model_dir):
    # served under the default model's name, as the README's requests name it
    return make_settings(workdir / "data", db_url, redis_url, model_dir_for(request, tiny_model_dir)).model_copy(
        update={"model_name": "smollm2-135m-instruct"})


@pytest.fixture
def stack(live_server, settings, start_worker, workdir, redis_url) -> dict[str, str]:
    """What `coserve up` leaves: credentials, the recorded Redis URL; plus the jobs and batch the
    placeholders (JOB_ID, BATCH_ID) name."""
    from app.credentials import ensure_credentials
    from app.embedded import record_redis_url

    start_worker("w1")
    creds, _ = ensure_credentials(settings.sqlalchemy_url, settings.data_dir, api_url=live_server)
    record_redis_url(settings.data_dir, redis_url)
    h = {"Authorization": f"Bearer {creds['api_key']}"}
    job = httpx.post(f"{live_server}/v1/jobs", headers=h, timeout=30, json={
        "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "ttft_ms": 1}).json()["id"]
    line = {"custom_id": "a", "method": "POST", "url": "/v1/completions",
            "body": {"model": "smollm2-135m-instruct", "prompt": "Hi", "max_tokens": 3}}
    f = httpx.post(f"{live_server}/v1/files", headers=h, data={"purpose": "batch"},
                   files={"file": ("in.jsonl", json.dumps(line) + "\n")}).json()
    batch = httpx.post(f"{live_server}/v1/batches", headers=h, json={
        "input_file_id": f["id"], "endpoint": "/v1/completions", "completion_window": "24h"}).json()["id"]

    def ended(path, field, done):
        return httpx.get(f"{live_server}{path}", headers=h).json()[field] in done
    wait_for(lambda: ended(f"/v1/jobs/{job}", "status", {"succeeded"}), 60, "the JOB_ID job")
    wait_for(lambda: ended(f"/v1/batches/{batch}", "status", {"completed"}), 60, "the BATCH_ID batch")
    # the worker stored the first missed deadline beside slo_met (what `coserve status JOB_ID` explains)
    miss = httpx.get(f"{live_server}/v1/jobs/{job}", headers=h).json()["metrics"]["slo_miss"]
    assert miss["token"] == 1 and miss["due_s"] == pytest.approx(0.001) and miss["late_ms"] > 0, miss
    # what the blocks read or write beside them: a one-page docs/ to summarize
    (workdir / "docs").mkdir()
    (workdir / "docs" / "note.md").write_text("Queues hold jobs. Workers take them in deadline order.\n")
    return {"JOB_ID": job, "BATCH_ID": batch, README_URL: live_server, "{model}": settings.model}


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("COSERVE_") and k != "REDIS_URL"}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env.update(NO_COLOR="1", COLUMNS="200", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return env


def _prepared(block: Block, plan: Plan, values: dict[str, str]) -> str:
    text = block.text
    for old, new, _why in plan.edits:
        text = text.replace(old, new)
    for name, value in values.items():
        text = text.replace(name, value)
    return text


def _run(lang: str, text: str, workdir: Path) -> subprocess.CompletedProcess:
    cmd = ["bash", "-e", "-o", "pipefail", "-c", text] if lang == "bash" else [sys.executable, "-c", text]
    try:
        return subprocess.run(cmd, cwd=workdir, env=_env(), capture_output=True, text=True, timeout=BLOCK_TIMEOUT_S)
    except subprocess.TimeoutExpired as exc:
        raise AssertionError(f"ran past {BLOCK_TIMEOUT_S}s:\n{text}") from exc


@pytest.mark.writes_text  # `coserve summarize docs/` exits 0 only with a summary of each document
def test_readme_blocks_run_against_a_live_stack(stack, workdir):
    ran = []
    for block in readme_blocks():
        marker, plan = block.plan()
        if plan.skip:
            continue
        text = _prepared(block, plan, stack)
        out = _run(block.lang, text, workdir)
        output = out.stdout + out.stderr
        print(f"--- README.md line {block.line}: exit {out.returncode}\n{output[-3000:]}")  # shown on failure
        where = f"README.md line {block.line} ({marker!r}) exited {out.returncode}:\n{text}\n--- output\n{output}"
        assert out.returncode == 0, where
        flat = " ".join(output.split())  # rich wraps long cells
        for want in plan.expect:
            assert want in flat, f"{want!r} not in the output of {where}"
        for name in plan.files:
            assert (workdir / name).is_file(), f"{name} not written by {where}"
        ran.append(marker)
    assert len(ran) == sum(1 for p in PLANS.values() if not p.skip)

    # and a block that fails is caught: the OpenAI example as it was, with KEY from an earlier bash block
    old = _run("python", "from openai import OpenAI\n"
                         f"client = OpenAI(base_url='{stack[README_URL]}/v1', api_key=KEY)\n", workdir)
    assert old.returncode != 0 and "NameError: name 'KEY' is not defined" in old.stderr
    assert _run("bash", "coserve status job_nope\necho not reached", workdir).returncode != 0
