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
  200-step healthy run). Left out of the default run, which CI runs within its 20-minute budget.

Run one tier: `pytest -m dist`; the default run: `pytest` (the README's command); the slow repeats:
`pytest -m slow`.

- timing: one test whose assertion is a wall-clock figure (a measured bubble, when a hang is named),
  never correctness. It gets one more run in a fresh process when it alone failed: tests/timing_rerun.py.
"""

import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from tests.timing_rerun import pytest_collectreport, pytest_runtest_logreport, pytest_sessionfinish  # noqa: E402,F401


def pytest_collection_modifyitems(config, items):
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
