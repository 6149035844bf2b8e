"""The wheel as a user installs it: one top-level package (`parwatch`, the bundled trainer inside it, built
from the checkout's top-level trainer/), and `parwatch train` runs from the installed files alone, away
from this checkout; an editable install of a checkout runs that checkout's trainer."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.beside_serial, pytest.mark.integration, pytest.mark.timeout(300)]


def run(cmd: list[str], cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, f"{cmd}: {proc.stdout[-1500:]}\n{proc.stderr[-3000:]}"
    return proc


def fresh_venv(env_dir: Path) -> Path:
    """A venv of its own (no parwatch in it) that sees the packages this interpreter sees (torch and friends).

    `venv --system-site-packages` is not that: run from inside a venv it sees the base interpreter's
    site-packages, not the venv's. A .pth file naming this interpreter's site directories is: its paths
    come after the new venv's own, and .pth files in them (an editable parwatch's finder) are not run.
    No pip or setuptools is seeded in it (`pip_into` installs), so builds use this interpreter's setuptools."""
    run([sys.executable, "-m", "venv", "--without-pip", str(env_dir)], cwd=env_dir.parent)
    [site_dir] = (env_dir / "lib").glob("python3*/site-packages")
    seen = [p for p in sys.path if Path(p).name in ("site-packages", "dist-packages") and Path(p).is_dir()]
    (site_dir / "outer_packages.pth").write_text("\n".join(seen) + "\n")
    return env_dir


def pip_into(env_dir: Path) -> list[str]:
    return [sys.executable, "-m", "pip", "--python", str(env_dir / "bin" / "python"), "install", "--quiet", "--no-deps"]


def source_copy(dest: Path) -> Path:
    """The files a build reads, copied: setuptools writes build/ and egg-info beside the sources."""
    ignore = shutil.ignore_patterns("__pycache__")
    shutil.copytree(ROOT / "parwatch", dest / "parwatch", ignore=ignore, symlinks=True)
    shutil.copytree(ROOT / "trainer", dest / "trainer", ignore=ignore)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, dest / name)
    return dest


@pytest.fixture(scope="module")
def venv(tmp_path_factory) -> Path:
    """A fresh venv with only the built wheel installed in it."""
    base = tmp_path_factory.mktemp("wheel")
    src = source_copy(base / "src")
    pip_wheel = [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation"]
    run([*pip_wheel, "-w", str(base / "dist"), str(src)], cwd=base)
    [wheel] = (base / "dist").glob("parwatch-*.whl")
    env_dir = fresh_venv(base / "venv")
    run([*pip_into(env_dir), str(wheel)], cwd=base)
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


def test_an_editable_install_imports_the_checkouts_trainer(tmp_path):
    src = source_copy(tmp_path / "src")
    env_dir = fresh_venv(tmp_path / "venv")
    python = str(env_dir / "bin" / "python")
    run([*pip_into(env_dir), "--no-build-isolation", "-e", str(src)], cwd=tmp_path)
    away = tmp_path / "elsewhere"
    away.mkdir()
    code = "import os, parwatch, parwatch.trainer.train as t; print(parwatch.__file__); print(os.path.realpath(t.__file__))"
    where = run([python, "-c", code], cwd=away, env=clean_env()).stdout.split()
    assert where == [str(src / "parwatch" / "__init__.py"), str(src / "trainer" / "train.py")], where
    refused = subprocess.run([python, "-c", "import trainer"], cwd=away, env=clean_env(), capture_output=True)
    assert refused.returncode != 0  # the folder is parwatch.trainer only
