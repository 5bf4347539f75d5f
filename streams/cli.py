"""The ``vmstream`` command: one entry point, one subcommand per job.

Each subcommand lives in the module that owns its concern; this module only parses
arguments and hands over.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable, Sequence

from streams import applying, demo, notify, replaying, requesting, tailing, watching
from streams.logs import limit_client_logs
from streams.settings import load_settings

Handler = Callable[[argparse.Namespace], int]


def _simulate(args: argparse.Namespace) -> int:
    from handlers.engine import Engine
    from streams.credentials import key_source
    from streams.simulating import run

    settings = load_settings(args.config)
    engine = Engine(settings.rules(), keys=key_source(settings.auth))
    if args.input in (None, "-"):
        return run(engine, sys.stdin, sys.stdout, settings.kafka)
    with open(args.input, encoding="utf-8") as source:
        return run(engine, source, sys.stdout, settings.kafka)


def _schemas(args: argparse.Namespace) -> int:
    from streams.schemas import write_schemas

    for path in write_schemas(args.output):
        print(path)
    return 0


def _worker(args: argparse.Namespace) -> int:
    import faust

    from streams.logs import logging_config
    from streams.topics import ensure_topics
    from streams.worker import Worker

    settings = load_settings(args.config)
    worker = Worker(settings)
    ensure_topics(settings.kafka, changelogs=worker.changelogs())
    level = "DEBUG" if args.verbose else "INFO"
    faust.Worker(worker.app, loglevel=level, quiet=True, logging_config=logging_config(level)).execute_from_commandline()
    return 0


def _topics(args: argparse.Namespace) -> int:
    from streams.topics import ensure_topics

    settings = load_settings(args.config)
    for name in ensure_topics(settings.kafka):
        print(f"created {name}")
    return 0


def _api(args: argparse.Namespace) -> int:
    from streams.api import main as serve_api

    return serve_api(args)


def _kafka(args: argparse.Namespace) -> int:
    from streams import localkafka

    return localkafka.main([args.action, *args.options])


def _kube(args: argparse.Namespace) -> int:
    from streams import localkube

    return localkube.main([args.action])


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="vmstream", description="Keeps GPU-passthrough VMs on KubeVirt right, event by event, over Kafka."
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log at DEBUG level")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    simulate = commands.add_parser("simulate", help="run the decision engine over JSON Lines, offline")
    simulate.add_argument("--config", help="the worker's configuration file (YAML)")
    simulate.add_argument("--input", default="-", help="JSON Lines input file, or - for stdin")
    simulate.set_defaults(handler=_simulate)

    schemas = commands.add_parser("schemas", help="write the JSON Schemas and the AsyncAPI document")
    schemas.add_argument("--output", default="docs/schemas", help="directory to write into")
    schemas.set_defaults(handler=_schemas)
    worker = commands.add_parser("worker", help="run the stream processor (Faust) on Kafka")
    worker.add_argument("--config", help="the configuration file (YAML)")
    worker.set_defaults(handler=_worker)

    topics = commands.add_parser("topics", help="create the Kafka topics (idempotent)")
    topics.add_argument("action", choices=["create"])
    topics.add_argument("--config", help="the configuration file (YAML)")
    topics.set_defaults(handler=_topics)

    kafka = commands.add_parser("kafka", help="a local single-node Kafka broker (no Docker)")
    kafka.add_argument("action", choices=["up", "down", "status"])
    kafka.add_argument("options", nargs=argparse.REMAINDER,
                       help="--port, --state-dir, --reset (see vmstream kafka up --help)")
    kafka.set_defaults(handler=_kafka)

    kube = commands.add_parser("kube", help="a local kube-apiserver + etcd with KubeVirt's CRDs")
    kube.add_argument("action", choices=["up", "down", "status"])
    kube.set_defaults(handler=_kube)

    api = commands.add_parser("api", help="serve the read API for consoles (docs/api.md)")
    api.add_argument("--config", help="the configuration file (YAML)")
    api.set_defaults(handler=_api)

    requesting.add_parser(commands)
    tailing.add_parser(commands)
    demo.add_parser(commands)
    replaying.add_parser(commands)
    applying.add_parser(commands)
    watching.add_parser(commands)
    notify.add_parser(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING, stream=sys.stderr)
    limit_client_logs()  # a broker outage: a few lines per kind and period, not thousands
    if not args.verbose:
        logging.getLogger("streams").setLevel(logging.INFO)
    handler: Handler = args.handler
    return handler(args)


if __name__ == "__main__":
    sys.exit(main())
