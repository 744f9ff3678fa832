"""The app serves its routers' routes as built at import (shared by every app a process makes) exactly as FastAPI's
include_router would have copied them: same routes in the same order, same OpenAPI document."""

from __future__ import annotations

from fastapi import FastAPI


def _include_routers_as_fastapi_does(api: FastAPI) -> FastAPI:
    from app.api import unserved
    from app.main import ROUTERS, _document_errors

    plain = FastAPI(title=api.title, version=api.version, description=api.description)
    plain.router.routes.extend(unserved.routes())
    for router in ROUTERS:
        plain.include_router(router)
    plain.exception_handlers.update(api.exception_handlers)
    _document_errors(plain)
    return plain


def _routes(api: FastAPI) -> list[tuple]:
    return [(type(r).__name__, r.path, sorted(getattr(r, "methods", None) or ()), r.name,
             getattr(r, "unique_id", None), getattr(r, "status_code", None)) for r in api.routes]


def test_the_apps_routes_and_openapi_are_what_include_router_makes(settings):
    from app.main import create_app

    api = create_app(settings)
    plain = _include_routers_as_fastapi_does(api)
    assert _routes(api) == _routes(plain)
    assert api.openapi() == plain.openapi()
