"""Test tiers (markers, see pyproject.toml):

- unit (no marker): single process, no sockets beyond loopback, seconds in total.
- dist: spawns real gloo ranks on this machine. World sizes stay at 2-4 (2 cores) and
  every spawn has a hard timeout (tests/distutil.py), so a deadlock fails the test
  instead of hanging CI.
- integration: starts real servers and tools: the sidecar under uvicorn, Prometheus,
  Alertmanager, promtool, helm. Each skips with the reason when its tool is absent
  (.ci/run installs them all).
- gpu: needs CUDA and NCCL; skipped without a GPU.
- slow: heavier repeats of scenarios the default run already covers (a hang before a collective and
  before a send, besides the one in compute; slow compute, besides the demo's straggler; a second
  200-step healthy run). Left out of the default run.
- timing: one test whose single assertion is a wall-clock figure (a measured bubble, when a hang is
  named), never correctness. It gets one more run in a fresh process when it alone failed, at most two
  a session: tests/timing_rerun.py. A deadline a test waits on (tests/deadline.py) is never re-run.
- serial (given at collection, tests/serial_phase.py): the timing tests, the tests sharing their
  scenario's fixture, and CPU-bound grids marked so.

Run one tier: `pytest -m dist`; the default run: `pytest -n auto` (the README's command); the slow
repeats: `pytest -m slow`. Without `-n` everything runs in one process, in file order.

`-n auto` starts one worker more than the cores (pytest_xdist_auto_num_workers below). In parallel
(`-n N`, pytest-xdist) the session has two phases (tests/serial_phase.py): the non-serial
tests on every worker, a file at a time, longest first by CI's recorded durations (tests/durations.json);
then the serial tests on one worker, pinned to half the cores, while the others run the lane (the unit
tests and the tests marked `beside_serial`) pinned to the other half, so a timing figure is never
measured while another worker loads its cores. Workers share no fixed
port and no state directory: servers and ranks take a port the kernel just reported free (a sidecar
that loses it to another process is started again on others: tests/sidecar_process.py), every test
writes under its own tmp_path (a worker's own base temp), and only the controller writes test-results/.

DeepSpeed's CPU comm op (a C++ extension DeepSpeed JIT-builds at its first start) is built once by
scripts/setup.sh, in the background while setup and lint go on, into the project's own
TORCH_EXTENSIONS_DIR (.tools/torch_extensions), which this session and every rank it spawns use (a
DeepSpeed start while it builds waits on its lock); a `lock` left there by a killed build is named at the start
(tests/deepspeed_op.py) instead of every DeepSpeed start waiting on it forever.
"""

import gc
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from tests import deepspeed_op  # noqa: E402
from tests.serial_phase import (  # noqa: E402,F401
    mark_serial,
    pytest_configure_node,
    pytest_runtest_setup,
    pytest_xdist_make_scheduler,
)
from tests.timing_rerun import pytest_collectreport, pytest_runtest_logreport, pytest_sessionfinish  # noqa: E402,F401

deepspeed_op.extensions_dir(os.environ)  # before any rank or server is spawned: they inherit it


def pytest_xdist_auto_num_workers(config):
    """`-n auto`: one worker more than the cores. Most tests wait (servers starting, grace windows, ranks
    blocked in a collective): the suite used 107% of 2 cores at -n 3 (971 s of CPU in 899 s), so a third
    worker fills the cores the waits leave idle (the serial phase still measures alone)."""
    return (os.cpu_count() or 1) + 1


def pytest_sessionstart(session):
    stale = deepspeed_op.stale_lock(deepspeed_op.extensions_dir(os.environ))
    if stale:
        pytest.exit(stale, returncode=pytest.ExitCode.USAGE_ERROR)
    # Collection imports torch and every test module, and rewrites each one's asserts (never cached where
    # PYTHONDONTWRITEBYTECODE is set): 3,786 collections took 3.4 of its 10 s of CPU, once per xdist worker.
    # Without them collection takes 5.6-6.4 s of 10.2-10.9; what it leaves is frozen, so no later pass walks
    # it again (the unit tests: 39.4 s of CPU against 43.4). 2026-12-06, docs/benchmarks.md.
    gc.disable()


@pytest.hookimpl(tryfirst=True)
def pytest_runtestloop(session):
    """After collection (an xdist controller collects nothing): the garbage collector back on."""
    if not gc.isenabled():
        gc.enable()
        gc.collect()  # collection's own cycles, before the rest is frozen
        gc.freeze()


@pytest.hookimpl(tryfirst=True)  # before -m deselects: `-m serial` sees the marker given here
def pytest_collection_modifyitems(config, items):
    mark_serial(config, items)
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except Exception:
        has_cuda = False
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU (none on this machine)")
    for item in items:
        if "gpu" in item.keywords and not has_cuda:
            item.add_marker(skip_gpu)


@pytest.fixture
def hook_registry():
    """The process-wide trainer hook registry, emptied before and after the test."""
    from parwatch.contract import registry

    registry.clear()
    yield registry
    registry.clear()
