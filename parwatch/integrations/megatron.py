"""Watch a Megatron-Core pipeline (TP x PP, 1F1B or interleaved 1F1B) with parwatch.

    from parwatch.collector import Collector, attach
    from parwatch.integrations import megatron as pw_megatron

    model = [...]                                       # this rank's model chunks, as usual
    watch = pw_megatron.watch(model, config, run_id=run_id, microbatches=m, load_checkpoint=my_load)
    attach(Collector(watch.run_context(), log_path="run/summaries.jsonl"))
    forward_backward = get_forward_backward_func()      # after watch(): the watched schedule

    def train_step(data):                               # one step's forward and backward, as before
        optimizer.zero_grad()
        forward_backward(forward_step_func=..., data_iterator=iter(data), model=model, num_microbatches=m, ...)

    step = watch.start()
    while step < steps:
        data = batches(step + 1 + watch.data_offset)    # rollbacks may skip batches
        train_step(data)
        watch.optimizer_step(optimizer, rerun=partial(train_step, data))   # the check; then optimizer.step()
        step = watch.step_done()                        # boundary; may pause or roll back
    watch.close()

What it emits, per pipeline stage (this rank's pipeline rank), chunk (model chunk on this rank),
vstage (chunk * pp + stage) and microbatch: forward, loss (Megatron computes it inside
forward_step: the forward span ends where the loss starts), backward, send and recv (activation
and grad, with peer, bytes and seq), the tensor-parallel collectives Megatron issues through
tensor_parallel.mappings (nested in the compute spans), Megatron's gradient finalisation (dp_sync: not bubble), the
optimizer step, and one step-boundary all-reduce per step. The theory is Megatron's own order
(`action_order`, replayed by the collector with the measured times).

How: while attached, Megatron's own module attributes are replaced by timing wrappers
(`_megatron_hooks`: schedules.forward_step, forward_step_calc_loss, backward_step, the
forward_backward_* functions, p2p_communication._batched_p2p_ops and _p2p_ops,
tensor_parallel.mappings' collective helpers); `detach()`
restores them. No torch attribute is touched, and importing parwatch never imports Megatron.

The rank layout (tp, pp, dp and Megatron's rank order, its default "tp-cp-ep-dp-pp" included) is read
off parallel_state (`megatron_layout`) and rides the RunContext, so DP > 1 is watched in the order
Megatron laid the ranks out in.

Before the optimizer step, `optimizer_step` runs the check (parwatch.contract.step_check): every
rank's loss and gradient finiteness (Megatron's `main_grad` buffers where its DDP keeps them) in one
small all-reduce; a bad step is re-run through `rerun`, then applied or skipped, and the third skip in
a window pauses the run at `step_done`. Directives from the sidecar arrive through the boundary: pause
holds the run in heartbeat boundaries until resume; rollback calls `load_checkpoint(step) ->
loaded_step` (step None: the newest checkpoint; or `load_checkpoint(step, skip_batches)`) on every
rank and continues from the step it returns, `data_offset` batches further on.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from parwatch.contract import SpanKind, StepBoundary, StepPolicy, TorchAllReduce, registry
from parwatch.integrations._megatron_hooks import Hooks, mean_loss
from parwatch.integrations._megatron_order import megatron_order
from parwatch.integrations._stage_spans import Patches
from parwatch.integrations._steploop import IntegrationError, StepLoop, step_check_for
from parwatch.rank_layout import Coords, LayoutError, RankLayout, order_of_groups
from parwatch.vocabulary import GroupRole, ScheduleName

__all__ = ["IntegrationError", "MegatronWatch", "action_order", "megatron_layout", "watch"]


def megatron_layout() -> RankLayout:
    """This run's rank layout, read off Megatron's parallel_state (initialised): its order from how this
    rank's TP, PP and DP groups are spaced (megatron-core 0.16 keeps no order string; its default,
    "tp-cp-ep-dp-pp", gives "tp-dp-pp"), checked against the ranks and groups Megatron reports.
    Context parallelism (cp > 1) is refused: parwatch places a rank by tp, pp and dp alone. Expert
    parallelism splits DP for the experts only: the dense layout, which this reads, is unchanged."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    cp = ps.get_context_parallel_world_size()
    if cp > 1:
        raise IntegrationError(
            f"context parallelism (cp={cp}) is not watched: parwatch places a rank by its tp, pp and dp "
            "coordinates only (cp=1 and any ep work)"
        )
    rank = dist.get_rank()
    tp = ps.get_tensor_model_parallel_world_size()
    pp = ps.get_pipeline_model_parallel_world_size()
    dp = ps.get_data_parallel_world_size()
    if dist.get_world_size() != tp * pp * dp:
        raise IntegrationError(
            f"world size {dist.get_world_size()} is not tp*pp*dp = {tp}*{pp}*{dp} in Megatron's parallel_state"
        )
    reported = Coords(
        ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank(), ps.get_data_parallel_rank()
    )
    members: dict[str, list[int]] = {
        GroupRole.TP: dist.get_process_group_ranks(ps.get_tensor_model_parallel_group()),
        GroupRole.PP: dist.get_process_group_ranks(ps.get_pipeline_model_parallel_group()),
        GroupRole.DP: dist.get_process_group_ranks(ps.get_data_parallel_group()),
    }
    try:
        layout = RankLayout(tp, pp, dp, order_of_groups(members))
    except LayoutError as err:
        raise IntegrationError(f"Megatron's process groups of rank {rank}: {err}") from None
    wrong = layout.mismatch(rank, reported)
    if wrong is not None:
        raise IntegrationError(f"Megatron's parallel_state: {wrong}, read off its process groups")
    for role, ranks in members.items():
        expected = list(layout.group(role, reported))
        if list(ranks) != expected:
            raise IntegrationError(
                f"Megatron's {role} group of rank {rank} is {list(ranks)}, but its other groups lay the run "
                f"out as {layout}, which makes it {expected}"
            )
    return layout


def action_order(pp: int, microbatches: int, chunks: int = 1, group_size: int | None = None) -> dict:
    """`{rank: [pipeline_sim.Action, ...]}`: the compute order Megatron's schedule runs on every
    pipeline rank (virtual stage = chunk * pp + pp_rank); `group_size`:
    microbatch_group_size_per_vp_stage (interleaved only; default pp)."""
    return megatron_order(pp, microbatches, chunks, group_size)


class MegatronWatch(StepLoop):
    """The step loop's handle for this rank's Megatron model chunks, instrumented: spans on Megatron's
    schedule, boundaries and directives.

    model_chunks: the module, or list of modules (one per virtual pipeline stage), handed to
        Megatron's forward_backward function; parallel_state must be initialised.
    config: the model's TransformerConfig / ModelParallelConfig (reads
        microbatch_group_size_per_vp_stage; its finalize_model_grads_func is timed as dp_sync).
    run_id: the run's id, the same non-empty string on every rank (directives name it).
    microbatches: num_microbatches given to forward_backward each step (the theory needs it).
    load_checkpoint: `f(step or None) -> loaded step` for rollback directives, on every rank.
    p2p: time send/recv (wraps Megatron's p2p_communication functions).
    boundary_group / device: where the boundary all-reduce (and the check's) runs (default: the world
        group, on the device of the first chunk's parameters).
    check: the check before the optimizer step: True (the default StepPolicy), a StepPolicy, or False."""

    def __init__(
        self,
        model_chunks,
        config,
        *,
        run_id: str,
        microbatches: int,
        load_checkpoint: Callable[..., int] | None = None,
        p2p: bool = True,
        pause_poll_s: float = 0.2,
        boundary_group=None,
        device=None,
        check: bool | StepPolicy = True,
    ) -> None:
        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        if not run_id:
            raise IntegrationError("watch: run_id must be the run's id (the same non-empty string on every rank)")
        if not isinstance(microbatches, int) or microbatches < 1:
            raise IntegrationError(f"watch: microbatches={microbatches!r} must be the num_microbatches of each step")
        if not ps.model_parallel_is_initialized():
            raise IntegrationError("watch: call megatron.core.parallel_state.initialize_model_parallel first")
        chunks = list(model_chunks) if isinstance(model_chunks, Sequence) else [model_chunks]
        if not chunks:
            raise IntegrationError("watch: no model chunks")
        self.run_id = run_id
        self.config = config
        self.microbatches = microbatches
        self.chunks = len(chunks)
        self.layout = megatron_layout()
        """The run's rank layout (tp, pp, dp in Megatron's order), read off parallel_state."""
        self.tp, self.pp, self.dp = self.layout.tp, self.layout.pp, self.layout.dp
        self.tp_rank, pp_rank, self.dp_rank = self.layout.coords(dist.get_rank())
        vp = ps.get_virtual_pipeline_model_parallel_world_size()
        if (vp or 1) != self.chunks:
            raise IntegrationError(
                f"watch: {self.chunks} model chunks but virtual_pipeline_model_parallel_size={vp}: "
                "pass every chunk of this rank"
            )
        group = getattr(config, "microbatch_group_size_per_vp_stage", None)
        self.group_size = (group or self.pp) if self.chunks > 1 else None
        self.schedule = ScheduleName.INTERLEAVED_1F1B if self.chunks > 1 else ScheduleName.ONE_F_ONE_B
        self.is_last = pp_rank == self.pp - 1
        param = next((p for c in chunks for p in c.parameters()), None)
        if device is None and param is not None and param.device.type != "cpu":
            device = param.device
        self.device = device
        all_reduce = TorchAllReduce(boundary_group, device)
        boundary = StepBoundary(
            dist.get_rank(boundary_group),
            dist.get_world_size(boundary_group),
            run_id,
            all_reduce,
            reports_loss=self.is_last and self.tp_rank == 0,
        )
        super().__init__(
            pp_rank=pp_rank,
            boundary=boundary,
            load_checkpoint=load_checkpoint,
            pause_poll_s=pause_poll_s,
            step_check=step_check_for(boundary, all_reduce, check),
        )
        tp_group = ps.get_tensor_model_parallel_group() if self.tp > 1 else None
        self._hooks = Hooks(
            {id(c): i for i, c in enumerate(chunks)},
            pp_rank,
            self.pp,
            p2p=p2p,
            tp_group=tp_group,
            tp_ranks=dist.get_process_group_ranks(tp_group) if tp_group is not None else (),
        )
        self._patches = Patches()
        self.attached = False
        self.attach()

    # ------------------------------------------------------------------ instrumentation
    def attach(self) -> MegatronWatch:
        """Put the wrappers in Megatron's modules (the constructor does; after `detach`, again)."""
        if self.attached:
            return self
        try:
            self._hooks.install()
        except RuntimeError as exc:
            raise IntegrationError(str(exc)) from exc
        except AttributeError as exc:
            raise IntegrationError(
                f"{exc}: parwatch wraps megatron-core 0.16's schedules and p2p functions; "
                "this version differs (watch with p2p=False if only the p2p functions are missing)"
            ) from exc
        finalize = getattr(self.config, "finalize_model_grads_func", None)
        if finalize is not None and not self._patches.redo():
            self._patches.set(
                self.config, "finalize_model_grads_func", _timed_finalize(finalize, self.pp_rank, self.dp)
            )
        self.attached = True
        return self

    def detach(self) -> None:
        """Restore Megatron's functions: it runs exactly as shipped (boundaries still work)."""
        if not self.attached:
            return
        self._hooks.uninstall()
        self._patches.undo()
        self.attached = False

    def run_context(self, **extra):
        """A collector RunContext for this rank: tp, pp, dp, their order and this rank's coordinates
        from Megatron's parallel_state (`megatron_layout`). `extra` goes to RunContext (tokens_per_step,
        local_gpu, hostname); local_gpu defaults to the CUDA device of the model's parameters (its
        clock: CUDA events)."""
        import torch.distributed as dist

        from parwatch.collector import RunContext

        if "local_gpu" not in extra and self.device is not None:
            import torch

            device = torch.device(self.device)
            if device.type == "cuda":
                extra["local_gpu"] = device.index if device.index is not None else torch.cuda.current_device()

        return RunContext.for_rank(
            self.run_id,
            dist.get_rank(),
            tp=self.tp,
            pp=self.pp,
            dp=self.dp,
            order=self.layout.order,
            schedule=self.schedule,
            microbatches=self.microbatches,
            chunks=self.chunks,
            **extra,
        )

    def action_order(self) -> dict:
        """Every pipeline rank's compute actions (pipeline_sim format): the bubble theory."""
        return action_order(self.pp, self.microbatches, self.chunks, self.group_size)

    # ------------------------------------------------------------------ the step loop
    def start(self, step: int = 0, data_offset: int = 0) -> int:
        """The run's first boundary, on every rank; `step`: where training resumes (0: fresh);
        `data_offset`: the batches rollbacks skipped before it (saved with the checkpoint)."""
        config = {
            "framework": "megatron-core",
            "schedule": str(self.schedule),
            "tp": self.tp,
            "pp": self.pp,
            "dp": self.dp,
            "order": self.layout.order,
            "microbatches": self.microbatches,
            "chunks": self.chunks,
            "microbatch_group_size_per_vp_stage": self.group_size,
        }
        return self.begin(step, config, self.action_order(), data_offset=data_offset)

    def optimizer_step(self, optimizer, *args, rerun=None, **kwargs):
        """The check before the optimizer step, then `optimizer.step()` in an optimizer span (its result:
        a Megatron optimizer's (update_successful, grad_norm, num_zeros_in_grad), whose own found-inf check
        may still skip an fp16 update). A step the check skips zeroes the gradients instead (returns None).
        `rerun`: runs the step's forward and backward again on the same microbatches from zeroed gradients
        (as the step does: zero_grad, zero_grad_buffer under Megatron's DDP, forward_backward): without it a
        bad step is skipped untriaged."""
        params = [p for group in optimizer.param_groups for p in group["params"]]

        def again() -> None:
            self._hooks.losses.clear()  # the re-run's microbatch losses are the step's
            assert rerun is not None
            rerun()

        verdict = self.check_step(params, lambda: mean_loss(self._hooks.losses), again if rerun is not None else None)
        if verdict is not None and not verdict.applied:
            optimizer.zero_grad()
            return None
        return super().optimizer_step(optimizer, *args, **kwargs)

    def step_done(self, loss: float | None = None, last: bool = False) -> int:
        """Call after each optimizer step, on every rank: the step boundary, then any directive.

        loss: this rank's loss for the step; default (last stage): the sum of the microbatch
        losses Megatron backpropagated, each divided by the microbatch count (the mean
        microbatch loss for a loss_func returning (loss, ...)). Returns the step training
        continues from: the one just finished, or the loaded one after a rollback.
        last: True after the run's last step (the last steps are then judged before it ends: settle).
        """
        if loss is None:
            loss = mean_loss(self._hooks.losses)
        self._hooks.losses.clear()
        return self.boundary_step(loss, last)


watch = MegatronWatch


def _timed_finalize(finalize, stage: int, dp: int):
    """Megatron's gradient finalisation (DP/embedding all-reduces, after the last backward) in a dp_sync span;
    with DP > 1 it names its group (its DP all-reduce waits for the other replicas: the hang analysis reads it)."""
    attrs = {"stage": stage, "op": "finalize_model_grads", **({"group": GroupRole.DP} if dp > 1 else {})}

    def finalize_model_grads(*args, **kwargs):
        with registry.span(SpanKind.DP_SYNC, **attrs):
            return finalize(*args, **kwargs)

    return finalize_model_grads
