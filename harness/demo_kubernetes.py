"""The demo with Kubernetes in the loop: a real kube-apiserver, the watch bridge, the applier.

It starts a Kafka broker and a local control plane (kube-apiserver + etcd with KubeVirt's
CRDs), creates a small AZ in it, and runs ``vmstream worker``, ``vmstream watch``,
``vmstream apply``, ``vmstream notify`` (to the demo's SMTP sink) and ``vmstream api`` as
their own processes. Then it asks for a GPU on a running VM (the VM
changes in Kubernetes, the owner is told it waits for a restart) and drains a GPU node (the
owners are told first, the node is cordoned, the GPU VMIs are deleted at the deadline).

No KubeVirt runs here, so where virt-controller would act — starting a VMI, replacing it on
a restart, recreating an ``Always`` VM after a drain — the demo's :class:`Cluster` does it,
and says so in the output (``[cluster]`` lines).
"""

from __future__ import annotations

import json
from contextlib import ExitStack
from pathlib import Path
from typing import Any, TextIO

from kubernetes import client
from kubernetes.client.rest import ApiException

from handlers.messages import object_key
from handlers.topics import K8S_EVENTS
from harness.demo_people import ApiProcess, Console, MailSink, NotifyProcess, mails_due, start_together
from harness.localkube import LocalKube
from harness.publishing import publish, scenario_records
from harness.running import CONFIG, Deployment, Outputs, VmstreamProcess, WorkerProcess
from harness.scenarios import A100, INTENTS, PROJECT_LABEL, RTX, kubevirt_cr, node, vm, vmi
from streams.common.credentials import DevSigner

KUBEVIRT = ("kubevirt.io", "v1")
ALICE, BOB, OPS = "alice@example.com", "bob@example.com", "ops@example.com"


def _created(obj: dict[str, Any]) -> dict[str, Any]:
    """An object as a client creates it: the server assigns uid and resourceVersion."""
    obj = {**obj, "metadata": dict(obj["metadata"])}
    for field in ("uid", "resourceVersion", "generation"):
        obj["metadata"].pop(field, None)
    return obj


class Cluster:
    """The demo's AZ in a real API server, and the part KubeVirt's controllers would play."""

    def __init__(self, api: client.ApiClient, out: TextIO) -> None:
        self.core = client.CoreV1Api(api)
        self.custom = client.CustomObjectsApi(api)
        self.out = out

    def say(self, text: str) -> None:
        self.out.write(f"  [cluster] {text}\n")
        self.out.flush()

    def create_az(self) -> set[str]:
        """Namespaces, nodes, the KubeVirt CR, VMs and their running VMIs; returns the
        k8s-events keys of what it created (``<Kind>/<namespace>/<name>``)."""
        created = {object_key("Namespace", None, "kubevirt")}
        self.core.create_namespace({"metadata": {"name": "kubevirt"}})
        for project in ("proj-a", "proj-b"):  # the applier writes only in project namespaces
            self.core.create_namespace({"metadata": {"name": f"spx-{project}", "labels": {PROJECT_LABEL: project}}})
            created.add(object_key("Namespace", None, f"spx-{project}"))
        nodes = [node("gpu-node-1", gpus={RTX: 2}), node("gpu-node-2", gpus={RTX: 2, A100: 1}), node("cpu-node-1")]
        for obj in nodes:
            self.core.create_node(_created(obj))
            created.add(object_key("Node", None, obj["metadata"]["name"]))
        cr = kubevirt_cr()
        self.custom.create_namespaced_custom_object(*KUBEVIRT, "kubevirt", "kubevirts", _created(cr))
        created.add(object_key("KubeVirt", "kubevirt", cr["metadata"]["name"]))
        vms = [
            (vm("spx-proj-a", "train-1", project="proj-a", owner=ALICE, gpu=RTX), "gpu-node-1", RTX),
            (vm("spx-proj-a", "batch-1", project="proj-a", owner=ALICE, run_strategy="Manual", gpu=RTX),
             "gpu-node-1", RTX),
            (vm("spx-proj-b", "dev-1", project="proj-b", owner=BOB, memory="32Gi"), "cpu-node-1", None),
        ]
        for obj, node_name, gpu in vms:
            namespace, name = obj["metadata"]["namespace"], obj["metadata"]["name"]
            self.custom.create_namespaced_custom_object(*KUBEVIRT, namespace, "virtualmachines", _created(obj))
            self.start_vmi(namespace, name, node_name, gpu)
            created |= {object_key("VirtualMachine", namespace, name), object_key("VirtualMachineInstance", namespace, name)}
        return created

    def start_vmi(self, namespace: str, name: str, node_name: str, gpu: str | None, generation: int = 1) -> None:
        """What virt-controller does for a VM that should run: a VMI, scheduled and running."""
        obj = vmi(namespace, name, node_name=node_name, gpu=gpu,
                  cpu_model="host-passthrough" if gpu else None, generation=generation)
        self.custom.create_namespaced_custom_object(*KUBEVIRT, namespace, "virtualmachineinstances", _created(obj))

    def delete_vmi(self, namespace: str, name: str) -> None:
        try:
            self.custom.delete_namespaced_custom_object(*KUBEVIRT, namespace, "virtualmachineinstances", name)
        except ApiException as exc:
            if exc.status != 404:
                raise

    def vmi_exists(self, namespace: str, name: str) -> bool:
        try:
            self.custom.get_namespaced_custom_object(*KUBEVIRT, namespace, "virtualmachineinstances", name)
            return True
        except ApiException as exc:
            if exc.status == 404:
                return False
            raise

    def gpu_fields(self, namespace: str, name: str) -> str:
        obj = self.custom.get_namespaced_custom_object(*KUBEVIRT, namespace, "virtualmachines", name)
        template = obj["spec"]["template"]["spec"]
        domain = template["domain"]
        gpus = [g["deviceName"] for g in domain.get("devices", {}).get("gpus", [])]
        return (f"gpus={gpus} cpu.model={domain.get('cpu', {}).get('model')} "
                f"requests.memory={domain.get('resources', {}).get('requests', {}).get('memory')} "
                f"evictionStrategy={template.get('evictionStrategy')} resourceVersion={obj['metadata']['resourceVersion']}")

    def cordoned(self, name: str) -> bool:
        return bool(self.core.read_node(name).spec.unschedulable)


def run(out: TextIO, stack: ExitStack, workdir: Path, bootstrap: str, printer: Any, *,
        notice_seconds: int, timeout: float) -> Outputs:
    out.write("starting a local kube-apiserver + etcd with KubeVirt's CRDs "
              "(built from the Go module proxy the first time: minutes)...\n")
    kube = stack.enter_context(LocalKube())
    cluster = Cluster(kube.api_client(), out)
    deployment = Deployment(bootstrap, workdir)
    deployment.create_topics()
    kubeconfig = str(kube.kubeconfig)
    # The worker verifies credentials (auth: jwt); the demo signs as an upstream service does.
    signer = DevSigner(workdir, operators=[OPS])
    worker = WorkerProcess(deployment, "worker", env=signer.worker_env()).start()
    stack.callback(worker.stop)
    for name, command in (("watch", ["watch"]), ("apply", ["apply"])):
        process = VmstreamProcess(deployment, name, [*command, "--config", str(CONFIG), "--kubeconfig", kubeconfig])
        process.start()
        stack.callback(process.stop)
    sink = stack.enter_context(MailSink(out))
    notify = NotifyProcess(deployment, sink)
    api = ApiProcess(deployment)
    start_together(stack, [notify, api])
    outputs = Outputs(deployment, on_arrival=printer)
    stack.callback(outputs.close)
    console = Console(api, outputs, out)
    out.write(f"API server {kube.server}; worker, watch bridge and applier running "
              f"(logs in {workdir}); worker pages: http://127.0.0.1:{worker.web_port}/ready /capacity /pending\n")
    out.write(f"notify delivering to an SMTP sink on 127.0.0.1:{sink.port}; console API {api.url}/v1/…\n")

    def mailed(o: Outputs) -> bool:
        return sink.count() >= mails_due(o)

    out.write("\n== the AZ: 3 nodes, the KubeVirt CR, 3 VMs of alice and bob, running\n")
    created = cluster.create_az()
    events = deployment.kafka.topic(K8S_EVENTS.name)
    # Each object by its key: the API server's own namespaces (default, kube-system, …) are
    # watched too, so a count of audit records can be reached before bob's VM is observed.
    outputs.wait_for(lambda o: created <= {a["input"]["key"] for a in o.audits(input__topic=events)},
                     timeout=timeout, what="the watch bridge's events of every object created decided")
    out.write(f"  the worker has observed the {len(created)} objects created, through the watch bridge\n")

    out.write("\n== bob asks for a GPU on his running VM dev-1\n")
    publish_signed(deployment, signer, [_intent("demo-gpu-1", "set_gpu", {"namespace": "spx-proj-b", "name": "dev-1",
                                                               "gpu_class": "nvidia-rtx-pro-6000-bse"},
                                      by=BOB, project="proj-b")])
    outputs.wait_for(lambda o: bool(o.results(cause="demo-gpu-1", type="patch_vm", outcome="applied")
                                    and o.notifications("gpu_change_pending_restart")) and mailed(o),
                     timeout=timeout, what="bob's patch applied and bob told, by mail too")
    out.write(f"  in Kubernetes now: {cluster.gpu_fields('spx-proj-b', 'dev-1')}\n")
    out.write(f"  waiting for a restart: {[p['vm'] for p in worker.page('/pending')]}\n")
    console.show_badge("spx-proj-b", "dev-1", timeout)
    console.show_classes()

    out.write("\n== bob restarts dev-1\n")
    cluster.say("KubeVirt replaces dev-1's VMI: the new one has the GPU, on gpu-node-2")
    cluster.delete_vmi("spx-proj-b", "dev-1")
    cluster.start_vmi("spx-proj-b", "dev-1", "gpu-node-2", RTX, generation=2)
    # The new VMI observed, its card counted on gpu-node-2: the old one's deletion alone
    # clears /pending too.
    worker.wait_for_capacity({"nvidia-rtx-pro-6000-bse": (4, 1)}, timeout)
    outputs.wait_for(lambda _: worker.page("/pending") == [], timeout=timeout, what="the restart observed")
    out.write("  nothing waits for a restart any more\n")

    out.write(f"\n== ops drains gpu-node-1 with {notice_seconds}s notice\n")
    publish_signed(deployment, signer, [_intent("demo-drain-1", "drain_node", {"node": "gpu-node-1", "reason": "firmware upgrade",
                                                                     "notice_seconds": notice_seconds}, by=OPS)])
    outputs.wait_for(lambda _: cluster.cordoned("gpu-node-1"), timeout=timeout, what="the cordon")
    out.write("  in Kubernetes now: gpu-node-1 spec.unschedulable=true\n")
    outputs.wait_for(lambda _: not (cluster.vmi_exists("spx-proj-a", "train-1")
                                    or cluster.vmi_exists("spx-proj-a", "batch-1")),
                     timeout=timeout + notice_seconds, what="the GPU VMIs stopped at the deadline")
    out.write("  in Kubernetes now: the GPU VMIs on gpu-node-1 are gone\n")
    cluster.say("KubeVirt recreates train-1 (runStrategy Always) on gpu-node-2, where a card is free; "
                "batch-1 (Manual) stays off")
    cluster.start_vmi("spx-proj-a", "train-1", "gpu-node-2", RTX, generation=2)
    outputs.wait_for(lambda o: bool(o.notifications("drain_completed")) and mailed(o), timeout=timeout,
                     what="drain_completed, and every mail delivered")
    return outputs


def _intent(intent_id: str, type_: str, spec: dict[str, Any], *, by: str, project: str | None = None) -> str:
    """One ``simulate``-format line carrying an intent."""
    key = f"node/{spec['node']}" if "node" in spec else f"vm/{spec['namespace']}/{spec['name']}"
    value: dict[str, Any] = {"intent_id": intent_id, "type": type_, "requested_by": by, "spec": spec}
    if project:
        value["project"] = project
    return json.dumps({"topic": INTENTS, "key": key, "value": value})


def publish_signed(deployment: Deployment, signer: DevSigner, lines: list[str]) -> None:
    """Intents moved to now, then signed: a credential covers the body as published."""
    publish(deployment.kafka, signer.sign_records(scenario_records(lines, shift_to_now=True)))
