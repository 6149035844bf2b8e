"""A checkpoint directory shared with an earlier run: a rollback loads only this run's checkpoints (issue 25,
item 11: on 8fae0f2 it loaded the newest one, another run's weights, and reported it applied)."""

import pytest

from tests.distutil import run_ranks

pytestmark = [pytest.mark.beside_serial, pytest.mark.dist, pytest.mark.timeout(200)]


def _two_runs(rank: int, world_size: int, root: str, second_saves: bool) -> dict:
    from parwatch import contract
    from parwatch.contract import Action, Directive
    from parwatch.trainer.config import TrainConfig
    from parwatch.trainer.train import Trainer

    small = dict(
        pp=2,
        layers=2,
        hidden=32,
        heads=2,
        vocab=64,
        seq_len=8,
        micro_batch_size=2,
        microbatches=2,
        checkpoint_dir=root,
        keep_checkpoints=0,
    )
    contract.registry.clear()
    Trainer(TrainConfig(run_id="run-a", steps=4, checkpoint_every=2, **small), rank, world_size).run()
    second = Trainer(
        TrainConfig(run_id="run-b", steps=5, checkpoint_every=3 if second_saves else 0, **small), rank, world_size
    )
    second.run()  # 5 steps; run-b's checkpoint at 3 when it saves, run-a's at 2 and 4 in the same directory
    second._rollback(Directive(id=1, action=Action.ROLLBACK, run_id="run-b"))
    return second.applied[-1]


@pytest.mark.parametrize("second_saves", [True, False], ids=["own-checkpoint", "none-of-its-own"])
def test_a_rollback_never_loads_another_runs_checkpoint(tmp_path, second_saves):
    results = run_ranks(_two_runs, 2, str(tmp_path), second_saves, timeout=180)
    for record in results:
        if second_saves:
            assert (record["outcome"], record["loaded_step"]) == ("applied", 3), record  # not run-a's step 4
        else:
            assert (record["outcome"], record["reason"]) == ("failed", "no_checkpoint"), record
