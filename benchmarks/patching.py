"""What the benchmarks of patching VMs share: the VMs, the patch, the watch that sees it land,
and the CPU each process spent meanwhile.

``apply_rate.py`` (commands → VM patched) and ``intent_to_patch.py`` (intents → VM patched)
both measure against the same anchor: the GPU rules' JSON patch the worker plans for a VM,
guarded by its ``resourceVersion``, sent by a plain kubernetes client straight to the API
server. Both count a VM as patched when their own watch on the API server shows the GPU in
its template, never by what the code under test reports.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import kit  # noqa: E402  (this directory's: puts the repository on sys.path)
from kubernetes import client, watch  # noqa: E402

from handlers.enforcement import FIELD_MANAGER  # noqa: E402
from handlers.gpus import desired_vm, plan_patch  # noqa: E402
from handlers.messages import GPUMutation  # noqa: E402
from harness.scenarios import A100, PROJECT_LABEL  # noqa: E402
from streams.kube.applying import JSON_PATCH, KUBEVIRT  # noqa: E402

NAMESPACE = "spx-bench"
# What config.yaml's nvidia-a100 class asks of a VM: the patch of a ``set_gpu`` to it.
MUTATION = GPUMutation(device_name=A100, eviction_strategy="External")

Patches = dict[str, tuple[list[dict[str, Any]], str]]  # name → (JSON patch, resourceVersion)


def vm_body(name: str) -> dict[str, Any]:
    return {
        "apiVersion": "kubevirt.io/v1", "kind": "VirtualMachine",
        "metadata": {"name": name, "namespace": NAMESPACE, "labels": {PROJECT_LABEL: "bench"},
                     "annotations": {"vmstream.io/owner": "bench@example.com"}},
        "spec": {"runStrategy": "Manual", "template": {"spec": {
            "domain": {"cpu": {"cores": 2}, "memory": {"guest": "4Gi"},
                       "devices": {"disks": [{"name": "root", "disk": {"bus": "virtio"}}]}},
            "volumes": [{"name": "root", "containerDisk": {"image": "quay.io/containerdisks/ubuntu:24.04"}}]}}},
    }


def create_vms(api: client.ApiClient, names: Sequence[str], threads: int = 8) -> None:
    """The project namespace (the applier writes nowhere else, docs/security.md) and the VMs."""
    client.CoreV1Api(api).create_namespace({"metadata": {"name": NAMESPACE, "labels": {PROJECT_LABEL: "bench"}}})
    custom = client.CustomObjectsApi(api)
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(lambda n: custom.create_namespaced_custom_object(*KUBEVIRT, NAMESPACE, "virtualmachines",
                                                                        vm_body(n)), names))


class PatchWatcher(threading.Thread):
    """Records when each VM's template first shows a GPU, from a watch on the API server."""

    def __init__(self, api: client.ApiClient, resource_version: str) -> None:
        super().__init__(daemon=True)
        self.custom = client.CustomObjectsApi(api)
        self.resource_version = resource_version
        self.patched: dict[str, float] = {}
        self.stop = threading.Event()

    def run(self) -> None:
        stream = watch.Watch()
        while not self.stop.is_set():
            for event in stream.stream(self.custom.list_namespaced_custom_object, *KUBEVIRT, NAMESPACE,
                                       "virtualmachines", resource_version=self.resource_version,
                                       timeout_seconds=5):
                obj = event["object"]
                self.resource_version = obj["metadata"]["resourceVersion"]
                gpus = obj["spec"]["template"]["spec"]["domain"].get("devices", {}).get("gpus")
                if gpus and obj["metadata"]["name"] not in self.patched:
                    self.patched[obj["metadata"]["name"]] = time.monotonic()


def watch_patches(api: client.ApiClient) -> PatchWatcher:
    """A watcher started from now: only patches made from here on are seen."""
    listed = client.CustomObjectsApi(api).list_namespaced_custom_object(*KUBEVIRT, NAMESPACE, "virtualmachines",
                                                                        limit=1)
    watcher = PatchWatcher(api, listed["metadata"]["resourceVersion"])
    watcher.start()
    return watcher


def wait_patched(watcher: PatchWatcher, names: Sequence[str], timeout: float = 900.0) -> float:
    """When the last of ``names`` was seen patched."""
    deadline = time.monotonic() + timeout
    while any(name not in watcher.patched for name in names):
        if time.monotonic() > deadline:
            missing = sum(name not in watcher.patched for name in names)
            raise TimeoutError(f"{missing} of {len(names)} VMs not patched in {timeout}s")
        time.sleep(0.1)  # waiting for the watch thread's record
    return max(watcher.patched[name] for name in names)


def planned(custom: client.CustomObjectsApi, names: Sequence[str]) -> Patches:
    """name → (the GPU rules' JSON patch for the live VM, its resourceVersion), as the worker plans it."""
    listed = custom.list_namespaced_custom_object(*KUBEVIRT, NAMESPACE, "virtualmachines")
    live = {vm["metadata"]["name"]: vm for vm in listed["items"]}
    return {name: (plan_patch(live[name], desired_vm(live[name], MUTATION)), live[name]["metadata"]["resourceVersion"])
            for name in names}


def anchor_request(custom: client.CustomObjectsApi, patches: Patches) -> Callable[[str], None]:
    """The anchor: the applier's own request (``KubeApplier._patch_vm``), straight from a plain client."""

    def send(name: str) -> None:
        patch, rv = patches[name]
        custom.patch_namespaced_custom_object(
            *KUBEVIRT, NAMESPACE, "virtualmachines", name,
            [{"op": "replace", "path": "/metadata/resourceVersion", "value": rv}, *patch],
            _content_type=JSON_PATCH, field_manager=FIELD_MANAGER)

    return send


def cpu_split(pids: dict[str, int]) -> dict[str, float]:
    """CPU-seconds so far of each process in ``pids``, and of the whole machine."""
    return {**{name: kit.cpu_of(pid).total for name, pid in pids.items()}, "machine": kit.machine_busy()}


def add_split(into: dict[str, float], before: dict[str, float], after: dict[str, float]) -> None:
    for name, value in after.items():
        into[name] = into.get(name, 0.0) + value - before[name]


def split_line(split: dict[str, float], count: int, processes: Sequence[str]) -> str:
    """The machine's CPU per VM patched, each process's, and the rest of the machine's (other jobs)."""
    named = sum(split.get(name, 0.0) for name in processes)
    cells = [f"{name} {1000 * split[name] / count:.1f}" for name in processes if split.get(name, 0.0) * 1000 / count >= 0.05]
    return (f"machine {1000 * split['machine'] / count:.1f} ms per VM patched: " + ", ".join(cells)
            + f", other {1000 * max(split['machine'] - named, 0.0) / count:.1f}")
