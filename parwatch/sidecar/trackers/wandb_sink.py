"""Weights & Biases: a run per parwatch run id (its id, resumed when it exists) in the project named after
':' (default parwatch). Offline where no key is configured (no WANDB_API_KEY, no login in ~/.netrc): the run's
files land under WANDB_DIR, else the sidecar's state directory, for `wandb sync` later. Scalars and texts go
into the run's history at their step; W&B takes steps in order only, so a text for an earlier step is
written at the newest step written (its own step is in the text), and texts of one tag at one step are joined
(a history row keeps one value per key)."""

from __future__ import annotations

import netrc
import os
from typing import Any

from parwatch.sidecar.trackers.names import safe_name
from parwatch.sidecar.trackers.series import Point


def mode(environ=os.environ) -> str:
    """WANDB_MODE when set; online with a key (WANDB_API_KEY, or a login in ~/.netrc); offline without."""
    if environ.get("WANDB_MODE"):
        return environ["WANDB_MODE"]
    if environ.get("WANDB_API_KEY"):
        return "online"
    try:
        logged_in = netrc.netrc().authenticators("api.wandb.ai") is not None
    except (OSError, netrc.NetrcParseError):
        logged_in = False
    return "online" if logged_in else "offline"


class WandbSink:
    def __init__(self, project: str, directory: str) -> None:
        self.project = project
        self.directory = os.environ.get("WANDB_DIR") or directory
        self._run: Any = None  # wandb.Run, imported when a run opens
        self._step = -1
        self._texts: dict[str, str] = {}  # the texts of the row at self._step, by tag

    def open(self, run_id: str) -> None:
        import wandb

        os.makedirs(self.directory, exist_ok=True)
        run_mode: Any = mode()  # WANDB_MODE's value is wandb's to judge
        self._run = wandb.init(
            project=self.project,
            id=safe_name(run_id),
            name=run_id,
            resume="allow",
            mode=run_mode,
            dir=self.directory,
            config={"parwatch_run_id": run_id},
            settings=wandb.Settings(
                console="off", silent=True, disable_git=True, save_code=False, x_disable_stats=True, x_disable_meta=True
            ),
        )
        self._step, self._texts = -1, {}

    def write(self, point: Point) -> None:
        run = self._run
        assert run is not None
        step = max(self._step, point.step)
        if step > self._step:
            self._step, self._texts = step, {}
        row: dict = dict(point.scalars)
        for text in point.texts:  # a row takes one value per key until the next step: texts of a tag are joined
            joined = f"{self._texts[text.tag]}\n{text.text}" if text.tag in self._texts else text.text
            self._texts[text.tag] = row[text.tag] = joined
        run.log(row, step=step)

    def finish(self) -> None:
        if self._run is not None:
            self._run.finish()
            self._run = None
