"""promtool and prometheus-operator's CRDs, for the tests of deploy/components/monitoring.

``tools/monitoring/build.sh`` builds promtool and copies the ServiceMonitor and
PrometheusRule CRDs from the Go module proxy, at the versions its go.mod and go.sum pin,
into the cache (``$VMSTREAM_CACHE_DIR`` or ``~/.cache/vmstream``): ``make parts`` asks for
them, so a fresh clone gets them itself.
"""

from __future__ import annotations

import re
from pathlib import Path

from harness.locations import REPO_ROOT, ThirdPartyDataError, built, cache_dir

MONITORING_DIR = REPO_ROOT / "tools" / "monitoring"
PROMETHEUS_MODULE = "github.com/prometheus/prometheus"
OPERATOR_MODULE = "github.com/prometheus-operator/prometheus-operator"


class MonitoringToolsError(ThirdPartyDataError):
    """tools/monitoring's go.mod and go.sum do not pin what it builds."""


def versions() -> tuple[str, str]:
    """(prometheus, prometheus-operator) as tools/monitoring pins them: the one required in
    go.mod, the other only downloaded, so go.sum pins it."""
    gomod = (MONITORING_DIR / "go.mod").read_text()
    gosum = (MONITORING_DIR / "go.sum").read_text()
    prometheus = re.search(rf"^\s*(?:require\s+)?{re.escape(PROMETHEUS_MODULE)}\s+(v\S+)", gomod, re.MULTILINE)
    operator = re.search(rf"^{re.escape(OPERATOR_MODULE)} (v[^\s/]+) h1:", gosum, re.MULTILINE)
    if prometheus is None or operator is None:
        raise MonitoringToolsError(f"{MONITORING_DIR} does not pin {PROMETHEUS_MODULE} and {OPERATOR_MODULE}")
    return prometheus.group(1), operator.group(1)


def monitoring_dir() -> Path:
    """``promtool`` and ``crds/`` at the pinned versions, built first if the cache lacks them."""
    prometheus, operator = versions()
    return built(cache_dir() / "monitoring" / f"prometheus-{prometheus}-operator-{operator}",
                 f"{PROMETHEUS_MODULE} {prometheus}\n{OPERATOR_MODULE} {operator}",
                 MONITORING_DIR / "build.sh", tool="go",
                 what=f"promtool {prometheus} and prometheus-operator {operator}'s CRDs (minutes the first time)")


def promtool() -> Path:
    return monitoring_dir() / "promtool"


def operator_crds() -> list[Path]:
    """The ServiceMonitor and PrometheusRule CRDs."""
    return sorted((monitoring_dir() / "crds").glob("*.yaml"))
