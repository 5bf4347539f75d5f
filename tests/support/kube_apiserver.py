"""Pytest plugin: a real Kubernetes API server for tests (``-p tests.support.kube_apiserver``).

With ``KUBECONFIG`` set, tests run against that cluster (which must already have KubeVirt's
and medik8s' CRDs). Otherwise a local etcd + kube-apiserver with those CRDs is started once
per session (``harness.localkube.LocalKube``), so patches are validated by the same schemas
a KubeVirt cluster applies.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client, config

from harness.localkube import LocalKube


@dataclass(frozen=True)
class Kube:
    """How a test reaches the API server; ``local`` is None for a cluster given by KUBECONFIG."""

    kubeconfig: Path
    local: LocalKube | None = None

    def api_client(self) -> client.ApiClient:
        """A new admin client; close it (``with kube.api_client() as api:``)."""
        return config.new_client_from_config(config_file=str(self.kubeconfig))


def minimal_vm(name: str) -> dict[str, Any]:
    """The smallest VirtualMachine KubeVirt's schema accepts: halted, 128Mi, no devices."""
    return {
        "apiVersion": "kubevirt.io/v1",
        "kind": "VirtualMachine",
        "metadata": {"name": name},
        "spec": {
            "runStrategy": "Halted",
            "template": {"spec": {"domain": {"devices": {}, "memory": {"guest": "128Mi"}}}},
        },
    }


@pytest.fixture(scope="session")
def kube() -> Iterator[Kube]:
    env = os.environ.get("KUBECONFIG")
    if env:
        yield Kube(Path(env))
        return
    with LocalKube() as local:
        yield Kube(local.kubeconfig, local)


@pytest.fixture
def kube_namespace(kube: Kube) -> Iterator[str]:
    """A fresh namespace per test, deleted afterwards (without a namespace controller locally,
    it stays Terminating; its name is unique, so that does no harm)."""
    name = f"t-{uuid.uuid4().hex[:10]}"
    with kube.api_client() as api:
        core = client.CoreV1Api(api)
        core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=name)))
        try:
            yield name
        finally:
            core.delete_namespace(name)
