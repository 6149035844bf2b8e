"""One short call on a GPU machine: NCCL, CUDA-event timing and real NVML, with the usual tables.

    python benchmarks/gpu_check.py [--out DIR]     # on the device machine: --out "$OUT"

What it exercises:
1. NVML through parwatch's sampler (utilisation, memory, power, SM clock, temperature).
2. The CUDA-event clock: a timed matmul read from events after the device finished,
   against the host clock around a synchronize.
3. The trainer over NCCL with the collector attached, as large a TP x PP layout as
   the GPUs allow (4+: TP2xPP2, 2-3: PP2, 1: one rank; NCCL refuses two ranks on one
   device), real compute: bubble per stage against theory, collectives, NVML per step.
4. Collector overhead: the same run with the collector off and on, alternated.
5. The torch.distributed.pipelining integration on one device: one rank holding both stages of an
   interleaved 1F1B schedule (v=2, m=8; one rank because NCCL refuses two on one device), real
   matmul compute, steps alternately watched and not: on/off, the spans resolved from CUDA events,
   the collector's per-step compute and bubble. Local stages hand tensors over without send/recv,
   so this exercises the compute, loss and boundary hooks, not the p2p ones.
6. The DeepSpeed integration on one device: a one-stage PipelineModule (m=8), steps alternately
   watched and not (instruction spans on the CUDA-event clock, no added synchronization).
7. The Megatron-Core integration on one device: the example's GPTModel (local layer spec, pp=1),
   steps alternately watched and not.
8. The goodput ledger against the profiler (issue 23): one rank's busy share of ten steps, the
   ledger's against the CUDA kernels in a torch.profiler trace (tests/trace_check.py, no parwatch
   code), and HTA's temporal breakdown of the trace where HTA is installed.
9. Clean exit on the device (issue 26): short watched trainer runs over NCCL, each must exit 0; the
   boundary's device tensor is released by NCCL's watchdog thread, not gloo's worker, so the
   teardown order is checked there too.
10. A device hang's evidence (issue 44): one rank over NCCL against a real sidecar, a kernel that never
   ends in its forward (torch.cuda._sleep, `--inject hang:rank=0,step=5,where=kernel`): the finding must
   say kind `device` (the collector's CUDA event queries, no sync), and its evidence bundle must hold the
   rank's stacks and a Flight Recorder dump with NCCL entries (parwatch's launcher set its buffer size).
   Without CUDA the same run is a host hang on gloo (kind `host`, a gloo dump): the wiring is checked.
Without CUDA it runs the same steps on gloo/CPU so the script itself can be checked
anywhere; the tables then say so.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import machine, megatron_train_step, print_table, run_trainer  # noqa: E402


def nvml_check() -> dict:
    from parwatch.collector.nvml import NvmlSampler

    sampler = NvmlSampler(0, interval_s=0.1)
    sampler.open()
    if not sampler.up:
        print("NVML: not available on this machine (nvml_up 0)")
        return {"nvml_up": 0}
    sample = sampler.sample_once()
    sampler.close()
    print_table(["NVML field", "value"], [[k, v] for k, v in sample.items()])
    return {"nvml_up": 1, "sample": sample}


def cuda_clock_check() -> dict:
    import torch

    from parwatch.collector.cuda_clock import CudaClock

    clock = CudaClock(0)
    a = torch.randn(4096, 4096, device="cuda")
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    start = clock.mark()
    for _ in range(20):
        a = a @ a
        a = a / a.norm()
    end = clock.mark()
    torch.cuda.synchronize()
    host = time.perf_counter() - t0
    events = clock.seconds(start, end)
    print_table(["timer", "seconds"], [["CUDA events (20 matmuls 4096^2)", events], ["host around synchronize", host]])
    return {"cuda_event_seconds": events, "host_seconds": host}


def _alternate(title: str, watch, collector, train_step, cuda: bool, pairs: int) -> dict:
    """Steps alternately watched and not in one process, each pair's order flipped, the first two
    pairs dropped as warm-up: the collector's view of its last step and the on/off ratios.
    `train_step(on)` runs one training step (with its optimizer step: in a span when on); the
    step boundary is the watch's. Closes the watch and the collector."""
    import torch

    from parwatch.collector import attach, detach

    times: dict = {"on": [], "off": []}
    step = 0
    for pair in range(pairs):
        for mode in ("off", "on") if pair % 2 == 0 else ("on", "off"):
            on = mode == "on"
            if on:
                watch.attach()
                attach(collector)
                watch.start(step)
            if cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            train_step(on)
            step = watch.step_done() if on else step + 1
            if cuda:
                torch.cuda.synchronize()
            if pair >= 2:
                times[mode].append(time.perf_counter() - t0)
            if on:
                watch.detach()
                detach(collector)
    summary = collector.last_summary
    result = {
        "clock": type(collector.clock).__name__,
        "unresolved_spans": collector.unresolved_spans,
        "errors": collector.errors,
        "summaries": collector.summaries,
        **{
            k: getattr(summary, k, None)
            for k in ("step_seconds", "compute_seconds", "bubble_ratio", "overhead_seconds")
        },
    }
    watch.close()
    collector.close()
    off, on_s = statistics.median(times["off"]), statistics.median(times["on"])
    paired = statistics.median(a / b for a, b in zip(times["on"], times["off"]))
    result.update(
        median_off_s=off, median_on_s=on_s, ratio=on_s / off, paired_ratio=paired, steps_per_mode=len(times["on"])
    )
    print(f"\n{title}")
    print_table(["measure", "value"], [[k, v] for k, v in result.items()])
    return result


def _one_rank(cuda: bool) -> None:
    """A world of one on this device (NCCL refuses two ranks on one GPU)."""
    import torch.distributed as dist

    from tests.distutil import free_port

    dist.init_process_group(
        "nccl" if cuda else "gloo", rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{free_port()}"
    )


def _interleaved_one_rank(cuda: bool):
    """One rank holding both stages of an interleaved 1F1B schedule (v=2, m=8), real matmuls: (the
    PipelineWatch, detached; train_step(on), one step with its optimizer step, in a span when on).
    Call after _one_rank."""
    import torch
    from torch.distributed.pipelining import PipelineStage, ScheduleInterleaved1F1B

    from parwatch.integrations.torch_pipelining import PipelineWatch

    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    hidden, rows, layers = (4096, 2048, 4) if cuda else (64, 16, 2)  # on an H200 ~1 ms a layer forward
    torch.manual_seed(0)
    stages = [
        PipelineStage(
            torch.nn.Sequential(*(torch.nn.Linear(hidden, hidden) for _ in range(layers))).to(device), i, 2, device
        )
        for i in range(2)
    ]
    schedule = ScheduleInterleaved1F1B(stages, n_microbatches=8, loss_fn=lambda out, y: ((out - y) ** 2).mean())
    params = [p for st in stages for p in st.submod.parameters()]
    optimizer = torch.optim.SGD(params, lr=1e-4)
    watch = PipelineWatch(schedule, run_id="gpu-check")
    watch.detach()
    x, y = torch.randn(8 * rows, hidden, device=device), torch.randn(8 * rows, hidden, device=device)

    def train_step(on: bool) -> None:
        optimizer.zero_grad()
        schedule.step(x, target=y)
        if on:
            watch.optimizer_step(optimizer)
        else:
            optimizer.step()

    return watch, train_step


def pipelining_check(cuda: bool, pairs: int = 20) -> dict:
    """Section 5: PipelineWatch + Collector on one rank, alternating watched and unwatched steps."""
    import torch.distributed as dist

    from parwatch.collector import Collector

    _one_rank(cuda)
    try:
        watch, train_step = _interleaved_one_rank(cuda)
        collector = Collector(watch.run_context(local_gpu=0 if cuda else None))
        title = f"torch pipelining integration, one rank, interleaved 1F1B v=2 m=8 on {'cuda' if cuda else 'cpu'}"
        return _alternate(title, watch, collector, train_step, cuda, pairs)
    finally:
        dist.destroy_process_group()


def ledger_trace_check(cuda: bool, steps: int = 14, first: int = 4) -> dict:
    """Section 8 (issue 23): the goodput ledger against a profiler trace of the same steps, read by
    tests/trace_check.py (none of parwatch's code): the rank's busy share of the window between the
    markers after steps `first` and `steps`, the ledger's (productive + optimizer) against the trace's
    (CUDA: the union of its kernels, collectives' left out; CPU: of its host ops). The bar on CPU, at
    wide layers, is 2 percentage points (tests/dist/test_ledger_profiler.py); this small CPU fallback
    only exercises the path. With HTA installed (`holistictraceanalysis`), its temporal breakdown of
    the same trace too."""
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile, record_function

    from parwatch.collector import Collector, attach, detach
    from tests import trace_check

    _one_rank(cuda)
    out = tempfile.mkdtemp(prefix="parwatch-ledger-trace-")
    try:
        watch, train_step = _interleaved_one_rank(cuda)
        summaries = os.path.join(out, "summaries.jsonl")
        collector = Collector(watch.run_context(local_gpu=0 if cuda else None), log_path=summaries)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        with profile(activities=activities) as prof:
            watch.attach()
            attach(collector)
            step = watch.start(0)
            while step < steps:
                train_step(True)
                with record_function(f"{trace_check.BEFORE}{step + 1}"):
                    pass
                step = watch.step_done()
                with record_function(f"{trace_check.MARK}{step}"):
                    pass
            watch.detach()
            detach(collector)
        watch.close()
        collector.close()
        trace = os.path.join(out, "trace-rank0.json")
        prof.export_chrome_trace(trace)
    finally:
        dist.destroy_process_group()
    with open(summaries) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    trace_window, trace_busy = trace_check.trace_busy(trace, first, steps, "kernel" if cuda else "cpu_op")
    ledger_window, ledger_busy, delta = trace_check.ledger_busy(rows, 0, first, steps)
    shortest, longest = trace_check.window_bounds(trace, first, steps)
    result = {
        "busy": "kernels" if cuda else "host ops",
        "trace_window_s": trace_window,
        "ledger_window_s": ledger_window,
        "trace_window_bounds_s": [shortest, longest],
        "trace_busy_share": trace_busy / trace_window,
        "ledger_busy_share": ledger_busy / ledger_window,
        "gap_pp": 100 * (ledger_busy / ledger_window - trace_busy / trace_window),
        "ledger_seconds": {c: v for c, v in sorted(delta.items()) if v > 0},
        "trace_dir": out,
    }
    try:
        from hta.trace_analysis import TraceAnalysis

        breakdown = TraceAnalysis(trace_dir=out).get_temporal_breakdown(visualize=False)
        result["hta"] = breakdown.to_dict(orient="records")
    except ImportError:
        result["hta"] = "not installed (pip install holistictraceanalysis)"
    except Exception as exc:  # HTA reads kernel traces: a CPU trace has none
        result["hta"] = f"{type(exc).__name__}: {exc}"
    print(f"\ngoodput ledger against the profiler's trace, steps {first}-{steps}, one rank ({result['busy']})")
    print_table(["measure", "value"], [[k, v] for k, v in result.items() if k != "ledger_seconds"])
    return result


def deepspeed_check(cuda: bool, pairs: int = 20) -> dict:
    """Section 6: the DeepSpeed integration on one rank (a one-stage PipelineModule: NCCL refuses two
    ranks on one GPU), alternating watched and unwatched steps in one process."""
    import deepspeed
    import torch
    from deepspeed.pipe import PipelineModule

    from parwatch.collector import Collector
    from parwatch.integrations import deepspeed as pw
    from tests.distutil import free_port

    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    deepspeed.init_distributed(dist_backend="nccl" if cuda else "gloo", verbose=False)
    try:
        # On CPU ~30 ms a step: a 10 ms stall of the host stays a small share of it (not so at 64 x 16).
        hidden, rows, layers = (4096, 2048, 4) if cuda else (512, 128, 2)
        torch.manual_seed(0)
        module = PipelineModule(
            layers=[torch.nn.Linear(hidden, hidden) for _ in range(layers)],
            num_stages=1,
            loss_fn=lambda out, y: ((out - y) ** 2).mean(),
            partition_method="uniform",
        )
        config = {"train_micro_batch_size_per_gpu": rows, "gradient_accumulation_steps": 8, "steps_per_print": 10**9}
        engine, *_ = deepspeed.initialize(
            model=module, optimizer=torch.optim.SGD(module.parameters(), lr=1e-4), config=config
        )
        batch = (torch.randn(rows, hidden, device=engine.device), torch.randn(rows, hidden, device=engine.device))
        data = iter(lambda: batch, None)
        watch = pw.watch(engine, run_id="gpu-check-deepspeed")
        watch.detach()
        collector = Collector(watch.run_context(local_gpu=0 if cuda else None))
        title = f"DeepSpeed integration, one rank, one stage, m=8 on {engine.device}"
        return _alternate(title, watch, collector, lambda on: engine.train_batch(data), cuda, pairs)
    finally:
        torch.distributed.destroy_process_group()


def megatron_check(cuda: bool, pairs: int = 20) -> dict:
    """Section 7: the Megatron-Core integration on one rank (pp=1: NCCL refuses two ranks on one GPU),
    the example's GPTModel (local layer spec) with real compute, steps alternately watched and not."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from parwatch.collector import Collector
    from parwatch.integrations import megatron as pw_megatron
    from tests.distutil import load_example

    example = load_example("megatron_gpt")
    if not cuda:
        import megatron_cpu  # next to the example, on the path it added

        megatron_cpu.install()
    sizes = ["--hidden", "1024", "--seq", "512", "--vocab", "8192"] if cuda else ["--hidden", "64", "--seq", "16"]
    args = example.parse_args(["--tp", "1", "--pp", "1", "--microbatches", "8", "--synthetic-ms", "0,0", *sizes])
    _one_rank(cuda)
    try:
        if cuda:
            torch.cuda.set_device(0)
        ps.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
        config = example.megatron_config(args)
        device = torch.device("cuda", 0) if cuda else torch.device("cpu")
        model = example.build_model(args, config)[0].to(device)
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
        data = [{k: t.to(device) for k, t in mb.items()} for mb in example.microbatches(args, 1)]
        watch = pw_megatron.watch([model], config, run_id="gpu-check-megatron", microbatches=args.microbatches)
        watch.detach()
        collector = Collector(watch.run_context(local_gpu=0 if cuda else None))

        train_step = megatron_train_step(example, watch, model, optimizer, data, args)
        title = f"Megatron-Core integration, one rank, GPTModel (local spec), m=8 on {device}"
        return _alternate(title, watch, collector, train_step, cuda, pairs)
    finally:
        ps.destroy_model_parallel()
        dist.destroy_process_group()


def clean_exit_check(args: list[str], runs: int = 10) -> dict:
    """`runs` short watched runs; their exit codes (each must be 0) and the stderr of any that was not."""
    import subprocess

    codes, failures = [], []
    small = [
        "--layers",
        "2",
        "--hidden",
        "64",
        "--heads",
        "4",
        "--vocab",
        "64",
        "--seq-len",
        "16",
        "--steps",
        "6",
        "--microbatches",
        "4",
        "--parwatch",
        "on",
    ]
    for _ in range(runs):
        proc = subprocess.run(
            [sys.executable, "-m", "parwatch", "train", *args, *small],
            capture_output=True,
            text=True,
            cwd=Path(__file__).resolve().parent.parent,
            timeout=300,
        )
        codes.append(proc.returncode)
        if proc.returncode != 0:
            failures.append(proc.stderr[-1500:])
    print(f"\nclean exit: {codes.count(0)} of {runs} watched runs exited 0 (codes {sorted(set(codes))})")
    return {"runs": runs, "exit_codes": codes, "failures": failures[:3]}


def layout(ngpus: int) -> list[str]:
    if ngpus >= 4:
        return ["--nproc", "4", "--tp", "2", "--pp", "2"]
    if ngpus >= 2:
        return ["--nproc", "2", "--pp", "2"]
    return ["--nproc", "1"]


def hang_evidence_check(cuda: bool) -> dict:
    """Section 10: a device hang named as the device's, with its stacks and Flight Recorder dump kept."""
    from tests.integration.e2e_util import decision_records, running_trainer, token_args, wait_until
    from tests.sidecar_process import running_sidecar

    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp)
        with running_sidecar(base / "state") as sidecar:
            with running_trainer(
                sidecar.control_url,
                base / "run",
                1000,
                "--backend",
                "nccl" if cuda else "gloo",
                "--layers",
                "2",
                "--hidden",
                "256",
                *token_args(sidecar),
                "--inject",
                "hang:rank=0,step=5,where=kernel",
                nproc=1,
            ):
                [record] = wait_until(
                    lambda: [d for d in decision_records(base / "state") if d["rule"] in ("hang", "rank-gone")][:1],
                    "a hang finding",
                    180,
                )
                bundle = base / "state" / record["evidence"]["bundle"]
                wait_until(lambda: (bundle / "rank0.json").exists(), "rank 0's evidence", 30)
                evidence = json.loads((bundle / "rank0.json").read_text())
                fr = evidence["flight_recorder"]
                entries = []
                if fr.get("path") and Path(fr["path"]).exists():
                    import pickle

                    entries = pickle.loads(Path(fr["path"]).read_bytes()).get("entries", [])
    names = sorted({e.get("profiling_name", "") for e in entries})[:8]
    out = {
        "rule": record["rule"],
        "kind": record["evidence"].get("kind"),
        "device_kind": evidence["activity"].get("device_kind"),
        "culprit_kind": (record["evidence"].get("culprit") or {}).get("kind"),
        "stack_lines": evidence["stacks"].count("\n"),
        "flight_recorder_entries": len(entries),
        "flight_recorder_ops": names,
        "expected_kind": "device" if cuda else "host",
    }
    out["ok"] = out["kind"] == out["expected_kind"] and len(entries) > 0 and out["stack_lines"] > 0
    print("\nhang evidence (issue 44): " + ", ".join(f"{k}={v}" for k, v in out.items()))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument(
        "--peak-flops",
        type=float,
        default=None,
        help="device peak FLOP/s at fp32 for MFU (default: known for H100/H200, else none)",
    )
    a = ap.parse_args()
    import torch

    cuda = torch.cuda.is_available()
    ngpus = torch.cuda.device_count() if cuda else 0
    result: dict = {"machine": machine(), "cuda": cuda, "gpus": ngpus}
    print(f"CUDA: {cuda}, GPUs: {ngpus}, NCCL: {torch.cuda.nccl.version() if cuda else None}")
    result["nvml"] = nvml_check()
    if cuda:
        result["cuda_clock"] = cuda_clock_check()
    model = [
        "--layers",
        "8",
        "--hidden",
        "1024" if cuda else "64",
        "--heads",
        "16" if cuda else "4",
        "--seq-len",
        "512" if cuda else "32",
        "--micro-batch-size",
        "4",
        "--vocab",
        "8192" if cuda else "64",
        "--microbatches",
        "8",
        "--schedule",
        "1f1b",
        "--steps",
        str(a.steps),
    ]
    args = layout(ngpus) + model + ["--backend", "nccl" if cuda else "gloo"]
    peak = a.peak_flops
    if peak is None and cuda and any(n in torch.cuda.get_device_name(0) for n in ("H100", "H200")):
        peak = 6.7e13  # fp32 (non-tensor-core) dense peak of an SXM H100/H200; the trainer runs fp32
    if peak:
        args += ["--parwatch-peak-flops", str(peak)]
    result["peak_flops"] = peak
    times = {"off": [], "on": []}
    summary_on = None
    for r in range(a.rounds):
        for mode in ("off", "on") if r % 2 == 0 else ("on", "off"):
            with tempfile.TemporaryDirectory() as log_dir:
                # --parwatch off with a log directory is a usage error: an endpoint or log implies on.
                watch = ["--parwatch-log", log_dir] if mode == "on" else ["--parwatch", "off"]
                s = run_trainer(args + watch, timeout=300)
                times[mode] += s["step_seconds"][3:]
                if mode == "on":
                    summary_on = s
                    lines = (Path(log_dir) / "summaries.jsonl").read_text().splitlines()
                    result["last_summaries"] = [json.loads(x) for x in lines[-len(s["stages"]) * 2 :]]
    print("\nbubble per stage (collector on, real compute)")
    print_table(
        ["stage", "measured", "theory", "compute s", "idle s"],
        [
            [st["stage"], st["bubble_ratio"], st["bubble_theoretical_ratio"], st["compute_seconds"], st["idle_seconds"]]
            for st in summary_on["stages"]
        ],
    )
    print("\ncollectives seen by rank 0")
    print_table(
        ["op", "group", "count", "mean s", "busbw B/s"],
        [
            [c["op"], c["group"], c["count"], c["mean_seconds"], c["busbw_bytes_per_second"]]
            for c in summary_on["collectives_rank0"]
        ],
    )
    mfu = [x.get("model_flops_utilization_ratio") for x in result["last_summaries"]]
    if any(m is not None for m in mfu):
        print(f"\nMFU per rank (last summaries, peak {peak:g} FLOP/s): {mfu}")
    gpu = [x.get("gpu") for x in result["last_summaries"] if x.get("gpu")]
    if gpu:
        print("\nNVML per step (last summaries)")
        print_table(
            ["rank gpu", "util", "mem used B", "power W", "SM Hz", "temp C"],
            [
                [
                    g.get("index"),
                    g.get("utilization_ratio"),
                    g.get("memory_used_bytes"),
                    g.get("power_watts"),
                    g.get("sm_clock_hertz"),
                    g.get("temperature_celsius"),
                ]
                for g in gpu
            ],
        )
    off, on = statistics.median(times["off"]), statistics.median(times["on"])
    print(f"\ncollector overhead: median step off {off:.4f} s, on {on:.4f} s, ratio {on / off:.4f}")
    result.update(
        stages=summary_on["stages"],
        collectives=summary_on["collectives_rank0"],
        overhead={"median_off_s": off, "median_on_s": on, "ratio": on / off},
    )
    result["torch_pipelining"] = pipelining_check(cuda)
    try:
        result["deepspeed"] = deepspeed_check(cuda)
    except ImportError as exc:  # the extra is not installed on this machine: say so, run the rest
        result["deepspeed"] = {"skipped": f"{exc} (pip install parwatch[deepspeed])"}
    try:
        result["megatron"] = megatron_check(cuda)
    except ImportError as exc:
        result["megatron"] = {"skipped": f"{exc} (pip install parwatch[megatron])"}
    result["ledger_trace"] = ledger_trace_check(cuda)
    result["clean_exit"] = clean_exit_check(layout(ngpus) + ["--backend", "nccl" if cuda else "gloo"])
    result["hang_evidence"] = hang_evidence_check(cuda)
    out = Path(a.out) / "gpu_check.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1, default=str))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
