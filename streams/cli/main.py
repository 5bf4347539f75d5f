"""The ``vmstream`` command: one entry point, one subcommand per job.

Each subcommand lives in the module that owns its concern; this module only parses
arguments and hands over.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable, Sequence

from streams.cli import replaying, requesting, tailing
from streams.kube import applying, watching
from streams.serve import notify
from streams.common.logs import limit_client_logs
from streams.common.settings import load_settings

Handler = Callable[[argparse.Namespace], int]


def _simulate(args: argparse.Namespace) -> int:
    from handlers.engine import Engine
    from streams.common.credentials import key_source
    from streams.cli.simulating import run

    settings = load_settings(args.config)
    engine = Engine(settings.rules(), keys=key_source(settings.auth))
    if args.input in (None, "-"):
        return run(engine, sys.stdin, sys.stdout, settings.kafka)
    with open(args.input, encoding="utf-8") as source:
        return run(engine, source, sys.stdout, settings.kafka)


def _schemas(args: argparse.Namespace) -> int:
    from streams.cli.schemas import write_schemas

    for path in write_schemas(args.output):
        print(path)
    return 0


def _worker(args: argparse.Namespace) -> int:
    import faust

    from streams.common.logs import logging_config
    from streams.common.topics import ensure_topics
    from streams.worker.app import Worker

    settings = load_settings(args.config)
    worker = Worker(settings)
    ensure_topics(settings.kafka, changelogs=worker.changelogs())
    level = "DEBUG" if args.verbose else "INFO"
    faust.Worker(worker.app, loglevel=level, quiet=True, logging_config=logging_config(level)).execute_from_commandline()
    return 0


def _topics(args: argparse.Namespace) -> int:
    from streams.common.topics import ensure_topics

    settings = load_settings(args.config)
    for name in ensure_topics(settings.kafka):
        print(f"created {name}")
    return 0


def _api(args: argparse.Namespace) -> int:
    from streams.serve.api import main as serve_api

    return serve_api(args)



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

    api = commands.add_parser("api", help="serve the read API for consoles (docs/api.md)")
    api.add_argument("--config", help="the configuration file (YAML)")
    api.set_defaults(handler=_api)

    requesting.add_parser(commands)
    tailing.add_parser(commands)
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
