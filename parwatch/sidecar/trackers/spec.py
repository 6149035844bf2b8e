"""`--export` values: which tracker, where, and the checks a sidecar can make before it starts."""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass

from parwatch.vocabulary import Tracker

DEFAULT_EVERY_STEPS = 10
"""--export-every: a point to the trackers at most once per this many steps."""
DEFAULT_EXPERIMENT = "parwatch"
"""MLflow experiment and W&B project when the --export value names none."""

MODULE = {Tracker.TENSORBOARD: "tensorboardX", Tracker.MLFLOW: "mlflow", Tracker.WANDB: "wandb"}
"""The module each tracker writes with; `pip install 'parwatch[<tracker>]'` brings it."""

USAGE = "--export tensorboard:DIR, --export mlflow:URI[#EXPERIMENT] or --export wandb[:PROJECT]"


class ExportError(ValueError):
    """An --export value is wrong or cannot work here; the message names the value and the fix."""


@dataclass(frozen=True)
class ExportSpec:
    tracker: Tracker
    target: str = ""
    """TensorBoard: the log directory (a subdirectory per run id); MLflow: the tracking URI; W&B: unused."""
    experiment: str = DEFAULT_EXPERIMENT
    """MLflow's experiment or W&B's project the runs go to."""

    def __str__(self) -> str:
        return f"{self.tracker}:{self.target}" if self.target else str(self.tracker)


def parse_export(value: str, environ=os.environ) -> ExportSpec:
    """'tensorboard:DIR' | 'mlflow:URI[#EXPERIMENT]' | 'wandb[:PROJECT]' -> ExportSpec; ExportError naming the fix."""
    name, _, rest = value.strip().partition(":")
    try:
        tracker = Tracker(name.lower())
    except ValueError:
        raise ExportError(f"--export {value!r}: unknown tracker {name!r}; use {USAGE}") from None
    module = MODULE[tracker]
    if importlib.util.find_spec(module) is None:
        raise ExportError(
            f"--export {value!r} needs {module}, which is not installed: pip install 'parwatch[{tracker}]'"
        )
    if tracker == Tracker.TENSORBOARD:
        if not rest:
            raise ExportError(f"--export {value!r}: name the log directory, e.g. --export tensorboard:./tb")
        return ExportSpec(tracker, rest)
    if tracker == Tracker.MLFLOW:
        uri, _, experiment = rest.partition("#")
        if not uri:
            raise ExportError(
                f"--export {value!r}: name the tracking URI, e.g. --export mlflow:http://mlflow:5000 "
                "or --export mlflow:file:./mlruns"
            )
        if _is_file_store(uri) and environ.get("MLFLOW_ALLOW_FILE_STORE", "").lower() not in ("1", "true"):
            raise ExportError(
                f"--export {value!r}: MLflow 3 keeps its file store for those who ask: set MLFLOW_ALLOW_FILE_STORE=true "
                "for a local directory, or give a tracking server's URI (http://HOST:PORT)"
            )
        return ExportSpec(tracker, uri, experiment or DEFAULT_EXPERIMENT)
    return ExportSpec(tracker, "", rest or DEFAULT_EXPERIMENT)


def _is_file_store(uri: str) -> bool:
    """A local directory: file:PATH, or a path with no scheme (MLflow reads both as its file store)."""
    scheme, sep, _ = uri.partition(":")
    return uri.startswith("file:") or not sep or len(scheme) == 1  # "C:\..." is a path, not a scheme
