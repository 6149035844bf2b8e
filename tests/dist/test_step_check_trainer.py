"""The check before the optimizer step in the reference trainer: the proofs of tests/step_check_proofs.py on 2
real gloo ranks (PP2, real compute) against a real sidecar, one spawn for every scenario."""

from __future__ import annotations

import os

import pytest

from tests.step_check_proofs import STEPS, assert_proofs, prove, run_scenarios

pytestmark = [pytest.mark.dist, pytest.mark.integration, pytest.mark.timeout(300)]  # ranks and a sidecar

SMALL = dict(layers=2, hidden=32, heads=4, vocab=64, seq_len=16, micro_batch_size=2)


def _body(rank: int, world_size: int, endpoint: str, token_file: str, out_dir: str) -> dict:
    from parwatch.collector import Collector, RunContext, SpanSampling, attach
    from parwatch.trainer.config import TrainConfig
    from parwatch.trainer.train import Trainer

    def train_one(run_id: str, faults: list[str], log_dir: str) -> dict:
        cfg = TrainConfig(pp=2, microbatches=2, steps=STEPS, run_id=run_id, inject=faults, pause_poll_s=0.1, **SMALL)
        ctx = RunContext.for_rank(run_id, rank, tp=1, pp=2, dp=1, schedule=cfg.schedule, microbatches=2)
        collector = attach(
            Collector(
                ctx,
                endpoint=endpoint,
                token=open(token_file).read().strip(),
                log_path=os.path.join(log_dir, "summaries.jsonl"),
                spans_path=os.path.join(log_dir, "spans.jsonl"),
                span_sample_steps=SpanSampling(first=STEPS),  # every step: the ledger check reads the spans
            )
        )
        trainer = Trainer(cfg, rank, world_size)
        try:
            summary = trainer.run()
        finally:
            collector.close()
            trainer.close()
        return {s + 1: loss for s, loss in enumerate(summary["losses"])} if trainer.reports_loss else {}

    return run_scenarios(rank, "ref", out_dir, train_one)


@pytest.fixture(scope="module")
def proofs(tmp_path_factory):
    return prove(tmp_path_factory, _body, "ref")


def test_the_reference_trainer_keeps_every_bad_step_from_the_weights(proofs):
    results, base = proofs
    assert_proofs(results, base / "state", str(base / "runs"), "ref")
