"""The engine's durable state: one SQLite database, STATE_DIR/parwatch.db, beside the audit log.

Every table is keyed by run id. A new run adds its rows; archiving the previous run only stamps
runs.archived_at, so every run's rows stay to be queried (its decisions.jsonl moves to
STATE_DIR/runs/RUN_ID/).
- runs: the paused flag, executed steps, last step, checkpoints ... (archived_at NULL: the current run)
- rules: each rule's state and counters; baselines: each spike/regression rule's windows (JSON)
- directives: the run's outstanding directives (delivered_at NULL: created, and cancellable)
- records: every decision, outcome and cancel record, as the line decisions.jsonl holds
- alerts_acted: Alertmanager fingerprints acted on (an alert is Alertmanager's, not a run's)

A Batch is one transaction. One holding a record, a delivery, a run's start or a rules reload commits
with synchronous=FULL: the WAL is fsync'd before COMMIT returns, so what the sidecar answered survives
a power loss. The rest (rule counters, checkpoints) commit with NORMAL: in WAL mode that survives a
crash of the process, not of the machine, and costs no fsync. After its commit a batch appends its
records to decisions.jsonl (fsync'd), the log people read; a crash between the two leaves the log
short, and the next start appends what it lacks (repair_log).
"""

from __future__ import annotations

import json
import logging
import os
import sqlite3
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from parwatch.vocabulary import RecordType

log = logging.getLogger(__name__)
DB_NAME, LOG_NAME = "parwatch.db", "decisions.jsonl"
SOUND = "ok"
"""What SQLite's quick_check answers for a sound database."""
RUN_FIELDS = ("paused", "tick", "last_step", "first_seen_time", "resumed_time", "next_directive_id")
RUN_LISTS = ("checkpoints", "rollback_ticks", "rearmed")
"""The runs columns held as JSON."""
DIRECTIVE_FIELDS = ("id", "action", "to_step", "skip_batches", "reason", "decision_id", "delivered_at")
SCHEMA = """
CREATE TABLE IF NOT EXISTS runs (
    run_id TEXT PRIMARY KEY, archived_at REAL, paused INTEGER, tick INTEGER, last_step INTEGER,
    first_seen_time REAL, resumed_time REAL, next_directive_id INTEGER,
    checkpoints TEXT, rollback_ticks TEXT, rearmed TEXT);
CREATE TABLE IF NOT EXISTS rules (run_id TEXT, rule TEXT, state TEXT, PRIMARY KEY (run_id, rule)) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS baselines (
    run_id TEXT, rule TEXT, windows TEXT, PRIMARY KEY (run_id, rule)) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS directives (
    run_id TEXT, id INTEGER, action TEXT, to_step INTEGER, skip_batches INTEGER, reason TEXT,
    decision_id INTEGER, delivered_at REAL, PRIMARY KEY (run_id, id)) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS records (
    seq INTEGER PRIMARY KEY, run_id TEXT, type TEXT, decision_id INTEGER, line TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS records_of_run ON records (run_id, seq);
CREATE TABLE IF NOT EXISTS alerts_acted (fingerprint TEXT PRIMARY KEY);
"""


class Batch:
    """The writes of one burst of engine work: one transaction, then its records' log lines."""

    def __init__(self, store: StateStore):
        self.store = store
        self.sql: list[tuple[str, list[tuple]]] = []
        """(statement, rows) in order; each statement runs once per row."""
        self.lines: list[bytes] = []
        self.full = False
        """Commit with synchronous=FULL (see the module docstring)."""
        self.then: Callable[[], None] | None = None
        """A file operation after the commit (a run's archiving moves its log)."""
        self.earlier: list[Batch] = []
        """Batches taken before this one: written first."""

    def __bool__(self) -> bool:
        return bool(self.sql or self.lines or self.then or self.earlier)

    def write(self) -> None:
        """Put the batch on disk (any thread; one batch at a time, in the order taken)."""
        self.store.write(self)

    def add(self, sql: str, *rows: tuple) -> None:
        self.sql.append((sql, list(rows)))

    def record(self, run_id: str | None, record: dict, logged: bool = False) -> None:
        """A JSON-safe decision, outcome or cancel record; logged: decisions.jsonl has it already."""
        line = json.dumps(record, allow_nan=False, separators=(",", ":"))
        did = record.get("id") if record.get("type") == RecordType.DECISION else None
        row = (run_id, str(record.get("type")), did if type(did) is int and 0 < did < 2**63 else None, line)
        self.add("INSERT INTO records (run_id, type, decision_id, line) VALUES (?, ?, ?, ?)", row)
        if not logged:
            self.lines.append(line.encode("utf-8") + b"\n")
        self.full = True

    def run(self, run_id: str, state: dict, rules: dict, directives: list[dict]) -> None:
        """The run's row, its rules' states and its outstanding directives (all of them: few)."""
        row = [state[k] for k in RUN_FIELDS] + [json.dumps(state[k]) for k in RUN_LISTS]
        self.add(
            f"INSERT OR REPLACE INTO runs (run_id, {', '.join(RUN_FIELDS + RUN_LISTS)}) {_values(1 + len(row))}",
            (run_id, *row),
        )
        self.per_rule("rules", run_id, rules)
        self.add("DELETE FROM directives WHERE run_id = ?", (run_id,))
        rows = [(run_id, *(d.get(k) for k in DIRECTIVE_FIELDS)) for d in directives]
        self.add(f"INSERT INTO directives {_values(1 + len(DIRECTIVE_FIELDS))}", *rows)

    def per_rule(self, table: str, run_id: str, values: dict) -> None:
        """Rows of rules (states) or baselines (windows): rule name -> JSON."""
        self.add(
            f"INSERT OR REPLACE INTO {table} VALUES (?, ?, ?)", *((run_id, k, json.dumps(v)) for k, v in values.items())
        )

    def archive(self, run_id: str, when: float) -> None:
        self.add("UPDATE runs SET archived_at = ? WHERE run_id = ?", (when, run_id))
        self.full = True

    def claim_records(self, run_id: str) -> None:
        """Records made before any run began belong to the first run."""
        self.add("UPDATE records SET run_id = ? WHERE run_id IS NULL", (run_id,))

    def alert(self, fingerprint: str, acted: bool) -> None:
        how = "INSERT OR IGNORE INTO alerts_acted VALUES (?)", "DELETE FROM alerts_acted WHERE fingerprint = ?"
        self.add(how[not acted], (fingerprint,))


class StateStore:
    """parwatch.db, opened (or made) in state_dir. An unreadable database is moved aside, loudly, and a new
    one started; the engine then recovers what decisions.jsonl says (as when the database is missing)."""

    def __init__(self, state_dir: Path):
        self.path, self.log_path = state_dir / DB_NAME, state_dir / LOG_NAME
        try:
            self._db = self._connect()
        except sqlite3.OperationalError as err:  # locked, or not permitted: not ours to move
            raise OSError(f"{self.path}: {err}") from err
        except sqlite3.DatabaseError as err:  # not a database, or damaged
            asides = [_move_aside(Path(f"{self.path}{suffix}")) for suffix in ("", "-wal", "-shm")]
            log.error(
                "%s is not a usable database (%s): moved aside as %s; starting a new one and recovering the "
                "run and its outstanding directives from %s (rule states and baselines start afresh)",
                self.path,
                err,
                ", ".join(a.name for a in asides if a is not None),
                self.log_path.name,
            )
            self._db = self._connect()

    def _connect(self) -> sqlite3.Connection:
        # Autocommit: write() opens each transaction itself. One thread at a time uses it (the engine's
        # caller, or the sidecar's writer thread).
        db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        try:
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA temp_store=MEMORY")  # no temporary files: the sidecar's root file system is read-only
            (check,) = db.execute("PRAGMA quick_check").fetchone()
            if check != SOUND:
                raise sqlite3.DatabaseError(f"quick_check: {check}")
            db.executescript(SCHEMA)
        except sqlite3.Error:
            db.close()
            raise
        return db

    def write(self, batch: Batch) -> None:
        for earlier in batch.earlier:
            self.write(earlier)
        if batch.sql:
            self._db.execute(f"PRAGMA synchronous={'FULL' if batch.full else 'NORMAL'}")
            self._db.execute("BEGIN IMMEDIATE")
            try:
                for sql, rows in batch.sql:
                    self._db.executemany(sql, rows)
                self._db.execute("COMMIT")
            except BaseException:
                if self._db.in_transaction:
                    self._db.execute("ROLLBACK")
                raise
        if batch.lines:
            append_lines(self.log_path, batch.lines)
        if batch.then is not None:
            batch.then()

    def load(self, recent: int) -> dict[str, Any] | None:
        """The current run's state (run: None when no run began), its newest `recent` records, the archived
        runs and the next ids; None when the database holds nothing yet."""
        db = self._db
        if db.execute("SELECT NOT EXISTS (SELECT 1 FROM runs) AND NOT EXISTS (SELECT 1 FROM records)").fetchone()[0]:
            return None
        columns = ("run_id",) + RUN_FIELDS + RUN_LISTS
        row = db.execute(f"SELECT {', '.join(columns)} FROM runs WHERE archived_at IS NULL").fetchone()
        run = None if row is None else dict(zip(columns, row))
        if run is not None:
            run.update({k: json.loads(run[k]) for k in RUN_LISTS})
        key = None if run is None else run["run_id"]
        lines = db.execute("SELECT line FROM records WHERE run_id IS ? ORDER BY seq DESC LIMIT ?", (key, recent))
        return {
            "run": run,
            "archived": [r for (r,) in db.execute("SELECT run_id FROM runs WHERE archived_at IS NOT NULL")],
            "rules": dict(db.execute("SELECT rule, state FROM rules WHERE run_id IS ?", (key,)).fetchall()),
            "baselines": dict(db.execute("SELECT rule, windows FROM baselines WHERE run_id IS ?", (key,)).fetchall()),
            "directives": [
                dict(zip(DIRECTIVE_FIELDS, d), run_id=key)
                for d in db.execute(f"SELECT {', '.join(DIRECTIVE_FIELDS)} FROM directives WHERE run_id IS ?", (key,))
            ],
            "records": [json.loads(line) for (line,) in reversed(lines.fetchall())],
            "next_decision_id": 1 + (db.execute("SELECT max(decision_id) FROM records").fetchone()[0] or 0),
            "next_directive_id": db.execute("SELECT max(next_directive_id) FROM runs").fetchone()[0],
        }

    def acted_alerts(self) -> list[str]:
        """Alertmanager fingerprints acted on, oldest first."""
        return [fp for (fp,) in self._db.execute("SELECT fingerprint FROM alerts_acted ORDER BY rowid")]

    def repair_log(self, run_id: str | None) -> None:
        """Append to decisions.jsonl the run's newest records it lacks: a crash came between their commit and
        the append. A log that ends with a line the store does not hold (edited by hand) is left alone."""
        last = _last_line(self.log_path)
        newest = self._db.execute(
            "SELECT line FROM records WHERE run_id IS ? ORDER BY seq DESC LIMIT 1000", (run_id,)
        ).fetchall()
        missing = []
        for (line,) in newest:
            if line.encode("utf-8") == last:
                break
            missing.append(line)
        else:
            if last is not None:
                return
        if missing:
            append_lines(self.log_path, [line.encode("utf-8") + b"\n" for line in reversed(missing)])
            log.warning("%s lacked the newest %d records of the store (a crash): appended", self.log_path, len(missing))


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


def read_log(path: Path, keep: int) -> list[dict]:
    """The newest `keep` records of a decisions.jsonl, oldest first; unreadable lines skipped with a warning."""
    if not path.exists():
        return []
    with open(path, "rb") as f:
        size, chunk, data = f.seek(0, os.SEEK_END), 1 << 16, b""
        while size > 0 and data.count(b"\n") <= keep:  # backwards, until enough whole lines are in hand
            start = max(0, size - chunk)
            f.seek(start)
            data = f.read(size - start) + data
            size = start
    lines = data.split(b"\n")[1 if size > 0 else 0 :]  # the first piece may be the tail of a line
    records = []
    for raw in lines:
        try:
            record = json.loads(raw) if raw.strip() else None
        except ValueError:
            log.warning("skipping an unreadable line in %s (a write cut short by a crash?)", path)
            continue
        if isinstance(record, dict):
            records.append(record)
        elif record is not None:
            log.warning("skipping a line of %s that is not a record (a JSON %s)", path, type(record).__name__)
    return records[-keep:]


def _values(n: int) -> str:
    return f"VALUES ({', '.join('?' * n)})"


def _last_line(path: Path) -> bytes | None:
    """The last whole line of a file (without its newline); None when it has none."""
    if not path.exists():
        return None
    with open(path, "rb") as f:
        f.seek(max(0, f.seek(0, os.SEEK_END) - (1 << 20)))
        whole, newline, _ = f.read().rpartition(b"\n")  # a piece after the last newline was cut short
    return whole.rpartition(b"\n")[2] or None if newline else None


def _move_aside(path: Path) -> Path | None:
    if not path.exists():
        return None
    aside = path.with_name(f"{path.name}.invalid-{time.strftime('%Y%m%dT%H%M%S')}")
    os.replace(path, aside)
    return aside
