"""What a control request must pass before any of its body is read (ASGI middleware).

FastAPI reads a route's body before it runs the route's dependencies, so a token checked there
comes after an unauthenticated client's body is in memory. The gate answers first, from the
head alone: 401 for a /v1/ path (or the OpenAPI document, unless --open-openapi) without a
credential of this sidecar's, 403 for a rank's or a node's credential on a path it may not ask
(auth.py; the identity goes on in the scope for the handler), 400 for a body framed two ways
(Content-Length and Transfer-Encoding: a proxy in front may read it the other way), 413 for a
declared length over --max-body-bytes. The body itself is counted as the app reads it, and
reading past the cap raises BodyTooLarge (413) there, chunked bodies too.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from fastapi import HTTPException

from parwatch.credentials import Verifier
from parwatch.sidecar.auth import IDENTITY, identify, permit

AUTHENTICATED_PREFIX = "/v1/"
"""Every route under it needs the token (the routes say so too, for the OpenAPI document)."""
OPENAPI_PATH = "/openapi.json"
"""Behind the token too, unless the sidecar runs with --open-openapi: it maps every route a caller may try."""


class BodyTooLarge(HTTPException):
    """The request body passed --max-body-bytes (an HTTPException, so FastAPI answers it as one)."""

    def __init__(self, max_bytes: int):
        super().__init__(413, too_large(max_bytes), {"connection": "close"})


def too_large(max_bytes: int) -> str:
    return f"request body over {max_bytes} bytes (--max-body-bytes)"


class RequestGate:
    def __init__(
        self,
        app,
        token: str | None,
        max_body_bytes: int,
        on_refused: Callable[[str, int, Any], None] | None = None,
        open_openapi: bool = False,
    ):
        self.app, self.max_body_bytes = app, max_body_bytes
        self.verifier = Verifier(token) if token else None
        self.open_openapi = open_openapi
        self.on_refused = on_refused
        """Told (path, status, detail) of every POST answered 4xx/5xx, here or by the app (refusals.py)."""

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if self.on_refused is not None and scope["method"] == "POST":
            send = self._telling(scope["path"], send)
        refused = self.refusal(scope)
        if refused is not None:
            return await send_json(send, *refused)
        limit, seen = self.max_body_bytes, 0

        async def counted():
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > limit:
                raise BodyTooLarge(limit)
            return message

        await self.app(scope, counted, send)

    def _telling(self, path: str, send):
        on_refused, status = self.on_refused, 0

        async def told(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            elif message["type"] == "http.response.body" and status >= 400 and on_refused is not None:
                on_refused(path, status, _detail(message.get("body", b"")))
                status = 0  # once per answer
            await send(message)

        return told

    def refusal(self, scope) -> tuple[int, dict, dict] | None:
        """(status, JSON payload, headers) when the head alone refuses the request."""
        authorization = declared = None
        chunked = False
        for key, value in scope.get("headers") or ():  # the first of each, as Starlette's headers.get reads it
            if key == b"authorization" and authorization is None:
                authorization = value.decode("latin-1")
            elif key == b"content-length" and declared is None:
                declared = value
            elif key == b"transfer-encoding":
                chunked = True
        path = scope["path"]
        if path.startswith(AUTHENTICATED_PREFIX) or (path == OPENAPI_PATH and not self.open_openapi):
            try:
                identity = identify(self.verifier, authorization)
                permit(identity, scope["method"], path)
            except HTTPException as err:
                return err.status_code, {"detail": err.detail}, {**(err.headers or {}), "connection": "close"}
            scope.setdefault("state", {})[IDENTITY] = identity
        if declared is not None and chunked:
            return 400, {"detail": "Content-Length and Transfer-Encoding together: send one"}, {"connection": "close"}
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            return 413, {"detail": too_large(self.max_body_bytes)}, {"connection": "close"}
        return None


def _detail(body: bytes) -> Any:
    try:
        return json.loads(body).get("detail")
    except (ValueError, AttributeError):
        return body[:300].decode("utf-8", "replace")


async def send_json(send, status: int, payload, headers: dict) -> None:
    """A JSON answer through ASGI, encoded as Starlette's JSONResponse encodes it."""
    body = json.dumps(payload, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()
    head = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    head += [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()]
    await send({"type": "http.response.start", "status": status, "headers": head})
    await send({"type": "http.response.body", "body": body})
