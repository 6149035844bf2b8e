"""The hot POST routes (/v1/ingest, /v1/activity, /v1/digest) are answered by ControlApp ahead of
the framework stack; the framework routes stay for OpenAPI. Both must give the same answers: the
same requests, sent to one app with its fast posts and to one without, get the same status and body."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from parwatch.sidecar import synthetic as syn
from parwatch.sidecar.app import create_control_app
from parwatch.sidecar.config import SidecarConfig
from parwatch.sidecar.service import build_sidecar

TOKEN = "fast-and-framework"


def _client(tmp_path, name: str, fast: bool) -> TestClient:
    sidecar = build_sidecar(SidecarConfig(state_dir=tmp_path / name, token=TOKEN, max_body_bytes=4096))
    app = create_control_app(sidecar)
    assert set(app.fast_posts) == {"/v1/ingest", "/v1/activity", "/v1/digest"}
    if not fast:
        app.fast_posts.clear()
    return TestClient(app)


def _summary(rank=0, step=1, **change):
    s = syn.summary(rank, step, tp=1, pp=2, instances=False)
    s.update(change)
    return s


AUTH = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}
CASES = [  # (path, raw body, headers)
    ("/v1/ingest", json.dumps({"version": 1, "summaries": [_summary()]}), AUTH),
    ("/v1/ingest", json.dumps({"version": 1, "summaries": [_summary(1)]}), AUTH),
    ("/v1/ingest", json.dumps({"version": 1, "summaries": [_summary(rank=9)]}), AUTH),  # outside the world
    ("/v1/ingest", json.dumps({"version": 1, "summaries": [_summary(tp=2)]}), AUTH),  # another world: 409
    ("/v1/ingest", json.dumps({"version": 1, "summaries": [_summary(step=True)]}), AUTH),  # bool is no count
    ("/v1/ingest", json.dumps({"version": 1, "summaries": [_summary(rank=-1)]}), AUTH),
    ("/v1/ingest", json.dumps({"version": 2, "summaries": []}), AUTH),
    ("/v1/ingest", '{"version": 1, "summaries": [', AUTH),  # not JSON
    ("/v1/ingest", "x" * 5000, AUTH),  # over --max-body-bytes
    ("/v1/ingest", json.dumps({"version": 1, "summaries": []}), {}),  # no token
    ("/v1/ingest", json.dumps({"version": 1, "summaries": []}), {"Authorization": "Bearer wrong"}),
    ("/v1/ingest", json.dumps({"version": 1, "summaries": []}), {"Authorization": f"Basic {TOKEN}"}),
    ("/v1/activity", json.dumps({"version": 1, "activity": {"rank": "zero"}}), AUTH),
    ("/v1/activity", "[1, 2", AUTH),
    ("/v1/activity", json.dumps({"version": 1}), {}),
    ("/v1/digest", json.dumps({"version": 7}), AUTH),
    ("/v1/digest", "{", AUTH),
    ("/v1/digest", "y" * 5000, AUTH),
]


@pytest.mark.parametrize("fast", [True, False], ids=["fast", "framework"])
def test_each_path_answers_every_case_as_documented(tmp_path, fast):
    client = _client(tmp_path, "s", fast)
    got = [client.post(path, content=raw, headers=headers).status_code for path, raw, headers in CASES]
    assert got == [200, 200, 422, 409, 422, 422, 422, 422, 413, 401, 401, 401, 422, 422, 401, 422, 422, 413]


def test_the_fast_posts_answer_exactly_as_the_framework_routes(tmp_path):
    fast, framework = _client(tmp_path, "fast", True), _client(tmp_path, "framework", False)
    for path, raw, headers in CASES:
        a = fast.post(path, content=raw, headers=headers)
        b = framework.post(path, content=raw, headers=headers)
        assert (a.status_code, a.json()) == (b.status_code, b.json()), (path, raw[:80])
        assert a.headers.get("www-authenticate") == b.headers.get("www-authenticate")
        assert a.headers["content-type"] == b.headers["content-type"] == "application/json"


def test_other_methods_and_paths_still_go_through_the_framework(tmp_path):
    client = _client(tmp_path, "s", True)
    assert client.get("/v1/ingest", headers=AUTH).status_code == 405
    assert client.post("/v1/ingest/", content="{}", headers=AUTH, follow_redirects=False).status_code == 307
    assert client.post("/v1/nothing", content="{}", headers=AUTH).status_code == 404
    assert "/v1/ingest" in client.get("/openapi.json").json()["paths"]
