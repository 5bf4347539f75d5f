"""The demo with Kubernetes in the loop: a real kube-apiserver, KubeVirt, the watch bridge, the applier.

It starts a Kafka broker and a local control plane (kube-apiserver + etcd with KubeVirt's
CRDs, and KubeVirt's own virt-api and virt-controller), creates a small AZ in it, and runs
``vmstream worker``, ``vmstream watch``, ``vmstream apply``, ``vmstream notify`` (to the
demo's SMTP sink) and ``vmstream api`` as their own processes. Then it asks for a GPU on a
running VM (the VM changes in Kubernetes, the owner is told it waits for a restart), restarts
it through virt-api, and drains a GPU node (the owners are told first, the node is cordoned,
the GPU VMs are stopped at the deadline, KubeVirt brings back the one that restarts by itself).

No containers run here: the node agent (``harness/node_agent.py``) plays the
scheduler, the kubelet and virt-handler, and says what it does (``[node agent]`` lines).
"""

from __future__ import annotations

import json
from contextlib import ExitStack
from pathlib import Path
from typing import Any, TextIO

from kubernetes import client, config
from kubernetes.client.rest import ApiException

from handlers.contracts.ids import watch_event_id
from handlers.contracts.messages import object_key
from handlers.contracts.topics import K8S_EVENTS
from harness.demo_people import ApiProcess, Console, MailSink, NotifyProcess, mails_due, start_together
from harness.localkube import LocalKube
from harness.processes import poll_until
from harness.localkubevirt import HANDLER_USER, NAMESPACE, SERVICE_ACCOUNT_GROUPS, vm_subresource
from harness.node_agent import NodeAgent
from harness.publishing import publish, scenario_records
from harness.running import CONFIG, Deployment, Outputs, VmstreamProcess, WorkerProcess
from harness.scenarios import INTENTS
from samples.cluster import A100, PROJECT_LABEL, RTX, kubevirt_cr, node, vm
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
    """The demo's AZ in a real API server, with KubeVirt's own controllers acting on it."""

    def __init__(self, api: client.ApiClient) -> None:
        self.api = api
        self.core = client.CoreV1Api(api)
        self.custom = client.CustomObjectsApi(api)

    def create_az(self) -> set[str]:
        """Namespaces, nodes, the KubeVirt CR's configuration and the VMs; returns the
        k8s-events keys of what the worker must have seen (``<Kind>/<namespace>/<name>``)."""
        created = {object_key("Namespace", None, NAMESPACE)}
        for project in ("proj-a", "proj-b"):  # the applier writes only in project namespaces
            self.core.create_namespace({"metadata": {"name": f"spx-{project}", "labels": {PROJECT_LABEL: project}}})
            created.add(object_key("Namespace", None, f"spx-{project}"))
        nodes = [node("gpu-node-1", gpus={RTX: 2}), node("gpu-node-2", gpus={RTX: 2, A100: 1}), node("cpu-node-1")]
        for obj in nodes:
            self.core.create_node(_created(obj))
            created.add(object_key("Node", None, obj["metadata"]["name"]))
        cr = kubevirt_cr()  # the GPUs KubeVirt may pass through, and its defaults
        self.custom.patch_namespaced_custom_object(*KUBEVIRT, NAMESPACE, "kubevirts", cr["metadata"]["name"],
                                                   {"spec": cr["spec"]})
        created.add(object_key("KubeVirt", NAMESPACE, cr["metadata"]["name"]))
        vms = [
            vm("spx-proj-a", "train-1", project="proj-a", owner=ALICE, gpu=RTX),
            vm("spx-proj-a", "batch-1", project="proj-a", owner=ALICE, run_strategy="Manual", gpu=RTX),
            vm("spx-proj-b", "dev-1", project="proj-b", owner=BOB, memory="32Gi"),
        ]
        for obj in vms:
            namespace, name = obj["metadata"]["namespace"], obj["metadata"]["name"]
            self.custom.create_namespaced_custom_object(*KUBEVIRT, namespace, "virtualmachines", _created(obj))
            if obj["spec"].get("runStrategy") == "Manual":  # created stopped: its owner starts it
                vm_subresource(self.api, namespace, name, "start")
            created |= {object_key("VirtualMachine", namespace, name), object_key("VirtualMachineInstance", namespace, name)}
        return created

    def running_vmi(self, namespace: str, name: str) -> dict[str, Any] | None:
        """The VM's VMI if it runs, else None."""
        try:
            found: dict[str, Any] = self.custom.get_namespaced_custom_object(
                *KUBEVIRT, namespace, "virtualmachineinstances", name)
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise
        return found if (found.get("status") or {}).get("phase") == "Running" else None

    def vmi_node(self, namespace: str, name: str) -> str | None:
        """Where the VM's VMI runs, or None (no VMI, or not running)."""
        vmi = self.running_vmi(namespace, name)
        return None if vmi is None else vmi["status"].get("nodeName")

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
    out.write("starting a local kube-apiserver + etcd with KubeVirt's CRDs, virt-api and virt-controller "
              "(built from the Go module proxy the first time: minutes)...\n")
    kube = stack.enter_context(LocalKube(kubevirt=True))
    admin = stack.enter_context(kube.api_client())
    handler = stack.enter_context(_client(kube.client_cert(HANDLER_USER, SERVICE_ACCOUNT_GROUPS)))
    stack.enter_context(NodeAgent(admin, handler, on_action=lambda what: _say(out, what)))
    cluster = Cluster(admin)
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
    out.write(f"API server {kube.server} with KubeVirt's virt-api and virt-controller; "
              "worker, watch bridge and applier running "
              f"(logs in {workdir}); worker pages: http://127.0.0.1:{worker.web_port}/ready /capacity /pending\n")
    out.write(f"notify delivering to an SMTP sink on 127.0.0.1:{sink.port}; console API {api.url}/v1/…\n")

    def mailed(o: Outputs) -> bool:
        return sink.count() >= mails_due(o)

    out.write("\n== the AZ: 3 nodes, the KubeVirt CR, 3 VMs of alice and bob, started by KubeVirt\n")
    created = cluster.create_az()
    events = deployment.kafka.topic(K8S_EVENTS.name)
    # Each object by its key: the API server's own namespaces (default, kube-system, …) are
    # watched too, so a count of audit records can be reached before bob's VM is observed.
    outputs.wait_for(lambda o: created <= {a["input"]["key"] for a in o.audits(input__topic=events)},
                     timeout=timeout, what="the watch bridge's events of every object created decided")
    # The VMIs running, and the worker's view of them: a GPU asked for before would be told to
    # apply "after the next restart" of a VMI that was not running yet.
    running: list[set[str]] = []  # per VMI, the ids of the watch events that show it running
    for namespace, name in (("spx-proj-a", "train-1"), ("spx-proj-a", "batch-1"), ("spx-proj-b", "dev-1")):
        if not poll_until(lambda ns=namespace, n=name: cluster.running_vmi(ns, n) is not None,  # type: ignore[misc]
                          timeout):
            raise TimeoutError(f"timed out waiting for KubeVirt to run {namespace}/{name}")
        vmi = cluster.running_vmi(namespace, name)
        assert vmi is not None
        running.append({watch_event_id("VirtualMachineInstance", namespace, name, vmi["metadata"]["resourceVersion"],
                                       kind) for kind in ("ADDED", "MODIFIED", "RELISTED")})
    outputs.wait_for(lambda o: all(refs & {a["input"]["ref"] for a in o.audits(input__topic=events)}
                                   for refs in running),
                     timeout=timeout, what="the worker to observe the running VMIs")
    out.write(f"  the worker has observed the {len(created)} objects created, through the watch bridge, "
              "and the VMIs KubeVirt runs\n")

    out.write("\n== bob asks for a GPU on his running VM dev-1\n")
    publish_signed(deployment, signer, [_intent("demo-gpu-1", "set_gpu", {"namespace": "spx-proj-b", "name": "dev-1",
                                                               "gpu_class": "nvidia-rtx-pro-6000-bse"},
                                      by=BOB, project="proj-b")])
    # conflict_retried: KubeVirt wrote the VM meanwhile, and the applier planned the patch again.
    outputs.wait_for(lambda o: bool([r for r in o.results(cause="demo-gpu-1", type="patch_vm")
                                     if r["outcome"] in ("applied", "conflict_retried")]
                                    and o.notifications("gpu_change_pending_restart")) and mailed(o),
                     timeout=timeout, what="bob's patch applied and bob told, by mail too")
    out.write(f"  in Kubernetes now: {cluster.gpu_fields('spx-proj-b', 'dev-1')}\n")
    out.write(f"  waiting for a restart: {[p['vm'] for p in worker.page('/pending')]}\n")
    console.show_badge("spx-proj-b", "dev-1", timeout)
    console.show_classes()

    out.write("\n== bob restarts dev-1 (through virt-api: KubeVirt replaces its VMI)\n")
    publish_signed(deployment, signer, [_intent("demo-restart-1", "restart_vm", {"namespace": "spx-proj-b",
                                                                                "name": "dev-1"},
                                                by=BOB, project="proj-b")])
    outputs.wait_for(lambda o: bool(o.results(cause="demo-restart-1", type="restart_vm", outcome="applied")),
                     timeout=timeout, what="bob's restart applied")
    # The new VMI observed, its card counted on gpu-node-2: the old one's deletion alone
    # clears /pending too.
    worker.wait_for_capacity({"nvidia-rtx-pro-6000-bse": (4, 1)}, timeout)
    out.write(f"  in Kubernetes now: dev-1 runs on {cluster.vmi_node('spx-proj-b', 'dev-1')} with the GPU\n")
    outputs.wait_for(lambda _: worker.page("/pending") == [], timeout=timeout, what="the restart observed")
    out.write("  nothing waits for a restart any more\n")

    out.write(f"\n== ops drains gpu-node-1 with {notice_seconds}s notice\n")
    publish_signed(deployment, signer, [_intent("demo-drain-1", "drain_node", {"node": "gpu-node-1", "reason": "firmware upgrade",
                                                                     "notice_seconds": notice_seconds}, by=OPS)])
    outputs.wait_for(lambda _: cluster.cordoned("gpu-node-1"), timeout=timeout, what="the cordon")
    out.write("  in Kubernetes now: gpu-node-1 spec.unschedulable=true\n")
    outputs.wait_for(lambda o: bool(o.notifications("drain_completed")) and mailed(o),
                     timeout=timeout + notice_seconds, what="drain_completed, and every mail delivered")
    batch = cluster.vmi_node("spx-proj-a", "batch-1")
    out.write(f"  in Kubernetes now: train-1 (Always) runs on {cluster.vmi_node('spx-proj-a', 'train-1')}; "
              f"batch-1 (Manual) {'is off' if batch is None else 'runs on ' + batch}\n")
    return outputs


def _say(out: TextIO, what: str) -> None:
    out.write(f"  [node agent] {what}\n")
    out.flush()


def _client(kubeconfig: Path) -> client.ApiClient:
    api: client.ApiClient = config.new_client_from_config(config_file=str(kubeconfig))
    return api


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
