"""The engine's durable state: one SQLite database, STATE_DIR/parwatch.db, and the audit log written from it.

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
short, and the next start appends what it lacks (repair_log). The log is read as the state only when the
database holds nothing (none yet, or one moved aside): load().

A write that fails (a full or read-only disk) raises StorageFault, and so does every batch taken
before the engine has put back the last committed state (GuardrailEngine.recover): a later batch
would otherwise commit a directive whose decision record was in the failed one. Rows are read
typed: a row whose columns do not hold what they should (`paused = 'no'`, a JSON list that is not
one) is moved to the `rows_aside` table with an ERROR; tables of another schema make the database
unusable (moved aside whole, as a damaged one is).
"""

from __future__ import annotations

import json
import logging
import os
import re
import sqlite3
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from parwatch.contract.directives import MAX_STEP
from parwatch.vocabulary import Action, RecordType, jsonable

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
CREATE TABLE IF NOT EXISTS rows_aside (tbl TEXT, row TEXT, reason TEXT, time REAL);
"""
COLUMNS = {
    "runs": ("run_id", "archived_at", *RUN_FIELDS, *RUN_LISTS),
    "rules": ("run_id", "rule", "state"),
    "baselines": ("run_id", "rule", "windows"),
    "directives": ("run_id", *DIRECTIVE_FIELDS),
    "records": ("seq", "run_id", "type", "decision_id", "line"),
    "alerts_acted": ("fingerprint",),
    "rows_aside": ("tbl", "row", "reason", "time"),
}
"""Every table's columns, in order: a database whose tables differ is of another schema."""


class StorageFault(OSError):
    """The state dir failed a write (or a batch came after one that did): nothing of it is committed.
    The message says why and that nothing was decided."""


def _integer(v) -> bool:
    return type(v) is int


def _optional(check):
    return lambda v: v is None or check(v)


def _number(v) -> bool:
    return type(v) in (int, float) and v == v and abs(v) != float("inf")


def _text(v) -> bool:
    return type(v) is str


def _json(kind, of: type | None = None):
    """JSON text of a `kind` (a list: of items of type `of`, if given)."""

    def check(v) -> bool:
        try:
            value = json.loads(v) if type(v) is str else None
        except ValueError:
            return False
        return isinstance(value, kind) and (of is None or all(type(x) is of for x in value))

    return check


TYPED: dict[str, dict[str, Callable[[Any], bool]]] = {
    "runs": {
        "run_id": _text,
        "archived_at": _optional(_number),
        "paused": lambda v: v in (0, 1) and type(v) is int,
        "tick": lambda v: type(v) is int and v >= 0,
        "last_step": _optional(_integer),
        "first_seen_time": _optional(_number),
        "resumed_time": _optional(_number),
        "next_directive_id": _optional(lambda v: type(v) is int and v > 0),
        "checkpoints": _json(list, of=int),
        "rollback_ticks": _json(list, of=int),
        "rearmed": _json(dict),
    },
    "directives": {
        "id": lambda v: type(v) is int and v > 0,
        "action": lambda v: v in tuple(Action),
        "to_step": _optional(_integer),
        "skip_batches": lambda v: type(v) is int and v >= 0,
        "reason": _text,
        "decision_id": _optional(_integer),
        "delivered_at": _optional(_number),
    },
    "rules": {"rule": _text, "state": _json(dict)},
    "baselines": {"rule": _text, "windows": _json(dict)},
    "records": {"line": _json(dict)},
}
"""What each column read back must hold (SQLite keeps whatever a hand or another program wrote in it)."""
KEYS = {
    "runs": ("rowid",),
    "rules": ("run_id", "rule"),
    "baselines": ("run_id", "rule"),
    "directives": ("run_id", "id"),
    "records": ("seq",),
}
"""What names one row of each typed table (three are WITHOUT ROWID)."""
MAX_UNLOGGED = 100_000
"""Log lines held while decisions.jsonl cannot be appended; the oldest beyond are left to the database."""


class Batch:
    """The writes of one burst of engine work: one transaction, then its records' log lines."""

    def __init__(self, store: StateStore):
        self.store = store
        self.epoch = store.epoch
        """The engine state it was taken from (StateStore.epoch): a batch of a state since put back is refused."""
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
        """The run's row, its rules' states and its outstanding directives (all of them: few; Outstanding.saved())."""
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

    def claim_records(self, run_id: str) -> None:
        """Records made before any run began belong to the first run."""
        self.add("UPDATE records SET run_id = ? WHERE run_id IS NULL", (run_id,))

    def alert(self, fingerprint: str, acted: bool) -> None:
        how = "INSERT OR IGNORE INTO alerts_acted VALUES (?)", "DELETE FROM alerts_acted WHERE fingerprint = ?"
        self.add(how[not acted], (fingerprint,))


class StateStore:
    """parwatch.db, opened (or made) in state_dir. An unreadable database, or one of another schema, is moved
    aside, loudly, and a new one started; the engine then recovers what decisions.jsonl says (as when the
    database is missing)."""

    def __init__(self, state_dir: Path):
        self.path, self.log_path = state_dir / DB_NAME, state_dir / LOG_NAME
        self.epoch = 0
        """Bumped when the engine puts back the committed state after a failed write (GuardrailEngine.recover)."""
        self.failed: str | None = None
        """Why the last write failed, while its state is not put back yet: every batch is refused meanwhile."""
        self._unlogged: list[bytes] = []
        """Log lines of committed batches that decisions.jsonl could not take yet (a full disk): appended first
        by the next batch that can write; the database holds their records meanwhile."""
        try:
            self._db = self._connect()
        except sqlite3.OperationalError as err:  # locked, or not permitted: not ours to move
            raise OSError(f"{self.path}: {err}") from err
        except sqlite3.DatabaseError as err:  # not a database, damaged, or another schema
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
            for table, columns in COLUMNS.items():
                found = tuple(row[1] for row in db.execute(f"PRAGMA table_info({table})"))
                if found != columns:
                    raise sqlite3.DatabaseError(
                        f"table {table} has columns {', '.join(found)}, not {', '.join(columns)}: another schema"
                    )
        except sqlite3.Error:
            db.close()
            raise
        return db

    def write(self, batch: Batch) -> None:
        """Commit the batch, then append its log lines (late, if decisions.jsonl cannot take them now);
        StorageFault when the commit fails, or when an earlier batch failed and the engine has not put back
        its committed state yet."""
        if self.failed is not None or batch.epoch != self.epoch:
            raise StorageFault(
                f"not written: an earlier write to the state dir failed ({self.failed or 'state put back since'})"
            )
        try:
            self._write(batch)
        except (OSError, sqlite3.Error) as err:
            self.failed = f"{type(err).__name__}: {err}"
            log.error(
                "cannot write the state dir %s (%s): what was decided since the last write is undone, "
                "nothing of it is acted on, and requests answer 503 until a write succeeds",
                self.path.parent,
                self.failed,
            )
            raise StorageFault(
                f"the state dir {self.path.parent} could not be written ({self.failed}): nothing was decided "
                "or queued; retry once it has room"
            ) from err

    def _write(self, batch: Batch) -> None:
        for earlier in batch.earlier:
            self._write(earlier)
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
        # Committed: the records stand (the database is the state). The log people read follows as soon as
        # it can; a line it cannot take now waits for the next batch (and a restart repairs it too).
        lines = self._unlogged + batch.lines
        if lines:
            try:
                append_lines(self.log_path, lines)
                if self._unlogged:
                    log.warning("%s took the %d records it could not take before", self.log_path, len(self._unlogged))
                self._unlogged = []
            except OSError as err:
                if not self._unlogged:
                    log.error(
                        "%s cannot be appended (%s): its records are in %s; appended once it can be",
                        self.log_path,
                        err.strerror or err,
                        self.path.name,
                    )
                self._unlogged = lines[-MAX_UNLOGGED:]
        if batch.then is not None:
            try:
                batch.then()
            except OSError as err:
                log.error("an ended run's files could not be moved (%s): they stay in %s", err, self.path.parent)

    def put_back(self) -> None:
        """The engine is about to reload the committed state: batches taken before now are refused."""
        self.epoch += 1
        self.failed = None

    def checkpoint(self) -> None:
        """Fold the WAL into the database file and truncate it (at shutdown: the state dir holds one file)."""
        try:
            self._db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        except sqlite3.Error as err:
            log.error("%s: the WAL could not be checkpointed at shutdown (%s); the next start reads it", self.path, err)

    def load(self, recent: int, now: float, repair: bool = True) -> tuple[dict[str, Any], bool]:
        """(the committed state, recovered): what the database holds (see _read), decisions.jsonl then given
        what it lacks (repair: not when the engine puts back its state after a failed write, which would
        append out of turn). Only when the database holds nothing (a first start, or one moved aside) is the
        log read as the state: recovered, and the engine then writes what it read into the database."""
        saved = self._read(recent)
        if saved is None:
            return self._recovered_from_log(recent, now), True
        if repair:
            self.repair_log((saved["run"] or {}).get("run_id"))
        return saved, False

    def _read(self, recent: int) -> dict[str, Any] | None:
        """The current run's state (run: None when no run began), its newest `recent` records, the archived
        runs and the next ids; None when the database holds nothing yet. Rows whose columns do not hold what
        they should are moved aside first (set_aside_bad_rows)."""
        db = self._db
        self.set_aside_bad_rows()
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

    def _recovered_from_log(self, recent: int, now: float) -> dict[str, Any]:
        """What decisions.jsonl says when there is no database: the run, its records, and the directives
        decided and neither handled nor cancelled (a trainer ignores an id it already handled, so handing
        one out again is safe). Rule states, checkpoints and counters start afresh."""
        records = [jsonable(r) for r in read_log(self.log_path, recent)]
        if not records:
            return {}
        run_id = next((r["run_id"] for r in reversed(records) if isinstance(r.get("run_id"), str)), None)
        kinds = (RecordType.DECISION, RecordType.DELIVERED)
        ended = {r.get("directive_id") for r in records if r.get("type") not in kinds}
        delivered = {  # when each went out (a time that is no number: it went out, when is unknown)
            r.get("directive_id"): r["time"] if type(r.get("time")) in (int, float) else now
            for r in records
            if r.get("type") == RecordType.DELIVERED
        }
        made = [r for r in records if r.get("type") == RecordType.DECISION]
        now_id = _ids_after_renumbering(records)
        outstanding = [  # as Outstanding.saved() makes them: the policy parses them back (from_saved)
            {
                "id": now_id.get(i, r["directive_id"]),
                "action": r.get("action"),
                "run_id": run_id,
                "to_step": r.get("checkpoint"),
                "skip_batches": r.get("skip_batches") or 0,
                "reason": str(r.get("reason") or ""),
                "decision_id": r.get("id"),
                "delivered_at": delivered.get(now_id.get(i, r["directive_id"])),
            }
            for i, r in enumerate(made)
            if r.get("directive_id") is not None
            and now_id.get(i, r["directive_id"]) not in ended
            and r.get("run_id") == run_id
        ]
        log.warning(
            "%s: no usable database: recovered from %s: run %s, outstanding directives %s",
            self.path,
            LOG_NAME,
            run_id,
            [d["id"] for d in outstanding] or "none",
        )
        ids = [r.get("id") for r in made if type(r.get("id")) is int and 0 < r["id"] < MAX_STEP]
        return {
            "run": {"run_id": run_id},
            "records": records,
            "directives": outstanding,
            "next_decision_id": 1 + max(ids, default=0),
            "next_directive_id": max(
                (d + 1 for d in [*(r.get("directive_id") for r in made), *now_id.values()] if type(d) is int),
                default=None,
            ),
        }

    def archive(self, batch: Batch, run_id: str, when: float) -> None:
        """End run `run_id` with `batch` (its last state): its rows marked archived, then its decisions.jsonl
        moved to STATE_DIR/runs/RUN_ID/ once that commits."""
        target = self.path.parent / "runs" / _safe_name(run_id)

        def move():
            target.mkdir(parents=True, exist_ok=True)
            if self.log_path.exists():
                os.replace(self.log_path, target / LOG_NAME)

        batch.add("UPDATE runs SET archived_at = ? WHERE run_id = ?", (when, run_id))
        batch.full, batch.then = True, move
        log.warning(
            "run %s ended here; its state stays in %s (archived), its decisions.jsonl moves to %s",
            run_id.encode("unicode_escape").decode(),
            self.path.name,
            target,
        )

    def set_aside_bad_rows(self) -> int:
        """Move every row whose columns do not hold what TYPED says into rows_aside, with an ERROR naming it;
        the number moved. A current run's row moved aside leaves no current run: the next one begins."""
        moved = 0
        for table, checks in TYPED.items():
            names, keys = list(checks), KEYS[table]
            for row in self._db.execute(f"SELECT {', '.join(keys + tuple(names))} FROM {table}").fetchall():
                key, values = row[: len(keys)], dict(zip(names, row[len(keys) :]))
                bad = [n for n in names if not checks[n](values[n])]
                if not bad:
                    continue
                reason = f"{', '.join(f'{n}={values[n]!r}'[:120] for n in bad)} not of the column's type"
                text = json.dumps(
                    {k: v if isinstance(v, (int, float, str, type(None))) else repr(v) for k, v in values.items()}
                )
                self._db.execute("BEGIN IMMEDIATE")
                self._db.execute("INSERT INTO rows_aside VALUES (?, ?, ?, ?)", (table, text, reason, time.time()))
                where = " AND ".join(f"{k} IS ?" for k in keys)
                self._db.execute(f"DELETE FROM {table} WHERE {where}", key)
                self._db.execute("COMMIT")
                log.error(
                    "%s: a row of table %s is unreadable (%s): moved to table rows_aside", self.path, table, reason
                )
                moved += 1
        return moved

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


def evidence_dir(run_id: str, decision_id: int) -> str:
    """Where the ranks' evidence for a decision is kept, relative to the state dir (parwatch.sidecar.evidence)."""
    return f"evidence/{_safe_name(run_id)}/decision-{decision_id}"


def _safe_name(run_id: str) -> str:
    """A run id as a directory name: nothing that climbs out of runs/ or hides."""
    name = re.sub(r"[^A-Za-z0-9_.-]", "_", run_id)[:120].lstrip(".")
    return name or "_"


def _move_aside(path: Path) -> Path | None:
    if not path.exists():
        return None
    aside = path.with_name(f"{path.name}.invalid-{time.strftime('%Y%m%dT%H%M%S')}")
    os.replace(path, aside)
    return aside


def _ids_after_renumbering(records: list[dict]) -> dict[int, int]:
    """{index among the decision records: its directive's id now} for the directives a later decision of
    rank 0's own renumbered (its `renumbered` {old: new}: ids rank 0 never took and would now ignore).
    Handed out again under the old id, such a directive would be ignored and its action lost."""
    now_id: dict[int, int] = {}
    ids: list[object] = []
    for r in records:
        for old, new in (r.get("renumbered") or {}).items():
            for i, did in enumerate(ids):
                if str(now_id.get(i, did)) == str(old) and type(new) is int:
                    now_id[i] = new
        if r.get("type") == RecordType.DECISION:
            ids.append(r.get("directive_id"))
    return now_id
