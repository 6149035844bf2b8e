"""The collector's token against a real sidecar: a copied snippet without one must not train on
silently while the sidecar answers 401 to every summary.

- the collector takes $PARWATCH_TOKEN when given no token, and its summaries are accepted;
- without a token it accepts, attach fails before training starts, naming the fix;
- a sidecar that refuses the token later (the shipper alone) is logged once as an error naming
  the fix, and every summary it drops is counted, as dropped and as refused.
"""

from __future__ import annotations

import logging
import os
import subprocess
import time

import pytest

from parwatch.collector import Collector, attach
from parwatch.collector.attach import AttachError
from parwatch.collector.shipper import Shipper
from parwatch.contract import HookRegistry
from tests import one_client
from tests.deadline import wait_until
from tests.fixtures import synthetic as syn
from tests.sidecar_process import ROOT, running_sidecar, sidecar_command, stop, wait_healthy
from tests.unit.test_collector_sim import ctx_for, pipeline, run_steps

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]
WAIT_S = 30.0


def child_env() -> dict:
    env = {k: v for k, v in os.environ.items() if k != "PARWATCH_TOKEN"}  # its own token, from its state dir
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


def wait_for(predicate, what: str) -> None:
    wait_until(predicate, what, WAIT_S, interval=0.02)


def test_the_collector_takes_its_token_from_PARWATCH_TOKEN(tmp_path, monkeypatch):
    with running_sidecar(tmp_path / "state") as sp:
        monkeypatch.setenv("PARWATCH_TOKEN", sp.token)
        # attach checks the token: it passes; a real clock, as a real collector has (its start is checked)
        run = pipeline(p=2, m=4, endpoint=sp.control_url, time_fn=time.time)
        run.boundary(0, "start", 0.0, 0.1)
        run_steps(run, 3, 0.1)
        for rank in run.ranks:
            rank.collector.close(timeout=WAIT_S)
        assert [r.collector.shipper.sent for r in run.ranks] == [3, 3]
        assert [r.collector.refused_total for r in run.ranks] == [0, 0]
        status = one_client.get(f"{sp.control_url}/v1/status", headers=sp.headers, timeout=10).json()
        assert status["last_step"] == 3


@pytest.mark.parametrize("token", [None, "not-the-token"])
def test_a_token_the_sidecar_refuses_fails_at_attach_naming_the_fix(tmp_path, monkeypatch, token):
    monkeypatch.delenv("PARWATCH_TOKEN", raising=False)
    with running_sidecar(tmp_path / "state") as sp:
        collector = Collector(ctx_for(0), endpoint=sp.control_url, token=token)
        registry = HookRegistry()
        with pytest.raises(AttachError, match="HTTP 401.*PARWATCH_TOKEN") as err:
            attach(collector, registry)
        assert "token=" in str(err.value) and "--parwatch-token-file" in str(err.value)
        assert collector not in registry.observers
        assert not collector.shipper._thread.is_alive()  # closed: no thread left behind


def test_a_sidecar_that_is_not_up_yet_is_no_attach_error(tmp_path, monkeypatch):
    """Attached while its sidecar is down (connection refused): no error; once a sidecar is up at that
    address (the same one, restarted on its state dir and ports), the collectors reconnect by themselves
    and the summaries of later steps reach it."""
    with running_sidecar(tmp_path / "state") as sp:
        pass
    monkeypatch.setenv("PARWATCH_TOKEN", sp.token)
    run = pipeline(p=2, m=4, endpoint=sp.control_url, time_fn=time.time)  # attach: no answer, no error
    assert all(rank.collector._registry is not None for rank in run.ranks)
    wait_for(lambda: run.ranks[0].collector.shipper.unreachable_since, "rank 0's poll to find no sidecar")
    listen = [sp.metrics_url.removeprefix("http://"), sp.control_url.removeprefix("http://")]
    args = ["--state-dir", str(tmp_path / "state"), "--metrics-listen", listen[0], "--control-listen", listen[1]]
    with open(tmp_path / "restarted.log", "wb") as log:
        proc = subprocess.Popen(sidecar_command(*args), stdout=log, stderr=subprocess.STDOUT, env=child_env())
    try:
        wait_healthy(f"{sp.control_url}/healthz", proc, 60)
        # Rank 0 polls for directives: its polls failed while the sidecar was away and backed off (5 s at
        # most; summaries meanwhile are dropped and counted, by design). It reconnects by itself.
        wait_for(lambda: all(r.collector.shipper.unreachable_since is None for r in run.ranks), "the reconnection")
        run.boundary(0, "start", 0.0, 0.1)
        run_steps(run, 3, 0.1)
        for rank in run.ranks:
            rank.collector.close(timeout=WAIT_S)
        status = one_client.get(f"{sp.control_url}/v1/status", headers=sp.headers, timeout=10).json()
    finally:
        stop(proc)
    assert [r.collector.shipper.sent for r in run.ranks] == [3, 3]
    assert status["last_step"] == 3


def test_refused_summaries_are_logged_once_as_an_error_and_counted(tmp_path, caplog):
    with running_sidecar(tmp_path / "state") as sp:
        shipper = Shipper(endpoint=sp.control_url, token="not-the-token", max_backoff_s=0.05).start()
        with caplog.at_level(logging.WARNING, logger="parwatch.collector"):
            for step in range(1, 6):
                t0 = time.perf_counter()
                shipper.put_summary(syn.summary(0, step))
                assert time.perf_counter() - t0 < 0.05  # the training thread never waits for it
                wait_for(lambda step=step: shipper.dropped == step, f"summary {step} dropped")
            shipper.close(timeout=WAIT_S)
    assert shipper.refused == shipper.dropped == 5 and shipper.sent == 0
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1, [r.getMessage() for r in caplog.records]
    message = errors[0].getMessage()
    assert "HTTP 401" in message and "PARWATCH_TOKEN" in message and "token=" in message
    assert not [r for r in caplog.records if "unreachable" in r.getMessage()]  # not mistaken for an outage
