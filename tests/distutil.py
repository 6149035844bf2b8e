"""Run a function on N real gloo ranks, each in its own process, under a hard timeout."""

from __future__ import annotations

import os
import sys
import traceback

import torch.multiprocessing as mp

from parwatch.ports import free_port  # below the ephemeral range
from tests.deadline import DeadlineExceeded

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load_example(name: str):
    """examples/<name>.py as a module (its `train()`, `parse_args()` ...), for tests and benchmarks."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"{name}_example", os.path.join(ROOT, "examples", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def installed(module: str) -> bool:
    """Whether `module` can be imported, without importing it: collection imports every test module on
    every xdist worker, and megatron.core's import costs each one ~5.5 s of CPU, deepspeed's ~1.5 s."""
    import importlib.util

    return importlib.util.find_spec(module) is not None


PRELOAD = ["torch", "torch.distributed", "torch._dynamo"]
"""What every rank imports (torch._dynamo: building the first optimizer does)."""


def _forkserver():
    """Ranks forked from one fork server per test session, which imported PRELOAD once (a process that
    never touches a device), not fresh interpreters that each import torch at every run_ranks (the
    saving: docs/benchmarks.md). The server's environment and directory are those it started with:
    _entry takes the caller's. The trainer's own launcher does the same (parwatch/trainer/launch.py)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def _entry(fn, rank, world_size, port, queue, args, env, cwd):
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        try:
            dist.init_process_group("gloo", rank=rank, world_size=world_size)
        except BaseException:  # the rendezvous, before fn: run_ranks starts the ranks again on another port
            queue.put((rank, INIT_FAILED, traceback.format_exc()))
        else:
            result = fn(rank, world_size, *args)
            queue.put((rank, "ok", result))
    except BaseException:  # report every failure, including assertion errors, to the parent
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    # The result is in the queue: skip the interpreter's teardown of torch (about 0.6 s a rank, which
    # run_ranks would wait for). The trainer's own ranks exit the normal way (test_clean_exit.py).
    queue.close()
    queue.join_thread()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


INIT_FAILED = "init-failed"
INIT_TRIES = 2
"""A gloo rendezvous that fails before fn runs (its port, picked free, taken by another test worker's ranks
in the moment between: 'connectFullMesh failed ... Connection closed by peer') is tried again on another
port, once. Nothing of fn has run: no figure or finding is re-run."""


def run_ranks(fn, world_size: int, *args, timeout: float = 120.0) -> list:
    """Run fn(rank, world_size, *args) on world_size gloo ranks; return results by rank.

    fn must be importable (module level). Raises AssertionError naming the failing rank
    with its traceback, or TimeoutError (after killing every rank) past `timeout` seconds.
    """
    failed = None
    for _ in range(INIT_TRIES):
        try:
            return _run_ranks_once(fn, world_size, args, timeout)
        except _RendezvousFailed as err:
            failed = err
    raise AssertionError(f"the gloo rendezvous failed {INIT_TRIES} times:\n{failed}")


class _RendezvousFailed(Exception):
    pass


def _run_ranks_once(fn, world_size: int, args: tuple, timeout: float) -> list:
    ctx = _forkserver()
    queue = ctx.Queue()
    port = free_port()
    here = (dict(os.environ), os.getcwd())
    procs = [ctx.Process(target=_entry, args=(fn, r, world_size, port, queue, args, *here)) for r in range(world_size)]
    for p in procs:
        p.start()
    results: dict = {}
    try:
        import queue as queue_mod
        import time

        deadline = time.monotonic() + timeout
        while len(results) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise DeadlineExceeded(
                    f"ranks {sorted(set(range(world_size)) - set(results))} did not finish in {timeout}s"
                )
            try:
                rank, status, payload = queue.get(timeout=min(remaining, 1.0))
            except queue_mod.Empty:
                dead = [i for i, p in enumerate(procs) if p.exitcode not in (None, 0) and i not in results]
                if dead:
                    raise AssertionError(
                        f"rank(s) {dead} exited with codes {[procs[i].exitcode for i in dead]}"
                    ) from None
                continue
            if status == INIT_FAILED:
                raise _RendezvousFailed(f"rank {rank}:\n{payload}")
            if status == "error":
                raise AssertionError(f"rank {rank} failed:\n{payload}")
            results[rank] = payload
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
    return [results[r] for r in range(world_size)]
