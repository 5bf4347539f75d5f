"""The applier's start on a real broker: it joins its group only once it knows its topic's partitions.

A kafka-python group member whose client metadata does not list the topic yet when the group
assigns partitions (a topic created a moment ago) is assigned nothing, and asks again only at
its next metadata refresh, five minutes later: an applier started with its topics sat idle
that long (benchmarks/README.md). The applier now waits for the commands topic's partitions
in its client's metadata before it subscribes; this test looks at that metadata at the moment
it subscribes.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from harness.running import CONFIG, Deployment
from streams.common.settings import load_settings
from streams.kube import applying
from streams.kube.applying import Applier, KubeApplier
from tests.support.waiting import eventually

pytestmark = [pytest.mark.kube, pytest.mark.kafka]


def test_the_applier_knows_its_topics_partitions_when_it_joins_its_group(
    kafka_bootstrap: str, tmp_path: Path, api: client.ApiClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    deployment = Deployment(kafka_bootstrap, tmp_path)
    deployment.create_topics()
    settings = load_settings(CONFIG).model_copy(update={"kafka": deployment.kafka, "signing": deployment.signing})
    topic = deployment.kafka.topic("commands")
    known_at_subscribe: list[set[int] | None] = []
    real_consumer = applying.consumer

    def consumer(kafka: Any, *topics: str, **extra: Any) -> Any:
        made = real_consumer(kafka, *topics, **extra)
        subscribe = made.subscribe

        def noting_subscribe(subscribed: list[str], **options: Any) -> Any:
            if topic in subscribed:  # what the client's metadata holds now, without asking the broker
                known_at_subscribe.append(made._cluster.partitions_for_topic(topic))
            return subscribe(subscribed, **options)

        made.subscribe = noting_subscribe
        return made

    monkeypatch.setattr(applying, "consumer", consumer)
    stop = threading.Event()
    applier = Applier(settings, KubeApplier(api), group_id=f"{deployment.app_id}-applier")
    thread = threading.Thread(target=applier.run, args=(stop,), daemon=True)
    thread.start()
    try:
        eventually(lambda: known_at_subscribe, "the applier to subscribe")
    finally:
        stop.set()
        thread.join(30)
    assert known_at_subscribe == [set(range(deployment.kafka.partitions))]
