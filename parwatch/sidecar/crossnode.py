"""Cross-node instances: a node sidecar hands the leader the collective/p2p instances it cannot
match alone, and the leader matches them (parwatch/sidecar/transfer.py does the matching).

With one sidecar per node, an instance whose members live on different nodes (pipeline
send/recv between stages on two nodes; a DP group across nodes) has some of its members'
records on each node. The node's TransferTracker sets those aside (`forwarding`); once a
second, right after its node digest (parwatch/sidecar/activity_api.py), the node posts the
oldest of them to --leader-url:

  POST /v1/instances  {"version": 1, "node": NAME, "run_id": ID,
                       "instances": [{"op", "group", "seq", "link", "members", "step",
                                      "got": [[rank, op, dur_us, bytes], ...]}, ...],
                       "ranks": [[rank, step, stage, host, compute_s, data_s, step_s, own_compute_s], ...],
                       "cpu_waits": [[rank, step, seconds], ...]}

at most MAX_FORWARD_HALVES instances, MAX_FORWARD_MEMBERS members listed in all, and
MAX_FORWARD_RANK_ROWS rank rows a post (parwatch/wire/bodies.py); the rest wait in the node's bounded outbox.
The rank rows let the leader's straggler attribution see every rank, not only its own node's; `cpu_waits`
(apart, so that a leader older than the field still takes the rows) how long each rank waited for a CPU in
those steps, where the node could read it. Durations only: no clock needs to agree across nodes.

The leader validates the body like any other (token, body size, bounds: 422 naming the field,
and every rank inside the run's world), ignores another run's, and merges the members into its
own pending instances by the same (group, members, seq) / (src, dst, seq) key; what is still
incomplete after REMOTE_SECONDS is dropped and counted (reason="remote"). A node whose post fails
counts what it carried as reason="unsent" and goes on (the leader may be restarting).
"""

from __future__ import annotations

import json
import logging

from fastapi import APIRouter, Depends, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from parwatch.sidecar.auth import identity_of
from parwatch.sidecar.bodies import body, documented
from parwatch.sidecar.transfer import Member, Pending, TransferTracker
from parwatch.vocabulary import Speaker
from parwatch.wire.bodies import MAX_FORWARD_HALVES, InstancesForward

log = logging.getLogger(__name__)
FORWARD_VERSION = 1
MAX_FORWARD_MEMBERS = 200_000
"""Members listed in one post, over all its instances (~1.5 MB of JSON, under the 8 MiB default body
limit): a node in wide DP groups sends fewer instances a post rather than one refused with 413."""


def to_wire(entries: list[Pending], rows: list[tuple], node: str, run_id: str) -> dict:
    """The POST body for some outbox entries and rank rows."""
    out = []
    for e in entries:
        link = e.key[0] == "p"
        members = [e.key[1], e.key[2]] if link else list(e.key[2])
        got = [[rank, m.op, round(m.seconds * 1e6), m.bytes] for rank, m in e.got.items()]
        out.append(
            {
                "op": e.op,
                "group": e.group,
                "seq": e.key[3],
                "link": link,
                "members": members,
                "step": e.first_step,
                "got": got,
            }
        )
    return {
        "version": FORWARD_VERSION,
        "node": node,
        "run_id": run_id,
        "instances": out,
        "ranks": [list(r[:8]) for r in rows],
        "cpu_waits": [[r[0], r[1], r[8]] for r in rows if r[8] is not None],
    }


def from_wire(body: InstancesForward, world: int) -> tuple[list[Pending], list[tuple]]:
    """Entries and rank rows to merge; RequestValidationError (422) names a rank outside the world."""
    entries = []
    for i, f in enumerate(body.instances):
        if max(f.members) >= world:
            _outside(("body", "instances", i, "members"), max(f.members), world)
        key: tuple
        path: tuple
        if f.link:
            src, dst = f.members
            key, path = ("p", src, dst, f.seq), ("link", src, dst)
        else:
            members = tuple(f.members)
            key, path = ("c", f.group, members, f.seq), ("group", f.group, members)
        got = {rank: Member(op, dur_us * 1e-6, nbytes) for rank, op, dur_us, nbytes in f.got}
        entries.append(Pending(f.op, f.group, path, frozenset(f.members), f.step, got, 0.0, key))
    for i, row in enumerate(body.ranks):
        if row[0] >= world:
            _outside(("body", "ranks", i, 0), row[0], world)
    for i, (rank, _, _) in enumerate(body.cpu_waits):
        if rank >= world:
            _outside(("body", "cpu_waits", i, 0), rank, world)
    waited = {(rank, step): seconds for rank, step, seconds in body.cpu_waits}
    return entries, [(*r, waited.get((r[0], r[1]))) for r in body.ranks]


def _outside(loc: tuple, rank: int, world: int):
    raise RequestValidationError(
        [
            {
                "type": "value_error",
                "loc": loc,
                "msg": f"rank {rank} is outside this run's world of {world} ranks (tp*pp*dp of the leader's run)",
            }
        ]
    )


class Forwarder:
    """A node's side: post the tracker's outbox to the leader, once per activity tick."""

    def __init__(self, tracker: TransferTracker, leader_url: str, node: str, headers: dict):
        self.tracker = tracker
        self.url = leader_url.rstrip("/") + "/v1/instances"
        self.node = node
        self.headers = {**headers, "Content-Type": "application/json"}
        self._failing = False
        tracker.forwarding = True

    async def post(self, http) -> int:
        """Post one batch (if any); returns how many instances the leader took (0 on failure)."""
        t = self.tracker
        if t.leading or t.run_id is None:
            return 0
        entries, rows = t.take_outbox(MAX_FORWARD_HALVES, MAX_FORWARD_MEMBERS)
        if not entries and not rows:
            return 0
        body = to_wire(entries, rows, self.node, t.run_id)
        try:
            response = await http.post(self.url, content=json.dumps(body), headers=self.headers)
            if response.status_code >= 400:
                raise RuntimeError(f"HTTP {response.status_code}: {response.text[:300]}")
        except Exception as exc:
            t.count_unsent(entries)
            if not self._failing:
                log.warning(
                    "cross-node instances to leader %s failing (%s); counted as unmatched reason=unsent", self.url, exc
                )
            self._failing = True
            return 0
        self._failing = False
        return len(entries)


def add_route(router: APIRouter, sidecar, auth: list) -> None:
    """POST /v1/instances on the control app (the leader takes what nodes forward)."""

    @router.post(
        "/v1/instances",
        dependencies=auth,
        openapi_extra=documented(InstancesForward),
        responses={401: {}, 403: {}, 413: {}, 422: {}},
    )
    async def instances(request: Request, forward: InstancesForward = Depends(body(InstancesForward))):
        """A node sidecar's members of instances that span nodes, and its ranks' attribution rows."""
        who = identity_of(request)
        if who.speaker == Speaker.NODE and who.node != forward.node:
            detail = f"node {forward.node[:64]!r}, but this credential speaks for {who.describe()} only"
            return JSONResponse({"detail": detail}, status_code=403)
        t = sidecar.transfer
        head = sidecar.store.run_summary()
        if head is None or forward.run_id != t.run_id:  # not this leader's run (a new run starting, a stray node)
            return JSONResponse({"matched": 0, "ignored": len(forward.instances)})
        entries, rows = from_wire(forward, head.tp * head.pp * head.dp)
        return JSONResponse({"matched": t.merge(entries, rows), "ignored": 0})
