"""The dashboard's web server: one page, its two static files, and ``/api/swarm``.

A small HTTP/1.0-style server on the standard library's :mod:`selectors`, in one thread: the
dashboard serves three files and one JSON document, read-only, and it must run inside a training
peer (``join --dashboard-port``) without touching the peer's asyncio loops (hivemind's and ours) or
adding a dependency every volunteer installs. The DHT is read by a separate poller thread every
``period`` seconds (:class:`~p2pdiloco.dashboard.view.SwarmView`), which also builds the JSON
document once per read; a request never waits on the DHT and never builds anything: it is answered
with bytes already made. It listens on 127.0.0.1 unless told otherwise; the data it shows is the
DHT's, public to anyone in the swarm anyway.

Routes (GET and HEAD; other methods are answered 405, unknown paths 404):

    /                  the page (static/index.html)
    /static/<file>     dashboard.js, dashboard.css
    /api/swarm         the view as JSON (docs/dashboard.md), ``Cache-Control: no-store``

Bounds, whatever the clients do: one thread serves every connection (no thread per connection);
at most ``max_connections`` are open (a new one closes the oldest still sending its request, or is
closed itself when all are being answered); a connection is closed after ``idle_timeout`` seconds
without progress and ``max_lifetime`` seconds in all; a request head longer than MAX_HEAD bytes is
refused (431); one response per connection (``Connection: close``).

Every response carries a Content-Security-Policy that allows only this origin's own script and
style (no inline script, no eval): defence in depth behind the page's rule of building the DOM
with ``textContent`` only, since peer records come from strangers.
"""
from __future__ import annotations

import errno
import logging
import os
import selectors
import signal
import socket
import sys
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

from ..errors import UserError
from ..swarm.keys import fingerprint_key, history_key, progress_key
from .view import SwarmView

__all__ = ["Dashboard", "serve_for_node", "run_dashboard"]

logger = logging.getLogger(__name__)

STATIC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "static")
_FILES = {
    "/": ("index.html", "text/html; charset=utf-8"),
    "/index.html": ("index.html", "text/html; charset=utf-8"),
    "/static/dashboard.js": ("dashboard.js", "text/javascript; charset=utf-8"),
    "/static/dashboard.css": ("dashboard.css", "text/css; charset=utf-8"),
}
_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; "
                               "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
}
_REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed",
            431: "Request Header Fields Too Large"}
_TEXT = "text/plain; charset=utf-8"

#: connection bounds (docs/dashboard.md): seconds without progress, seconds in all, open connections
IDLE_TIMEOUT = 10.0
MAX_LIFETIME = 60.0
MAX_CONNECTIONS = 64
#: bytes of a request's line and headers (a browser's are well under 2 KiB)
MAX_HEAD = 16 * 1024
#: seconds a connection that was answered is read (and discarded) before it is closed: closing a socket
#: with unread input resets it, and a reset can destroy the response before the client read it
_LINGER = 2.0

Response = Tuple[int, str, bytes, str]  # status, content type, body, Cache-Control


class _Conn:
    __slots__ = ("sock", "born", "idle_at", "head", "out", "sent", "state")

    def __init__(self, sock: socket.socket, now: float):
        self.sock, self.born, self.idle_at = sock, now, now
        self.head = bytearray()
        self.out: List[memoryview] = []
        self.sent = 0
        self.state = "reading"  # → "writing" → "closing"


class HttpServer:
    """The single-threaded server (see the module docstring); ``respond(method, path)`` makes a
    response and must not block. ``accepted``/``evicted``/``refused``/``timed_out`` count connections."""

    def __init__(self, host: str, port: int, respond: Callable[[str, str], Response], *,
                 idle_timeout: Optional[float] = None, max_lifetime: Optional[float] = None,
                 max_connections: Optional[int] = None):
        self.respond = respond
        self.idle_timeout = IDLE_TIMEOUT if idle_timeout is None else idle_timeout
        self.max_lifetime = MAX_LIFETIME if max_lifetime is None else max_lifetime
        self.max_connections = MAX_CONNECTIONS if max_connections is None else max_connections
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.socket = socket.socket(family, socket.SOCK_STREAM)
        try:
            # a restarted dashboard can take its port back at once (not a port in use)
            self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self.socket.bind((host, port))
            self.socket.listen(128)
            self.socket.setblocking(False)
        except OSError:
            self.socket.close()
            raise
        self.server_address = self.socket.getsockname()
        self._sel = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._sel.register(self.socket, selectors.EVENT_READ, None)
        self._sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._conns: Dict[int, _Conn] = {}
        self._stop = threading.Event()
        self._stopped = threading.Event()
        self.accepted = self.evicted = self.refused = self.timed_out = 0

    def serve_forever(self, poll_interval: float = 0.25) -> None:
        try:
            while not self._stop.is_set():
                for key, mask in self._sel.select(timeout=poll_interval):
                    if key.data is None:
                        self._accept()
                    elif key.data == "wake":
                        try:
                            self._wake_r.recv(64)
                        except OSError:
                            pass
                    else:
                        conn = key.data
                        if mask & selectors.EVENT_READ:
                            self._read(conn)
                        if mask & selectors.EVENT_WRITE and conn.state == "writing":
                            self._write(conn)
                self._expire(time.monotonic())
        finally:
            self._stopped.set()

    def shutdown(self) -> None:
        """Stop :meth:`serve_forever` (from another thread) and wait until it returned."""
        self._stop.set()
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass
        self._stopped.wait(5)

    def server_close(self) -> None:
        for conn in list(self._conns.values()):
            self._close(conn)
        for s in (self.socket, self._wake_r, self._wake_w):
            s.close()
        self._sel.close()

    # ---- connections ----------------------------------------------------------------------------------
    def _accept(self) -> None:
        for _ in range(64):  # a burst of connections is taken in batches between other work
            try:
                sock, _addr = self.socket.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:  # out of file descriptors, say: the backlog waits for the next round
                logger.debug(f"dashboard: accept failed: {e}")
                return
            now = time.monotonic()
            if len(self._conns) >= self.max_connections:
                waiting = [c for c in self._conns.values() if c.state == "reading"]
                if not waiting:
                    self.refused += 1
                    sock.close()
                    continue
                self.evicted += 1
                self._close(min(waiting, key=lambda c: c.born))
            sock.setblocking(False)
            conn = _Conn(sock, now)
            self._conns[sock.fileno()] = conn
            self._sel.register(sock, selectors.EVENT_READ, conn)
            self.accepted += 1

    def _read(self, conn: _Conn) -> None:
        try:
            data = conn.sock.recv(8192)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self._close(conn)
            return
        if conn.state != "reading":
            return  # input after the request (a body we do not read): discarded
        conn.idle_at = time.monotonic()
        conn.head += data
        end = conn.head.find(b"\r\n\r\n")
        if end < 0:
            end = conn.head.find(b"\n\n")
        if end < 0:
            if len(conn.head) > MAX_HEAD:
                self._answer(conn, "GET", (431, _TEXT, b"request head too large\n", "no-store"))
            return
        if end > MAX_HEAD:
            self._answer(conn, "GET", (431, _TEXT, b"request head too large\n", "no-store"))
            return
        line = bytes(conn.head[:conn.head.find(b"\n")]).decode("latin-1").strip().split()
        if len(line) != 3 or not line[2].startswith("HTTP/"):
            self._answer(conn, "GET", (400, _TEXT, b"bad request\n", "no-store"))
            return
        method, target = line[0], line[1]
        try:
            response = self.respond(method, target.split("?", 1)[0])
        except Exception:  # a bug of ours: this connection fails, the server goes on
            logger.exception("dashboard: request failed")
            self._close(conn)
            return
        self._answer(conn, method, response)

    def _answer(self, conn: _Conn, method: str, response: Response) -> None:
        code, ctype, body, cache = response
        head = [f"HTTP/1.1 {code} {_REASONS.get(code, 'Error')}", "Server: p2pdiloco-dashboard",
                f"Content-Type: {ctype}", f"Content-Length: {len(body)}", f"Cache-Control: {cache}",
                "Connection: close", *(f"{k}: {v}" for k, v in _HEADERS.items())]
        conn.out = [memoryview(("\r\n".join(head) + "\r\n\r\n").encode("latin-1"))]
        if method != "HEAD":
            conn.out.append(memoryview(body))
        conn.state = "writing"
        self._sel.modify(conn.sock, selectors.EVENT_READ | selectors.EVENT_WRITE, conn)
        self._write(conn)

    def _write(self, conn: _Conn) -> None:
        while conn.out:
            try:
                n = conn.sock.send(conn.out[0][conn.sent:])
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                self._close(conn)
                return
            conn.idle_at = time.monotonic()
            conn.sent += n
            if conn.sent < len(conn.out[0]):
                return
            conn.out.pop(0)
            conn.sent = 0
        try:
            conn.sock.shutdown(socket.SHUT_WR)
        except OSError:
            self._close(conn)
            return
        conn.state = "closing"
        conn.idle_at = time.monotonic()
        self._sel.modify(conn.sock, selectors.EVENT_READ, conn)

    def _expire(self, now: float) -> None:
        for conn in list(self._conns.values()):
            limit = _LINGER if conn.state == "closing" else self.idle_timeout
            if now - conn.idle_at > limit or now - conn.born > self.max_lifetime:
                if conn.state != "closing":
                    self.timed_out += 1
                self._close(conn)

    def _close(self, conn: _Conn) -> None:
        fd = conn.sock.fileno()
        if self._conns.pop(fd, None) is None:
            return
        try:
            self._sel.unregister(conn.sock)
        except (KeyError, ValueError):
            pass
        conn.sock.close()


def _static_files() -> Dict[str, Tuple[bytes, str]]:
    out = {}
    for path, (name, ctype) in _FILES.items():
        with open(os.path.join(STATIC, name), "rb") as f:
            out[path] = (f.read(), ctype)
    return out


def _responder(view: SwarmView) -> Callable[[str, str], Response]:
    files = _static_files()

    def respond(method: str, path: str) -> Response:
        if method not in ("GET", "HEAD"):
            return 405, _TEXT, b"read-only\n", "no-store"
        if path == "/api/swarm":
            return 200, "application/json", view.published(), "no-store"
        if path in files:
            body, ctype = files[path]
            return 200, ctype, body, "no-cache"
        return 404, _TEXT, b"not found\n", "no-store"

    return respond


class Dashboard:
    """An HTTP server for ``view`` plus the poller thread that refreshes it.

    :param option: how the user chose the port (``--port``, ``--dashboard-port``): named in errors.
    :param idle_timeout, max_lifetime, max_connections: the connection bounds (None: IDLE_TIMEOUT,
        MAX_LIFETIME, MAX_CONNECTIONS).
    :raises UserError: the address cannot be listened on (port in use, not ours to bind, bad host).
    """

    def __init__(self, view: SwarmView, host: str = "127.0.0.1", port: int = 8080, option: str = "--port", *,
                 idle_timeout: Optional[float] = None, max_lifetime: Optional[float] = None,
                 max_connections: Optional[int] = None):
        self.view = view
        try:
            self.httpd = HttpServer(host, port, _responder(view), idle_timeout=idle_timeout,
                                    max_lifetime=max_lifetime, max_connections=max_connections)
        except OSError as e:
            where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
            if e.errno == errno.EADDRINUSE:
                raise UserError(f"cannot serve the dashboard on {where}: the port is in use; choose another with "
                                f"{option} (0: any free port)") from None
            if e.errno == errno.EACCES:
                raise UserError(f"cannot serve the dashboard on {where}: permission denied (ports below 1024 "
                                f"need root); choose another with {option}") from None
            raise UserError(f"cannot serve the dashboard on {where}: {e.strerror or e}") from None
        self.host = host
        self.port = self.httpd.server_address[1]
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.25},
                                          name="p2pdiloco-dashboard-http", daemon=True)]
        self._threads[0].start()

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/"

    def poll(self) -> None:
        """Start reading the DHT every ``view.period`` seconds (after :meth:`SwarmView.attach`)."""
        def run() -> None:
            while True:
                self.view.refresh()
                if self._stop.wait(self.view.period):
                    return

        t = threading.Thread(target=run, name="p2pdiloco-dashboard-poll", daemon=True)
        t.start()
        self._threads.append(t)

    def close(self) -> None:
        self._stop.set()
        self.httpd.shutdown()
        self.httpd.server_close()
        for t in self._threads:
            t.join(timeout=5)


def _attach_node(view: SwarmView, node: Any) -> None:
    view.attach(lambda: node.get_subkeys(progress_key(view.run_id)),
                lambda: node.get_subkeys(fingerprint_key(view.run_id)),
                lambda: node.get_subkeys(history_key(view.run_id)))


def serve_for_node(node: Any, run_id: str, *, host: str, port: int, period: float = 2.0) -> Dashboard:
    """``join --dashboard-port``: serve the dashboard of ``run_id`` from a training peer, reading
    through the peer's own DHT node (in a thread of its own: training never waits on it)."""
    view = SwarmView(run_id, period=period)
    dash = Dashboard(view, host, port, option="--dashboard-port (train.dashboard_port)")
    _attach_node(view, node)
    dash.poll()
    logger.info(f"[{node.short_id}] dashboard of run {run_id!r}: {dash.url}")
    return dash


def run_dashboard(initial_peers: list, run_id: str, host: str, port: int, period: float = 2.0,
                  bootstrap_timeout: float = 20.0) -> int:
    """``p2pdiloco dashboard``: serve until SIGINT/SIGTERM. The page is up before the DHT is reached
    (it says "connecting"); an unreachable bootstrap peer ends the command with one error line."""
    from ..addresses import parse_maddrs
    from ..swarm.node import SwarmNode

    parse_maddrs(initial_peers, "initial peer", require_peer_id=True)  # a typo fails before anything starts
    if not 0 <= port <= 65535:
        raise UserError(f"--port ({port}) must be a TCP port, 0-65535 (0: any free port)")
    view = SwarmView(run_id, period=period)
    dash = Dashboard(view, host, port)
    node: Optional[Any] = None
    try:
        print(f"dashboard of run {run_id!r}: {dash.url}", flush=True)
        print("reading the swarm's records from the DHT (client mode); Ctrl-C stops", file=sys.stderr, flush=True)
        node = SwarmNode(initial_peers, host_maddrs=["/ip4/127.0.0.1/tcp/0"], bootstrap_timeout=bootstrap_timeout,
                         client_mode=True)
        _attach_node(view, node)
        dash.poll()
        stop = threading.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
        while not stop.wait(0.5):
            pass
        print("shutting down", file=sys.stderr, flush=True)
    finally:
        dash.close()
        if node is not None:
            node.shutdown()
    return 0
