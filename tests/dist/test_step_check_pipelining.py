"""The check before the optimizer step under torch.distributed.pipelining (PipelineWatch, through
examples/torch_pipelining.py): the proofs of tests/step_check_proofs.py on 2 real gloo ranks (1F1B) against
a real sidecar, one spawn for every scenario."""

from __future__ import annotations

import pytest

from tests.distutil import load_example
from tests.step_check_proofs import assert_proofs, example_argv, prove, run_scenarios

pytestmark = [pytest.mark.dist, pytest.mark.integration, pytest.mark.timeout(300)]  # ranks and a sidecar


def _body(rank: int, world_size: int, endpoint: str, token_file: str, out_dir: str) -> dict:
    example = load_example("torch_pipelining")

    def train_one(run_id: str, faults: list[str], log_dir: str) -> dict:
        argv = example_argv(
            ["--schedule", "1f1b", "--microbatches", "2"], run_id, faults, log_dir, endpoint, token_file
        )
        return example.train(example.parse_args(argv))["losses"]

    return run_scenarios(rank, "pipe", out_dir, train_one)


@pytest.fixture(scope="module")
def proofs(tmp_path_factory):
    return prove(tmp_path_factory, _body, "pipe")


def test_pipeline_watch_keeps_every_bad_step_from_the_weights(proofs):
    results, base = proofs
    assert_proofs(results, base / "state", str(base / "runs"), "pipe")
