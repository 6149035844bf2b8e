"""Fast text encoders for the sidecar's own metric families.

prometheus_client's encoders escape every sample name character by character (the
OpenMetrics one most of all); with 1024 ranks that alone costs several hundred ms per
scrape. Our metric and label names are fixed legacy-valid identifiers, so escaping is
needed only for label values and help text. These encoders write exactly what
prometheus_client writes for such families (a unit test holds them to that), and
`choose` falls back to the library for any format or escaping they do not cover.

encode_async produces the same bytes but hands the event loop back every few ms, so a
scrape of a thousand ranks does not stall ingest (a worker thread would, through the GIL).
Per-rank families (RankFamily) bring their own `text_chunks`: runs of up to CHUNK_LINES lines,
each line one f-string over the record's fields, not a Sample with a label dict to sort and
escape (about five times cheaper for a 1024-rank scrape), and joined a chunk at a time, not
yielded line by line (the generator and the encoder's per-piece work were a third of the rest).
"""

from __future__ import annotations

import asyncio
import math
import time

from prometheus_client import exposition
from prometheus_client.metrics_core import Metric
from prometheus_client.openmetrics import exposition as om_exposition

TEXT_CONTENT_TYPE = exposition.CONTENT_TYPE_PLAIN_0_0_4
OPENMETRICS_CONTENT_TYPES = (
    om_exposition.CONTENT_TYPE_LATEST,
    om_exposition.CONTENT_TYPE_LATEST + "; escaping=" + om_exposition.UNDERSCORES,
)
_TEXT_TYPES = {"counter": "counter", "gauge": "gauge", "histogram": "histogram", "info": "gauge"}
_TEXT_SUFFIX = {"counter": "_total", "info": "_info"}


CHUNK_LINES = 128
"""Lines per text chunk: a 1024-rank family is 8 pieces, each well under the encoder's slice."""


def chunks(seq, size: int = CHUNK_LINES):
    """Consecutive slices of a sequence, `size` items each (the last may be shorter)."""
    for i in range(0, len(seq), size):
        yield seq[i:i + size]


def go_float(v) -> str:
    """prometheus_client.utils.floatToGoString, with the common cases first."""
    kind = type(v)
    if kind is float and -1e6 < v < 1e6:  # Python's repr is Go's here (NaN and inf fail the test)
        return repr(v)
    if kind is int and -1_000_000 < v < 1_000_000:  # counts: Go writes 1e+06 from a million on
        return f"{v}.0"
    if 1e6 <= v < 1e15 and (kind is int or kind is float and v.is_integer()):
        return _whole_in_exponent_form(int(v))  # bytes and hertz: a third of the cost of the general path
    d = float(v)
    if d != d:
        return "NaN"
    if d == math.inf:
        return "+Inf"
    if d == -math.inf:
        return "-Inf"
    s = repr(d)
    dot = s.find(".")
    if d > 0 and dot > 6:  # Go switches to exponents sooner than Python
        mantissa = f"{s[0]}.{s[1:dot]}{s[dot + 1:]}".rstrip("0.")
        return f"{mantissa}e+{dot - 1:02d}"
    return s


def _whole_in_exponent_form(n: int) -> str:
    """Go's text for a whole number from 1e6 to 1e15 (exact in a float64): 81200000000 -> 8.12e+10."""
    digits = str(n)
    significant = digits.rstrip("0")
    mantissa = f"{significant[0]}.{significant[1:]}" if len(significant) > 1 else significant
    return f"{mantissa}e+{len(digits) - 1:02d}"


def _label_value(v: str) -> str:
    if "\\" in v or "\n" in v or '"' in v:
        return v.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")
    return v


class RankFamily(Metric):
    """A family with samples per rank (or per stage), generated only when encoded, in two forms:
    `samples` (prometheus_client's encoders iterate it) and `text_chunks()`, the same lines as
    exposition text written straight from the records, several whole lines per string (the
    encoders here use it: building a Sample and sorting its label dict per line was most of a
    1024-rank scrape)."""

    def __init__(self, name: str, doc: str, typ: str, samples, text_chunks):
        super().__init__(name, doc, typ)
        self._samples = samples
        self.text_chunks = text_chunks

    @property
    def samples(self):
        return self._samples()

    @samples.setter
    def samples(self, value):  # Metric.__init__ sets an empty list
        pass


def _line(s) -> str:
    if s.labels:
        labels = ",".join(f'{k}="{_label_value(v)}"' for k, v in sorted(s.labels.items()))
        return f"{s.name}{{{labels}}} {go_float(s.value)}\n"
    return f"{s.name} {go_float(s.value)}\n"


def _text_header(metric) -> str:
    name = metric.name + _TEXT_SUFFIX.get(metric.type, "")
    doc = metric.documentation.replace("\\", r"\\").replace("\n", r"\n")
    return f"# HELP {name} {doc}\n# TYPE {name} {_TEXT_TYPES[metric.type]}\n"


def _openmetrics_header(metric) -> str:
    doc = metric.documentation.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")
    unit = f"# UNIT {metric.name} {metric.unit}\n" if metric.unit else ""
    return f"# HELP {metric.name} {doc}\n# TYPE {metric.name} {metric.type}\n{unit}"


def _pieces(registry, openmetrics: bool):
    header = _openmetrics_header if openmetrics else _text_header
    for metric in registry.collect():
        yield header(metric)
        text_chunks = getattr(metric, "text_chunks", None)  # RankFamily: lines written straight from records
        if text_chunks is not None:
            yield from text_chunks()
            continue
        for s in metric.samples:
            yield _line(s)
    if openmetrics:
        yield "# EOF\n"


def encode_text(registry) -> bytes:
    """Prometheus text format 0.0.4."""
    return "".join(_pieces(registry, False)).encode("utf-8")


def encode_openmetrics(registry) -> bytes:
    """OpenMetrics 1.0.0 text."""
    return "".join(_pieces(registry, True)).encode("utf-8")


async def encode_async(registry, encoder, slice_seconds: float = 0.001) -> bytes:
    """What `encoder` (encode_text or encode_openmetrics) writes, yielding to the loop every slice.

    Each slice's text is joined and encoded before the yield: joining and encoding the whole 2 MB
    of a 1,024-rank scrape at the end held the loop 3-4 ms in one piece."""
    out: list[str] = []
    done: list[bytes] = []
    deadline = time.perf_counter() + slice_seconds
    for piece in _pieces(registry, encoder is encode_openmetrics):
        out.append(piece)
        if time.perf_counter() > deadline:  # per piece: a piece may be a chunk of CHUNK_LINES lines
            done.append("".join(out).encode("utf-8"))
            out.clear()
            await asyncio.sleep(0)
            deadline = time.perf_counter() + slice_seconds
    done.append("".join(out).encode("utf-8"))
    return b"".join(done)


def choose(accept_header: str):
    """(encoder, content_type) for an Accept header, as prometheus_client's choose_encoder decides."""
    encoder, content_type = exposition.choose_encoder(accept_header)
    if content_type == TEXT_CONTENT_TYPE:
        return encode_text, content_type
    if content_type in OPENMETRICS_CONTENT_TYPES:
        return encode_openmetrics, content_type
    return encoder, content_type  # another version or escaping: the library's encoder
