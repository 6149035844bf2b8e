"""Reading back what the leader wrote to a tracker, each with the tracker's own reader, and what /metrics says
the same series are (the oracle the tracker tests hold them to).

Readers return (scalars, texts): scalars = {series: {step: value}}, texts = {tag: [(step, text), ...]}.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from parwatch import ledger_view
from parwatch.bubble import stage_bubble
from parwatch.vocabulary import BubbleCause

WANDB_BIN = Path(sys.executable).with_name("wandb")


def read_tensorboard(run_dir: Path) -> tuple[dict, dict]:
    """TensorBoard's own EventAccumulator over one run's event files (scalars are float32 there)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.util import tensor_util

    acc = EventAccumulator(str(run_dir), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    scalars = {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}
    texts: dict[str, list] = {}
    for tag in acc.Tags()["tensors"]:
        for e in acc.Tensors(tag):
            for item in tensor_util.make_ndarray(e.tensor_proto).ravel():
                texts.setdefault(tag.removesuffix("/text_summary"), []).append((e.step, item.decode()))
    return scalars, texts


def read_mlflow(uri: str, run_id: str, experiment: str = "parwatch") -> tuple[dict, dict, str]:
    """MLflow's client: the run tagged with the parwatch run id, every metric's history, every text artifact.
    Also returns the run's status."""
    import tempfile

    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name(experiment)
    runs = client.search_runs([exp.experiment_id], filter_string=f"tags.`parwatch.run_id` = '{run_id}'")
    assert len(runs) == 1, f"one MLflow run per parwatch run id, found {len(runs)}"
    run = runs[0]
    scalars = {
        key: {m.step: m.value for m in client.get_metric_history(run.info.run_id, key)} for key in run.data.metrics
    }
    texts: dict[str, list] = {}
    with tempfile.TemporaryDirectory() as tmp:
        local = Path(client.download_artifacts(run.info.run_id, "", tmp))
        for path in sorted(local.rglob("*.txt")):
            tag = str(path.parent.relative_to(local))
            step = int(path.name.split("-")[0])
            texts.setdefault(tag, []).append((step, path.read_text()))
    return scalars, texts, run.info.status


def read_wandb(run_dir: Path) -> tuple[dict, dict]:
    """W&B's own reader of its offline transaction log (`wandb leet inspect --json`): the history rows."""
    out = subprocess.run(
        [str(WANDB_BIN), "leet", "inspect", "--json", str(run_dir)],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
        env={**os.environ, "WANDB_MODE": "offline"},
    ).stdout
    scalars: dict[str, dict] = {}
    texts: dict[str, list] = {}
    for line in out.splitlines():
        record = json.loads(line)
        if record.get("type") != "history":
            continue
        step = int(record["history"]["step"]["num"])
        for key, value in record["history"]["item"].items():
            if key.startswith("_"):
                continue
            if isinstance(value, str):
                texts.setdefault(key, []).extend((step, t) for t in value.split("\n"))
            else:
                scalars.setdefault(key, {})[step] = float("nan") if value == "NaN" else float(value)
    return scalars, texts


def wandb_run_dir(root: Path) -> Path:
    dirs = sorted(root.rglob("run-*.wandb"))
    assert len(dirs) == 1, dirs
    return dirs[0].parent


# --- the oracle: what /metrics says -------------------------------------------------------------


def samples(text: str) -> dict[str, dict[tuple, float]]:
    """A /metrics text as sample name -> sorted labels -> value (prometheus_client's parser)."""
    out: dict[str, dict[tuple, float]] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return out


def _grown(now: dict, before: dict, name: str) -> dict:
    b = before.get(name, {})
    return {k: v - b.get(k, 0.0) for k, v in now.get(name, {}).items()}


def expected(now_text: str, before_text: str = "") -> dict[str, float]:
    """The series a tracker should hold for a window ending at `now_text`'s scrape and starting at
    `before_text`'s (empty: the run so far), written out from the definitions: the bubble of a stage is its
    ranks' idle over idle + compute, goodput the ledger's net productive over its wall, p99 Prometheus'
    histogram_quantile."""
    now, before = samples(now_text), samples(before_text) if before_text else {}
    out: dict[str, float] = {}
    if () in now.get("parwatch_loss", {}):
        out["loss"] = now["parwatch_loss"][()]
    dsum = sum(_grown(now, before, "parwatch_step_duration_seconds_sum").values())
    dcount = sum(_grown(now, before, "parwatch_step_duration_seconds_count").values())
    if dcount:
        out["step_seconds"] = dsum / dcount
    mfu = list(now.get("parwatch_model_flops_utilization_ratio", {}).values())
    if mfu:
        out["mfu"] = sum(mfu) / len(mfu)
    if () in now.get("parwatch_hang_detected", {}):
        out["hang_detected"] = now["parwatch_hang_detected"][()]
    ledgers: dict[str, dict[str, float]] = {}
    for key, seconds in _grown(now, before, "parwatch_time_seconds_total").items():
        labels = dict(key)
        ledger = ledgers.setdefault(labels["rank"], {})
        ledger[labels["category"]] = ledger.get(labels["category"], 0.0) + seconds
    total = ledger_view.totals(ledgers.values())
    if total and total["rank_seconds"] > 0:
        out["goodput/ratio"], out["goodput/ettr"] = total["goodput_ratio"], total["ettr"]
        out.update({f"goodput/{c}": s / total["rank_seconds"] for c, s in total["seconds"].items() if s > 0})
    per_stage: dict[str, list[float]] = {}
    for i, name in enumerate(("parwatch_stage_idle_seconds_total", "parwatch_stage_compute_seconds_total")):
        for key, seconds in _grown(now, before, name).items():
            per_stage.setdefault(dict(key)["stage"], [0.0, 0.0])[i] += seconds
    for stage, (idle, compute) in per_stage.items():
        if idle + compute > 0:
            out[f"bubble/stage_{stage}/measured"] = stage_bubble(idle, compute)
    for cause in BubbleCause:
        for key, value in now.get(cause.metric, {}).items():
            out[f"bubble/stage_{dict(key)['stage']}/{cause}"] = value
    for key, value in now.get("parwatch_straggler_ratio", {}).items():
        out[f"straggler/{dict(key)['cause']}"] = value
    buckets: dict[tuple, list] = {}
    for key, count in _grown(now, before, "parwatch_collective_duration_seconds_bucket").items():
        labels = dict(key)
        buckets.setdefault((labels["op"], labels["group"]), []).append((float(labels["le"]), count))
    for (op, group), edges in buckets.items():
        edges.sort()
        total_count = edges[-1][1]
        if total_count <= 0:
            continue
        rank, lo_le, lo_n = 0.99 * total_count, 0.0, 0.0
        for le, n in edges:
            if n >= rank:
                value = lo_le if math.isinf(le) else lo_le + (le - lo_le) * (rank - lo_n) / (n - lo_n)
                out[f"collective_p99/{op}/{group}"] = value
                break
            lo_le, lo_n = le, n
    return out


def same(a: float, b: float, float32: bool = False) -> bool:
    """Equal as stored: TensorBoard keeps scalars as float32; NaN equals NaN."""
    if float32:
        import numpy as np

        a, b = float(np.float32(a)), float(np.float32(b))
    return (math.isnan(a) and math.isnan(b)) or a == b
