"""Checkpoint round trip through the real trainer on TP2 x PP2.

Run 6 steps saving at 3 and 6; a new Trainer with the same config loads step 3 and
runs to 6: steps 4..6 must give bit-identical losses and end on bit-identical weights
(model, optimizer and RNG state all came back). Then one byte of a shard is flipped and
loading refuses it with a CheckpointError naming the file.
"""

import pytest

from tests.distutil import run_ranks

pytestmark = [pytest.mark.beside_serial, pytest.mark.dist, pytest.mark.timeout(200)]


def _weights(trainer) -> list:
    return [t.detach().clone() for c in trainer.chunks for t in c.state_dict().values()]


def _round_trip(rank: int, world_size: int, root: str) -> dict:
    import torch
    import torch.distributed as dist

    from parwatch import contract
    from parwatch.trainer.checkpoint import list_checkpoints, step_dir
    from parwatch.trainer.config import TrainConfig
    from parwatch.trainer.errors import CheckpointError
    from parwatch.trainer.train import Trainer

    contract.registry.clear()
    cfg = dict(
        tp=2,
        pp=2,
        layers=4,
        hidden=32,
        heads=4,
        vocab=64,
        seq_len=16,
        micro_batch_size=2,
        microbatches=4,
        steps=6,
        checkpoint_dir=root,
        checkpoint_every=3,
        keep_checkpoints=0,
    )
    first = Trainer(TrainConfig(**cfg), rank, world_size)
    first_losses = first.run()["losses"]
    saved = list_checkpoints(root)
    first_weights = _weights(first)

    resumed = Trainer(TrainConfig(**cfg), rank, world_size)
    resumed.load_checkpoint(3)
    assert resumed.step == 3
    resumed_losses = resumed.run()["losses"]
    same_weights = all(torch.equal(a, b) for a, b in zip(first_weights, _weights(resumed)))

    # Corrupt rank 1's step-3 shard (same size, one byte flipped), then every rank loads step 3.
    shard = step_dir(root, 3) / "rank_00001.pt"
    dist.barrier()
    if rank == 0:
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0xFF
        shard.write_bytes(bytes(data))
    dist.barrier()
    refused = None
    try:
        resumed.load_checkpoint(3)
    except CheckpointError as e:
        refused = str(e)
    return {
        "first": first_losses,
        "resumed": resumed_losses,
        "saved": saved,
        "same_weights": same_weights,
        "refused": refused,
        "shard": str(shard),
    }


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_ranks(_round_trip, 4, str(tmp_path_factory.mktemp("ckpt")), timeout=180)


def test_saves_at_every_third_step(results):
    assert all(r["saved"] == [3, 6] for r in results)


def test_resumed_run_repeats_steps_4_to_6_exactly(results):
    for rank, r in enumerate(results):
        assert len(r["first"]) == 6
        assert r["resumed"] == r["first"][3:], f"rank {rank}"  # exact equality, not a tolerance


def test_resumed_run_ends_on_the_same_weights(results):
    assert [r["same_weights"] for r in results] == [True] * 4


def test_corrupted_shard_is_refused_naming_the_file(results):
    corrupted = results[1]
    assert corrupted["refused"] is not None, "rank 1 loaded a shard with a flipped byte"
    assert corrupted["shard"] in corrupted["refused"]
    assert "sha256" in corrupted["refused"]
    # Other ranks' shards are intact and still load.
    assert [r["refused"] for r in (results[0], results[2], results[3])] == [None, None, None]
