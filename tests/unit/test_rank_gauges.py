"""parwatch.sidecar.rank_gauges: the per-rank gauges, rendered from cached lines, are byte for byte what
prometheus_client renders for the same values, in the text format and in OpenMetrics, and /metrics
places them inside the exposition (before OpenMetrics' # EOF)."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.exposition import generate_latest
from prometheus_client.openmetrics.exposition import generate_latest as generate_openmetrics
from prometheus_client.openmetrics.parser import text_string_to_metric_families as parse_openmetrics
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector, CollectorRegistry

from parwatch.catalog import metric
from parwatch.sidecar.rank_gauges import RankGauge, exposition
from tests.loop_turns import run_beside_other_work

VALUES = {3: 2, 0: 1.0, 1: True, 10: 0, 7: 3.0, 100_000: False}


class _Reference(Collector):
    """The same family, rendered by prometheus_client."""

    def __init__(self, name: str, values):
        self.name, self.values = name, values

    def collect(self):
        family = GaugeMetricFamily(self.name, metric(self.name).help, labels=["rank"])
        for rank, value in sorted(self.values.items()):
            family.add_metric([str(rank)], float(value))
        yield family


def _reference(name: str, values) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Reference(name, values))
    return registry


@pytest.mark.parametrize("name", ["parwatch_rank_up", "parwatch_rank_state"])
@pytest.mark.parametrize("values", [VALUES, {}])
def test_the_lines_are_prometheus_clients_own(name, values):
    gauge = RankGauge(name, lambda: values)
    for _ in range(2):  # the second time from the cached lines
        assert gauge.render() == generate_latest(_reference(name, values))
        assert gauge.render(openmetrics=True) == generate_openmetrics(_reference(name, values)).removesuffix(b"# EOF\n")


def test_a_changed_value_is_rendered_not_the_last_lines():
    values = dict(VALUES)
    gauge = RankGauge("parwatch_rank_state", lambda: values)
    gauge.render()
    values[10] = 2  # rank 10 gone
    assert gauge.render() == generate_latest(_reference("parwatch_rank_state", values))
    del values[3]
    assert b'rank="3"' not in gauge.render()


def test_no_family_when_there_is_no_source():
    assert RankGauge("parwatch_rank_state", lambda: None).render() == b""


def test_the_exposition_holds_registry_and_rank_gauges_in_either_format():
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Reference("parwatch_hang_detected", {}))
    gauges = {
        "up": RankGauge("parwatch_rank_up", lambda: VALUES),
        "none": RankGauge("parwatch_rank_state", lambda: None),
    }
    body, content_type = asyncio.run(exposition(registry, gauges, ""))
    assert content_type.startswith("text/plain; version=0.0.4")
    families = {f.name: f for f in text_string_to_metric_families(body.decode())}
    assert set(families) == {"parwatch_hang_detected", "parwatch_rank_up"}
    assert {int(s.labels["rank"]): s.value for s in families["parwatch_rank_up"].samples} == {
        r: float(v) for r, v in VALUES.items()
    }
    body, content_type = asyncio.run(exposition(registry, gauges, "application/openmetrics-text;version=1.0.0"))
    assert content_type.startswith("application/openmetrics-text") and body.endswith(b"\n# EOF\n")
    families = {f.name: f for f in parse_openmetrics(body.decode())}  # the parser refuses anything after # EOF
    assert len(families["parwatch_rank_up"].samples) == len(VALUES)


@pytest.mark.parametrize("accept", ["", "application/openmetrics-text;version=1.0.0"])
def test_the_registry_is_rendered_a_few_samples_at_a_time_with_the_loop_running_between(accept):
    """A node's /metrics (~2,000 samples at 64 ranks) held its loop 14-56 ms at once, and the ranks' posts
    meanwhile waited: it is rendered SAMPLES_PER_TURN samples at a time, the same bytes as at once."""
    registry = CollectorRegistry(auto_describe=False)
    for name in ("parwatch_hang_detected", "parwatch_rank_up", "parwatch_rank_state"):
        registry.register(_Reference(name, VALUES))
    gauges = {"up": RankGauge("parwatch_rank_up", lambda: VALUES)}
    turns_whole: list = []
    turns_sliced: list = []
    whole, _ = run_beside_other_work(lambda: exposition(registry, gauges, accept, 10_000), turns_whole)
    sliced, _ = run_beside_other_work(lambda: exposition(registry, gauges, accept, len(VALUES)), turns_sliced)
    # No turn when rendered at once; a turn after each of the first two families when sliced.
    assert sliced == whole and not turns_whole and len(turns_sliced) >= 2
    encode = generate_openmetrics if accept else generate_latest
    registry_alone = encode(registry).removesuffix(b"# EOF\n")
    assert whole == registry_alone + RankGauge("parwatch_rank_up", lambda: VALUES).render(bool(accept)) + (
        b"# EOF\n" if accept else b""
    )
