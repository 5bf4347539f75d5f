"""Where vmstream finds things outside its own tree.

Both live in the cache (``$VMSTREAM_CACHE_DIR`` or ``~/.cache/vmstream``), outside the
clone, so a fresh clone reuses them: the downloaded and built parts (Kafka's jars,
kube-apiserver and etcd), and the third-party data the tests and the local API server use
(KubeVirt's CRDs and example manifests, the medik8s NodeMaintenance CRD), which
``tools/kubevirtdata/build.sh`` generates from the Go module proxy at the versions its
go.mod and go.sum pin, and Strimzi's CRDs, which ``tools/strimzicrds/build.sh`` generates
with Strimzi's own generator from Maven Central at the version its pom.xml pins. Nothing is
read from beside the clone.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import subprocess
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
KUBEVIRTDATA_DIR = REPO_ROOT / "tools" / "kubevirtdata"
STRIMZICRDS_DIR = REPO_ROOT / "tools" / "strimzicrds"
KUBEVIRT_MODULE = "kubevirt.io/kubevirt"
NODEMAINTENANCE_MODULE = "github.com/medik8s/node-maintenance-operator"

log = logging.getLogger(__name__)


class ThirdPartyDataError(RuntimeError):
    """The third-party data is not in the cache and could not be generated."""


def cache_dir() -> Path:
    """The download/build cache: ``$VMSTREAM_CACHE_DIR`` or ``~/.cache/vmstream``."""
    path = Path(os.environ.get("VMSTREAM_CACHE_DIR", Path.home() / ".cache" / "vmstream"))
    path.mkdir(parents=True, exist_ok=True)
    return path


def third_party_versions() -> tuple[str, str]:
    """(kubevirt.io/kubevirt, node-maintenance-operator) versions pinned by tools/kubevirtdata.

    KubeVirt is required in go.mod; the medik8s module is only downloaded, so go.sum is
    what pins it.
    """
    gomod = (KUBEVIRTDATA_DIR / "go.mod").read_text()
    gosum = (KUBEVIRTDATA_DIR / "go.sum").read_text()
    kubevirt = re.search(
        rf"^\s*(?:require\s+)?{re.escape(KUBEVIRT_MODULE)}\s+(v\S+)", gomod, re.MULTILINE
    )
    nmo = re.search(rf"^{re.escape(NODEMAINTENANCE_MODULE)} (v[^\s/]+) h1:", gosum, re.MULTILINE)
    if kubevirt is None or nmo is None:
        raise ThirdPartyDataError(
            f"{KUBEVIRTDATA_DIR} does not pin {KUBEVIRT_MODULE} and {NODEMAINTENANCE_MODULE}"
        )
    return kubevirt.group(1), nmo.group(1)


def built(out: Path, stamp: str, script: Path, *, tool: str, what: str) -> Path:
    """``out`` once ``out/versions`` holds ``stamp``, running ``script`` first if it does not.

    The check is made here too, not only in the script, so that a machine with a warm cache
    needs no ``tool`` (the Go toolchain, Maven) at all.
    """
    versions = out / "versions"
    if versions.is_file() and versions.read_text() == stamp:
        return out
    if shutil.which(tool) is None:
        raise ThirdPartyDataError(f"{what} are not in {out} and there is no {tool} to make them ({script}); "
                                  f"install {tool}")
    log.info("making %s", what)
    env = {**os.environ, "VMSTREAM_CACHE_DIR": str(cache_dir())}
    # The script echoes its output dir on stdout; progress and compiler errors go to stderr.
    result = subprocess.run(["bash", str(script)], env=env, stdout=subprocess.PIPE, text=True, check=False)
    if result.returncode != 0 or not (versions.is_file() and versions.read_text() == stamp):
        raise ThirdPartyDataError(f"{script.relative_to(REPO_ROOT)} failed with exit code {result.returncode}")
    return out


def third_party_dir() -> Path:
    """The generated third-party data, generating it first if the cache lacks it.

    Layout: ``kubevirt/crds/<plural>.kubevirt.io.yaml``, ``kubevirt/control-plane/*.yaml``,
    ``kubevirt/examples/*.yaml``, ``kubevirt/bin/{virt-controller,virt-api}``,
    ``medik8s/nodemaintenances.nodemaintenance.medik8s.io.yaml``.
    """
    kubevirt, nmo = third_party_versions()
    return built(
        cache_dir() / "kubevirtdata" / f"kubevirt-{kubevirt}-nmo-{nmo}-control-plane",  # as build.sh names it
        f"{KUBEVIRT_MODULE} {kubevirt}\n{NODEMAINTENANCE_MODULE} {nmo}\nbinaries virt-controller virt-api",
        KUBEVIRTDATA_DIR / "build.sh", tool="go",
        what=f"KubeVirt {kubevirt}'s CRDs and binaries (minutes the first time)")


def kubevirt_crd(plural: str) -> Path:
    """KubeVirt's own CRD manifest, e.g. ``kubevirt_crd("virtualmachines")``."""
    return third_party_dir() / "kubevirt" / "crds" / f"{plural}.kubevirt.io.yaml"


def kubevirt_crds() -> list[Path]:
    """Every CRD KubeVirt's virt-operator installs, and the KubeVirt CRD."""
    return sorted((third_party_dir() / "kubevirt" / "crds").glob("*.yaml"))


def kubevirt_control_plane_dir() -> Path:
    """virt-operator's RBAC, virt-api's webhook configurations and APIServices (namespace kubevirt)."""
    return third_party_dir() / "kubevirt" / "control-plane"


def kubevirt_binary(command: str) -> Path:
    """KubeVirt's own ``virt-controller`` or ``virt-api``, built at the pinned version."""
    return third_party_dir() / "kubevirt" / "bin" / command


def kubevirt_examples_dir() -> Path:
    """KubeVirt's ``examples/`` manifests (VMs, VMIs, and other kinds) at the pinned version."""
    return third_party_dir() / "kubevirt" / "examples"


def nodemaintenance_crd() -> Path:
    return third_party_dir() / "medik8s" / "nodemaintenances.nodemaintenance.medik8s.io.yaml"


def strimzi_version() -> str:
    """The Strimzi release tools/strimzicrds/pom.xml pins (io.strimzi:api and crd-generator)."""
    pom = (STRIMZICRDS_DIR / "pom.xml").read_text()
    match = re.search(r"<strimzi\.version>\s*([^<\s]+)\s*</strimzi\.version>", pom)
    if match is None:
        raise ThirdPartyDataError(f"{STRIMZICRDS_DIR / 'pom.xml'} pins no strimzi.version")
    return match.group(1)


def strimzi_crds_dir() -> Path:
    """Strimzi's CRDs at the pinned version, generating them first if the cache lacks them.

    Layout: ``crds/<plural>.<group>.yaml``, one CRD a file, e.g.
    ``crds/kafkatopics.kafka.strimzi.io.yaml``.
    """
    version = strimzi_version()
    return built(cache_dir() / "strimzicrds" / version,
                 f"io.strimzi:api {version}\nio.strimzi:crd-generator {version}",
                 STRIMZICRDS_DIR / "build.sh", tool="mvn",
                 what=f"Strimzi {version}'s CRDs (Maven fetches two jars the first time)")


def strimzi_crd(name: str) -> Path:
    """Strimzi's own CRD by its name: ``strimzi_crd("kafkatopics.kafka.strimzi.io")``."""
    return strimzi_crds_dir() / "crds" / f"{name}.yaml"


def strimzi_crds() -> list[Path]:
    """Every CRD Strimzi's build generates for its cluster operator, at the pinned version."""
    return sorted((strimzi_crds_dir() / "crds").glob("*.yaml"))
