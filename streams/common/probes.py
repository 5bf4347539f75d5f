"""``/health``, ``/ready`` and ``/metrics`` for the processes that have no web server of their own.

The worker answers these through Faust's web server; the applier and the watch bridge are
plain threads around blocking clients, so they get this: a small HTTP server on a daemon
thread, bound to loopback unless told otherwise.

- ``/health`` — 200 while the process runs (liveness: a hung process stops answering).
- ``/ready`` — 200 when ``ready()`` says so, else 503; the body is ``{"ready": …}`` plus
  whatever ``details()`` adds.
- ``/metrics`` — the process's own Prometheus registry (:func:`streams.common.metrics.registry`).

    probes = ProbeServer(ready=applier.ready.is_set, port=6067, process="apply").start()
    ...
    probes.close()
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest

from streams.common import metrics

log = logging.getLogger(__name__)


class ProbeServer:
    """Serves the three pages on ``host:port`` (``port=0``: any free port, see :attr:`port`);
    ``/metrics`` shows ``process``'s registry (or the registry given)."""

    def __init__(
        self,
        *,
        ready: Callable[[], bool],
        host: str = "127.0.0.1",
        port: int = 0,
        process: metrics.Process | CollectorRegistry,
        details: Callable[[], dict[str, Any]] | None = None,
        before_metrics: Callable[[], None] | None = None,
    ) -> None:
        self.ready = ready
        self.registry = process if isinstance(process, CollectorRegistry) else metrics.registry(process)
        self.details = details
        self.before_metrics = before_metrics
        self._server = ThreadingHTTPServer((host, port), _handler(self))
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="probes", daemon=True)

    @property
    def host(self) -> str:
        return str(self._server.server_address[0])

    @property
    def port(self) -> int:
        return int(self._server.server_address[1])

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> ProbeServer:
        self._thread.start()
        log.info("probes at %s (/health, /ready, /metrics)", self.url)
        return self

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def __enter__(self) -> ProbeServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- pages ---------------------------------------------------------------------------

    def page(self, path: str) -> tuple[int, str, bytes]:
        """``(status, content type, body)`` for ``path``."""
        if path == "/health":
            return 200, "application/json", b'{"ok": true}'
        if path == "/ready":
            try:
                ready = bool(self.ready())
                body: dict[str, Any] = {"ready": ready}
                if self.details is not None:
                    body.update(self.details())
            except Exception as exc:  # a failing check means not ready, and says why
                ready, body = False, {"ready": False, "error": f"{type(exc).__name__}: {exc}"}
            return (200 if ready else 503), "application/json", json.dumps(body, default=str).encode()
        if path == "/metrics":
            if self.before_metrics is not None:
                try:
                    self.before_metrics()
                except Exception:  # a stale gauge beats no metrics at all
                    log.exception("refreshing metrics failed")
            return 200, metrics.CONTENT_TYPE_LATEST, generate_latest(self.registry)
        return 404, "text/plain", b"not found\n"


def _handler(server: ProbeServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
            status, content_type, body = server.page(self.path.split("?", 1)[0])
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 — probes every few seconds: not worth a line each
            return

    return Handler


def add_probe_arguments(parser: argparse.ArgumentParser, default_port: int) -> None:
    """``--probe-host`` and ``--probe-port``, the same for every process that serves probes."""
    parser.add_argument("--probe-host", default=os.environ.get("VMSTREAM_PROBE_HOST", "127.0.0.1"),
                        help="address of /health, /ready and /metrics (default: $VMSTREAM_PROBE_HOST, "
                        "else loopback only)")
    parser.add_argument("--probe-port", type=int,
                        default=int(os.environ.get("VMSTREAM_PROBE_PORT", str(default_port))),
                        help=f"port of /health, /ready and /metrics (default: $VMSTREAM_PROBE_PORT, else "
                        f"{default_port}; 0: any free)")
