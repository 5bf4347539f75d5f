"""The README's main command keeps working: ``vmstream demo`` in both of its forms."""

from __future__ import annotations

import io

import pytest

from streams import demo

pytestmark = [pytest.mark.kafka]


@pytest.mark.kube
def test_the_demo_with_kubernetes_in_the_loop(kafka_bootstrap: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KAFKA_BOOTSTRAP_SERVERS", kafka_bootstrap)
    out = io.StringIO()
    assert demo.run(out, kubernetes=True, notice_seconds=3, show_audit=False, timeout=90) == 0
    text = out.getvalue()
    assert "in Kubernetes now: gpus=['nvidia.com/GB202GL_RTX_PRO_6000_BLACKWELL_SERVER_EDITION'] " \
           "cpu.model=host-passthrough requests.memory=32Gi evictionStrategy=External" in text
    assert "→ bob@example.com: VM spx-proj-b/dev-1 will have GPU" in text
    assert "in Kubernetes now: gpu-node-1 spec.unschedulable=true" in text
    assert text.count("drain_will_stop_gpu_vm") == 0 and text.count("is being drained") == 2
    assert "→ ops@example.com: Node gpu-node-1 has no GPU VM left" in text


def test_the_demo_on_kafka_alone(kafka_bootstrap: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KAFKA_BOOTSTRAP_SERVERS", kafka_bootstrap)
    out = io.StringIO()
    assert demo.run(out, kubernetes=False, notice_seconds=3, show_audit=False, timeout=90) == 0
    text = out.getvalue()
    assert "command restart_vm VirtualMachine spx-proj-b/dev-1" in text
    assert text.count("is being drained") == 2 and "has no GPU VM left" in text
