"""How long a starting watch bridge takes to read ``k8s-events`` back to its end.

Why this exists: before its first list, a starting bridge reads everything the topic
holds (``streams.kube.watching.last_published``) to learn what it last published of each object,
so that deletions made while no bridge ran are published (docs/watch.md). That read grows
with the topic — every change of the retention period, not only one event per object — and
delays the bridge's readiness by as much.

What it does: on a local Kafka broker (or ``KAFKA_BOOTSTRAP_SERVERS``), in an isolated topic
set, it publishes ``--objects`` VirtualMachine objects of about ``--object-bytes`` each,
``--events-per-object`` events apiece (the last one a deletion for one object in ten), then
times ``last_published`` and checks what it found.

Run it from the repository root::

    .venv/bin/python benchmarks/watch_read_back.py                       # 2,000 VMs x 10 events
    .venv/bin/python benchmarks/watch_read_back.py --objects 10000 --events-per-object 20
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Literal

import kit  # noqa: E402  (this directory's; first: quiets kafka-python's import)

from streams.common.durable import DurableProducer  # noqa: E402  # isort: skip
from streams.common.kafka_clients import COMPRESSION  # noqa: E402  # isort: skip
from streams.kube.watching import TOPIC, Publisher, last_published, select_kinds  # noqa: E402


def vm(index: int, version: int, size: int) -> dict[str, object]:
    return {
        "apiVersion": "kubevirt.io/v1",
        "kind": "VirtualMachine",
        "metadata": {"name": f"vm-{index}", "namespace": "bench", "resourceVersion": str(version),
                     "annotations": {"bench/padding": "x" * size}},
        "spec": {"runStrategy": "Halted", "template": {"spec": {"domain": {"devices": {}}}}},
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--objects", type=int, default=2000)
    parser.add_argument("--events-per-object", type=int, default=10)
    parser.add_argument("--object-bytes", type=int, default=2000)
    kit.add_small_option(parser, objects=200, events_per_object=2)
    args = kit.parse(parser)

    kind = select_kinds("VirtualMachine")[0]
    with contextlib.ExitStack() as stack:
        bootstrap = stack.enter_context(kit.broker()).bootstrap
        deployment = kit.new_deployment(bootstrap, Path(stack.enter_context(tempfile.TemporaryDirectory())))
        stack.callback(deployment.delete_topics)
        kafka = deployment.kafka
        sending = DurableProducer(kafka, client_id="bench", linger_ms=20, compression=COMPRESSION)
        publisher = Publisher(sending, kafka.topic(TOPIC))
        started = time.monotonic()
        for version in range(args.events_per_object):
            for index in range(args.objects):
                last = version == args.events_per_object - 1
                type_: Literal["DELETED", "RELISTED", "MODIFIED"] = "DELETED" if last and index % 10 == 0 else ("RELISTED" if version == 0 else "MODIFIED")
                publisher.send(kind, type_, vm(index, version * args.objects + index + 1, args.object_bytes))
        sending.close()  # what was sent, flushed
        published = time.monotonic() - started
        events = args.objects * args.events_per_object

        started, cpu_started = time.monotonic(), time.process_time()
        alive = last_published(kafka, kafka.topic(TOPIC), [kind])
        read_back, cpu = time.monotonic() - started, time.process_time() - cpu_started
        expected = args.objects - len(range(0, args.objects, 10))
        found = len(alive.get("VirtualMachine", {}))
        assert found == expected, f"{found} alive, expected {expected}"

    print(f"watch read-back: {events} events of ~{args.object_bytes} bytes ({args.objects} VMs x "
          f"{args.events_per_object}), {os.cpu_count()} CPUs, {kit.load_average()}")
    print(f"  published in            {published:8.1f} s")
    print(f"  read back in            {read_back:8.1f} s  ({events / read_back:,.0f} events/s), "
          f"CPU {cpu:.1f} s ({1e6 * cpu / events:.0f} us per event)")
    print(f"  alive after read-back   {found:8d}   (one VM in ten deleted last)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
