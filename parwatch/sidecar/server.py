"""Run the sidecar: two uvicorn servers (metrics, control) on one event loop.

One loop means the store and engine are only ever touched by one task at a time. We bind
the sockets ourselves so a port in use is a one-line error naming the flag, and we own
the signals: SIGTERM/SIGINT stop both servers, SIGHUP reloads the rules file.

Both listeners use uvicorn's httptools protocol (h11 where httptools is not installed), wrapped
so that connection counts, the time to send a request's head and its size are bounded per
listener (listener.py). h11 alone would cap the head, but took about twice httptools' CPU per
request at the leader's 2,048 digests a second (docs/benchmarks.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import gc
import logging
import resource
import signal
import socket
from typing import Literal

import uvicorn

from parwatch.sidecar.app import create_control_app, create_metrics_app
from parwatch.sidecar.config import TOKEN_ENV, Listen
from parwatch.sidecar.listener import Book, Watch, guarded
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


MAX_HEAD_BYTES = 16 * 1024
"""A request line and headers larger than this are refused (431) before they are read further."""
MAX_CONNECTIONS = 1024
"""Open connections per listener, fewer where the file limit needs it (connection_budget)."""
FD_RESERVE = 64
"""File descriptors kept for everything but connections: the state store, the writer, the leader client."""


def connection_budget(max_connections: int = MAX_CONNECTIONS) -> int:
    """Connections each of the two listeners may hold: the soft file limit is first raised as far as
    the hard one allows (up to what two full listeners need), and the budget fits in it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = 2 * max_connections + FD_RESERVE
    if soft != resource.RLIM_INFINITY and soft < want:
        raised = want if hard == resource.RLIM_INFINITY else min(want, hard)
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (raised, hard))
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if soft == resource.RLIM_INFINITY:
        return max_connections
    budget = min(max_connections, (soft - FD_RESERVE) // 2)
    if budget < max_connections:
        log.warning(
            "open file limit %d: each listener holds at most %d connections (raise `ulimit -n` for more)", soft, budget
        )
    return max(budget, 16)


def _http_protocol():
    """uvicorn's protocol class for its `http` setting: httptools (C) when installed, else h11."""
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

        return HttpToolsProtocol
    except ImportError:
        from uvicorn.protocols.http.h11_impl import H11Protocol

        return H11Protocol


def _uvicorn(app, lifespan: Literal["auto", "on", "off"], book: Book) -> _Server:
    # proxy_headers off: the connection book matches requests to connections by the socket's own peer.
    config = uvicorn.Config(
        Watch(app, book),
        log_level="warning",
        access_log=False,
        lifespan=lifespan,
        timeout_graceful_shutdown=5,
        server_header=False,
        http=guarded(_http_protocol(), book),
        h11_max_incomplete_event_size=MAX_HEAD_BYTES,
        proxy_headers=False,
    )
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
    budget = connection_budget()
    head = cfg.head_timeout_seconds
    body = cfg.body_timeout_seconds
    servers = [
        _uvicorn(create_metrics_app(sidecar), "off", Book(budget, head, MAX_HEAD_BYTES, body_seconds=body)),
        _uvicorn(
            create_control_app(sidecar),
            "on",
            Book(budget, head, MAX_HEAD_BYTES, body_seconds=body, on_close=sidecar.proofs.forget),
        ),
    ]
    log.info(
        "parwatch sidecar: metrics http://%s/metrics, control http://%s (token %s), rules %s, state %s",
        cfg.metrics_listen,
        cfg.control_listen,
        f"required, in {cfg.token_file}: give it to trainers with --parwatch-token-file, to the CLI with --token-file"
        if cfg.token_file
        else f"required, from {TOKEN_ENV}",
        cfg.rules_path or "packaged defaults",
        cfg.state_dir,
    )
    # What exists now (modules, the apps, the rules) lives as long as the process: out of every later
    # collection, a full one scans the run's live state only, not the imports (docs/benchmarks.md).
    gc.collect()
    gc.freeze()
    _run(_serve_all(sidecar, servers, [metrics_sock, control_sock]))


async def _serve_all(sidecar: Sidecar, servers, sockets) -> None:
    loop = asyncio.get_running_loop()

    def stop():
        for s in servers:
            s.should_exit = True

    loop.add_signal_handler(signal.SIGTERM, stop)
    loop.add_signal_handler(signal.SIGINT, stop)
    loop.add_signal_handler(signal.SIGHUP, sidecar.reload_rules)
    tasks = [asyncio.create_task(s.serve(sockets=[sock])) for s, sock in zip(servers, sockets)]
    # If one server stops (shutdown, or failed lifespan), stop the other too.
    done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    stop()
    await asyncio.gather(*pending, return_exceptions=True)
    for t in done:
        t.result()
    for s in servers:
        if not s.started:
            raise StartupError("a listener failed to start; see the log above")
