"""Collective census from the hook events of a real TP2 x PP2 run.

An observer on every rank counts the TP collectives by (step, enclosing compute span
kind, op, bytes) and the p2p transfers by (step, kind, what, bytes). Megatron's
accounting must hold exactly, per step and per stage, with L layers over 2 stages
(L/2 blocks each) and m microbatches of b sequences of s tokens, width h, fp32:

  every block, every microbatch: 2 forward + 2 backward all-reduces of b*s*h elements
  first stage: + 1 forward all-reduce (vocab-parallel embedding)
  last stage:  + 1 backward all-reduce (LM head input) + 3 forward all-reduces of b*s
               elements (vocab-parallel cross entropy: max, target logit, sum of exp)
  p2p: per chunk boundary crossed, m activations forward and m gradients back, b*s*h each
"""

from collections import Counter

import pytest

from tests.distutil import run_ranks

pytestmark = [pytest.mark.beside_serial, pytest.mark.dist, pytest.mark.timeout(200)]

LAYERS, HIDDEN, SEQ, BATCH, M, STEPS = 4, 32, 16, 2, 4, 2
ACT_BYTES = BATCH * SEQ * HIDDEN * 4
TOKEN_BYTES = BATCH * SEQ * 4
SCHEDULES = {
    "gpipe": dict(schedule="gpipe"),
    "1f1b": dict(schedule="1f1b"),
    "interleaved": dict(schedule="interleaved", chunks=2),
}


def _census_observer():
    from parwatch import contract

    class Census(contract.Observer):
        """Counts TP collectives by the compute span they ran inside, and p2p transfers, per step."""

        def __init__(self):
            self.step = 1
            self.open = []  # TP collective spans that ended since the last compute span ended
            self.tp = Counter()
            self.p2p = Counter()

        def on_span(self, span):
            if span.kind == contract.SpanKind.COLLECTIVE and span.attrs["group"] == "tp":
                # A collective inside a compute span ends before it does: hold it until then.
                self.open.append(span)
            elif span.kind in contract.COMPUTE_KINDS:
                for c in self.open:
                    inside = span.start <= c.start and c.end <= span.end
                    self.tp[(self.step, span.kind if inside else "outside", c.attrs["op"], c.attrs["bytes"])] += 1
                self.open.clear()
            elif span.kind in (contract.SpanKind.SEND, contract.SpanKind.RECV):
                self.p2p[(self.step, span.kind, span.attrs["what"], span.attrs["bytes"])] += 1

        def on_boundary(self, info, slot_rows):
            for c in self.open:
                self.tp[(self.step, "outside", c.attrs["op"], c.attrs["bytes"])] += 1
            self.open.clear()
            if info.kind == "step":
                self.step = info.step + 1

    return Census()


def _count(rank: int, world_size: int) -> dict:
    from parwatch import contract
    from parwatch.trainer.config import TrainConfig
    from parwatch.trainer.train import Trainer

    results = {}
    for name, settings in SCHEDULES.items():
        contract.registry.clear()
        census = _census_observer()
        contract.registry.register(census)
        cfg = TrainConfig(
            tp=2,
            pp=2,
            layers=LAYERS,
            hidden=HIDDEN,
            heads=4,
            vocab=64,
            seq_len=SEQ,
            micro_batch_size=BATCH,
            microbatches=M,
            steps=STEPS,
            **settings,
        )
        trainer = Trainer(cfg, rank, world_size)
        trainer.run()
        contract.registry.clear()
        results[name] = {"stage": trainer.groups.stage, "tp": dict(census.tp), "p2p": dict(census.p2p)}
    return results


def expected_tp(stage: int, step: int) -> dict:
    blocks = LAYERS // 2
    fwd, bwd = 2 * blocks * M, 2 * blocks * M
    want = {}
    if stage == 0:
        fwd += M  # embedding
    else:
        bwd += M  # LM head's column-parallel input
        want[(step, "forward", "all_reduce", TOKEN_BYTES)] = 3 * M  # cross entropy
    want[(step, "forward", "all_reduce", ACT_BYTES)] = fwd
    want[(step, "backward", "all_reduce", ACT_BYTES)] = bwd
    return want


def expected_p2p(stage: int, step: int, chunks: int) -> dict:
    # Virtual stages 0..2*chunks-1 alternate between the two ranks; each boundary between
    # neighbours carries m activations forward and m gradients back.
    sends_act = recvs_act = sends_grad = recvs_grad = 0
    for vs in range(stage, 2 * chunks, 2):
        not_first, not_last = vs > 0, vs < 2 * chunks - 1
        recvs_act += M * not_first
        sends_grad += M * not_first
        sends_act += M * not_last
        recvs_grad += M * not_last
    want = {
        (step, "send", "activation", ACT_BYTES): sends_act,
        (step, "recv", "activation", ACT_BYTES): recvs_act,
        (step, "send", "grad", ACT_BYTES): sends_grad,
        (step, "recv", "grad", ACT_BYTES): recvs_grad,
    }
    return {k: v for k, v in want.items() if v}


@pytest.fixture(scope="module")
def census_by_rank():
    return run_ranks(_count, 4, timeout=180)


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_tp_all_reduces_per_step_per_stage(census_by_rank, schedule):
    for rank, results in enumerate(census_by_rank):
        got = results[schedule]
        stage = got["stage"]
        assert stage == rank // 2  # TP ranks are adjacent
        want = {}
        for step in range(1, STEPS + 1):
            want.update(expected_tp(stage, step))
        assert got["tp"] == want, f"rank {rank} (stage {stage}), {schedule}"


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_p2p_transfers_per_step_per_stage(census_by_rank, schedule):
    chunks = SCHEDULES[schedule].get("chunks", 1)
    for rank, results in enumerate(census_by_rank):
        got = results[schedule]
        want = {}
        for step in range(1, STEPS + 1):
            want.update(expected_p2p(got["stage"], step, chunks))
        assert got["p2p"] == want, f"rank {rank} (stage {got['stage']}), {schedule}"


def test_expected_p2p_matches_the_plain_pipeline():
    # The formula's two-stage, one-chunk case, spelled out.
    assert expected_p2p(0, 1, 1) == {(1, "send", "activation", ACT_BYTES): M, (1, "recv", "grad", ACT_BYTES): M}
    assert expected_p2p(1, 1, 1) == {(1, "recv", "activation", ACT_BYTES): M, (1, "send", "grad", ACT_BYTES): M}
