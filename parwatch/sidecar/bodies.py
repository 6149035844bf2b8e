"""Request bodies of the control app's FastAPI routes, read as the hot posts read theirs: the raw body
decoded into its typed record (parwatch/wire/) in one call, a 422 naming the field otherwise.
The OpenAPI document names the record (app.py adds the records' schemas)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from fastapi import HTTPException, Request

from parwatch.wire.codec import BadRecord, decode

T = TypeVar("T")


def body(record: type[T]) -> Callable[[Request], Awaitable[T]]:
    """A FastAPI dependency: the request's body as `record` (`Depends(body(ControlRequest))`)."""

    async def read(request: Request) -> T:
        try:
            return decode(await request.body(), record, dotted=True)
        except BadRecord as err:
            raise HTTPException(422, str(err)) from None

    return read


def schema(name: str) -> dict[str, Any]:
    """A JSON content whose schema is the record `name` (in components/schemas)."""
    return {"application/json": {"schema": {"$ref": f"#/components/schemas/{name}"}}}


def documented(record: type) -> dict[str, Any]:
    """A route's `openapi_extra`: its request body is `record`."""
    return {"requestBody": {"required": True, "content": schema(record.__name__)}}
