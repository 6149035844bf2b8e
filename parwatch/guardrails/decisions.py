"""What the guardrail engine keeps on disk: the decision log and its own state.

decisions.jsonl is append-only: one JSON object per line, flushed and fsync'd on every
append, so a decision survives a sidecar crash the moment it was made. state.json is
replaced atomically (temp file, fsync, rename), so a restart sees either the old state or
the new one, never half of each. The directory is fsync'd too when the caller needs the
rename itself to survive a power loss (sync_dir); without it a power loss may bring back
the previous, equally complete, file. (The engine decides which writes need what.)

Deferred mode (the sidecar's): appends and state writes are only noted, and take()
hands back one batch -- the log lines and the state encoded at that moment -- for a
writer thread to put on disk (Batch.write) before the sidecar answers the request that
made them. A burst of decisions costs one fsync, and none of it runs on the event loop.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path

from parwatch.schema import encode_float

log = logging.getLogger(__name__)
RECENT_RECORDS = 1000
"""Records held in memory for decisions(limit); older ones stay in the file."""


def json_safe(value):
    """A copy with NaN/inf as the schema's strings ("nan", "inf", "-inf"): the log is strict JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return encode_float(value)
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return  # some file systems do not open directories; the rename itself is still atomic
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class DecisionLog:
    def __init__(self, path: str | Path, recent: int = RECENT_RECORDS):
        self.path = Path(path)
        self.recent: deque[dict] = deque(maxlen=recent)
        self.deferred = False
        """True: append() only queues the line; take_lines() hands them to the writer."""
        self._queued: list[bytes] = []
        self._load_tail()

    def _load_tail(self) -> None:
        if not self.path.exists():
            return
        keep = self.recent.maxlen
        assert keep is not None  # __init__ bounds it
        with open(self.path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            # Read backwards in chunks until enough whole lines are in hand.
            chunk, data = 1 << 16, b""
            while size > 0 and data.count(b"\n") <= keep:
                start = max(0, size - chunk)
                f.seek(start)
                data = f.read(size - start) + data
                size = start
        lines = data.split(b"\n")
        if size > 0:
            lines = lines[1:]  # the first piece may be the tail of a line before the chunk
        for raw in lines:
            if not raw.strip():
                continue
            try:
                record = json.loads(raw)
            except ValueError:
                log.warning("skipping an unreadable line in %s (a write cut short by a crash?)", self.path)
                continue
            if isinstance(record, dict):
                self.recent.append(record)
            else:
                log.warning("skipping a line of %s that is not a record (a JSON %s)", self.path, type(record).__name__)

    def append(self, record: dict) -> dict:
        """Write one record durably; returns the JSON-safe record as written."""
        record = json_safe(record)
        line = (json.dumps(record, allow_nan=False, separators=(",", ":")) + "\n").encode("utf-8")
        if self.deferred:
            self._queued.append(line)
        else:
            append_lines(self.path, [line])
        self.recent.append(record)
        return record

    def take_lines(self) -> list[bytes]:
        """The queued lines (deferred mode), oldest first; the queue starts empty again."""
        lines, self._queued = self._queued, []
        return lines

    def records(self, limit: int = 100) -> list[dict]:
        """The newest `limit` records, newest last."""
        if limit <= 0:
            return []
        return list(self.recent)[-limit:]

    def max_value(self, key: str) -> int:
        """Largest integer `key` among the records in memory (ids only grow, so the newest hold it)."""
        values = [r.get(key) for r in self.recent]
        return max((v for v in values if isinstance(v, int)), default=0)


def append_lines(path: Path, lines: list[bytes]) -> None:
    """Append whole lines and fsync them."""
    with open(path, "a+b") as f:
        # A crash mid-write can leave a line without its newline; never glue onto it.
        if f.tell() > 0:
            f.seek(-1, os.SEEK_END)
            if f.read(1) != b"\n":
                f.write(b"\n")
        f.write(b"".join(lines))
        f.flush()
        os.fsync(f.fileno())


def encode_state(state: dict) -> bytes:
    # json.dumps runs the C encoder; json.dump would take the pure-Python one.
    return json.dumps(state, sort_keys=True, separators=(",", ":")).encode("utf-8")


def write_state(path: str | Path, state: dict | bytes, sync_dir: bool = True) -> None:
    """Replace `path` with `state` (a dict, or its encode_state bytes) atomically; sync_dir: also
    make the rename durable."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    data = state if isinstance(state, bytes) else encode_state(state)
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    if sync_dir:
        _fsync_dir(path.parent)


def move_aside(path: Path, why: str, kept: str) -> Path:
    """Put an unusable state file out of the sidecar's way, kept for a person to read, and say so."""
    aside = path.with_name(f"{path.name}.invalid-{time.strftime('%Y%m%dT%H%M%S')}")
    os.replace(path, aside)
    log.warning("%s is not usable (%s): moved aside to %s; %s", path, why, aside.name, kept)
    return aside


def read_state(path: str | Path, kept: str = "starting from a clean state") -> dict | None:
    """The saved state; None when there is none, or when it is not a JSON object (then it is moved aside,
    with a warning that says `kept`: what the caller keeps instead)."""
    path = Path(path)
    if not path.exists():
        return None
    try:
        with open(path, encoding="utf-8") as f:
            state = json.load(f)
    except (OSError, ValueError) as e:
        move_aside(path, str(e)[:200], kept)
        return None
    if not isinstance(state, dict):
        move_aside(path, f"a JSON {type(state).__name__}, not an object", kept)
        return None
    return state


class StateFile:
    """state.json as the engine keeps it: durable changes written at once, counter-only ones deferred.

    `snapshot` returns the state to write. write_now() writes before it returns (the file
    fsync'd; the directory too unless sync_dir=False). mark_dirty() only notes a
    counter-only change; flush_if_due() writes it once `after` seconds (by `now`) passed
    since the last write (the file fsync'd; the rename becomes durable with the next
    directory fsync); flush() writes it at once, directory included.
    """

    def __init__(self, path: str | Path, snapshot: Callable[[], dict], now: Callable[[], float]):
        self.path = Path(path)
        self._snapshot, self._now = snapshot, now
        self.dirty = False
        self.dir_synced = True
        self.written_at = now()
        self.deferred = False
        """True: writes are only noted; take() encodes the state for the writer thread."""
        self._owed: bool | None = None  # deferred: None, or whether the owed write syncs the directory

    def read(self, kept: str = "starting from a clean state") -> dict | None:
        return read_state(self.path, kept)

    def write_now(self, sync_dir: bool = True) -> None:
        self._write(sync_dir)

    def mark_dirty(self) -> None:
        self.dirty = True

    def flush_if_due(self, after: float) -> None:
        # A clock that went back (NTP) counts as due: never defer for longer than asked.
        if self.dirty and not 0 <= self._now() - self.written_at < after:
            self._write(sync_dir=False)

    def flush(self) -> None:
        """Everything on disk, the last rename included."""
        if self.dirty:
            self._write(sync_dir=True)
        elif not self.dir_synced:
            if self.deferred:
                self._owed = True  # the writer rewrites the state and syncs the directory
            else:
                _fsync_dir(self.path.parent)
            self.dir_synced = True

    def _write(self, sync_dir: bool) -> None:
        if self.deferred:
            self._owed = bool(self._owed) or sync_dir
        else:
            write_state(self.path, self._snapshot(), sync_dir)
        self.dirty, self.dir_synced, self.written_at = False, sync_dir, self._now()

    def take(self) -> tuple[bytes, bool] | None:
        """Deferred mode: (the state encoded now, sync_dir) if a write is owed, else None."""
        if self._owed is None:
            return None
        owed, self._owed = self._owed, None
        return encode_state(self._snapshot()), owed


class Batch:
    """Writes owed by one burst of engine work: decision lines, then the state that follows them."""

    def __init__(
        self,
        log_path: Path,
        lines: list[bytes],
        states: list[tuple[Path, tuple[bytes, bool] | None]],
        then: Callable[[], None] | None = None,
        earlier: list[Batch] | None = None,
    ):
        self.log_path, self.lines = log_path, lines
        self.states = [(path, owed) for path, owed in states if owed is not None]
        """(path, StateFile.take()) of each state file owed a write."""
        self.then = then
        """A file operation that must follow these writes (archiving a run's files)."""
        self.earlier = earlier or []
        """Batches taken before this one that must be written first."""

    def __bool__(self) -> bool:
        return bool(self.lines) or bool(self.states) or self.then is not None or bool(self.earlier)

    def write(self) -> None:
        """Put the batch on disk (any thread; one batch at a time, in the order taken)."""
        for batch in self.earlier:
            batch.write()
        if self.lines:
            append_lines(self.log_path, self.lines)
        for path, (data, sync_dir) in self.states:
            write_state(path, data, sync_dir)
        if self.then is not None:
            self.then()
