"""Start the trainer: under torchrun (env:// rendezvous) or alone with --nproc N.

With --nproc the launcher spawns its ranks itself, watches them, and if one
dies (an injected crash, an error) stops the others at once instead of
letting them wait on a collective until the timeout.
"""

from __future__ import annotations

import datetime
import logging
import os
import sys
import time
from collections.abc import Callable
from typing import Any

from parwatch.ports import free_port
from parwatch.trainer.config import TrainConfig
from parwatch.trainer.errors import ConfigError, TrainerError
from parwatch.trainer.progress import RankProgress, describe_exit, exit_status

log = logging.getLogger("trainer")

_PEER_LOST = 3  # a rank's exit code when a collective failed because a peer went away
_PORT_TAKEN = 4  # rank 0's exit code when the rendezvous port, free a moment before, was taken before it bound it
_PORT_TRIES = 3
_CAUSE_GRACE_S = 15.0  # how long the ranks that lost a peer wait for the one that failed to be named
_WIND_DOWN_S = 3.0  # how long the other ranks may take to end by themselves once one failed
RANK_IMPORTS = ["torch", "torch.distributed", "parwatch.trainer.train", "parwatch.collector.attach"]
"""What every rank imports, once, in the fork server (not torch._dynamo: trainer/optim.py)."""

Attach = Callable[[TrainConfig, int, int, int, str], Any]
"""Builds and attaches one rank's observer: (cfg, rank, world_size, local_rank, backend) -> an object with
close(error=None); a ValueError names the setting to fix. The trainer knows nothing of the observer:
parwatch's launcher (`parwatch train`) passes its collector's (parwatch.collector.attach.RankAttach). One
with a `prepare(cfg, world_size)` method is asked, before --nproc ranks are spawned, for one Attach per rank
(what each rank alone receives: its own credential, not the secret it was minted from)."""
UNWATCHED = (
    "--parwatch on (or --parwatch-endpoint / --parwatch-log) needs parwatch's launcher, which attaches "
    "the collector: run `parwatch train ...` (under torchrun: `torchrun ... -m parwatch train ...`)"
)


def run_rank(
    cfg: TrainConfig, rank: int, world_size: int, local_rank: int = 0, progress=None, attach: Attach | None = None
) -> dict:
    """Body of one rank: init the process group, attach the observer, train, shut down in order.

    progress: a RankProgress the launcher reads (its `step` after each boundary), or None."""
    import torch
    import torch.distributed as dist

    from parwatch.contract import new_run_id
    from parwatch.trainer.checkpoint import atomic_write_json
    from parwatch.trainer.train import Trainer

    torch.set_num_threads(int(os.environ.get("TRAINER_THREADS", "1")))
    backend = cfg.backend
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
    dist.init_process_group(
        backend, rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=cfg.timeout_s)
    )
    observer = trainer = error = None
    failed = True
    try:
        if not cfg.run_id:
            # Under torchrun's static rendezvous every rank would invent its own id: take rank 0's.
            chosen = [os.environ.get("PARWATCH_RUN_ID") or new_run_id()]
            dist.broadcast_object_list(chosen, src=0)
            cfg.run_id = chosen[0]
        if cfg.watched:
            if attach is None:
                raise ConfigError(UNWATCHED)
            try:
                observer = attach(cfg, rank, world_size, local_rank, backend)
            except ValueError as err:
                raise ConfigError(str(err)) from None
        trainer = Trainer(cfg, rank, world_size)
        if progress is not None:
            progress.training()
            trainer.on_step = progress.step
        summary = trainer.run()
        if rank == 0 and cfg.summary_json:
            atomic_write_json(cfg.summary_json, summary)
        failed = False
        return summary
    except BaseException as exc:  # told to the sidecar (crashed, and why), then raised on
        error = exc
        raise
    finally:
        if progress is not None and not failed:
            progress.teardown()
        shutdown(trainer, observer, failed, error)


def shutdown(trainer, observer, failed: bool, error: BaseException | None = None) -> None:
    """Everything a rank started, stopped in order, then the process group destroyed.

    1. the trainer: sends completed, lane threads joined, the boundary's all-reduce released;
    2. the observer: no more spans, its last word (done, or crashed with `error`), shipper flushed
       (bounded), its threads joined;
    3. the hook registry emptied, 4. destroy_process_group: nothing of parwatch runs during it.
    Each step runs even when the one before it raised; the first such error is re-raised, unless
    training itself failed (then its error is the one that propagates)."""
    import torch.distributed as dist

    from parwatch import contract

    steps = [
        lambda: trainer is not None and trainer.close(failed),
        lambda: observer is not None and observer.close(error=error),
        contract.registry.clear,
        lambda: dist.is_initialized() and dist.destroy_process_group(),
    ]
    first = None
    for step in steps:
        try:
            step()
        except Exception as exc:  # later steps still run: a rank must never exit with its group up
            log.warning("shutdown: %s: %s", type(exc).__name__, exc)
            first = first or exc
    if first is not None and not failed:
        raise first


def _spawned(
    rank: int, world_size: int, port: int, cfg: TrainConfig, shared, attach: Attach | None, here: tuple[dict, str]
) -> None:
    env, cwd = here
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank)
    )
    _setup_logging(rank)
    progress = RankProgress(shared, rank)
    try:
        run_rank(cfg, rank, world_size, local_rank=rank, progress=progress, attach=attach)
        progress.done()
    except TrainerError as e:
        print(f"error: {e}", file=sys.stderr)
        os._exit(2)
    except RuntimeError as e:  # a peer died: the launcher names the rank that failed first
        if rank == 0 and progress.starting() and "EADDRINUSE" in str(e):
            # Another process took the port between free_port() and the bind: nothing of the run has started.
            print(f"rank 0: the rendezvous port {port} was taken before it bound it", file=sys.stderr)
            os._exit(_PORT_TAKEN)
        print(f"rank {rank}: stopped: {str(e).splitlines()[0][:200]}", file=sys.stderr)
        os._exit(_PEER_LOST)


def _setup_logging(rank: int) -> None:
    logging.basicConfig(
        level=os.environ.get("TRAINER_LOG", "WARNING"), format=f"[rank {rank}] %(levelname)s %(name)s: %(message)s"
    )


def spawn(cfg: TrainConfig, attach: Attach | None = None) -> int:
    """Run cfg.nproc ranks on this machine; returns the exit code (0 when every rank succeeded).

    The ranks fork from a fork server that imported what every rank imports (RANK_IMPORTS) once: four
    ranks cost one import of torch, not four (about 1.9 s of CPU each, and as much wall time on two
    cores). The server never touches a device, so CUDA starts in each rank as before. This launcher
    itself never imports torch: its teardown would hold the exit."""
    import multiprocessing as mp

    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(RANK_IMPORTS)
    here = (dict(os.environ), os.getcwd())  # the server's are those it started with: a rank takes ours
    prepare = getattr(attach, "prepare", None)
    try:
        attaches = prepare(cfg, cfg.nproc) if prepare is not None else [attach] * cfg.nproc
    except ValueError as err:
        raise ConfigError(str(err)) from None
    for _ in range(_PORT_TRIES):
        port = free_port()
        code = _run_ranks(ctx, cfg, port, attaches, here)
        if code != _PORT_TAKEN:
            return code
        # A demo or test on a busy machine (CI on f219b8e: another test's sidecar answered the ranks on it).
        print(f"the rendezvous port {port} was taken; starting the ranks again on another", file=sys.stderr)
    print(f"error: the rendezvous port was taken {_PORT_TRIES} times before rank 0 bound it", file=sys.stderr)
    return _PORT_TAKEN


def _run_ranks(ctx, cfg: TrainConfig, port: int, attaches: list, here: tuple[dict, str]) -> int:
    """One launch of cfg.nproc ranks on `port`: their exit code (0 when every rank succeeded), _PORT_TAKEN when
    rank 0 could not bind it (the others stopped at once: they were still waiting for the rendezvous)."""
    shared = RankProgress.shared_array(ctx, cfg.nproc)
    procs = [
        ctx.Process(target=_spawned, args=(r, cfg.nproc, port, cfg, shared, attaches[r], here))
        for r in range(cfg.nproc)
    ]
    for p in procs:
        p.start()
    from multiprocessing.connection import wait

    code = 0
    try:
        alive: dict[Any, int] = {p.sentinel: r for r, p in enumerate(procs)}  # sentinels: fds
        failed: list[int] = []
        deadline = None  # set when the only failures so far are ranks that lost a peer
        while alive:
            # Wake on each exit, so the rank that failed first is the one named (its peers die a
            # moment later with "connection closed", often before it has finished dying).
            timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
            for sentinel in wait(list(alive), timeout):
                rank = alive.pop(sentinel)
                procs[rank].join()
                if procs[rank].exitcode != 0:
                    failed.append(rank)
            if not failed:
                continue
            echoes_only = all(procs[r].exitcode == _PEER_LOST for r in failed)
            if echoes_only and alive and (deadline is None or time.monotonic() < deadline):
                deadline = deadline or time.monotonic() + _CAUSE_GRACE_S
                continue
            # Exit code 3 is a rank that only lost a peer: name the cause, not the echo.
            rank = min(failed, key=lambda r: (procs[r].exitcode == _PEER_LOST, r))
            exitcode = procs[rank].exitcode
            assert exitcode is not None  # joined above
            if exitcode == _PORT_TAKEN:
                return _PORT_TAKEN  # the others are stopped below: no rank got past the rendezvous
            code = exit_status(exitcode) or 1
            print(
                f"error: {describe_exit(shared, rank, exitcode, cfg.steps)}; stopping the other ranks", file=sys.stderr
            )
            # They lost a peer and are ending: let their collectors post their last summaries and say how
            # they ended (a SIGTERM now loses them: under load a rank's whole first process went unheard).
            until = time.monotonic() + _WIND_DOWN_S
            while alive and (left := until - time.monotonic()) > 0:
                for sentinel in wait(list(alive), left):
                    alive.pop(sentinel)
            break
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return code


def adopt_slurm_task(environ=os.environ) -> bool:
    """`srun` with one task per rank (NeMo's and Lightning's way): RANK, WORLD_SIZE and LOCAL_RANK from the
    step's task variables where no launcher (torchrun) set them. MASTER_ADDR and MASTER_PORT are the job
    script's to set (examples/slurm/parwatch.sbatch); without them the ranks could not meet."""
    if "RANK" in environ or "SLURM_PROCID" not in environ or "SLURM_STEP_NUM_TASKS" not in environ:
        return False
    alone = environ["SLURM_STEP_NUM_TASKS"] == "1"  # main() gives a lone rank a local address
    if not alone and (not environ.get("MASTER_ADDR") or not environ.get("MASTER_PORT")):
        raise ConfigError(
            "under srun with one task per rank, set MASTER_ADDR and MASTER_PORT in the job script, e.g. "
            'MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1) '
            "MASTER_PORT=$((20000 + SLURM_JOB_ID % 20000))"
        )
    environ.update(
        RANK=environ["SLURM_PROCID"],
        WORLD_SIZE=environ["SLURM_STEP_NUM_TASKS"],
        LOCAL_RANK=environ.get("SLURM_LOCALID", "0"),
    )
    return True


def main(argv: list[str] | None = None, attach: Attach | None = None) -> int:
    """The trainer's command line; `attach` is given by parwatch's launcher (see Attach)."""
    from parwatch.trainer.config import parse_args

    try:
        cfg = parse_args(argv)
        if not cfg.nproc:
            adopt_slurm_task()
        world = cfg.nproc or int(os.environ.get("WORLD_SIZE", "1"))
        cfg.validate(world)
        if cfg.watched and attach is None:
            raise ConfigError(UNWATCHED)
        if not cfg.run_id:  # one id for every rank: an id from the environment, else ...
            env_id = os.environ.get("PARWATCH_RUN_ID") or os.environ.get("TORCHELASTIC_RUN_ID", "")
            if (not env_id or env_id == "none") and os.environ.get("SLURM_JOB_ID"):
                env_id = f"slurm-{os.environ['SLURM_JOB_ID']}"  # a requeued job keeps its id, so its run
            if env_id and env_id != "none":
                cfg.run_id = env_id
            elif cfg.nproc:  # ... one made here for the ranks spawned below; under torchrun
                from parwatch.contract import new_run_id  # rank 0's, broadcast in run_rank

                cfg.run_id = new_run_id()
        if cfg.nproc:
            return spawn(cfg, attach)
        rank = int(os.environ.get("RANK", "0"))
        if "MASTER_ADDR" not in os.environ:  # alone, without torchrun
            os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
        _setup_logging(rank)
        run_rank(cfg, rank, world, int(os.environ.get("LOCAL_RANK", "0")), attach=attach)
        return 0
    except TrainerError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
