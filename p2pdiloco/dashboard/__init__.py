"""A live web dashboard of a run, read from the DHT: ``p2pdiloco dashboard`` or
``p2pdiloco join --dashboard-port N``.

    view.py     what the page shows, accumulated from successive reads of the progress records
    server.py   the HTTP server (standard library selectors, one thread, bounded connections) and the DHT poller
    status.py   what ``p2pdiloco status`` prints (the table, or the records as JSON)
    static/     the page: index.html, dashboard.js (hand-written SVG charts), dashboard.css

The JSON it serves at ``/api/swarm`` is documented in docs/dashboard.md.
"""
from .server import Dashboard, run_dashboard, serve_for_node
from .view import SwarmView, digest_agreement, live_records

__all__ = ["Dashboard", "SwarmView", "digest_agreement", "live_records", "run_dashboard", "serve_for_node"]
