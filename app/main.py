"""FastAPI application factory: one router per resource."""

from __future__ import annotations

import gc
import logging
from contextlib import asynccontextmanager
from tempfile import SpooledTemporaryFile

from fastapi import FastAPI, UploadFile
from fastapi.concurrency import run_in_threadpool
from fastapi.routing import APIRoute
from starlette.formparsers import MultiPartParser

from app import output_constraints
from app.api import (admin, anthropic_messages, batches, conversations, errors, files, health, jobs, lora,
                     message_batches, metrics, models, openai_compat, prefix_cache, responses, stored_completions,
                     summarize, tenants, tokenize, unserved, usage, webhooks)
from app.auth import KeyCache, announce_revocation
from app.credentials import ensure_admin_key
from app.db.migrate import schema_problem, upgrade
from app.db.session import get_engine, size_pool
from app.observability.http_metrics import instrument
from app.observability.logs import API_LOG_FORMAT, configure_logging
from app.openai_schemas import OpenAIRoute
from app.request_id import LogRequestId, RequestId
from app.services.job_writer import JobWriter
from app.services.model_info import context_length, get_tokenizer, use_chat_template
from app.services.rate_limits import RateLimiter
from app.summarize.service import RunDrivers
from app.settings import Settings, get_settings

log = logging.getLogger(__name__)

# the OpenAI-compatible resources: an unknown URL under one is answered in OpenAI's error shape
OPENAI_PREFIXES = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/conversations", "/v1/models",
                   "/v1/files", "/v1/batches", "/v1/organization", "/v1/webhook_endpoints", "/v1/webhook_event_types",
                   "/tokenize", "/detokenize", "/tokenizer_info", "/v1/load_lora_adapter", "/v1/unload_lora_adapter",
                   "/invocations")
ANTHROPIC_PREFIXES = ("/v1/messages",)  # Anthropic's SDKs read its error shape there
# the paths Anthropic's SDK calls (anthropic 2.14's resources, beta included): where it sent a request, an error no
# route answered is in its shape (errors.error_api), on those coserve shares with OpenAI's too
ANTHROPIC_SDK_PREFIXES = ("/v1/messages", "/v1/models", "/v1/files", "/v1/skills", "/v1/organizations",
                          "/v1/user_profiles", "/v1/agents", "/v1/sessions", "/v1/environments", "/v1/memory_stores",
                          "/v1/vaults", "/v1/deployments", "/v1/deployment_runs", "/v1/dreams", "/v1/tunnels",
                          "/v1/compliance")


def schema_check(url: str) -> str | None:
    with get_engine(url).connect() as conn:
        return schema_problem(conn)


def schema_at_head(url: str) -> str | None:
    """Migrates a database behind this coserve, as each worker does at start (the API may start first, and would
    fail every request meanwhile); what still keeps it from the schema (None: nothing)."""
    if schema_check(url) is None:
        return None
    try:
        upgrade(url)
    except Exception as exc:  # a database newer than this coserve, or another process migrating it
        log.warning("could not migrate the database: %s", exc)
    return schema_check(url)


@asynccontextmanager
async def lifespan(api: FastAPI):
    # load the tokenizer before the first request instead of during it
    model = api.state.settings.model
    try:
        await run_in_threadpool(get_tokenizer, model)
        await run_in_threadpool(context_length, api.state.settings)
    except Exception as exc:  # the API still serves reads; submissions will report the problem
        log.warning("could not load the tokenizer of %s at start-up: %s", model, exc)
    settings = api.state.settings
    if settings.engine_backend == "vllm":  # constraints are checked (xgrammar compiles them) only for vLLM
        output_constraints.warm_up()
    try:  # every request would fail on a schema behind this code; /readyz says so too
        if problem := await run_in_threadpool(schema_at_head, settings.sqlalchemy_url):
            log.error("%s", problem)
    except Exception as exc:
        log.warning("could not read the database's schema revision: %s", exc)
    if settings.admin_key:  # deployments (compose) pass the admin key in the environment
        try:
            if await run_in_threadpool(ensure_admin_key, settings.sqlalchemy_url, settings.admin_key,
                                       settings.default_tier):  # the variable's earlier key: refused everywhere
                await run_in_threadpool(announce_revocation, settings.redis_url)
        except Exception as exc:
            log.warning("could not register COSERVE_ADMIN_KEY: %s", exc)
    api.state.job_writer = JobWriter(settings, api.state.rate_limiter)
    api.state.run_drivers = RunDrivers()  # a restarted app's new runs get drivers again
    _freeze_start_up_objects()
    try:
        yield
    finally:
        api.state.run_drivers.close()  # a step in progress ends first
        api.state.job_writer.close()
        gc.unfreeze()  # what a stopped app (a test's, say) leaves in cycles can be collected again


_collected_at_start = False  # whether an app of this process has collected before freezing


def _freeze_start_up_objects() -> None:
    """What start-up made (modules, routes, schemas, the tokenizer: ~600k objects) is never garbage: left in the
    collector's oldest generation, each full collection walked it and stalled every request for ~0.4 s
    (ops/bench_submit.py's p99); frozen, a collection walks what requests make (vLLM's server does the same). The
    collection that keeps start-up's garbage out of the freeze runs at the process's first start only: a later app in
    the same process (a test's: 0.8-2 s each with torch loaded) freezes without it, and its stop's unfreeze hands
    what it froze back to the collector."""
    global _collected_at_start
    if not _collected_at_start:
        gc.collect()
        _collected_at_start = True
    gc.freeze()


REPLAY_PIECE_BYTES = 64 * 1024  # a spooled body reaches the app in pieces of this size, as a server's reads do


class BodyLimit:
    """Answers 413 for a body over the limit: by Content-Length up front; a body without one
    (chunked) is read here, counting bytes, spooled (to disk past a megabyte) and handed on in pieces. File uploads
    have their own, larger limit. The 413 is in the shape of the API whose prefix the path lies under, or
    Anthropic's for its SDK on a path it calls (``errors.unrouted_error``: Anthropic's ``request_too_large``,
    OpenAI's ``error``, else ``{"detail"}``)."""

    def __init__(self, app, limit: int, upload_limit: int, upload_prefix: str = "/v1/files") -> None:
        self.app, self.limit, self.upload_limit, self.upload_prefix = app, limit, upload_limit, upload_prefix

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        upload = scope["path"].startswith(self.upload_prefix)
        limit = self.upload_limit if upload else self.limit
        hint = ("upload a smaller file or split it" if upload else
                "split the documents over several runs" if scope["path"].startswith("/v1/summarize") else
                "split it, or upload a file for the Batch API")
        headers = dict(scope["headers"])
        length = headers.get(b"content-length")
        if length is not None:
            if length.isdigit() and int(length) > limit:
                return await self._reject(scope, receive, send, limit, hint)
            return await self.app(scope, receive, send)
        if b"chunked" not in headers.get(b"transfer-encoding", b""):
            return await self.app(scope, receive, send)
        # spooled to disk past a megabyte, as Starlette spools an upload's file: a 200 MiB upload is not held in
        # memory (its pieces, then joined, were two copies of it before the route read it)
        body = UploadFile(SpooledTemporaryFile(max_size=MultiPartParser.spool_max_size))
        try:
            seen = 0
            while True:
                message = await receive()
                if message["type"] != "http.request":
                    return  # the client went away
                seen += len(message.get("body", b""))
                if seen > limit:
                    return await self._reject(scope, receive, send, limit, hint)
                await body.write(message.get("body", b""))
                if not message.get("more_body", False):
                    break
            await body.seek(0)
            return await self.app(scope, self._replay(body, receive), send)
        finally:
            await body.close()

    @staticmethod
    def _replay(body: UploadFile, receive):
        """The spooled body as the app's ``receive``, a piece at a time; then the client's own messages."""
        done = False

        async def replay():
            nonlocal done
            if done:
                return await receive()
            piece = await body.read(REPLAY_PIECE_BYTES)
            done = len(piece) < REPLAY_PIECE_BYTES
            return {"type": "http.request", "body": piece, "more_body": not done}

        return replay

    async def _reject(self, scope, receive, send, limit: int, hint: str):
        message = f"request body over {limit} bytes; {hint}"
        answer = errors.unrouted_error(scope, 413, message)  # the app's prefixes, the client's headers
        return await answer(scope, receive, send)


# the routers the app serves, after unserved's routes and in this order; none has a lifespan, dependency overrides or
# prefix of its own to add at inclusion (a route an APIRouter builds already has its router's prefix, tags, class)
ROUTERS = tuple(module.router for module in (
    health, jobs, openai_compat, responses, anthropic_messages, message_batches, conversations, models, tokenize, lora,
    files, batches, summarize, admin, tenants, usage, webhooks, metrics, stored_completions, prefix_cache)) + (
    openai_compat.sagemaker, webhooks.event_types_router)


def create_app(settings: Settings | None = None) -> FastAPI:
    # as the workers do: the API's own INFO lines are kept, at COSERVE_LOG_LEVEL, each naming its request
    configure_logging(API_LOG_FORMAT, LogRequestId())
    api = FastAPI(title="coserve", version="0.1.0", lifespan=lifespan,
                  description="Co-serving interactive LLM requests and deadline batch jobs.")
    api.state.settings = settings or get_settings()
    settings = api.state.settings
    size_pool(settings.sqlalchemy_url, settings.database_pool)  # before any session of the app's
    # before any request renders chat messages
    use_chat_template(settings.model, settings.chat_template, settings.chat_template_content_format)
    api.state.key_cache = KeyCache(settings.redis_url)  # API keys' lookups, invalidated through Redis
    api.state.rate_limiter = RateLimiter(settings.redis_url)  # the tenants' rate limits (the writer's too)
    api.state.run_drivers = RunDrivers()  # the lifespan's replaces it; this one serves an app run without it
    # an upload's body is its file and the multipart envelope around it: the route holds the file to max_file_bytes
    api.add_middleware(BodyLimit, limit=settings.max_body_bytes,
                       upload_limit=settings.max_file_bytes + files.UPLOAD_ENVELOPE_BYTES)
    api.add_middleware(RequestId)  # outermost: a 413 carries its request id too
    api.state.http_metrics = instrument(api)  # outside the others: a 413 is counted too
    api.router.routes.extend(unserved.routes())  # first: /v1/chat/completions/render is no stored completion's id
    for router in ROUTERS:  # built once at import and shared: include_router would build each route again for
        api.router.routes.extend(router.routes)  # each app (~0.5 s; a test process makes hundreds of apps)
    errors.install(api, openai_prefixes=OPENAI_PREFIXES, anthropic_prefixes=ANTHROPIC_PREFIXES,
                   anthropic_sdk_prefixes=ANTHROPIC_SDK_PREFIXES)
    _document_errors(api)
    return api


def _document_errors(api: FastAPI) -> None:
    """OpenAI-compatible routes answer a validation error with a 400 in OpenAI's shape, never
    FastAPI's 422: take the 422 FastAPI documents for every route with parameters out of theirs.
    Every operation whose body is JSON lists the 415 a body sent as another media type gets
    (``errors.CheckedRoute``)."""
    plain = api.openapi

    def openapi() -> dict:
        if api.openapi_schema is None:
            schema = plain()
            openai_paths = _operations(api, OpenAIRoute)
            checked_paths = _operations(api, errors.CheckedRoute)
            for path, ops in schema.get("paths", {}).items():
                for method, op in ops.items():
                    if (path, method) in openai_paths:
                        op.get("responses", {}).pop("422", None)
                    if (path, method) in checked_paths and "application/json" in op.get("requestBody", {}).get(
                            "content", {}):
                        op.setdefault("responses", {}).setdefault("415", {
                            "description": "The body was not sent as JSON: send it with "
                                           "'Content-Type: application/json'"})
            api.openapi_schema = schema
        return api.openapi_schema

    api.openapi = openapi  # type: ignore[method-assign]


def _operations(api: FastAPI, route_class: type[APIRoute]) -> set[tuple[str, str]]:
    """(path, method) of each operation the routes of ``route_class`` serve, as the OpenAPI document keys them."""
    return {(r.path_format, m.lower()) for r in api.routes if isinstance(r, route_class) for m in r.methods}


def app_factory() -> FastAPI:
    """For ``uvicorn --factory app.main:app_factory`` (settings from the environment)."""
    return create_app()
