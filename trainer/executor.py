"""Runs one step of a pipeline schedule (a list of parwatch.trainer.schedules.Instr) on this rank.

Each instruction is announced as a hook span; the data fetch of the first and
last virtual stages is a `data` span of its own, before the forward. Sends are posted with isend and
completed at the end of the step; receives block. Messages carry a tag naming
(kind, destination virtual stage, microbatch) so gloo matches them exactly;
the schedules also keep every pair's send and receive order identical, so a
transport without tags (NCCL) matches them too.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from parwatch import contract
from parwatch.trainer.comm import Comm
from parwatch.trainer.data import global_index, microbatch
from parwatch.trainer.faults import Faults
from parwatch.trainer.schedules import Instr, message_of, peer_stage
from parwatch.vocabulary import InstrOp, P2PPayload


@dataclass(frozen=True)
class StepShape:
    microbatches: int
    micro_batch_size: int
    seq_len: int
    hidden: int
    vocab: int
    seed: int
    dtype: torch.dtype
    device: torch.device = torch.device("cpu")


class PipelineExecutor:
    def __init__(
        self,
        chunks: list,
        instrs: list[Instr],
        comm: Comm,
        shape: StepShape,
        faults: Faults,
        registry: contract.HookRegistry = contract.registry,
    ):
        self.chunks = chunks
        self.instrs = instrs
        self.comm = comm
        self.shape = shape
        self.faults = faults
        self.registry = registry
        g = comm.groups
        self.stage, self.p, self.v = g.stage, g.dims.pp, len(chunks)
        self.pp_ranks = g.pp_ranks
        self.dp_rank = g.coords.dp_rank
        self.last_vstage = self.p * self.v - 1
        if comm.faults is None:
            comm.faults = faults  # its hang points (before a TP all-reduce, before a p2p send)

    # ------------------------------------------------------------------ helpers
    def _vstage(self, chunk: int) -> int:
        return chunk * self.p + self.stage

    def _tag(self, instr: Instr) -> int:
        msg = message_of(instr, self.stage, self.p)
        return (msg.dst_vstage * self.shape.microbatches + msg.microbatch) * 2 + (msg.kind == P2PPayload.GRAD)

    def _peer(self, instr: Instr) -> int:
        return self.pp_ranks[peer_stage(instr, self.stage, self.p)]

    def _data(self, step_data: int, mb: int):
        s = self.shape
        ids, targets = microbatch(
            s.seed, step_data, global_index(self.dp_rank, s.microbatches, mb), s.micro_batch_size, s.seq_len, s.vocab
        )
        return ids.to(s.device, non_blocking=True), targets.to(s.device, non_blocking=True)

    # --------------------------------------------------------------------- step
    def run(self, step: int, data_step: int) -> float | None:
        """Execute the schedule once; returns the mean microbatch loss on the last stage, else None.

        Losses stay on the device until the step is done: one host read per step, not one per
        microbatch (which would synchronise the GPU inside the schedule and distort its timing)."""
        s, reg = self.shape, self.registry
        act_shape = (s.micro_batch_size, s.seq_len, s.hidden)
        inputs: dict = {}
        outputs: dict = {}
        grads: dict = {}
        losses: list = []
        # Injected loss faults (nan, bad-batch, spike) act on the stage that computes the loss.
        factor = self.faults.loss_factor(step, data_step) if self.stage == self.last_vstage % self.p else 1.0
        straggle_s = self.faults.straggler_ms(step) / 1000.0
        data_delay_s = self.faults.data_delay_ms() / 1000.0
        warmup_s = self.faults.warmup_ms(step) / 1000.0
        self.faults.begin_step(step)
        for instr in self.instrs:
            key = (instr.microbatch, instr.chunk)
            vstage = self._vstage(instr.chunk)
            attrs = dict(stage=self.stage, microbatch=instr.microbatch, chunk=instr.chunk)
            op = instr.op
            if op == InstrOp.RECV_ACT:
                buf = torch.empty(act_shape, dtype=s.dtype, device=s.device)
                self.comm.recv(buf, self._peer(instr), self._tag(instr), what=P2PPayload.ACTIVATION, **attrs)
                inputs[key] = buf.requires_grad_()
            elif op == InstrOp.RECV_GRAD:
                buf = torch.empty(act_shape, dtype=s.dtype, device=s.device)
                self.comm.recv(buf, self._peer(instr), self._tag(instr), what=P2PPayload.GRAD, **attrs)
                grads[key] = buf
            elif op == InstrOp.FORWARD:
                if vstage == 0 or vstage == self.last_vstage:
                    # Its own span, outside the forward: slow input must not read as slow compute.
                    with reg.span(contract.SpanKind.DATA, **attrs):
                        ids, targets = self._data(data_step, instr.microbatch)
                        if data_delay_s:
                            time.sleep(data_delay_s)
                with reg.span(contract.SpanKind.FORWARD, **attrs):
                    self.faults.hang_if("compute")
                    self.faults.hang_if("kernel")
                    if warmup_s:  # an injected first-step warm-up (compilation): once, in the first forward
                        time.sleep(warmup_s)
                        warmup_s = 0.0
                    chunk = self.chunks[instr.chunk]
                    x = ids if vstage == 0 else inputs[key]
                    out = chunk(x)
                    if vstage == self.last_vstage:
                        loss = chunk.loss(out, targets)
                        if factor != 1.0:
                            loss = loss * factor
                        losses.append(loss.detach())
                        out = loss / s.microbatches
                    if straggle_s and instr.chunk == 0:
                        time.sleep(straggle_s)
                outputs[key] = out
            elif op == InstrOp.SEND_ACT:
                self.comm.isend(
                    outputs[key].detach(), self._peer(instr), self._tag(instr), what=P2PPayload.ACTIVATION, **attrs
                )
            elif op == InstrOp.BACKWARD:
                with reg.span(contract.SpanKind.BACKWARD, **attrs):
                    self.faults.hang_if("backward")
                    out = outputs.pop(key)
                    if vstage == self.last_vstage:
                        torch.autograd.backward(out)
                    else:
                        torch.autograd.backward(out, grads.pop(key))
            elif op == InstrOp.SEND_GRAD:
                x = inputs.pop(key)
                self.comm.isend(x.grad, self._peer(instr), self._tag(instr), what=P2PPayload.GRAD, **attrs)
            self.comm.poll_sends()
        self.comm.complete_sends()
        return torch.stack(losses).mean().item() if losses else None
