"""The applier as a process: ``vmstream apply`` — its settings, its clients, its probes, start and stop.

The loop is streams/kube/applying/loop.py, the Kubernetes side streams/kube/applying/api.py.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Sequence

from streams.common.probes import ProbeServer, add_probe_arguments
from streams.common.topics import ensure_topics
from streams.kube.applying.api import KubeApplier
from streams.kube.applying.loop import Applier
from streams.kube.informing import PolicyCache


def _run(args: argparse.Namespace) -> int:
    from streams.common.startup import check_secrets, load_config, reach_kafka, run_until_signalled
    from streams.kube.kubeconfig import api_client, reach_kubernetes

    logging.getLogger("kafka").setLevel(logging.WARNING)  # kafka-python's connection chatter
    settings = load_config(args)
    check_secrets(settings, seals="results")  # and checks the worker's commands with the same keys
    api = api_client(args.kubeconfig, pool_size=settings.apply.concurrency)
    reach_kubernetes(api.configuration)
    reach_kafka(settings.kafka)
    ensure_topics(settings.kafka)
    with api:
        cache = PolicyCache(api) if settings.apply.cache else None
        applier = Applier(settings, KubeApplier(api, subresource_url=args.subresource_url,
                                                project_label=settings.labels.project, cache=cache))
        return run_until_signalled(
            "apply", applier.run,
            lambda stop: ProbeServer(ready=lambda: applier.ready.is_set() and not stop.is_set(),
                                     host=args.probe_host, port=args.probe_port, process="apply"),
            host=args.probe_host, port=args.probe_port)


def add_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register ``vmstream apply``."""
    from streams.common.startup import add_kafka_arguments

    apply = commands.add_parser(
        "apply", help="apply the commands topic to the Kubernetes API and publish the results",
        description="Consume commands, apply each to the Kubernetes API once, and publish its "
        "result, audit record and (on failure) a notification.",
    )
    apply.add_argument("--config", help="the configuration file (YAML)")
    apply.add_argument("--kubeconfig", help="kubeconfig file (default: $KUBECONFIG, else in-cluster, "
                       "else ~/.kube/config: streams/kube/kubeconfig.py)")
    apply.add_argument(
        "--subresource-url", metavar="URL",
        help="base URL of KubeVirt's subresource API (start/stop/restart); default: the API "
        "server itself, where virt-api is aggregated",
    )
    add_kafka_arguments(apply)
    add_probe_arguments(apply, 6067)
    apply.set_defaults(handler=_run, process=True)


def main(argv: Sequence[str] | None = None) -> int:
    """``vmstream apply …`` alone (``python -m streams.kube.applying``)."""
    from streams.common.dispatch import run_alone

    return run_alone(add_parser, argv)

