"""The README's main command keeps working: ``python -m harness demo`` in both of its forms."""

from __future__ import annotations

import io

import pytest

from harness import demo

pytestmark = [pytest.mark.kafka]


def run_demo(*, kubernetes: bool) -> str:
    """The demo's printed output; printed here too when it fails, so that the failure shows
    what the demo saw up to then (every output, as the README's command prints it)."""
    out = io.StringIO()
    try:
        assert demo.run(out, kubernetes=kubernetes, notice_seconds=3, show_audit=False, timeout=90) == 0
    except BaseException:
        print(out.getvalue())
        raise
    return out.getvalue()


@pytest.mark.kube
def test_the_demo_with_kubernetes_in_the_loop(kafka_bootstrap: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KAFKA_BOOTSTRAP_SERVERS", kafka_bootstrap)
    text = run_demo(kubernetes=True)
    assert "in Kubernetes now: gpus=['nvidia.com/GB202GL_RTX_PRO_6000_BLACKWELL_SERVER_EDITION'] " \
           "cpu.model=host-passthrough requests.memory=32Gi evictionStrategy=External" in text
    assert "→ bob@example.com: VM spx-proj-b/dev-1 will have GPU" in text
    assert "in Kubernetes now: gpu-node-1 spec.unschedulable=true" in text
    assert text.count("drain_will_stop_gpu_vm") == 0 and text.count("is being drained") == 2
    assert "→ ops@example.com: Node gpu-node-1 has no GPU VM left" in text
    # gpu-node-1's two cards held by train-1 and batch-1; gpu-node-2's A100 unused.
    _assert_mail_and_console(text, rtx="total 4, in use 2, free 2", a100="total 1, in use 0, free 1")


def test_the_demo_on_kafka_alone(kafka_bootstrap: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KAFKA_BOOTSTRAP_SERVERS", kafka_bootstrap)
    text = run_demo(kubernetes=False)
    assert "command restart_vm VirtualMachine spx-proj-b/dev-1" in text
    assert text.count("is being drained") == 2 and "has no GPU VM left" in text
    # The scripted AZ (harness.scenarios.cluster) runs an A100 VM on gpu-node-2 too.
    _assert_mail_and_console(text, rtx="total 4, in use 2, free 2", a100="total 1, in use 1, free 0")


def _assert_mail_and_console(text: str, *, rtx: str, a100: str) -> None:
    """Each notification reached its owner's inbox once, through vmstream notify and the sink;
    the console's pages show bob's pending GPU and the classes' cards."""
    mails = [line for line in text.splitlines() if line.startswith("  mail    → ")]
    assert sorted(mails) == sorted([
        "  mail    → bob@example.com: [vmstream info] VirtualMachine spx-proj-b/dev-1: GPU change waits for a restart",
        "  mail    → alice@example.com: [vmstream warning] VirtualMachine spx-proj-a/train-1: "
        "will be stopped for a node drain",
        "  mail    → alice@example.com: [vmstream warning] VirtualMachine spx-proj-a/batch-1: "
        "will be stopped for a node drain",
        "  mail    → ops@example.com: [vmstream info] Node gpu-node-1: drain completed",
    ]), mails
    badge = ("  console GET /v1/vms/spx-proj-b/dev-1 → GPU now: none; "
             "after restart: NVIDIA RTX PRO 6000 Blackwell Server Edition (applies after restart)")
    assert badge in text
    classes = text.split("  console GET /v1/gpu-classes → AZ az1:\n", 1)[1].split("\n")[:2]
    assert sorted(classes) == [f"            NVIDIA RTX PRO 6000 Blackwell Server Edition: {rtx}",
                               f"            nvidia-a100: {a100}"], classes
    # Shown when bob's change is pending: after his set_gpu, before the drain.
    assert text.index("GPU change waits for a restart") < text.index(badge) < text.index("== ops drains")
