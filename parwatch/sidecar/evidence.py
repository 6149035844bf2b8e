"""Evidence kept at a decision: when the leader names a hang or a crash, every rank it can reach sends its
Python stacks (all threads), its last spans, its activity and its Flight Recorder dump's path
(parwatch.collector.evidence); the leader writes them beside the decision:

    STATE_DIR/evidence/<run>/decision-<id>/rank<R>.json

(the decision's `evidence.bundle` names that directory). The ask travels with answers the ranks and nodes
already get once a second: the leader's reply to a rank's activity post, and to a node's digest, carries
{"evidence": {"decision": id}}; a node then asks its own ranks the same way, and forwards what they send
to the leader's POST /v1/evidence. Everything arrives within about 3 s of the decision (two digest
ticks and a post), well inside the 5 s the issue asks.

What is accepted is bounded and checked against what the sidecar knows: the body is a typed record
(parwatch.wire.evidence.EvidencePost, at most 64 spans and 128 KiB of stacks), its run is the run it asked,
its decision one it asked for within ASK_SECONDS, its rank inside the run and not yet stored for that
decision (409 otherwise); whose evidence a rank's or a node's credential may post is checked by the route
(ActivityHub._check_speaker in activity_api.py: its own rank reporting there; the ranks its digests carry). At most MAX_BUNDLES bundles are kept (the oldest directory goes first) and
MAX_RANKS_PER_BUNDLE ranks per bundle: disk use is bounded whatever the run's size. A write that fails
answers 503 and is logged; it never touches a decision.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import threading
from collections.abc import Callable
from pathlib import Path

import msgspec

from parwatch.vocabulary import jsonable
from parwatch.wire.evidence import RankEvidence

log = logging.getLogger(__name__)
ASK_SECONDS = 60.0
"""How long a decision's evidence is asked for (and accepted) after it was decided."""
MAX_BUNDLES = 64
MAX_RANKS_PER_BUNDLE = 1024
MAX_ASKED = 8
"""Decisions whose evidence is accepted at once (the newest ones asked)."""


class EvidenceRefused(ValueError):
    """Evidence this sidecar does not take; `status` is the HTTP answer (409, 503)."""

    def __init__(self, message: str, status: int = 409):
        super().__init__(message)
        self.status = status


class EvidenceBook:
    """What evidence this sidecar asks for, and (at the leader) where it keeps what it received."""

    def __init__(self, state_dir: str | Path, clock: Callable[[], float]):
        self.root = Path(state_dir)
        self.clock = clock
        self.asked: dict[int, dict] = {}
        """decision id -> {"run_id", "decision", "bundle" (leader), "time", "expected", "ranks"}, newest last."""
        self.failed_writes = 0
        self._lock = threading.Lock()  # stores run in worker threads

    # -- asking --------------------------------------------------------------------------------------
    def ask(self, run_id: str | None, decision: int, bundle: str | None = None, expected: tuple | list = ()) -> None:
        """Ask every rank for its evidence for `decision` (bundle: where the leader keeps it; None at a node)."""
        with self._lock:
            if decision in self.asked:
                return
            self.asked[decision] = {
                "run_id": run_id,
                "decision": decision,
                "bundle": bundle,
                "time": self.clock(),
                "expected": sorted(expected)[:MAX_RANKS_PER_BUNDLE],
                "ranks": [],
            }
            while len(self.asked) > MAX_ASKED:
                del self.asked[next(iter(self.asked))]

    def request(self, run_id: str | None) -> dict | None:
        """What a reply to this run's rank or node carries: the newest decision still asked, or None."""
        now = self.clock()
        for ask in reversed(self.asked.values()):
            if ask["run_id"] == run_id and now - ask["time"] <= ASK_SECONDS:
                return {"decision": ask["decision"]}
        return None

    # -- receiving -----------------------------------------------------------------------------------
    def check(self, ev: RankEvidence, world: int | None) -> dict:
        """The ask `ev` answers; EvidenceRefused (409) naming what does not fit."""
        ask = self.asked.get(ev.decision)
        if ask is None or self.clock() - ask["time"] > ASK_SECONDS:
            raise EvidenceRefused(f"evidence.decision: no evidence is asked for decision {ev.decision} here")
        if ev.run_id != ask["run_id"]:
            raise EvidenceRefused(
                f"evidence.run_id: decision {ev.decision} is run {ask['run_id']!r}'s, not {ev.run_id!r}"
            )
        if world is not None and ev.rank >= world:
            raise EvidenceRefused(f"evidence.rank: {ev.rank} is outside the run's {world} ranks")
        if ev.rank in ask["ranks"]:
            raise EvidenceRefused(
                f"evidence.rank: rank {ev.rank}'s evidence for decision {ev.decision} is already here"
            )
        if len(ask["ranks"]) >= MAX_RANKS_PER_BUNDLE:
            raise EvidenceRefused(f"evidence: decision {ev.decision} already keeps {MAX_RANKS_PER_BUNDLE} ranks")
        return ask

    def note(self, ev: RankEvidence) -> None:
        """A node: the rank's evidence is on its way to the leader (taken once)."""
        with self._lock:
            self.asked[ev.decision]["ranks"].append(ev.rank)

    def store(self, ev: RankEvidence) -> Path:
        """The leader: write the rank's evidence into its decision's bundle (atomically); EvidenceRefused
        (503) when the state dir cannot take it."""
        with self._lock:
            ask = self.asked[ev.decision]
            folder = self.root / ask["bundle"]
            try:
                if not folder.exists():
                    self._prune()
                    folder.mkdir(parents=True, exist_ok=True)
                path = folder / f"rank{ev.rank}.json"
                tmp = path.with_suffix(".tmp")
                with open(tmp, "w") as f:
                    json.dump(jsonable(msgspec.to_builtins(ev)), f, indent=1)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, path)
            except OSError as err:
                self.failed_writes += 1
                log.error("evidence: cannot write rank %d's evidence for decision %d: %s", ev.rank, ev.decision, err)
                raise EvidenceRefused(f"the sidecar cannot store evidence ({err.strerror or err})", 503) from None
            ask["ranks"].append(ev.rank)
            return path

    def _prune(self) -> None:
        """Keep at most MAX_BUNDLES bundle directories (the newest, by modification time)."""
        base = self.root / "evidence"
        if not base.is_dir():
            return
        bundles = sorted(
            (d for run in base.iterdir() if run.is_dir() for d in run.iterdir() if d.is_dir()),
            key=lambda d: d.stat().st_mtime,
        )
        for old in bundles[: max(0, len(bundles) - MAX_BUNDLES + 1)]:
            shutil.rmtree(old, ignore_errors=True)

    def status(self) -> list[dict]:
        """The decisions asked, newest last: where their bundle is and which ranks it holds so far."""
        return [
            {k: ask[k] for k in ("decision", "bundle", "time", "expected")} | {"ranks": sorted(ask["ranks"])}
            for ask in self.asked.values()
        ]
