"""The applier reads what a command concerns once (handlers/rules/judgment.py, ``reads``), on a real API
server: each object kind at most one GET per try of a command, counted at the client (the API
server also answers KubeVirt's controllers)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import pytest
from kubernetes import client

from handlers.contracts.messages import Command, ObjectRef
from streams.kube.applying import KubeApplier
from tests.kube.test_applier_cache import create_vm, project_namespace, requests_sent, set_gpu  # noqa: F401
from tests.kube.test_applying import command, create_vm_command, make_node, vm_ref, vmi_ref  # noqa: F401

pytestmark = pytest.mark.kube


def kind_of(path: str) -> str:
    if "/virtualmachineinstances/" in path:
        return "VirtualMachineInstance"
    if "/virtualmachines/" in path:
        return "VirtualMachine"
    return "Node" if path.startswith("/api/v1/nodes/") else "Namespace"


def applied_reading(api: client.ApiClient, issued: Command) -> tuple[str, Counter[str], int]:
    """The outcome of ``issued``, the GETs it sent by kind, and how many writes."""
    fresh = client.ApiClient(api.configuration)  # a client of its own: only this command's requests
    try:
        sent = requests_sent(fresh)
        outcome = KubeApplier(fresh).apply(issued).outcome
    finally:
        fresh.close()
    return outcome, Counter(kind_of(path) for method, path in sent if method == "GET"), \
        sum(method != "GET" for method, _ in sent)


def test_each_command_reads_each_object_it_concerns_at_most_once_per_try(
    api: client.ApiClient, project_namespace: str, make_node: Callable[..., str]  # noqa: F811
) -> None:
    namespace = project_namespace
    vm = create_vm(api, namespace, "vm-1")
    node = make_node()
    node_ref = ObjectRef(kind="Node", name=node)

    outcome, reads, writes = applied_reading(api, set_gpu(vm))
    assert outcome in ("applied", "conflict_retried")
    assert reads == {"Namespace": writes, "VirtualMachine": writes}  # one read of each per try: a 409 is a try of its own

    for issued, read in [
        (create_vm_command(namespace, "vm-2"), {"Namespace": 1, "VirtualMachine": 1}),
        (command("restart_vm", vm_ref(namespace, "vm-1")), {"Namespace": 1, "VirtualMachine": 1,
                                                             "VirtualMachineInstance": 1}),
        (command("stop_vm", vm_ref(namespace, "vm-1")), None),
        (command("delete_vmi", vmi_ref(namespace, "vm-1")), {"Namespace": 1}),
        (command("cancel_evacuation", vmi_ref(namespace, "vm-1"), evacuation_node=node),
         {"Namespace": 1, "VirtualMachineInstance": 1}),
        (command("cordon_node", node_ref), {"Node": 1}),
        (command("uncordon_node", node_ref), {"Node": 1}),
    ]:
        outcome, reads, _ = applied_reading(api, issued)
        assert max(reads.values()) == 1, (issued.type, outcome, reads)
        if read is not None:  # a stop virt-api refuses is judged on the VMI, read then
            assert reads == read, (issued.type, outcome, reads)
