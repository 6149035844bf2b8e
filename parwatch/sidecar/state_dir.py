"""One sidecar owns its state dir, and only a state dir it can write is taken.

Two sidecars on one state dir archived each other's runs and handed out one directive id for two
actions; a state dir that could not be written let the sidecar start and then answer every request
500. So before anything else is read or written there, `hold` takes an exclusive lock on
STATE_DIR/lock (fcntl.flock: released by the kernel when the process ends, however it ends), writes
its pid into it, and writes and syncs a probe of PROBE_BYTES: a second sidecar, a read-only or a full
file system refuses the start with one line naming --state-dir.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
from pathlib import Path

LOCK_NAME = "lock"
PROBE_NAME = ".write-probe"
PROBE_BYTES = 256 * 1024
"""Room the first writes need (the database, its WAL, the token): a state dir without it is refused."""


class StateDirError(OSError):
    """The state dir cannot be this sidecar's; the message names --state-dir and the fix."""


class StateDirLock:
    def __init__(self, fd: int, path: Path):
        self.fd, self.path = fd, path

    def release(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self.fd)


def hold(state_dir: str | os.PathLike) -> StateDirLock:
    """Lock `state_dir` for this process and prove it writable; StateDirError (naming --state-dir) if not."""
    root = Path(state_dir)
    flag = f"--state-dir {root}"
    try:
        root.mkdir(parents=True, exist_ok=True)
        fd = os.open(root / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o600)
    except OSError as err:
        raise StateDirError(
            f"{flag}: cannot be written ({err.strerror}); give the sidecar a writable directory"
        ) from err
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as err:
        owner = _read_pid(fd)
        os.close(fd)
        if err.errno in (errno.EWOULDBLOCK, errno.EACCES):
            raise StateDirError(
                f"{flag} is in use by another sidecar (pid {owner or 'unknown'}, lock {root / LOCK_NAME}); "
                "stop it, or give this one its own --state-dir"
            ) from err
        raise StateDirError(f"{flag}: cannot be locked ({err.strerror})") from err
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        _probe(root / PROBE_NAME)
    except OSError as err:
        os.close(fd)
        raise StateDirError(
            f"{flag}: cannot be written ({err.strerror}); the sidecar keeps its decisions there, so it does "
            "not start without it: free space, or mount it read-write"
        ) from err
    return StateDirLock(fd, root / LOCK_NAME)


def _probe(path: Path) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        block = b"\0" * 65536
        for _ in range(PROBE_BYTES // len(block)):
            os.write(fd, block)
        os.fsync(fd)
    finally:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(path)


def _read_pid(fd: int) -> int | None:
    try:
        text = os.pread(fd, 32, 0).decode().strip()
    except (OSError, UnicodeDecodeError):
        return None
    return int(text) if text.isdigit() else None
