"""The compute order DeepSpeed's pipeline schedules run, per stage, as `pipeline_sim` actions, read from
DeepSpeed's own schedule classes (deepspeed.runtime.pipe.schedule): TrainSchedule (1F1B) and
DualPipeVSchedule (two stages per rank, in a V). The integration (parwatch.integrations.deepspeed)
replays them for the bubble's theory and causes.
"""

from __future__ import annotations

from parwatch import pipeline_sim


def train_schedule_order(pp: int, microbatches: int) -> dict[int, list[pipeline_sim.Action]]:
    """`{stage: [Action, ...]}`: the forwards and backwards DeepSpeed's TrainSchedule runs on
    every stage, in its order (read from DeepSpeed's schedule class itself)."""
    from deepspeed.runtime.pipe import schedule as ds_schedule

    order: dict[int, list[pipeline_sim.Action]] = {}
    for stage in range(pp):
        counts = {pipeline_sim.F: 0, pipeline_sim.B: 0}
        actions = order[stage] = []
        sched = ds_schedule.TrainSchedule(micro_batches=microbatches, stages=pp, stage_id=stage)
        for cmds in sched.steps():
            for cmd in cmds:
                kind = {ds_schedule.ForwardPass: pipeline_sim.F, ds_schedule.BackwardPass: pipeline_sim.B}.get(
                    type(cmd)
                )
                if kind is not None:  # each stage runs both in microbatch order
                    actions.append(pipeline_sim.Action(stage, kind, counts[kind]))
                    counts[kind] += 1
    return order


def dualpipev_schedule_order(pp: int, microbatches: int) -> dict[int, list]:
    """`{stage: [Action or Overlap, ...]}`: the forwards and backwards DeepSpeed's DualPipeVSchedule
    runs on every rank, in its order (read from the schedule class itself), on virtual stages r
    (phase 0) and 2p-1-r (phase 1).

    A compute's send is only queued; it leaves at the next CommitP2P, which may come after a later
    compute (rank 0 at p=2 runs its third phase-0 forward, commits, runs its first phase-1 forward,
    and only then queues both sends). The computes up to each commit that sends are kept as one
    `pipeline_sim.Overlap`, whose results the replay hands on when the block ends."""
    from deepspeed.runtime.pipe import schedule as ds

    computes = {ds.ForwardPass: pipeline_sim.F, ds.BackwardPass: pipeline_sim.B}
    sent = {ds.SendActivation: pipeline_sim.F, ds.SendGrad: pipeline_sim.B}  # the compute whose result it sends
    order: dict[int, list] = {}
    for stage in range(pp):
        actions: list[pipeline_sim.Action] = []
        index: dict[tuple[str, int], int] = {}  # (F or B, buffer) -> its place in `actions`
        cuts: list[int] = []  # after these computes a commit sends
        queued: list[int] = []
        sched = ds.DualPipeVSchedule(micro_batches=microbatches, stages=pp, stage_id=stage)
        for cmds in sched.steps():
            for cmd in cmds:
                kind = computes.get(type(cmd))
                if kind is not None:
                    index[kind, cmd.buffer_id] = len(actions)
                    actions.append(
                        pipeline_sim.Action(
                            vstage(stage, pp, cmd.phase), kind, cmd.buffer_id - cmd.phase * microbatches
                        )
                    )
                elif type(cmd) in sent:
                    queued.append(index[sent[type(cmd)], cmd.buffer_id])
                elif type(cmd) is ds.CommitP2P and queued:
                    if cuts and min(queued) <= cuts[-1]:  # blocks cannot say when it leaves
                        raise ValueError(
                            f"stage {stage}: {actions[min(queued)]} leaves after a later block's results; "
                            "this DualPipeVSchedule cannot be replayed as blocks"
                        )
                    cuts.append(len(actions) - 1)
                    queued = []
        bounds = [0, *(c + 1 for c in cuts if c + 1 < len(actions)), len(actions)]
        groups = [actions[a:b] for a, b in zip(bounds, bounds[1:]) if b > a]
        order[stage] = [g[0] if len(g) == 1 else pipeline_sim.Overlap(g) for g in groups]
    return order


def vstage(stage: int, pp: int, phase: int) -> int:
    """The virtual stage a DualPipeV rank runs in `phase`: the V's way out (0), or back (1)."""
    return stage if phase == 0 else 2 * pp - 1 - stage
