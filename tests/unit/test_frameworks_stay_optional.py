"""The framework integrations import their framework only when used: `import parwatch` (and
importing the integration modules themselves) never pulls in deepspeed or megatron."""

from __future__ import annotations

import pkgutil
import subprocess
import sys

import parwatch.integrations


def test_importing_parwatch_imports_no_framework():
    modules = [f"parwatch.integrations.{m.name}" for m in pkgutil.iter_modules(parwatch.integrations.__path__)]
    code = (
        "import importlib, sys\n"
        "import parwatch, parwatch.collector\n"
        f"for name in {modules!r}:\n"
        "    importlib.import_module(name)\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('deepspeed', 'megatron')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]", out.stdout
    assert "parwatch.integrations.deepspeed" in modules


TRACKER_MODULES = ("tensorboardX", "tensorboard", "mlflow", "wandb")


def test_a_sidecar_without_export_imports_no_tracker(tmp_path):
    """`import parwatch`, the sidecar's CLI and a built sidecar with its apps never load a tracker's library
    unless --export names it; naming one loads only the spec check, and the library when a run opens."""
    code = (
        "import sys\n"
        "import parwatch, parwatch.cli.main, parwatch.cli.sidecar\n"
        "from parwatch.sidecar.app import create_control_app, create_metrics_app\n"
        "from parwatch.sidecar.config import SidecarConfig\n"
        "from parwatch.sidecar.service import build_sidecar\n"
        f"sidecar = build_sidecar(SidecarConfig(state_dir={str(tmp_path / 'state')!r}))\n"
        "create_control_app(sidecar), create_metrics_app(sidecar)\n"
        "sidecar.close()\n"
        f"print(sorted(m for m in sys.modules if m.split('.')[0] in {TRACKER_MODULES!r}))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout
