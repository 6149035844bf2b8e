"""The hot POST routes (/v1/ingest, /v1/activity, /v1/digest) answer every case as documented:
body cap 413, bearer token 401 (checked before the body is read), validation 422 naming the problem."""

from __future__ import annotations

import json

from fastapi.testclient import TestClient

from parwatch.sidecar.app import create_control_app
from parwatch.sidecar.config import SidecarConfig
from parwatch.sidecar.service import build_sidecar
from tests.fixtures import synthetic as syn

TOKEN = "fast-and-framework"


def _client(tmp_path, name: str) -> TestClient:
    sidecar = build_sidecar(SidecarConfig(state_dir=tmp_path / name, token=TOKEN, max_body_bytes=4096))
    return TestClient(create_control_app(sidecar))


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


def test_each_path_answers_every_case_as_documented(tmp_path):
    client = _client(tmp_path, "s")
    answers = [client.post(path, content=raw, headers=headers) for path, raw, headers in CASES]
    assert [a.status_code for a in answers] == [
        200,
        200,
        422,
        409,
        422,
        422,
        422,
        422,
        413,
        401,
        401,
        401,
        422,
        422,
        401,
        422,
        422,
        413,
    ]
    for a in answers:
        assert a.headers["content-type"] == "application/json"
        assert not a.is_error or a.json()["detail"]
        if a.status_code == 401:
            assert a.headers["www-authenticate"] == 'Bearer realm="parwatch"'


def test_other_methods_and_paths_are_answered_by_the_framework(tmp_path):
    client = _client(tmp_path, "s")
    assert client.get("/v1/ingest", headers=AUTH).status_code == 405
    assert client.post("/v1/ingest/", content="{}", headers=AUTH, follow_redirects=False).status_code == 307
    assert client.post("/v1/nothing", content="{}", headers=AUTH).status_code == 404
    assert client.get("/openapi.json").status_code == 401  # behind the token, like every route it maps
    assert "/v1/ingest" in client.get("/openapi.json", headers=AUTH).json()["paths"]
