"""DeepSpeed's CPU comm op, built once into the project's own TORCH_EXTENSIONS_DIR; a stale build lock named.

DeepSpeed 0.19.8 on a machine without CUDA starts every process group through TorchBackend, which
loads its shared-memory comm op (op_builder/cpu/comm.py ShareMemCommBuilder, `deepspeed_shm_comm`:
csrc/cpu/comm/shm.cpp and shm_interface.cpp). Not shipped prebuilt, it is JIT-built by
torch.utils.cpp_extension.load into $TORCH_EXTENSIONS_DIR/deepspeed_shm_comm (unset:
~/.cache/torch_extensions/py311_cpu/deepspeed_shm_comm): 30-175 s on 2 cores, once; later starts run
ninja, which finds nothing to do. `python -m tests.deepspeed_op` (scripts/setup.sh test) builds it into
EXTENSIONS_DIR, which tests/conftest.py hands to the test session and every rank it spawns.

cpp_extension guards a build with a FileBaton: `lock` in that directory, created with O_EXCL and
removed when the build ends. A build killed midway leaves it, and every later start waits on it in
FileBaton.wait, which has no timeout: silently, for ever. A lock older than any build is such a one.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXTENSIONS_DIR = ROOT / ".tools" / "torch_extensions"
OP = "deepspeed_shm_comm"
STALE_AFTER_S = 600.0
"""A build takes 30-175 s here: a lock this old was left by a build that was killed."""


def extensions_dir(environ=os.environ) -> Path:
    """The TORCH_EXTENSIONS_DIR a DeepSpeed start in this environment uses (the project's by default)."""
    environ.setdefault("TORCH_EXTENSIONS_DIR", str(EXTENSIONS_DIR))
    return Path(environ["TORCH_EXTENSIONS_DIR"])


def stale_lock(directory: Path, now: float | None = None) -> str | None:
    """What to tell about a build lock of the op left by a killed build (None when there is none)."""
    lock = Path(directory) / OP / "lock"
    try:
        age = (time.time() if now is None else now) - lock.stat().st_mtime
    except FileNotFoundError:
        return None
    if age < STALE_AFTER_S:
        return None  # a build may be under way in another process
    return (
        f"{lock} is {age / 60:.0f} min old: a build of DeepSpeed's {OP} op was killed and left it, and every "
        f"DeepSpeed start would wait on it for ever. Remove it (rm {lock}); the next start builds the op."
    )


def build() -> float:
    """Build (or find built) the op in this process's TORCH_EXTENSIONS_DIR; seconds it took."""
    from deepspeed.accelerator import get_accelerator

    builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
    start = time.monotonic()
    builder.load(verbose=False)
    return time.monotonic() - start


def main() -> int:
    directory = extensions_dir()
    stale = stale_lock(directory)
    if stale:
        print(stale, file=sys.stderr)
        return 1
    print(f"DeepSpeed's {OP} op in {directory}: {build():.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
