"""POST /v1/ingest: schema validation (422 naming the field), body cap (413), bearer token (401)."""

from __future__ import annotations

import json
import time

import pytest
from fastapi.testclient import TestClient

from parwatch.sidecar.app import create_control_app
from parwatch.sidecar.config import Listen, SidecarConfig
from parwatch.sidecar.service import build_sidecar
from parwatch.tokens import TokenError
from tests.fixtures import synthetic as syn

TOKEN = "s3cret-token"


def make_client(tmp_path, auth: bool = True, **config) -> TestClient:
    """A client of the control app; auth: it sends the sidecar's token on every request."""
    sidecar = build_sidecar(SidecarConfig(state_dir=tmp_path / "state", **config))
    headers = {"Authorization": f"Bearer {sidecar.config.token}"} if auth else {}
    return TestClient(create_control_app(sidecar), headers=headers)


@pytest.fixture
def client(tmp_path):
    return make_client(tmp_path)


def body(*summaries) -> dict:
    return {"version": 1, "summaries": list(summaries)}


def test_valid_summaries_are_accepted_without_a_directive(client):
    r = client.post("/v1/ingest", json=body(syn.summary(0, 1), syn.summary(1, 1)))
    assert r.status_code == 200
    assert r.json() == {"accepted": 2, "directive": None}
    ranks = client.get("/v1/status").json()["ranks"]
    assert ranks["0"]["last_step"] == 1 and ranks["1"]["up"] is True


def test_a_step_ahead_of_the_run_is_refused_alone_and_the_rest_of_its_post_taken(client):
    """The README's test run on fa4ad6a: one summary ahead of the run refused a real rank's whole post (its
    backlog of steps 2-9), and every step in it was lost."""
    now = time.time()
    assert (
        client.post("/v1/ingest", json=body(syn.summary(0, 1, time=now), syn.summary(1, 1, time=now))).status_code
        == 200
    )
    r = client.post("/v1/ingest", json=body(*(syn.summary(1, step, time=now) for step in (2, 3, 10**6, 4))))
    assert r.status_code == 200, r.text
    reply = r.json()
    assert reply["accepted"] == 3 and [h["index"] for h in reply["refused"]] == [2] and reply["directive"] is None
    assert reply["refused"][0]["reason"].startswith("summaries.2.step=1000000 is ahead of the run")
    status = client.get("/v1/status").json()
    assert status["ranks"]["1"]["last_step"] == 4
    assert [(f["post"], f["count"]) for f in status["refused"]] == [("ingest", 1)]
    assert "1 of 4, the rest taken" in status["refused"][0]["detail"]
    r = client.post("/v1/ingest", json=body(syn.summary(1, 10**6 + 1, time=now)))  # nothing else in it: refused
    assert r.status_code == 422 and "ahead of the run" in r.json()["detail"]


@pytest.mark.parametrize("loss", ["nan", "inf", "-inf", None, 3.5])
def test_loss_may_be_a_number_null_or_a_nonfinite_string(client, loss):
    s = syn.summary(1, 1)
    s["loss"] = loss
    assert client.post("/v1/ingest", json=body(s)).status_code == 200


def _broken(change):
    s = syn.summary(1, 1, tp=1, pp=2)
    change(s)
    return body(s)


@pytest.mark.parametrize(
    "payload, expected",
    [
        (_broken(lambda s: s.pop("step")), "summaries.0.step: required, but missing"),
        (_broken(lambda s: s.update(step="seven")), "summaries.0.step: Expected `int`, got `str`"),
        (_broken(lambda s: s.update(loss="banana")), "summaries.0.loss"),
        (_broken(lambda s: s.update(schedule="zig zag\n")), "summaries.0.schedule"),
        (_broken(lambda s: s.update(rank=5)), "rank 5 is outside the world of tp*pp*dp = 2 ranks"),
        (_broken(lambda s: s.update(stage=3)), "stage 3 is outside pp = 2"),
        (_broken(lambda s: s.update(step_seconds=-1.0)), "summaries.0.step_seconds"),
        (_broken(lambda s: s["collectives"][0].update(op="all_to_all")), "summaries.0.collectives.0.op"),
        (
            _broken(lambda s: s["collectives"][0].update(buckets=[1, 2])),
            "summaries.0.collectives.0: buckets has 2",
        ),
        (_broken(lambda s: s["gpu"].update(utilization_ratio=1.5)), "summaries.0.gpu.utilization_ratio"),
        (
            {
                "version": 1,
                "summaries": [],
                "outcomes": [{"directive_id": 0, "run_id": "r", "outcome": "applied", "step": 1, "ranks": 2}],
            },
            "outcomes.0.directive_id",
        ),
        (
            {
                "version": 1,
                "summaries": [],
                "outcomes": [{"directive_id": 3, "run_id": "r", "outcome": "done", "step": 1, "ranks": 2}],
            },
            "outcomes.0.outcome: Invalid enum value 'done' (one of applied, substituted, failed, ignored, mixed)",
        ),
        (_broken(lambda s: s.update({"global": {"step": 1, "loss": "nope"}})), "summaries.0.global.loss"),
        ({"version": 2, "summaries": []}, "version: Invalid enum value 2"),
        ({"version": 1, "summaries": "all of them"}, "summaries: Expected `array`, got `str`"),
        ({"summaries": []}, "version: required, but missing"),
        # Numbers beyond what the metric can hold (issue 11): 422 naming the field, never stored.
        (_broken(lambda s: s.update(tokens=10**400)), "summaries.0.tokens: Expected `int` <= 9007199254740992"),
        (_broken(lambda s: s.update(step=2**53 + 1)), "summaries.0.step"),
        (_broken(lambda s: s.update(dropped_total=2**63)), "summaries.0.dropped_total"),
        (_broken(lambda s: s.update(memory_max_allocated_bytes=10**30)), "summaries.0.memory_max_allocated_bytes"),
        (_broken(lambda s: s.update(checkpoints=[10**400])), "summaries.0.checkpoints.0"),
        (_broken(lambda s: s.update(step_seconds=1e300)), "summaries.0.step_seconds"),
        (_broken(lambda s: s.update(loss=10**400)), "summaries.0.loss"),
        (_broken(lambda s: s.update(time=1e300)), "summaries.0.time"),
        (
            _broken(lambda s: s.update(run_id="run\nINFO forged line")),
            "summaries.0.run_id: Expected `str` without control characters",
        ),
        (_broken(lambda s: s["collectives"][0].update(group="g123")), "summaries.0.collectives.0.group"),
        # One run id bound with the activity reports (bounds.MAX_RUN_ID): a run summarised is a run watched.
        (_broken(lambda s: s.update(run_id="r" * 129)), "summaries.0.run_id: Expected `str` of length <= 128"),
        # One world bound with the activity reports (bounds.MAX_WORLD): a 2**18-rank summary is refused too.
        (_broken(lambda s: s.update(tp=1 << 17, dp=2)), "over the 131072 a sidecar accepts"),
        # A closed set's error lists its members; a dict's bad key says it is a key.
        (
            _broken(lambda s: s.update(time_seconds={"lunch": 1.0})),
            "summaries.0.time_seconds: a key: Invalid enum value 'lunch' (one of productive, ",
        ),
        (_broken(lambda s: s.update(nvml_up=True)), "summaries.0.nvml_up: Expected `int`, got `bool`"),
    ],
)
def test_invalid_bodies_get_422_naming_the_field(client, payload, expected):
    r = client.post("/v1/ingest", json=payload)
    assert r.status_code == 422, r.text
    assert expected in r.json()["detail"]


def test_malformed_json_is_a_422_with_the_reason(client):
    r = client.post(
        "/v1/ingest", content=b'{"version": 1, "summaries": [', headers={"content-type": "application/json"}
    )
    assert r.status_code == 422
    assert "not valid JSON" in r.json()["detail"]


def test_bodies_over_the_cap_get_413(tmp_path):
    client = make_client(tmp_path, max_body_bytes=4096)
    big = body(*[syn.summary(0, step) for step in range(1, 20)])
    assert len(json.dumps(big)) > 4096
    r = client.post("/v1/ingest", json=big)
    assert r.status_code == 413
    assert "--max-body-bytes" in r.json()["detail"]
    # A chunked body (no Content-Length) is counted as it arrives.
    r = client.post(
        "/v1/ingest",
        content=iter([json.dumps(big).encode()[i : i + 1000] for i in range(0, 20000, 1000)]),
        headers={"content-type": "application/json"},
    )
    assert r.status_code == 413
    assert client.post("/v1/ingest", json=body(syn.summary(0, 1))).status_code == 200


def test_token_is_required_when_configured(tmp_path):
    client = make_client(tmp_path, auth=False, token=TOKEN, control_listen=Listen("0.0.0.0", 9401))
    ok = body(syn.summary(0, 1))
    r = client.post("/v1/ingest", json=ok)
    assert r.status_code == 401 and "missing Authorization" in r.json()["detail"]
    assert r.headers["www-authenticate"].startswith("Bearer")
    r = client.post("/v1/ingest", json=ok, headers={"Authorization": "Bearer nope"})
    assert r.status_code == 401 and r.json()["detail"] == "wrong bearer token"
    r = client.post("/v1/ingest", json=ok, headers={"Authorization": f"Basic {TOKEN}"})
    assert r.status_code == 401 and "Bearer <token>" in r.json()["detail"]
    for path in ("/v1/status", "/v1/decisions"):
        assert client.get(path).status_code == 401
    assert client.post("/v1/control", json={"action": "pause"}).status_code == 401
    assert client.post("/v1/alerts", json={"version": "4", "status": "firing", "alerts": []}).status_code == 401
    assert client.get("/healthz").status_code == 200
    r = client.post("/v1/ingest", json=ok, headers={"Authorization": f"Bearer {TOKEN}"})
    assert r.status_code == 200 and r.json()["accepted"] == 1


def test_without_a_token_the_sidecar_makes_one_and_requires_it(tmp_path):
    client = make_client(tmp_path, auth=False)  # loopback, no --token-file: authenticated all the same
    token_file = tmp_path / "state" / "token"
    assert token_file.stat().st_mode & 0o777 == 0o600
    assert client.post("/v1/ingest", json=body(syn.summary(0, 1))).status_code == 401
    auth = {"Authorization": f"Bearer {token_file.read_text().strip()}"}
    assert client.post("/v1/ingest", json=body(syn.summary(0, 1)), headers=auth).status_code == 200
    # A restart keeps the token the trainers already hold.
    assert make_client(tmp_path).headers["Authorization"] == auth["Authorization"]


def test_a_token_file_others_can_read_is_refused(tmp_path):
    token_file = tmp_path / "state" / "token"
    token_file.parent.mkdir()
    token_file.write_text("abc\n")
    token_file.chmod(0o644)
    with pytest.raises(TokenError, match=f"readable by group or others.*fix: chmod 600 {token_file}"):
        make_client(tmp_path)


def test_openapi_documents_every_body_by_its_record(client):
    """Every POST's body is a typed record (parwatch/wire/), named in the
    document and generated from the type the sidecar decodes it with."""
    doc = client.get("/openapi.json").json()
    schemas = doc["components"]["schemas"]
    posts = {path: ops["post"] for path, ops in doc["paths"].items() if "post" in ops}
    bodies = {path: op["requestBody"]["content"]["application/json"]["schema"]["$ref"] for path, op in posts.items()}
    assert bodies == {
        "/v1/ingest": "#/components/schemas/IngestBody",
        "/v1/control": "#/components/schemas/ControlRequest",
        "/v1/directives/{directive_id}/cancel": "#/components/schemas/CancelRequest",
        "/v1/alerts": "#/components/schemas/AlertmanagerPayload",
        "/v1/instances": "#/components/schemas/InstancesForward",
        "/v1/activity": "#/components/schemas/ActivityPost",
        "/v1/evidence": "#/components/schemas/EvidencePost",
        "/v1/digest": "#/components/schemas/NodeDigest",
    }
    assert all(ref.rsplit("/", 1)[1] in schemas for ref in bodies.values())
    assert "global" in schemas["StepSummary"]["properties"]
    assert schemas["ControlRequest"]["additionalProperties"] is False  # an operator's typo is refused
    ingest_answer = posts["/v1/ingest"]["responses"]["200"]["content"]["application/json"]["schema"]
    assert ingest_answer == {"$ref": "#/components/schemas/IngestResponse"} and "Directive" in schemas
    assert schemas["Directive"]["properties"]["action"] == {"$ref": "#/components/schemas/Action"}
    problem = posts["/v1/control"]["responses"]["422"]["content"]["application/json"]["schema"]
    assert problem == {"$ref": "#/components/schemas/Problem"} and "Problem" in schemas
    # The decision log's answer is described by its typed records (parwatch/wire/log.py).
    answer = doc["paths"]["/v1/decisions"]["get"]["responses"]["200"]["content"]["application/json"]["schema"]
    refs = [item["$ref"].rsplit("/", 1)[1] for item in answer["items"]["anyOf"]]
    outcomes = ["Applied", "Substituted", "Failed", "Ignored", "Mixed"]
    assert refs == ["Decision", "Cancelled", "Delivered", *outcomes] and set(refs) <= set(schemas)
    assert all(schemas[r]["properties"]["type"] == {"enum": [r.lower()]} for r in outcomes)  # tagged by type
    assert {"action", "source", "reason", "evidence", "time", "step"} <= set(schemas["Decision"]["required"])


@pytest.mark.parametrize(
    "text",
    [
        '{"summaries": [1,]}',
        '{"summaries": [1 2]}',
        '{"a": 1,}',
        '{"a" 1}',
        '{"summaries": [1]} x',
        '{"summaries": [',
        "{1: 2}",
        '{"a": 1',
        "",
    ],
)
def test_invalid_json_small_or_large_is_a_422(client, text):
    padded = '{"pad": "' + "x" * 70_000 + '", ' + text[1:] if text.startswith("{") else text
    for raw in (text, padded):
        r = client.post("/v1/ingest", content=raw.encode(), headers={"content-type": "application/json"})
        assert r.status_code == 422 and "not valid JSON" in r.json()["detail"], r.text[:300]
