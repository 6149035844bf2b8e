"""The wire contract (version 1): every record that crosses a process boundary, typed once with its bounds
and field docs (msgspec). The sender builds and encodes the record, the receiver decodes the same record.

- `bounds`: the one set of bounds and the constrained types every record uses.
- `steps`: a rank's step summary, the ingest body and its answer (the contract's Directive), outcome and
  check records.
- `activity`: a rank's activity report and a node's digest (hang detection).
- `bodies`: an operator's control, Alertmanager's webhook, another sidecar's cross-node instances.
- `log`: the decision log (decisions.jsonl), a union tagged by `type`.
- `findings`: a decision's evidence (a hang's, a rank-gone's, a rule's ...), typed by its rule and source.
- `codec`: decode (a 422 naming the field), parse, encode, and the OpenAPI schemas.

The directive itself is the contract's stdlib record (parwatch/contract/directives.py), so a trainer needs
no msgspec. Run directory files: summaries.jsonl (a StepSummary a line), spans.jsonl (a span record a line,
for the steps the collector samples: {run_id, rank, stage, step, kind, start_s, end_s, attrs}, start_s and
end_s in seconds since the run's time origin, the first step boundary, so ranks of one host line up) and
decisions.jsonl (the decision log).
"""

from __future__ import annotations

from typing import Any

from parwatch.wire.activity import ActivityPost, NodeDigest
from parwatch.wire.bodies import AlertmanagerPayload, CancelRequest, ControlRequest, InstancesForward, Problem
from parwatch.wire.codec import openapi_schemas
from parwatch.wire.evidence import EvidencePost
from parwatch.wire.log import LOG_TYPES
from parwatch.wire.steps import IngestBody, IngestResponse

BODIES = (IngestBody, IngestResponse, Problem, ControlRequest, CancelRequest, AlertmanagerPayload, InstancesForward)
"""The control app's records named in the OpenAPI document (components/schemas/<class name>)."""


def openapi_components() -> dict[str, Any]:
    """The JSON schemas of every body, the activity posts and the decision log's records."""
    return openapi_schemas((*BODIES, ActivityPost, NodeDigest, EvidencePost, *LOG_TYPES))
