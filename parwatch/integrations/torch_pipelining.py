"""Watch a `torch.distributed.pipelining` schedule with parwatch: a few lines of user code.

    from parwatch.collector import Collector, attach
    from parwatch.integrations.torch_pipelining import PipelineWatch

    schedule = ScheduleInterleaved1F1B(stages, n_microbatches=8, loss_fn=loss_fn)
    watch = PipelineWatch(schedule, run_id=run_id, load_checkpoint=my_load)  # spans + boundary
    attach(Collector(watch.run_context(), log_path="run/summaries.jsonl"))
    step = watch.start()
    while step < steps:
        x, y = batch(step + 1 + watch.data_offset)               # rollbacks may skip batches

        def forward_backward():                                  # the step, as before
            optimizer.zero_grad()
            schedule.step(x, target=y)

        forward_backward()
        watch.optimizer_step(optimizer, rerun=forward_backward)  # the check; then optimizer.step(), or not
        step = watch.step_done()                                 # boundary; may pause or roll back
    watch.close()

What it emits, per stage (this rank's pipeline position), chunk (index among this rank's
stages) and microbatch: forward, backward (or backward_input and backward_weight where the
schedule splits them), loss (torch computes it outside the stage's forward), send/recv (see
`_p2p`), gradient reduction/scaling after the last backward (dp_sync: not bubble), the
optimizer step, and one step-boundary all-reduce per step. Every schedule class of
torch.distributed.pipelining is supported (see SCHEDULE_NAMES), and torch's runtime running
actions loaded from a CSV (`_PipelineScheduleRuntime`, named "custom").

Before the optimizer step, `optimizer_step` runs the check (parwatch.contract.step_check): every
rank's loss and gradient finiteness in one small all-reduce; a bad step is re-run through `rerun`,
then applied (transient) or skipped (its gradients zeroed), and the third skip in a window pauses the
run at `step_done`. Directives from the sidecar arrive through the boundary: pause holds the run in
heartbeat boundaries until resume; rollback calls `load_checkpoint(step) -> loaded_step` (step None:
the newest checkpoint; or `load_checkpoint(step, skip_batches)`) on every rank and continues from the
step it returns, `data_offset` batches further on.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from parwatch import pipeline_sim
from parwatch.contract import StepBoundary, StepPolicy, TorchAllReduce
from parwatch.integrations import _p2p
from parwatch.integrations._p2p import P2PHookMissing  # noqa: F401  (part of this module's API)
from parwatch.integrations._stage_spans import (
    SCHEDULE_METHODS,
    STAGE_METHODS,
    Patches,
    instrument_loss,
    instrument_stage,
)
from parwatch.integrations._steploop import IntegrationError, StepLoop, step_check_for
from parwatch.rank_layout import DEFAULT_ORDER, LayoutError, RankLayout, order_of_axes
from parwatch.vocabulary import SCHEDULES, GroupRole

SCHEDULE_NAMES = {s.torch_class: s.name for s in SCHEDULES.values() if s.torch_class is not None}
"""torch class name -> parwatch's schedule name (parwatch.vocabulary's registry)."""

RUNTIME_CLASS = "_PipelineScheduleRuntime"
CUSTOM = "custom"
"""The name of a schedule torch's runtime runs from actions it was given (`_load_csv`, as torchtitan's
pipeline_parallel_schedule_csv does): no closed form; its theory is the replay of those actions."""


def mesh_role(name: str) -> str:
    """The parwatch dimension a DeviceMesh dimension is: "pp", "tp", or DP for every other name
    (dp_replicate, dp_shard, cp, ...: ranks holding the same shard of the model)."""
    return name if name in (GroupRole.PP, GroupRole.TP) else GroupRole.DP


def schedule_name(schedule) -> str:
    """parwatch's name for a torch schedule object (a subclass maps to its torch base class)."""
    mro = [cls.__name__ for cls in type(schedule).__mro__]
    for name in mro:
        if name in SCHEDULE_NAMES:
            return SCHEDULE_NAMES[name]
    if RUNTIME_CLASS in mro:
        return CUSTOM
    raise IntegrationError(
        f"{type(schedule).__name__} is not one of torch's schedule classes "
        f"({', '.join([*SCHEDULE_NAMES, RUNTIME_CLASS])}); parwatch cannot name its bubble theory"
    )


def stages_of(schedule) -> list:
    """The schedule's stages on this rank, ordered by stage index."""
    stages = getattr(schedule, "_stages", None)
    if stages is None:
        stage = getattr(schedule, "_stage", None)
        stages = [stage] if stage is not None else None
    if not stages:
        raise IntegrationError(
            f"{type(schedule).__name__} has neither _stages nor _stage: not a "
            "torch.distributed.pipelining schedule this integration knows"
        )
    return sorted(stages, key=lambda s: s.stage_index)


def action_order(schedule) -> dict:
    """`{rank: [pipeline_sim.Action or Overlap, ...]}`: the compute actions every rank of this
    schedule runs, an OVERLAP_F_B block (DualPipeV) kept whole as torch runs it.

    Multi-stage schedules run their `pipeline_order`; the one-stage ones (GPipe, 1F1B) run
    what their `_step_microbatches` codes, which `pipeline_sim.single_stage_order` mirrors."""
    name = schedule_name(schedule)
    if name != CUSTOM and SCHEDULES[name].one_chunk:
        stage = stages_of(schedule)[0]
        return pipeline_sim.single_stage_order(name, stage.num_stages, schedule._n_microbatches)
    order = schedule.pipeline_order
    if name == CUSTOM and not order:  # loaded with its communication ("compute_comms"): that list runs
        order = getattr(schedule, "pipeline_order_with_comms", None)
    if not order:
        raise IntegrationError(
            f"{type(schedule).__name__} has no actions yet: load them (schedule._load_csv(...)) before the watch starts"
        )
    return pipeline_sim.blocks(order)


class PipelineWatch(StepLoop):
    """Instruments one schedule on this rank and drives its step boundary. See the module docstring.

    schedule: a torch.distributed.pipelining schedule, built as usual (the process group is up).
    run_id: the run's id, the same on every rank (directives name it).
    load_checkpoint: `f(step or None) -> loaded step`, called on every rank for a rollback
        directive (None asks for the newest checkpoint). It must load the same step on every
        rank or raise on every rank; without it rollbacks are reported failed (no_checkpoint).
    p2p: time send/recv (hooks torch's private `_batch_p2p`/`_wait_batch_p2p`).
    pause_poll_s: seconds between heartbeat boundaries while paused.
    boundary_group / device: where the boundary all-reduce (and the check's) runs (default: the world
        group, on the first stage's device).
    check: the check before the optimizer step: True (the default StepPolicy), a StepPolicy, or False."""

    def __init__(
        self,
        schedule,
        *,
        run_id: str,
        load_checkpoint: Callable[..., int] | None = None,
        p2p: bool = True,
        pause_poll_s: float = 0.2,
        boundary_group=None,
        device=None,
        check: bool | StepPolicy = True,
    ) -> None:
        import torch.distributed as dist

        if not run_id:
            raise IntegrationError(
                "PipelineWatch: run_id must be the run's id (the same non-empty string on every rank)"
            )
        self.schedule = schedule
        self.run_id = run_id
        self.name = schedule_name(schedule)
        self.stages = stages_of(schedule)
        for stage in self.stages:
            missing = [m for m in STAGE_METHODS if not callable(getattr(stage, m, None))]
            if missing:
                raise IntegrationError(
                    f"stage {stage.stage_index} ({type(stage).__name__}) lacks "
                    f"{', '.join(missing)}: this torch's PipelineStage differs from "
                    "the torch 2.13 API parwatch wraps"
                )
        missing = [m for m in SCHEDULE_METHODS if not callable(getattr(schedule, m, None))]
        if missing:
            raise IntegrationError(
                f"{type(schedule).__name__} lacks {', '.join(missing)}: cannot time the loss on this torch version"
            )
        first = self.stages[0]
        self.pp_rank = first.group_rank
        self.pp = first.group_size
        self.microbatches = schedule._n_microbatches
        self.chunks = len(self.stages)
        self.is_last = any(s.is_last for s in self.stages)
        self.p2p = p2p
        all_reduce = TorchAllReduce(boundary_group, device if device is not None else getattr(first, "device", None))
        boundary = StepBoundary(
            dist.get_rank(boundary_group),
            dist.get_world_size(boundary_group),
            run_id,
            all_reduce,
            reports_loss=self.is_last,
        )
        super().__init__(
            pp_rank=self.pp_rank,
            boundary=boundary,
            load_checkpoint=load_checkpoint,
            pause_poll_s=pause_poll_s,
            step_check=step_check_for(boundary, all_reduce, check),
        )
        self._patches = Patches()
        self._losses: list = []
        self.attached = False
        self.attach()

    # ------------------------------------------------------------------ instrumentation
    def attach(self) -> PipelineWatch:
        """Instrument the schedule (the constructor does; after `detach`, again)."""
        if self.attached:
            return self
        if not self._patches.redo():  # the first time: build the wrappers (later attaches reuse them)
            attrs = {}
            for chunk, stage in enumerate(self.stages):
                base = {"stage": self.pp_rank, "chunk": chunk, "vstage": stage.stage_index}
                attrs[stage.stage_index] = base
                instrument_stage(stage, base, self._patches, p2p=self.p2p)
            instrument_loss(self.schedule, attrs, self._patches, self._losses)
        if self.p2p:
            try:
                _p2p.install()
            except Exception:
                self._patches.undo()
                raise
        self.attached = True
        return self

    def detach(self) -> None:
        """Take every wrapper off: the schedule runs exactly as torch ships it (boundaries still work)."""
        if not self.attached:
            return
        self._patches.undo()
        if self.p2p:
            _p2p.uninstall()
        self.attached = False

    def run_context(
        self,
        *,
        tp: int | None = None,
        dp: int | None = None,
        tp_rank: int | None = None,
        dp_rank: int | None = None,
        mesh=None,
        order: str | None = None,
        **extra,
    ):
        """A collector RunContext for this rank; its stage is this rank's place in the pipeline group.

        A pipeline-only world needs no argument. With tensor or data parallelism give the layout:
        `mesh=`, the DeviceMesh the run was built from, with a "pp" dimension, whose "tp" dimension
        is TP and whose other dimensions (dp_replicate, dp_shard, cp, ...) are folded into DP (they
        must be neighbours); its dimension order is the run's rank order. Or `tp=` and/or `dp=` (one
        given: the other is what the world leaves) with `order=`, the rank order fastest dimension
        first (parwatch.rank_layout; default "tp-pp-dp": TP ranks adjacent, then PP stages, DP
        outermost). The coordinates follow from the order; `tp_rank=` / `dp_rank=`, if given, must
        agree with it, and so must the pipeline group's ranks. `extra` goes to RunContext.for_rank
        (tokens_per_step, local_gpu, hostname)."""
        import torch.distributed as dist

        from parwatch.collector import RunContext

        world, rank = dist.get_world_size(), dist.get_rank()
        if mesh is not None:
            if order is not None:
                raise IntegrationError("run_context: give mesh= or order=, not both (a mesh has its own order)")
            tp, dp, tp_rank, dp_rank, order = self._mesh_layout(mesh)
        if tp is None and dp is None:  # a pipeline-only world
            tp = dp = 1
        elif tp is None or dp is None:  # the other degree is what the world leaves
            known = self.pp * (tp or dp or 1)
            other = world // known if world % known == 0 else 0
            tp, dp = (tp, other) if dp is None else (other, dp)
        assert tp is not None and dp is not None
        if tp * self.pp * dp != world:
            raise IntegrationError(
                f"the world has {world} ranks but tp*pp*dp = {tp}*{self.pp}*{dp}: give run_context "
                "the run's layout (tp=, dp=, or mesh=)"
            )
        try:
            layout = RankLayout(tp, self.pp, dp, order or DEFAULT_ORDER)
        except LayoutError as err:
            raise IntegrationError(f"run_context: {err}") from None
        at = layout.coords(rank)
        given = (
            tp_rank if tp_rank is not None else at.tp_rank,
            self.pp_rank,
            dp_rank if dp_rank is not None else at.dp_rank,
        )
        wrong = layout.mismatch(rank, given)
        if wrong is not None:
            raise IntegrationError(
                f"{wrong} (stage {self.pp_rank} is its place in the schedule's pipeline group): pass the "
                "order the run's ranks were laid out in (order=, fastest first), or mesh="
            )
        pipeline = dist.get_process_group_ranks(getattr(self.stages[0], "group", None) or dist.group.WORLD)
        if list(pipeline) != list(layout.group(GroupRole.PP, at)):
            raise IntegrationError(
                f"the schedule's pipeline group of rank {rank} is {list(pipeline)}, but {layout} makes it "
                f"{list(layout.group(GroupRole.PP, at))}: pass the run's order= or mesh="
            )
        return RunContext.for_rank(
            self.run_id,
            rank,
            tp=tp,
            pp=self.pp,
            dp=dp,
            order=layout.order,
            schedule=self.name,
            microbatches=self.microbatches,
            chunks=self.chunks,
            **extra,
        )

    def _mesh_layout(self, mesh) -> tuple[int, int, int, int, str]:
        """(tp, dp, tp_rank, dp_rank, order) of this rank in a DeviceMesh with a "pp" dimension."""
        names = tuple(mesh.mesh_dim_names or ())
        if GroupRole.PP not in names:
            raise IntegrationError(f"mesh dimensions {names}: run_context(mesh=) needs one named 'pp'")
        sizes, here = tuple(mesh.shape), mesh.get_coordinate()
        if here is None:
            raise IntegrationError("this rank is not in the mesh given to run_context")
        dims = dict(zip(names, zip(sizes, here)))
        if dims[GroupRole.PP] != (self.pp, self.pp_rank):
            raise IntegrationError(
                f"the mesh's pp dimension (size {dims['pp'][0]}, this rank {dims['pp'][1]}) is not the "
                f"schedule's pipeline group (size {self.pp}, this rank {self.pp_rank})"
            )
        tp, tp_rank = dims.get(GroupRole.TP, (1, 0))
        dp, dp_rank = 1, 0
        for name, (size, index) in dims.items():
            if name not in (GroupRole.PP, GroupRole.TP):
                dp, dp_rank = dp * size, dp_rank * size + index
        try:
            order = order_of_axes((mesh_role(name), size) for name, size in zip(names, sizes))
        except LayoutError as err:
            raise IntegrationError(f"mesh dimensions {names}: {err}") from None
        return tp, dp, tp_rank, dp_rank, order

    def action_order(self) -> dict:
        """Every rank's compute actions (pipeline_sim format), for `pipeline_sim.bubble_causes`."""
        return action_order(self.schedule)

    # ------------------------------------------------------------------ the step loop
    def start(self, step: int = 0, data_offset: int = 0) -> int:
        """The run's first boundary, on every rank; `step`: where training resumes (0: fresh);
        `data_offset`: the batches rollbacks skipped before it (saved with the checkpoint)."""
        config = {"schedule": self.name, "pp": self.pp, "microbatches": self.microbatches, "chunks": self.chunks}
        return self.begin(step, config, self.action_order(), data_offset=data_offset)

    def optimizer_step(self, optimizer, *args, rerun=None, **kwargs):
        """The check before the optimizer step, then `optimizer.step()` in an optimizer span; a step the
        check skips zeroes the gradients instead (returns None). `rerun`: runs the step's forward and
        backward again on the same microbatches from zeroed gradients (zero_grad, then schedule.step):
        without it a bad step is skipped untriaged."""
        params = [p for group in optimizer.param_groups for p in group["params"]]

        def again() -> None:
            self._losses.clear()  # the re-run's microbatch losses are the step's
            assert rerun is not None
            rerun()

        verdict = self.check_step(params, self._step_loss, again if rerun is not None else None)
        if verdict is not None and not verdict.applied:
            optimizer.zero_grad()
            return None
        return super().optimizer_step(optimizer, *args, **kwargs)

    def _step_loss(self) -> float | None:
        return _mean_loss(self._losses) if self._losses else None

    def step_done(self, loss: float | None = None, last: bool = False) -> int:
        """Call after each optimizer step, on every rank: the step boundary, then any directive.

        loss: this rank's loss for the step; default: the mean of the microbatch losses the
        schedule computed here (last stage only). Returns the step training continues from:
        the step just finished, or the loaded one after a rollback.
        last: True after the run's last step (the last steps are then judged before it ends: settle).
        """
        if loss is None and self._losses:
            loss = _mean_loss(self._losses)
        self._losses.clear()
        return self.boundary_step(loss, last)


def _mean_loss(losses: list) -> float:
    """The float64 mean of the microbatch losses (each one detached element, see instrument_loss)."""
    if losses[0].device.type == "cpu":
        # Read each as a float and sum exactly: right after a step (cold caches) this is cheaper than
        # stack/float64/mean (docs/benchmarks.md). The same value for losses within a few decades of
        # each other; beyond that this one is the exactly rounded sum (tested).
        return math.fsum(map(float, losses)) / len(losses)
    import torch

    # On a device each read is a copy to the host: one stack, one read.
    return float(torch.stack(losses).to(torch.float64).mean())
