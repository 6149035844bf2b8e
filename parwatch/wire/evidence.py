"""Evidence on the wire: what one rank was doing when the leader named a hang or a crash.

POST /v1/evidence  EvidencePost: {"version": 1, "evidence": RankEvidence}, a rank's to its node sidecar, or
                   a node's to the leader (parwatch.collector.evidence builds it; parwatch.sidecar.evidence
                   keeps it beside the decision).
"""

from __future__ import annotations

from typing import Annotated, Literal

from msgspec import Meta, Struct

from parwatch.wire.activity import ActivityReport
from parwatch.wire.bounds import MAX_ERROR_CHARS, MAX_STEP, Count, Rank, RunId, Text, Timestamp, text

MAX_EVIDENCE_SPANS = 64
MAX_STACK_CHARS = 128 * 1024


class SpanRow(Struct, array_like=True, frozen=True):
    """One of a rank's last spans, as its evidence keeps it: [kind, op, group, peer, seq, stage, microbatch,
    start, end] (start and end on the rank's wall clock; end null while it is open)."""

    kind: Text
    op: Text | None
    group: Text | None
    peer: Rank | None
    seq: Count | None
    stage: Rank | None
    microbatch: Annotated[int, Meta(ge=0, le=MAX_STEP)] | None
    start: Timestamp | None
    end: Timestamp | None


class FlightRecorder(Struct, kw_only=True):
    """torch.distributed's Flight Recorder dump (NCCL, and gloo on torch >= 2.8), written by the rank."""

    path: Annotated[str, text(4096)] | None = None
    """Where the rank wrote the pickled dump (its run directory, else its temp directory); None: not written."""
    entries: Annotated[int, Meta(ge=0)] | None = None
    error: Annotated[str, text(MAX_ERROR_CHARS)] | None = None
    """Why there is no dump (no process group, no recorder in this torch, the buffer size is 0)."""


class RankEvidence(Struct, kw_only=True):
    """What one rank was doing when the leader named a hang or a crash (parwatch.collector.evidence)."""

    run_id: RunId | None = None
    decision: Count
    """The decision (its id in decisions.jsonl) this evidence was asked for."""
    rank: Rank
    time: Timestamp
    activity: ActivityReport
    stacks: Annotated[str, Meta(max_length=MAX_STACK_CHARS)]
    """Every thread's Python stack, innermost call last (as faulthandler and traceback print them)."""
    spans: Annotated[list[SpanRow], Meta(max_length=MAX_EVIDENCE_SPANS)]
    """Its last spans, oldest first; the open ones (innermost last) at the end."""
    flight_recorder: FlightRecorder | None = None


class EvidencePost(Struct):
    """POST /v1/evidence: a rank's evidence to its node sidecar, or a node's to the leader."""

    version: Literal[1]
    evidence: RankEvidence
