"""The check before the optimizer step under Megatron-Core (MegatronWatch, through examples/megatron_gpt.py):
the proofs of tests/step_check_proofs.py on 2 real gloo ranks (PP2, GPTModel) against a real sidecar, one
spawn for every scenario."""

from __future__ import annotations

import pytest

from tests.distutil import installed, load_example
from tests.step_check_proofs import assert_proofs, example_argv, prove, run_scenarios

pytestmark = [  # ranks and a sidecar
    pytest.mark.dist,
    pytest.mark.integration,
    pytest.mark.timeout(300),
    pytest.mark.skipif(not installed("megatron.core"), reason="pip install -e '.[test]' installs megatron-core"),
]


def _body(rank: int, world_size: int, endpoint: str, token_file: str, out_dir: str) -> dict:
    from megatron.core import parallel_state

    example = load_example("megatron_gpt")

    def train_one(run_id: str, faults: list[str], log_dir: str) -> dict:
        argv = example_argv(["--pp", "2", "--microbatches", "2"], run_id, faults, log_dir, endpoint, token_file)
        return example.train(example.parse_args(argv))["losses"]

    try:
        return run_scenarios(rank, "megatron", out_dir, train_one)
    finally:
        parallel_state.destroy_model_parallel()


@pytest.fixture(scope="module")
def proofs(tmp_path_factory):
    return prove(tmp_path_factory, _body, "megatron")


def test_megatron_watch_keeps_every_bad_step_from_the_weights(proofs):
    results, base = proofs
    assert_proofs(results, base / "state", str(base / "runs"), "megatron")
