"""Checkpoints: one shard per rank plus a manifest that makes the step complete.

Layout under `root`:

    step_00000010/
        rank_00000.pt     torch.save of that rank's state (model, optimizer, rng)
        rank_00000.json   that shard's sha256, size and tensor shapes/dtypes
        ...
        manifest.json     written by rank 0 after every rank's shard is on disk

A step directory without manifest.json is incomplete (a rank died mid-save) and is
never listed or loaded. Every file is written atomically (temp file in the same
directory, fsync, os.replace, fsync of the directory), so a crash leaves either the
old file or the new one under the final name, never half of one.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import shutil
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import IO, Any, cast

import torch

from parwatch.trainer.errors import CheckpointError

MANIFEST = "manifest.json"
FORMAT_VERSION = 1
_STEP_DIR = re.compile(r"^step_(\d{8,})$")
_RANK_FILE = re.compile(r"^rank_(\d{5,})\.(pt|json)$")


def step_dir(root: str | Path, step: int) -> Path:
    return Path(root) / f"step_{step:08d}"


def _shard_name(rank: int) -> str:
    return f"rank_{rank:05d}.pt"


def _shard_info_name(rank: int) -> str:
    return f"rank_{rank:05d}.json"


def _fsync_dir(path: Path) -> None:
    # os.replace is only durable once the directory entry itself reaches the disk.
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: Path, write: Callable[[io.BufferedWriter], object]) -> None:
    """Write `path` via a temp file in the same directory, so readers never see a partial file
    and a crash leaves the old file or the new one (the trainer's one way to write a file)."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    _fsync_dir(path.parent)


def atomic_write_json(path: str | Path, obj: dict) -> None:
    data = json.dumps(obj, indent=1, sort_keys=True).encode()
    atomic_write(Path(path), lambda f: f.write(data))


class _HashingWriter:
    """A file-like object for torch.save that hashes and counts bytes on their way to disk."""

    def __init__(self, f):
        self._f = f
        self.sha256 = hashlib.sha256()
        self.bytes = 0

    def write(self, data) -> int:
        self.sha256.update(data)
        self.bytes += len(data)
        return self._f.write(data)

    def flush(self) -> None:
        self._f.flush()


def tensor_table(obj: object, prefix: str = "") -> dict[str, dict[str, Any]]:
    """{dotted key: {"shape": [...], "dtype": "float32"}} for every tensor nested in obj."""
    if isinstance(obj, torch.Tensor):
        return {prefix: {"shape": list(obj.shape), "dtype": str(obj.dtype).removeprefix("torch.")}}
    items: Iterable[tuple[object, object]]
    if isinstance(obj, dict):
        items = obj.items()
    elif isinstance(obj, (list, tuple)):
        items = enumerate(obj)
    else:
        return {}
    table: dict[str, dict[str, Any]] = {}
    for key, value in items:
        table.update(tensor_table(value, f"{prefix}.{key}" if prefix else str(key)))
    return table


def _remove_stale_manifest(directory: Path) -> None:
    # Re-saving a step (after a rollback) must not leave the old manifest vouching for
    # a mix of old and new shards; without it the step reads as incomplete until done.
    try:
        os.unlink(directory / MANIFEST)
        _fsync_dir(directory)
    except FileNotFoundError:
        pass


def save_checkpoint(
    root: str | Path,
    step: int,
    rank: int,
    world_size: int,
    state: dict,
    meta: dict,
    barrier: Callable[[], None],
    keep_last: int = 3,
) -> Path:
    """Save this rank's shard; rank 0 then writes the manifest and prunes old checkpoints.

    Every rank must call it with the same step, world_size and keep_last. `barrier` is
    called three times (after rank 0 drops a stale manifest, after the shards, after the
    manifest), so no rank returns before the step is complete. keep_last=0 keeps every checkpoint. Returns the step directory.
    """
    if not 0 <= rank < world_size:
        raise CheckpointError(f"save_checkpoint: rank={rank} is outside world_size={world_size}")
    if keep_last < 0:
        raise CheckpointError(f"save_checkpoint: keep_last={keep_last} must be >= 0 (0 keeps every checkpoint)")
    directory = step_dir(root, step)
    directory.mkdir(parents=True, exist_ok=True)
    if rank == 0:
        _remove_stale_manifest(directory)
    # Saving a step again (after a rollback): no rank may replace its shard while the old
    # manifest still vouches for the old one, or a crash in between leaves a listed
    # checkpoint that fails its own sha256 check.
    barrier()

    writer_box = {}

    def write_shard(f):
        writer_box["w"] = writer = _HashingWriter(f)
        torch.save(state, cast(IO[bytes], writer))  # the writer is file-like where torch.save needs it

    atomic_write(directory / _shard_name(rank), write_shard)
    writer = writer_box["w"]
    atomic_write_json(
        directory / _shard_info_name(rank),
        {
            "step": step,
            "rank": rank,
            "world_size": world_size,
            "file": _shard_name(rank),
            "sha256": writer.sha256.hexdigest(),
            "bytes": writer.bytes,
            "tensors": tensor_table(state),
        },
    )
    barrier()
    if rank == 0:
        _write_manifest(Path(root), directory, step, world_size, meta)
        _prune(Path(root), keep_last, just_saved=step)
    barrier()
    return directory


def _read_shard_info(directory: Path, rank: int, step: int, world_size: int) -> dict:
    path = directory / _shard_info_name(rank)
    try:
        info = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(
            f"checkpoint shard info {path}: missing: rank {rank} did not finish saving; "
            f"step_{step:08d} stays incomplete"
        ) from None
    except (OSError, ValueError) as e:
        raise CheckpointError(f"checkpoint shard info {path}: unreadable ({e})") from None
    if info.get("step") != step or info.get("world_size") != world_size:
        raise CheckpointError(
            f"checkpoint shard info {path}: from step {info.get('step')} with world size "
            f"{info.get('world_size')}, expected step {step} with world size {world_size}: "
            f"a stale file from another save; step_{step:08d} stays incomplete"
        )
    shard = directory / info["file"]
    size = shard.stat().st_size if shard.exists() else None
    if size != info["bytes"]:
        raise CheckpointError(
            f"checkpoint shard {shard}: {size} bytes on disk but {info['bytes']} written: "
            f"the file was altered or truncated; step_{step:08d} stays incomplete"
        )
    return {key: info[key] for key in ("rank", "file", "sha256", "bytes", "tensors")}


def _write_manifest(root: Path, directory: Path, step: int, world_size: int, meta: dict) -> None:
    shards = [_read_shard_info(directory, r, step, world_size) for r in range(world_size)]
    atomic_write_json(
        directory / MANIFEST,
        {
            "format": FORMAT_VERSION,
            "step": step,
            "world_size": world_size,
            "time": time.time(),
            "meta": meta,
            "shards": shards,
        },
    )
    _fsync_dir(root)
    # Shards of a larger earlier world size, or temp files of a killed writer, are not
    # part of this checkpoint; every rank is past the first barrier, so none is writing.
    for path in directory.iterdir():
        match = _RANK_FILE.match(path.name)
        if path.name.endswith(".tmp") or (match and int(match.group(1)) >= world_size):
            path.unlink(missing_ok=True)


def _step_dirs(root: Path) -> dict[int, Path]:
    if not root.is_dir():
        return {}
    found = {}
    for path in root.iterdir():
        match = _STEP_DIR.match(path.name)
        if match and path.is_dir():
            found[int(match.group(1))] = path
    return found


def _prune(root: Path, keep_last: int, just_saved: int) -> None:
    dirs = _step_dirs(root)
    complete = sorted(s for s, p in dirs.items() if (p / MANIFEST).is_file())
    newest = complete[-1] if complete else None
    keep = set(complete[-keep_last:]) if keep_last else set(complete)
    keep.add(just_saved)  # never the one just written, even if newer steps exist (after a rollback)
    for s, path in dirs.items():
        stale_complete = s in complete and s not in keep
        abandoned = s not in complete and newest is not None and s < newest
        if stale_complete or abandoned:
            shutil.rmtree(path, ignore_errors=True)


def list_checkpoints(root: str | Path) -> list[int]:
    """Steps with a complete checkpoint (a manifest), ascending; [] if root does not exist."""
    return sorted(s for s, p in _step_dirs(Path(root)).items() if (p / MANIFEST).is_file())


def read_manifest(root: str | Path, step: int) -> dict:
    path = step_dir(root, step) / MANIFEST
    try:
        manifest = json.loads(path.read_text())
    except FileNotFoundError:
        what = (
            "incomplete checkpoint (a rank failed or the save was interrupted)"
            if path.parent.is_dir()
            else "no such checkpoint"
        )
        raise CheckpointError(
            f"checkpoint manifest {path}: missing: {what}; complete steps in {root}: {list_checkpoints(root)}"
        ) from None
    except (OSError, ValueError) as e:
        raise CheckpointError(
            f"checkpoint manifest {path}: unreadable ({e}); delete step_{step:08d} or load another step"
        ) from None
    if manifest.get("step") != step or "shards" not in manifest:
        raise CheckpointError(
            f"checkpoint manifest {path}: says step {manifest.get('step')} "
            f"with {len(manifest.get('shards', []))} shards: not a manifest for step {step}"
        )
    return manifest


def _layout_note(manifest: dict) -> str:
    layout = (manifest.get("meta") or {}).get("parallel")
    return f" (it saved with {layout})" if layout else ""


def _verified_bytes(root: str | Path, step: int, rank: int, world_size: int) -> tuple[bytes, dict]:
    """This rank's shard of `step` as bytes, with the manifest, after checking its size and sha256."""
    manifest = read_manifest(root, step)
    directory = step_dir(root, step)
    fix = f"delete {directory.name} or load another step"
    if manifest["world_size"] != world_size:
        raise CheckpointError(
            f"checkpoint {directory}: saved with world size {manifest['world_size']} "
            f"but this run has world size {world_size}: resume with the same --tp/--pp/--dp "
            f"as the saving run{_layout_note(manifest)}"
        )
    if not 0 <= rank < world_size:
        raise CheckpointError(f"load_checkpoint: rank={rank} is outside world_size={world_size}")
    entry = manifest["shards"][rank]
    path = directory / entry["file"]
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint shard {path}: missing although the manifest lists it; {fix}") from None
    except OSError as e:
        raise CheckpointError(f"checkpoint shard {path}: unreadable ({e}); {fix}") from None
    if len(data) != entry["bytes"]:
        raise CheckpointError(
            f"checkpoint shard {path}: size mismatch (expected {entry['bytes']} bytes, "
            f"got {len(data)}): the file was truncated or altered; {fix}"
        )
    digest = hashlib.sha256(data).hexdigest()
    if digest != entry["sha256"]:
        raise CheckpointError(
            f"checkpoint shard {path}: sha256 mismatch (expected {entry['sha256'][:12]}.., "
            f"got {digest[:12]}..): the file was altered or truncated; {fix}"
        )
    return data, manifest


def verify_checkpoint(root: str | Path, step: int, rank: int, world_size: int) -> str | None:
    """None when this rank's shard of `step` is intact (manifest, size, sha256); else what is wrong."""
    try:
        _verified_bytes(root, step, rank, world_size)
    except CheckpointError as e:
        return str(e)
    return None


def load_checkpoint(root: str | Path, step: int, rank: int, world_size: int, map_location="cpu") -> tuple[dict, dict]:
    """This rank's (state, manifest) for `step`, after checking the shard's size and sha256.

    A world-size mismatch quotes manifest["meta"]["parallel"] when the saver put its layout there.
    """
    data, manifest = _verified_bytes(root, step, rank, world_size)
    path = step_dir(root, step) / manifest["shards"][rank]["file"]
    try:
        # weights_only=False: the state holds optimizer and RNG objects, and the bytes match the
        # sha256 that this trainer recorded when it wrote them, so this is our own pickle.
        state = torch.load(io.BytesIO(data), map_location=map_location, weights_only=False)
    except Exception as e:
        raise CheckpointError(
            f"checkpoint shard {path}: unreadable by torch.load ({type(e).__name__}: {e}); "
            f"delete {path.parent.name} or load another step"
        ) from None
    return state, manifest
