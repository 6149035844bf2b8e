"""Checkpoint save/load in one process: ranks 1..N-1 save first, rank 0 last (a no-op barrier)."""

import hashlib
import json
import os

import pytest
import torch

import parwatch.trainer.checkpoint as ckpt
from parwatch.trainer.checkpoint import (
    list_checkpoints,
    load_checkpoint,
    read_manifest,
    save_checkpoint,
)
from parwatch.trainer.errors import CheckpointError


def no_barrier():
    pass


def rank_state(rank: int, step: int) -> dict:
    gen = torch.Generator().manual_seed(1000 * step + rank)
    weight = torch.randn(4, 3, generator=gen)
    return {
        "model": {"layer.weight": weight, "layer.bias": torch.arange(3, dtype=torch.bfloat16) + rank},
        "optimizer": {
            "state": {0: {"exp_avg": weight * 0.5, "step": torch.tensor(float(step))}},
            "param_groups": [{"lr": 0.1, "params": [0]}],
        },
        "rng": {"torch": torch.get_rng_state(), "python": ("v", rank)},
    }


def save_all(root, step, world_size=3, keep_last=3, meta=None):
    for rank in [*range(1, world_size), 0]:
        out = save_checkpoint(
            root,
            step,
            rank,
            world_size,
            rank_state(rank, step),
            meta or {"data_position": step * 8},
            no_barrier,
            keep_last=keep_last,
        )
    return out


def test_round_trip_is_exact_for_every_rank(tmp_path):
    directory = save_all(tmp_path, 10)
    assert directory == tmp_path / "step_00000010"
    for rank in range(3):
        state, manifest = load_checkpoint(tmp_path, 10, rank, 3)
        expected = rank_state(rank, 10)
        for key in ("layer.weight", "layer.bias"):
            assert torch.equal(state["model"][key], expected["model"][key])
            assert state["model"][key].dtype == expected["model"][key].dtype
        assert torch.equal(state["optimizer"]["state"][0]["exp_avg"], expected["optimizer"]["state"][0]["exp_avg"])
        assert state["optimizer"]["param_groups"] == expected["optimizer"]["param_groups"]
        assert state["rng"]["python"] == ("v", rank)
        assert manifest["meta"] == {"data_position": 80}


def test_manifest_records_shapes_dtypes_and_hashes(tmp_path):
    save_all(tmp_path, 5, world_size=2)
    manifest = read_manifest(tmp_path, 5)
    assert manifest["step"] == 5 and manifest["world_size"] == 2
    assert [s["file"] for s in manifest["shards"]] == ["rank_00000.pt", "rank_00001.pt"]
    tensors = manifest["shards"][1]["tensors"]
    assert tensors["model.layer.weight"] == {"shape": [4, 3], "dtype": "float32"}
    assert tensors["model.layer.bias"] == {"shape": [3], "dtype": "bfloat16"}
    assert tensors["optimizer.state.0.step"] == {"shape": [], "dtype": "float32"}
    assert tensors["rng.torch"]["dtype"] == "uint8"
    shard = tmp_path / "step_00000005" / "rank_00001.pt"
    assert manifest["shards"][1]["bytes"] == shard.stat().st_size
    assert manifest["shards"][1]["sha256"] == hashlib.sha256(shard.read_bytes()).hexdigest()


def test_keep_last_prunes_oldest_complete_checkpoints(tmp_path):
    for step in (10, 20, 30, 40):
        save_all(tmp_path, step, world_size=2, keep_last=2)
    assert list_checkpoints(tmp_path) == [30, 40]
    assert not (tmp_path / "step_00000010").exists()


def test_keep_last_zero_keeps_all(tmp_path):
    for step in (1, 2, 3, 4):
        save_all(tmp_path, step, world_size=1, keep_last=0)
    assert list_checkpoints(tmp_path) == [1, 2, 3, 4]


def test_resaving_an_older_step_keeps_it_even_beyond_keep_last(tmp_path):
    save_all(tmp_path, 10, world_size=1, keep_last=1)
    save_all(tmp_path, 20, world_size=1, keep_last=1)
    save_all(tmp_path, 15, world_size=1, keep_last=1)  # after a rollback below step 20
    assert list_checkpoints(tmp_path) == [15, 20]
    state, _ = load_checkpoint(tmp_path, 15, 0, 1)
    assert torch.equal(state["model"]["layer.weight"], rank_state(0, 15)["model"]["layer.weight"])


def test_incomplete_step_is_ignored_and_refused(tmp_path):
    save_all(tmp_path, 10, world_size=2)
    # Rank 1 saved step 20, rank 0 never did: no manifest.
    save_checkpoint(tmp_path, 20, 1, 2, rank_state(1, 20), {}, no_barrier)
    assert list_checkpoints(tmp_path) == [10]
    with pytest.raises(CheckpointError, match=r"step_00000020/manifest.json: missing: incomplete checkpoint"):
        load_checkpoint(tmp_path, 20, 1, 2)


def test_incomplete_dirs_older_than_newest_complete_are_removed(tmp_path):
    save_checkpoint(tmp_path, 5, 1, 2, rank_state(1, 5), {}, no_barrier)
    save_all(tmp_path, 10, world_size=2)
    assert not (tmp_path / "step_00000005").exists()


def test_rank_zero_refuses_manifest_when_a_rank_is_missing(tmp_path):
    with pytest.raises(CheckpointError, match=r"rank_00001.json: missing: rank 1 did not finish saving"):
        save_checkpoint(tmp_path, 7, 0, 2, rank_state(0, 7), {}, no_barrier)
    assert list_checkpoints(tmp_path) == []


def test_listed_in_step_order(tmp_path):
    assert list_checkpoints(tmp_path / "nowhere") == []
    for step in (30, 10, 20):
        save_all(tmp_path, step, world_size=1, keep_last=0)
    assert list_checkpoints(tmp_path) == [10, 20, 30]


def test_truncated_shard_is_refused_naming_the_file(tmp_path):
    save_all(tmp_path, 10, world_size=2)
    shard = tmp_path / "step_00000010" / "rank_00001.pt"
    shard.write_bytes(shard.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match=r"step_00000010/rank_00001.pt: size mismatch.*truncated"):
        load_checkpoint(tmp_path, 10, 1, 2)
    load_checkpoint(tmp_path, 10, 0, 2)  # the other rank's shard is untouched


def test_flipped_byte_is_refused_naming_the_file(tmp_path):
    save_all(tmp_path, 10, world_size=2)
    shard = tmp_path / "step_00000010" / "rank_00000.pt"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"step_00000010/rank_00000.pt: sha256 mismatch.*altered"):
        load_checkpoint(tmp_path, 10, 0, 2)


def test_missing_shard_is_refused(tmp_path):
    save_all(tmp_path, 10, world_size=2)
    os.unlink(tmp_path / "step_00000010" / "rank_00001.pt")
    with pytest.raises(CheckpointError, match=r"rank_00001.pt: missing"):
        load_checkpoint(tmp_path, 10, 1, 2)


def test_world_size_mismatch_names_both_sizes(tmp_path):
    save_all(tmp_path, 10, world_size=3, meta={"parallel": {"tp": 3, "pp": 1, "dp": 1}})
    with pytest.raises(CheckpointError, match=r"world size 3 but this run has world size 2.*--tp/--pp/--dp.*'tp': 3"):
        load_checkpoint(tmp_path, 10, 0, 2)


def test_corrupt_manifest_is_refused(tmp_path):
    save_all(tmp_path, 10, world_size=1)
    (tmp_path / "step_00000010" / "manifest.json").write_text("{not json")
    with pytest.raises(CheckpointError, match=r"manifest.json: unreadable"):
        load_checkpoint(tmp_path, 10, 0, 1)


def test_no_temp_files_remain(tmp_path):
    save_all(tmp_path, 10, world_size=3)
    names = sorted(os.listdir(tmp_path / "step_00000010"))
    assert names == ["manifest.json"] + [f"rank_{r:05d}.{ext}" for r in range(3) for ext in ("json", "pt")]


def test_crash_inside_torch_save_leaves_no_partial_shard(tmp_path, monkeypatch):
    def crashing_save(obj, f):
        f.write(b"PK\x03\x04 half a zip")
        raise RuntimeError("disk full")

    monkeypatch.setattr(ckpt.torch, "save", crashing_save)
    with pytest.raises(RuntimeError, match="disk full"):
        save_checkpoint(tmp_path, 10, 1, 2, rank_state(1, 10), {}, no_barrier)
    assert os.listdir(tmp_path / "step_00000010") == []
    assert list_checkpoints(tmp_path) == []


def test_crash_while_resaving_keeps_old_shard_whole(tmp_path, monkeypatch):
    save_all(tmp_path, 10, world_size=1)
    shard = tmp_path / "step_00000010" / "rank_00000.pt"
    before = shard.read_bytes()

    def crashing_save(obj, f):
        f.write(b"garbage")
        raise RuntimeError("killed")

    monkeypatch.setattr(ckpt.torch, "save", crashing_save)
    with pytest.raises(RuntimeError):
        save_checkpoint(tmp_path, 10, 0, 1, rank_state(0, 11), {}, no_barrier)
    assert shard.read_bytes() == before
    # The re-save began, so the old manifest no longer vouches for step 10.
    assert list_checkpoints(tmp_path) == []


def test_stale_shards_from_a_larger_world_are_removed(tmp_path):
    save_all(tmp_path, 10, world_size=3)
    save_all(tmp_path, 10, world_size=2)
    manifest = json.loads((tmp_path / "step_00000010" / "manifest.json").read_text())
    assert manifest["world_size"] == 2
    assert not (tmp_path / "step_00000010" / "rank_00002.pt").exists()
    load_checkpoint(tmp_path, 10, 1, 2)
