"""A small HTTP client for the sidecar's control listener (CLI, tests, scripts).

The httpx session is injectable, so tests can hand in FastAPI's TestClient.
"""

from __future__ import annotations

import httpx

DEFAULT_ENDPOINT = "http://127.0.0.1:9401"


class SidecarError(RuntimeError):
    """The sidecar refused a request or could not be reached; the message says which and why."""

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status


class SidecarClient:
    def __init__(
        self,
        endpoint: str = DEFAULT_ENDPOINT,
        token: str | None = None,
        timeout: float = 5.0,
        session: httpx.Client | None = None,
    ):
        self.endpoint = endpoint.rstrip("/")
        self.session = session or httpx.Client(timeout=timeout)
        self.headers = {"Authorization": f"Bearer {token}"} if token else {}

    def close(self) -> None:
        self.session.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _call(self, method: str, path: str, **kw):
        url = f"{self.endpoint}{path}"
        try:
            r = self.session.request(method, url, headers=self.headers, **kw)
        except httpx.HTTPError as err:
            raise SidecarError(
                f"cannot reach the sidecar at {self.endpoint} ({err}); is `parwatch sidecar` running?"
            ) from err
        if r.status_code >= 400:
            try:
                detail = r.json().get("detail", r.text)
            except ValueError:
                detail = r.text
            raise SidecarError(f"{method} {path}: {r.status_code} {detail}", r.status_code)
        return r.json()

    def healthz(self) -> dict:
        return self._call("GET", "/healthz")

    def status(self) -> dict:
        return self._call("GET", "/v1/status")

    def decisions(self, limit: int = 50) -> list:
        return self._call("GET", "/v1/decisions", params={"limit": limit})

    def control(
        self, action: str, reason: str = "", to_step: int | None = None, skip_batches: int = 0, requested_by: str = ""
    ) -> dict:
        body = {"action": action, "reason": reason, "to_step": to_step, "skip_batches": skip_batches}
        if requested_by:
            body["requested_by"] = requested_by
        return self._call("POST", "/v1/control", json=body)

    def cancel(self, directive_id: int, requested_by: str = "") -> dict:
        return self._call("POST", f"/v1/directives/{int(directive_id)}/cancel", json={"requested_by": requested_by})

    def ingest(self, summaries: list[dict]) -> dict:
        return self._call("POST", "/v1/ingest", json={"version": 1, "summaries": summaries})

    def alerts(self, payload: dict) -> dict:
        return self._call("POST", "/v1/alerts", json=payload)
