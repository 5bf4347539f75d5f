"""The figures the worker's gauges show: GPUs per class, VMs waiting for a card or a restart,
open drains with their deadlines and the GPU VMs they still have."""

from __future__ import annotations

from datetime import timedelta

from handlers.reads.figures import NO_GPU, figures
from samples.cluster import A100, RTX, node, vm, vmi
from tests.support.harness import START, Harness

ALICE, OPS = "alice@example.com", "ops@example.com"


def by_class(h: Harness) -> dict[str, tuple[int, int, int, int, int, int]]:
    """class → (total, schedulable, used, free, waiting for a card, pending a restart)."""
    return {c.class_id: (c.capacity.total, c.capacity.schedulable, c.capacity.used, c.capacity.free,
                         c.waiting_for_gpu, c.pending_restart)
            for c in figures(h.state, h.engine.catalog).classes}


def az() -> Harness:
    h = Harness()
    h.observe_all(
        node("gpu-node-1", gpus={RTX: 2, A100: 1}),
        node("gpu-node-2", gpus={RTX: 1}),
        vm("p", "always-1", project="proj-a", owner=ALICE, gpu=RTX),
        vmi("p", "always-1", node_name="gpu-node-1", gpu=RTX),
        vm("p", "cpu-1", project="proj-a", owner=ALICE),
        vmi("p", "cpu-1", node_name="gpu-node-2"),
    )
    return h


def test_every_configured_class_shows_its_cards_even_with_none() -> None:
    h = Harness()
    assert by_class(h) == {"nvidia-a100": (0, 0, 0, 0, 0, 0), "nvidia-rtx-pro-6000-bse": (0, 0, 0, 0, 0, 0)}
    h = az()
    assert by_class(h) == {"nvidia-a100": (1, 1, 0, 1, 0, 0), "nvidia-rtx-pro-6000-bse": (3, 3, 1, 2, 0, 0)}


def test_a_device_no_class_names_is_shown_by_its_device() -> None:
    h = Harness()
    h.observe(node("gpu-node-9", gpus={"nvidia.com/SOMETHING_ELSE": 4}))
    [other] = [c for c in figures(h.state, h.engine.catalog).classes if c.device_name == "nvidia.com/SOMETHING_ELSE"]
    assert other.class_id == "nvidia.com/SOMETHING_ELSE" and other.capacity.free == 4


def test_a_cordoned_node_counts_in_total_not_in_free() -> None:
    h = az()
    h.observe(node("gpu-node-2", gpus={RTX: 1}, unschedulable=True, rv=2), "MODIFIED")
    assert by_class(h)["nvidia-rtx-pro-6000-bse"][:4] == (3, 2, 1, 1)


def test_a_gpu_change_on_a_running_vm_is_pending_until_the_restart() -> None:
    h = az()
    h.observe(vm("p", "cpu-1", project="proj-a", owner=ALICE, gpu=A100, rv=2), "MODIFIED")
    assert by_class(h)["nvidia-a100"][5] == 1
    h.observe(vm("p", "always-1", project="proj-a", owner=ALICE, rv=2), "MODIFIED")  # its GPU taken away
    assert figures(h.state, h.engine.catalog).pending_without_gpu == 1
    h.observe(vmi("p", "cpu-1", node_name="gpu-node-1", gpu=A100, generation=2), "MODIFIED")
    assert by_class(h)["nvidia-a100"][5] == 0
    assert NO_GPU == "none"


def test_a_vm_whose_vmi_finds_no_card_waits_for_one() -> None:
    h = az()
    h.observe(vm("p", "big-1", project="proj-a", owner=ALICE, gpu=A100))
    h.observe(vmi("p", "big-1", node_name=None, phase="Scheduling", gpu=A100, unschedulable=True))
    assert by_class(h)["nvidia-a100"][4] == 1
    h.observe(vmi("p", "big-1", node_name="gpu-node-1", gpu=A100), "MODIFIED")
    assert by_class(h)["nvidia-a100"][4] == 0


def test_an_open_drain_shows_its_deadline_and_the_vms_it_still_has() -> None:
    h = az()
    h.intent("drain_node", {"node": "gpu-node-1", "reason": "firmware", "notice_seconds": 600}, by=OPS, project=None)
    h.observe(node("gpu-node-1", gpus={RTX: 2, A100: 1}, unschedulable=True, rv=2), "MODIFIED")
    [drain] = figures(h.state, h.engine.catalog).drains
    assert (drain.node, drain.source, drain.scope) == ("gpu-node-1", "intent", "node")
    assert drain.started_at == START and drain.deadline == START + timedelta(seconds=600)
    assert drain.vms_left == 1 and not drain.deadline_passed
    h.wait(600)
    h.tick()
    [drain] = figures(h.state, h.engine.catalog).drains
    assert drain.deadline_passed and drain.vms_left == 1  # stopped, not yet seen gone
    h.observe(vmi("p", "always-1", node_name="gpu-node-1", phase="Succeeded", gpu=RTX), "DELETED")
    h.observe(vmi("p", "always-1", node_name="gpu-node-2", gpu=RTX, generation=2))
    assert figures(h.state, h.engine.catalog).drains == ()
