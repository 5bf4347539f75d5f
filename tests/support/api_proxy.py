"""A TEST TOOL, never shipped: a fault-injecting proxy in front of the real API server.

The applier reaches KubeVirt's subresources (``/apis/subresources.kubevirt.io/...``) through
the API server, which passes them to virt-api. To test what the applier does when that path
fails at the worst moment, a test points the applier's ``--subresource-url`` here instead:

* every request is forwarded to the API server **as the client that sent it** — the proxy
  reads the client certificate's CN and O and asks the API server to impersonate that user
  and those groups — and the API server's answer is relayed unchanged, so virt-api's own
  answers (202, 409 with its message, …) are what the applier sees;
* :meth:`ApiProxy.unavailable` answers the next requests 503 without forwarding them, as the
  aggregation layer does while virt-api is away;
* :meth:`ApiProxy.before_answering` runs a hook after the API server has answered a matching
  request and before the answer is relayed — to kill the caller there (its request took
  effect without its knowing) or to hold the answer.

``requests`` records (method, path, status relayed) for each request. It plays no part of
KubeVirt: virt-api and virt-controller behind it are the real ones.
"""

from __future__ import annotations

import http.client
import logging
import ssl
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import TracebackType
from typing import Any
from urllib.parse import urlsplit

from cryptography import x509
from cryptography.x509.oid import NameOID

from harness.pki import CertificateAuthority

log = logging.getLogger(__name__)


class ApiProxy:
    """Listens on 127.0.0.1 with a certificate of the local CA; forwards to ``server``.

    ``admin_cert``/``admin_key`` authenticate the proxy to the API server (it needs the right
    to impersonate); ``pki`` is the local CA's directory (``ca.crt``, ``ca.key``).
    """

    def __init__(self, server: str, pki: Path, admin_cert: Path, admin_key: Path, workdir: Path) -> None:
        target = urlsplit(server)
        self.host, self.port_upstream = target.hostname or "127.0.0.1", target.port or 443
        self.requests: list[tuple[str, str, int]] = []
        self._hooks: list[tuple[str, Callable[[], None]]] = []
        self._unavailable = 0
        self._lock = threading.Lock()
        cert, key = CertificateAuthority.load(pki).issue(workdir, "api-proxy", "api-proxy",
                                                         server_hosts=["127.0.0.1", "localhost"])
        serving = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=str(pki / "ca.crt"))
        serving.load_cert_chain(str(cert), str(key))
        serving.verify_mode = ssl.CERT_REQUIRED
        self._upstream = ssl.create_default_context(cafile=str(pki / "ca.crt"))
        self._upstream.load_cert_chain(str(admin_cert), str(admin_key))
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _forward(self) -> None:
                proxy._forward(self)

            do_GET = do_PUT = do_POST = do_PATCH = do_DELETE = _forward  # noqa: N815 (http.server's naming)

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
                log.debug("api proxy: " + format, *args)

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._server.socket = serving.wrap_socket(self._server.socket, server_side=True)
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self._server.server_address[1]}"

    def start(self) -> ApiProxy:
        self._thread = threading.Thread(target=self._server.serve_forever, name="api-proxy", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def __enter__(self) -> ApiProxy:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    # --- faults ----------------------------------------------------------------------------

    def unavailable(self, times: int) -> None:
        """Answer the next ``times`` requests 503, as the aggregator does while virt-api is away."""
        with self._lock:
            self._unavailable = times

    def before_answering(self, path_suffix: str, hook: Callable[[], None]) -> None:
        """Run ``hook`` once, when the API server has answered a request whose path ends so."""
        with self._lock:
            self._hooks.append((path_suffix, hook))

    def statuses(self, path_suffix: str) -> list[int]:
        """The status relayed for each request whose path ends with ``path_suffix``, in order."""
        with self._lock:
            return [status for _, path, status in self.requests if path.rstrip("/").endswith(path_suffix)]

    # --- forwarding ------------------------------------------------------------------------

    def _forward(self, request: BaseHTTPRequestHandler) -> None:
        body = request.rfile.read(int(request.headers.get("Content-Length") or 0))
        with self._lock:
            refuse = self._unavailable > 0
            self._unavailable -= int(refuse)
        if refuse:
            self._relay(request, 503, {"Content-Type": "application/json"},
                        b'{"kind":"Status","apiVersion":"v1","status":"Failure","reason":"ServiceUnavailable",'
                        b'"message":"the server is currently unable to handle the request","code":503}')
            return
        user, groups = _identity(request)
        headers = {k: v for k, v in request.headers.items()
                   if k.lower() not in ("host", "connection", "content-length", "authorization")
                   and not k.lower().startswith("impersonate-")}
        connection = http.client.HTTPSConnection(self.host, self.port_upstream, context=self._upstream, timeout=60)
        try:
            connection.putrequest(request.command, request.path, skip_accept_encoding=True)
            for key, value in headers.items():
                connection.putheader(key, value)
            connection.putheader("Impersonate-User", user)
            for group in groups:
                connection.putheader("Impersonate-Group", group)
            connection.putheader("Content-Length", str(len(body)))
            connection.endheaders(body)
            response = connection.getresponse()
            answer = response.read()
            status, answer_headers = response.status, dict(response.getheaders())
        finally:
            connection.close()
        with self._lock:
            matching = [h for h in self._hooks if request.path.rstrip("/").endswith(h[0])][:1]
            for entry in matching:
                self._hooks.remove(entry)
        for _, run in matching:
            run()
        self._relay(request, status, answer_headers, answer)

    def _relay(self, request: BaseHTTPRequestHandler, status: int, headers: dict[str, str], body: bytes) -> None:
        with self._lock:
            self.requests.append((request.command, request.path, status))
        try:
            request.send_response(status)
            for key, value in headers.items():
                if key.lower() not in ("content-length", "connection", "transfer-encoding"):
                    request.send_header(key, value)
            request.send_header("Content-Length", str(len(body)))
            request.end_headers()
            request.wfile.write(body)
        except OSError:  # the caller is gone (killed by a hook): nothing to answer
            pass


def _identity(request: BaseHTTPRequestHandler) -> tuple[str, list[str]]:
    """The user (CN) and groups (O) of the client certificate the caller presented."""
    der = request.connection.getpeercert(binary_form=True)
    subject = x509.load_der_x509_certificate(der).subject
    user = str(subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value)
    groups = [str(a.value) for a in subject.get_attributes_for_oid(NameOID.ORGANIZATION_NAME)]
    return user, groups
