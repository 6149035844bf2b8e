"""Run the demo: a sidecar and a TP2xPP2 trainer on this machine, wired together.

The run directory ends up holding everything a later `parwatch report` needs:
summaries.jsonl and spans.jsonl (collectors), decisions.jsonl and parwatch.db
(the sidecar's state dir is the run dir), summary.json (trainer rank 0),
checkpoints/, the two processes' logs, demo-summary.json and report/.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from parwatch.client import SidecarClient, SidecarError
from parwatch.demo.live import LiveView, SummaryTail
from parwatch.demo.processes import Child, python_module, stop_all, wait_healthy
from parwatch.demo.scenario import DemoConfig
from parwatch.demo.summary import build_summary, print_summary
from parwatch.ports import free_port
from parwatch.sidecar.config import TOKEN_FILE_NAME
from parwatch.tokens import read_token
from parwatch.vocabulary import Action


class DemoFailed(RuntimeError):
    pass


def pause_hint(status: dict, control: str, token_file: Path | None = None) -> str:
    """What to do when a guardrail (or an operator) paused the run: the demo would wait forever."""
    why = next(
        (d.get("reason") for d in reversed(status.get("last_decisions") or []) if d.get("action") == Action.PAUSE), None
    )
    auth = f" --token-file {token_file}" if token_file else ""
    return (
        f"the run is paused{f' ({why})' if why else ''}: `parwatch resume --endpoint {control}{auth}` "
        "continues it; Ctrl-C stops the demo"
    )


def run_demo(cfg: DemoConfig, run_dir: Path, console, interactive: bool) -> dict:
    run_dir.mkdir(parents=True, exist_ok=True)
    metrics_port, control_port = free_port(), free_port()
    control = f"http://127.0.0.1:{control_port}"
    children: list[Child] = []
    try:
        sidecar = Child(
            "sidecar",
            python_module(
                "parwatch.cli.main",
                "sidecar",
                "--state-dir",
                str(run_dir),
                "--metrics-listen",
                f"127.0.0.1:{metrics_port}",
                "--control-listen",
                f"127.0.0.1:{control_port}",
            ),
            run_dir / "sidecar.log",
        )
        children.append(sidecar)
        try:
            wait_healthy(f"{control}/healthz", sidecar.proc, 60.0)
        except (RuntimeError, TimeoutError) as err:
            raise RuntimeError(f"the {sidecar.name}: {err}:\n{sidecar.tail()}") from None
        token_file = run_dir / TOKEN_FILE_NAME  # the sidecar's generated token (its state dir is the run dir)
        console.print(
            f"sidecar: metrics http://127.0.0.1:{metrics_port}/metrics   control {control}  "
            f"(status: parwatch status --endpoint {control} --token-file {token_file})",
            highlight=False,
        )
        trainer = Child(
            "trainer",
            python_module(
                "parwatch",
                "train",
                *cfg.trainer_args(),
                "--parwatch",
                "on",
                "--parwatch-endpoint",
                control,
                "--parwatch-token-file",
                str(token_file),
                "--parwatch-log",
                str(run_dir),
                "--checkpoint-dir",
                str(run_dir / "checkpoints"),
                "--summary-json",
                str(run_dir / "summary.json"),
                "--run-id",
                f"demo-{int(time.time())}",
            ),
            run_dir / "trainer.log",
        )
        children.append(trainer)
        console.print(
            f"trainer: TP{cfg.tp} x PP{cfg.pp}, {cfg.schedule}, m={cfg.microbatches}, "
            f"{cfg.steps} steps, scenario {cfg.scenario}; logs in {run_dir}",
            highlight=False,
        )
        tail = SummaryTail(run_dir / "summaries.jsonl")
        status = None
        paused_hint_shown = False
        with (
            SidecarClient(control, read_token(token_file), timeout=2.0) as client,
            LiveView(console, interactive, cfg.steps) as view,
        ):
            while trainer.poll() is None:
                advanced = tail.poll()
                try:
                    status = client.status()
                except SidecarError:
                    pass
                view.update(tail, status, advanced)
                if status and status.get("paused") and not paused_hint_shown:
                    console.print(pause_hint(status, control, token_file), highlight=False)
                paused_hint_shown = bool(status and status.get("paused"))
                time.sleep(0.5)
            tail.poll()
            view.update(tail, status, True)
        if trainer.poll() != 0:
            raise DemoFailed(
                f"the trainer exited with code {trainer.poll()}; last lines of {trainer.log_path}:\n{trainer.tail(8)}"
            )
        # Give the collectors' last summaries a moment to land before the sidecar stops.
        time.sleep(1.0)
    finally:
        # The children run in their own sessions (a terminal's Ctrl-C reaches only this
        # process), so this is what stops them on success, failure and interrupt alike.
        stop_all(list(reversed(children)))
    summary = build_summary(run_dir, cfg.pp, cfg.microbatches, 1, cfg.price_per_gpu_hour)
    (run_dir / "demo-summary.json").write_text(json.dumps(summary, indent=1, default=str))
    print_summary(console, summary)
    from parwatch.report.build import build_report

    paths = build_report(run_dir)
    console.print(
        f"report: {paths.get('html')}  (timeline {paths.get('timeline_png')}, trace {paths.get('trace')})",
        highlight=False,
    )
    return summary
