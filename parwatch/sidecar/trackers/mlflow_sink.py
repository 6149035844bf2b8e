"""MLflow: a run per parwatch run id (tag parwatch.run_id; a restarted sidecar finds and continues it) in
the experiment named after '#' (default parwatch). Scalars as metrics at their step; each decision and
finding as a text artifact, <tag>/<step>-<n>.txt. mlflow-skinny is enough: the client and the file store."""

from __future__ import annotations

import time
from typing import Any

from parwatch.sidecar.trackers.series import Point

RUN_TAG = "parwatch.run_id"


class MlflowSink:
    def __init__(self, uri: str, experiment: str) -> None:
        self.uri = uri
        self.experiment = experiment
        self._client: Any = None  # MlflowClient, imported when a run opens
        self._run: str | None = None
        self._texts = 0

    def open(self, run_id: str) -> None:
        from mlflow.tracking import MlflowClient

        client = MlflowClient(tracking_uri=self.uri)
        found = client.get_experiment_by_name(self.experiment)
        experiment_id = found.experiment_id if found is not None else client.create_experiment(self.experiment)
        escaped = run_id.replace("'", "\\'")
        runs = client.search_runs([experiment_id], filter_string=f"tags.`{RUN_TAG}` = '{escaped}'", max_results=1)
        if runs:
            self._run = runs[0].info.run_id
            client.update_run(self._run, status="RUNNING")
        else:
            self._run = client.create_run(experiment_id, run_name=run_id, tags={RUN_TAG: run_id}).info.run_id
        self._client = client

    def write(self, point: Point) -> None:
        from mlflow.entities import Metric

        client, run = self._client, self._run
        assert client is not None and run is not None
        now_ms = int(time.time() * 1000)
        if point.scalars:
            client.log_batch(run, metrics=[Metric(k, v, now_ms, point.step) for k, v in point.scalars.items()])
        for text in point.texts:
            self._texts += 1
            client.log_text(run, text.text, f"{text.tag}/{text.step:09d}-{self._texts:06d}.txt")

    def finish(self) -> None:
        if self._client is not None and self._run is not None:
            self._client.set_terminated(self._run, "FINISHED")
        self._client = self._run = None
