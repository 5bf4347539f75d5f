"""The probe server of the applier and the watch bridge: /health, /ready, /metrics."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

from prometheus_client import CollectorRegistry, Counter

from streams.common.probes import ProbeServer

REGISTRY = CollectorRegistry()
PROBED = Counter("vmstream_test_probed_total", "A counter only the probe test increments", registry=REGISTRY)


def _get(url: str) -> tuple[int, str, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status, response.headers["Content-Type"], response.read()
    except urllib.error.HTTPError as error:
        return error.code, error.headers["Content-Type"], error.read()


def test_health_ready_and_metrics_on_loopback() -> None:
    state = {"ready": False}
    refreshed = []
    with ProbeServer(ready=lambda: state["ready"], details=lambda: {"ledger": 3},
                     before_metrics=lambda: refreshed.append(1), process=REGISTRY) as probes:
        assert probes.host == "127.0.0.1" and probes.port > 0
        assert _get(probes.url + "/health")[0] == 200
        status, _, body = _get(probes.url + "/ready")
        assert status == 503 and json.loads(body) == {"ready": False, "ledger": 3}
        state["ready"] = True
        status, _, body = _get(probes.url + "/ready")
        assert status == 200 and json.loads(body) == {"ready": True, "ledger": 3}
        PROBED.inc(7)
        status, content_type, body = _get(probes.url + "/metrics")
        assert status == 200 and content_type.startswith("text/plain")
        assert "vmstream_test_probed_total 7.0" in body.decode()
        assert refreshed == [1]
        assert _get(probes.url + "/nothing")[0] == 404


def test_a_failing_readiness_check_is_not_ready() -> None:
    def broken() -> bool:
        raise RuntimeError("ledger unreadable")

    with ProbeServer(ready=broken, process="apply") as probes:
        status, _, body = _get(probes.url + "/ready")
        assert status == 503 and "ledger unreadable" in json.loads(body)["error"]
