"""The training loop of one rank: build the layout and model, run steps, meet at boundaries.

At every step boundary all ranks join one small all-reduce (parwatch.contract's
StepBoundary): it carries the loss from the last stage, the observers' slots, rank 0's
directive and every rank's outcome of the last one, so pause, resume and rollback happen
on every rank at the same step, and rank 0 learns what every rank did.
"""

from __future__ import annotations

import logging
import math
import os
import random
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from parwatch import contract
from parwatch.contract import (
    Action,
    BoundaryKind,
    Event,
    FailReason,
    Outcome,
    SpanKind,
    StepBoundary,
    StepCheck,
    TorchAllReduce,
    Unresumable,
    Verdict,
    torch_grads,
)
from parwatch.trainer import checkpoint as ckpt
from parwatch.trainer import optim
from parwatch.trainer.comm import Comm
from parwatch.trainer.config import TrainConfig, parse_synthetic
from parwatch.trainer.errors import CheckpointError, TrainerError
from parwatch.trainer.executor import PipelineExecutor, StepShape
from parwatch.trainer.faults import Faults, InjectedError, parse_fault
from parwatch.trainer.flops import model_flops_per_step
from parwatch.trainer.model import Chunk, GPTConfig, build_pieces
from parwatch.trainer.parallel_dims import ParallelDims, build_groups
from parwatch.trainer.partition import partition, piece_param_counts
from parwatch.trainer.schedules import build_schedule, pipeline_order
from parwatch.trainer.synthetic import SyntheticChunk
from parwatch.vocabulary import GroupRole, jsonable

log = logging.getLogger("trainer")


class Trainer:
    def __init__(
        self, cfg: TrainConfig, rank: int, world_size: int, registry: contract.HookRegistry = contract.registry
    ):
        cfg.validate(world_size)
        self.cfg, self.rank, self.world = cfg, rank, world_size
        self.registry = registry
        self.dims = ParallelDims(cfg.tp, cfg.pp, cfg.dp, world_size)
        self.groups = build_groups(self.dims, rank)
        self.faults = Faults([parse_fault(s) for s in cfg.inject], rank, self.groups.stage)
        self.comm = Comm(
            self.groups,
            slow_ms=self.faults.slow_collectives(),
            registry=registry,
            link_delay_ms=self.faults.link_delays_ms(),
        )
        self.dtype = torch.float64 if cfg.dtype == "float64" else torch.float32
        self.device = self._device
        self.chunks = [c.to(self.device) for c in self._build_chunks()]
        params = [p for c in self.chunks for p in c.parameters()]
        self.optimizer: optim.Optimizer = (
            optim.SGD(params, lr=cfg.lr) if cfg.optimizer == "sgd" else optim.AdamW(params, lr=cfg.lr)
        )
        instrs = build_schedule(cfg.schedule, self.groups.stage, cfg.pp, cfg.microbatches, cfg.chunks)
        shape = StepShape(
            cfg.microbatches,
            cfg.micro_batch_size,
            cfg.seq_len,
            cfg.hidden,
            cfg.vocab,
            cfg.seed,
            self.dtype,
            self.device,
        )
        self.executor = PipelineExecutor(self.chunks, instrs, self.comm, shape, self.faults, registry)
        self.model_flops_per_step = self._model_flops()
        self.step = 0
        self.data_offset = 0  # batches skipped by rollbacks so far: data step = step + offset
        self.losses: dict[int, float] = {}  # step -> loss of the trajectory that survives rollbacks
        self.loss_history: list[tuple[int, float]] = []  # every step executed, rolled back or not
        self.step_seconds: dict[int, float] = {}
        self.applied: list[dict] = []
        self.bad_checkpoints: set[int] = set()  # failed verification on some rank: never loaded again
        self.run_id = cfg.run_id or "unnamed-run"
        """Named in every directive it follows and every checkpoint it writes."""
        self.reports_loss = self.groups.is_last_stage and self.groups.coords.tp_rank == 0
        all_reduce = TorchAllReduce(device=self.device)  # the boundary's and the check's: one set of buffers
        self.steps_boundary = StepBoundary(
            rank, world_size, self.run_id, all_reduce, registry=registry, reports_loss=self.reports_loss
        )
        self.step_check = (
            StepCheck(rank, world_size, all_reduce, registry=registry) if cfg.pre_step_check == "on" else None
        )
        """The check before each optimizer step (None: --pre-step-check off)."""
        self.step_checks: list[dict] = []
        """The verdicts of the steps the check found bad (re-run, skipped, paused)."""
        self._verdict: Verdict | None = None  # the current step's, between its check and its boundary
        self._last_boundary_t: float | None = None
        self.on_step: Callable[[int], None] | None = None
        """Called with the step after each step boundary (the launcher's progress), or None."""

    # ------------------------------------------------------------------ model
    def _build_chunks(self) -> list[torch.nn.Module]:
        cfg, g = self.cfg, self.groups
        parts = cfg.pp * cfg.chunks
        counts = piece_param_counts(cfg.layers, cfg.hidden, cfg.vocab, cfg.seq_len)
        ranges = partition(cfg.layers, parts, cfg.partition, counts)
        synthetic = parse_synthetic(cfg.synthetic_compute)
        gpt = GPTConfig(cfg.layers, cfg.hidden, cfg.heads, cfg.vocab, cfg.seq_len, cfg.seed, self.dtype)
        chunks: list[torch.nn.Module] = []
        for c in range(cfg.chunks):
            vstage = c * cfg.pp + g.stage
            pieces = ranges[vstage]
            if synthetic:
                blocks = sum(1 for i in pieces if 1 <= i <= cfg.layers)
                chunks.append(
                    SyntheticChunk(
                        blocks,
                        cfg.hidden,
                        cfg.vocab,
                        self.comm,
                        synthetic.fwd_ms / 1000 / cfg.chunks,
                        synthetic.bwd_ms / 1000 / cfg.chunks,
                        vstage == 0,
                        self.dtype,
                        serial_tp=bool(synthetic.serial_tp),
                    )
                )
            else:
                chunks.append(Chunk(build_pieces(gpt, self.comm, pieces)))
        return chunks

    def _model_flops(self) -> int | None:
        """This rank's model FLOPs per step; None under synthetic compute (there is no math)."""
        cfg = self.cfg
        if cfg.synthetic_compute:
            return None
        from parwatch.trainer.model import Block

        layers_local = sum(1 for c in self.chunks for m in c.modules() if isinstance(m, Block))
        return model_flops_per_step(
            self.chunks,
            layers_local,
            cfg.hidden,
            cfg.tp,
            cfg.seq_len,
            cfg.microbatches * cfg.micro_batch_size * cfg.seq_len,
        )

    # --------------------------------------------------------------- boundary
    def boundary(self, kind: BoundaryKind, loss: float | None = None):
        """The step-boundary all-reduce; returns (mean loss, a directive to apply or None)."""
        return self.steps_boundary.exchange(kind, self.step, loss)

    @property
    def _device(self):
        return (
            torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
        )

    # -------------------------------------------------------------- one step
    def train_step(self) -> float | None:
        step = self.step + 1
        if self.faults.crash_now(step):
            # The wall time it ends: tests time the leader's finding from here.
            log.error("rank %d: injected crash at step %d, exiting at %.3f", self.rank, step, time.time())
            os._exit(17)
        if self.faults.raise_now(step):
            log.error("rank %d: injected exception at step %d, raising at %.3f", self.rank, step, time.time())
            raise InjectedError(f"injected exception on rank {self.rank} at step {step}")
        self.faults.hiccup_if_due(step)
        data_step = step + self.data_offset
        loss = self._forward_backward(step, data_step)
        self._verdict = None
        if self.step_check is not None:
            passes = [loss]

            def rerun() -> None:
                passes.append(self._forward_backward(step, data_step))

            self._verdict = verdict = self.step_check.run(
                step, lambda: self._reading(passes[-1]), rerun, batch=data_step
            )
            loss = passes[-1]
            if verdict.action is not None:
                self.step_checks.append(verdict.as_dict())
            if not verdict.applied:  # skipped: the batch is passed over, the weights stay as they are
                self._zero_grads()
                self.step = step
                return loss
        self._dp_sync()
        with self.registry.span(SpanKind.OPTIMIZER, stage=self.groups.stage):
            self.optimizer.step()
        self.step = step
        return loss

    def _forward_backward(self, step: int, data_step: int) -> float | None:
        """One pass of the schedule on batch `data_step`, from zeroed gradients; this rank's loss (last stage)."""
        self._zero_grads()
        loss = self.executor.run(step, data_step)
        if self.faults.corrupt_grads_now(step):
            grad = next(p.grad for c in self.chunks for p in c.parameters() if p.grad is not None)
            grad.view(-1)[0] = math.nan  # one element, as a flipped exponent bit would leave it
            log.error("rank %d: injected gradient corruption (sdc) at step %d", self.rank, step)
        return loss

    def _zero_grads(self) -> None:
        for opt_group in self.optimizer.param_groups:
            for p in opt_group["params"]:
                p.grad = None

    def _reading(self, loss: float | None):
        """This rank's loss (the ranks that report one) and its gradients, before the DP sync: a fault is
        named on the rank that produced it, not on the replicas it would spread to."""
        grads = torch_grads.grads_of(p for c in self.chunks for p in c.parameters())
        return torch_grads.reading(loss if self.reports_loss else None, grads)

    def _dp_sync(self) -> None:
        if self.dims.dp == 1:
            return
        with self.registry.span(SpanKind.DP_SYNC, stage=self.groups.stage):
            grads = [p.grad for c in self.chunks for p in c.parameters() if p.grad is not None]
            flat = torch.cat([g.reshape(-1) for g in grads])
            self.comm.all_reduce(flat, GroupRole.DP)
            flat /= self.dims.dp  # SUM then divide: gloo has no ReduceOp.AVG
            offset = 0
            for g in grads:
                g.copy_(flat[offset : offset + g.numel()].view_as(g))
                offset += g.numel()

    # ------------------------------------------------------------ checkpoints
    def save_checkpoint(self) -> None:
        cfg = self.cfg
        state = {
            "model": [c.state_dict() for c in self.chunks],
            "optimizer": self.optimizer.state_dict(),
            "rng": {"torch": torch.get_rng_state(), "python": random.getstate()},
        }
        meta = {
            "run_id": self.run_id,
            "step": self.step,
            "data_offset": self.data_offset,
            "parallel": {"tp": cfg.tp, "pp": cfg.pp, "dp": cfg.dp, "chunks": cfg.chunks},
            "config": cfg.to_dict(),
        }
        with self.registry.span(SpanKind.CHECKPOINT, stage=self.groups.stage, step=self.step):
            delay_ms = self.faults.checkpoint_delay_ms()
            if delay_ms:  # an injected slow save (a busy file system)
                time.sleep(delay_ms / 1000.0)
            ckpt.save_checkpoint(
                cfg.checkpoint_dir,
                self.step,
                self.rank,
                self.world,
                state,
                meta,
                dist.barrier,
                keep_last=cfg.keep_checkpoints,
            )
        self.bad_checkpoints.discard(self.step)  # written anew
        self.registry.emit_event(Event.CHECKPOINT_SAVED, step=self.step, checkpoints=self._usable_checkpoints())

    def _eval_if_due(self, step: int) -> None:
        """An injected eval pass after the boundary of `step` (the reference trainer evaluates nothing else)."""
        ms = self.faults.eval_ms(step)
        if ms:
            with self.registry.span(SpanKind.EVAL, stage=self.groups.stage, step=step):
                time.sleep(ms / 1000.0)

    def _checkpoint_if_finite(self, loss: float) -> None:
        """Save after the boundary, when every rank knows the step's loss: a NaN/inf step's weights
        are poisoned, and saving them would only push good checkpoints out of the kept set."""
        if math.isfinite(loss):
            self.save_checkpoint()
        else:
            log.warning("rank %d: step %d loss is %s; checkpoint skipped", self.rank, self.step, loss)
            self.registry.emit_event(Event.CHECKPOINT_SKIPPED, step=self.step, reason=f"loss {loss}")

    def load_checkpoint(self, step: int) -> None:
        state, manifest = ckpt.load_checkpoint(self.cfg.checkpoint_dir, step, self.rank, self.world)
        for chunk, sd in zip(self.chunks, state["model"]):
            chunk.load_state_dict(sd)
        self.optimizer.load_state_dict(state["optimizer"])
        torch.set_rng_state(state["rng"]["torch"])
        random.setstate(state["rng"]["python"])
        self.step = manifest["meta"]["step"]
        self.data_offset = manifest["meta"]["data_offset"]

    # ------------------------------------------------------------- directives
    def _apply(self, directive) -> None:
        if directive is None:
            return
        if directive.action == Action.PAUSE:
            self._report(directive, Outcome.APPLIED)
            self._pause()
        elif directive.action == Action.ROLLBACK:
            self._rollback(directive)
        else:  # resume while running: nothing to do, but say it was seen
            self._report(directive, Outcome.APPLIED)

    def _report(
        self, directive, outcome: Outcome, *, loaded_step: int | None = None, reason: FailReason | None = None, **noted
    ) -> None:
        """Tell every rank's boundary (and so rank 0) this rank's outcome; note it in the run summary."""
        record = {
            "id": directive.id,
            "action": directive.action.value,
            "step": self.step,
            "outcome": outcome,
            **noted,
        }
        if loaded_step is not None:
            record["loaded_step"] = loaded_step
        if reason is not None:
            record["reason"] = reason
        self.applied.append(record)
        self.steps_boundary.report(directive, outcome, step=self.step, loaded_step=loaded_step, reason=reason)

    def _pause(self) -> None:
        self.registry.emit_event(Event.PAUSED, step=self.step)
        log.warning("rank %d: paused at step %d", self.rank, self.step)
        try:
            rollback = self.steps_boundary.hold(self.step, self.cfg.pause_poll_s, report=self._report)
        except Unresumable as err:
            raise TrainerError(
                f"{err}: run it watched by a sidecar (--parwatch-endpoint), or --pre-step-check off"
            ) from None
        if rollback is not None:
            self._rollback(rollback)

    def _usable_checkpoints(self) -> list[int]:
        """This run's complete checkpoints not known to be bad. A checkpoint directory shared with an earlier
        run holds its steps too: a rollback never loads another run's weights."""
        if not self.cfg.checkpoint_dir:
            return []
        steps = ckpt.list_checkpoints(self.cfg.checkpoint_dir)
        return [s for s in steps if s not in self.bad_checkpoints and self._run_of(s) == self.run_id]

    def _run_of(self, step: int) -> str | None:
        """The run that wrote checkpoint `step` (its manifest says); unreadable ones are judged ours here and
        refused by verification, which names the fault."""
        try:
            return ckpt.read_manifest(self.cfg.checkpoint_dir, step)["meta"].get("run_id")
        except (CheckpointError, KeyError, AttributeError):
            return self.run_id

    def _load_agreed(self, limit: int | None) -> tuple[int | None, list[int]]:
        """Load this run's newest checkpoint up to `limit` (any, for None) that passes verification on every
        rank (one agreement per candidate): (the step loaded or None, the candidates tried)."""
        candidates = sorted(
            (s for s in self._usable_checkpoints() if limit is None or s <= limit),
            reverse=True,
        )
        for candidate in candidates:
            problem = ckpt.verify_checkpoint(self.cfg.checkpoint_dir, candidate, self.rank, self.world)
            if problem:
                log.error("rank %d: checkpoint %d fails verification: %s", self.rank, candidate, problem)
            if self.steps_boundary.agree(problem is None):
                self.load_checkpoint(candidate)
                return candidate, candidates
            self.bad_checkpoints.add(candidate)
            self.registry.emit_event(
                Event.CHECKPOINT_CORRUPT,
                step=candidate,
                rank=self.rank,
                error=problem or "",
                checkpoints=self._usable_checkpoints(),
            )
        return None, candidates

    def _restore(self) -> None:
        """--resume: continue from this run's newest checkpoint (a restart after a crash)."""
        loaded, candidates = self._load_agreed(None)
        if loaded is None:
            log.warning(
                "rank %d: --resume found no %s checkpoint of run %s in %s; starting at step 0",
                self.rank,
                "intact" if candidates else "complete",
                self.run_id,
                self.cfg.checkpoint_dir,
            )
            return
        log.warning("rank %d: resumed run %s from its checkpoint at step %d", self.rank, self.run_id, loaded)
        self.registry.emit_event(Event.RESTORED, step=loaded)
        self.boundary(BoundaryKind.RESUME)

    def _rollback(self, directive) -> None:
        """Load the asked checkpoint, or, when it fails verification on any rank, the newest older one
        that passes on every rank: all ranks decide together (one agreement per candidate)."""
        from_step, asked = self.step, directive.to_step
        loaded, candidates = self._load_agreed(from_step if asked is None else asked)
        if loaded is None:
            reason = FailReason.CHECKPOINT_CORRUPT if candidates else FailReason.NO_CHECKPOINT
            log.error(
                "rank %d: rollback requested at step %d but no %s checkpoint exists; continuing",
                self.rank,
                from_step,
                "intact" if candidates else "complete",
            )
            self._report(directive, Outcome.FAILED, reason=reason)
            return
        self.data_offset += directive.skip_batches
        for s in [s for s in self.losses if s > loaded]:
            del self.losses[s]
        outcome = Outcome.APPLIED if asked is None or loaded == asked else Outcome.SUBSTITUTED
        if outcome == Outcome.SUBSTITUTED:
            log.warning("rank %d: checkpoint %d unusable; rolled back to %d instead", self.rank, asked, loaded)
        self._report(
            directive,
            outcome,
            loaded_step=loaded,
            from_step=from_step,
            to_step=loaded,
            skip_batches=directive.skip_batches,
        )
        self.registry.emit_event(
            Event.ROLLBACK, from_step=from_step, to_step=loaded, skip_batches=directive.skip_batches
        )
        self.boundary(BoundaryKind.RESUME)

    # -------------------------------------------------------------------- run
    def run(self) -> dict:
        self.begin()
        while self.step < self.cfg.steps:
            self.run_step()
            if self.step == self.cfg.steps:  # the last steps' judgement may send the run back
                self._apply(self.steps_boundary.settle(self.step))
        return self.end()

    def begin(self) -> None:
        """run_start, the start boundary (every rank lines up), and a resume if configured."""
        cfg = self.cfg
        self.registry.emit_event(
            Event.RUN_START,
            config=cfg.to_dict(),
            rank=self.rank,
            model_flops_per_step=self.model_flops_per_step,
            pipeline_order=pipeline_order(cfg.schedule, cfg.pp, cfg.microbatches, cfg.chunks),
        )
        self.boundary(BoundaryKind.START)
        if cfg.resume:
            self._restore()
        self._last_boundary_t = time.perf_counter()

    def run_step(self) -> None:
        """One step, its boundary, and what the boundary brought: a directive, a checkpoint."""
        cfg = self.cfg
        loss = self.train_step()
        self.faults.hang_if("boundary")  # an injected hang before joining the boundary (between spans)
        mean_loss, directive = self.boundary(BoundaryKind.STEP, loss)
        now = time.perf_counter()
        if self._last_boundary_t is not None:
            self.step_seconds[self.step] = now - self._last_boundary_t
        self.losses[self.step] = mean_loss
        self.loss_history.append((self.step, mean_loss))
        trained = self.step
        if self.on_step is not None:
            self.on_step(self.step)
        paused_before = len(self.applied)
        self._apply(directive)
        verdict, self._verdict = self._verdict, None
        if verdict is not None and verdict.pause and self.step == trained:
            # Every rank decided it at the check: skips keep coming. Held like a pause directive, unless
            # one just held the run (the operator has seen it and resumed).
            if not any(a["action"] == Action.PAUSE for a in self.applied[paused_before:]):
                log.error("rank %d: step %d %s; pausing", self.rank, self.step, verdict.evidence.get("pause"))
                self._pause()
        if self.step == trained and cfg.checkpoint_every and self.step % cfg.checkpoint_every == 0:
            self._checkpoint_if_finite(mean_loss)
        self._eval_if_due(trained)
        self._last_boundary_t = time.perf_counter()

    def end(self) -> dict:
        summary = self.summary()
        self.registry.emit_event(Event.RUN_END, steps_completed=self.step, summary=summary)
        return summary

    def close(self, failed: bool = False) -> None:
        """The trainer's part of shutdown, before its process group is destroyed: sends completed
        and their lane threads ended, the boundary's all-reduce released (see TorchAllReduce.close).
        After a failure every wait is short: a peer may be gone."""
        try:
            self.comm.close(failed, timeout_s=0.5 if failed else 5.0)
        finally:
            self.steps_boundary.close(timeout_s=1.0 if failed else 5.0)

    def summary(self) -> dict:
        steps = sorted(self.losses)
        return {
            "config": self.cfg.to_dict(),
            "world_size": self.world,
            "steps_completed": self.step,
            "losses": [jsonable(self.losses[s]) for s in steps],
            "step_seconds": [self.step_seconds.get(s) for s in steps],
            "loss_history": [[s, jsonable(loss)] for s, loss in self.loss_history],
            "directives_applied": self.applied,
            "step_checks": self.step_checks,
            "tokens_per_step": self.cfg.tokens_per_step,
        }


if __name__ == "__main__":  # `python -m parwatch.trainer.train` is the trainer too, not a module that trains nothing
    import sys

    from parwatch.trainer.launch import main

    sys.exit(main())
