"""Every route vLLM 0.32's server registers (for any kind of model, with every flag and its dev mode on) is one coserve
serves or answers by name (``app.api.unserved``), never with a bare 404: a vLLM user who calls one learns why and
what to use instead."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.conftest import ROOT

# vLLM's app as `vllm serve` builds it with every route-registering flag on, once per kind of model (its pooling
# routes need a pooling model's config to register: their paths are in app.api.unserved from its source)
VLLM_ROUTES = r"""
import json, sys
from vllm.entrypoints.launchers.app import build_app
from vllm.entrypoints.launchers.cli_args import make_arg_parser
from vllm.utils.argparse_utils import FlexibleArgumentParser

flags = ["--model", "m", "--enable-tokenizer-info-endpoint", "--enable-fault-tolerance", "--enable-scale-out",
         "--profiler-config", '{"profiler": "torch", "torch_profiler_dir": "/tmp/profile"}']
routes = set()
for tasks in (("generate",), ("embed", "classify", "score"), ("transcription", "realtime")):
    app = build_app(make_arg_parser(FlexibleArgumentParser()).parse_args(flags), tasks)
    for r in app.routes:
        for method in getattr(r, "methods", None) or (["WEBSOCKET"] if "WebSocket" in type(r).__name__ else []):
            routes.add((method, r.path))
json.dump(sorted(routes), sys.stdout)
"""
# FastAPI's own pages, and vLLM's Prometheus mount
FRAMEWORK = {"/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc", "/metrics"}


def vllm_routes() -> set[tuple[str, str]]:
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"}
    out = subprocess.run([sys.executable, "-c", VLLM_ROUTES], env=env, cwd=ROOT, capture_output=True, text=True,
                         timeout=300, check=True).stdout
    return {(m, p) for m, p in json.loads(out) if m != "HEAD" and p not in FRAMEWORK}


def routes_of(app) -> set[tuple[str, str]]:
    """(method, path) of each of ``app``'s routes, a websocket's as WEBSOCKET."""
    return {(m, r.path) for r in app.routes
            for m in getattr(r, "methods", None) or (["WEBSOCKET"] if "WebSocket" in type(r).__name__ else [])}


def test_every_vllm_route_is_served_or_answered_by_name():
    from app.main import create_app

    vllm = vllm_routes()
    assert {("POST", "/v1/chat/completions"), ("WEBSOCKET", "/v1/realtime"), ("GET", "/tokenizer_info"),
            ("POST", "/pause"), ("POST", "/v1/audio/translations")} <= vllm  # the build saw them all
    bare = sorted(vllm - routes_of(create_app()))  # unserved routes are routes too: app.api.unserved's
    assert bare == [], f"vLLM routes coserve neither serves nor names: {bare}"
