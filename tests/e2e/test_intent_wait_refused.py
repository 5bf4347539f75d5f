"""``vmstream intent set-gpu … --wait`` against the whole loop, when the API server says no.

The same real parts as tests/e2e/test_loop.py (its fixtures: a worker verifying intents'
credentials, the watch bridge, the applier, a kube-apiserver with KubeVirt's CRDs). A
ValidatingAdmissionPolicy created here refuses a GPU on one VM only; the real CLI, signing
with the upstream service's key, exits 5 with the API server's reason for that VM and 0 for
another VM the policy leaves alone.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from kubernetes import client
from kubernetes.client.rest import ApiException

from streams.cli import requesting
from harness.locations import REPO_ROOT
from harness.running import CONFIG, Outputs
from samples.cluster import RTX
from tests.e2e.test_loop import ALICE, KUBEVIRT, NAMESPACE, Loop, loop  # noqa: F401 (fixtures)

pytestmark = [pytest.mark.kube, pytest.mark.kafka]

REFUSED_VM, ALLOWED_VM = "refused-1", "allowed-1"
POLICY = "no-gpu"
# Short enough that the CLI's one-line result (an excerpt of 160 characters of the API
# server's message, streams/cli/tailing.py) holds the whole of it.
REASON = f"no GPU for {REFUSED_VM} here"
ADMISSION = ("admissionregistration.k8s.io", "v1")
GPU_CLASS = "nvidia-rtx-pro-6000-bse"
ADD_GPU = {"spec": {"template": {"spec": {"domain": {"devices": {
    "gpus": [{"name": "gpu-0", "deviceName": RTX}]}}}}}}


def _policy() -> dict[str, object]:
    return {
        "apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingAdmissionPolicy",
        "metadata": {"name": POLICY},
        "spec": {
            "failurePolicy": "Fail",
            "matchConstraints": {"resourceRules": [{
                "apiGroups": ["kubevirt.io"], "apiVersions": ["*"], "operations": ["UPDATE"],
                "resources": ["virtualmachines"]}]},
            "validations": [{
                "expression": f"object.metadata.name != '{REFUSED_VM}' || "
                              "object.spec.?template.?spec.?domain.?devices.?gpus.orValue([]).size() == 0",
                "message": REASON, "reason": "Forbidden"}],
        },
    }


def _binding() -> dict[str, object]:
    return {
        "apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingAdmissionPolicyBinding",
        "metadata": {"name": POLICY},
        "spec": {"policyName": POLICY, "validationActions": ["Deny"]},
    }


def _dry_run_gpu(api: client.ApiClient, name: str) -> tuple[int, str]:
    """(HTTP status, body) of adding a GPU to ``name``, without keeping it."""
    try:
        client.CustomObjectsApi(api).patch_namespaced_custom_object(
            *KUBEVIRT, NAMESPACE, "virtualmachines", name, ADD_GPU, dry_run="All",
            _content_type="application/merge-patch+json")
    except ApiException as exc:
        return int(exc.status), str(exc.body)
    return 200, ""


@pytest.fixture
def no_gpu_for_one_vm(loop: Loop) -> Iterator[None]:  # noqa: F811 (loop: the fixture)
    """The policy and its binding, in effect: a dry-run GPU patch of the one VM is denied."""
    custom = client.CustomObjectsApi(loop.api)
    custom.create_cluster_custom_object(*ADMISSION, "validatingadmissionpolicies", _policy())
    try:
        custom.create_cluster_custom_object(*ADMISSION, "validatingadmissionpolicybindings", _binding())
        deadline = time.monotonic() + 60
        while True:
            status, body = _dry_run_gpu(loop.api, REFUSED_VM)
            if status == 403 and REASON in body:
                break
            assert status == 200, (status, body)  # not in effect yet, or refusing for another reason
            assert time.monotonic() < deadline, "the admission policy never took effect"
            time.sleep(0.2)  # polling interval
        assert _dry_run_gpu(loop.api, ALLOWED_VM) == (200, "")
        yield
    finally:
        for plural in ("validatingadmissionpolicybindings", "validatingadmissionpolicies"):
            try:
                custom.delete_cluster_custom_object(*ADMISSION, plural, POLICY)
            except ApiException as exc:
                if exc.status != 404:
                    raise


@pytest.fixture
def vms(loop: Loop) -> Loop:  # noqa: F811 (loop: the fixture)
    """A GPU node and two stopped VMs without a GPU, both seen by the worker."""
    loop.node("gpu-node-1", gpus={RTX: 2})
    for name in (REFUSED_VM, ALLOWED_VM):
        loop.vm(name, run_strategy="Manual")
    for name in (REFUSED_VM, ALLOWED_VM):
        key = f"VirtualMachine/{NAMESPACE}/{name}"

        def observed(outputs: Outputs, key: str = key) -> bool:
            return any(a["input"]["key"] == key for a in outputs.seen["audit"])

        loop.outputs.wait_for(observed, timeout=90, what=f"the worker to observe {key}")
    return loop


def set_gpu(loop: Loop, name: str, pem: Path) -> subprocess.CompletedProcess[str]:
    """The CLI as a person runs it, signing with the upstream service's key."""
    command = [str(REPO_ROOT / ".venv" / "bin" / "vmstream"), "intent", "set-gpu",
               "--by", ALICE, "--project", "proj-a", "--namespace", NAMESPACE, "--name", name,
               "--gpu-class", GPU_CLASS, "--config", str(CONFIG),
               "--key", str(pem), "--kid", loop.signer.key.kid, "--wait", "--timeout", "90"]
    return subprocess.run(command, env=loop.deployment.env(0), capture_output=True, text=True, timeout=150,
                          check=False)


def test_intent_wait_exits_5_with_the_api_servers_reason_when_it_refuses_the_gpu_patch(
    vms: Loop, no_gpu_for_one_vm: None, tmp_path: Path
) -> None:
    pem = tmp_path / "upstream.pem"
    pem.write_bytes(vms.signer.key.private_pem())

    refused = set_gpu(vms, REFUSED_VM, pem)
    assert refused.returncode == requesting.EXIT_FAILED, (refused.stdout, refused.stderr)
    assert f"  result failed patch_vm VirtualMachine {NAMESPACE}/{REFUSED_VM} [cmd-" in refused.stdout
    assert f"ValidatingAdmissionPolicy '{POLICY}'" in refused.stdout and REASON in refused.stdout, refused.stdout
    assert "command(s) failed in Kubernetes" in refused.stderr, refused.stderr
    vm = vms.get("virtualmachines", REFUSED_VM)
    assert vm is not None and "gpus" not in vm["spec"]["template"]["spec"]["domain"]["devices"]

    allowed = set_gpu(vms, ALLOWED_VM, pem)
    assert allowed.returncode == requesting.EXIT_ACCEPTED, (allowed.stdout, allowed.stderr)
    assert f"  result applied patch_vm VirtualMachine {NAMESPACE}/{ALLOWED_VM} [cmd-" in allowed.stdout
    vm = vms.get("virtualmachines", ALLOWED_VM)
    assert vm is not None
    assert vm["spec"]["template"]["spec"]["domain"]["devices"]["gpus"] == [{"name": "gpu-0", "deviceName": RTX}]
