"""A rank's evidence for a decision: every thread's Python stack, its last spans, its activity and, where
torch records one, the Flight Recorder dump. Built on the activity reporter's thread when its sidecar's
reply asks for it (the leader named a hang or a crash), while the training thread may be blocked.

Stacks come from `sys._current_frames()`: every thread's frame, read by another thread that holds the
GIL, as `faulthandler` prints them but with source lines. A thread blocked in C (a gloo or NCCL call)
has released the GIL, so its stack is read; one that holds the GIL forever stops this thread too (its
activity then stops: the sidecar calls it silent), which `--hang-dump-stacks` (faulthandler on SIGUSR1,
a C signal handler) still reaches.
"""

from __future__ import annotations

import os
import re
import sys
import tempfile
import threading
import traceback

from parwatch.wire.bounds import CONTROL_CHARS
from parwatch.wire.evidence import MAX_EVIDENCE_SPANS, MAX_STACK_CHARS, FlightRecorder, SpanRow

FLIGHT_RECORDER_ENV = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")
"""The Flight Recorder's ring-buffer size (torch >= 2.8 reads the first; older torch the second)."""
FLIGHT_RECORDER_ENTRIES = "2000"
"""What parwatch's launcher sets when the user set neither (PyTorch's own examples use 2000)."""
DUMP_ON_TIMEOUT_ENV = "TORCH_NCCL_DUMP_ON_TIMEOUT"


def enable_flight_recorder(environ: dict | None = None) -> bool:
    """Before the process group exists: turn torch's Flight Recorder on (and its dump on an NCCL watchdog
    timeout) unless the user chose a buffer size. True when parwatch set it."""
    env = os.environ if environ is None else environ
    if any(name in env for name in FLIGHT_RECORDER_ENV):
        return False
    env[FLIGHT_RECORDER_ENV[0]] = FLIGHT_RECORDER_ENTRIES
    env[FLIGHT_RECORDER_ENV[1]] = FLIGHT_RECORDER_ENTRIES  # torch < 2.8 reads only this name
    env.setdefault(DUMP_ON_TIMEOUT_ENV, "1")
    return True


def python_stacks(limit: int = MAX_STACK_CHARS) -> str:
    """Every thread's stack, innermost call last, as the interpreter would print a traceback."""
    names = {t.ident: t.name for t in threading.enumerate()}
    parts = []
    for ident, frame in sys._current_frames().items():
        lines = "".join(traceback.format_stack(frame))
        parts.append(f'Thread {ident} "{names.get(ident, "?")}" (most recent call last):\n{lines}')
    text = "\n".join(parts)
    return text if len(text) <= limit else text[: limit - 40] + "\n... (stacks cut at the size limit)\n"


def span_rows(spans, wall_of, open_spans=()) -> list[SpanRow]:
    """The last spans (closed ones oldest first, then the open ones outermost first) as evidence rows."""
    rows = []
    closed = list(spans)[-(MAX_EVIDENCE_SPANS - len(open_spans)) :] if len(open_spans) < MAX_EVIDENCE_SPANS else []
    for span, is_open in [*((s, False) for s in closed), *((s, True) for s in open_spans)][-MAX_EVIDENCE_SPANS:]:
        attrs = span.attrs or {}
        rows.append(
            SpanRow(
                str(span.kind),
                _text(attrs.get("op")),
                _text(attrs.get("group")),
                _int(attrs.get("peer")),
                _int(attrs.get("seq")),
                _int(attrs.get("stage")),
                _int(attrs.get("microbatch")),
                wall_of(span.start),
                None if is_open else wall_of(span.end),
            )
        )
    return rows


def open_chain(current) -> list:
    """The open spans, outermost first (current's parents)."""
    chain = []
    while current is not None:
        chain.append(current)
        current = getattr(current, "parent", None)
    return chain[::-1]


def _text(v) -> str | None:
    return str(v)[:64] if v is not None else None


def _int(v) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) and 0 <= v < (1 << 31) else None


def flight_recorder(directory: str | None, rank: int, decision: int) -> FlightRecorder:
    """Dump torch's Flight Recorder to a file beside the run's logs; the file's path, or why there is none."""
    torch = sys.modules.get("torch")
    if torch is None:
        return FlightRecorder(error="torch is not loaded")
    dist = torch.distributed
    if not dist.is_available() or not dist.is_initialized():
        return FlightRecorder(error="no process group")
    c10d = torch._C._distributed_c10d
    dump = getattr(c10d, "_dump_fr_trace", None) or getattr(c10d, "_dump_nccl_trace", None)
    if dump is None:
        return FlightRecorder(error=f"torch {torch.__version__} has no Flight Recorder dump")
    try:
        raw = dump()
        import pickle

        entries = len(pickle.loads(raw).get("entries", ()))
        if not entries and not any(os.environ.get(n, "0") not in ("", "0") for n in FLIGHT_RECORDER_ENV):
            return FlightRecorder(entries=0, error="the Flight Recorder is off (TORCH_FR_BUFFER_SIZE=0)")
        folder = directory or tempfile.gettempdir()
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, f"flight-recorder-rank{rank}-decision{decision}.pkl")
        with open(path, "wb") as f:
            f.write(raw)
        return FlightRecorder(path=os.path.abspath(path), entries=entries)
    except Exception as exc:  # evidence is best effort: never a crash of the reporter thread
        return FlightRecorder(error=re.sub(CONTROL_CHARS, " ", f"{type(exc).__name__}: {exc}")[:200])
