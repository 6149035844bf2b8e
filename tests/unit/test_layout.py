"""The checkout's layout as pyproject installs it: every package folder is listed (a forgotten one would
be missing from the wheel), the top-level trainer/ is parwatch.trainer, and parwatch/trainer links to it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")
ROOT = Path(__file__).resolve().parents[2]


def setuptools_config() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


def packages_under(folder: Path, name: str) -> set[str]:
    """Dotted names of the packages in `folder`, which installs as `name` (links not followed)."""
    return {
        ".".join([name, *init.parent.relative_to(folder).parts])
        for init in folder.rglob("__init__.py")
        if not any(p.is_symlink() for p in init.parents if folder in p.parents)
    }


def test_every_package_folder_is_listed():
    folders = packages_under(ROOT / "parwatch", "parwatch") | packages_under(ROOT / "trainer", "parwatch.trainer")
    assert sorted(setuptools_config()["packages"]) == sorted(folders)


def test_the_trainer_folder_is_parwatch_trainer():
    assert setuptools_config()["package-dir"] == {"parwatch.trainer": "trainer"}
    link = ROOT / "parwatch" / "trainer"
    assert link.is_symlink() and os.readlink(link) == "../trainer"
