"""Offline report of a run directory: measured pipeline timeline, Perfetto trace, plots, summary.

    from parwatch.report import build_report
    paths = build_report("runs/demo")           # -> {"html": Path(".../report/index.html"), ...}

Heavy imports (matplotlib) happen on first use, so `import parwatch.report` stays cheap.
"""

from __future__ import annotations


def build_report(run_dir, step=None, out_dir=None, options=None) -> dict:
    from parwatch.report.build import build_report as _build

    return _build(run_dir, step=step, out_dir=out_dir, options=options)


__all__ = ["build_report"]
