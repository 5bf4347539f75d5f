"""The CRD-schema checker accepts KubeVirt's own examples and rejects broken VMs for the right reason."""

from __future__ import annotations

import copy
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from jsonschema import Draft202012Validator

from harness.locations import kubevirt_examples_dir
from tests.support import kubevirt_schema as ks

EXAMPLES_DIR = kubevirt_examples_dir()
#: The kinds of KubeVirt's examples checked here; the directory also holds instancetypes,
#: preferences, pools, replica sets, migration policies and the like.
EXAMPLE_KINDS = ("VirtualMachine", "VirtualMachineInstance")


def _example_docs() -> list[tuple[str, dict[str, Any]]]:
    """Every VM and VMI document in KubeVirt's examples, labelled ``file#index``."""
    docs = []
    for path in sorted(EXAMPLES_DIR.glob("*.yaml")):
        with path.open(encoding="utf-8") as fh:
            for index, doc in enumerate(d for d in yaml.safe_load_all(fh) if d is not None):
                if doc.get("kind") in EXAMPLE_KINDS:
                    docs.append((f"{path.name}#{index}", doc))
    return docs


EXAMPLES = _example_docs()


def _example(name: str) -> dict[str, Any]:
    """A fresh deep copy, so mutations never leak between tests."""
    return copy.deepcopy(next(doc for label, doc in EXAMPLES if label == f"{name}#0"))


@pytest.fixture
def vm() -> dict[str, Any]:
    return _example("vm-cirros.yaml")


def _domain(vm: dict[str, Any]) -> dict[str, Any]:
    domain: dict[str, Any] = vm["spec"]["template"]["spec"]["domain"]
    return domain


def _crd_node(kind: str, dotted: str) -> dict[str, Any]:
    """A node of the raw CRD schema by dotted path; ``[]`` steps into ``items``."""
    node = ks.crd_schema(kind)
    for step in dotted.split("."):
        node = node["items"] if step == "[]" else node["properties"][step]
    return node


VM_DOMAIN = "spec.template.spec.domain"

# --------------------------------------------------------------------------- examples


def test_examples_cover_vms_and_vmis() -> None:
    kinds = [doc["kind"] for _, doc in EXAMPLES]
    assert kinds.count("VirtualMachine") >= 3
    assert kinds.count("VirtualMachineInstance") >= 2
    labels = {label for label, _ in EXAMPLES}
    assert {"vm-cirros.yaml#0", "vm-alpine-datavolume.yaml#0", "vmi-gpu.yaml#0"} <= labels


@pytest.mark.parametrize(("label", "doc"), EXAMPLES, ids=[label for label, _ in EXAMPLES])
def test_example_validates(label: str, doc: dict[str, Any]) -> None:
    checks: dict[str, tuple[Callable[..., list[str]], Callable[..., None]]] = {
        "VirtualMachine": (ks.vm_errors, ks.validate_vm),
        "VirtualMachineInstance": (ks.vmi_errors, ks.validate_vmi),
    }
    errors_of, validate = checks[doc["kind"]]
    assert errors_of(doc) == []
    assert ks.errors(doc["kind"], doc) == []
    validate(doc)
    ks.validate(doc["kind"], doc)


@pytest.mark.parametrize("kind", sorted(ks.KINDS))
def test_translation_is_valid_draft_2020_12(kind: str) -> None:
    schema = ks.json_schema(kind)
    Draft202012Validator.check_schema(schema)
    assert schema["properties"]["kind"] == {"const": kind}


def test_kubevirt_cr() -> None:
    cr: dict[str, Any] = {
        "apiVersion": "kubevirt.io/v1",
        "kind": "KubeVirt",
        "metadata": {"name": "kubevirt", "namespace": "kubevirt"},
        "spec": {"configuration": {"developerConfiguration": {"featureGates": ["GPU"]}}},
    }
    assert ks.errors("KubeVirt", cr) == []
    cr["spec"]["imagePullPolicy"] = 1
    assert ks.errors("KubeVirt", cr) == ["spec.imagePullPolicy: expected string, got integer 1"]


# --------------------------------------------------------------------------- mutations


def test_wrong_type(vm: dict[str, Any]) -> None:
    vm["spec"]["runStrategy"] = 5
    assert ks.vm_errors(vm) == ["spec.runStrategy: expected string, got integer 5"]
    with pytest.raises(ks.KubeVirtSchemaError) as caught:
        ks.validate_vm(vm)
    assert isinstance(caught.value, AssertionError)
    assert "VirtualMachine 'vm-cirros'" in str(caught.value)
    assert "spec.runStrategy: expected string" in str(caught.value)
    assert caught.value.errors == ks.vm_errors(vm)


def test_run_strategy_values_are_not_in_the_schema(vm: dict[str, Any]) -> None:
    """Only KubeVirt's webhook knows the run strategies: the schema passes any string."""
    assert _crd_node("VirtualMachine", "spec.runStrategy") == {
        "description": _crd_node("VirtualMachine", "spec.runStrategy")["description"],
        "type": "string",
    }
    vm["spec"]["runStrategy"] = "Alwayz"
    assert ks.vm_errors(vm) == []


def test_unknown_field(vm: dict[str, Any]) -> None:
    _domain(vm)["cpu"] = {"modle": "host-passthrough"}
    assert ks.vm_errors(vm) == [f"{VM_DOMAIN}.cpu.modle: unknown field"]
    assert ks.vm_errors(vm, allow_unknown_fields=True) == []
    with pytest.raises(AssertionError, match=r"spec\.template\.spec\.domain\.cpu\.modle: unknown field"):
        ks.validate_vm(vm)
    ks.validate_vm(vm, allow_unknown_fields=True)


def test_unknown_field_in_metadata(vm: dict[str, Any]) -> None:
    vm["metadata"]["lables"] = {"a": "b"}
    vm["spec"]["template"]["metadata"]["annotation"] = {}
    assert ks.vm_errors(vm) == [
        "metadata.lables: unknown field",
        "spec.template.metadata.annotation: unknown field",
    ]


def test_preserve_unknown_fields_is_honoured(vm: dict[str, Any]) -> None:
    assert _crd_node("VirtualMachine", f"{VM_DOMAIN}.clock")["x-kubernetes-preserve-unknown-fields"]
    _domain(vm)["clock"] = {"utc": {}, "somethingNew": {"x": 1}}
    assert ks.vm_errors(vm) == []
    _domain(vm)["clock"]["utc"] = {"offsetSecs": 1}  # known sub-objects stay strict
    assert ks.vm_errors(vm) == [f"{VM_DOMAIN}.clock.utc.offsetSecs: unknown field"]


@pytest.mark.parametrize("kind", ["VirtualMachine", "VirtualMachineInstance"])
def test_gpu_items_require_only_name(kind: str) -> None:
    prefix = "spec.template.spec." if kind == "VirtualMachine" else "spec."
    items = _crd_node(kind, prefix + "domain.devices.gpus.[]")
    assert items["required"] == ["name"]
    assert {"deviceName", "claimName", "requestName"} <= set(items["properties"])


def test_gpu_entries(vm: dict[str, Any]) -> None:
    gpus: list[dict[str, Any]] = [{"deviceName": "nvidia.com/GA102GL_A10"}]
    _domain(vm)["devices"]["gpus"] = gpus
    assert ks.vm_errors(vm) == [f"{VM_DOMAIN}.devices.gpus[0].name: required field missing"]
    gpus[0]["name"] = "gpu1"
    assert ks.vm_errors(vm) == []
    gpus.append({"name": "gpu2"})  # deviceName is optional (claimName/requestName is the DRA way)
    assert ks.vm_errors(vm) == []
    gpus.append({"name": "gpu3", "deviceName": 10, "virtualGPUOptions": {"display": {"enabled": "yes"}}})
    assert ks.vm_errors(vm) == [
        f"{VM_DOMAIN}.devices.gpus[2].deviceName: expected string, got integer 10",
        f"{VM_DOMAIN}.devices.gpus[2].virtualGPUOptions.display.enabled: expected boolean, got string 'yes'",
    ]


def test_memory_guest_is_int_or_string() -> None:
    node = _crd_node("VirtualMachine", f"{VM_DOMAIN}.memory.guest")
    assert node["x-kubernetes-int-or-string"] is True
    assert "type" not in node


@pytest.mark.parametrize("value", [12, "12", "128Mi", "1G", "0.5Gi", "1e3", 2**40])
def test_memory_guest_accepts(vm: dict[str, Any], value: object) -> None:
    _domain(vm)["memory"]["guest"] = value
    assert ks.vm_errors(vm) == []


@pytest.mark.parametrize(
    ("value", "reason"),
    [
        (1.5, "expected integer or string, got number 1.5"),
        (True, "expected integer or string, got boolean True"),
        (None, "expected integer or string, got null"),
        ([12], "expected integer or string, got array [12]"),
        ("12 GiB", "'12 GiB' is not a resource quantity (e.g. 2Gi, 500m, 1024)"),
        ("12GB", "'12GB' is not a resource quantity (e.g. 2Gi, 500m, 1024)"),
    ],
)
def test_memory_guest_rejects(vm: dict[str, Any], value: object, reason: str) -> None:
    _domain(vm)["memory"]["guest"] = value
    assert ks.vm_errors(vm) == [f"{VM_DOMAIN}.memory.guest: {reason}"]


def test_resource_requests_are_quantities(vm: dict[str, Any]) -> None:
    _domain(vm)["resources"] = {"requests": {"memory": "1Gi", "cpu": 2}, "limits": {"nvidia.com/gpu": 1}}
    assert ks.vm_errors(vm) == []
    _domain(vm)["resources"]["requests"]["memory"] = "lots"
    assert ks.vm_errors(vm) == [
        f"{VM_DOMAIN}.resources.requests.memory: 'lots' is not a resource quantity (e.g. 2Gi, 500m, 1024)"
    ]


def test_null_where_not_nullable(vm: dict[str, Any]) -> None:
    assert "nullable" not in _crd_node("VirtualMachine", f"{VM_DOMAIN}.cpu")
    _domain(vm)["cpu"] = None
    vm["spec"]["runStrategy"] = None
    assert ks.vm_errors(vm) == [
        "spec.runStrategy: expected string, got null",
        f"{VM_DOMAIN}.cpu: expected object, got null",
    ]


def test_null_where_nullable(vm: dict[str, Any]) -> None:
    assert _crd_node("VirtualMachine", "spec.template.metadata")["nullable"] is True
    assert _crd_node("VirtualMachine", "spec.dataVolumeTemplates.[]")["nullable"] is True
    vm["spec"]["template"]["metadata"] = None
    vm["spec"]["dataVolumeTemplates"] = [None]
    assert ks.vm_errors(vm) == []


def test_vmstream_mutation_is_valid(vm: dict[str, Any]) -> None:
    """The shape of what vmstream writes: GPUs, cpu.model, memory requests, eviction."""
    domain = _domain(vm)
    domain["devices"]["gpus"] = [{"name": "gpu1", "deviceName": "nvidia.com/GA102GL_A10"}]
    domain["cpu"] = {"model": "host-passthrough", "cores": 4, "dedicatedCpuPlacement": True}
    domain["resources"] = {"requests": {"memory": "8Gi"}}
    vm["spec"]["template"]["spec"]["evictionStrategy"] = "LiveMigrate"
    vm["metadata"]["annotations"] = {"vmstream.io/revision": "3"}
    ks.validate_vm(vm)


def test_int32_range(vm: dict[str, Any]) -> None:
    assert _crd_node("VirtualMachine", f"{VM_DOMAIN}.cpu.cores")["format"] == "int32"
    _domain(vm)["cpu"] = {"cores": 2**31 - 1}
    assert ks.vm_errors(vm) == []
    _domain(vm)["cpu"] = {"cores": 2**31}
    assert ks.vm_errors(vm) == [f"{VM_DOMAIN}.cpu.cores: 2147483648 is not a valid int32"]


def test_list_type_map_and_set_reject_duplicates(vm: dict[str, Any]) -> None:
    spec = vm["spec"]["template"]["spec"]
    tsc = {"maxSkew": 1, "topologyKey": "zone", "whenUnsatisfiable": "DoNotSchedule"}
    spec["topologySpreadConstraints"] = [tsc, {**tsc, "maxSkew": 2}]
    users = {"users": ["fedora", "root", "fedora"]}
    spec["accessCredentials"] = [
        {"sshPublicKey": {"source": {"secret": {"secretName": "keys"}}, "propagationMethod": {"qemuGuestAgent": users}}}
    ]
    assert ks.vm_errors(vm) == [
        "spec.template.spec.accessCredentials[0].sshPublicKey.propagationMethod.qemuGuestAgent.users[2]: "
        "duplicate set item 'fedora' (first at index 0)",
        "spec.template.spec.topologySpreadConstraints[1]: "
        "duplicate map key topologyKey='zone', whenUnsatisfiable='DoNotSchedule' (first at index 0)",
    ]
    spec["topologySpreadConstraints"][1]["whenUnsatisfiable"] = "ScheduleAnyway"
    users["users"].pop()
    assert ks.vm_errors(vm) == []


def test_metadata_is_checked_lightly(vm: dict[str, Any]) -> None:
    vm["metadata"]["labels"]["kubevirt.io/vm"] = 3
    vm["metadata"]["labels"]["bad key!"] = "x"
    vm["metadata"]["annotations"] = {"note": ["not", "a", "string"]}
    vm["metadata"]["namespace"] = "Default"
    vm["spec"]["template"]["metadata"]["labels"]["tier"] = "has space"
    assert ks.vm_errors(vm) == [
        "metadata.annotations.note: expected string, got array ['not', 'a', 'string']",
        "metadata.labels: invalid key 'bad key!' (pattern "
        "'^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\\\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
        "[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$')",
        "metadata.labels['kubevirt.io/vm']: expected string, got integer 3",
        "metadata.namespace: 'Default' does not match '^[a-z0-9]([-a-z0-9]*[a-z0-9])?$'",
        "spec.template.metadata.labels.tier: 'has space' does not match "
        "'^([A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)?$'",
    ]


def test_metadata_name(vm: dict[str, Any]) -> None:
    vm["metadata"]["creationTimestamp"] = None  # what `kubectl create --dry-run -o yaml` emits
    assert ks.vm_errors(vm) == []
    vm["metadata"]["creationTimestamp"] = "2024-05-01T10:00:00Z"
    assert ks.vm_errors(vm) == []
    vm["metadata"]["creationTimestamp"] = "yesterday"
    del vm["metadata"]["name"]
    assert ks.vm_errors(vm) == [
        "metadata.creationTimestamp: 'yesterday' is not a valid date-time",
        "metadata: one of ['name', 'generateName'] is required",
    ]
    vm["metadata"] = {"generateName": "gpu-vm-"}
    assert ks.vm_errors(vm) == []
    vm["metadata"] = {"name": "Not_A_DNS_Name"}
    assert ks.vm_errors(vm) == [
        f"metadata.name: 'Not_A_DNS_Name' does not match {ks._DNS1123_SUBDOMAIN!r}",
    ]


def test_type_meta_and_required_spec(vm: dict[str, Any]) -> None:
    vmi = _example("vmi-gpu.yaml")
    vmi_as_vm = ks.vm_errors(vmi)
    assert "kind: must be 'VirtualMachine', got 'VirtualMachineInstance'" in vmi_as_vm
    assert "spec.domain: unknown field" in vmi_as_vm  # a VMI spec is not a VM spec
    assert ks.vmi_errors(vmi) == []
    vm["apiVersion"] = "kubevirt.io/v1alpha3"
    del vm["spec"]
    assert ks.vm_errors(vm) == [
        "apiVersion: must be 'kubevirt.io/v1', got 'kubevirt.io/v1alpha3'",
        "spec: required field missing",
    ]


def test_vmi_mutations() -> None:
    vmi = _example("vmi-gpu.yaml")
    vmi["spec"]["domain"]["devices"]["gpus"][0]["nmae"] = "typo"
    vmi["spec"]["domain"]["memory"]["guest"] = 1024
    with pytest.raises(ks.KubeVirtSchemaError) as caught:
        ks.validate_vmi(vmi)
    assert caught.value.errors == ["spec.domain.devices.gpus[0].nmae: unknown field"]


def test_every_violation_is_reported(vm: dict[str, Any]) -> None:
    vm["spec"]["runStrategy"] = 5
    _domain(vm)["cpu"] = {"modle": "x"}
    _domain(vm)["devices"]["gpus"] = [{"deviceName": "d"}]
    _domain(vm)["memory"]["guest"] = "big"
    with pytest.raises(ks.KubeVirtSchemaError) as caught:
        ks.validate_vm(vm)
    message = str(caught.value)
    assert "(4 error(s))" in message
    for path in ("spec.runStrategy", "cpu.modle", "gpus[0].name", "memory.guest"):
        assert path in message


def test_unknown_kind() -> None:
    with pytest.raises(ValueError, match="unknown kind 'Pod'"):
        ks.errors("Pod", {})


def test_schemas_are_built_once_and_not_shared() -> None:
    assert ks._validator("VirtualMachine", True) is ks._validator("VirtualMachine", True)
    copy_ = ks.json_schema("VirtualMachine")
    copy_["properties"].clear()
    assert ks.json_schema("VirtualMachine")["properties"]
    raw = ks.crd_schema("VirtualMachine")
    raw["properties"].clear()
    assert ks.crd_schema("VirtualMachine")["properties"]


def test_validation_is_fast(vm: dict[str, Any]) -> None:
    """One call must stay cheap enough to run on every produced VM; see the time with ``-rP``."""
    ks.validate_vm(vm)  # warm the caches: loading + translation happen once per process
    timings = []
    for _ in range(20):
        start = time.perf_counter()
        ks.validate_vm(vm)
        timings.append(time.perf_counter() - start)
    median_ms = statistics.median(timings) * 1000
    print(f"validate_vm: median {median_ms:.3f} ms over {len(timings)} calls")
    assert median_ms < 50, f"one validate_vm call took {median_ms:.2f} ms"


def test_crds_are_generated_into_the_cache_at_the_pinned_version() -> None:
    """The CRDs stay outside the repository: KubeVirt's own, at the version go.mod pins."""
    from harness.locations import REPO_ROOT, cache_dir, kubevirt_crd, third_party_versions

    kubevirt, _ = third_party_versions()
    assert kubevirt == "v1.7.0"
    for plural in ks.KINDS.values():
        path = kubevirt_crd(plural)
        assert path.is_file()
        assert REPO_ROOT not in path.resolve().parents
        assert cache_dir().resolve() in path.resolve().parents
        assert kubevirt in path.parent.parent.parent.name
    assert (path.parent.parent.parent / "versions").read_text().startswith(
        f"kubevirt.io/kubevirt {kubevirt}\n"
    )


def test_without_the_data_or_go_the_error_says_how_to_get_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An empty cache and no Go toolchain: a clear error, not a missing file later."""
    from harness import locations

    monkeypatch.setenv("VMSTREAM_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr("harness.locations.shutil.which", lambda name: None)
    with pytest.raises(locations.ThirdPartyDataError, match="tools/kubevirtdata/build.sh"):
        locations.kubevirt_crd("virtualmachines")
    assert list(tmp_path.iterdir()) == []
