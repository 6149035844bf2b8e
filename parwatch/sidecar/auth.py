"""Bearer-token check for the control listener (constant-time compare)."""

from __future__ import annotations

import hmac

from fastapi import HTTPException, Request

_CHALLENGE = {"WWW-Authenticate": 'Bearer realm="parwatch"'}


def check_bearer(expected: str | None, authorization: str | None) -> None:
    """Raise 401 with the reason unless `authorization` carries the expected token.

    No expected token means the listener is on loopback and open (config.py enforces it).
    """
    if not expected:
        return
    if not authorization:
        raise HTTPException(401, "missing Authorization header; send 'Authorization: Bearer <token>'", _CHALLENGE)
    scheme, _, given = authorization.partition(" ")
    if scheme.lower() != "bearer" or not given.strip():
        raise HTTPException(401, "Authorization must be 'Bearer <token>'", _CHALLENGE)
    if not hmac.compare_digest(given.strip().encode(), expected.encode()):
        raise HTTPException(401, "wrong bearer token", _CHALLENGE)


def bearer_dependency(expected: str | None):
    """A FastAPI dependency enforcing `expected` on every route that declares it."""

    async def require_token(request: Request) -> None:  # async: a sync dependency costs a thread hop
        check_bearer(expected, request.headers.get("authorization"))

    return require_token
