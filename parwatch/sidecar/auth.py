"""Who a control request speaks for (parwatch/credentials.py), and what each may ask.

The shared token is the operator's and may ask anything. A rank credential may post its own rank's
summaries, activity and evidence; a node credential its node's digests, cross-node instances and its ranks'
evidence (whose evidence: checked by the route); both may ask GET /v1/whoami (what the collector checks at
attach). Anything else is a 403 naming what it needs.
Constant-time compares throughout (credentials.Verifier).
"""

from __future__ import annotations

from fastapi import HTTPException, Request

from parwatch.credentials import OPERATOR, Identity, Verifier
from parwatch.vocabulary import Speaker

_CHALLENGE = {"WWW-Authenticate": 'Bearer realm="parwatch"'}
WHOAMI = "/v1/whoami"
MAY_ASK: dict[Speaker, frozenset[tuple[str, str]]] = {
    Speaker.RANK: frozenset(
        {("POST", "/v1/ingest"), ("POST", "/v1/activity"), ("POST", "/v1/evidence"), ("GET", WHOAMI)}
    ),
    Speaker.NODE: frozenset(
        {("POST", "/v1/digest"), ("POST", "/v1/instances"), ("POST", "/v1/evidence"), ("GET", WHOAMI)}
    ),
}
"""What a rank's and a node's credential may ask (method, path); the operator's token may ask anything. A rank
posts its own evidence, a node its ranks' (the route checks whose: parwatch.sidecar.activity_api)."""
IDENTITY = "identity"
"""The key of the request's identity in the ASGI scope's "state" (Starlette's request.state.identity)."""


def identify(verifier: Verifier | None, authorization: str | None) -> Identity:
    """Who `authorization` speaks for; 401 with the reason when it is no credential of this sidecar's.

    No verifier means the listener is on loopback and open (config.py enforces it): the operator."""
    if verifier is None:
        return OPERATOR
    if not authorization:
        raise HTTPException(401, "missing Authorization header; send 'Authorization: Bearer <token>'", _CHALLENGE)
    scheme, _, given = authorization.partition(" ")
    if scheme.lower() != "bearer" or not given.strip():
        raise HTTPException(401, "Authorization must be 'Bearer <token>'", _CHALLENGE)
    identity = verifier.identify(given.strip())
    if identity is None:
        raise HTTPException(401, "wrong bearer token", _CHALLENGE)
    return identity


def permit(identity: Identity, method: str, path: str) -> None:
    """403 naming what is needed when `identity` may not ask `method path`."""
    allowed = MAY_ASK.get(identity.speaker)
    if allowed is None or (method, path) in allowed:
        return
    asks = ", ".join(f"{m} {p}" for m, p in sorted(allowed))
    raise HTTPException(
        403,
        f"a credential of {identity.describe()} may ask only {asks}; {method} {path} needs the operator's "
        "token (the sidecar's --token-file)",
    )


def identity_of(request: Request) -> Identity:
    """The identity the gate (gate.RequestGate) found for this request."""
    return request.scope.get("state", {}).get(IDENTITY, OPERATOR)


def bearer_dependency(verifier: Verifier | None):
    """A FastAPI dependency on every authenticated route: the gate has checked the credential before the
    body was read; this one declares it for the OpenAPI document and checks it again for an app
    served without the gate."""

    async def require_token(request: Request) -> None:  # async: a sync dependency costs a thread hop
        if IDENTITY not in request.scope.get("state", {}):
            permit(identify(verifier, request.headers.get("authorization")), request.method, request.url.path)

    return require_token
