"""Where vmstream finds things outside its own tree.

Two places matter: the cache for downloaded and built third-party parts (Kafka's jars,
kube-apiserver and etcd), kept outside the clone so a fresh clone reuses it; and the
shared third-party data (KubeVirt's CRDs and examples, the medik8s CRD), which is read
where it lies and never copied into the project.
"""

from __future__ import annotations

import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent


def cache_dir() -> Path:
    """The download/build cache: ``$VMSTREAM_CACHE_DIR`` or ``~/.cache/vmstream``."""
    path = Path(os.environ.get("VMSTREAM_CACHE_DIR", Path.home() / ".cache" / "vmstream"))
    path.mkdir(parents=True, exist_ok=True)
    return path


def shared_dir() -> Path:
    """Third-party data: ``$VMSTREAM_SHARED_DIR`` or the ``shared/`` beside the clone."""
    return Path(os.environ.get("VMSTREAM_SHARED_DIR", REPO_ROOT.parent / "shared")).resolve()


def kubevirt_crd(plural: str) -> Path:
    """KubeVirt's own CRD manifest, e.g. ``kubevirt_crd("virtualmachines")``."""
    return shared_dir() / "kubevirt" / "crds" / f"{plural}.kubevirt.io.yaml"


def nodemaintenance_crd() -> Path:
    return shared_dir() / "medik8s" / "nodemaintenances.nodemaintenance.medik8s.io.yaml"
