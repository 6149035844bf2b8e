"""What every trainer owes issue 42, checked the same way for each: the reference trainer, torch pipelining,
Megatron-Core and DeepSpeed (tests/dist/test_step_check_*.py).

One spawn of 2 real gloo ranks per trainer runs three runs in turn against one real sidecar (its packaged
default rules), run id `<trainer>-<scenario>` (three, not one per fault: a run costs Megatron and DeepSpeed
seconds to build):

- clean: no fault, the reference for bitwise losses;
- transients: `nan:step=3` (the loss NaN once, on rank 1, the last stage) and `sdc:rank=0` at steps 2 and 5
  (rank 0's gradients corrupted once each): each re-run, transient, no rollback, naming the rank that
  produced it; the losses bitwise those of clean; the suspect-device rule names rank 0 (two transients),
  not rank 1 (one);
- bad-batches: bad batches at steps 2, 4 and 5 (NaN every time computed): re-run, persistent, skipped and
  named, skipped, then skipped and paused with the record saying why; an operator (a thread here, through
  the sidecar's API) resumes and the run completes, every applied step's loss finite.

In every run no optimizer step ever writes a non-finite weight (a torch optimizer post-step hook on every
rank), and each rank's goodput ledger holds as wasted the compute of the passes the check threw away,
measured independently from the run's span records, within 2%.
"""

from __future__ import annotations

import json
import math
import os
import threading
import time
from pathlib import Path

import httpx

from tests import one_client
from tests.integration.e2e_util import read_jsonl

STEPS = 8
SDC_RANK, LOSS_RANK = 0, 1
BAD_BATCHES = (2, 4, 5)  # within the steps the examples' collectors keep spans of (1-5): the ledger check reads them
SCENARIOS: dict[str, list[str]] = {
    "clean": [],
    "transients": ["nan:step=3", f"sdc:rank={SDC_RANK},step=2", f"sdc:rank={SDC_RANK},step=5"],
    "bad-batches": [f"bad-batch:step={s}" for s in BAD_BATCHES],
}
COMPUTE = {"forward", "backward", "backward_input", "backward_weight", "loss"}
LEDGER_TOLERANCE = 0.02


# ------------------------------------------------------------------------------ inside each rank
class Watch:
    """On one rank, for one scenario: every optimizer step's weights (a torch post-step hook: every step
    of every optimizer) and every verdict the check announces (Event.STEP_CHECKED)."""

    def __init__(self) -> None:
        from torch.optim.optimizer import register_optimizer_step_post_hook

        from parwatch.contract import Observer, registry

        self.steps = self.nonfinite = 0
        self.verdicts: list[dict] = []
        watch = self

        class Verdicts(Observer):
            def on_event(self, name, attrs):
                if name == "step_checked":
                    watch.verdicts.append(attrs["verdict"])

        self._observer = Verdicts()
        registry.register(self._observer)
        self._hook = register_optimizer_step_post_hook(self._after_step)

    def _after_step(self, optimizer, args, kwargs) -> None:
        import torch

        self.steps += 1
        params = [p for group in optimizer.param_groups for p in group["params"]]
        if not all(bool(torch.isfinite(p).all()) for p in params):
            self.nonfinite += 1

    def close(self) -> dict:
        from parwatch.contract import registry

        registry.unregister(self._observer)
        self._hook.remove()
        return {"optimizer_steps": self.steps, "nonfinite_weights": self.nonfinite, "verdicts": self.verdicts}


def run_scenarios(rank: int, trainer: str, out_dir: str, train_one) -> dict:
    """Every scenario on this rank: `train_one(run_id, faults, log_dir)` trains one run (the collector
    shipping to the sidecar, writing to log_dir) and returns {step: loss} of the surviving steps (the
    rank holding the loss; {} elsewhere). Returns {scenario: {losses, verdicts, optimizer_steps,
    nonfinite_weights}}."""
    out = {}
    for name, faults in SCENARIOS.items():
        watch = Watch()
        losses = train_one(f"{trainer}-{name}", faults, os.path.join(out_dir, name))
        out[name] = {**watch.close(), "losses": {str(s): repr(float(v)) for s, v in losses.items()}}
    return out


def example_argv(layout: list[str], run_id: str, faults: list[str], log_dir: str, endpoint: str, token_file: str):
    """An example's arguments for one scenario: its layout, 1/2 ms stages, STEPS steps, the sidecar."""
    argv = [*layout, "--synthetic-ms", "1,2", "--steps", str(STEPS), "--run-id", run_id, "--parwatch-log", log_dir]
    argv += ["--parwatch-endpoint", endpoint, "--parwatch-token-file", token_file]
    return argv + [a for f in faults for a in ("--inject", f)]


# ------------------------------------------------------------------------------ the test process
def prove(tmp_path_factory, body, trainer: str, timeout: float = 240) -> tuple[list[dict], Path]:
    """Every scenario on 2 real ranks (`body(rank, world, endpoint, token_file, out_dir)`, which calls
    run_scenarios) against one real sidecar, an operator resuming what pauses: (results by rank, the
    base directory: its state/ and runs/)."""
    from tests.distutil import run_ranks
    from tests.sidecar_process import running_sidecar

    base = tmp_path_factory.mktemp(f"step-check-{trainer}")
    with running_sidecar(base / "state", "--max-runs", "8") as sidecar, Operator(sidecar):
        results = run_ranks(body, 2, sidecar.control_url, str(sidecar.token_file), str(base / "runs"), timeout=timeout)
    return results, base


class Operator:
    """Resumes every run the check paused, as an operator would, through the sidecar's API."""

    def __init__(self, sidecar) -> None:
        self.url, self.headers = sidecar.control_url, sidecar.headers
        self.resumed: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def __enter__(self) -> Operator:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(10)

    def _loop(self) -> None:
        while not self._stop.wait(0.2):
            try:
                answer = one_client.get(
                    f"{self.url}/v1/decisions", params={"limit": 50}, headers=self.headers, timeout=5
                )
                for d in answer.json():
                    if d.get("source") == "step_check" and d.get("action") == "pause" and d["id"] not in self.resumed:
                        self.resumed.append(d["id"])
                        time.sleep(0.3)  # the ranks hold after the step's boundary
                        one_client.post(
                            f"{self.url}/v1/control",
                            json={"action": "resume", "reason": "test operator", "requested_by": "test"},
                            headers=self.headers,
                            timeout=5,
                        )
            except (httpx.HTTPError, ValueError):
                continue


def decisions(state_dir: Path, run_id: str) -> list[dict]:
    """The run's decision records: its archived log (STATE_DIR/runs/RUN_ID/) or the current one."""
    for path in (Path(state_dir) / "runs" / run_id / "decisions.jsonl", Path(state_dir) / "decisions.jsonl"):
        rows = [r for r in read_jsonl(path) if r.get("type") == "decision" and r.get("run_id") == run_id]
        if rows:
            return rows
    return []


def checks(state_dir: Path, run_id: str) -> list[dict]:
    """The run's records of the check before the optimizer step (other rules may fire on a tiny run's
    noise: a skewed first step, say)."""
    return [d for d in decisions(state_dir, run_id) if d["source"] == "step_check"]


def losses_of(results: list[dict], scenario: str) -> dict[int, float]:
    """The scenario's {step: loss}, from the rank that reported them."""
    (losses,) = [r[scenario]["losses"] for r in results if r[scenario]["losses"]]
    return {int(s): float(v) for s, v in losses.items()}


def verdicts_of(results: list[dict], scenario: str) -> list[dict]:
    """The scenario's verdicts, which every rank reached alike (checked)."""
    seen = [r[scenario]["verdicts"] for r in results]
    assert all(v == seen[0] for v in seen), seen
    return seen[0]


def assert_proofs(results: list[dict], state_dir: Path, out_dir: str, trainer: str) -> None:
    """Every proof of the module docstring, for one trainer's results (one dict per rank)."""
    for name in SCENARIOS:
        for rank, r in enumerate(results):
            assert r[name]["nonfinite_weights"] == 0, (trainer, name, rank, r[name])
            assert r[name]["optimizer_steps"] > 0, (trainer, name, rank)
    clean = losses_of(results, "clean")
    assert sorted(clean) == list(range(1, STEPS + 1)) and all(map(math.isfinite, clean.values())), clean
    assert verdicts_of(results, "clean") == [] and checks(state_dir, f"{trainer}-clean") == []

    # transients: re-run, applied, no rollback; the losses bitwise the clean run's; each names its rank.
    transients = verdicts_of(results, "transients")
    assert [(v["step"], v["action"], v["triage"], v["applied"], v["ranks"]) for v in transients] == [
        (2, "rerun", "transient", True, [SDC_RANK]),
        (3, "rerun", "transient", True, [LOSS_RANK]),
        (5, "rerun", "transient", True, [SDC_RANK]),
    ], transients
    assert losses_of(results, "transients") == clean
    recorded = checks(state_dir, f"{trainer}-transients")
    assert [(d["rule"], d["action"], d["triage"], d["step"], d["ranks"]) for d in recorded] == [
        ("step-nonfinite", "rerun", "transient", v["step"], v["ranks"]) for v in transients
    ]
    assert all(d["enforced"] for d in recorded) and not any(
        d["action"] == "rollback" for d in decisions(state_dir, f"{trainer}-transients")
    )
    (suspect,) = [d for d in decisions(state_dir, f"{trainer}-transients") if d["rule"] == "suspect-device"]
    assert suspect["action"] == "alert" and suspect["evidence"]["culprit"]["rank"] == SDC_RANK, suspect

    # bad-batches: persistent, skipped and named, the third skip pauses; resumed, the run completes.
    bad = verdicts_of(results, "bad-batches")
    assert [(v["step"], v["action"], v["triage"], v["applied"], v["batch"]) for v in bad] == [
        (2, "skip", "persistent", False, 2),
        (4, "skip", "persistent", False, 4),
        (5, "pause", "persistent", False, 5),
    ], bad
    losses = losses_of(results, "bad-batches")
    assert sorted(losses) == list(range(1, STEPS + 1))
    assert all(math.isfinite(v) == (s not in BAD_BATCHES) for s, v in losses.items()), losses
    recorded = checks(state_dir, f"{trainer}-bad-batches")
    assert [(d["action"], d["triage"], d["batch"]) for d in recorded] == [
        ("skip", "persistent", 2),
        ("skip", "persistent", 4),
        ("pause", "persistent", 5),
    ], recorded
    assert "batch 2" in recorded[0]["reason"], recorded[0]["reason"]
    paused = recorded[2]
    assert paused["escalated"] and "3 steps skipped within 500 steps" in paused["reason"], paused
    assert paused["evidence"]["skipped_steps"] == list(BAD_BATCHES)

    for name in ("transients", "bad-batches"):
        assert_wasted_is_the_discarded_compute(Path(out_dir) / name, verdicts_of(results, name), trainer)


def assert_wasted_is_the_discarded_compute(log_dir: Path, verdicts: list[dict], trainer: str) -> None:
    """Per rank: the ledger's wasted seconds against the compute spans of the passes the check threw away
    (a re-run's first pass: the first half of its step's compute spans by end time; all of a skipped
    step's), from spans.jsonl."""
    spans = [s for s in read_jsonl(log_dir / "spans.jsonl") if s["kind"] in COMPUTE]
    for ledger_path in sorted(log_dir.glob("ledger-rank*.json")):
        ledger = json.loads(ledger_path.read_text())
        rank = ledger["rank"]
        discarded = 0.0
        for v in verdicts:
            mine = sorted((s for s in spans if s["rank"] == rank and s["step"] == v["step"]), key=lambda s: s["end_s"])
            assert mine and len(mine) % 2 == 0, (trainer, rank, v["step"], len(mine))
            thrown = mine if not v["applied"] else mine[: len(mine) // 2]
            discarded += sum(s["end_s"] - s["start_s"] for s in thrown)
        wasted = ledger["time_seconds"]["wasted"]
        assert abs(wasted - discarded) <= LEDGER_TOLERANCE * discarded, (trainer, log_dir.name, rank, wasted, discarded)
        print(
            f"{trainer} {log_dir.name} rank {rank}: wasted {wasted:.5f} s, discarded passes {discarded:.5f} s "
            f"({100 * (wasted - discarded) / discarded:+.3f}%)"
        )
