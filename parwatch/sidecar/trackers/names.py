"""Names trackers accept for a parwatch run id."""

from __future__ import annotations

import re

_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]")


def safe_name(run_id: str) -> str:
    """A run id as a directory or tracker run name: other characters become '_' (a run id is ASCII already,
    parwatch.wire.bounds.RunId; this keeps a path out of it)."""
    name = _UNSAFE.sub("_", run_id).lstrip(".")
    return name or "run"
