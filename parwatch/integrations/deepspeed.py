"""Watch a DeepSpeed pipeline (`deepspeed.pipe.PipelineModule` / `PipelineEngine`) with parwatch.

    from parwatch.collector import Collector, attach
    from parwatch.integrations import deepspeed as pw

    engine, *_ = deepspeed.initialize(model=pipeline_module, config=cfg, optimizer=opt)
    watch = pw.watch(engine, run_id=run_id, checkpoint_dir="ckpt")   # spans + boundary
    attach(Collector(watch.run_context(), log_path="run/summaries.jsonl"))
    step = watch.start()
    while step < steps:
        engine.train_batch(data_iter)                               # unchanged
        step = watch.step_done()                                    # boundary; may pause or roll back
    watch.close()

How: the engine runs each instruction of its schedule through `self._INSTRUCTION_MAP[type(cmd)]`,
looked up on the instance. `watch` shadows that map on this one engine (the class and other
engines are untouched; `detach` removes it) with timed versions:

- ForwardPass / BackwardPass -> forward / backward spans (the last stage's loss runs inside its
  forward), numbered by microbatch in the order TrainSchedule runs them;
- SendActivation, RecvActivation, SendGrad, RecvGrad -> send / recv spans (DeepSpeed's p2p is
  blocking: a recv is the time the stage waited, a send the time until the peer took it);
- LoadMicroBatch -> data; ReduceGrads -> dp_sync (with dp = 1 a no-op);
- OptimizerStep -> the check before the optimizer step (below; untimed), then optimizer, *except*
  gradient clipping (`engine.clip_fp32_gradients`, on by default): the first all-reduce after the
  last backwards (the check's; clipping's norm all-reduce with the check off) is where a rank waits
  for the others' last backward. That part is left untimed: idle, i.e. bubble, as the schedule implies.
- ReduceTiedGrads and the loss broadcast after the schedule: untimed (idle).

DeepSpeed's DualPipeV engine (`deepspeed.pipe.DualPipeVModule`, run by `DualPipeVEngine` with
`DualPipeVSchedule`) is watched through the same map. Rank r holds stage r (phase 0) and stage
2p-1-r (phase 1); its instructions carry the phase:

- ForwardPass / BackwardPass -> forward / backward spans, chunk = phase, vstage = r or 2p-1-r,
  microbatch read from the buffer (`phase * m + microbatch`); rank 0's phase-1 forward holds the loss;
- Send*/Recv* only queue p2p ops there; `CommitP2P` launches the queued batch and waits for all of
  it. Each queued transfer becomes a send / recv span (peer, bytes, microbatch) over that commit:
  the time the rank waited for it. The first recv (else send) is the open span while the commit
  blocks (what a hang finding sees); the others are emitted with the same marks.

`engine.eval_batch` runs unwatched (eval steps are not training steps). `engine.save_checkpoint`
gets a checkpoint span and tells the collector the step is a rollback target.

The theory is the replay of DeepSpeed's own TrainSchedule (its instruction stream for every
stage, read from deepspeed.runtime.pipe.schedule) by parwatch.pipeline_sim, with measured times;
TrainSchedule is 1F1B, so its closed form is (p-1)/(m+p-1). For DualPipeV the replay is of
DualPipeVSchedule's stream (`dualpipev_schedule_order`), the computes up to each commit kept as
one block (see there).

The check before the optimizer step (parwatch.contract.step_check) runs inside the OptimizerStep
instruction, before DeepSpeed's optimizer step: every rank's loss (the loss stage's microbatch losses
so far) and gradient finiteness in one small all-reduce. A bad step's first pass takes no update, and
`train_batch` runs the step again on the microbatches it drew (recorded as the engine drew them, so
the user's iterator moves on once); the re-run's OptimizerStep then applies the update (transient) or
skips it through DeepSpeed's own overflow-skip path (the optimizer reports `overflow`: the engine
zeroes the gradients, counts `skipped_steps` and leaves the learning rate where it was); the third
skip in a window pauses the run at `step_done`.

Directives arrive through the step boundary: pause holds the run; rollback loads through
`load_checkpoint(step) -> loaded step`, or, given `checkpoint_dir`, through the engine's own
`load_checkpoint(checkpoint_dir, tag="global_step<N>")` (the tags `save_checkpoint` writes); the
batches it skips are in `watch.data_offset` (step s trains batch s + data_offset).
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from typing import Any

from parwatch.contract import SpanKind, StepBoundary, StepPolicy, TorchAllReduce, registry, torch_grads
from parwatch.integrations._deepspeed_order import dualpipev_schedule_order, train_schedule_order, vstage
from parwatch.integrations._stage_spans import Patches
from parwatch.integrations._steploop import IntegrationError, StepLoop, step_check_for
from parwatch.rank_layout import LayoutError, order_of_axes
from parwatch.vocabulary import CollectiveOp, GroupRole, ScheduleName

SCHEDULE = ScheduleName.ONE_F_ONE_B
"""DeepSpeed's TrainSchedule is 1F1B (PipeDream-flush)."""
DUALPIPEV = ScheduleName.DUALPIPEV
"""A DualPipeVEngine's DualPipeVSchedule: two stages per rank, in a V."""
_TAG = re.compile(r"^global_step(\d+)$")


class DeepSpeedWatch(StepLoop):
    """Instrument a DeepSpeed PipelineEngine on this rank; see the module docstring.

    run_id: the same non-empty string on every rank. load_checkpoint: `f(step or None) -> loaded
    step` for rollbacks; or checkpoint_dir: where `engine.save_checkpoint` writes (the engine
    loads from it). With neither, rollbacks are reported failed (no_checkpoint).
    check: the check before the optimizer step: True (the default StepPolicy), a StepPolicy, or False."""

    def __init__(
        self,
        engine,
        *,
        run_id: str,
        load_checkpoint: Callable[..., int] | None = None,
        checkpoint_dir: str | None = None,
        pause_poll_s: float = 0.2,
        check: bool | StepPolicy = True,
    ) -> None:
        import torch.distributed as dist

        if not run_id:
            raise IntegrationError("run_id must be the run's id (the same non-empty string on every rank)")
        for attr in ("_INSTRUCTION_MAP", "stage_id", "num_stages", "micro_batches", "grid", "train_batch"):
            if not hasattr(engine, attr):
                raise IntegrationError(
                    f"{type(engine).__name__} has no {attr}: not a deepspeed PipelineEngine "
                    "(build the model as a deepspeed.pipe.PipelineModule)"
                )
        if load_checkpoint is not None and checkpoint_dir is not None:
            raise IntegrationError("give load_checkpoint or checkpoint_dir, not both")
        self.engine = engine
        self.run_id = run_id
        self.pp = engine.num_stages
        self.microbatches = engine.micro_batches
        self.checkpoint_dir = checkpoint_dir
        self.dualpipev = _is_dualpipev(engine)
        self.schedule = DUALPIPEV if self.dualpipev else SCHEDULE
        # DualPipeV computes the loss on rank 0 (its is_last_stage() says so only outside a phase)
        self._reports_loss = engine.stage_id == 0 if self.dualpipev else engine.is_last_stage()
        all_reduce = TorchAllReduce(None, getattr(engine, "device", None))
        boundary = StepBoundary(
            dist.get_rank(), dist.get_world_size(), run_id, all_reduce, reports_loss=self._reports_loss
        )
        super().__init__(
            pp_rank=engine.stage_id,
            boundary=boundary,
            load_checkpoint=load_checkpoint or (self._load_from_dir if checkpoint_dir else None),
            pause_poll_s=pause_poll_s,
            step_check=step_check_for(boundary, all_reduce, check),
        )
        self._rerunning = False  # train_batch is running a bad step again
        self._patches = Patches()
        self._counts: dict[str, int] = {}
        self._training = False
        self._clip: list = []  # clipping's start and end marks inside this step's OptimizerStep
        self._queued: list[tuple[SpanKind, dict]] = []  # DualPipeV: transfers the next CommitP2P runs
        self.attached = False
        self.attach()

    # ------------------------------------------------------------------ instrumentation
    def attach(self) -> DeepSpeedWatch:
        """Instrument the engine (the constructor does; after `detach`, again)."""
        if self.attached:
            return self
        if not self._patches.redo():
            self._instrument()
        self.attached = True
        return self

    def detach(self) -> None:
        """Take every shadow off: the engine runs exactly as DeepSpeed ships it."""
        if self.attached:
            self._patches.undo()
            self.attached = False

    def _instrument(self) -> None:
        engine = self.engine
        shadow = self._dualpipev_map() if self.dualpipev else self._train_schedule_map()
        self._patches.set(engine, "_INSTRUCTION_MAP", shadow)
        self._patches.set(engine, "train_batch", self._marking(engine.train_batch, training=True))
        self._patches.set(engine, "eval_batch", self._marking(engine.eval_batch, training=False))
        self._patches.set(engine, "save_checkpoint", self._saving(engine.save_checkpoint))
        self._patches.set(engine, "clip_fp32_gradients", self._clipping(engine.clip_fp32_gradients))

    def _train_schedule_map(self) -> dict[type, Callable[..., Any]]:
        from deepspeed.runtime.pipe import schedule as ds

        engine, stage = self.engine, self.pp_rank
        base = {"stage": stage, "chunk": 0, "vstage": stage}
        peer = {"prev": _global_rank(engine, stage - 1), "next": _global_rank(engine, stage + 1)}
        p2p = {  # instruction -> (span kind, op, what, neighbour)
            ds.SendActivation: (SpanKind.SEND, CollectiveOp.SEND, "activation", "next"),
            ds.RecvActivation: (SpanKind.RECV, CollectiveOp.RECV, "activation", "prev"),
            ds.SendGrad: (SpanKind.SEND, CollectiveOp.SEND, "grad", "prev"),
            ds.RecvGrad: (SpanKind.RECV, CollectiveOp.RECV, "grad", "next"),
        }
        timed = {
            ds.ForwardPass: SpanKind.FORWARD,
            ds.BackwardPass: SpanKind.BACKWARD,
            ds.LoadMicroBatch: SpanKind.DATA,
            ds.ReduceGrads: SpanKind.DP_SYNC,
        }
        shadow: dict[type, Callable[..., Any]] = {}
        for cls, fn in engine._INSTRUCTION_MAP.items():  # the instance's own shadows, if any, stay inside ours
            if cls in timed:
                shadow[cls] = self._timed(fn, timed[cls], self._counted(base, cls.__name__))
            elif cls in p2p:
                kind, op, what, side = p2p[cls]
                attrs = {**base, "op": op, "what": what, "group": GroupRole.PP, "group_size": 2, "peer": peer[side]}
                shadow[cls] = self._timed(fn, kind, self._counted(attrs, cls.__name__), _PAYLOAD[cls.__name__])
            elif cls is ds.OptimizerStep:
                shadow[cls] = self._optimizer_step(fn)
            else:
                shadow[cls] = fn  # ReduceTiedGrads and anything newer: run as is (idle)
        return shadow

    def _dualpipev_map(self) -> dict[type, Callable[..., Any]]:
        """DualPipeVEngine's map: computes by phase and buffer, transfers timed at their commit."""
        from deepspeed.runtime.pipe import schedule as ds

        timed = {ds.ForwardPass: SpanKind.FORWARD, ds.BackwardPass: SpanKind.BACKWARD, ds.LoadMicroBatch: SpanKind.DATA}
        queued = {  # instruction -> (span kind, op, what)
            ds.SendActivation: (SpanKind.SEND, CollectiveOp.SEND, "activation"),
            ds.RecvActivation: (SpanKind.RECV, CollectiveOp.RECV, "activation"),
            ds.SendGrad: (SpanKind.SEND, CollectiveOp.SEND, "grad"),
            ds.RecvGrad: (SpanKind.RECV, CollectiveOp.RECV, "grad"),
        }
        shadow: dict[type, Callable[..., Any]] = {}
        for cls, fn in self.engine._INSTRUCTION_MAP.items():
            if cls in timed:
                shadow[cls] = self._timed(fn, timed[cls], self._by_buffer({}))
            elif cls in queued:
                kind, op, what = queued[cls]
                shadow[cls] = self._queueing(
                    fn, kind, self._by_buffer({"op": op, "what": what, "group": GroupRole.PP, "group_size": 2})
                )
            elif cls is ds.CommitP2P:
                shadow[cls] = self._commit(fn)
            elif cls is ds.ReduceGrads:
                shadow[cls] = self._timed(fn, SpanKind.DP_SYNC, lambda kwargs: {"stage": self.pp_rank})
            elif cls is ds.OptimizerStep:
                shadow[cls] = self._optimizer_step(fn)
            else:
                shadow[cls] = fn  # ReduceTiedGrads and anything newer: run as is (idle)
        return shadow

    def _counted(self, attrs: dict, counter: str):
        """Span attrs numbered by microbatch in the order the instructions run (per type and step):
        TrainSchedule runs each type in microbatch order."""
        counts = self._counts
        by_mb: dict[int, dict] = {}

        def attrs_of(kwargs) -> dict:
            mb = counts.get(counter, 0)
            counts[counter] = mb + 1
            span_attrs = by_mb.get(mb)
            if span_attrs is None:
                span_attrs = by_mb[mb] = {**attrs, "microbatch": mb}
            return span_attrs

        return attrs_of

    def _by_buffer(self, attrs: dict):
        """Span attrs of a DualPipeV instruction from its buffer and phase: DualPipeVSchedule keeps
        microbatch mb of phase ph in buffer ph * m + mb (LoadMicroBatch: phase 0)."""
        stage, m = self.pp_rank, self.microbatches
        cache: dict[tuple[int, int], dict] = {}

        def attrs_of(kwargs) -> dict:
            key = (kwargs.get("phase", 0), kwargs["buffer_id"])
            span_attrs = cache.get(key)
            if span_attrs is None:
                phase, buffer = key
                span_attrs = cache[key] = {
                    **attrs,
                    "stage": stage,
                    "chunk": phase,
                    "vstage": vstage(stage, self.pp, phase),
                    "microbatch": buffer - phase * m,
                }
            return span_attrs

        return attrs_of

    def _timed(self, fn, kind: SpanKind, attrs_of: Callable[[dict], dict], payload=None):
        """An instruction in a span of `kind` with `attrs_of(kwargs)`; `payload(engine, buffer_id)`:
        the tensors a send/recv moved (their bytes go in the span)."""

        def instruction(engine, **kwargs):
            if not (self._training and registry.active):
                return fn(engine, **kwargs)
            with registry.span(kind, **attrs_of(kwargs)) as span:
                if payload is None or span is None:
                    return fn(engine, **kwargs)
                if kind == SpanKind.SEND:  # a send frees its buffer: read it first
                    span.attrs["bytes"] = _nbytes(payload, engine, kwargs)
                    return fn(engine, **kwargs)
                result = fn(engine, **kwargs)
                span.attrs["bytes"] = _nbytes(payload, engine, kwargs)
                return result

        return instruction

    def _queueing(self, fn, kind: SpanKind, attrs_of: Callable[[dict], dict]):
        """A DualPipeV Send*/Recv*: it only queues P2POps on `engine._p2p_ops`; what it queued (peer,
        bytes) waits for the commit that runs it."""

        def instruction(engine, **kwargs):
            if not (self._training and registry.active):
                return fn(engine, **kwargs)
            before = len(getattr(engine, "_p2p_ops", ()))
            result = fn(engine, **kwargs)
            ops = getattr(engine, "_p2p_ops", ())[before:]
            if ops:  # a P2POp: op, tensor, peer (a global rank)
                peer = getattr(ops[0], "peer", None)
                attrs = {
                    **attrs_of(kwargs),
                    "peer": None if peer is None else int(peer),
                    "bytes": _size([getattr(op, "tensor", None) for op in ops]),
                }
                self._queued.append((kind, attrs))
            return result

        return instruction

    def _commit(self, fn):
        """CommitP2P: launches the queued batch and waits for all of it, so every transfer in it gets
        the commit's span. The first recv (else send) is open while it blocks (what a hang finding
        sees); the rest are emitted with its marks."""

        def instruction(engine, **kwargs):
            queued = self._queued
            if not (queued and self._training and registry.active):
                return fn(engine, **kwargs)
            self._queued = []
            first = next((i for i, (kind, _) in enumerate(queued) if kind == SpanKind.RECV), 0)
            kind, attrs = queued.pop(first)
            with registry.span(kind, **attrs) as span:
                result = fn(engine, **kwargs)
            if span is not None:
                for other_kind, other in queued:
                    registry.emit_span(other_kind, span.start, span.end, **other)
            return result

        return instruction

    def _optimizer_step(self, step_fn):
        """OptimizerStep as optimizer spans around, not over, gradient clipping (see module docstring),
        after the check before the optimizer step."""

        def instruction(engine, **kwargs):
            fn = step_fn
            if self._training and self.step_check is not None:
                if not self._checked():  # a re-run is due: no update from this pass
                    engine.zero_grad()
                    engine.optimizer.zero_grad()
                    return None
                if self.verdict is not None and not self.verdict.applied:
                    fn = _overflowing(step_fn)
            if not (self._training and registry.active):
                return fn(engine, **kwargs)
            clock = registry.clock
            start = clock.mark()
            self._clip = []
            result = fn(engine, **kwargs)
            end = clock.mark()
            edges = [start, *self._clip, end] if len(self._clip) == 2 else [start, end]
            for begin, finish in zip(edges[::2], edges[1::2]):
                registry.emit_span(SpanKind.OPTIMIZER, begin, finish, stage=self.pp_rank)
            return result

        return instruction

    def _clipping(self, clip):
        def clip_fp32_gradients(*args, **kwargs):
            marks = self._clip
            if registry.active:
                marks.append(registry.clock.mark())
            try:
                return clip(*args, **kwargs)
            finally:
                if marks:
                    marks.append(registry.clock.mark())

        return clip_fp32_gradients

    def _marking(self, call, *, training: bool):
        """train_batch runs with its instructions timed, and again on the same microbatches when the check
        asks for a re-run; eval_batch untimed, in one eval span (not a training step: the goodput ledger's
        eval, not bubble)."""

        def once(*args, **kwargs):
            self._training = training
            self._counts.clear()
            self._queued = []
            try:
                if training:
                    return call(*args, **kwargs)
                with registry.span(SpanKind.EVAL, stage=self.pp_rank):
                    return call(*args, **kwargs)
            finally:
                self._training = False

        def batch(data_iter=None):
            if self.step_check is None:
                return once(data_iter)
            engine = self.engine
            source = data_iter if data_iter is not None else getattr(engine, "data_iterator", None)
            drawn = _Drawn(source) if source is not None else None
            result = once(drawn)
            if self.step_check.rerun_due:
                self._rerunning = True
                try:
                    result = once(iter(drawn.items) if drawn is not None else None)
                finally:
                    self._rerunning = False
            if drawn is not None:
                engine.set_dataiterator(source)  # the user's (or the engine's own) iterator, moved on once
            return result

        return batch if training else once

    def _checked(self) -> bool:
        """The check at this pass's OptimizerStep; False when the step must be run again first."""
        assert self.step_check is not None
        loss = None
        total = getattr(self.engine, "total_loss", None)
        if self._reports_loss and total is not None and hasattr(total, "detach"):
            loss = float(total.detach().double()) / self.engine.gradient_accumulation_steps()
        reading = torch_grads.reading(loss, torch_grads.grads_of(self.engine.module.parameters()))
        if self._rerunning:
            verdict = self.step_check.again(reading)
        else:
            step = self.step + 1
            first = self.step_check.first(step, reading, batch=step + self.data_offset)
            if first is None:
                return False
            verdict = first
        self.verdict = verdict
        self._note(verdict)
        return True

    def _saving(self, save):
        def save_checkpoint(*args, **kwargs):
            with registry.span(SpanKind.CHECKPOINT, stage=self.pp_rank):
                result = save(*args, **kwargs)
            self.checkpoint_saved(self.engine.global_steps)
            return result

        return save_checkpoint

    # ------------------------------------------------------------------ the run
    def run_context(self, **extra):
        """A collector RunContext for this rank, with DeepSpeed's own coordinates and rank order (its
        topology's axes, outermost first: PipeModelDataParallelTopology's pipe, data, model is the
        order "tp-dp-pp"). `extra`: RunContext fields (tokens_per_step, local_gpu, hostname)."""
        import torch.distributed as dist

        from parwatch.collector import RunContext

        grid = self.engine.grid
        tp, dp = grid.get_slice_parallel_world_size(), grid.data_parallel_size
        try:
            return RunContext(
                run_id=self.run_id,
                rank=dist.get_rank(),
                world_size=dist.get_world_size(),
                tp=tp,
                pp=self.pp,
                dp=dp,
                tp_rank=grid.get_slice_parallel_rank(),
                stage=self.pp_rank,
                dp_rank=grid.get_data_parallel_id(),
                schedule=self.schedule,
                microbatches=self.microbatches,
                chunks=2 if self.dualpipev else 1,
                order=topology_order(grid._topo),
                **extra,
            )
        except ValueError as err:
            raise IntegrationError(f"DeepSpeed's topology: {err}") from None

    def action_order(self) -> dict:
        """Every stage's compute actions (pipeline_sim format), for `pipeline_sim.bubble_causes`."""
        if self.dualpipev:
            return dualpipev_schedule_order(self.pp, self.microbatches)
        return train_schedule_order(self.pp, self.microbatches)

    def start(self, step: int | None = None, data_offset: int = 0) -> int:
        """The run's first boundary, on every rank; `step`: where training resumes (default: the
        engine's global_steps, 0 on a fresh run, the loaded step after `engine.load_checkpoint`);
        `data_offset`: the batches rollbacks skipped before it (saved with the checkpoint)."""
        step = self.engine.global_steps if step is None else step
        config = {
            "schedule": self.schedule,
            "framework": "deepspeed",
            "pp": self.pp,
            "microbatches": self.microbatches,
            "chunks": 2 if self.dualpipev else 1,
        }
        return self.begin(step, config, self.action_order(), data_offset=data_offset)

    def step_done(self, loss: float | None = None, last: bool = False) -> int:
        """Call after each `engine.train_batch`, on every rank: the step boundary, then any directive.

        loss: default, the batch's mean loss the engine computed (reported by the loss stage: the
        last, or DualPipeV's rank 0).
        Returns the step training continues from: the step just finished, or the loaded one.
        last: True after the run's last step (the last steps are then judged before it ends: settle).
        """
        if loss is None and self._reports_loss and self.engine.agg_train_loss is not None:
            loss = float(self.engine.agg_train_loss)
        return self.boundary_step(loss, last)

    def _load_from_dir(self, step: int | None) -> int:
        """The newest `global_step<N>` checkpoint at or before `step` (None: the newest), loaded by
        the engine; its step."""
        assert self.checkpoint_dir is not None
        steps = (
            sorted(int(m.group(1)) for m in map(_TAG.match, os.listdir(self.checkpoint_dir)) if m)
            if os.path.isdir(self.checkpoint_dir)
            else []
        )
        target = max((s for s in steps if step is None or s <= step), default=None)
        if target is None:
            raise FileNotFoundError(f"no global_step<N> checkpoint at or before step {step} in {self.checkpoint_dir}")
        path, _ = self.engine.load_checkpoint(self.checkpoint_dir, tag=f"global_step{target}")
        if path is None:
            raise FileNotFoundError(f"deepspeed could not load global_step{target} from {self.checkpoint_dir}")
        return int(self.engine.global_steps)


watch = DeepSpeedWatch


class _Drawn:
    """An iterator that keeps what the engine draws from it: the microbatches of one train_batch, to run
    again for a re-run."""

    def __init__(self, source) -> None:
        self.source = source
        self.items: list = []

    def __iter__(self):
        return self

    def __next__(self):
        item = next(self.source)
        self.items.append(item)
        return item


def _overflowing(fn):
    """OptimizerStep with the update withheld the way DeepSpeed withholds one on an fp16 overflow: the
    optimizer's step does nothing and it reports `overflow`, so the engine zeroes the gradients, counts
    the step in `skipped_steps`, does not step the learning-rate schedule, and moves `global_steps` on."""

    def instruction(engine, **kwargs):
        optimizer = engine.optimizer
        saved = {k: optimizer.__dict__[k] for k in ("step", "overflow") if k in optimizer.__dict__}
        optimizer.step = lambda *args, **kw: None
        optimizer.overflow = True
        try:
            return fn(engine, **kwargs)
        finally:
            for k in ("step", "overflow"):
                if k in saved:
                    setattr(optimizer, k, saved[k])
                else:
                    optimizer.__dict__.pop(k, None)

    return instruction


_PAYLOAD = {  # where each transfer's tensors are once it is done (deepspeed.runtime.pipe.engine)
    "SendActivation": lambda engine, buffer: engine.pipe_buffers["outputs"][buffer],
    "RecvActivation": lambda engine, buffer: engine.pipe_buffers["inputs"][buffer],
    "SendGrad": lambda engine, buffer: _grads(engine.pipe_buffers["inputs"][buffer]),
    "RecvGrad": lambda engine, buffer: engine.grad_layer,
}


def _grads(inputs):
    if isinstance(inputs, tuple | list):
        return [t.grad for t in inputs if getattr(t, "grad", None) is not None]
    return inputs.grad


def _nbytes(payload, engine, kwargs: dict) -> int:
    """Bytes of the tensors `payload` finds; 0 when it finds none (a byte count never stops a run)."""
    try:
        return _size(payload(engine, kwargs.get("buffer_id")))
    except (AttributeError, IndexError, KeyError, TypeError):
        return 0


def _size(value) -> int:
    if isinstance(value, tuple | list):
        return sum(_size(v) for v in value)
    return int(value.nbytes) if hasattr(value, "nbytes") else 0


TOPOLOGY_ROLES = {"pipe": GroupRole.PP, "data": GroupRole.DP, "model": GroupRole.TP}
"""DeepSpeed's topology axis names -> parwatch's dimensions."""


def topology_order(topology) -> str:
    """The rank order (parwatch.rank_layout) of a DeepSpeed ProcessTopology: row-major, its axes outermost first."""
    axes = list(zip(topology.get_axis_names(), topology.dims))
    other = [f"{name} ({size})" for name, size in axes if name not in TOPOLOGY_ROLES and size > 1]
    if other:
        raise IntegrationError(
            f"DeepSpeed topology axes {', '.join(other)}: parwatch places a rank by pipe, data and model only"
        )
    try:
        return order_of_axes((TOPOLOGY_ROLES[name], size) for name, size in axes if name in TOPOLOGY_ROLES)
    except LayoutError as err:
        raise IntegrationError(f"DeepSpeed's topology: {err}") from None


def _is_dualpipev(engine) -> bool:
    try:
        from deepspeed.runtime.pipe.dualpipev import DualPipeVEngine
    except ImportError:  # a deepspeed without DualPipeV (before 0.19.8)
        return False
    return isinstance(engine, DualPipeVEngine)


def _global_rank(engine, stage: int) -> int | None:
    """The global rank of `stage` in this rank's pipeline (None past either end)."""
    if not 0 <= stage < engine.num_stages:
        return None
    return int(engine.grid.stage_to_global(stage_id=stage))
