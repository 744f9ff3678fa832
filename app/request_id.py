"""``x-request-id`` on every answer, as OpenAI's API sends it (its SDKs show it as ``_request_id``) and as
``vllm serve --enable-request-id-headers`` does: the client's own ``X-Request-Id`` echoed, else a new one.

While a request is served its id is ``current()``: the jobs it submits keep it (``Job.request_id``), and the API's
log lines and a 500's body name it, so what a client reports can be found."""

from __future__ import annotations

import logging
import uuid
from contextvars import ContextVar

HEADER = b"x-request-id"
MAX_CHARS = 256  # a longer client id is replaced, not echoed
_current: ContextVar[str | None] = ContextVar("request_id", default=None)


def current() -> str | None:
    """The id of the request being served (the route's threads see it too); None outside one."""
    return _current.get()


class LogRequestId(logging.Filter):
    """Gives each log record the id of the request it was written in (``-`` outside one), for ``%(request_id)s``."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.request_id = _current.get() or "-"
        return True


class RequestId:
    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        given = next((v for k, v in scope["headers"] if k == HEADER), b"")
        printable = 0 < len(given) <= MAX_CHARS and all(32 <= c < 127 for c in given)  # a header value may carry it
        request_id = given if printable else uuid.uuid4().hex.encode()
        # left set where the app raised: the 500's handler, outside this middleware, names it (app.api.errors)
        _current.set(request_id.decode("ascii"))

        async def with_id(message):
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), (HEADER, request_id)]
            return await send(message)

        return await self.app(scope, receive, with_id)
