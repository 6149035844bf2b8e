"""HTTP faces of the sidecar: the read-only metrics app and the control app.

The control app turns every bad request into a 4xx whose reason names the field (422
for a body or query that fails validation), and its OpenAPI document lists exactly the
answers it gives; the metrics app serves only /metrics and /healthz. The token, framing and
declared size are checked before any body is read (gate.py).

The posts a leader takes from every node each second (/v1/digest, and /v1/activity beside it)
are answered by HotPosts, ahead of FastAPI's routing, dependency injection and response
classes, which cost more than their handlers: at 2,048 digests a second the leader could not
keep up without it (docs/benchmarks.md). The FastAPI routes of the same handlers document them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Awaitable, Mapping
from typing import Annotated, Any, Protocol

from fastapi import Depends, FastAPI, HTTPException, Path, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Receive, Scope, Send

from parwatch import __version__, wire
from parwatch.credentials import OPERATOR, Identity, Verifier
from parwatch.guardrails.engine import DirectiveDelivered
from parwatch.guardrails.engine_store import StorageFault
from parwatch.sidecar import activity_api
from parwatch.sidecar.auth import IDENTITY, WHOAMI, bearer_dependency, identity_of
from parwatch.sidecar.bodies import body, documented, schema
from parwatch.sidecar.gate import BodyTooLarge, RequestGate, send_json
from parwatch.sidecar.pid_owner import Connection, connection_of
from parwatch.sidecar.rank_gauges import exposition
from parwatch.sidecar.service import Sidecar
from parwatch.sidecar.store import Refused
from parwatch.vocabulary import jsonable
from parwatch.wire.bodies import AlertmanagerPayload, CancelRequest, ControlRequest
from parwatch.wire.bounds import MAX_STEP
from parwatch.wire.codec import BadRecord, decode
from parwatch.wire.log import LOG_TYPES
from parwatch.wire.steps import IngestBody

log = logging.getLogger(__name__)


BODY_NEVER_CAME = "the body never arrived whole (the client went away, or it took over --body-timeout-seconds)"
SMALL_BODY = 64 * 1024
"""Bodies up to this size (a rank's usual post) are validated on the loop; larger ones in a thread
(an 8 MB post takes some hundreds of ms to validate)."""


def _reason(errors) -> str:
    """One line naming each of the first problems (FastAPI's error dicts: a query or path parameter)."""
    problems = []
    for err in list(errors)[:5]:
        loc = [str(p) for p in err.get("loc", ()) if p != "body"]
        if err.get("type") == "json_invalid":
            problems.append(f"body is not valid JSON: {err.get('ctx', {}).get('error', err.get('msg'))}")
            continue
        field = ".".join(loc) or "body"
        problems.append(f"{field}: {err.get('msg')}")
    return "; ".join(problems)[:4000]


Responses = dict[int | str, dict[str, Any]]
"""A route's documented answers (FastAPI's `responses`): status -> model and description."""

_PROBLEM: dict[str, Any] = {"content": schema("Problem")}
_AUTH: Responses = {401: {**_PROBLEM, "description": "missing or wrong bearer token"}}
_INVALID: Responses = {422: {**_PROBLEM, "description": "invalid body or query; detail names the field"}}
_TOO_LARGE: Responses = {413: {**_PROBLEM, "description": "body over --max-body-bytes"}}
_FORBIDDEN: Responses = {
    403: {**_PROBLEM, "description": "a rank's or a node's credential speaking for another rank, node or run"}
}
_UNAVAILABLE: Responses = {
    503: {**_PROBLEM, "description": "the state dir could not be written: nothing was decided; retry"}
}


def _healthz(app: FastAPI) -> None:
    # pid: a launcher waiting for its own sidecar must not take another process's answer on a port that
    # was free a moment ago (CI on 3c6403a: a test talked to another test's sidecar and got its 401).
    @app.get("/healthz", include_in_schema=False)
    async def healthz():
        return {"ok": True, "pid": os.getpid()}


def create_metrics_app(sidecar: Sidecar) -> FastAPI:
    app = FastAPI(title="parwatch metrics", docs_url=None, redoc_url=None, openapi_url=None)
    _healthz(app)

    @app.get("/metrics")
    async def metrics(request: Request):
        body, content_type = await exposition(sidecar.registry, sidecar.rank_gauges, request.headers.get("accept", ""))
        return Response(body, media_type=content_type)

    return app


def create_control_app(sidecar: Sidecar) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app):
        sidecar.defer_writes()  # from here on, disk writes happen in the writer thread
        task = asyncio.create_task(_no_data_ticker(sidecar))
        requeuer = asyncio.create_task(sidecar.requeue.serve(sidecar.persist, sidecar.engine.record_finding))
        try:
            yield
        finally:
            task.cancel()
            requeuer.cancel()
            sidecar.close()  # persist the last second of rule counters on a clean stop

    token = sidecar.config.token
    auth = [Depends(bearer_dependency(Verifier(token) if token else None))]
    app = FastAPI(
        title="parwatch sidecar control",
        version=__version__,
        description="Ingest step summaries, steer the run (pause/resume/rollback), receive Alertmanager webhooks.",
        docs_url=None,
        redoc_url=None,
        lifespan=lifespan,
    )
    hot: dict[str, PostHandler] = {}
    app.add_middleware(HotPosts, posts=hot)
    app.add_middleware(
        RequestGate,
        token=token,
        max_body_bytes=sidecar.config.max_body_bytes,
        on_refused=sidecar.refusals.note,
        open_openapi=sidecar.config.open_openapi,
    )
    _healthz(app)

    @app.exception_handler(RequestValidationError)
    async def invalid(request, exc):
        return JSONResponse({"detail": _reason(exc.errors())}, status_code=422)

    @app.exception_handler(ClientDisconnect)
    async def gone(request, exc):
        # A rank that died mid-post (a crash, a kill), or a body past its deadline: nothing of it was stored.
        log.info("%s %s: the client went away before its body arrived", request.method, request.url.path)
        return JSONResponse(
            {"detail": "the body never arrived whole (client gone, or past --body-timeout-seconds)"}, 400
        )

    @app.exception_handler(StorageFault)
    async def unwritable(request, exc):
        # The state dir failed a write: what the request made was undone (no decision, no directive).
        return JSONResponse({"detail": str(exc)}, status_code=503, headers={"Retry-After": "5"})

    @app.post(
        "/v1/ingest",
        dependencies=auth,
        openapi_extra=documented(IngestBody),
        responses={
            200: {
                "description": "accepted; the directive rank 0 applies next, if any",
                "content": schema("IngestResponse"),
            },
            **_AUTH,
            **_FORBIDDEN,
            **_TOO_LARGE,
            **_INVALID,
            409: {
                **_PROBLEM,
                "description": "the summary does not fit the run (its world, a live run, an ended run, an earlier process)",
            },
            429: {**_PROBLEM, "description": "more ranks or run ids than --max-ranks / --max-runs"},
            **_UNAVAILABLE,
        },
    )
    async def ingest(request: Request):
        """Store step summaries; answer with the directive rank 0 should apply, if any."""
        raw = await request.body()
        status, payload = await ingest_raw(raw, client=connection_of(request.scope), identity=identity_of(request))
        return JSONResponse(payload, status_code=status)

    async def ingest_raw(raw: bytes, *, client: Connection | None, identity: Identity | None) -> tuple[int, object]:
        """The ingest route's work, on the raw body: every rank posts here every step, so HotPosts answers it
        without FastAPI's routing, dependencies and middleware (about 60% of a post's CPU in a profile at
        64 ranks); the route above is what the OpenAPI document describes."""
        try:
            if len(raw) <= SMALL_BODY:
                posted = decode(raw, IngestBody, dotted=True)
            else:
                posted = await asyncio.to_thread(decode, raw, IngestBody, dotted=True)
        except BadRecord as err:
            return 422, {"detail": str(err)}
        try:
            return 200, await sidecar.ingest_async(posted, identity or OPERATOR, client)
        except Refused as err:
            return err.status, {"detail": str(err)}

    hot["/v1/ingest"] = ingest_raw

    @app.post(
        "/v1/control",
        dependencies=auth,
        openapi_extra=documented(ControlRequest),
        responses={
            **_AUTH,
            **_TOO_LARGE,
            **_INVALID,
            400: {**_PROBLEM, "description": "the engine refused it (e.g. no such checkpoint)"},
            **_UNAVAILABLE,
        },
    )
    async def control(req: ControlRequest = Depends(body(ControlRequest))):
        """Operator pause / resume / rollback; returns the decision record."""
        epoch = sidecar.engine.epoch
        try:
            decision = sidecar.control(req)
        except ValueError as err:
            raise HTTPException(400, str(err)) from err
        await sidecar.persist(epoch)
        return JSONResponse(jsonable(decision))

    @app.post(
        "/v1/directives/{directive_id}/cancel",
        dependencies=auth,
        openapi_extra=documented(CancelRequest),
        responses={
            **_AUTH,
            **_TOO_LARGE,
            **_INVALID,
            404: {**_PROBLEM, "description": "no outstanding directive with that id"},
            409: {**_PROBLEM, "description": "already delivered to the run: it will be applied"},
            **_UNAVAILABLE,
        },
    )
    async def cancel(
        directive_id: Annotated[int, Path(ge=1, lt=MAX_STEP)], req: CancelRequest = Depends(body(CancelRequest))
    ):
        """Withdraw a directive not yet delivered to the run; returns the cancel record."""
        epoch = sidecar.engine.epoch
        try:
            record = sidecar.cancel(directive_id, req.requested_by or "operator")
        except DirectiveDelivered as err:
            return JSONResponse({"detail": str(err), "directive": err.directive}, status_code=409)
        except ValueError as err:
            raise HTTPException(404, str(err)) from err
        await sidecar.persist(epoch)
        return JSONResponse(jsonable(record))

    @app.post(
        "/v1/alerts",
        dependencies=auth,
        openapi_extra=documented(AlertmanagerPayload),
        responses={**_AUTH, **_TOO_LARGE, **_INVALID, **_UNAVAILABLE},
    )
    async def alerts(payload: AlertmanagerPayload = Depends(body(AlertmanagerPayload))) -> dict[str, int]:
        """Alertmanager webhook (payload version 4): firing alerts labelled parwatch_action act once."""
        epoch = sidecar.engine.epoch
        acted = len(sidecar.alert_webhook(payload))
        await sidecar.persist(epoch)
        return {"acted": acted}

    @app.get("/v1/status", dependencies=auth, responses={**_AUTH, **_FORBIDDEN})
    async def status():
        return JSONResponse(sidecar.status())

    @app.get(WHOAMI, dependencies=auth, responses=_AUTH)
    async def whoami(request: Request):
        """Who this request's credential speaks for (a collector checks its own at attach)."""
        who = identity_of(request)
        return {"speaker": who.speaker, "run_id": who.run_id, "rank": who.rank, "node": who.node}

    hub = activity_api.install(app, sidecar)  # /v1/activity, /v1/digest, /v1/hang and the hang loop
    hot.update(hub.posts)

    decision_log = {
        "description": "the newest records of the decision log, newest last (parwatch/wire/log.py)",
        "content": {
            "application/json": {
                "schema": {
                    "type": "array",
                    "items": {"anyOf": [{"$ref": f"#/components/schemas/{r.__name__}"} for r in LOG_TYPES]},
                }
            }
        },
    }

    @app.get("/v1/decisions", dependencies=auth, responses={200: decision_log, **_AUTH, **_INVALID})
    async def decisions(limit: int = Query(50, ge=1, le=10_000)):
        return JSONResponse(sidecar.decisions(limit))

    def openapi():
        if app.openapi_schema is None:
            doc = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
            # Every body is read raw and decoded into its record in one call: the records describe them.
            components = doc.setdefault("components", {}).setdefault("schemas", {})
            components.update(wire.openapi_components())  # with /v1/activity's and /v1/digest's (activity_api)
            doc["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
            for operations in doc["paths"].values():
                for op in operations.values():
                    if "401" in op.get("responses", {}):
                        op["security"] = [{"bearer": []}]
            app.openapi_schema = doc
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]  # FastAPI's documented way to extend the schema
    return app


class PostHandler(Protocol):
    """A raw-body POST handler (activity_api's `hub.posts`): answers (status, JSON payload)."""

    def __call__(
        self, raw: bytes, *, client: Connection | None, identity: Identity | None
    ) -> Awaitable[tuple[int, object]]: ...


class HotPosts:
    """ASGI middleware: POSTs to a path in `posts` (path -> async handler of the raw body returning
    (status, JSON payload)) are answered here, the rest go on to the app. Behind RequestGate, so
    the token and the body cap hold as for every route."""

    def __init__(self, app: ASGIApp, posts: Mapping[str, PostHandler]):
        self.app, self.posts = app, posts

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        handler = self.posts.get(scope["path"]) if scope["type"] == "http" and scope["method"] == "POST" else None
        if handler is None:
            return await self.app(scope, receive, send)
        chunks: list[bytes] = []
        more = True
        try:
            while more:
                message = await receive()
                if message["type"] != "http.request":  # the client went away, or its body passed its deadline
                    log.info("POST %s: the client went away before its body arrived", scope["path"])
                    return await send_json(send, 400, {"detail": BODY_NEVER_CAME}, {})
                chunks.append(message.get("body", b""))
                more = message.get("more_body", False)
        except BodyTooLarge as err:
            return await send_json(send, err.status_code, {"detail": err.detail}, {})
        identity = scope.get("state", {}).get(IDENTITY)  # the gate's: who the credential speaks for
        try:  # the connection proves a post's pid
            status, payload = await handler(b"".join(chunks), client=connection_of(scope), identity=identity)
        except StorageFault as err:  # as the app's handler answers it: nothing the post made was kept
            return await send_json(send, 503, {"detail": str(err)}, {"Retry-After": "5"})
        await send_json(send, status, payload, {})


async def _no_data_ticker(sidecar: Sidecar) -> None:
    while True:
        await asyncio.sleep(sidecar.config.no_data_interval_seconds)
        try:
            epoch = sidecar.engine.epoch
            sidecar.tick()
            await sidecar.persist(epoch)
        except StorageFault as err:  # told once by the store; the findings are judged again once it writes
            log.debug("no-data check not recorded: %s", err)
        except Exception:  # a bug in one check must not stop the next ones
            log.exception("no-data check failed")
