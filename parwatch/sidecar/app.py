"""HTTP faces of the sidecar: the read-only metrics app and the control app.

The control app turns every bad request into a 4xx whose reason names the field; the
metrics app serves only /metrics and /healthz.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging

from typing import Annotated

from fastapi import Depends, FastAPI, HTTPException, Path, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response

from parwatch import __version__
from parwatch.sidecar import activity_api
from parwatch.sidecar.auth import bearer_dependency
from parwatch.sidecar.exposition import choose, encode_async, encode_openmetrics, encode_text
from parwatch.sidecar.models import AlertmanagerPayload, CancelRequest, ControlRequest, IngestBody, IngestResponse
from parwatch.sidecar.service import Sidecar, jsonable

log = logging.getLogger(__name__)


class BodyLimit:
    """ASGI middleware: 413 for bodies over the cap, counted as they arrive (chunked ones too)."""

    def __init__(self, app, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or ()).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            return await self._too_large(send)
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                return  # client went away
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                return await self._too_large(send)
            chunks.append(chunk)
            more = message.get("more_body", False)
        body, replayed = b"".join(chunks), False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _too_large(self, send):
        payload = json.dumps({"detail": f"request body over {self.max_bytes} bytes (--max-body-bytes)"}).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
        await send({"type": "http.response.start", "status": 413, "headers": headers})
        await send({"type": "http.response.body", "body": payload})


def _reason(exc: RequestValidationError) -> str:
    problems = []
    for err in exc.errors()[:5]:
        loc = [str(p) for p in err.get("loc", ()) if p != "body"]
        if err.get("type") == "json_invalid":
            problems.append(f"body is not valid JSON: {err.get('ctx', {}).get('error', err.get('msg'))}")
            continue
        field = ".".join(loc) or "body"
        problems.append(f"{field}: {err.get('msg')}")
    return "; ".join(problems)


def _healthz(app: FastAPI) -> None:
    @app.get("/healthz", include_in_schema=False)
    async def healthz():
        return {"ok": True}


def create_metrics_app(sidecar: Sidecar) -> FastAPI:
    app = FastAPI(title="parwatch metrics", docs_url=None, redoc_url=None, openapi_url=None)
    _healthz(app)

    @app.get("/metrics")
    async def metrics(request: Request):
        encoder, content_type = choose(request.headers.get("accept", ""))
        if encoder in (encode_text, encode_openmetrics):
            # On the loop, in slices of a few ms: ingest keeps flowing during a 1024-rank scrape.
            body = await encode_async(sidecar.registry, encoder)
        else:
            body = encoder(sidecar.registry)  # an unusual Accept header: the library's encoder
        return Response(body, media_type=content_type)

    return app


def create_control_app(sidecar: Sidecar) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app):
        task = asyncio.create_task(_no_data_ticker(sidecar))
        try:
            yield
        finally:
            task.cancel()
            sidecar.engine.close()  # persist the last second of rule counters on a clean stop

    auth = [Depends(bearer_dependency(sidecar.config.token))]
    app = FastAPI(
        title="parwatch sidecar control",
        version=__version__,
        description="Ingest step summaries, steer the run (pause/resume/rollback), receive Alertmanager webhooks.",
        docs_url=None, redoc_url=None, lifespan=lifespan,
    )
    app.add_middleware(BodyLimit, max_bytes=sidecar.config.max_body_bytes)
    _healthz(app)

    @app.exception_handler(RequestValidationError)
    async def bad_request(request, exc):
        return JSONResponse({"detail": _reason(exc)}, status_code=400)

    @app.post("/v1/ingest", dependencies=auth, response_model=IngestResponse,
              responses={400: {"description": "invalid body; detail names the field"}, 401: {}, 413: {}})
    async def ingest(body: IngestBody):
        """Store step summaries; answer with the directive rank 0 should apply, if any."""
        return JSONResponse(sidecar.ingest(body))

    @app.post("/v1/control", dependencies=auth, responses={400: {}, 401: {}})
    async def control(body: ControlRequest):
        """Operator pause / resume / rollback; returns the decision record."""
        try:
            return JSONResponse(jsonable(sidecar.control(body)))
        except ValueError as err:
            raise HTTPException(400, str(err)) from err

    @app.post("/v1/directives/{directive_id}/cancel", dependencies=auth,
              responses={401: {}, 404: {"description": "no outstanding directive with that id"}})
    async def cancel(directive_id: Annotated[int, Path(ge=1, lt=2**53)], body: CancelRequest):
        """Withdraw a directive the run has not handled yet; returns the cancel record."""
        try:
            return JSONResponse(jsonable(sidecar.cancel(directive_id, body.requested_by or "operator")))
        except ValueError as err:
            raise HTTPException(404, str(err)) from err

    @app.post("/v1/alerts", dependencies=auth, responses={400: {}, 401: {}})
    async def alerts(body: AlertmanagerPayload):
        """Alertmanager webhook (payload version 4): firing alerts labelled parwatch_action act once."""
        return {"acted": len(sidecar.alert_webhook(body))}

    @app.get("/v1/status", dependencies=auth)
    async def status():
        return JSONResponse(sidecar.status())

    activity_api.install(app, sidecar)  # /v1/activity, /v1/digest, /v1/hang and the hang loop

    @app.get("/v1/decisions", dependencies=auth)
    async def decisions(limit: int = Query(50, ge=1, le=10_000)):
        return JSONResponse(sidecar.decisions(limit))

    return app


async def _no_data_ticker(sidecar: Sidecar) -> None:
    while True:
        await asyncio.sleep(sidecar.config.no_data_interval_seconds)
        try:
            sidecar.tick()
        except Exception:  # a bug in one check must not stop the next ones
            log.exception("no-data check failed")
