"""FastAPI dependencies as ``Annotated`` aliases: settings, DB session, caller, admin."""

from __future__ import annotations

import hmac
import logging
import time
from collections.abc import Callable, Iterator
from typing import Annotated, TypeVar

from fastapi import Depends, Header, HTTPException, Query, Request, status
from sqlalchemy.orm import Session

from fastapi.concurrency import run_in_threadpool

from app.auth import _MISS, KeyCache, Principal, lookup
from app.db.session import DATABASE_ERRORS, database_unavailable, get_sessionmaker
from app.responses_schemas import LOGPROBS_INCLUDE, refuse_unsupported_include
from app.services.rate_limits import RateLimiter
from app.settings import Settings, get_settings

log = logging.getLogger(__name__)

T = TypeVar("T")


async def settings_dep(request: Request) -> Settings:
    # create_app(settings) stores its settings on the app; the default reads the environment
    return getattr(request.app.state, "settings", None) or get_settings()


SettingsDep = Annotated[Settings, Depends(settings_dep)]


def get_session(settings: SettingsDep) -> Iterator[Session]:
    session = get_sessionmaker(settings.sqlalchemy_url)()
    try:
        yield session
    finally:
        session.close()


# closed once the route has answered, before a streamed body (a job's stream, a download) or a background task runs:
# a session closed after them held its pooled connection as long as they ran, and a burst of streams past the pool's
# size waited out its timeout (a 500)
SessionDep = Annotated[Session, Depends(get_session, scope="function")]


def _lookup(url: str, key: str) -> Principal | None:
    session = get_sessionmaker(url)()
    try:
        return lookup(session, key)
    finally:
        session.close()


def _per_app(request: Request, name: str, make: Callable[[str | None], T]) -> T:
    """The app's one ``name``, made on first use from its Redis URL."""
    state = request.app.state
    value = getattr(state, name, None)
    if value is None:
        settings = getattr(state, "settings", None) or get_settings()
        value = make(settings.redis_url)
        setattr(state, name, value)
    return value


def key_cache(request: Request) -> KeyCache:
    """The app's key cache (``create_app`` makes one per app, with its Redis)."""
    return _per_app(request, "key_cache", KeyCache)


def rate_limiter(request: Request) -> RateLimiter:
    """The app's door to the tenants' rate-limit buckets (``create_app`` makes one per app, its writer's too)."""
    return _per_app(request, "rate_limiter", RateLimiter)


def presented_key(authorization: str | None, x_api_key: str | None) -> str | None:
    """The API key a request sends: ``Authorization: Bearer`` or (Anthropic's SDKs) ``x-api-key``."""
    if authorization and authorization.lower().startswith("bearer "):
        return authorization[7:].strip()
    return x_api_key.strip() if x_api_key else None


def _missing_key(authorization: str | None) -> str:
    """What a request that presents no key is told: both headers a key is taken from (Anthropic's SDKs send
    ``x-api-key``), and where it sent an ``Authorization`` of another form, that only ``Bearer`` is read (its value is
    not echoed: it may be the key itself, sent without the scheme)."""
    if authorization:
        return ("missing API key: the Authorization header is read only as 'Bearer <key>'; "
                "send it so, or send the key as 'x-api-key: <key>'")
    return "missing API key: send 'Authorization: Bearer <key>' or 'x-api-key: <key>'"


async def get_principal(request: Request, authorization: Annotated[str | None, Header()] = None,
                        x_api_key: Annotated[str | None, Header()] = None) -> Principal:
    # async with a cache: the hot submit path needs no worker thread or DB session for auth, only the
    # revocation token's GET (app.auth); settings read here rather than as a sub-dependency (each one
    # costs FastAPI's resolver)
    settings = await settings_dep(request)
    key = presented_key(authorization, x_api_key)
    if key is None:
        raise HTTPException(status.HTTP_401_UNAUTHORIZED, _missing_key(authorization),
                            headers={"WWW-Authenticate": "Bearer"})
    cache = key_cache(request)
    stamp = cache.stamp()  # one GET of the revocation token, before the lookup it vouches for
    principal = cache.get(key, stamp)
    if principal is _MISS:
        since = time.monotonic()
        principal = await run_in_threadpool(_lookup, settings.sqlalchemy_url, key)
        cache.put(key, stamp, principal, since)
    if principal is None:
        raise HTTPException(status.HTTP_401_UNAUTHORIZED, "invalid or revoked API key",
                            headers={"WWW-Authenticate": "Bearer"})
    if principal.tenant_disabled:
        raise HTTPException(status.HTTP_403_FORBIDDEN, "this API key's tenant is disabled; ask the operator")
    return principal  # type: ignore[return-value]


CurrentPrincipal = Annotated[Principal, Depends(get_principal)]


async def require_admin(principal: CurrentPrincipal) -> Principal:
    if not principal.is_admin:
        raise HTTPException(status.HTTP_403_FORBIDDEN, "this route needs an admin API key")
    return principal


AdminPrincipal = Annotated[Principal, Depends(require_admin)]


async def require_metrics_reader(request: Request, authorization: Annotated[str | None, Header()] = None,
                                 x_api_key: Annotated[str | None, Header()] = None) -> None:
    """``GET /metrics`` needs an admin key: its series carry tenants' ids (the 429s per tenant). Where the database
    cannot be reached to look the key up, ``COSERVE_ADMIN_KEY`` (compared in constant time) still reads it, so the
    scrape can report the database down."""
    try:
        await require_admin(await get_principal(request, authorization, x_api_key))
    except DATABASE_ERRORS as exc:
        if not database_unavailable(exc):
            raise
        admin_key, key = (await settings_dep(request)).admin_key, presented_key(authorization, x_api_key)
        if not (admin_key and key and hmac.compare_digest(key.encode(), admin_key.encode())):
            raise HTTPException(status.HTTP_503_SERVICE_UNAVAILABLE, "the database is unavailable to check this "
                                "key; only COSERVE_ADMIN_KEY reads /metrics until it is back") from None


MetricsReader = Depends(require_metrics_reader)


def asks_logprobs(
        include: Annotated[list[str] | None, Query(description=f"only {LOGPROBS_INCLUDE!r}: a response's output "
                                                               "token logprobs, where it kept them")] = None,
        listed: Annotated[list[str] | None, Query(alias="include[]", include_in_schema=False)] = None) -> bool:
    """Whether a retrieval's ``include`` asks for a response's token logprobs (OpenAI's include adds what it names,
    on each read; the official client sends a list as ``include[]``); a value this server cannot give is a 400
    naming it, as at create."""
    asked = [*(include or ()), *(listed or ())]
    refuse_unsupported_include(asked)
    return LOGPROBS_INCLUDE in asked


WithLogprobs = Annotated[bool, Depends(asks_logprobs)]
