"""The dashboard's web server: one page, its two static files, and ``/api/swarm``.

Built on the standard library's :class:`http.server.ThreadingHTTPServer`, in a thread: the dashboard
serves three files and one JSON document, read-only, to a few browsers, and it must run inside a
training peer (``join --dashboard-port``) without touching the peer's asyncio loops (hivemind's and
ours) or adding a dependency every volunteer installs. The DHT is read by a separate poller thread
every ``period`` seconds (:class:`~p2pdiloco.dashboard.view.SwarmView`); a request never waits on
the DHT. It listens on 127.0.0.1 unless told otherwise; the data it shows is the DHT's, public to
anyone in the swarm anyway.

Routes (GET only; anything else is 404 / 405):

    /                  the page (static/index.html)
    /static/<file>     dashboard.js, dashboard.css
    /api/swarm         the view as JSON (docs/dashboard.md), ``Cache-Control: no-store``

Every response carries a Content-Security-Policy that allows only this origin's own script and
style (no inline script, no eval): defence in depth behind the page's rule of building the DOM
with ``textContent`` only, since peer records come from strangers.
"""
from __future__ import annotations

import errno
import json
import logging
import os
import signal
import socket
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Optional

from ..errors import UserError
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


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True  # a restarted dashboard can take its port back at once (not a port in use)


def _handler(view: SwarmView) -> type:
    class Handler(BaseHTTPRequestHandler):
        server_version = "p2pdiloco-dashboard"
        sys_version = ""

        def do_HEAD(self) -> None:  # noqa: N802 (http.server's naming)
            self.do_GET(head=True)

        def do_GET(self, head: bool = False) -> None:  # noqa: N802
            self._head = head
            path = self.path.split("?", 1)[0]
            if path == "/api/swarm":
                body = json.dumps(view.document(), allow_nan=False, separators=(",", ":")).encode()
                self._send(200, "application/json", body, cache="no-store")
            elif path in _FILES:
                name, ctype = _FILES[path]
                with open(os.path.join(STATIC, name), "rb") as f:
                    self._send(200, ctype, f.read(), cache="no-cache")
            else:
                self._send(404, "text/plain; charset=utf-8", b"not found\n")

        def do_POST(self) -> None:  # noqa: N802
            self._send(405, "text/plain; charset=utf-8", b"read-only\n")

        do_PUT = do_DELETE = do_PATCH = do_POST

        def _send(self, code: int, ctype: str, body: bytes, cache: str = "no-store") -> None:
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Cache-Control", cache)
            for k, v in _HEADERS.items():
                self.send_header(k, v)
            self.end_headers()
            if not getattr(self, "_head", False):
                self.wfile.write(body)

        def log_message(self, fmt: str, *args: Any) -> None:
            logger.debug("dashboard: " + fmt, *args)

    return Handler


class Dashboard:
    """An HTTP server for ``view`` plus the poller thread that refreshes it.

    :param option: how the user chose the port (``--port``, ``--dashboard-port``): named in errors.
    :raises UserError: the address cannot be listened on (port in use, not ours to bind, bad host).
    """

    def __init__(self, view: SwarmView, host: str = "127.0.0.1", port: int = 8080, option: str = "--port"):
        self.view = view
        _Server.address_family = socket.AF_INET6 if ":" in host else socket.AF_INET
        try:
            self.httpd = _Server((host, port), _handler(view))
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
    view.attach(lambda: node.get_subkeys(f"{view.run_id}:progress"),
                lambda: node.get_subkeys(f"{view.run_id}:fingerprint"))


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
