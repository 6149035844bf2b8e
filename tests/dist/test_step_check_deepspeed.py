"""The check before the optimizer step under DeepSpeed's pipeline engine (DeepSpeedWatch, through
examples/deepspeed_pipe.py): the proofs of tests/step_check_proofs.py on 2 real gloo ranks (PP2,
TrainSchedule) against a real sidecar, one spawn for every scenario."""

from __future__ import annotations

import os

import pytest

from tests.distutil import installed, load_example
from tests.step_check_proofs import STEPS, assert_proofs, example_argv, prove, run_scenarios

pytestmark = [  # ranks and a sidecar
    pytest.mark.dist,
    pytest.mark.integration,
    pytest.mark.timeout(300),
    pytest.mark.skipif(not installed("deepspeed"), reason="pip install -e '.[test]' installs deepspeed"),
]


def _body(rank: int, world_size: int, endpoint: str, token_file: str, out_dir: str) -> dict:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    import logging

    import deepspeed

    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    deepspeed.init_distributed(dist_backend="gloo", verbose=False)  # adopts the group distutil made
    example = load_example("deepspeed_pipe")
    counted: dict = {}  # run id -> the engine's own step counters

    def train_one(run_id: str, faults: list[str], log_dir: str) -> dict:
        argv = example_argv(["--pp", "2", "--microbatches", "2"], run_id, faults, log_dir, endpoint, token_file)
        result = example.train(example.parse_args(argv))
        engine = result["engine"]
        counted[run_id] = {"global_steps": engine.global_steps, "skipped_steps": engine.skipped_steps}
        return result["losses"] if engine.is_last_stage() else {}

    return {**run_scenarios(rank, "deepspeed", out_dir, train_one), "engine": counted}


@pytest.fixture(scope="module")
def proofs(tmp_path_factory):
    return prove(tmp_path_factory, _body, "deepspeed")


def test_deepspeed_watch_keeps_every_bad_step_from_the_weights(proofs):
    results, base = proofs
    assert_proofs(results, base / "state", str(base / "runs"), "deepspeed")


def test_a_skip_rides_deepspeeds_own_overflow_path(proofs):
    """The engine counts the skipped steps as it counts an fp16 overflow, and its step count goes on."""
    results, _ = proofs
    skipped = {"clean": 0, "transients": 0, "bad-batches": 3}
    for rank, r in enumerate(results):
        for name, n in skipped.items():
            assert r["engine"][f"deepspeed-{name}"] == {"global_steps": STEPS, "skipped_steps": n}, (rank, name)
