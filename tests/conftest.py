"""Plugins for the real parts: a Kafka broker and a kube-apiserver, started once a session."""

from __future__ import annotations

import pytest

pytest_plugins = ["tests.support.kafka_broker", "tests.support.kube_apiserver"]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """A test that asks for a real part is marked for it, said or not: the tiers select tests
    by these marks (`make test-kafka` runs those not marked `kube`), so a mark forgotten must
    not start an API server in a tier that promises none."""
    for item in items:
        needs = getattr(item, "fixturenames", ())
        if "kube" in needs:
            item.add_marker(pytest.mark.kube)
        if "kafka_bootstrap" in needs:
            item.add_marker(pytest.mark.kafka)
