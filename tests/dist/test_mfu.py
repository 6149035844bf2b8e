"""MFU in the collector's summaries: model FLOPs of the step over (step seconds x configured peak)."""

from __future__ import annotations

import json
import os

import pytest

from tests.distutil import run_ranks

pytestmark = [pytest.mark.beside_serial, pytest.mark.dist]
PEAK = 1e9  # a made-up peak FLOP/s, so the ratio is large enough to read


def _run(rank, world, log_dir, peak):
    from parwatch.collector.attach import attach_from_config
    from parwatch.trainer.config import TrainConfig
    from parwatch.trainer.train import Trainer

    cfg = TrainConfig(
        steps=3,
        layers=2,
        hidden=32,
        heads=4,
        seq_len=16,
        microbatches=2,
        parwatch="on",
        parwatch_log=log_dir,
        parwatch_peak_flops=peak,
        run_id="mfu",
    )
    collector = attach_from_config(cfg, rank, world, 0, "gloo")
    try:
        trainer = Trainer(cfg, rank, world)
        trainer.run()
        return trainer.model_flops_per_step
    finally:
        collector.close()


def _summaries(log_dir):
    with open(os.path.join(log_dir, "summaries.jsonl")) as f:
        return [json.loads(line) for line in f]


def test_mfu_is_model_flops_over_step_time_and_peak(tmp_path):
    (flops,) = run_ranks(_run, 1, str(tmp_path), PEAK, timeout=120)
    assert flops > 0
    summaries = _summaries(tmp_path)
    assert len(summaries) == 3
    for s in summaries:
        assert s["model_flops_utilization_ratio"] == pytest.approx(flops / (s["step_seconds"] * PEAK), rel=1e-9)


def test_no_mfu_without_a_configured_peak(tmp_path):
    run_ranks(_run, 1, str(tmp_path), 0.0, timeout=120)
    assert all(s["model_flops_utilization_ratio"] is None for s in _summaries(tmp_path))  # null: no peak, no MFU
