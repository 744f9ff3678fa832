"""Error answers shared by every router: their documented shapes, the app-wide handlers,
and the route class that refuses request bodies no handler could process.

Native routes answer ``{"detail": "..."}`` for 4xx, except 422, which is always FastAPI's
list of ``{"loc", "msg", "type"}`` (``unprocessable`` makes one from a message), so a 422
body matches the one schema the OpenAPI document gives it. OpenAI-compatible routes answer
``{"error": {...}}`` (``app.openai_schemas``).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

from fastapi import FastAPI, Request, Response
from fastapi.concurrency import run_in_threadpool
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.params import Form
from fastapi.exception_handlers import http_exception_handler
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from pydantic import BaseModel
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match
from starlette.types import Scope

from app import output_constraints, request_id
from app.db.session import DATABASE_ERRORS, database_unavailable, unavailable_reason
from app.services.workers import grammar_backends
from app.settings import get_settings
from app.wire import find_unstorable, json_safe, unstorable_message

log = logging.getLogger(__name__)


# ---------------------------------------------------------------- documented shapes
class HTTPError(BaseModel):
    """A native route's error (every 4xx but 422)."""

    detail: str


class OpenAIErrorObject(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class OpenAIErrorBody(BaseModel):
    """An OpenAI-compatible route's error."""

    error: OpenAIErrorObject


_WHY = {400: "invalid request", 401: "missing, invalid or revoked API key", 403: "needs an admin API key",
        404: "not found (or another tenant's)", 409: "conflicts with the resource's state",
        413: "request body over the size limit", 422: "invalid request",
        429: "over the tenant's rate limit (retry-after says when to try again)", 503: "not ready",
        500: "the generation failed", 504: "the request's deadline passed"}


def responses(*codes: int) -> dict[int | str, dict[str, Any]]:
    """``responses=`` of a native route answering ``codes``."""
    return {c: {"model": HTTPError, "description": _WHY.get(c, "error")} for c in codes if c != 422}


def openai_responses(*codes: int) -> dict[int | str, dict[str, Any]]:
    """``responses=`` of an OpenAI-compatible route answering ``codes`` (413 too: the body limit answers it in
    OpenAI's shape under its prefixes)."""
    return {c: {"model": OpenAIErrorBody, "description": _WHY.get(c, "error")} for c in codes}


class AnthropicErrorObject(BaseModel):
    type: str
    message: str


class AnthropicErrorBody(BaseModel):
    """An Anthropic-compatible route's error."""

    type: Literal["error"] = "error"
    error: AnthropicErrorObject


def anthropic_responses(*codes: int) -> dict[int | str, dict[str, Any]]:
    """``responses=`` of an Anthropic-compatible route answering ``codes`` (413 too: the body limit answers it in
    Anthropic's shape under its prefix)."""
    return {c: {"model": AnthropicErrorBody, "description": _WHY.get(c, "error")} for c in codes}


def unprocessable(message: str, *loc: str | int) -> RequestValidationError:
    """A 422 in the same shape as pydantic's (``raise unprocessable("...", "body", "tier")``)."""
    return RequestValidationError([{"type": "value_error", "loc": loc or ("body",), "msg": message}])


# ---------------------------------------------------------------- handlers
# FastAPI's words where an upload's field came as text (a multipart part without a filename, a URL-encoded form)
_TEXT_FOR_UPLOAD = "Expected UploadFile"
_SEND_A_FILE_PART = ("send the file as a multipart/form-data part with a filename (curl: -F file=@input.jsonl); "
                    "it came as a text field")


def validation_errors(exc: RequestValidationError) -> list[dict[str, Any]]:
    """The errors of ``exc`` as strict JSON: the NaN or lone surrogate that failed validation
    is echoed as text (JSONResponse refuses both), and a JSON syntax error says where and what."""
    out = []
    for e in map(blamed, exc.errors()):
        if isinstance((e.get("ctx") or {}).get("error"), Exception):  # a validator's ValueError: its text
            e = {**e, "ctx": {**e["ctx"], "error": str(e["ctx"]["error"])}}
        e = jsonable_encoder(e)
        if e.get("type") == "json_invalid" and len(e.get("loc", ())) == 2:  # ("body", <character offset>)
            pos = e["loc"][-1]
            e = {**e, "loc": ["body"], "msg": f"the body is not valid JSON: {(e.get('ctx') or {}).get('error')}"
                                             f" at character {pos}", "input": None}
        if e.get("type") == "value_error" and _TEXT_FOR_UPLOAD in str(e.get("msg")):
            e = {**e, "msg": _SEND_A_FILE_PART, "input": None}  # not the Python class it expected, nor the text
        out.append(json_safe(e))
    return out


async def request_validation_handler(_request: Request, exc: RequestValidationError) -> JSONResponse:
    return JSONResponse({"detail": validation_errors(exc)}, status_code=422)


def allowed_methods(request: Request) -> list[str]:
    """Every method some route of the app answers at this path (Starlette's 405 names only
    the first route that matched the path, e.g. GET but not DELETE of /v1/files/{id})."""
    methods: set[str] = set()
    for route in request.app.router.routes:
        match, _ = route.matches({**request.scope, "method": "GET"}) if hasattr(route, "matches") else (None, {})
        if match in (Match.FULL, Match.PARTIAL) and getattr(route, "methods", None):
            methods |= set(route.methods)
    return sorted(methods | {"OPTIONS"})


async def http_error_handler(request: Request, exc: StarletteHTTPException) -> Response:
    if exc.status_code == 405 and request.method == "OPTIONS":  # the methods this resource answers (RFC 9110 9.3.7)
        return Response(status_code=204, headers={"Allow": ", ".join(allowed_methods(request))})
    api = _api_at(request.app, request.url.path)
    # no route took it (a method or, where a compatible API's SDK calls, a path not served): the SDKs there read their
    # API's shape, as its routes answer (Anthropic's routes leave nothing else here; OpenAI's answer their own 404s)
    unrouted = exc.status_code == 405 or (exc.status_code == 404 and "endpoint" not in request.scope
                                          and error_api(request.scope) is not None)
    if unrouted or api == "anthropic":
        headers = dict(exc.headers or {})
        if exc.status_code == 405:
            headers["Allow"] = ", ".join(allowed_methods(request))
            message = f"{request.method} is not allowed here; use one of {headers['Allow']}"
        elif exc.status_code == 404:
            message = f"Invalid URL ({request.method} {request.url.path})"
        else:
            message = str(exc.detail)
        return unrouted_error(request.scope, exc.status_code, message, headers)
    if exc.status_code == 422 and isinstance(exc.detail, str):  # one shape for every 422
        return await request_validation_handler(request, unprocessable(exc.detail))
    return await http_exception_handler(request, exc)


def anthropic_sdk(headers: Mapping[str, str]) -> bool:
    """Whether Anthropic's SDK sent the request of ``headers``: it sends ``anthropic-version`` on every request, and
    its key as ``x-api-key`` (OpenAI's as a bearer ``Authorization``)."""
    return "anthropic-version" in headers or ("x-api-key" in headers and "authorization" not in headers)


def error_api(scope: Scope) -> Literal["anthropic", "openai"] | None:
    """The API in whose shape an error no route answered goes to the request of ``scope``: Anthropic's where
    Anthropic's SDK sent it (``anthropic_sdk``: it sends ``anthropic-version`` to paths it shares with OpenAI's too,
    e.g. /v1/models) to a path that SDK calls (``install``'s ``anthropic_sdk_prefixes``), else that of the API whose
    prefix the path lies under (``install``'s prefixes), else None: coserve's own paths answer ``{"detail"}`` to
    every client."""
    app, path = scope["app"], scope["path"]
    if _under(path, getattr(app.state, "anthropic_sdk_prefixes", ())) and anthropic_sdk(Headers(scope=scope)):
        return "anthropic"
    return _api_at(app, path)


def unrouted_error(scope: Scope, status_code: int, message: str,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    """An error no route answered (Starlette's 404 for a path, 405 for a method, the body limit's 413) for the
    request of ``scope``, in the shape ``error_api`` says: Anthropic's, OpenAI's, else the native ``{"detail"}``."""
    api = error_api(scope)
    if api == "anthropic":
        return anthropic_error(status_code, message, headers)
    if api == "openai":
        from app.openai_schemas import error_response  # it builds on this module

        answer = error_response(status_code, message, type="invalid_request_error")
        answer.headers.update(headers or {})
        return answer
    return JSONResponse({"detail": message}, status_code=status_code, headers=headers)


def anthropic_error(status_code: int, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    """An answer in Anthropic's error shape outside its routes (``AnthropicRoute.error`` within them): the
    request's id in the body and the ``request-id`` header (docs.anthropic.com/en/api/errors)."""
    from app.anthropic_schemas import error_body  # it builds on this module

    rid = request_id.current()
    body = error_body(status_code, message) | {"request_id": rid}
    # json_safe: a path may hold what no JSON encoder writes (a lone surrogate)
    return JSONResponse(json_safe(body), status_code=status_code,
                        headers=(headers or {}) | ({"request-id": rid} if rid else {}))


async def server_error_handler(request: Request, exc: Exception) -> Response:
    """A 500 (a defect: no input should reach it) names the request's id in its body and header, and the log line
    with the traceback names it too, so a client's report leads to it. In the shape of the route's API (OpenAI's,
    Anthropic's: the route's own ``error``), else the native one."""
    from app.openai_schemas import OpenAIError, OpenAIRoute  # it builds on this module

    rid = request_id.current() or "-"
    log.error("request %s (%s %s) failed", rid, request.method, request.url.path, exc_info=exc)
    message = f"The server had an error while processing your request (request id {rid}); report it with this id"
    route = request.scope.get("route")
    answer = (route.error_to(request, OpenAIError(500, message, type="server_error")) if isinstance(route, OpenAIRoute)
              else JSONResponse({"detail": message}, status_code=500))
    answer.headers["x-request-id"] = rid
    return answer


# how long a client is asked to wait before it retries while the database is unavailable (OpenAI's and Anthropic's
# SDKs wait what retry-after says, up to a minute); a pool's burst or a failover is over in seconds
DATABASE_RETRY_AFTER_S = 5
# while the database stays unavailable, one log line per this many seconds says so, with how many requests it refused
OUTAGE_LOG_INTERVAL_S = 60.0


class OutageLog:
    """Logs the database's unavailability once, then once a minute with the count of the requests refused meanwhile
    (a traceback per request filled the log during an outage, and said 'defect' where there was none)."""

    def __init__(self, interval_s: float = OUTAGE_LOG_INTERVAL_S) -> None:
        self.interval_s, self.refused, self.logged_at = interval_s, 0, None
        self._lock = threading.Lock()

    def note(self, exc: BaseException) -> None:
        with self._lock:
            self.refused += 1
            now = time.monotonic()
            if self.logged_at is not None and now - self.logged_at < self.interval_s:
                return
            refused, self.refused, self.logged_at = self.refused, 0, now
        log.warning("the database is unavailable (%s: %s); %d request(s) answered 503 since the last report",
                    type(exc).__name__, str(getattr(exc, "orig", None) or exc).partition("\n")[0], refused)


async def database_unavailable_handler(request: Request, exc: Exception) -> Response:
    """A 503 with ``retry-after`` where the database cannot serve now (``database_unavailable``: busy, locked, down,
    its pool exhausted): the client's SDK retries it, and the outage is logged once (``OutageLog``), not as a defect.
    Any other database error is one: it goes on to ``server_error_handler``'s 500."""
    if not database_unavailable(exc):
        raise exc
    from app.openai_schemas import OpenAIError, OpenAIRoute  # it builds on this module

    request.app.state.outage_log.note(exc)
    rid = request_id.current() or "-"
    message = (f"the database is unavailable ({unavailable_reason(exc)}); "
               f"retry in {DATABASE_RETRY_AFTER_S} seconds (request id {rid})")
    headers = {"retry-after": str(DATABASE_RETRY_AFTER_S), "x-request-id": rid}
    route = request.scope.get("route")
    if isinstance(route, OpenAIRoute):
        answer = route.error_to(request, OpenAIError(503, message, type="server_error", code="database_unavailable"))
    else:
        answer = unrouted_error(request.scope, 503, message)
    answer.headers.update(headers)
    return answer


def stream_failure(exc: Exception, job_id: str, read_at: str) -> tuple[int, str]:
    """The status and message a job's stream that failed on the way ends with (the job goes on: ``read_at`` reads
    it), and its one log line: where the database was unavailable (``database_unavailable``) a 503 saying so, without
    a traceback; else a 500 and the traceback of the defect."""
    if database_unavailable(exc):
        log.warning("the stream of job %s stopped: the database is unavailable (%s)", job_id, type(exc).__name__)
        return 503, (f"the database is unavailable ({unavailable_reason(exc)}), so the stream stopped; the job goes "
                     f"on: read it in {DATABASE_RETRY_AFTER_S} seconds ({read_at})")
    log.error("the stream of job %s failed", job_id, exc_info=exc)
    return 500, f"the stream failed; the job goes on ({read_at})"


def _api_at(app: Any, path: str) -> Literal["anthropic", "openai"] | None:
    """The compatible API whose prefix ``path`` lies under (``install``'s arguments), or None on a native path."""
    for api in ("anthropic", "openai"):
        if _under(path, getattr(app.state, f"{api}_prefixes", ())):
            return api  # type: ignore[return-value]
    return None


def _under(path: str, prefixes: Sequence[str]) -> bool:
    return any(path == p or path.startswith(p + "/") for p in prefixes)


def install(app: FastAPI, openai_prefixes: Sequence[str] = (), anthropic_prefixes: Sequence[str] = (),
            anthropic_sdk_prefixes: Sequence[str] = ()) -> None:
    """The handlers above; ``openai_prefixes``, ``anthropic_prefixes``: paths whose unmatched URLs answer in
    OpenAI's or Anthropic's shape; ``anthropic_sdk_prefixes``: the paths Anthropic's SDK calls, where its requests
    are answered in Anthropic's shape (``error_api``)."""
    app.state.openai_prefixes = tuple(openai_prefixes)
    app.state.anthropic_prefixes = tuple(anthropic_prefixes)
    app.state.anthropic_sdk_prefixes = tuple(anthropic_sdk_prefixes)
    app.add_exception_handler(RequestValidationError, request_validation_handler)  # type: ignore[arg-type]
    app.add_exception_handler(StarletteHTTPException, http_error_handler)  # type: ignore[arg-type]
    app.state.outage_log = OutageLog()
    for database_error in DATABASE_ERRORS:  # which of them say the database is unavailable: the handler's call
        app.add_exception_handler(database_error, database_unavailable_handler)
    app.add_exception_handler(Exception, server_error_handler)


# ---------------------------------------------------------------- routes
def _media_type(request: Request) -> str:
    """The request's media type, lower-cased, without parameters ("" when it has no Content-Type)."""
    return (request.headers.get("content-type") or "").split(";", 1)[0].strip().lower()


def _is_json(media_type: str) -> bool:
    """Whether FastAPI parses a body of ``media_type`` as JSON: ``application/json`` and ``application/*+json``."""
    return media_type == "application/json" or (media_type.startswith("application/") and media_type.endswith("+json"))


def unsupported_media_type(media_type: str) -> StarletteHTTPException:
    """The 415 for a JSON route's body sent as another media type (vLLM's OpenAI server refuses it too:
    ``validate_json_request``): ``curl -d`` sends a form's, and FastAPI reads no body without a Content-Type."""
    sent = f"it was sent as {media_type!r}" if media_type else "it was sent without a Content-Type"
    return StarletteHTTPException(415, f"the body must be JSON sent with 'Content-Type: application/json'; {sent}")


class CheckedRoute(APIRoute):
    """Refuses, with a 415, a body but a form's (an upload's) sent without a JSON Content-Type; with a 422 naming the
    field, a NUL character in the path or the query, and a JSON body holding a lone surrogate or a NUL anywhere (in
    a field no model checks too: metadata, tools, a dict key). The body is parsed once: Starlette caches it for the
    route's own parsing. A structured output's constraint in the body compiles off the event loop
    (``app.output_constraints.known``)."""

    def get_route_handler(self) -> Callable:
        handler = super().get_route_handler()
        # whether the route reads a form (an upload's multipart body), not JSON: known once the route is built
        takes_form = self.body_field is not None and isinstance(self.body_field.field_info, Form)

        async def checked(request: Request) -> Response:
            for where, params in (("path", request.path_params.items()), ("query", request.query_params.multi_items())):
                for name, value in params:
                    if (found := find_unstorable(value)) is not None:  # an id no column holds (a NUL)
                        raise RequestValidationError([{"type": "string_unicode", "loc": (where, name),
                                                       "msg": unstorable_message(found[1]), "input": None}])
            if request.method in ("POST", "PUT", "PATCH") and not takes_form and await request.body():
                # a body-less POST (a cancel) needs no Content-Type
                if not _is_json(media_type := _media_type(request)):
                    raise unsupported_media_type(media_type)
                try:
                    body = await request.json()
                except json.JSONDecodeError:
                    body = None  # the route reports it, as it would have
                except UnicodeDecodeError as exc:  # FastAPI would answer an undocumented 400 with no hint
                    raise RequestValidationError([{
                        "type": "json_invalid", "loc": ("body",), "input": None,
                        "msg": f"the body is not valid JSON: it is not UTF-8 text (byte {exc.start})"}]) from None
                found = find_unstorable(body)
                if found is not None:
                    where, char = found
                    raise RequestValidationError([{"type": "string_unicode", "loc": ("body", *where),
                                                   "msg": unstorable_message(char), "input": None}])
                if constraints := output_constraints.carried(body):
                    # FastAPI validates the body on the event loop: its constraints compile here in a thread
                    # (seconds at xgrammar's first import), with the backends of the workers' engines, and
                    # validation reads their outcomes; a body with none hops nowhere
                    backends, answers = await run_in_threadpool(_checked_constraints, request, constraints)
                    with output_constraints.under(backends), output_constraints.known(answers):
                        return await handler(request)
            return await handler(request)

        return checked


def _checked_constraints(request: Request, constraints: list[output_constraints.Constraint],
                         ) -> tuple[tuple[str, ...], dict[output_constraints.Constraint, str | None]]:
    """The backends the live workers' engines compile structured outputs with (``workers.grammar_backends``), and
    each of ``constraints``' outcome under them (``output_constraints.outcomes``)."""
    backends = grammar_backends(getattr(request.app.state, "settings", None) or get_settings())
    return backends, output_constraints.outcomes(constraints, backends)


def blamed(error: dict[str, Any]) -> dict[str, Any]:
    """A pydantic error whose location names the field a model validator blamed (``FieldProblem``)."""
    field = getattr((error.get("ctx") or {}).get("error"), "field", None)
    return {**error, "loc": (*error.get("loc", ()), field)} if isinstance(field, str) else error


def loc_param(loc: Sequence[Any]) -> str | None:
    """``("body", "messages", 0, "content")`` -> ``"messages.0.content"``."""
    parts = [str(p) for p in loc if p not in ("body", "query", "path", "header")]
    return ".".join(parts) or None
