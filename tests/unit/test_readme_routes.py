"""Every route README.md and the operator's docs (ops/compose/*.md) name as `METHOD /path` is one the app serves with
that method, so a renamed or removed route cannot stay documented."""

from __future__ import annotations

import re

from tests.conftest import ROOT

# `POST /v1/jobs/{id}/cancel`, `GET /v1/responses/{id}?stream=true`: a method, a path and maybe a query
NAMED_ROUTE = re.compile(r"`(GET|POST|PUT|PATCH|DELETE) (/[^`?\s]*)")
DOCS = ("README.md", *sorted(str(p.relative_to(ROOT)) for p in ROOT.joinpath("ops/compose").glob("*.md")))


def _shape(path: str) -> str:
    """A path with each parameter as ``{}``, whatever the docs or the app call it (``{id}``, ``{model_id:path}``)."""
    return re.sub(r"\{[^}]*\}", "{}", path.rstrip("/") or "/")


def test_every_route_the_docs_name_is_served_with_its_method():
    from app.main import create_app

    served = {(m, _shape(r.path)) for r in create_app().routes for m in getattr(r, "methods", None) or ()}
    for doc in DOCS:
        named = {(m, _shape(p)) for m, p in NAMED_ROUTE.findall(ROOT.joinpath(doc).read_text())
                 if "..." not in p and "[" not in p}  # `GET .../messages`, `GET /v1/jobs[/{id}]`: shorthands
        assert sorted(named - served) == [], f"{doc} names routes the app does not serve"
