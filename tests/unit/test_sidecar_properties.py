"""Property tests (issue 11): whatever the sidecar accepts, /metrics can still be served.

Hypothesis draws summaries at the edges of what the models accept (counts up to 2**53, seconds
up to 1e9, negative idle, NaN/inf losses, odd but printable run ids, retries and rollbacks in any
order); every accepted post must leave both text encoders working, prometheus_client's parser
reading the result, and `promtool check metrics` clean.
"""

from __future__ import annotations

import math
import shutil
import subprocess
import tempfile

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client.exposition import generate_latest as encode_text
from prometheus_client.openmetrics.exposition import generate_latest as encode_openmetrics
from prometheus_client.parser import text_string_to_metric_families

from parwatch.contract.directives import MAX_STEP
from parwatch.sidecar.config import SidecarConfig
from parwatch.sidecar.service import build_sidecar
from parwatch.sidecar.store import Refused
from parwatch.vocabulary import CollectiveOp, GroupRole
from parwatch.wire.bounds import MAX_COUNT, MAX_RATIO, MAX_SECONDS, MAX_TIME
from parwatch.wire.codec import BadRecord, parse
from parwatch.wire.steps import COLLECTIVE_BUCKETS, IngestBody

PROMTOOL = shutil.which("promtool")

counts = st.one_of(st.sampled_from([0, 1, MAX_COUNT - 1, MAX_COUNT]), st.integers(0, MAX_COUNT))
steps = st.one_of(st.sampled_from([0, 1, MAX_STEP - 1]), st.integers(0, MAX_STEP - 1))
"""Steps and checkpoints stop below 2**53, the contract's bound: a rollback's skip count is one's difference."""
seconds = st.one_of(st.sampled_from([0.0, 5e-324, MAX_SECONDS]), st.floats(0, MAX_SECONDS))
signed = st.floats(-MAX_SECONDS, MAX_SECONDS)
ratios = st.floats(-MAX_RATIO, MAX_RATIO)
losses = st.one_of(st.none(), st.sampled_from(["nan", "inf", "-inf"]), st.floats(allow_nan=True, allow_infinity=True))
run_ids = st.text(st.characters(blacklist_categories=("Cc", "Cs")), min_size=1, max_size=40)


@st.composite
def collective(draw):
    count = draw(counts)
    buckets = sorted(
        draw(st.lists(st.integers(0, count), min_size=len(COLLECTIVE_BUCKETS), max_size=len(COLLECTIVE_BUCKETS)))
    )
    return {
        "op": draw(st.sampled_from(list(CollectiveOp))),
        "group": draw(st.sampled_from(list(GroupRole))),
        "count": count,
        "seconds": draw(seconds),
        "bytes": draw(counts),
        "buckets": draw(st.sampled_from([buckets, []])),
        # The model takes bandwidths below MAX_COUNT (2**53), not equal to it.
        "algbw": draw(st.floats(0, MAX_COUNT, exclude_max=True)),
        "busbw": draw(st.floats(0, MAX_COUNT, exclude_max=True)),
    }


@st.composite
def summary(draw, run_id, world):
    tp, pp, dp = world
    rank = draw(st.integers(0, tp * pp * dp - 1))
    s = {
        "v": 1,
        "run_id": run_id,
        "rank": rank,
        "stage": (rank // tp) % pp,
        "tp_rank": rank % tp,
        "dp_rank": rank // (tp * pp),
        "tp": tp,
        "pp": pp,
        "dp": dp,
        "microbatches": draw(st.integers(1, 64)),
        "schedule": draw(st.sampled_from(["1f1b", "gpipe", "interleaved_1f1b", "zb-h1"])),
        "step": draw(steps),
        "timeline": draw(st.integers(0, 3)),
        "time": draw(st.floats(0, MAX_TIME)),
        "step_seconds": draw(seconds),
        "compute_seconds": draw(seconds),
        "other_seconds": draw(seconds),
        "idle_seconds": draw(signed),
        "bubble_ratio": draw(ratios),
        "bubble_theoretical_ratio": draw(ratios),
        "loss": draw(losses),
        "tokens": draw(counts),
        "memory_max_allocated_bytes": draw(st.one_of(st.none(), counts)),
        "collectives": draw(st.lists(collective(), max_size=3)),
        "dropped_total": draw(counts),
        "overhead_seconds": draw(seconds),
        "nvml_up": draw(st.sampled_from([0, 1])),
        "checkpoints": draw(st.lists(steps, max_size=3)),
        "model_flops_utilization_ratio": draw(st.one_of(st.none(), st.floats(0, MAX_RATIO))),
    }
    if draw(st.booleans()):
        s["gpu"] = {
            "index": draw(st.integers(0, 1024)),
            "utilization_ratio": draw(st.floats(0, 1)),
            "memory_used_bytes": draw(counts),
            "power_watts": draw(st.floats(0, 1e6)),
            "sm_clock_hertz": draw(st.floats(0, 1e12)),
            "temperature_celsius": draw(st.floats(-300, 1e4)),
        }
    if rank == 0 and draw(st.booleans()):
        s["global"] = {
            "step": draw(steps),
            "loss": draw(losses),
            "pipeline_skew_ratio": draw(st.none() | ratios),
            "stages": [
                {
                    "stage": i,
                    "compute_seconds": draw(seconds),
                    "idle_seconds": draw(signed),
                    "step_seconds": draw(seconds),
                    "bubble_ratio": draw(ratios),
                }
                for i in range(pp)
            ],
        }
    return s


@st.composite
def posts(draw):
    world = (draw(st.integers(1, 2)), draw(st.integers(1, 3)), draw(st.integers(1, 2)))
    ids = draw(st.lists(run_ids, min_size=1, max_size=2))
    return [
        [draw(summary(draw(st.sampled_from(ids)), world))] * draw(st.integers(1, 2))  # retries too
        for _ in range(draw(st.integers(1, 6)))
    ]


def _check_exposition(sidecar) -> str:
    text = encode_text(sidecar.registry).decode()
    families = list(text_string_to_metric_families(text))
    assert families and all(
        math.isfinite(s.value) or s.name == "parwatch_loss" or "bubble" in s.name
        for f in families
        for s in f.samples
        if f.type in ("counter", "histogram")
    )
    assert encode_openmetrics(sidecar.registry).endswith(b"# EOF\n")
    return text


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(posts())
def test_any_accepted_input_leaves_metrics_readable(batches):
    with tempfile.TemporaryDirectory() as state:
        sidecar = build_sidecar(SidecarConfig(state_dir=state))
        for summaries in batches:
            try:
                sidecar.ingest(parse({"version": 1, "summaries": summaries}, IngestBody))
            except (BadRecord, Refused):
                continue  # refused whole: nothing of it was stored
        assert sidecar.store.ranks  # something was accepted and stored
        text = _check_exposition(sidecar)
        if PROMTOOL:
            lint = subprocess.run(
                [PROMTOOL, "check", "metrics"], input=text, capture_output=True, text=True, timeout=60
            )
            assert lint.returncode == 0, lint.stdout + lint.stderr


@pytest.mark.parametrize(
    "field, value",
    [
        ("tokens", 10**400),
        ("step", 2**64),
        ("dropped_total", 2**63),
        ("memory_max_allocated_bytes", 10**400),
        ("checkpoints", [10**400]),
    ],
)
def test_numbers_beyond_a_metric_are_refused_not_stored(field, value, tmp_path):
    """Issue 11: one such post used to be accepted and break every later scrape (500)."""
    from tests.fixtures import synthetic as syn

    sidecar = build_sidecar(SidecarConfig(state_dir=tmp_path))
    s = syn.summary(0, 1)
    s[field] = value
    with pytest.raises(BadRecord, match=field):
        parse({"version": 1, "summaries": [s]}, IngestBody)
    sidecar.ingest(parse({"version": 1, "summaries": [syn.summary(0, 1)]}, IngestBody))
    _check_exposition(sidecar)


def test_a_step_past_the_contracts_bound_is_refused_not_turned_into_a_broken_rollback(tmp_path):
    """Hypothesis found it: rank 0's view of step 2**53 with a NaN loss made a rollback whose skip count
    (step - checkpoint) the contract refuses, and the ingest failed. Steps stop below 2**53 now."""
    from tests.fixtures import synthetic as syn

    sidecar = build_sidecar(SidecarConfig(state_dir=tmp_path))
    s = syn.summary(0, 1)
    s.update(checkpoints=[0], **{"global": {"step": MAX_STEP, "loss": "nan", "stages": []}})
    with pytest.raises(BadRecord, match=r"^summaries\[0\].global.step: Expected `int` <= 9007199254740991"):
        parse({"version": 1, "summaries": [s]}, IngestBody)
    s["global"]["step"] = MAX_STEP - 1  # the largest accepted: its rollback is a valid directive
    sidecar.ingest(parse({"version": 1, "summaries": [s]}, IngestBody))
    _check_exposition(sidecar)
