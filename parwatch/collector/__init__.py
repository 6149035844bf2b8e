"""parwatch's in-process collector: spans in, step summaries out.

    from parwatch.collector import Collector, RunContext, attach

    ctx = RunContext.for_rank(run_id, rank, tp=2, pp=2, dp=1, schedule="1f1b", microbatches=8)
    collector = attach(Collector(ctx, endpoint="http://127.0.0.1:9401", log_path="run/summaries.jsonl"))
    ...train (the trainer drives it through parwatch.contract)...
    collector.close()

Any trainer can drive the same Observer methods directly (see parwatch/contract/).
"""

from __future__ import annotations

# The submodule `attach` is imported first, so the names below (the functions) win.
from parwatch.collector.attach import AttachError, attach, attach_from_config, detach
from parwatch.collector.collector import Collector, SpanSampling
from parwatch.collector.context import RunContext
from parwatch.collector.wire import parse_directive

__all__ = [
    "AttachError",
    "Collector",
    "RunContext",
    "SpanSampling",
    "attach",
    "attach_from_config",
    "detach",
    "parse_directive",
]
