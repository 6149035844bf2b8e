"""Replay a pipeline schedule's action lists with given durations: makespan, busy, idle, bubble.

Pure Python, no torch. A schedule is `{rank: [action, ...]}`: each rank runs its list in
order, one action at a time, and an action starts once its dependencies have finished:

    F(s, mb)    after F(s-1, mb)                       (s is the virtual stage)
    B/I(s, mb)  after F(s, mb) and after B/I(s+1, mb)  (the gradient from the next stage)
    W(s, mb)    after I(s, mb)

A dependency produced on another rank also waits `p2p_s` (the send's latency; `p2p_of` gives
it per producing action where it was measured). `host_s` is the executor's own host work
before each block of actions (posting sends and receives, its bookkeeping), one figure or per
block: the rank spends it, then waits for the block's dependencies; it is idle, not
busy, as it is in the collector's accounting. Which rank
holds a virtual stage is read from the order itself, so interleaved (stage s on rank s % p)
and V layouts (stages r and 2p-1-r on rank r) need no extra argument.

Actions may be this module's `Action`, torch's `_Action` (duck-typed: stage_index,
computation_type, microbatch_index, sub_actions), a `(stage, type, microbatch)` tuple or a
string such as "2F0". torch's OVERLAP_F_B runs its sub-actions back to back, and what they
produce reaches other ranks when the whole block ends (torch posts the sends after it): such a
block is kept as an `Overlap` (its string "(0F3;3B1)OVERLAP_F_B", torch's own spelling, reads
back as one), and `blocks()` gives an order with its blocks intact; `None` (an
idle slot in torch's IR) and non-compute actions (SEND_*, RECV_*, REDUCE_GRAD, UNSHARD,
RESHARD) are dropped: communication is modelled by `p2p_s`, idle by the replay.

    order = {0: ["0F0", "0F1", "0B0", "0B1"], 1: ["1F0", "1B0", "1F1", "1B1"]}
    simulate(order, {"F": 0.04, "B": 0.08}).bubble    # {0: 0.333.., 1: 0.333..}

parwatch.bubble gives the closed forms; `bubble_causes()` splits a measured bubble into the part
the schedule implies, the part stage imbalance adds, and the rest (waiting).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol

from parwatch.vocabulary import BubbleCause, ScheduleName, canonical_schedule

F, B, I, W = "F", "B", "I", "W"  # forward, full backward, backward input, backward weight
COMPUTE_TYPES = (F, B, I, W)
_OVERLAP = "OVERLAP_F_B"
_ACTION_RE = re.compile(r"^\s*(\d+)\s*([A-Z_]+?)\s*(\d*)\s*$")
_OVERLAP_RE = re.compile(r"^\s*\((.*)\)\s*OVERLAP_F_B\s*$")


class Action(NamedTuple):
    """One compute action: `type` in F, B, I, W on virtual stage `stage` for `microbatch`.

    A named tuple, so hashing it (replays key dicts by action) runs in C."""

    stage: int
    type: str
    microbatch: int

    def __str__(self) -> str:
        return f"{self.stage}{self.type}{self.microbatch}"


class Overlap(tuple):
    """An OVERLAP_F_B block: actions one rank runs back to back, whose results other ranks get
    when the whole block ends. Flattening it into single actions would let the replay hand each
    result on early and overlap what torch runs one after the other."""

    __slots__ = ()

    def __str__(self) -> str:
        return f"({';'.join(map(str, self))}){_OVERLAP}"


@dataclass(frozen=True)
class SimResult:
    makespan: float
    """Seconds from the first action's start to the last action's end, over all ranks."""
    busy: dict
    """rank -> seconds spent in actions."""
    idle: dict
    """rank -> makespan - busy."""
    bubble: dict
    """rank -> idle / makespan (0 for an empty schedule)."""
    finish: dict
    """Action -> (start, end) seconds: the replayed timeline."""


# --------------------------------------------------------------------------- input
def normalize(order: Mapping | Replay) -> dict[int, list[Action]]:
    """`{rank: [Action, ...]}` from any accepted form (see the module docstring), or a Replay's."""
    if isinstance(order, Replay):
        return order.ranks
    return {rank: [a for group in groups for a in group] for rank, groups in _groups(order).items()}


def blocks(order: Mapping | Replay) -> dict[int, list[Action | Overlap]]:
    """`{rank: [Action or Overlap, ...]}`: as `normalize`, but an OVERLAP_F_B block of several
    compute actions stays one `Overlap` (what the replay of the order needs; see Overlap)."""
    grouped = order.blocks if isinstance(order, Replay) else _groups(order)
    return {rank: [g[0] if len(g) == 1 else Overlap(g) for g in groups] for rank, groups in grouped.items()}


def _groups(order: Mapping) -> dict[int, list[list[Action]]]:
    """Each rank's actions in blocks: one action, or an OVERLAP_F_B's sub-actions."""
    if not isinstance(order, Mapping) or not order:
        raise ValueError("pipeline order must be a non-empty {rank: [action, ...]} mapping")
    result: dict[int, list[list[Action]]] = {}
    for rank, actions in order.items():
        if not isinstance(rank, int) or rank < 0:
            raise ValueError(f"pipeline order key {rank!r} must be a rank (an int >= 0)")
        result[rank] = [group for raw in actions if (group := _convert(raw, rank))]
    seen: dict[Action, int] = {}
    for rank, groups in result.items():
        for action in (a for g in groups for a in g):
            if action in seen:
                raise ValueError(f"action {action} appears twice (ranks {seen[action]} and {rank})")
            seen[action] = rank
    return result


def _convert(raw, rank: int) -> list[Action]:
    if raw is None:
        return []
    parts: tuple[object, object, object]  # (stage, type, microbatch), checked below
    if isinstance(raw, Action):
        parts = (raw.stage, raw.type, raw.microbatch)
    elif isinstance(raw, Overlap):
        return [a for sub in raw for a in _convert(sub, rank)]
    elif isinstance(raw, str) and (overlap := _OVERLAP_RE.match(raw)):
        return [a for sub in overlap.group(1).split(";") if sub.strip() for a in _convert(sub, rank)]
    elif isinstance(raw, str):
        match = _ACTION_RE.match(raw)
        if not match:
            raise ValueError(f"rank {rank}: action string {raw!r} is not like '2F0' (stage, type, microbatch)")
        stage, kind, mb = match.groups()
        parts = (int(stage), kind, int(mb) if mb else None)
    elif isinstance(raw, tuple) and len(raw) == 3 and not hasattr(raw, "computation_type"):
        parts = raw
    elif hasattr(raw, "computation_type"):  # torch's _Action
        kind = _type_name(raw.computation_type)
        if kind == _OVERLAP:
            subs = getattr(raw, "sub_actions", None) or ()
            return [a for sub in subs for a in _convert(sub, rank)]
        parts = (raw.stage_index, kind, raw.microbatch_index)
    else:
        raise ValueError(f"rank {rank}: cannot read action {raw!r}; use Action(stage, type, microbatch)")
    stage, kind, mb = parts
    kind = _type_name(kind)
    if kind not in COMPUTE_TYPES:
        return []  # communication, resharding, grad reduction: not replayed
    if not isinstance(stage, int) or stage < 0 or not isinstance(mb, int) or mb < 0:
        raise ValueError(f"rank {rank}: action {raw!r} needs a stage and a microbatch (ints >= 0)")
    return [Action(stage, kind, mb)]


def _type_name(kind) -> str:
    value = getattr(kind, "value", kind)  # torch's _ComputationType is a str Enum
    return str(value)


# ---------------------------------------------------------------------- durations
def _duration_fn(durations: Mapping):
    """Seconds of an action: durations[action], else durations[(stage, type)], else durations[type].

    B defaults to I + W when both are known, so one table serves fused and split schedules."""
    if not isinstance(durations, Mapping):
        raise ValueError("durations must map a type ('F', 'B', 'I', 'W'), (stage, type) or an Action to seconds")
    for key, value in durations.items():
        kind = key.type if isinstance(key, Action) else key[1] if isinstance(key, tuple) else key
        if kind not in COMPUTE_TYPES or not isinstance(value, (int, float)) or value < 0:
            raise ValueError(
                f"durations[{key!r}] = {value!r}: keys are F/B/I/W, (stage, F/B/I/W) or an Action, values seconds >= 0"
            )

    def lookup(stage: int, kind: str) -> float | None:
        value = durations.get((stage, kind))
        return durations.get(kind) if value is None else value

    def duration(action: Action) -> float:
        value = durations.get(action)
        if value is not None:
            return float(value)
        value = lookup(action.stage, action.type)
        if value is None and action.type == B:
            i, w = lookup(action.stage, I), lookup(action.stage, W)
            value = None if i is None or w is None else i + w
        if value is None:
            raise ValueError(
                f"no duration for {action.type} on stage {action.stage}; "
                f"give durations[{action.type!r}] or durations[({action.stage}, {action.type!r})]"
            )
        return float(value)

    return duration


# ---------------------------------------------------------------------- simulate
def _dependencies(action: Action, stages: Mapping[tuple[int, int], str], n_stages: int) -> list[Action]:
    """What must finish before `action`; `stages[(s, mb)]` is the backward type that stage uses (B or I)."""
    s, mb = action.stage, action.microbatch
    if action.type == F:
        return [Action(s - 1, F, mb)] if s > 0 else []
    if action.type in (B, I):
        deps = [Action(s, F, mb)]
        if s + 1 < n_stages:
            deps.append(Action(s + 1, stages.get((s + 1, mb), B), mb))
        return deps
    return [Action(s, I, mb)]  # W


HostSeconds = float | Mapping[int, float] | Mapping[int, Sequence[float]]
"""The executor's host work before each block: one figure, per rank, or per rank and block."""


def simulate(
    order: Mapping | Replay,
    durations: Mapping,
    p2p_s: float = 0.0,
    host_s: HostSeconds = 0.0,
    p2p_of: Mapping[Action, float] | None = None,
) -> SimResult:
    """Replay `order` (see the module docstring) with `durations` in seconds.

    durations: {"F": s, "B": s} for uniform stages, {(stage, "F"): s, ...} per virtual stage, or
    {Action: s} per action (an Action entry wins over (stage, type), which wins over a type
    entry); B defaults to I + W.
    p2p_s: latency added to a dependency produced on another rank.
    p2p_of: {Action: s}: that latency for what one action produced, where it was measured (the
    others take p2p_s).
    host_s: the executor's host seconds before each block of actions (an action, or an `Overlap`):
    one figure, {rank: seconds}, or {rank: [seconds per block, in the order's block order]}
    (missing ranks: 0). Every rank starts at 0; the makespan runs from 0 to the last end.
    `order` may be a `Replay` (compiled once, for replaying one order many times)."""
    replay = order if isinstance(order, Replay) else Replay(order)
    return replay.run(durations, p2p_s, host_s, p2p_of)


class Replay:
    """An order compiled for replaying: every action's dependencies resolved, and an order of its
    blocks that respects them, found once. `run()` is then one pass over flat lists, which is
    what rank 0's collector needs: it replays the run's order twice a step (`bubble_causes`).

    Raises ValueError for an order that cannot run: a virtual stage on no rank, a dependency no
    rank runs, a deadlock."""

    def __init__(self, order: Mapping) -> None:
        blocks = _groups(order)
        self.blocks = blocks
        self.ranks = {r: [a for g in groups for a in g] for r, groups in blocks.items()}
        """`{rank: [Action, ...]}`, as `normalize` gives it."""
        self.stages = stages_of(self)
        """`{rank: [virtual stage, ...]}`."""
        rank_of = {a.stage: r for r, actions in self.ranks.items() for a in actions}
        n_stages = max(rank_of, default=-1) + 1
        missing = sorted(set(range(n_stages)) - set(rank_of))
        if missing:
            raise ValueError(f"virtual stages {missing} appear on no rank; the order covers 0..{n_stages - 1}")
        bwd_type = {(a.stage, a.microbatch): a.type for acts in self.ranks.values() for a in acts if a.type in (B, I)}
        present = {a for acts in self.ranks.values() for a in acts}
        index: dict[Action, int] = {}
        plan: list = []  # (rank, ((action index, ((dep index, produced on another rank), ...)), ...))
        cursor = {r: 0 for r in blocks}
        remaining = sum(len(group) for groups in blocks.values() for group in groups)
        while remaining:
            progressed = False
            for rank, groups in blocks.items():
                while cursor[rank] < len(groups):
                    group = groups[cursor[rank]]
                    deps = [d for action in group for d in _dependencies(action, bwd_type, n_stages) if d not in group]
                    absent = [d for d in deps if d not in present]
                    if absent:
                        action = next(a for a in group if absent[0] in _dependencies(a, bwd_type, n_stages))
                        raise ValueError(
                            f"rank {rank}: {action} depends on {absent[0]}, which no rank runs; the order is incomplete"
                        )
                    if any(d not in index for d in deps):
                        break
                    for action in group:
                        index[action] = len(index)
                    plan.append(
                        (
                            rank,
                            tuple(
                                (
                                    index[action],
                                    tuple(
                                        (index[dep], dep not in group and rank_of[dep.stage] != rank)
                                        for dep in _dependencies(action, bwd_type, n_stages)
                                    ),
                                )
                                for action in group
                            ),
                        )
                    )
                    cursor[rank] += 1
                    remaining -= len(group)
                    progressed = True
            if not progressed:
                blocked = [str(blocks[r][cursor[r]][0]) for r in blocks if cursor[r] < len(blocks[r])]
                raise ValueError(f"the order deadlocks: every rank waits ({', '.join(blocked)} are next)")
        self._actions = list(index)
        self._keys = [(a.stage, a.type) for a in self._actions]
        self._plan = plan
        self._rank_indices = {r: [index[a] for a in acts] for r, acts in self.ranks.items()}

    def run(
        self,
        durations: Mapping,
        p2p_s: float = 0.0,
        host_s: HostSeconds = 0.0,
        p2p_of: Mapping[Action, float] | None = None,
    ) -> SimResult:
        """The replay with these durations (see `simulate`)."""
        if p2p_s < 0:
            raise ValueError(f"p2p_s={p2p_s} must be >= 0")
        latency = [p2p_s] * len(self._actions)
        if p2p_of:
            position = {a: i for i, a in enumerate(self._actions)}
            for action, value in p2p_of.items():
                if action not in position or not isinstance(value, (int, float)) or value < 0:
                    raise ValueError(
                        f"p2p_of[{action!s}] = {value!r}: keys are actions of the order, values seconds >= 0"
                    )
                latency[position[action]] = float(value)
        host = _host_fn(host_s, self.blocks)
        duration = _duration_fn(durations)
        if any(isinstance(key, Action) for key in durations):
            seconds = [duration(a) for a in self._actions]
        else:  # by (stage, type): one lookup each, not one per action
            by_key = {key: duration(Action(key[0], key[1], 0)) for key in set(self._keys)}
            seconds = [by_key[key] for key in self._keys]
        n = len(seconds)
        start, end, published = [0.0] * n, [0.0] * n, [0.0] * n
        free = dict.fromkeys(self.blocks, 0.0)
        block_of = dict.fromkeys(self.blocks, 0)
        for rank, group in self._plan:
            t = free[rank] + host(rank, block_of[rank])  # the block's host work first, then its dependencies
            block_of[rank] += 1
            for i, deps in group:
                ready = t
                for j, remote in deps:
                    at = published[j] + latency[j] if remote else end[j]
                    if at > ready:
                        ready = at
                t = ready + seconds[i]
                start[i], end[i] = ready, t
            for i, _ in group:  # what a block produces reaches other ranks when the block ends
                published[i] = t
            free[rank] = t
        ranks = self._rank_indices
        if not n:
            return SimResult(0.0, {r: 0.0 for r in ranks}, {r: 0.0 for r in ranks}, {r: 0.0 for r in ranks}, {})
        # From 0, not the first start: with host work the first action starts late, and that wait is idle.
        makespan = max(end)
        busy = {r: sum(end[i] - start[i] for i in indices) for r, indices in ranks.items()}
        idle = {r: makespan - busy[r] for r in ranks}
        bubble = {r: (idle[r] / makespan if makespan > 0 else 0.0) for r in ranks}
        return SimResult(makespan, busy, idle, bubble, {a: (start[i], end[i]) for i, a in enumerate(self._actions)})


def _host_fn(host_s: HostSeconds, blocks: Mapping[int, list]) -> Callable[[int, int], float]:
    """(rank, block index) -> the host seconds before that block, `host_s` checked."""
    if not isinstance(host_s, Mapping):
        if not isinstance(host_s, (int, float)) or host_s < 0:
            raise ValueError(
                f"host_s={host_s!r} must be seconds >= 0, {{rank: seconds}} or {{rank: [seconds per block]}}"
            )
        return lambda rank, block: float(host_s)
    per_block: dict[int, list[float]] = {r: [0.0] * len(groups) for r, groups in blocks.items()}
    for rank, value in host_s.items():
        if rank not in blocks:
            raise ValueError(f"host_s[{rank!r}]: keys are ranks of the order ({sorted(blocks)})")
        values = [value] * len(blocks[rank]) if isinstance(value, (int, float)) else list(value)
        if len(values) != len(blocks[rank]) or not all(isinstance(v, (int, float)) and v >= 0 for v in values):
            raise ValueError(
                f"host_s[{rank!r}] = {value!r}: seconds >= 0, or one such figure for each of the rank's "
                f"{len(blocks[rank])} blocks"
            )
        per_block[rank] = [float(v) for v in values]
    return lambda rank, block: per_block[rank][block]


# ----------------------------------------------------------------- bubble causes
@dataclass(frozen=True)
class BubbleCauses:
    """One stage's bubble share of a step, split three ways (they sum to the measured bubble)."""

    schedule: float
    """The bubble the schedule implies with every stage at the mean per-type time."""
    imbalance: float
    """Added by this step's unequal stage times: simulated at measured times, minus schedule."""
    wait: float
    """The rest: measured - schedule - imbalance (p2p, collectives, host). Negative if faster."""

    def as_dict(self) -> dict[BubbleCause, float]:
        return {cause: getattr(self, cause.value) for cause in BubbleCause}


def bubble_causes(
    order: Mapping | Replay,
    per_stage_type_seconds: Mapping[int, Mapping[str, float]],
    measured_bubble_per_stage: Mapping[int, float],
    p2p_s: float = 0.0,
) -> dict[int, BubbleCauses]:
    """Split each stage's measured bubble ratio into schedule, imbalance and wait.

    order: the schedule's `{rank: [action, ...]}` (rank = pipeline stage, as in the summaries), or
        its `Replay` (compiled once: rank 0's collector calls this every step).
    per_stage_type_seconds: `{rank: {"F": s, "B": s}}` or with "I" and "W": the mean seconds of
        ONE action of that type on that rank in this step (all its virtual stages alike).
    measured_bubble_per_stage: `{rank: bubble_ratio}` as the collector measured it.
    p2p_s: a point-to-point latency both simulations assume (0: none).
    Returns `{rank: BubbleCauses}` for the ranks of `measured_bubble_per_stage`."""
    replay = order if isinstance(order, Replay) else Replay(order)
    ranks = replay.ranks
    unknown = sorted(set(measured_bubble_per_stage) - set(ranks))
    if unknown:
        raise ValueError(f"measured_bubble_per_stage has stages {unknown} the order does not run")
    lacking = sorted(set(ranks) - set(per_stage_type_seconds))
    if lacking:
        raise ValueError(f"per_stage_type_seconds lacks stages {lacking}; give each stage's F and B (or I, W)")
    given = set(COMPUTE_TYPES)
    for rank in ranks:
        given &= set(per_stage_type_seconds[rank])
    mean = {kind: sum(float(per_stage_type_seconds[r][kind]) for r in ranks) / len(ranks) for kind in given}
    measured = {
        (stage, kind): float(per_stage_type_seconds[r][kind])
        for r, stages in replay.stages.items()
        for stage in stages
        for kind in given
    }
    uniform = replay.run(mean, p2p_s).bubble
    actual = replay.run(measured, p2p_s).bubble
    out = {}
    for rank, bubble in measured_bubble_per_stage.items():
        schedule = uniform[rank]
        imbalance = actual[rank] - schedule
        out[rank] = BubbleCauses(schedule, imbalance, float(bubble) - schedule - imbalance)
    return out


class StageSeconds(Protocol):
    """One stage's compute seconds in a step, per kind (a rank's global view stage has them)."""

    @property
    def forward_seconds(self) -> float: ...
    @property
    def backward_seconds(self) -> float: ...
    @property
    def backward_weight_seconds(self) -> float: ...
    @property
    def loss_seconds(self) -> float: ...


def per_action_seconds(order: Mapping | Replay, stage_totals: Mapping[int, StageSeconds]) -> dict[int, dict]:
    """Per-action mean seconds from one step's per-stage totals, for `bubble_causes`.

    stage_totals: `{rank: stage seconds}`: the collector's global-view stages fit as they are. backward
    sums full backwards (B) and input backwards (I); a rank running both is split assuming
    B = I + W. The loss, computed after the last stage's forwards, is folded into that rank's F."""
    out: dict[int, dict] = {}
    for rank, actions in normalize(order).items():
        totals = stage_totals.get(rank)
        if totals is None:
            raise ValueError(f"stage_totals lacks stage {rank}; give every stage of the order")
        count = {kind: sum(1 for a in actions if a.type == kind) for kind in COMPUTE_TYPES}
        fwd = totals.forward_seconds + totals.loss_seconds
        bwd, wgt = totals.backward_seconds, totals.backward_weight_seconds
        means: dict[str, float] = {}
        if count[F]:
            means[F] = fwd / count[F]
        if count[W]:
            means[W] = wgt / count[W]
        if count[I]:  # bwd = nB * (I + W) + nI * I
            means[I] = max(0.0, (bwd - count[B] * means[W]) / (count[B] + count[I]))
            if count[B]:
                means[B] = means[I] + means[W]
        elif count[B]:
            means[B] = bwd / count[B]
        out[rank] = means
    return out


# ------------------------------------------------------------- executed orders
def single_stage_order(schedule_name: str, p: int, m: int) -> dict[int, list[Action]]:
    """The order torch's one-stage-per-rank schedules execute (ScheduleGPipe, Schedule1F1B).

    Their `pipeline_order` is descriptive only, and in torch 2.13 Schedule1F1B's is off by one
    microbatch on the last rank, so the replay uses what `_step_microbatches` runs: GPipe all
    forwards then all backwards; 1F1B min(m, p-s) warm-up forwards, then B/F alternating."""
    name = canonical_schedule(schedule_name)
    if p < 1 or m < 1:
        raise ValueError(f"single_stage_order: p={p} and m={m} must be >= 1")
    order: dict[int, list[Action]] = {}
    for s in range(p):
        if name == ScheduleName.GPIPE:
            order[s] = [Action(s, F, i) for i in range(m)] + [Action(s, B, i) for i in range(m)]
        elif name == ScheduleName.ONE_F_ONE_B:
            warmup = min(m, p - s)
            acts = [Action(s, F, i) for i in range(warmup)]
            for i in range(m):
                acts.append(Action(s, B, i))
                if warmup + i < m:
                    acts.append(Action(s, F, warmup + i))
            order[s] = acts
        else:
            raise ValueError(f"single_stage_order: schedule {schedule_name!r} must be gpipe or 1f1b")
    return order


def stages_of(order: Mapping | Replay) -> dict[int, list[int]]:
    """rank -> the virtual stages it runs, in ascending order."""
    return {r: sorted({a.stage for a in acts}) for r, acts in normalize(order).items()}
