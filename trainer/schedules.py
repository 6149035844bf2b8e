"""Pipeline schedules as data: the instruction list each stage runs.

A schedule is, per stage, the list of `Instr` the executor runs in order. Builders
choose the order of forwards and backwards; each compute then gets its recv right
before it and its send right after it (posted with isend, never waited on). With
these orders every (src rank -> dst rank) pair sends its messages in the order the
receiver receives them (tests check it), so the lists run on a transport without
tags: NCCL p2p is FIFO per pair.

p=2, m=4, forward 1 unit, backward 2 units, as parwatch.pipeline_sim replays
`pipeline_order`. Digit n = forward of microbatch n, letter pair = its backward
(aa = mb 0), . = idle:

  GPipe: all forwards, then all backwards in forward order (as Megatron and
  torch.distributed.pipelining do). Bubble (p-1)/(m+p-1) = 1/5 on every stage;
  every stage holds all m microbatches' activations.
    stage 0 |0123...aabbccdd|
    stage 1 |.0123aabbccdd..|

  1F1B (PipeDream-Flush, Megatron's non-interleaved schedule): stage s runs
  min(p-s-1, m) warmup forwards, then one forward and one backward in turn, then the
  remaining backwards. Same bubble, but stage s holds at most min(m, p-s).
    stage 0 |01..aa2bb3cc.dd|
    stage 1 |.0aa1bb2cc3dd..|

  Interleaved 1F1B (Megatron's forward_backward_pipelining_with_interleaving): each
  rank holds v chunks; virtual stage = chunk*p + stage, and after the last rank comes
  rank 0's next chunk. Microbatches go through in groups of p per chunk, warmup is
  2(p-s-1) + (v-1)p. A chunk's work takes 1/v as long, so the bubble shrinks to
  (p-1)/(v*m+p-1) = 1/9. Needs p >= 2 and m % p == 0. v=2, one column = half a unit,
  0-3/aa-dd = chunk 0 and 4-7/ee-hh = chunk 1 of microbatches 0-3:
    stage 0 |01452.ee3ff6aa7bb.gg.hhccdd|
    stage 1 |.014ee5ff2aa3bb6gg7hhccdd..|

Why isend. With rendezvous sends (a send returns once the receiver has posted the
matching recv) GPipe still finishes, but 1F1B and interleaved deadlock once p >= 2 and
m >= 2: in steady state stage s sends an activation and then waits for a gradient, while
stage s+1 sends that gradient and then waits for the next activation, so both sit in
their send. Megatron posts such pairs together (send_forward_recv_backward via
batch_isend_irecv); an executor on blocking sends would have to do the same.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from parwatch.trainer.errors import ConfigError
from parwatch.vocabulary import REFERENCE_SCHEDULES, InstrOp, P2PPayload, ScheduleName, canonical_schedule
from parwatch.vocabulary import SCHEDULES as REGISTRY

COMPUTE_OPS = (InstrOp.FORWARD, InstrOp.BACKWARD)
RECV_OPS = (InstrOp.RECV_ACT, InstrOp.RECV_GRAD)
SEND_OPS = (InstrOp.SEND_ACT, InstrOp.SEND_GRAD)
OPS = frozenset(InstrOp)
SCHEDULES = REFERENCE_SCHEDULES
"""What this trainer runs."""
SCHEDULE_CHOICES = (*SCHEDULES, *(a for name in SCHEDULES for a in REGISTRY[name].aliases))
"""What --schedule and `build_schedule` take: the names and their aliases ("interleaved")."""


class ScheduleError(ConfigError, ValueError):
    """A schedule setting that cannot work (also a ValueError for plain callers)."""


@dataclass(frozen=True)
class Instr:
    op: str
    """One of recv_act, forward, send_act, recv_grad, backward, send_grad."""
    microbatch: int
    """Microbatch index, 0..m-1."""
    chunk: int = 0
    """Model chunk on this rank (0..v-1); virtual stage = chunk * p + stage."""

    def __post_init__(self) -> None:
        if self.op not in OPS:
            raise ValueError(f"Instr op={self.op!r} is not one of {sorted(map(str, OPS))}")

    def __str__(self) -> str:
        return f"{self.op}(mb={self.microbatch}, chunk={self.chunk})"


class Message(NamedTuple):
    """One p2p message, named the same way by its sender and its receiver."""

    kind: P2PPayload
    microbatch: int
    src_vstage: int
    dst_vstage: int


def virtual_stage(stage: int, chunk: int, num_stages: int) -> int:
    return chunk * num_stages + stage


_DIRECTION: dict[str, int] = {InstrOp.SEND_ACT: 1, InstrOp.RECV_ACT: -1, InstrOp.SEND_GRAD: -1, InstrOp.RECV_GRAD: 1}
"""Where a p2p op's message goes, in virtual stages (+1: to the next)."""


def message_of(instr: Instr, stage: int, num_stages: int) -> Message:
    """The message a send/recv instruction on `stage` moves; its ranks are vstage % p."""
    vs = virtual_stage(stage, instr.chunk, num_stages)
    kind = P2PPayload.ACTIVATION if instr.op.endswith("_act") else P2PPayload.GRAD
    step = _DIRECTION[instr.op]
    src, dst = (vs, vs + step) if instr.op in SEND_OPS else (vs + step, vs)
    return Message(kind, instr.microbatch, src, dst)


def peer_stage(instr: Instr, stage: int, num_stages: int) -> int:
    """The rank (pipeline stage) a send goes to or a recv comes from."""
    msg = message_of(instr, stage, num_stages)
    return (msg.dst_vstage if instr.op in SEND_OPS else msg.src_vstage) % num_stages


def build_schedule(name: str, stage: int, num_stages: int, microbatches: int, chunks: int = 1) -> list[Instr]:
    """The instruction list stage `stage` runs for one step of schedule `name` (or an alias of it)."""
    name = canonical_schedule(name)
    _check_args(name, stage, num_stages, microbatches, chunks)
    order = _compute_order(name, stage, num_stages, microbatches, chunks)
    return _with_p2p(order, stage, num_stages, chunks)


def _check_args(name: str, stage: int, p: int, m: int, v: int) -> None:
    if name not in SCHEDULES:
        raise ScheduleError(f"schedule={name!r} is unknown; choose one of {', '.join(SCHEDULES)}")
    for setting, value in (("num_stages", p), ("microbatches", m), ("chunks", v)):
        if not isinstance(value, int) or value < 1:
            raise ScheduleError(f"{setting}={value!r} must be a positive integer")
    if not isinstance(stage, int) or not 0 <= stage < p:
        raise ScheduleError(f"stage={stage!r} is out of range for num_stages={p}; use 0..{p - 1}")
    if name != ScheduleName.INTERLEAVED_1F1B and v != 1:
        raise ScheduleError(f"chunks={v} needs schedule='interleaved1f1b'; use chunks=1 with {name!r}")
    if name == ScheduleName.INTERLEAVED_1F1B:
        if v < 2:
            raise ScheduleError(f"chunks={v}: interleaved needs chunks >= 2 (chunks=1 is plain '1f1b')")
        if p < 2:
            raise ScheduleError("num_stages=1: interleaved needs num_stages >= 2; use '1f1b' on one stage")
        if m % p:
            choices = sorted({m + p - m % p, max(p, m - m % p)})
            raise ScheduleError(
                f"microbatches={m} is not a multiple of num_stages={p} (interleaved needs it, as in "
                f"Megatron); use microbatches={' or '.join(map(str, choices))}"
            )


def _compute_order(name: str, s: int, p: int, m: int, v: int) -> list[Instr]:
    """The forwards and backwards of stage s, in the order it runs them."""
    if name == ScheduleName.GPIPE:  # backward in forward order, as Megatron and torch.distributed.pipelining do
        return [Instr(InstrOp.FORWARD, i) for i in range(m)] + [Instr(InstrOp.BACKWARD, i) for i in range(m)]
    if name == ScheduleName.ONE_F_ONE_B:
        fwd = [Instr(InstrOp.FORWARD, i) for i in range(m)]
        bwd = [Instr(InstrOp.BACKWARD, i) for i in range(m)]
        warmup = min(p - s - 1, m)
    else:  # interleaved: Megatron's warmup count and virtual-microbatch -> (mb, chunk) map

        def unit(op: str, k: int) -> Instr:
            chunk = (k % (p * v)) // p
            mb = (k // (p * v)) * p + k % p
            return Instr(op, mb, chunk if op == InstrOp.FORWARD else v - 1 - chunk)

        fwd = [unit(InstrOp.FORWARD, k) for k in range(m * v)]
        bwd = [unit(InstrOp.BACKWARD, k) for k in range(m * v)]
        warmup = min(2 * (p - s - 1) + (v - 1) * p, m * v)
    steady = [ins for pair in zip(fwd[warmup:], bwd) for ins in pair]
    return fwd[:warmup] + steady + bwd[len(fwd) - warmup :]


def _with_p2p(order: list[Instr], s: int, p: int, v: int) -> list[Instr]:
    """Each compute with its recv right before it and its send right after it."""
    out: list[Instr] = []
    for ins in order:
        vs = virtual_stage(s, ins.chunk, p)
        first, last = vs == 0, vs == p * v - 1
        if ins.op == InstrOp.FORWARD:
            recv, send = (None if first else InstrOp.RECV_ACT), (None if last else InstrOp.SEND_ACT)
        else:
            recv, send = (None if last else InstrOp.RECV_GRAD), (None if first else InstrOp.SEND_GRAD)
        if recv:
            out.append(Instr(recv, ins.microbatch, ins.chunk))
        out.append(ins)
        if send:
            out.append(Instr(send, ins.microbatch, ins.chunk))
    return out


def pipeline_order(name: str, num_stages: int, microbatches: int, chunks: int = 1) -> dict[int, list[str]]:
    """Every stage's compute actions in parwatch.pipeline_sim's notation ("{vstage}{F|B}{mb}"):
    what an observer replays to split the bubble into its causes."""
    order = {}
    for stage in range(num_stages):
        order[stage] = [
            f"{i.chunk * num_stages + stage}{'F' if i.op == InstrOp.FORWARD else 'B'}{i.microbatch}"
            for i in build_schedule(name, stage, num_stages, microbatches, chunks)
            if i.op in COMPUTE_OPS
        ]
    return order
