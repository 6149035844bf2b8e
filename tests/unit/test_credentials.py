"""Issue 43, finding 1 (each rank speaks only for itself): credentials minted from the sidecars' secret, what
each may ask, and where a rank gets its own without holding the secret. On d484f20 every rank held the one
token: any of them (or a stray job with it) could post for every rank and steer the run."""

from __future__ import annotations

import os

import pytest
from fastapi.testclient import TestClient

from parwatch import credentials
from parwatch.collector.attach import AttachError, RankAttach, attach_from_config
from parwatch.credentials import CredentialError, Identity, Verifier, node_credential, rank_credential, run_key
from parwatch.sidecar.app import create_control_app
from parwatch.sidecar.config import SidecarConfig
from parwatch.sidecar.service import build_sidecar
from parwatch.trainer.config import TrainConfig
from parwatch.vocabulary import Speaker
from tests.fixtures import synthetic as syn

SECRET = "s3cret"


def _bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def test_a_credential_names_what_it_speaks_for_and_only_this_secret_mints_it():
    verify = Verifier(SECRET)
    assert verify.identify(SECRET) == credentials.OPERATOR
    assert verify.identify(rank_credential(SECRET, "run 7/β", 3)) == Identity(Speaker.RANK, run_id="run 7/β", rank=3)
    assert verify.identify(node_credential(SECRET, "node-a:9401")) == Identity(Speaker.NODE, node="node-a:9401")
    key = run_key(SECRET, "r1")
    assert credentials.for_rank(key, "r1", 5) == rank_credential(SECRET, "r1", 5)  # torchrun: from the run's key
    for forged in (
        rank_credential("another secret", "r1", 0),
        rank_credential(SECRET, "r1", 1).replace("pwr1.1.", "pwr1.0."),  # rank 1's mac, claimed for rank 0
        key,  # a run key is no credential
        "pwr1.0.x.y",
        "",
    ):
        assert verify.identify(forged) is None, forged
    with pytest.raises(CredentialError, match="not the one of rank 2"):
        credentials.for_rank(rank_credential(SECRET, "r1", 1), "r1", 2)
    with pytest.raises(CredentialError, match="not the key of run 'r2'"):
        credentials.for_rank(key, "r2", 0)


@pytest.fixture
def client(tmp_path):
    sidecar = build_sidecar(SidecarConfig(state_dir=tmp_path, token=SECRET))
    return TestClient(create_control_app(sidecar))


def _body(rank: int, run_id: str = "r1", **extra) -> dict:
    return {"version": 1, "summaries": [syn.summary(rank, 1, run_id=run_id)], **extra}


def test_a_rank_credential_posts_for_its_own_rank_and_run_only(client):
    rank0 = _bearer(rank_credential(SECRET, "r1", 0))
    assert client.post("/v1/ingest", json=_body(0), headers=rank0).status_code == 200
    for body in (_body(1), _body(0, "r2")):  # another rank, another run: 403 naming it
        r = client.post("/v1/ingest", json=body, headers=rank0)
        assert r.status_code == 403 and "speaks for rank 0 of run 'r1' only" in r.json()["detail"], r.text
    rank1 = _bearer(rank_credential(SECRET, "r1", 1))
    outcome = _body(1, outcomes=[syn.outcome(5, step=1, run_id="r1")])
    assert client.post("/v1/ingest", json=outcome, headers=rank1).status_code == 403  # outcomes are rank 0's
    assert client.post("/v1/ingest", json=_body(1, alive=True), headers=rank1).status_code == 403
    activity = {"version": 1, "activity": {"run_id": "r1", "rank": 0, "pid": 1, "stage": 0, "tp_rank": 0,
                                           "dp_rank": 0, "tp": 1, "pp": 2, "dp": 1, "step": 1, "time": 1.0}}  # fmt: skip
    assert client.post("/v1/activity", json=activity, headers=rank1).status_code == 403
    for method, path in (
        ("POST", "/v1/control"),
        ("GET", "/v1/status"),
        ("GET", "/v1/decisions"),
        ("POST", "/v1/digest"),
    ):
        r = client.request(method, path, json={"action": "pause"}, headers=rank0)
        assert r.status_code == 403 and "needs the operator's token" in r.json()["detail"], (path, r.text)
    assert client.get("/v1/whoami", headers=rank0).json() == {
        "speaker": "rank",
        "run_id": "r1",
        "rank": 0,
        "node": None,
    }
    assert client.post("/v1/ingest", json=_body(1), headers=_bearer(SECRET)).status_code == 200  # the operator's


def test_the_launcher_hands_each_rank_its_own_credential_and_never_the_secret(tmp_path, monkeypatch):
    token_file = tmp_path / "token"
    token_file.write_text(SECRET + "\n")
    monkeypatch.setenv("PARWATCH_TOKEN", "should-not-reach-a-rank")
    cfg = TrainConfig(
        run_id="r1", parwatch="on", parwatch_endpoint="http://127.0.0.1:1", parwatch_token_file=str(token_file)
    )
    per_rank = RankAttach().prepare(cfg, 4)
    assert [a.credential for a in per_rank] == [rank_credential(SECRET, "r1", r) for r in range(4)]
    assert cfg.parwatch_token_file == ""  # the spawned ranks get no path to the secret ...
    assert "PARWATCH_TOKEN" not in os.environ  # ... nor the variable


def test_a_rank_under_torchrun_mints_its_own_from_the_run_key_and_drops_it(hook_registry, monkeypatch):
    monkeypatch.setenv(credentials.RUN_KEY_ENV, run_key(SECRET, "r1"))
    cfg = TrainConfig(tp=1, pp=2, run_id="r1", parwatch="on", parwatch_endpoint="http://127.0.0.1:1")
    collector = attach_from_config(cfg, rank=1, world_size=2, local_rank=1, backend="gloo")
    try:
        assert collector.shipper._headers["Authorization"] == f"Bearer {rank_credential(SECRET, 'r1', 1)}"
        assert credentials.RUN_KEY_ENV not in os.environ
    finally:
        collector.close(timeout=5)
    monkeypatch.setenv(credentials.RUN_KEY_ENV, run_key(SECRET, "another-run"))
    with pytest.raises(AttachError, match="not the key of run 'r1'"):
        attach_from_config(cfg, rank=1, world_size=2, local_rank=1, backend="gloo")
