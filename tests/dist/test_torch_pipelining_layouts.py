"""PipelineWatch.run_context in worlds larger than the pipeline: TP x PP and DP x PP on 4 gloo ranks.

The pipeline groups are {0, 2} and {1, 3} throughout. Read as TP x PP in parwatch's default order (TP
innermost) rank r is tp_rank r % 2 of stage r // 2; read as a ("pp", "dp") DeviceMesh, PP the outer
dimension, it is dp_rank r % 2 of the same stage: the order "tp-dp-pp", which run_context takes from
the mesh (or from order=). The default order would put rank 1 at stage 1: given dp=2 alone, or dp_rank=
that disagrees with it, run_context refuses, naming the mismatch, rather than guess. One run with the
mesh's context is then watched by a real sidecar: it takes every rank's summaries and activity, the
boundary (the world group by default) sees every rank of every stage.
"""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests import one_client
from tests.distutil import run_ranks
from tests.sidecar_process import running_sidecar

pytestmark = [pytest.mark.dist, pytest.mark.timeout(150)]


def layouts_body(rank: int, world_size: int, endpoint: str, token: str) -> dict:
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
        return [ctx.world_size, ctx.tp, ctx.pp, ctx.dp, ctx.tp_rank, ctx.stage, ctx.dp_rank, ctx.order]

    out = {
        "none": coords(),
        "tp": coords(tp=2),
        "mesh": coords(mesh=mesh),
        "dp_order": coords(dp=2, order="tp-cp-ep-dp-pp"),  # Megatron's way of writing it
        "dp_default_order": coords(dp=2),
        "dp_given": coords(dp=2, dp_rank=rank % 2),
        "pp_fastest": coords(tp=2, order="pp-tp"),  # stage r % 2: ranks 0 and 3 agree, their groups do not
    }
    collector = attach(Collector(watch.run_context(mesh=mesh), endpoint=endpoint, token=token))
    step = watch.start()
    x, y = torch.randn(4, 4), torch.randn(4, 4)
    while step < 3:
        schedule.step(x, target=y) if stage_index == 0 else schedule.step(target=y)
        step = watch.step_done()
    if rank == 0:  # the sidecar takes every rank's live activity (in the mesh's order) while they wait here
        out["rank_states"] = _rank_states_once_all_report(endpoint, token, world_size)
    dist.barrier()
    view = collector.last_summary.global_
    out["view"] = None if view is None else [(s.stage, s.ranks) for s in view.stages]
    out["summary"] = [getattr(collector.last_summary, k) for k in ("tp_rank", "stage", "dp_rank", "order")]
    watch.close()
    collector.close()
    return out


def _rank_states_once_all_report(endpoint: str, token: str, world: int, timeout: float = 30.0) -> dict:
    """The leader's rank states once `world` ranks run (polled; the last seen at the deadline)."""
    import time

    deadline = time.monotonic() + timeout
    while True:
        states = one_client.get(f"{endpoint}/v1/hang", headers={"Authorization": f"Bearer {token}"}, timeout=10).json()
        if states["rank_states"].get("running") == world or time.monotonic() > deadline:
            return states["rank_states"]
        time.sleep(0.1)


def test_run_context_takes_the_order_from_the_mesh_and_a_sidecar_watches_it(tmp_path):
    with running_sidecar(tmp_path / "state") as sidecar:
        out = run_ranks(layouts_body, 4, sidecar.control_url, sidecar.token, timeout=120)
        families = {
            f.name: f
            for f in text_string_to_metric_families(one_client.get(f"{sidecar.metrics_url}/metrics", timeout=10).text)
        }
    for rank, o in enumerate(out):
        assert "tp*pp*dp = 1*2*1" in o["none"] and "mesh=" in o["none"]
        assert o["tp"] == [4, 2, 2, 1, rank % 2, rank // 2, 0, "tp-pp-dp"]
        assert o["mesh"] == [4, 1, 2, 2, 0, rank // 2, rank % 2, "tp-dp-pp"]  # PP outer, DP inner
        assert o["dp_order"] == o["mesh"]
        for refused in (o["dp_default_order"], o["dp_given"]):  # the default order, which is not the run's
            if rank in (1, 2):  # it puts them at the other stage
                expected = f"but order 'tp-pp-dp' (fastest first) puts it at tp_rank 0, stage {rank % 2}, dp_rank"
            else:  # the right stage, but a pipeline of {r, r +- 1}, not the schedule's {r, r +- 2}
                expected = f"pipeline group of rank {rank} is {sorted({rank, rank ^ 2})}, but tp 1 x pp 2 x dp 2"
            assert expected in refused and "order=" in refused and "mesh=" in refused, refused
        if rank in (0, 3):  # the right stage, but the schedule's pipeline group is {r, r +- 2}, not the order's
            assert f"pipeline group of rank {rank} is {sorted({rank, rank ^ 2})}" in o["pp_fastest"], o["pp_fastest"]
        else:
            assert f"rank {rank} says tp_rank 0, stage 0" in o["pp_fastest"] or "stage 1" in o["pp_fastest"]
        assert o["summary"] == [0, rank // 2, rank % 2, "tp-dp-pp"]
    assert out[0]["view"] == [(0, 2), (1, 2)]  # both replicas of both stages reached rank 0's view
    assert out[0]["rank_states"] == {"running": 4}
    # The sidecar took every rank's summaries and activity, in the mesh's order: rank 1 is stage 0 there.
    series = {(int(s.labels["rank"]), int(s.labels["stage"])) for s in families["parwatch_stage_bubble_ratio"].samples}
    assert series == {(0, 0), (1, 0), (2, 1), (3, 1)}
    refused = families.get("parwatch_posts_refused")
    assert refused is None or sum(s.value for s in refused.samples if s.name.endswith("_total")) == 0
