"""What one hook costs on the training thread when it runs cold: CPU per call right after a sleep.

    python benchmarks/hook_cost.py [--calls 400] [--sleep-ms 5]

The integration's hooks run right after the training thread wakes (a compute's sleep on CPU, a
blocking receive), when the CPU's caches hold other work; there every Python call and object costs
5-10x its cost in a tight loop. Each measured call here follows a sleep; the cases are interleaved
round-robin in one process, so the machine's state hits all alike; the table gives the median
thread CPU (`time.thread_time_ns`) per call and what it adds over the bare call it wraps:

- a compute span: the bare stage method; `with registry.span(...)` around it (the generic contract
  path); the integration's wrapper (`_stage_spans._timed`);
- a send/recv span: the op builder, `_batch_p2p` and `_wait_batch_p2p` with torch's functions
  replaced by do-nothing ones, bare and wrapped;
- the boundary vector: a float64 tensor built from a list and read back, against
  `TorchAllReduce`'s reused array-backed tensor (filling and reading; the all-reduce itself is a
  1-rank gloo group's, in both);
- DeepSpeed's timed instruction (`DeepSpeedWatch._timed`) and Megatron-Core's forward_step hook
  (`_megatron_hooks.Hooks`), each around a do-nothing original, against the bare call;
- nothing: the two clock reads alone, what every row includes.

Each case also runs warm (no sleep before the call), in a second pass: the ratio of the two columns
is what waking up costs this machine's code, the hooks' and the trainer's alike.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import types

from common import ROOT, print_table, write_json

sys.path.insert(0, str(ROOT))


def cold(cases: dict, calls: int, sleep_s: float, reset) -> dict:
    out = {name: [] for name in cases}
    for i in range(calls):
        for name, call in cases.items():
            time.sleep(sleep_s)
            c0 = time.thread_time_ns()
            call(i)
            out[name].append(time.thread_time_ns() - c0)
        reset()
    return {name: statistics.median(v) / 1e3 for name, v in out.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=400, help="measured calls per case")
    ap.add_argument("--sleep-ms", type=float, default=5.0, help="sleep before each call (what makes it cold)")
    ap.add_argument("--out", default="benchmarks/results/hook_cost.json")
    a = ap.parse_args()

    import torch
    import torch.distributed as dist

    from parwatch.contract import Observer, SpanKind, TorchAllReduce, registry
    from parwatch.integrations import _p2p
    from parwatch.integrations import _stage_spans as spans

    class Sink(Observer):  # what the collector does per span: append
        def __init__(self):
            self.spans = []
            self.on_span = self.spans.append

    tensor = torch.ones(32)

    class Op:  # a P2POp's fields the wrappers read
        def __init__(self):
            self.tensor, self.peer = tensor, 1

    class Stage:
        stage_index = 0

        def forward_one_chunk(self, i, *a, **k):
            return None

        backward_one_chunk = backward_weight_one_chunk = forward_one_chunk

        def perform_reduce_grad(self, f, *a, **k):
            return None

        def get_fwd_send_ops(self, i):
            return [Op()]

        get_bwd_send_ops = get_fwd_recv_ops = get_bwd_recv_ops = get_fwd_send_ops

    def post(ops, desc=None):
        return [None]

    def wait(works):
        return None

    _p2p._originals.update(_batch_p2p=post, _wait_batch_p2p=wait)  # torch's, replaced: only the wrappers count
    bare, wrapped = Stage(), Stage()
    base = {"stage": 0, "chunk": 0, "vstage": 0}
    spans.instrument_stage(wrapped, base, spans.Patches(), p2p=True)
    sink = Sink()
    registry.register(sink)

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29500 + os.getpid() % 1000))
    dist.init_process_group("gloo", rank=0, world_size=1)
    values = [0.0] * 40
    reduce = TorchAllReduce()

    def tensor_from_list(i):
        vec = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(vec, async_op=True).wait()
        vec.tolist()

    def generic_span(i):
        with registry.span(SpanKind.FORWARD, **base, microbatch=i % 8):
            bare.forward_one_chunk(i % 8)

    # DeepSpeed's timed instruction and Megatron-Core's forward_step hook, around do-nothing originals
    # (neither framework is imported: the wrappers are parwatch's own code).
    from parwatch.integrations._megatron_hooks import Hooks
    from parwatch.integrations.deepspeed import DeepSpeedWatch

    def instruction(engine, **kwargs):
        return None

    watch = types.SimpleNamespace(_training=True, _counts={})  # what the instruction wrapper reads of its watch
    ds_timed = DeepSpeedWatch._timed(
        watch, instruction, SpanKind.FORWARD, DeepSpeedWatch._counted(watch, base, "ForwardPass")
    )
    out = torch.ones(1)

    def forward_step(step_func, data, model, n, input_tensor, **kwargs):
        return out, 1

    hooks = Hooks({}, 0, 2)
    mg_forward = hooks._forward_step(forward_step)

    def reset():
        sink.spans.clear()
        watch._counts.clear()

    cases = {
        "compute: bare call": lambda i: bare.forward_one_chunk(i % 8),
        "compute: with registry.span": generic_span,
        "compute: integration wrapper": lambda i: wrapped.forward_one_chunk(i % 8),
        "send: bare builder, post, wait": lambda i: wait(post(bare.get_fwd_send_ops(i % 8))),
        "send: integration wrappers": lambda i: _p2p._wait_batch_p2p(_p2p._batch_p2p(wrapped.get_fwd_send_ops(i % 8))),
        "deepspeed instruction: bare": lambda i: instruction(None, buffer_id=i % 8),
        "deepspeed instruction: integration wrapper": lambda i: ds_timed(None, buffer_id=i % 8),
        "megatron forward_step: bare": lambda i: forward_step(None, None, None, 8, None, current_microbatch=i % 8),
        "megatron forward_step: integration hook": lambda i: mg_forward(
            None, None, None, 8, None, current_microbatch=i % 8
        ),
        "boundary vector: tensor from a list": tensor_from_list,
        "boundary vector: TorchAllReduce": lambda i: reduce(values)(),
        "nothing (the clock reads alone)": lambda i: None,
    }
    try:
        medians = cold(cases, a.calls, a.sleep_ms / 1000, reset)
        warm = cold(cases, a.calls, 0.0, reset)
    finally:
        dist.destroy_process_group()
    pairs = {
        "compute: with registry.span": "compute: bare call",
        "compute: integration wrapper": "compute: bare call",
        "send: integration wrappers": "send: bare builder, post, wait",
        "deepspeed instruction: integration wrapper": "deepspeed instruction: bare",
        "megatron forward_step: integration hook": "megatron forward_step: bare",
    }
    added = {name: medians[name] - medians[bare] for name, bare in pairs.items()}
    added_warm = {name: warm[name] - warm[bare] for name, bare in pairs.items()}
    rows = [[name, value, added.get(name, ""), warm[name], added_warm.get(name, "")] for name, value in medians.items()]
    print_table(
        [
            "case",
            f"thread CPU per call after a {a.sleep_ms:g} ms sleep (us, median)",
            "added over bare (us)",
            "warm: no sleep (us)",
            "added, warm (us)",
        ],
        rows,
    )
    write_json(
        a.out,
        {
            "calls": a.calls,
            "sleep_ms": a.sleep_ms,
            "median_us": medians,
            "added_us": added,
            "warm_median_us": warm,
            "warm_added_us": added_warm,
        },
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
