"""The wheel as a user installs it: one top-level package (`parwatch`, the bundled trainer inside it), and
`parwatch train` runs from the installed files alone, away from this checkout."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


def run(cmd: list[str], cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, f"{cmd}: {proc.stdout[-1500:]}\n{proc.stderr[-3000:]}"
    return proc


@pytest.fixture(scope="module")
def venv(tmp_path_factory) -> Path:
    """A fresh venv (seeing this machine's torch and friends) with only the built wheel installed in it."""
    base = tmp_path_factory.mktemp("wheel")
    src = base / "src"  # built from a copy: setuptools writes build/ and egg-info beside the sources
    shutil.copytree(ROOT / "parwatch", src / "parwatch", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--quiet",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(base / "dist"),
            str(src),
        ],
        cwd=base,
    )
    [wheel] = (base / "dist").glob("parwatch-*.whl")
    env_dir = base / "venv"
    run([sys.executable, "-m", "venv", "--system-site-packages", str(env_dir)], cwd=base)
    run([str(env_dir / "bin" / "python"), "-m", "pip", "install", "--quiet", "--no-deps", str(wheel)], cwd=base)
    return env_dir


def clean_env() -> dict:
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PARWATCH_TOKEN")}


def test_the_wheel_installs_one_top_level_package(venv):
    code = (
        "import importlib.metadata as m, json; d = m.distribution('parwatch'); "
        "print(json.dumps(sorted({f.parts[0] for f in d.files if not f.parts[0].endswith('.dist-info') "
        "and f.parts[0] not in ('..', 'bin')})))"
    )
    out = run([str(venv / "bin" / "python"), "-c", code], cwd=venv, env=clean_env()).stdout
    assert json.loads(out) == ["parwatch"]


def test_parwatch_train_runs_from_the_installed_wheel(venv, tmp_path):
    log = tmp_path / "log"
    run(
        [
            str(venv / "bin" / "parwatch"),
            "train",
            "--nproc",
            "1",
            "--steps",
            "2",
            "--layers",
            "2",
            "--hidden",
            "32",
            "--seq-len",
            "16",
            "--parwatch-log",
            str(log),
        ],
        cwd=tmp_path,
        env=clean_env(),
    )
    where = run(
        [str(venv / "bin" / "python"), "-c", "import parwatch.trainer as t; print(t.__file__)"],
        cwd=tmp_path,
        env=clean_env(),
    ).stdout.strip()
    assert where.startswith(str(venv)), where  # the installed copy, not this checkout
    rows = [json.loads(line) for line in (log / "summaries.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
