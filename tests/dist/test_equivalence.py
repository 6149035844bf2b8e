"""End to end: every TP x PP x DP layout and schedule gives the single-process losses.

Same seed, same model, same global batch: the weights are full_init slices and the data
is a pure function of (seed, step, global microbatch index), so a layout may change the
order of additions and nothing else. fp32 must agree to 1e-5 relative over 5 optimizer
steps, fp64 to 1e-12. The trainer runs in-process on each rank (run_ranks); one 4-rank
spawn runs every layout in turn, one 1-rank spawn computes the references.
"""

import math

import pytest

from tests.distutil import run_ranks

pytestmark = [pytest.mark.beside_serial, pytest.mark.dist, pytest.mark.timeout(400)]

STEPS = 5
MODEL = dict(layers=4, hidden=32, heads=4, vocab=64, seq_len=16, micro_batch_size=2, steps=STEPS, seed=0)
GLOBAL_MICROBATCHES = 4  # per step over all DP replicas: the single process runs m=4

# name -> (settings, reference dtype). dp=2 layouts run m=2 each: the same 4 global microbatches.
LAYOUTS = {
    "tp2xpp2-gpipe": dict(tp=2, pp=2, schedule="gpipe"),
    "tp2xpp2-1f1b": dict(tp=2, pp=2, schedule="1f1b"),
    "tp1xpp4-gpipe": dict(pp=4, schedule="gpipe"),
    "tp1xpp4-1f1b": dict(pp=4, schedule="1f1b"),
    "tp2xpp1xdp2-gpipe": dict(tp=2, dp=2, microbatches=2, schedule="gpipe"),
    "tp2xpp1xdp2-1f1b": dict(tp=2, dp=2, microbatches=2, schedule="1f1b"),
    "tp2xpp2-interleaved-m4": dict(tp=2, pp=2, schedule="interleaved", chunks=2),
    "pp2xdp2-interleaved-m2": dict(pp=2, dp=2, microbatches=2, schedule="interleaved", chunks=2),
    "tp2xpp2-1f1b-fp64": dict(tp=2, pp=2, schedule="1f1b", dtype="float64"),
    "tp2xpp1xdp2-gpipe-fp64": dict(tp=2, dp=2, microbatches=2, schedule="gpipe", dtype="float64"),
}
REFERENCES = {"float32": dict(), "float64": dict(dtype="float64")}
TOLERANCE = {"float32": 1e-5, "float64": 1e-12}


def _config(settings: dict):
    from parwatch.trainer.config import TrainConfig

    return TrainConfig(**{**MODEL, "microbatches": GLOBAL_MICROBATCHES, **settings})


def _train_each(rank: int, world_size: int, runs: dict) -> dict:
    """Train every run of `runs` (name -> settings) one after the other; losses by name."""
    from parwatch import contract
    from parwatch.trainer.train import Trainer

    losses = {}
    for name, settings in runs.items():
        contract.registry.clear()
        summary = Trainer(_config(settings), rank, world_size).run()
        losses[name] = [float(x) for x in summary["losses"]]
    return losses


@pytest.fixture(scope="module")
def reference_losses():
    """Single-process losses (world 1, m=4), fp32 and fp64."""
    return run_ranks(_train_each, 1, REFERENCES, timeout=180)[0]


@pytest.fixture(scope="module")
def layout_losses():
    """Every layout's losses as each of the 4 ranks saw them at the step boundaries."""
    return run_ranks(_train_each, 4, LAYOUTS, timeout=180)


def _relative_error(got: list, want: list) -> float:
    return max(abs(g - w) / abs(w) for g, w in zip(got, want))


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_layout_gives_the_single_process_losses(reference_losses, layout_losses, layout):
    dtype = LAYOUTS[layout].get("dtype", "float32")
    want = reference_losses[dtype]
    got = layout_losses[0][layout]
    assert len(got) == len(want) == STEPS
    assert all(math.isfinite(x) for x in want)
    err = _relative_error(got, want)
    assert err <= TOLERANCE[dtype], f"{layout}: losses {got} vs single process {want}: relative error {err:.2e}"


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_every_rank_reads_the_same_loss(layout_losses, layout):
    # The boundary collective hands the last stage's loss to every rank, bit for bit.
    assert all(ranks[layout] == layout_losses[0][layout] for ranks in layout_losses)


def test_the_reference_learns(reference_losses):
    # Guards the comparison against a degenerate model whose loss never moves.
    for dtype, losses in reference_losses.items():
        assert losses[-1] < losses[0], f"{dtype}: loss did not fall over {STEPS} steps: {losses}"


def test_float64_and_float32_differ_only_by_rounding(reference_losses):
    err = _relative_error(reference_losses["float32"], reference_losses["float64"])
    assert 0 < err < 1e-4
