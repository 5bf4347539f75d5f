"""Fixtures shared by the tests against the API server."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from kubernetes import client

from tests.support.kube_apiserver import Kube


@pytest.fixture
def api(kube: Kube) -> Iterator[client.ApiClient]:
    """An API client for the session's control plane, closed after the test."""
    with kube.api_client() as api_client:
        yield api_client
