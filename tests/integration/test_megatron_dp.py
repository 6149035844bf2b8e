"""Megatron-Core with DP > 1 in its default rank order ("tp-cp-ep-dp-pp"), watched end to end: 4 gloo
ranks under torchrun run examples/megatron_gpt.py (GPTModel, Megatron's DistributedDataParallel and
finalize_model_grads, each replica on its own batches) against a real `parwatch sidecar`.

TP1 x PP2 x DP2 puts the DP replicas inside the pipeline (rank = dp_rank + 2 * stage), where parwatch's
default order would put stage 1 at rank 1; TP2 x PP1 x DP2 lays ranks out as the default does. One run
per layout: healthy steps, then one rank blocks in its forward for good, and

- every (tp_rank, stage, dp_rank) reports in Megatron's order: the summaries, and the sidecar's per-rank
  series, with no post refused;
- the hang finding names the blocked rank with its coordinates, and every other rank waits for it (its
  pipeline peer in a receive or a TP all-reduce, the other replica in Megatron's DP gradient sync);
- each DP replica's measured bubble (median of steps 2-5) is within 0.02 of the replay of
  Megatron's 1F1B order at that step's measured times (tests/bubble_replay.py, as for DP = 1).

The bubble is a wall-clock figure: it is measured in runs of their own (`timed`: both layouts, 5
steps, on run_ranks' 4 gloo ranks with the collector writing its logs, no sidecar and no hang),
which tests/serial_phase.py runs alone in the serial phase. The watched runs with the hang (`run`)
time nothing, so they run with the other tests.
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest
from prometheus_client.parser import text_string_to_metric_families

from parwatch.integrations.megatron import action_order
from tests import one_client
from tests.bubble_replay import assert_near_replay, replayed_steps
from tests.distutil import load_example, run_ranks
from tests.integration.e2e_util import ROOT, TORCHRUN, decision_records, kill_group, token_args, wait_until
from tests.sidecar_process import running_sidecar

pytestmark = [pytest.mark.integration, pytest.mark.dist, pytest.mark.timeout(300)]

M, HANG_STEP, TOLERANCE = 4, 7, 0.02
LAYOUTS = {  # name -> ((tp, pp, dp), the order kept, {rank: (tp_rank, stage, dp_rank)} in Megatron's default order, the rank hung)
    "tp1-pp2-dp2": ((1, 2, 2), "tp-dp-pp", {0: (0, 0, 0), 1: (0, 0, 1), 2: (0, 1, 0), 3: (0, 1, 1)}, 1),
    "tp2-pp1-dp2": ((2, 1, 2), "tp-pp-dp", {0: (0, 0, 0), 1: (1, 0, 0), 2: (0, 0, 1), 3: (1, 0, 1)}, 2),
}
"""The order a layout keeps is the first that fits (parwatch.rank_layout): at pp = 1 Megatron's is the default."""


def _rank_series(metrics_url: str) -> tuple[set, float]:
    """({(rank, stage)} of parwatch_stage_bubble_ratio, the posts the sidecar refused so far)."""
    families = {
        f.name: f for f in text_string_to_metric_families(one_client.get(f"{metrics_url}/metrics", timeout=10).text)
    }
    ranks = {(int(s.labels["rank"]), int(s.labels["stage"])) for s in families["parwatch_stage_bubble_ratio"].samples}
    refused = families.get("parwatch_posts_refused")
    return ranks, sum(s.value for s in refused.samples if s.name.endswith("_total")) if refused else 0.0


@pytest.fixture(scope="module", params=sorted(LAYOUTS))
def run(request, tmp_path_factory):
    """One watched run of the layout: healthy steps, then its hung rank blocks at HANG_STEP."""
    pytest.importorskip("megatron.core", reason="pip install -e '.[test]' installs megatron-core")
    name = request.param
    (tp, pp, _), _, _, hung = LAYOUTS[name]
    tmp = tmp_path_factory.mktemp(name)
    cmd = [
        TORCHRUN,
        "--nproc-per-node",
        "4",
        str(ROOT / "examples" / "megatron_gpt.py"),
        "--tp",
        str(tp),
        "--pp",
        str(pp),
    ]
    cmd += ["--microbatches", str(M), "--synthetic-ms", "20,40", "--steps", "1000", "--hang-at", f"{hung}:{HANG_STEP}"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    with running_sidecar(tmp / "state") as sidecar:
        cmd += ["--parwatch-log", str(tmp / "log"), "--parwatch-endpoint", sidecar.control_url, *token_args(sidecar)]
        with open(tmp / "out.txt", "wb") as out:
            proc = subprocess.Popen(
                cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
        try:
            finding = wait_until(
                lambda: (
                    [d for d in decision_records(tmp / "state") if d["rule"] in ("hang", "rank-gone")]
                    or proc.poll() is not None
                ),
                "a hang finding",
                timeout=200,
            )
            output = (tmp / "out.txt").read_text(errors="replace")
            assert isinstance(finding, list), f"the run ended (code {proc.returncode}):\n{output[-4000:]}"
            series, refused = _rank_series(sidecar.metrics_url)
            status = one_client.get(f"{sidecar.control_url}/v1/hang", headers=sidecar.headers, timeout=10).json()
        finally:
            kill_group(proc)
    return {
        "name": name,
        "finding": finding[0],
        "dir": tmp / "log",
        "series": series,
        "refused": refused,
        "status": status,
        "output": output,
    }


def timed_body(rank: int, world_size: int, out_dir: str) -> None:
    """Every rank: each layout's example run in turn, 5 steps (steps 2-5 replayed), no hang, no sidecar."""
    from megatron.core import parallel_state

    example = load_example("megatron_gpt")
    try:
        for name, ((tp, pp, _), _, _, _) in sorted(LAYOUTS.items()):
            argv = ["--tp", str(tp), "--pp", str(pp), "--microbatches", str(M), "--synthetic-ms", "20,40"]
            argv += ["--steps", "5", "--run-id", name, "--parwatch-log", os.path.join(out_dir, name)]
            example.train(example.parse_args(argv))
            parallel_state.destroy_model_parallel()
    finally:
        parallel_state.destroy_model_parallel()


@pytest.fixture(scope="module")
def timed(tmp_path_factory):
    """The runs whose bubble the timing test asserts: {layout: {"name", "dir"}} (as `run`'s)."""
    pytest.importorskip("megatron.core", reason="pip install -e '.[test]' installs megatron-core")
    out = tmp_path_factory.mktemp("megatron-dp-timed")
    run_ranks(timed_body, 4, str(out), timeout=280)
    return {name: {"name": name, "dir": out / name} for name in LAYOUTS}


def _summaries(run) -> list[dict]:
    return [json.loads(line) for line in (run["dir"] / "summaries.jsonl").read_text().splitlines()]


def test_every_stage_and_replica_reports_in_megatrons_order(run):
    sizes, order, coords, _ = LAYOUTS[run["name"]]
    rows = [r for r in _summaries(run) if r["step"] < HANG_STEP]
    assert {(r["rank"], (r["tp_rank"], r["stage"], r["dp_rank"])) for r in rows} == set(coords.items())
    assert {((r["tp"], r["pp"], r["dp"]), r["order"]) for r in rows} == {(sizes, order)}
    for rank in coords:  # every healthy step of every rank
        assert {r["step"] for r in rows if r["rank"] == rank} == set(range(1, HANG_STEP)), rank
    assert run["series"] == {(rank, stage) for rank, (_, stage, _) in coords.items()}  # at the sidecar
    assert run["refused"] == 0


def test_a_hung_rank_is_named_with_its_coordinates_and_everyone_waits_for_it(run):
    _, _, coords, hung = LAYOUTS[run["name"]]
    finding = run["finding"]
    assert finding["rule"] == "hang", finding
    culprit = finding["evidence"]["culprit"]
    where = (culprit["rank"], (culprit["tp_rank"], culprit["stage"], culprit["dp_rank"]), culprit["kind"])
    assert where == (hung, coords[hung], "forward"), finding["evidence"]
    assert finding["evidence"]["waiting"] == sorted(set(coords) - {hung}), finding["evidence"]
    assert run["status"]["rank_states"] == {"running": 3, "hung": 1}


def replica_steps(run) -> dict:
    """(tp_rank, dp_rank) -> the steps of that pipeline replica (its stages' ranks) with every stage's spans."""
    (_, pp, _), _, coords, _ = LAYOUTS[run["name"]]
    pipelines: dict = {}  # (tp_rank, dp_rank) -> {stage: rank}
    for rank, (tp_rank, stage, dp_rank) in coords.items():
        pipelines.setdefault((tp_rank, dp_rank), {})[stage] = rank
    return {
        key: replayed_steps(str(run["dir"]), action_order(pp, M), ranks) for key, ranks in sorted(pipelines.items())
    }


def test_each_replica_has_every_stages_spans_of_steps_2_to_5(run):
    for steps in replica_steps(run).values():
        assert sorted(steps) == [2, 3, 4, 5], sorted(steps)  # the collector keeps steps 1-5's spans (SpanSampling)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_each_timed_replica_has_every_stages_spans_of_steps_2_to_5(timed, layout):
    for steps in replica_steps(timed[layout]).values():
        assert sorted(steps) == [2, 3, 4, 5], sorted(steps)


@pytest.mark.timing
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_each_replicas_bubble_matches_the_replay_of_megatrons_order(timed, layout):
    run = timed[layout]
    for (tp_rank, dp_rank), steps in replica_steps(run).items():
        assert_near_replay(steps, f"{run['name']} tp_rank {tp_rank} dp_rank {dp_rank}", TOLERANCE)
