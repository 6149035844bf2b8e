"""Run the sidecar: two uvicorn servers (metrics, control) on one event loop.

One loop means the store and engine are only ever touched by one task at a time. We bind
the sockets ourselves so a port in use is a one-line error naming the flag, and we own
the signals: SIGTERM/SIGINT stop both servers, SIGHUP reloads the rules file.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import gc
import importlib.util
import logging
import signal
import socket

import uvicorn

from parwatch.sidecar.app import create_control_app, create_metrics_app
from parwatch.sidecar.config import TOKEN_ENV, Listen
from parwatch.sidecar.gc_pacing import GcPacer
from parwatch.sidecar.service import Sidecar

log = logging.getLogger(__name__)


class StartupError(RuntimeError):
    """The sidecar cannot start; the message is one line that names the flag to change."""


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self):
        yield  # serve() installs the handlers for both servers


def bind(listen: Listen, flag: str) -> socket.socket:
    try:
        infos = socket.getaddrinfo(listen.host, listen.port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as err:
        raise StartupError(f"{flag} {listen}: cannot resolve host {listen.host!r} ({err.strerror})") from err
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # restart right after a stop (TIME_WAIT)
    try:
        sock.bind(address)
        sock.listen(2048)
    except OSError as err:
        sock.close()
        if err.errno == errno.EADDRINUSE:
            raise StartupError(
                f"port {listen.port} is already in use ({flag} {listen}); stop the other process or pick "
                f"another port with {flag} HOST:PORT"
            ) from err
        raise StartupError(f"{flag} {listen}: cannot listen ({err.strerror})") from err
    sock.setblocking(False)
    return sock


HTTP_PARSER = "httptools" if importlib.util.find_spec("httptools") else "h11"
"""httptools (C) parses a request in a fraction of h11's (pure Python) time: at 1024 posts/s the
parser was a large share of the loop's busy time (issue 12). h11 is the fallback."""


def _http_protocol(app):
    """The control listener answers its hot POSTs at the protocol (fast_http) when httptools is
    there; the metrics listener, and everything without httptools, uses uvicorn's own."""
    if HTTP_PARSER == "httptools" and getattr(app, "fast_posts", None) is not None:
        from parwatch.sidecar.fast_http import FastPostProtocol

        return FastPostProtocol
    return HTTP_PARSER


def _uvicorn(app, lifespan: str) -> _Server:
    # proxy_headers off: nothing here reads the client address, and uvicorn's middleware for it ran
    # on every request (~4% of the leader's CPU at 2,048 digests/s).
    config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan=lifespan,
                            timeout_graceful_shutdown=5, server_header=False, http=_http_protocol(app),
                            proxy_headers=False)
    return _Server(config)


def _run(main) -> None:
    """Run the servers on uvloop when installed (libuv: less loop overhead per request), else asyncio."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)


def serve(sidecar: Sidecar) -> None:
    """Bind both listeners (StartupError when one cannot) and serve until SIGTERM/SIGINT."""
    cfg = sidecar.config
    metrics_sock = bind(cfg.metrics_listen, "--metrics-listen")
    try:
        control_sock = bind(cfg.control_listen, "--control-listen")
    except StartupError:
        metrics_sock.close()
        raise
    servers = [_uvicorn(create_metrics_app(sidecar), "off"), _uvicorn(create_control_app(sidecar), "on")]
    log.info(
        "parwatch sidecar: metrics http://%s/metrics, control http://%s (token %s), rules %s, state %s",
        cfg.metrics_listen, cfg.control_listen,
        f"required, in {cfg.token_file}: give it to trainers with --parwatch-token-file, to the CLI with --token-file"
        if cfg.token_file else f"required, from {TOKEN_ENV}",
        cfg.rules_path or "packaged defaults", cfg.state_dir,
    )
    tune_gc()
    _run(_serve_all(sidecar, servers, [metrics_sock, control_sock]))


def tune_gc() -> None:
    """Request garbage is freed by reference counting; at ~1000 posts/s the default cycle-collector
    thresholds (700 allocations) run it hundreds of times a second, and its pauses showed as the
    ingest p99 (benchmarks/sidecar_load.py: 7.5 -> 3.9 ms outside scrapes). Collect less often,
    and keep the objects alive since startup (modules, rules) out of every full collection; while
    serving, gc_pacing.GcPacer keeps each second's surviving records out of the young generation."""
    gc.set_threshold(50_000, 20, 100)
    gc.freeze()


async def _serve_all(sidecar: Sidecar, servers, sockets) -> None:
    loop = asyncio.get_running_loop()

    def stop():
        for s in servers:
            s.should_exit = True

    loop.add_signal_handler(signal.SIGTERM, stop)
    loop.add_signal_handler(signal.SIGINT, stop)
    loop.add_signal_handler(signal.SIGHUP, sidecar.reload_rules)
    tasks = [asyncio.create_task(s.serve(sockets=[sock])) for s, sock in zip(servers, sockets)]
    pacer = asyncio.create_task(GcPacer().run())
    # If one server stops (shutdown, or failed lifespan), stop the other too.
    done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    stop()
    pacer.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    for t in done:
        t.result()
    for s in servers:
        if not s.started:
            raise StartupError("a listener failed to start; see the log above")
