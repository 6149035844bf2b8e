"""TensorBoard: event files under DIR/<run id>/, written with tensorboardX (protobuf only; TensorBoard itself
is needed only to read them). Scalars with add_scalar, decisions and findings with add_text."""

from __future__ import annotations

import os

from parwatch.sidecar.trackers.names import safe_name
from parwatch.sidecar.trackers.series import Point


class TensorBoardSink:
    def __init__(self, log_dir: str) -> None:
        self.log_dir = log_dir
        self._writer = None

    def open(self, run_id: str) -> None:
        from tensorboardX import SummaryWriter

        self._writer = SummaryWriter(logdir=os.path.join(self.log_dir, safe_name(run_id)))

    def write(self, point: Point) -> None:
        writer = self._writer
        assert writer is not None
        for name, value in point.scalars.items():
            writer.add_scalar(name, value, point.step)
        for text in point.texts:
            writer.add_text(text.tag, text.text, text.step)
        writer.flush()

    def finish(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
