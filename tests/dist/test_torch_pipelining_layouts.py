"""PipelineWatch.run_context in worlds larger than the pipeline: TP x PP and DP x PP on 4 gloo ranks.

The pipeline groups are {0, 2} and {1, 3} throughout. Read as TP x PP in parwatch's order (TP
innermost) rank r is tp_rank r % 2 of stage r // 2; read as a ("pp", "dp") DeviceMesh it is
dp_rank r % 2 of the same stage, an order parwatch's default layout would misplace (it derives
stage r % 2 for dp=2), which run_context must refuse rather than guess. One run with the mesh's
context then checks the boundary (the world group by default) sees every rank of every stage.
"""

from __future__ import annotations

import pytest

from tests.distutil import run_ranks

pytestmark = [pytest.mark.dist, pytest.mark.timeout(120)]


def layouts_body(rank: int, world_size: int) -> dict:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    from parwatch.collector import Collector, attach
    from parwatch.integrations.torch_pipelining import IntegrationError, PipelineWatch

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    pp_group = mesh["pp"].get_group()
    stage_index = dist.get_rank(pp_group)
    torch.manual_seed(0)
    stage = PipelineStage(torch.nn.Linear(4, 4), stage_index, 2, torch.device("cpu"), group=pp_group)
    schedule = ScheduleGPipe(stage, 2, loss_fn=lambda out, target: ((out - target) ** 2).mean())
    watch = PipelineWatch(schedule, run_id="layouts")

    def coords(**layout):
        try:
            ctx = watch.run_context(**layout)
        except IntegrationError as exc:
            return str(exc)
        return [ctx.world_size, ctx.tp, ctx.pp, ctx.dp, ctx.tp_rank, ctx.stage, ctx.dp_rank]

    out = {
        "none": coords(),
        "tp": coords(tp=2),
        "mesh": coords(mesh=mesh),
        "dp_default_order": coords(dp=2),
        "dp_given": coords(dp=2, dp_rank=rank % 2),
    }
    collector = attach(Collector(watch.run_context(mesh=mesh)))
    step = watch.start()
    x, y = torch.randn(4, 4), torch.randn(4, 4)
    while step < 3:
        schedule.step(x, target=y) if stage_index == 0 else schedule.step(target=y)
        step = watch.step_done()
    view = collector.last_summary.get("global")
    out["view"] = None if view is None else [(s["stage"], s["ranks"]) for s in view["stages"]]
    out["summary"] = [collector.last_summary[k] for k in ("tp_rank", "stage", "dp_rank")]
    watch.close()
    collector.close()
    return out


def test_run_context_takes_tp_or_dp_layouts_and_a_mesh():
    out = run_ranks(layouts_body, 4, timeout=100)
    for rank, o in enumerate(out):
        assert "tp*pp*dp = 1*2*1" in o["none"] and "mesh=" in o["none"]
        assert o["tp"] == [4, 2, 2, 1, rank % 2, rank // 2, 0]
        assert o["mesh"] == [4, 1, 2, 2, 0, rank // 2, rank % 2]
        assert o["dp_given"] == o["mesh"]
        if rank in (1, 2):  # the default order puts them at the other stage
            assert f"stage {rank // 2} of its pipeline group" in o["dp_default_order"], o
            assert "dp_rank=" in o["dp_default_order"]
        else:
            assert o["dp_default_order"] == o["mesh"]
        assert o["summary"] == [0, rank // 2, rank % 2]
    assert out[0]["view"] == [(0, 2), (1, 2)]  # both replicas of both stages reached rank 0's view
