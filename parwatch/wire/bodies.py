"""What others post to a sidecar: an operator's control, Alertmanager's webhook, another sidecar's halves of
cross-node collectives, and the problem every 4xx answers with.

POST /v1/control                    ControlRequest
POST /v1/directives/{id}/cancel     CancelRequest
POST /v1/alerts                     AlertmanagerPayload (webhook version 4)
POST /v1/instances                  InstancesForward: a node sidecar's halves of cross-node collectives.

An operator's bodies refuse unknown keys (a typo must not pass). Bounds: parwatch/wire/bounds.py.
"""

from __future__ import annotations

from typing import Annotated, Literal

from msgspec import Meta, Struct, field

from parwatch.vocabulary import Action, CollectiveOp, GroupRole
from parwatch.wire.bounds import MAX_WORLD, Count, Host, Node, Rank, RunId, Seconds, Step


class Problem(Struct, frozen=True, kw_only=True):
    """Every 4xx answer: `detail` names the field (or header, or limit) and the fix."""

    detail: str


class ControlRequest(Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """POST /v1/control: an operator's pause, resume or rollback."""

    action: Action
    to_step: Step | None = None  # the contract's bound (parse_directive): what passes, the trainer takes
    skip_batches: Step = 0
    reason: Annotated[str, Meta(max_length=2000)] = ""
    requested_by: Annotated[str, Meta(max_length=200)] = ""


class CancelRequest(Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    requested_by: Annotated[str, Meta(max_length=200)] = ""


AlertStatus = Literal["firing", "resolved"]


class Alert(Struct, frozen=True, kw_only=True):
    status: AlertStatus
    labels: dict[str, str] = field(default_factory=dict)
    annotations: dict[str, str] = field(default_factory=dict)
    startsAt: str = ""
    endsAt: str = ""
    generatorURL: str = ""
    fingerprint: Annotated[str, Meta(max_length=128)] = ""


class AlertmanagerPayload(Struct, frozen=True, kw_only=True):
    """POST /v1/alerts: Alertmanager's webhook payload, version 4."""

    version: Literal["4"]
    status: AlertStatus
    receiver: str = ""
    groupLabels: dict[str, str] = field(default_factory=dict)
    commonLabels: dict[str, str] = field(default_factory=dict)
    commonAnnotations: dict[str, str] = field(default_factory=dict)
    externalURL: str = ""
    alerts: Annotated[list[Alert], Meta(max_length=10_000)] = field(default_factory=list)


MAX_FORWARD_HALVES = 2000
"""Instances per cross-node post (a node posts once a second; ~150 bytes each as JSON)."""
MAX_FORWARD_RANK_ROWS = 4096
"""Rank attribution rows per cross-node post."""
MAX_NODE_RANKS = 4096
"""Members one node may report for one instance (a node runs a few to a few dozen ranks)."""
ForwardedMember = tuple[Rank, CollectiveOp, Count, Count]
"""[rank, op on that rank, duration microseconds, bytes]: one member's record of the instance."""
ForwardedRankRow = tuple[Rank, Step, Rank, Host, Seconds, Seconds, Seconds, Seconds | None]
"""[rank, step, stage, host, compute seconds, data seconds, step seconds, own compute seconds or null]:
attribution figures (own compute: compute less the rank's TP collectives; null when its records were capped)."""
ForwardedCpuWait = tuple[Rank, Step, Seconds]
"""[rank, step, seconds]: how long the rank's threads waited for a CPU in that step (sidecar/cpu_wait.py)."""


class ForwardedInstance(Struct, frozen=True, kw_only=True):
    """One node's members of a collective/p2p instance that spans nodes (sidecar/crossnode.py)."""

    op: CollectiveOp
    """The instance's op label: the collective's op, or "send" for a p2p transfer."""
    group: GroupRole
    seq: Count
    link: bool
    """true: a p2p transfer, members = [src, dst]; false: a collective, members = its group's ranks."""
    members: Annotated[list[Rank], Meta(min_length=2, max_length=MAX_WORLD)]
    step: Step
    """The step the node first saw it in."""
    got: Annotated[list[ForwardedMember], Meta(min_length=1, max_length=MAX_NODE_RANKS)]

    def __post_init__(self) -> None:
        if self.link and len(self.members) != 2:
            raise ValueError(f"a p2p instance (link: true) has members [src, dst]; got {len(self.members)} ranks")
        if len(set(self.members)) != len(self.members):
            raise ValueError("members must be distinct ranks")
        ranks = [m[0] for m in self.got]
        if len(set(ranks)) != len(ranks) or not set(ranks) <= set(self.members):
            raise ValueError("got must hold distinct ranks, each one of members")


class InstancesForward(Struct, frozen=True, kw_only=True):
    """POST /v1/instances: a node sidecar hands the leader what only the leader can match."""

    version: Literal[1]
    node: Node
    run_id: RunId
    instances: Annotated[list[ForwardedInstance], Meta(max_length=MAX_FORWARD_HALVES)] = field(default_factory=list)
    ranks: Annotated[list[ForwardedRankRow], Meta(max_length=MAX_FORWARD_RANK_ROWS)] = field(default_factory=list)
    cpu_waits: Annotated[list[ForwardedCpuWait], Meta(max_length=MAX_FORWARD_RANK_ROWS)] = field(default_factory=list)
    """The rows' ranks' waits for a CPU, where the node reads them (apart from `ranks`: an older leader still
    takes those)."""
