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
