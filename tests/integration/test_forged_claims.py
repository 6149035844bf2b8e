"""Issue 43, findings 1, 2, 6 and 9: a rank's claims about its process, its progress and its ledger are checked
against what the sidecar knows, and a refused claim is a 4xx, never a 200 that drops the data after it.

The real ranks are this test process (its pid, its real start). The attacker posts from another process, with
today's shared token and with rank 0's own credential: what any rank (or a stray job) held before each rank
had its own credential. A forgery answered 200 on d484f20 and silenced the real rank 0 for the rest of the run.
"""

from __future__ import annotations

import math
import re
import time

import pytest

from tests import one_client
from tests.integration.e2e_util import wait_until
from tests.integration.trust_util import MY_START, Elsewhere, decisions, ingest, rank_headers, summary
from tests.sidecar_process import running_sidecar

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]
RUN = "r1"


@pytest.fixture
def elsewhere():
    e = Elsewhere()
    yield e
    e.close()


def steps(sp, first: int, last: int, nan_at: int | None = None, real: bool = True, **kw) -> None:
    """The real ranks 0 and 1 post steps first..last; rank 0's global view of step `nan_at` has a NaN loss."""
    for step in range(first, last + 1):
        loss = math.nan if step == nan_at else 2.0
        for rank in (0, 1):
            r = ingest(sp, summary(rank, step, RUN, real=real, global_loss=loss, **kw))
            assert r.status_code == 200, (step, rank, r.text)


def judged_nan(sp, step: int) -> bool:
    """A nonfinite-loss decision of global step `step` (rank 0's view of step n is step n - 1)."""
    return any(d["step"] == step for d in decisions(sp, "nonfinite-loss"))


def refused(status: int) -> bool:
    return status in (403, 409, 422)


def test_a_forged_process_start_is_refused_and_the_real_nan_is_judged(tmp_path, elsewhere):
    """Finding 1: one ingest of rank 0 with a start 5 s later than the real one made every later real summary
    "a late post of a restarted process" (200, dropped): the NaN at step 15 was never judged."""
    with running_sidecar(tmp_path / "state") as sp:
        steps(sp, 1, 10)
        forged = summary(0, 11, RUN)
        forged["process_start_time"] = MY_START + 5
        for headers in (sp.headers, rank_headers(sp, RUN, 0)):
            status, text = elsewhere.ingest(sp, forged, headers=headers)
            assert refused(status), (status, text)
        steps(sp, 11, 15, nan_at=15)
        assert wait_until(lambda: judged_nan(sp, 14), "the real NaN judged", timeout=10)
        refusals = one_client.get(f"{sp.metrics_url}/metrics").text
        assert re.search(r'parwatch_posts_refused_total\{post="ingest",reason="conflict"\} [1-9]', refusals)
        assert "refused ranks' summaries (HTTP 409" in sp.log()


def test_unproven_ranks_cannot_move_rank_0s_timeline_or_step_ahead(tmp_path, elsewhere):
    """Finding 2: a rank-0 summary with timeline = current + 1, or a step 1,000 ahead within the pace allowance,
    froze the global view (ordered by (timeline, step)); the NaN after it was never judged. Here the real ranks
    send no pid (a collector the sidecar cannot prove): the claims themselves are checked."""
    with running_sidecar(tmp_path / "state") as sp:
        steps(sp, 1, 10, real=False)
        time.sleep(1.1)  # time passing, not a proof: on d484f20 the pace allowance then covered 1,000 steps
        ahead = summary(0, 11, RUN, real=False, timeline=1)
        far = summary(0, 1010, RUN, real=False)
        for forged in (ahead, far):
            for headers in (sp.headers, rank_headers(sp, RUN, 0)):
                status, text = elsewhere.ingest(sp, forged, headers=headers)
                assert status == 422, (status, text)
        assert "timeline moves only with an applied rollback" in text or "ahead of the run" in text
        steps(sp, 11, 15, nan_at=15, real=False)
        assert wait_until(lambda: judged_nan(sp, 14), "the real NaN judged", timeout=10)


def test_forged_ledger_claims_are_refused_and_counters_never_go_back(tmp_path, elsewhere):
    """Finding 9: a start time of 1e11 gave 98 billion seconds of down; three forged restarts counted steps 1-10
    again (tokens 40,960 -> 163,840); a forged counter of 1e9 then the real one made
    parwatch_time_seconds_total go backwards."""
    with running_sidecar(tmp_path / "state") as sp:
        steps(sp, 1, 10)
        for headers in (sp.headers, rank_headers(sp, RUN, 0)):
            future = summary(0, 11, RUN)
            future["process_start_time"] = 1e11
            assert elsewhere.ingest(sp, future, headers=headers)[0] == 422
            for restart in (1, 2, 3):  # a "restart" while rank 0's process still runs
                replay = [summary(0, step, RUN) for step in range(1, 11)]
                for s in replay:
                    s["process_start_time"] = MY_START + 60 * restart
                status, text = elsewhere.ingest(sp, *replay, headers=headers)
                assert refused(status), (status, text)
            inflated = summary(0, 11, RUN)
            inflated["time_seconds"]["productive"] = 1e9
            status, text = elsewhere.ingest(sp, inflated, headers=headers)
            assert refused(status), (status, text)

        def metric(name: str) -> float:
            text = one_client.get(f"{sp.metrics_url}/metrics").text
            return sum(float(m) for m in re.findall(rf"^{name}(?:\{{[^}}]*\}})? (\S+)$", text, re.M))

        assert metric("parwatch_tokens_total") == 10 * 4096
        before = metric("parwatch_time_seconds_total")
        steps(sp, 11, 12)
        assert metric("parwatch_tokens_total") == 12 * 4096
        assert before <= metric("parwatch_time_seconds_total") < 1e6


def test_a_run_that_ended_here_is_refused_not_dropped(tmp_path):
    """Finding 6: a --resume under a run id archived on this sidecar trained unjudged: every summary answered
    200 and dropped, so rank 0's local fallback (which acts on a summary its sidecar did not take) never ran."""
    with running_sidecar(tmp_path / "state", "--rank-grace-seconds", "1") as sp:
        steps(sp, 1, 3, real=False)
        wait_until(
            lambda: ingest(sp, summary(0, 1, "r2", real=False)).status_code == 200, "run r2 to take over", timeout=10
        )

        def r2_silent() -> bool:  # past its grace: a new run could take over now, but r1 ended here
            ranks = one_client.get(f"{sp.control_url}/v1/status", headers=sp.headers).json()["ranks"]
            return all(r["age_seconds"] > 1.0 for r in ranks.values())

        wait_until(r2_silent, "run r2 to fall silent", timeout=10)
        r = ingest(sp, summary(0, 4, RUN, real=False, global_loss=math.nan))
        assert r.status_code == 409 and "already ended here" in r.json()["detail"] and "--run-id" in r.json()["detail"]
