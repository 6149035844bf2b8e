"""Refresh tests/durations.json from a run's JUnit XML: `python -m tests.durations test-results/junit.xml`.

The scheduler (tests/serial_phase.py) hands out the longest units first by these figures. Only tests that
took over a second are kept (the rest weigh UNKNOWN_SECONDS); a stale figure only changes the order.
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

from tests.serial_phase import DURATIONS

ROOT = Path(__file__).resolve().parent.parent
KEEP_OVER_SECONDS = 1.0


def node_id(classname: str, name: str) -> str | None:
    """pytest's node id of a JUnit testcase: its classname is the module's dotted path, then any classes."""
    parts = classname.split(".")
    for cut in range(len(parts), 0, -1):
        path = "/".join(parts[:cut]) + ".py"
        if (ROOT / path).is_file():
            return "::".join([path, *parts[cut:], name])
    return None


def durations(junit: Path) -> dict[str, float]:
    out = {}
    for case in ET.parse(junit).iter("testcase"):
        seconds = float(case.get("time") or 0.0)
        nodeid = node_id(case.get("classname", ""), case.get("name", ""))
        if nodeid is not None and seconds > KEEP_OVER_SECONDS:
            out[nodeid] = round(seconds, 1)
    return dict(sorted(out.items()))


if __name__ == "__main__":
    figures = durations(Path(sys.argv[1]))
    Path(DURATIONS).write_text(json.dumps(figures, indent=0) + "\n")
    print(f"{DURATIONS}: {len(figures)} tests over {KEEP_OVER_SECONDS:g} s, {sum(figures.values()):.0f} s in all")
