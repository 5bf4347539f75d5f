"""What a GPU does to a VM: the mutation rules of DOMAIN.md, as one pure function.

``desired_vm(observed, mutation)`` returns the VM as it must look; the patch sent to the
API server is the RFC 6902 difference between the two (:func:`plan_patch`). The applier
calls the same functions again after a conflict, so the rules live here only.

Adding a GPU records, in the annotation ``vmstream.io/pre-gpu``, every value it is about to
overwrite; removing the GPU puts back only what vmstream set and nobody changed since
("only undo what we set"), then drops the record. Hence add-then-remove is the identity,
and applying the same mutation twice changes nothing the second time.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from decimal import Decimal, InvalidOperation
from typing import Any

from handlers.contracts.messages import GPUMutation
from handlers.core.cluster import HOST_PASSTHROUGH

PRE_GPU_ANNOTATION = "vmstream.io/pre-gpu"
GPU_ENTRY_NAME = "gpu-0"

Path = tuple[str, ...]
TEMPLATE: Path = ("spec", "template", "spec")
DOMAIN: Path = (*TEMPLATE, "domain")
GPUS: Path = (*DOMAIN, "devices", "gpus")
HOST_DEVICES: Path = (*DOMAIN, "devices", "hostDevices")
CPU_MODEL: Path = (*DOMAIN, "cpu", "model")
MEMORY_GUEST: Path = (*DOMAIN, "memory", "guest")
MEMORY_REQUEST: Path = (*DOMAIN, "resources", "requests", "memory")
EVICTION_STRATEGY: Path = (*TEMPLATE, "evictionStrategy")
ANNOTATIONS: Path = ("metadata", "annotations")

# Maps vmstream may have to create; on removal each is dropped again if it is empty and
# did not exist before.
CONTAINERS: tuple[Path, ...] = (
    ANNOTATIONS,
    (*DOMAIN, "devices"),
    (*DOMAIN, "cpu"),
    (*DOMAIN, "resources"),
    (*DOMAIN, "resources", "requests"),
)
_ABSENT = object()


class GPURuleViolation(ValueError):
    """The VM cannot take this mutation (e.g. it already has several GPUs)."""


def _get(obj: Any, path: Path) -> Any:
    for part in path:
        if not isinstance(obj, dict) or part not in obj:
            return _ABSENT
        obj = obj[part]
    return obj


def _set(obj: dict[str, Any], path: Path, value: Any) -> None:
    for part in path[:-1]:
        child = obj.get(part)
        if not isinstance(child, dict):
            child = obj[part] = {}
        obj = child
    obj[path[-1]] = value


def _delete(obj: dict[str, Any], path: Path) -> None:
    parent = _get(obj, path[:-1])
    if isinstance(parent, dict):
        parent.pop(path[-1], None)


def _key(path: Path) -> str:
    return "/" + "/".join(path)


def gpu_devices(vm: dict[str, Any]) -> list[str]:
    gpus = _get(vm, GPUS)
    if not isinstance(gpus, list):
        return []
    return [g.get("deviceName", "") for g in gpus if isinstance(g, dict)]


def template_devices(vm: dict[str, Any]) -> list[str]:
    """Every device the template passes through (gpus and hostDevices), sorted."""
    host = _get(vm, HOST_DEVICES)
    hosts = [h.get("deviceName", "") for h in host if isinstance(h, dict)] if isinstance(host, list) else []
    return sorted([*gpu_devices(vm), *hosts])


def uses_instancetype(vm: dict[str, Any]) -> bool:
    return bool(_get(vm, ("spec", "instancetype")) not in (_ABSENT, None))


def pre_gpu_record(vm: dict[str, Any]) -> dict[str, Any] | None:
    annotations = _get(vm, ANNOTATIONS)
    raw = annotations.get(PRE_GPU_ANNOTATION) if isinstance(annotations, dict) else None
    if not isinstance(raw, str):
        return None
    try:
        record = json.loads(raw)
    except json.JSONDecodeError:
        return None
    return record if isinstance(record, dict) else None


def _snapshot(vm: dict[str, Any]) -> dict[str, Any]:
    """What adding a GPU is about to overwrite, for a faithful removal later."""
    values: dict[str, Any] = {}
    absent: list[str] = []
    for path in (GPUS, CPU_MODEL, MEMORY_REQUEST, EVICTION_STRATEGY):
        value = _get(vm, path)
        if value is _ABSENT:
            absent.append(_key(path))
        else:
            values[_key(path)] = value
    created = [_key(path) for path in CONTAINERS if _get(vm, path) is _ABSENT]
    return {"values": values, "absent": absent, "created": created}


def _restore(vm: dict[str, Any], record: dict[str, Any], path: Path, *, if_current: Any) -> None:
    """Put back the recorded value at ``path`` — only if it still holds what we set."""
    if _get(vm, path) != if_current:
        return
    key = _key(path)
    if key in record.get("values", {}):
        _set(vm, path, record["values"][key])
    else:
        _delete(vm, path)


def desired_vm(observed: dict[str, Any], mutation: GPUMutation) -> dict[str, Any]:
    """The VM ``observed`` should become under ``mutation`` (the GPU rules, all of them).

    An ``enforce`` mutation only brings the GPU the VM has under the rules: a VM that does
    not have exactly that GPU (any more) is left as it is, so that an applier planning it
    again after a conflict can never undo a ``set_gpu`` that came in between.
    """
    current = gpu_devices(observed)
    if mutation.enforce and mutation.devices is not None:
        if template_devices(observed) != sorted(mutation.devices):
            return observed
        kept: dict[str, Any] = copy.deepcopy(observed)
        _apply_rules(kept, mutation, keep_gpus=True)
        return kept
    if mutation.enforce and current != [mutation.device_name]:
        return observed
    if len(current) > 1:
        raise GPURuleViolation(f"the VM has {len(current)} GPUs; a VM may have at most one")
    if mutation.device_name is None and not current:
        return observed
    vm: dict[str, Any] = copy.deepcopy(observed)
    if mutation.device_name is not None:
        _add_gpu(vm, mutation)
    else:
        _remove_gpu(vm)
    return vm


def _add_gpu(vm: dict[str, Any], mutation: GPUMutation) -> None:
    _apply_rules(vm, mutation, keep_gpus=False)


def _apply_rules(vm: dict[str, Any], mutation: GPUMutation, *, keep_gpus: bool) -> None:
    """The GPU rules on ``vm``; with ``keep_gpus``, its devices as they are (several GPUs,
    GPU host devices, an instance type's), else its one GPU made ``mutation.device_name``."""
    record = pre_gpu_record(vm)
    if record is None:
        record = _snapshot(vm)
        if keep_gpus or gpu_devices(vm) == [mutation.device_name]:
            # The VM came with its GPUs (kubectl, GitOps): before them, it had none, so
            # removing the GPU later removes it rather than putting it back.
            key = _key(GPUS)
            record["values"].pop(key, None)
            record["absent"] = sorted({*record["absent"], key})
    if not keep_gpus:
        gpus = _get(vm, GPUS)
        name = GPU_ENTRY_NAME
        if isinstance(gpus, list) and gpus and isinstance(gpus[0], dict) and gpus[0].get("name"):
            name = gpus[0]["name"]
        _set(vm, GPUS, [{"name": name, "deviceName": mutation.device_name}])
    # Only host-passthrough shows the guest the host's physical address width, so OVMF can
    # size a 64-bit PCI window for the GPU's BARs; with a named model the guest hangs. An
    # instance type that sets the CPU model owns it (its cpu.model and the VM's conflict).
    if mutation.cpu_model is not False:
        _set(vm, CPU_MODEL, HOST_PASSTHROUGH)
    # VFIO pins all guest memory: a request below guest memory (overcommit) cannot work.
    # With an instance type, memory belongs to the instance type (KubeVirt refuses both).
    guest = _get(vm, MEMORY_GUEST)
    if not uses_instancetype(vm) and guest is not _ABSENT and guest is not None:
        _set(vm, MEMORY_REQUEST, guest)
        record["pinned_memory"] = guest
    # GPU VMs cannot live-migrate: with LiveMigrate a drain would hang on them for ever.
    _set(vm, EVICTION_STRATEGY, mutation.eviction_strategy)
    record["eviction_strategy"] = mutation.eviction_strategy
    _set(vm, (*ANNOTATIONS, PRE_GPU_ANNOTATION), json.dumps(record, sort_keys=True))


def rule_gaps(vm: dict[str, Any], *, eviction_strategy: str, instancetype_cpu_model: str | None = None) -> list[str]:
    """Which GPU rules a VM with a GPU breaks, in words; empty when it follows them all.

    The same rules :func:`_apply_rules` applies: ``host-passthrough``, a memory request equal
    to guest memory (unless an instance type owns the memory), the policy's eviction strategy.
    An instance type's CPU model is the VMI's (``applyCPU``, pkg/instancetype/apply/cpu.go).
    """
    gaps = []
    model = instancetype_cpu_model or _get(vm, CPU_MODEL)
    if model != HOST_PASSTHROUGH:
        gaps.append(f"CPU model {model if model is not _ABSENT else 'unset'} instead of {HOST_PASSTHROUGH}")
    guest = _get(vm, MEMORY_GUEST)
    if not uses_instancetype(vm) and guest not in (_ABSENT, None):
        request = _get(vm, MEMORY_REQUEST)
        if request is _ABSENT or not same_quantity(request, guest):
            shown = "no memory request" if request is _ABSENT else f"memory request {request}"
            gaps.append(f"{shown} for {guest} of guest memory (overcommitted; passthrough pins it all)")
    strategy = _get(vm, EVICTION_STRATEGY)
    if strategy != eviction_strategy:
        shown = "no eviction strategy" if strategy is _ABSENT else f"eviction strategy {strategy}"
        gaps.append(f"{shown} instead of {eviction_strategy}")
    return gaps


_SUFFIXES: dict[str, int | Decimal] = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60,
             "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15, "E": 10**18, "m": Decimal("0.001")}


_LONGEST_FIRST = tuple(sorted(_SUFFIXES, key=len, reverse=True))  # "Mi" is tried before "M"


def quantity(value: Any) -> Decimal | None:
    """A Kubernetes quantity ("32Gi", "34359738368", "1e3") as a number; None if it is none."""
    text = str(value).strip()
    for suffix in _LONGEST_FIRST:
        if text.endswith(suffix) and len(text) > len(suffix):
            number, factor = text[: -len(suffix)], Decimal(_SUFFIXES[suffix])
            break
    else:
        number, factor = text, Decimal(1)
    try:
        return Decimal(number) * factor
    except InvalidOperation:
        return None


def same_quantity(a: Any, b: Any) -> bool:
    qa, qb = quantity(a), quantity(b)
    return a == b if qa is None or qb is None else qa == qb


def _remove_gpu(vm: dict[str, Any]) -> None:
    record = pre_gpu_record(vm) or {}
    gpu_key = _key(GPUS)
    if gpu_key in record.get("values", {}):
        _set(vm, GPUS, record["values"][gpu_key])
    elif gpu_key in record.get("absent", ()) or not record:
        _delete(vm, GPUS)
    _restore(vm, record, CPU_MODEL, if_current=HOST_PASSTHROUGH)
    if "pinned_memory" in record:
        _restore(vm, record, MEMORY_REQUEST, if_current=record["pinned_memory"])
    if "eviction_strategy" in record:
        _restore(vm, record, EVICTION_STRATEGY, if_current=record["eviction_strategy"])
    _delete(vm, (*ANNOTATIONS, PRE_GPU_ANNOTATION))
    created = set(record.get("created", ()))
    for path in reversed(CONTAINERS):
        if _key(path) in created and _get(vm, path) == {}:
            _delete(vm, path)


def plan_patch(observed: dict[str, Any], desired: dict[str, Any]) -> list[dict[str, Any]]:
    """The RFC 6902 JSON Patch turning ``observed`` into ``desired`` (empty: nothing to do).

    Objects are diffed key by key; a list that changed is replaced whole. The applier sends
    the patch with the observed ``resourceVersion``, so a whole-list replace cannot undo a
    change made meanwhile, and no list is diffed element by element (``jsonpatch.make_patch``
    does, for every list of the VM, on each decision).
    """
    return list(_diff(observed, desired, ""))


def _diff(before: dict[str, Any], after: dict[str, Any], path: str) -> Iterator[dict[str, Any]]:
    for key in sorted(before.keys() | after.keys()):
        if key in before and key in after:
            old, new = before[key], after[key]
            if old == new:
                continue  # most keys: no path is spelled for them
            here = f"{path}/{_pointer_token(key)}"
            if isinstance(old, dict) and isinstance(new, dict):
                yield from _diff(old, new, here)
            else:
                yield {"op": "replace", "path": here, "value": copy.deepcopy(new)}
        elif key in after:
            yield {"op": "add", "path": f"{path}/{_pointer_token(key)}", "value": copy.deepcopy(after[key])}
        else:
            yield {"op": "remove", "path": f"{path}/{_pointer_token(key)}"}


def _pointer_token(key: str) -> str:
    """A key as an RFC 6901 reference token (``~`` and ``/`` escaped)."""
    return key.replace("~", "~0").replace("/", "~1")
