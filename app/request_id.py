"""``x-request-id`` on every answer, as OpenAI's API sends it (its SDKs show it as ``_request_id``) and as
``vllm serve --enable-request-id-headers`` does: the client's own ``X-Request-Id`` echoed, else a new one."""

from __future__ import annotations

import uuid

HEADER = b"x-request-id"
MAX_CHARS = 256  # a longer client id is replaced, not echoed


class RequestId:
    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        given = next((v for k, v in scope["headers"] if k == HEADER), b"")
        printable = 0 < len(given) <= MAX_CHARS and all(32 <= c < 127 for c in given)  # a header value may carry it
        request_id = given if printable else uuid.uuid4().hex.encode()

        async def with_id(message):
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), (HEADER, request_id)]
            return await send(message)

        return await self.app(scope, receive, with_id)
