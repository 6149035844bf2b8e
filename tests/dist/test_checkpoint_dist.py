"""Checkpoint save/load on real gloo ranks, synchronised by torch.distributed.barrier."""

import pytest

from tests.distutil import run_ranks

pytestmark = [pytest.mark.beside_serial, pytest.mark.dist, pytest.mark.timeout(120)]


def _save_then_load(rank: int, world_size: int, root: str) -> dict:
    import torch
    import torch.distributed as dist

    from parwatch.trainer.checkpoint import list_checkpoints, load_checkpoint, save_checkpoint

    def own_state(step):
        return {
            "model": {"w": torch.full((2, rank + 1), float(100 * step + rank))},
            "optimizer": {"state": {}, "param_groups": []},
            "rng": {"rank": rank},
        }

    for step in (4, 8, 12):
        save_checkpoint(
            root, step, rank, world_size, own_state(step), {"rank0_meta": step}, barrier=dist.barrier, keep_last=2
        )
        # The second barrier means the manifest exists on return, on every rank.
        assert list_checkpoints(root)[-1] == step
    state, manifest = load_checkpoint(root, 8, rank, world_size)
    assert torch.equal(state["model"]["w"], own_state(8)["model"]["w"])
    assert state["rng"] == {"rank": rank}
    return {
        "steps": list_checkpoints(root),
        "world_size": manifest["world_size"],
        "w": state["model"]["w"].tolist(),
        "shape": manifest["shards"][rank]["tensors"]["model.w"]["shape"],
    }


@pytest.mark.parametrize("world_size", [2, 3])
def test_every_rank_gets_its_own_tensors_back(tmp_path, world_size):
    results = run_ranks(_save_then_load, world_size, str(tmp_path), timeout=120)
    for rank, result in enumerate(results):
        assert result["steps"] == [8, 12]
        assert result["world_size"] == world_size
        assert result["w"] == [[800.0 + rank] * (rank + 1)] * 2
        assert result["shape"] == [2, rank + 1]
