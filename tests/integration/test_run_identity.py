"""Issue 25, item 4, against a real `parwatch sidecar`: run identity is decided once per run.

On 40e8301 one stray rank-0 summary with another run id archived the live run: every later summary
of the live run was refused "already ended here" and its NaN was never judged.
"""

from __future__ import annotations

import httpx
import pytest

from tests import one_client
from tests.fixtures import synthetic as syn
from tests.sidecar_process import running_sidecar

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]
STAGES = [syn.stage_view(0, 0.5, 0.38), syn.stage_view(1, 0.5, 0.38)]


def _post(sp, steps, run_id="live", **kw):
    summaries = [
        syn.summary(r, step, run_id=run_id, global_stages=STAGES if r == 0 else None, checkpoints=[1], **kw)
        for step in steps
        for r in (0, 1)
    ]
    return one_client.post(
        f"{sp.control_url}/v1/ingest", json={"version": 1, "summaries": summaries}, headers=sp.headers, timeout=30
    )


def test_a_stray_summary_of_another_run_cannot_end_the_live_one(tmp_path):
    with running_sidecar(tmp_path / "state") as sp:
        assert _post(sp, [1, 2]).status_code == 200
        stray = _post(sp, [1], run_id="another-job")
        assert stray.status_code == 409 and "run 'live' is live here" in stray.json()["detail"], stray.text
        nan = _post(sp, [3, 4, 5], global_loss=float("nan"))
        assert nan.status_code == 200, nan.text
        decisions = one_client.get(f"{sp.control_url}/v1/decisions", headers=sp.headers, timeout=10).json()
        status = one_client.get(f"{sp.control_url}/v1/status", headers=sp.headers, timeout=10).json()
    assert status["run"]["run_id"] == "live"
    assert any(d.get("rule") == "nonfinite-loss" for d in decisions), decisions


def _forged(sp, rank: int, at_step: int, **change) -> httpx.Response:
    s = syn.summary(rank, at_step, run_id="live", global_stages=STAGES if rank == 0 else None, checkpoints=[1])
    for key, value in change.items():
        if key == "global_step":
            s["global"]["step"] = value
        else:
            s[key] = value
    return one_client.post(
        f"{sp.control_url}/v1/ingest", json={"version": 1, "summaries": [s]}, headers=sp.headers, timeout=30
    )


@pytest.mark.parametrize(
    "change, field",
    [
        ({"step": 2**52}, "summaries.0.step=4503599627370496 is ahead of the run"),
        ({"global_step": 2**52}, "summaries.0.global.step=4503599627370496 is after the summary's own step"),
        ({"timeline": 2**31}, "summaries.0.timeline: Expected `int` <= 100000"),
        ({"timeline": 50}, "summaries.0.timeline=50: rank 0 was at timeline 0"),
    ],
)
def test_a_forged_step_timeline_or_view_cannot_freeze_the_live_run(tmp_path, change, field):
    """Issue 25, item 4: on 8fae0f2 one rank-0 summary with global.step 2^52 or timeline 2^31 stood as the run's
    newest view and state, and the real NaN at the next steps was never judged. Steps and timelines only move
    as a run can move them (one rollback a second at most, 1,000 steps a second)."""
    with running_sidecar(tmp_path / "state") as sp:
        assert _post(sp, [1, 2]).status_code == 200
        forged = _forged(sp, 0, 3, **change)
        assert forged.status_code == 422 and field in forged.json()["detail"], forged.text
        nan = _post(sp, [3, 4, 5], global_loss=float("nan"))
        assert nan.status_code == 200, nan.text
        decisions = one_client.get(f"{sp.control_url}/v1/decisions", headers=sp.headers, timeout=10).json()
    assert any(d.get("rule") == "nonfinite-loss" for d in decisions), decisions
