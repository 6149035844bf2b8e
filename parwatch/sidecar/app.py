"""HTTP faces of the sidecar: the read-only metrics app and the control app.

The control app turns every bad request into a 4xx whose reason names the field (422
for a body or query that fails validation), and its OpenAPI document lists exactly the
answers it gives; the metrics app serves only /metrics and /healthz.

/v1/ingest parses and validates its body itself, a slice of summaries at a time, handing
the event loop back between slices: a post of 10,000 summaries must not stall /healthz,
/metrics or the other ranks' posts.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import time
from typing import Annotated, Any, Awaitable, Callable, Literal

from fastapi import Depends, FastAPI, HTTPException, Path, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, Field, TypeAdapter, ValidationError
from pydantic_core import from_json

from parwatch import __version__
from parwatch.guardrails.engine import DirectiveDelivered
from parwatch.schema import SCHEMA_VERSION
from parwatch.sidecar import activity_api
from parwatch.sidecar.auth import bearer_dependency, check_bearer
from parwatch.sidecar.exposition import choose, encode_async, encode_openmetrics, encode_text
from parwatch.sidecar.models import (
    AlertmanagerPayload,
    CancelRequest,
    ControlRequest,
    IngestBody,
    IngestResponse,
    OutcomeRecord,
    Problem,
    StepSummary,
)
from parwatch.sidecar.service import SLICE_SECONDS, Sidecar, jsonable
from parwatch.sidecar.store import Refused

log = logging.getLogger(__name__)


class BodyTooLarge(Exception):
    """The request body passed --max-body-bytes."""


async def read_capped(scope, receive, max_bytes: int) -> bytes | None:
    """The whole request body (None when the client went away); BodyTooLarge past `max_bytes`,
    from the declared length or counted as chunks arrive (chunked bodies too)."""
    declared = dict(scope.get("headers") or ()).get(b"content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise BodyTooLarge
    chunks, size, more = [], 0, True
    while more:
        message = await receive()
        if message["type"] != "http.request":
            return None
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > max_bytes:
            raise BodyTooLarge
        chunks.append(chunk)
        more = message.get("more_body", False)
    return b"".join(chunks)


async def read_body_or_413(scope, receive, send, max_bytes: int) -> bytes | None:
    """The request body; None when there is nothing more to do: the client went away, or the body
    was over `max_bytes` and a 413 naming --max-body-bytes went out."""
    try:
        return await read_capped(scope, receive, max_bytes)
    except BodyTooLarge:
        await send_json(send, 413, too_large(max_bytes))
        return None


def json_body(payload) -> bytes:
    """A JSON answer's bytes, encoded as Starlette's JSONResponse encodes them."""
    return json.dumps(payload, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()


async def send_json(send, status: int, payload, headers: dict | None = None) -> None:
    """A JSON answer through ASGI (fast_http.FastPostProtocol writes the same bytes itself)."""
    body = json_body(payload)
    head = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    head += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": head})
    await send({"type": "http.response.body", "body": body})


class BodyLimit:
    """ASGI middleware: 413 for bodies over the cap, counted as they arrive (chunked ones too)."""

    def __init__(self, app, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        body = await read_body_or_413(scope, receive, send, self.max_bytes)
        if body is None:
            return
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


def too_large(max_bytes: int) -> dict:
    return {"detail": f"request body over {max_bytes} bytes (--max-body-bytes)"}


MAX_SUMMARIES = IngestBody.model_fields["summaries"].metadata[0].max_length


class _IngestHead(BaseModel):
    """IngestBody with its summaries still raw: validated a slice at a time (_validate_ingest)."""

    version: Literal[SCHEMA_VERSION]
    summaries: list[Any] = Field(max_length=MAX_SUMMARIES)
    outcomes: list[OutcomeRecord] = IngestBody.model_fields["outcomes"]
    alive: Annotated[bool, Field(strict=True)] = False


_SUMMARY = TypeAdapter(StepSummary)


_DECODER = json.JSONDecoder()
SMALL_BODY = 64 * 1024
"""Bodies up to this size (a rank's usual post) are parsed in one call."""
_BLANK = re.compile(r"[ \t\n\r]*")


async def parse_ingest_json(raw: bytes) -> Any:
    """json.loads(raw), except that a top-level object's "summaries" array is decoded one element
    at a time, handing the loop back every SLICE_SECONDS: parsing an 8 MB body in one call held
    the event loop for 40-150 ms. ValueError (or RecursionError) for invalid JSON."""
    if len(raw) <= SMALL_BODY:
        return from_json(raw)  # one call, a fraction of a millisecond: pydantic-core's fast parser
    text = raw.decode("utf-8")
    end = len(text)

    def blank(i: int) -> int:
        return _BLANK.match(text, i).end()

    def expect(i: int, chars: str) -> tuple[str, int]:
        if i >= end or text[i] not in chars:
            raise ValueError(f"expected one of {chars!r} at char {i}")
        return text[i], blank(i + 1)

    i = blank(0)
    if i >= end or text[i] != "{":
        return json.loads(text)  # not an object: whatever it is, the validator names the problem
    out: dict = {}
    _, i = expect(i, "{")
    if text.startswith("}", i):
        i = blank(i + 1)
    else:
        deadline = time.perf_counter() + SLICE_SECONDS
        while True:
            key, i = _DECODER.raw_decode(text, i)
            if not isinstance(key, str):
                raise ValueError(f"object keys must be strings (char {i})")
            _, i = expect(blank(i), ":")
            if key == "summaries" and text.startswith("[", i):
                items: list = []
                _, i = expect(i, "[")
                if text.startswith("]", i):
                    i = blank(i + 1)
                else:
                    while True:
                        item, i = _DECODER.raw_decode(text, i)
                        items.append(item)
                        sep, i = expect(blank(i), ",]")
                        if time.perf_counter() > deadline:
                            await asyncio.sleep(0)
                            deadline = time.perf_counter() + SLICE_SECONDS
                        if sep == "]":
                            break
                value = items
            else:
                value, i = _DECODER.raw_decode(text, i)
                i = blank(i)
            out[key] = value
            sep, i = expect(i, ",}")
            if sep == "}":
                break
    if i != end:
        raise ValueError(f"extra data at char {i}")
    return out


async def _validate_ingest(raw: bytes) -> IngestBody:
    """IngestBody from raw JSON, as FastAPI would validate it, but yielding between slices.

    Raises RequestValidationError (-> 422 naming the field) for the first problems found."""
    if len(raw) <= SMALL_BODY:  # a rank's usual post: parsed and validated in one pass in pydantic-core
        try:
            return IngestBody.model_validate_json(raw)
        except ValidationError as err:
            raise RequestValidationError(_located(err, ("body",))) from None
    try:
        data = await parse_ingest_json(raw)
    except (ValueError, RecursionError) as err:
        raise RequestValidationError([{"type": "json_invalid", "loc": ("body",), "msg": "JSON decode error",
                                       "ctx": {"error": str(err)[:200]}}]) from None
    try:
        head = _IngestHead.model_validate(data)
    except ValidationError as err:
        raise RequestValidationError(_located(err, ("body",))) from None
    summaries, errors = [], []
    deadline = time.perf_counter() + SLICE_SECONDS
    for i, item in enumerate(head.summaries):
        try:
            summaries.append(_SUMMARY.validate_python(item))
        except ValidationError as err:
            errors += _located(err, ("body", "summaries", i))
            if len(errors) >= 5:
                break
        if time.perf_counter() > deadline:
            await asyncio.sleep(0)
            deadline = time.perf_counter() + SLICE_SECONDS
    if errors:
        raise RequestValidationError(errors)
    return IngestBody.model_construct(version=head.version, summaries=summaries, outcomes=head.outcomes,
                                      alive=head.alive)


def _located(err: ValidationError, prefix: tuple) -> list[dict]:
    return [{**e, "loc": (*prefix, *e.get("loc", ()))} for e in err.errors(include_url=False)]


def _reason(exc: RequestValidationError) -> str:
    problems = []
    for err in exc.errors()[:5]:
        loc = [str(p) for p in err.get("loc", ()) if p != "body"]
        if err.get("type") == "json_invalid":
            problems.append(f"body is not valid JSON: {err.get('ctx', {}).get('error', err.get('msg'))}")
            continue
        field = ".".join(loc) or "body"
        problems.append(f"{field}: {err.get('msg')}")
    return "; ".join(problems)[:4000]


_PROBLEM = {"model": Problem}
_AUTH = {401: {**_PROBLEM, "description": "missing or wrong bearer token"}}
_INVALID = {422: {**_PROBLEM, "description": "invalid body or query; detail names the field"}}
_TOO_LARGE = {413: {**_PROBLEM, "description": "body over --max-body-bytes"}}


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
        sidecar.defer_writes()  # from here on, disk writes happen in the writer thread
        task = asyncio.create_task(_no_data_ticker(sidecar))
        try:
            yield
        finally:
            task.cancel()
            sidecar.close()  # persist the last second of rule counters on a clean stop

    auth = [Depends(bearer_dependency(sidecar.config.token))]
    app = ControlApp(
        title="parwatch sidecar control",
        version=__version__,
        description="Ingest step summaries, steer the run (pause/resume/rollback), receive Alertmanager webhooks.",
        docs_url=None, redoc_url=None, lifespan=lifespan,
        token=sidecar.config.token, max_body_bytes=sidecar.config.max_body_bytes,
    )
    app.add_middleware(BodyLimit, max_bytes=sidecar.config.max_body_bytes)
    _healthz(app)

    @app.exception_handler(RequestValidationError)
    async def invalid(request, exc):
        return JSONResponse({"detail": _reason(exc)}, status_code=422)

    ingest_body = {"required": True,
                   "content": {"application/json": {"schema": {"$ref": "#/components/schemas/IngestBody"}}}}

    @app.post("/v1/ingest", dependencies=auth, response_model=IngestResponse,
              openapi_extra={"requestBody": ingest_body},
              responses={**_AUTH, **_TOO_LARGE, **_INVALID,
                         409: {**_PROBLEM, "description": "the summary does not fit the run's world (tp, pp, dp)"},
                         429: {**_PROBLEM, "description": "more ranks or run ids than --max-ranks / --max-runs"}})
    async def ingest(request: Request):
        """Store step summaries; answer with the directive rank 0 should apply, if any."""
        # Served by ControlApp.fast_posts; this route documents it (OpenAPI) and serves only
        # when that entry is removed. Both run the one handler.
        status, payload = await handle_ingest(await request.body())
        return JSONResponse(payload, status_code=status)

    handle_ingest = app.fast_posts["/v1/ingest"] = _ingest_handler(sidecar)

    @app.post("/v1/control", dependencies=auth,
              responses={**_AUTH, **_TOO_LARGE, **_INVALID,
                         400: {**_PROBLEM, "description": "the engine refused it (e.g. no such checkpoint)"}})
    async def control(body: ControlRequest):
        """Operator pause / resume / rollback; returns the decision record."""
        try:
            decision = sidecar.control(body)
        except ValueError as err:
            raise HTTPException(400, str(err)) from err
        await sidecar.persist()
        return JSONResponse(jsonable(decision))

    @app.post("/v1/directives/{directive_id}/cancel", dependencies=auth,
              responses={**_AUTH, **_TOO_LARGE, **_INVALID,
                         404: {**_PROBLEM, "description": "no outstanding directive with that id"},
                         409: {**_PROBLEM, "description": "already delivered to the run: it will be applied"}})
    async def cancel(directive_id: Annotated[int, Path(ge=1, lt=2**53)], body: CancelRequest):
        """Withdraw a directive not yet delivered to the run; returns the cancel record."""
        try:
            record = sidecar.cancel(directive_id, body.requested_by or "operator")
        except DirectiveDelivered as err:
            return JSONResponse({"detail": str(err), "directive": err.directive}, status_code=409)
        except ValueError as err:
            raise HTTPException(404, str(err)) from err
        await sidecar.persist()
        return JSONResponse(jsonable(record))

    @app.post("/v1/alerts", dependencies=auth, responses={**_AUTH, **_TOO_LARGE, **_INVALID})
    async def alerts(body: AlertmanagerPayload) -> dict[str, int]:
        """Alertmanager webhook (payload version 4): firing alerts labelled parwatch_action act once."""
        acted = len(sidecar.alert_webhook(body))
        await sidecar.persist()
        return {"acted": acted}

    @app.get("/v1/status", dependencies=auth, responses=_AUTH)
    async def status():
        return JSONResponse(sidecar.status())

    activity_api.install(app, sidecar)  # /v1/activity, /v1/digest, /v1/hang and the hang loop

    @app.get("/v1/decisions", dependencies=auth, responses={**_AUTH, **_INVALID})
    async def decisions(limit: int = Query(50, ge=1, le=10_000)):
        return JSONResponse(sidecar.decisions(limit))

    def openapi():
        if app.openapi_schema is None:
            doc = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
            # /v1/ingest reads its body itself (_validate_ingest): describe it as IngestBody.
            schema = IngestBody.model_json_schema(ref_template="#/components/schemas/{model}")
            components = doc.setdefault("components", {}).setdefault("schemas", {})
            components.update(schema.pop("$defs", {}))
            components["IngestBody"] = schema
            doc["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
            for operations in doc["paths"].values():
                for op in operations.values():
                    if "401" in op.get("responses", {}):
                        op["security"] = [{"bearer": []}]
            app.openapi_schema = doc
        return app.openapi_schema

    app.openapi = openapi
    return app


class ControlApp(FastAPI):
    """The control app, with the hot POST routes (`fast_posts`: path -> handler of the raw body)
    answered before the framework's middleware stack, routing and dependency injection: at
    1024 posts/s (benchmarks/sidecar_load.py) those were about a quarter of the sidecar's CPU per
    post. Same checks in the same order, same answers: body cap 413, bearer token 401, then the
    handler's (status, JSON payload). The framework routes stay, to document them (OpenAPI)."""

    def __init__(self, *args, token: str | None, max_body_bytes: int, **kwargs):
        super().__init__(*args, **kwargs)
        self.token, self.max_body_bytes = token, max_body_bytes
        self.fast_posts: dict[str, Callable[[bytes], Awaitable[tuple[int, Any]]]] = {}
        self.on_refused: Callable[[str, int, Any], None] | None = None
        """Told of every fast post answered 4xx/5xx: (path, status, detail) (parwatch.sidecar.refusals)."""

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["method"] == "POST":
            handler = self.fast_posts.get(scope["path"])
            if handler is not None:
                return await self._fast_post(handler, scope, receive, send)
        return await super().__call__(scope, receive, send)

    async def answer(self, handler, authorization: str | None, raw: bytes) -> tuple[int, Any, dict | None]:
        """A fast post's (status, JSON payload, extra headers) once its body is read within the cap:
        the bearer token (401 with its challenge), then the handler. Served here through ASGI and by
        fast_http.FastPostProtocol at the protocol."""
        try:
            check_bearer(self.token, authorization)
        except HTTPException as err:
            self._refused(handler, err.status_code, err.detail)
            return err.status_code, {"detail": err.detail}, err.headers
        status, payload = await handler(raw)
        if status >= 400:
            self._refused(handler, status, payload.get("detail") if isinstance(payload, dict) else payload)
        return status, payload, None

    def _refused(self, handler, status: int, detail) -> None:
        if self.on_refused is not None:
            self.on_refused(next((p for p, h in self.fast_posts.items() if h is handler), ""), status, detail)

    async def _fast_post(self, handler, scope, receive, send):
        raw = await read_body_or_413(scope, receive, send, self.max_body_bytes)
        if raw is None:
            return
        await send_json(send, *await self.answer(handler, _header(scope, b"authorization"), raw))


def _ingest_handler(sidecar: Sidecar):
    async def ingest(raw: bytes) -> tuple[int, Any]:
        try:
            body = await _validate_ingest(raw)
        except RequestValidationError as err:
            return 422, {"detail": _reason(err)}
        try:
            return 200, await sidecar.ingest_async(body)
        except Refused as err:
            return err.status, {"detail": str(err)}

    return ingest


def _header(scope, name: bytes) -> str | None:
    for key, value in scope.get("headers") or ():
        if key == name:
            return value.decode("latin-1")
    return None


async def _no_data_ticker(sidecar: Sidecar) -> None:
    while True:
        await asyncio.sleep(sidecar.config.no_data_interval_seconds)
        try:
            sidecar.tick()
            await sidecar.persist()
        except Exception:  # a bug in one check must not stop the next ones
            log.exception("no-data check failed")
