"""The demo's live view: step, loss, bubble per stage, guardrail states.

A rich live table on a terminal; one plain line per reported step otherwise
(CI logs, pipes), so the output is readable in both.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from parwatch.vocabulary import RuleState


class SummaryTail:
    """Follows summaries.jsonl as the collectors append to it; keeps the latest per stage."""

    def __init__(self, path: Path):
        self.path = path
        self._offset = 0
        self.step = 0
        self.loss = None
        self.bubble: dict[int, float] = {}
        self.theory: dict[int, float] = {}

    def poll(self) -> bool:
        """Read new complete lines; True when the newest step advanced."""
        try:
            with open(self.path, "rb") as f:
                f.seek(self._offset)
                data = f.read()
        except OSError:
            return False
        end = data.rfind(b"\n") + 1
        self._offset += end
        before = self.step
        for line in data[:end].splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if rec.get("rank") == 0:
                self.step = rec.get("step", self.step)
                # Rank 0's own loss belongs to this step; the fast-path view lags one step.
                g = rec.get("global") or {}
                # The stage bubble the guardrail judges (parwatch.bubble), not one rank's.
                for st in g.get("stages") or ():
                    if isinstance(st.get("bubble_ratio"), (int, float)):
                        self.bubble[st["stage"]] = st["bubble_ratio"]
                        self.theory[st["stage"]] = rec.get("bubble_theoretical_ratio")
                if rec.get("loss") is not None:
                    self.loss = rec["loss"]
                elif "loss" in g:
                    self.loss = g["loss"]
        return self.step != before


def _fmt_loss(loss) -> str:
    if isinstance(loss, str):
        return loss
    if loss is None or (isinstance(loss, float) and math.isnan(loss)):
        return "-"
    return f"{loss:.4f}"


def status_line(tail: SummaryTail, status: dict | None) -> str:
    stages = " ".join(f"s{s}={b:.3f}/{tail.theory.get(s) or 0:.3f}" for s, b in sorted(tail.bubble.items()))
    rules = status.get("rules", {}) if status else {}
    hot = [f"{n}:{r.get('state')}" for n, r in sorted(rules.items()) if r.get("state") != RuleState.OK]
    paused = " PAUSED" if status and status.get("paused") else ""
    return (
        f"step {tail.step:4d}  loss {_fmt_loss(tail.loss):>8}  bubble measured/theory {stages}"
        f"  guardrails {' '.join(hot) or 'all ok'}{paused}"
    )


class LiveView:
    def __init__(self, console, interactive: bool, total_steps: int):
        self.console = console
        self.interactive = interactive
        self.total = total_steps
        self._live: Any = None  # a rich.live.Live while interactive

    def __enter__(self):
        if self.interactive:
            from rich.live import Live

            self._live = Live(console=self.console, refresh_per_second=4, transient=False)
            self._live.__enter__()
        return self

    def __exit__(self, *exc):
        if self._live is not None:
            self._live.__exit__(*exc)

    def update(self, tail: SummaryTail, status: dict | None, advanced: bool) -> None:
        if self._live is not None:
            self._live.update(self._table(tail, status))
        elif advanced:
            self.console.print(status_line(tail, status), highlight=False, soft_wrap=True)

    def _table(self, tail: SummaryTail, status: dict | None):
        from rich.table import Table

        t = Table(
            title=f"parwatch demo: step {tail.step}/{self.total}, loss {_fmt_loss(tail.loss)}"
            + ("  [bold red]PAUSED[/]" if status and status.get("paused") else "")
        )
        t.add_column("stage")
        t.add_column("bubble measured", justify="right")
        t.add_column("theory (p-1)/(m+p-1)", justify="right")
        for s, b in sorted(tail.bubble.items()):
            t.add_row(str(s), f"{b:.3f}", f"{tail.theory.get(s) or 0:.3f}")
        for name, rule in sorted((status or {}).get("rules", {}).items()):
            state = rule.get("state", "?")
            colour = {"ok": "green", "pending": "yellow", "firing": "red"}.get(state, "white")
            t.add_row(f"rule {name}", f"[{colour}]{state}[/]", "")
        return t
