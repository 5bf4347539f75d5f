"""A production-sized AZ as a stream of input lines, from a seed: what ``vmstream simulate``
and the engine are measured on (``engine.py``).

A cluster (1,000 nodes of which 200 carry 4–8 GPU cards of the two example classes; 10,000
VMs of 40 projects, ~15 % with a GPU, mixed run strategies) and the lines the watch bridge
and the upstream services would send: the initial relist (ADDED), then mostly MODIFIED
events (node heartbeats, VM and VMI status updates), VMIs deleted and recreated,
``set_gpu`` / ``restart_vm`` / ``create_vm`` intents (some refused, some redelivered), a few
drains of several kinds (intent, cordon, NodeMaintenance, kubectl drain) whose deadlines
pass, and a few malformed messages. The generator keeps its own model of the cluster so that
what follows an intent is what KubeVirt would show; it never runs the engine. The same seed
gives a byte-identical stream.
"""

from __future__ import annotations

import heapq
import json
import random
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from functools import partial
from pathlib import Path
from typing import Any, Protocol

import kit  # noqa: F401  (this directory's: puts the repository on sys.path)  # isort: skip

import yaml  # noqa: E402

from harness.scenarios import EVENTS, INTENTS, Script  # noqa: E402
from samples.cluster import A100, EXAMPLE_CONFIG, RTX, kubevirt_cr, node, node_maintenance, vm, vmi  # noqa: E402

START = datetime(2026, 12, 1, 8, 0, tzinfo=UTC)
OPS = "ops@example.com"  # the operator of EXAMPLE_CONFIG
CLASS_OF = {RTX: "nvidia-rtx-pro-6000-bse", A100: "nvidia-a100"}
HOST_PASSTHROUGH = "host-passthrough"

MEAN_GAP_SECONDS = 0.2  # cluster time between two inputs: 80k inputs ≈ 4.5 h, drains fit in
GPU_NODE_SHARE = 0.2
GPU_VM_SHARE = 0.15
CPU_VM_ON_GPU_NODE = 0.1  # the scheduler puts some CPU VMs on GPU nodes: drains meet them
PROJECTS = 40
USERS = 300
EVENTS_PER_DRAIN = 10_000
DRAIN_TAIL_LINES = 10_000
DRAIN_NOTICE = 600  # the drain_node intents' notice; other drains take the config's
CONFIG_NOTICE = int(EXAMPLE_CONFIG["drain"]["notice_seconds"])  # type: ignore[index]

# Strategy of each VM (None: the deprecated ``running: true``), and how the background
# traffic is made up — weights, not exact shares.
STRATEGIES: dict[str | None, float] = {
    "Always": 0.55, "RerunOnFailure": 0.10, "Manual": 0.20, "Halted": 0.10, None: 0.05,
}
MIX: dict[str, float] = {
    "node_heartbeat": 0.34,
    "vmi_update": 0.28,
    "vm_update": 0.18,
    "vmi_restart": 0.04,
    "manual_toggle": 0.02,
    "set_gpu": 0.025,
    "restart_vm": 0.025,
    "create_vm": 0.012,
    "redelivery": 0.005,
    "unwatched_kind": 0.003,
    "malformed": 0.002,
    "node_flap": 0.002,
}
MIX_KINDS, MIX_WEIGHTS = list(MIX), list(MIX.values())


class Writer(Protocol):
    """Where the lines go: a text file, or a list of one phase's lines (engine.py)."""

    def write(self, text: str, /) -> object: ...


# ------------------------------------------------------------------ the cluster model


class RandomSet:
    """Keys with O(1) add, discard and uniform choice, in a seed-determined order.

    A set's order depends on PYTHONHASHSEED; the stream must not.
    """

    def __init__(self) -> None:
        self._items: list[str] = []
        self._index: dict[str, int] = {}

    def add(self, key: str) -> None:
        if key not in self._index:
            self._index[key] = len(self._items)
            self._items.append(key)

    def discard(self, key: str) -> None:
        i = self._index.pop(key, None)
        if i is None:
            return
        last = self._items.pop()
        if i < len(self._items):
            self._items[i] = last
            self._index[last] = i

    def choice(self, rng: random.Random) -> str | None:
        return rng.choice(self._items) if self._items else None

    def __len__(self) -> int:
        return len(self._items)


@dataclass
class NodeState:
    name: str
    gpus: dict[str, int]
    used: dict[str, int] = field(default_factory=dict)
    vmis: dict[str, None] = field(default_factory=dict)  # an ordered set of VM keys
    unschedulable: bool = False
    ready: bool = True
    busy: bool = False  # in a drain or a NotReady flap: not picked for another one
    rv: int = 1

    @property
    def schedulable(self) -> bool:
        return self.ready and not self.unschedulable

    def free(self, device: str) -> int:
        return self.gpus.get(device, 0) - self.used.get(device, 0)

    def obj(self) -> dict[str, Any]:
        return node(self.name, gpus=self.gpus or None, unschedulable=self.unschedulable,
                    ready=self.ready, rv=self.rv)


@dataclass
class VMState:
    namespace: str
    name: str
    project: str
    owner: str | None
    strategy: str | None  # None: the deprecated spec.running: true
    gpu: str | None
    memory: str
    cores: int
    rv: int = 1
    printable: str = "Stopped"

    @property
    def key(self) -> str:
        return f"vm/{self.namespace}/{self.name}"

    @property
    def effective_strategy(self) -> str:
        return self.strategy or "Always"

    def obj(self) -> dict[str, Any]:
        return vm(self.namespace, self.name, project=self.project, owner=self.owner,
                  run_strategy=self.strategy, running=True if self.strategy is None else None,
                  gpu=self.gpu, memory=self.memory, cores=self.cores, rv=self.rv,
                  printable_status=self.printable)


@dataclass
class VMIState:
    vm: VMState
    node: str | None
    phase: str
    gpu: str | None
    generation: int
    unschedulable: bool = False
    eviction_requested: bool = False

    def obj(self, phase: str | None = None) -> dict[str, Any]:
        return vmi(self.vm.namespace, self.vm.name, node_name=self.node, phase=phase or self.phase,
                   gpu=self.gpu, cpu_model=HOST_PASSTHROUGH if self.gpu else None,
                   generation=self.generation, unschedulable=self.unschedulable,
                   eviction_requested=self.eviction_requested)


# ------------------------------------------------------------------------ generation


class Generator:
    """Builds the input stream from a model of the cluster and writes it as it goes.

    Lines are written as soon as they are made (never all held), and the stream is cut at
    exactly ``limit`` lines. Follow-ups (the VM patched after a ``set_gpu``, a drain's
    deadline) are queued on the cluster clock and interleaved with the background traffic.
    """

    def __init__(self, rng: random.Random, *, vms: int, nodes: int, limit: int, out: Writer,
                 events_per_drain: int = EVENTS_PER_DRAIN) -> None:
        self.rng = rng
        self.limit = limit
        self.events_per_drain = events_per_drain
        self.out = out
        self.script = Script(START)
        self.written = 0
        self.mix: Counter[str] = Counter()
        self._categories: list[str] = []
        self._queue: list[tuple[datetime, int, Callable[[], None]]] = []
        self._seq = 0
        self._intents = 0
        self._new_vms = 0
        self._recent_intents: deque[dict[str, Any]] = deque(maxlen=200)
        self.nodes: dict[str, NodeState] = {}
        self.gpu_nodes: list[NodeState] = []
        self.cpu_nodes: list[NodeState] = []
        self.all_nodes: list[NodeState] = []
        self.vms: dict[str, VMState] = {}
        self.vm_keys = RandomSet()
        self.vmis: dict[str, VMIState] = {}
        self.vmi_keys = RandomSet()
        self.waiting: dict[str, dict[str, None]] = {RTX: {}, A100: {}}
        self.projects = [f"proj-{i:02d}" for i in range(1, PROJECTS + 1)]
        self.members = {p: [f"user-{rng.randrange(USERS):03d}@example.com" for _ in range(rng.randint(2, 12))]
                        for p in self.projects}
        self._build(vms, nodes)

    # -------------------------------------------------------------- output plumbing

    @property
    def now(self) -> datetime:
        return self.script.now

    @property
    def count(self) -> int:
        return self.written + len(self.script.lines)

    def flush(self) -> None:
        for text, category in zip(self.script.jsonl(), self._categories, strict=True):
            if self.written >= self.limit:
                break
            self.out.write(text)
            self.out.write("\n")
            self.written += 1
            self.mix[category] += 1
        self.script.lines.clear()
        self._categories.clear()

    def _event(self, type_: str, obj: dict[str, Any], category: str) -> None:
        self.script.event(type_, obj)
        self._categories.append(category)

    def _intent(self, type_: str, spec: dict[str, Any], *, by: str, project: str | None) -> None:
        self._intents += 1
        self.script.intent(f"it-{self._intents:07d}", type_, spec, by=by, project=project)
        self._recent_intents.append(self.script.lines[-1])
        self._categories.append(f"intent {type_}")

    def _line(self, line: dict[str, Any], category: str) -> None:
        self.script.lines.append(line)
        self._categories.append(category)

    def _text(self, text: str, category: str) -> None:
        """A line that is not even a JSON object: written as is."""
        self.flush()
        if self.written < self.limit:
            self.out.write(text + "\n")
            self.written += 1
            self.mix[category] += 1

    def later(self, seconds: float, action: Callable[[], None]) -> None:
        self._seq += 1
        heapq.heappush(self._queue, (self.now + timedelta(seconds=seconds), self._seq, action))

    def _advance_to(self, at: datetime) -> None:
        self.script.start = max(self.script.start, at)

    # ------------------------------------------------------------------ the cluster

    def _build(self, vms: int, nodes: int) -> None:
        rng = self.rng
        gpu_nodes = round(nodes * GPU_NODE_SHARE)
        for i in range(1, gpu_nodes + 1):
            count = rng.randint(4, 8)
            if rng.random() < 0.15:  # a mixed node
                rtx = rng.randint(1, count - 1)
                gpus = {RTX: rtx, A100: count - rtx}
            else:
                gpus = {RTX if rng.random() < 0.6 else A100: count}
            host = NodeState(f"gpu-node-{i:04d}", gpus)
            self.nodes[host.name] = host
            self.gpu_nodes.append(host)
        for i in range(1, nodes - gpu_nodes + 1):
            host = NodeState(f"cpu-node-{i:04d}", {})
            self.nodes[host.name] = host
            self.cpu_nodes.append(host)
        self.all_nodes = [*self.gpu_nodes, *self.cpu_nodes]
        cards: Counter[str] = Counter()
        for host in self.gpu_nodes:
            cards.update(host.gpus)
        devices, weights = list(cards), [cards[d] for d in cards]
        strategies, strategy_weights = list(STRATEGIES), list(STRATEGIES.values())
        for i in range(1, vms + 1):
            project = rng.choice(self.projects)
            gpu = rng.choices(devices, weights)[0] if devices and rng.random() < GPU_VM_SHARE else None
            state = VMState(
                namespace=f"spx-{project}", name=f"vm-{i:05d}", project=project,
                owner=None if rng.random() < 0.1 else rng.choice(self.members[project]),
                strategy=rng.choices(strategies, strategy_weights)[0], gpu=gpu,
                memory=rng.choice(("4Gi", "8Gi", "16Gi", "32Gi", "64Gi")), cores=rng.choice((2, 4, 8, 16)),
            )
            self.vms[state.key] = state
            self.vm_keys.add(state.key)

    def _place(self, vm_: VMState, generation: int) -> VMIState:
        """Where the scheduler would put a new VMI; a GPU VM with no free card waits."""
        rng = self.rng
        if vm_.gpu:
            device = vm_.gpu
            candidates = [n for n in self.gpu_nodes if n.schedulable and n.free(device) > 0]
            if not candidates:
                return VMIState(vm_, None, "Scheduling", vm_.gpu, generation, unschedulable=True)
            return VMIState(vm_, rng.choice(candidates).name, "Running", vm_.gpu, generation)
        pool = self.gpu_nodes if (rng.random() < CPU_VM_ON_GPU_NODE or not self.cpu_nodes) else self.cpu_nodes
        for _ in range(20):
            candidate = rng.choice(pool)
            if candidate.schedulable:
                return VMIState(vm_, candidate.name, "Running", None, generation)
        return VMIState(vm_, None, "Scheduling", None, generation, unschedulable=True)

    def _attach(self, state: VMIState) -> None:
        key = state.vm.key
        self.vmis[key] = state
        self.vmi_keys.add(key)
        if state.node is None:
            if state.gpu:
                self.waiting[state.gpu][key] = None
            return
        host = self.nodes[state.node]
        host.vmis[key] = None
        if state.gpu:
            host.used[state.gpu] = host.used.get(state.gpu, 0) + 1

    def _detach(self, key: str) -> VMIState | None:
        state = self.vmis.pop(key, None)
        if state is None:
            return None
        self.vmi_keys.discard(key)
        if state.gpu:
            self.waiting[state.gpu].pop(key, None)
        if state.node is not None:
            host = self.nodes[state.node]
            host.vmis.pop(key, None)
            if state.gpu:
                host.used[state.gpu] -= 1
                if host.schedulable:  # a card is free: the longest-waiting VM of its class gets it
                    device = state.gpu
                    self.later(self.rng.uniform(5, 30), lambda: self._unwait(device))
        return state

    def _printable(self, vm_: VMState) -> str:
        state = self.vmis.get(vm_.key)
        if state is None:
            return "Stopped"
        return "Running" if state.node else ("ErrorUnschedulable" if state.gpu else "Scheduling")

    def _vm_status(self, vm_: VMState) -> None:
        vm_.printable = self._printable(vm_)
        vm_.rv += 1
        self._event("MODIFIED", vm_.obj(), "vm status")

    # ------------------------------------------------------------------ the stream

    def relist(self) -> None:
        """The watch bridge's first list: the KubeVirt CR, every node, every VM and VMI."""
        self._event("ADDED", kubevirt_cr(), "relist kubevirt")
        for state in self.nodes.values():
            self._event("ADDED", state.obj(), "relist node")
            self.script.wait(0.001)
        running_share = {"Always": 1.0, "RerunOnFailure": 0.9, "Manual": 0.6, "Halted": 0.0}
        for vm_ in self.vms.values():
            started = self.rng.random() < running_share[vm_.effective_strategy]
            instance = self._place(vm_, 1) if started else None
            if instance is not None:
                self._attach(instance)
            vm_.printable = self._printable(vm_)
            self._event("ADDED", vm_.obj(), "relist vm")
            if instance is not None:
                self._event("ADDED", instance.obj(), "relist vmi")
            self.script.wait(0.001)
            self.flush()

    def run(self) -> None:
        """The relist, then background traffic, follow-ups and drains up to ``limit`` lines."""
        self.relist()
        if self.count >= self.limit:
            self.flush()
            return
        # Drains start spread over the stream, the last early enough for its deadline to pass
        # (a notice of 900 s is some 7,000 lines at this pace).
        begin, rest = self.count, self.limit - self.count
        drains = max(1, rest // self.events_per_drain)
        window = max(rest - DRAIN_TAIL_LINES, rest // 2)
        drain_at = [begin + window * (2 * i + 1) // (2 * drains) for i in range(drains)]
        kinds = ("intent", "cordon", "maintenance", "eviction")

        def drain_now() -> bool:
            if not (drain_at and self.count >= drain_at[0]):
                return False
            drain_at.pop(0)
            self.drain(kinds[(drains - len(drain_at) - 1) % len(kinds)])
            return True

        while self.count < self.limit:
            self.step(drain_now)

    def step(self, drain_now: Callable[[], bool] | None = None) -> None:
        """One action on the cluster clock: a follow-up that is due, else a drain if
        ``drain_now`` starts one, else a piece of background traffic (MIX)."""
        due = self.now + timedelta(seconds=self.rng.expovariate(1 / MEAN_GAP_SECONDS))
        if self._queue and self._queue[0][0] <= due:
            at, _, action = heapq.heappop(self._queue)
            self._advance_to(at)
            action()
        else:
            self._advance_to(due)
            if drain_now is None or not drain_now():
                getattr(self, f"_bg_{self.rng.choices(MIX_KINDS, MIX_WEIGHTS)[0]}")()
        self.flush()

    # -------------------------------------------------------- background traffic

    def _bg_node_heartbeat(self) -> None:
        state = self.rng.choice(self.all_nodes)
        state.rv += 1
        self._event("MODIFIED", state.obj(), "node heartbeat")

    def _bg_vmi_update(self) -> None:
        key = self.vmi_keys.choice(self.rng)
        if key is None:
            return self._bg_node_heartbeat()
        self._event("MODIFIED", self.vmis[key].obj(), "vmi status")

    def _bg_vm_update(self) -> None:
        key = self.vm_keys.choice(self.rng)
        if key is None:
            return self._bg_node_heartbeat()
        vm_ = self.vms[key]
        vm_.rv += 1
        self._event("MODIFIED", vm_.obj(), "vm status")

    def _bg_vmi_restart(self) -> None:
        """A guest shuts down or crashes; its run strategy decides whether it comes back."""
        key = self.vmi_keys.choice(self.rng)
        if key is None or self.vmis[key].node is None:
            return self._bg_vm_update()
        phase = "Failed" if self.rng.random() < 0.3 else "Succeeded"
        ended = self._detach(key)
        assert ended is not None
        self._event("DELETED", ended.obj(phase), "vmi deleted")
        vm_ = ended.vm

        def come_back() -> None:
            if self.vms.get(vm_.key) is not vm_ or vm_.key in self.vmis:
                return
            strategy = vm_.effective_strategy
            if strategy == "Always" or (strategy == "RerunOnFailure" and phase == "Failed"):
                self._start_vmi(vm_, ended.generation + 1)
            else:
                self._vm_status(vm_)

        self.later(self.rng.uniform(3, 30), come_back)

    def _start_vmi(self, vm_: VMState, generation: int) -> None:
        if vm_.key in self.vmis or self.vms.get(vm_.key) is not vm_:
            return
        state = self._place(vm_, generation)
        self._attach(state)
        self._event("ADDED", state.obj(), "vmi recreated")
        self._vm_status(vm_)

    def _bg_manual_toggle(self) -> None:
        """An owner starts or stops a Manual VM by hand."""
        for _ in range(10):
            key = self.vm_keys.choice(self.rng)
            if key is not None and self.vms[key].strategy == "Manual":
                break
        else:
            return self._bg_vm_update()
        vm_ = self.vms[key]
        current = self.vmis.get(key)
        if current is None:
            self._start_vmi(vm_, 1 + self.rng.randrange(3))
        elif current.node is not None:
            self._detach(key)
            self._event("DELETED", current.obj("Succeeded"), "vmi deleted")
            self._vm_status(vm_)
        else:
            self._bg_vm_update()

    def _requester(self, vm_: VMState) -> str:
        return vm_.owner or self.rng.choice(self.members[vm_.project])

    def _bg_set_gpu(self) -> None:
        """Half of the requests are about a VM that has a GPU (change or remove it).

        Picking VMs uniformly would add a GPU to a CPU VM six times out of seven, and GPU
        demand would keep growing for as long as the stream runs.
        """
        rng = self.rng
        key = None
        for _ in range(20 if rng.random() < 0.5 else 1):
            key = self.vm_keys.choice(rng)
            if key is None or self.vms[key].gpu:
                break
        if key is None:
            return self._bg_node_heartbeat()
        vm_ = self.vms[key]
        spec: dict[str, Any] = {"namespace": vm_.namespace, "name": vm_.name}
        by, project = self._requester(vm_), vm_.project
        roll = rng.random()
        if roll < 0.03:  # a VM that does not exist (yet, or any more)
            spec["name"] = f"gone-{rng.randrange(10**5):05d}"
            spec["gpu_class"] = CLASS_OF[RTX]
        elif roll < 0.08:  # someone of another project
            project = rng.choice(self.projects)
            by = rng.choice(self.members[project])
            spec["gpu_class"] = CLASS_OF[A100]
        elif roll < 0.12:  # a class this AZ does not offer
            spec["gpu_class"] = "nvidia-h100"
        if "gpu_class" in spec:
            self._intent("set_gpu", spec, by=by, project=project)
            return
        if vm_.gpu is None:
            device: str | None = rng.choice((RTX, A100))
        else:
            device = None if rng.random() < 0.5 else (A100 if vm_.gpu == RTX else RTX)
        class_id = None if device is None else CLASS_OF[device]
        if class_id is not None and rng.random() < 0.2:
            class_id = class_id.upper()  # class ids are case-insensitive
        spec["gpu_class"] = class_id
        self._intent("set_gpu", spec, by=by, project=project)

        def patched() -> None:  # the applier's patch, as the watch then shows the VM
            if self.vms.get(key) is not vm_ or vm_.gpu == device:
                return
            vm_.gpu = device
            vm_.rv += 1
            self._event("MODIFIED", vm_.obj(), "vm patched")
            if key in self.vmis and rng.random() < 0.6:  # the owner restarts it, later
                self.later(rng.uniform(30, 900), lambda: self._restart_intent(vm_))

        self.later(rng.uniform(1, 5), patched)

    def _bg_restart_vm(self) -> None:
        key = self.vm_keys.choice(self.rng)
        if key is None:
            return self._bg_node_heartbeat()
        self._restart_intent(self.vms[key])

    def _restart_intent(self, vm_: VMState) -> None:
        rng = self.rng
        project = vm_.project if rng.random() > 0.03 else rng.choice(self.projects)
        self._intent("restart_vm", {"namespace": vm_.namespace, "name": vm_.name},
                     by=self._requester(vm_), project=project)
        current = self.vmis.get(vm_.key)
        refused = (project != vm_.project or vm_.effective_strategy in ("Halted", "Once")
                   or current is None or self.vms.get(vm_.key) is not vm_)
        if refused or current is None:
            return

        def stopped() -> None:
            if self.vmis.get(vm_.key) is not current:
                return
            self._detach(vm_.key)
            self._event("DELETED", current.obj("Succeeded"), "vmi deleted")
            self.later(rng.uniform(2, 10), lambda: self._start_vmi(vm_, current.generation + 1))

        self.later(rng.uniform(2, 20), stopped)

    def _bg_create_vm(self) -> None:
        rng = self.rng
        self._new_vms += 1
        project = rng.choice(self.projects)
        by = rng.choice(self.members[project])
        cores = rng.choice((1, 2, 4, 8, 16, 32))
        memory = rng.choice((2, 4, 8, 16, 32, 64))
        strategy = rng.choice(("Always", "Always", "Manual", "RerunOnFailure"))
        gpu = rng.choice((RTX, A100)) if rng.random() < 0.2 else None
        spec: dict[str, Any] = {
            "namespace": f"spx-{project}", "name": f"new-{self._new_vms:05d}", "cores": cores,
            "memory_gib": memory, "image": "quay.io/containerdisks/ubuntu:24.04", "run_strategy": strategy,
        }
        if gpu:
            spec["gpu_class"] = CLASS_OF[gpu]
        invalid = rng.random() < 0.05
        if invalid:
            spec["cores"] = 3  # outside Superphenix's sizes: refused
        self._intent("create_vm", spec, by=by, project=project)
        if invalid:
            return
        new = VMState(namespace=spec["namespace"], name=spec["name"], project=project, owner=by,
                      strategy=strategy, gpu=gpu, memory=f"{memory}Gi", cores=cores)

        def created() -> None:
            self.vms[new.key] = new
            self.vm_keys.add(new.key)
            self._event("ADDED", new.obj(), "vm created")
            if strategy != "Manual":
                self.later(rng.uniform(3, 15), lambda: self._start_vmi(new, 1))

        self.later(rng.uniform(1, 4), created)

    def _bg_redelivery(self) -> None:
        """Kafka delivers an intent a second time: the same id, the same body."""
        if not self._recent_intents:
            return self._bg_node_heartbeat()
        self._line(self.rng.choice(self._recent_intents), "intent redelivered")

    def _bg_unwatched_kind(self) -> None:
        name = f"virt-launcher-{self.rng.randrange(10**6):06d}"
        pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": "spx-proj-01"}}
        self._event("MODIFIED", pod, "unwatched kind")

    def _bg_malformed(self) -> None:
        rng = self.rng
        variant = rng.randrange(6)
        key = self.vm_keys.choice(rng) or "vm/x/y"
        if variant == 0:
            self.script.raw(INTENTS, key, "{not json")
        elif variant == 1:
            self.script.raw(INTENTS, key, json.dumps({"type": "set_gpu", "spec": {}}))
        elif variant == 2:
            self.script.raw(EVENTS, "Node/gpu-node-0001",
                            json.dumps({"event_id": "ev-x", "type": "ADDED", "kind": "Node"}))
        elif variant == 3:
            self.script.raw(EVENTS, key, json.dumps({"event_id": "ev-y", "type": "BOOKMARK", "kind": "Node",
                                                     "object": {"metadata": {"name": "n"}},
                                                     "observed_at": "2026-12-01T08:00:00Z"}))
        elif variant == 4:
            return self._text("this is not JSON at all", "malformed")
        else:
            return self._text(json.dumps({"topic": "vmstream.elsewhere", "key": "k", "value": {}}), "malformed")
        self._categories.append("malformed")

    def _bg_node_flap(self) -> None:
        """A kubelet misses its heartbeats for a few minutes: the node is NotReady."""
        state = self.rng.choice(self.all_nodes)
        if state.busy:
            return self._bg_node_heartbeat()
        state.busy, state.ready = True, False
        state.rv += 1
        self._event("MODIFIED", state.obj(), "node not ready")

        def back() -> None:
            state.busy, state.ready = False, True
            state.rv += 1
            self._event("MODIFIED", state.obj(), "node ready again")
            for device in state.gpus:
                for _ in range(max(0, state.free(device))):
                    self._unwait(device)

        self.later(self.rng.uniform(60, 300), back)

    def _unwait(self, device: str) -> None:
        """The longest-waiting VM of ``device`` gets a card that became free, if any is."""
        waiting = self.waiting[device]
        if not waiting:
            return
        candidates = [n for n in self.gpu_nodes if n.schedulable and n.free(device) > 0]
        if not candidates:
            return
        key = next(iter(waiting))
        state = self.vmis[key]
        self._detach(key)
        state.node, state.phase, state.unschedulable = self.rng.choice(candidates).name, "Running", False
        self._attach(state)
        self._event("MODIFIED", state.obj(), "vmi scheduled")
        self._vm_status(state.vm)

    # ---------------------------------------------------------------------- drains

    def drain(self, kind: str) -> None:
        """One drain of a busy GPU node, from its first signal to the node's return."""
        rng = self.rng
        candidates = [n for n in self.gpu_nodes if not n.busy and n.schedulable
                      and any(self.vmis[k].gpu for k in n.vmis)]
        if not candidates:
            return self._bg_node_heartbeat()
        host = rng.choice(candidates)
        host.busy = True
        notice = CONFIG_NOTICE
        if kind == "intent":
            notice = DRAIN_NOTICE
            self._intent("drain_node", {"node": host.name, "reason": "firmware upgrade",
                                        "notice_seconds": notice}, by=OPS, project=None)
            if rng.random() < 0.5:  # someone who is not an operator tries too: refused
                project = rng.choice(self.projects)
                self._intent("drain_node", {"node": host.name, "reason": "it is slow"},
                             by=rng.choice(self.members[project]), project=project)
            self.later(rng.uniform(1, 3), lambda: self._cordon(host, True))
            self._migrate_cpu_vmis(host)
            self.later(notice + rng.uniform(1800, 2400), lambda: self._undrain(host, intent=True))
        elif kind == "maintenance":
            name = f"nm-{host.name}"
            self._event("ADDED", node_maintenance(name, host.name, "PSU replacement"), "node maintenance")
            self.later(rng.uniform(1, 3), lambda: self._cordon(host, True))
            self._migrate_cpu_vmis(host)

            def done() -> None:
                self._event("DELETED", node_maintenance(name, host.name, "PSU replacement"), "node maintenance")
                self._undrain(host, intent=False)

            self.later(notice + rng.uniform(1800, 2400), done)
        else:  # "cordon": kubectl cordon; "eviction": kubectl drain, which also evicts
            self._cordon(host, True)
            if kind == "eviction":
                for key in sorted(host.vmis):
                    state = self.vmis[key]
                    if state.gpu:
                        self.later(rng.uniform(1, 5), partial(self._evict_requested, state, host))
                self._migrate_cpu_vmis(host)
            self.later(notice + rng.uniform(1800, 2400), lambda: self._undrain(host, intent=False))
        self.later(notice + rng.uniform(2, 15), lambda: self._stop_gpu_vmis(host))

    def _cordon(self, host: NodeState, cordoned: bool) -> None:
        host.unschedulable = cordoned
        host.rv += 1
        self._event("MODIFIED", host.obj(), "node cordoned" if cordoned else "node uncordoned")

    def _evict_requested(self, state: VMIState, host: NodeState) -> None:
        if self.vmis.get(state.vm.key) is state and state.node == host.name:
            state.eviction_requested = True
            self._event("MODIFIED", state.obj(), "vmi eviction requested")

    def _migrate_cpu_vmis(self, host: NodeState) -> None:
        """Non-GPU VMs live-migrate away on their own during the notice."""
        for key in sorted(host.vmis):
            state = self.vmis[key]
            if state.gpu:
                continue

            def migrate(state: VMIState = state) -> None:
                if self.vmis.get(state.vm.key) is not state or state.node != host.name:
                    return
                target = self._place(state.vm, state.generation)
                if target.node is None:
                    return
                self._detach(state.vm.key)
                state.node = target.node
                self._attach(state)
                self._event("MODIFIED", state.obj(), "vmi migrated")

            self.later(self.rng.uniform(5, 120), migrate)

    def _stop_gpu_vmis(self, host: NodeState) -> None:
        """The deadline passed: what the engine's delete_vmi commands do, as the watch shows it."""
        for key in sorted(host.vmis):
            state = self.vmis[key]
            if not state.gpu:
                continue
            self._detach(key)
            state.eviction_requested = False
            self._event("DELETED", state.obj("Succeeded"), "vmi stopped at deadline")
            vm_ = state.vm

            def after(vm_: VMState = vm_, generation: int = state.generation + 1) -> None:
                if vm_.effective_strategy == "Always":
                    self._start_vmi(vm_, generation)
                elif self.vms.get(vm_.key) is vm_ and vm_.key not in self.vmis:
                    self._vm_status(vm_)

            self.later(self.rng.uniform(3, 20), after)

    def _undrain(self, host: NodeState, *, intent: bool) -> None:
        if intent:
            self._intent("undrain_node", {"node": host.name, "reason": "firmware done"}, by=OPS, project=None)

        def back() -> None:
            self._cordon(host, False)
            host.busy = False
            for device in host.gpus:
                for _ in range(max(0, host.free(device))):
                    self._unwait(device)

        self.later(self.rng.uniform(1, 3) if intent else 0, back)


def generate(path: Path, *, vms: int, nodes: int, events: int, seed: int,
             events_per_drain: int = EVENTS_PER_DRAIN) -> Counter[str]:
    """Write the stream to ``path``; returns how many lines of each kind it holds."""
    if nodes < 5 or vms < 1 or events < 1:
        raise SystemExit("need at least 5 nodes, 1 VM and 1 event")
    with path.open("w", encoding="utf-8") as out:
        generator = Generator(random.Random(seed), vms=vms, nodes=nodes, limit=events, out=out,
                              events_per_drain=events_per_drain)
        generator.run()
    return generator.mix


def write_config(path: Path) -> None:
    path.write_text(yaml.safe_dump(EXAMPLE_CONFIG, sort_keys=False), encoding="utf-8")
