"""Experiment trackers as optional outputs of the leader sidecar (`parwatch sidecar --export`).

The leader writes a run's figures, as its own /metrics shows them, to TensorBoard, MLflow or W&B: one
tracker run per parwatch run id, at most MAX_SERIES series, at most once per `--export-every` steps (and
the run's last step), plus its decisions and straggler findings as text. The event loop only takes a
snapshot of the figures (`series.py`) and hands it to each tracker's queue; a thread per tracker does
the tracker's I/O (`worker.py`), dropping and counting points when the tracker is slower than the run.

Nothing here imports a tracker's library unless `--export` names it: `import parwatch` and a sidecar
without --export never load tensorboardX, mlflow or wandb (tests/unit/test_frameworks_stay_optional.py).
"""
