"""The gauges with a series per rank of the run (parwatch_rank_up, parwatch_rank_state), rendered from
cached lines.

At the leader they have a series for every rank: 16,384 at 16,384 ranks. prometheus_client renders a
sample in ~5 us, and a scrape held the leader's event loop, the one that takes every node's digest,
for 120-145 ms (docs/benchmarks.md, the leader). Here a rank's line start (`name{rank="N"} `) is made
once and a scrape joins bytes, or reuses the last scrape's lines when no rank's value changed. A gauge's lines are the same in the text format and in OpenMetrics, so
/metrics appends these to prometheus_client's rendering of the registry (before OpenMetrics' `# EOF`).
A test holds them byte-equal to prometheus_client's own rendering of the same values.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping

from prometheus_client.exposition import choose_encoder
from prometheus_client.registry import CollectorRegistry
from prometheus_client.utils import floatToGoString

from parwatch.catalog import metric

_EOF = b"# EOF\n"


class RankGauge:
    """One gauge family labelled by rank. `values`: () -> {rank: value}, or None for no family at all."""

    def __init__(self, name: str, values: Callable[[], Mapping[int, float] | None]):
        self.name = name
        self.values = values
        text = metric(name).help.replace("\\", r"\\").replace("\n", r"\n")
        self._heads = {  # OpenMetrics escapes a HELP text's double quotes too
            openmetrics: f"# HELP {name} {help_text}\n# TYPE {name} gauge\n".encode()
            for openmetrics, help_text in ((False, text), (True, text.replace('"', '\\"')))
        }
        self._lines: dict[int, bytes] = {}  # rank -> b'name{rank="N"} ' (ranks are bounded by MAX_WORLD)
        self._texts: dict[float, bytes] = {}  # value -> b"1.0\n"
        self._last: tuple[dict, bytes] = ({}, b"")  # the values last rendered, and their lines

    def render(self, openmetrics: bool = False) -> bytes:
        values = self.values()
        if values is None:
            return b""
        if values != self._last[0]:  # ranks rarely change state: most scrapes reuse the lines
            self._last = (dict(values), self._samples(values))
        return self._heads[openmetrics] + self._last[1]

    def _samples(self, values: Mapping[int, float]) -> bytes:
        lines, texts, out = self._lines, self._texts, []
        for rank in sorted(values):
            line = lines.get(rank)
            if line is None:
                line = lines[rank] = f'{self.name}{{rank="{rank}"}} '.encode()
            value = values[rank]
            text = texts.get(value)
            if text is None:
                text = texts[value] = f"{floatToGoString(value)}\n".encode()
            out.append(line + text)
        return b"".join(out)


SAMPLES_PER_TURN = 200
"""Samples /metrics renders before the loop takes its next turn: a node's 64 ranks are ~2,000 samples, which
rendered at once held the loop 11-17 ms, and every post that arrived meanwhile waited (docs/benchmarks.md)."""


class _Families:
    """Some families the registry collected, as an encoder takes them (anything with collect())."""

    def __init__(self, families: list):
        self.families = families

    def collect(self):
        return self.families


async def exposition(
    registry: CollectorRegistry, gauges: Mapping[str, RankGauge], accept: str, samples_per_turn: int = SAMPLES_PER_TURN
) -> tuple[bytes, str]:
    """/metrics: the registry in the format `accept` asks for, with the per-rank gauges. (body, content type)
    Rendered SAMPLES_PER_TURN samples at a time, the ranks' posts answered between: the collectors read whole
    values (sidecar/exporter.py), so a scrape may be interleaved with ingests."""
    encoder, content_type = choose_encoder(accept)
    openmetrics = content_type.startswith("application/openmetrics-text")
    parts: list[bytes] = []
    batch: list = []
    samples = 0

    def render() -> None:
        body = encoder(_Families(batch))
        parts.append(body[: -len(_EOF)] if openmetrics and body.endswith(_EOF) else body)

    for family in registry.collect():
        batch.append(family)
        samples += len(family.samples)
        if samples >= samples_per_turn:
            render()
            batch, samples = [], 0
            await asyncio.sleep(0)
    render()
    parts += (g.render(openmetrics) for g in gauges.values())
    return b"".join(parts) + (_EOF if openmetrics else b""), content_type
