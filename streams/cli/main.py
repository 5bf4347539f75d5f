"""The ``vmstream`` command: one entry point, one subcommand per job.

Each subcommand lives in the module that owns its concern; this module builds the parser
and hands over to streams/common/dispatch.py, where logging is set up and a
:class:`~streams.common.errors.UserError` ends as one line and its exit code.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from datetime import datetime
from importlib.metadata import PackageNotFoundError, version

from streams.cli import health, replaying, requesting, tailing
from streams.common.dispatch import dispatch
from streams.common.errors import EXIT_CODES_HELP, EXIT_OK, EXIT_USAGE, UserError
from streams.common.startup import add_kafka_arguments, check_port, check_secrets, load_config, reach_kafka
from streams.kube import applying, watching
from streams.serve import notify


def _simulate(args: argparse.Namespace) -> int:
    if args.maintenance is not None:
        return _simulate_maintenance(args)
    if args.az or args.compare or args.json or args.at:
        raise UserError("--az, --at, --compare and --json go with --maintenance",
                        "give the plan request with --maintenance FILE", exit_code=EXIT_USAGE)
    from handlers.decide.engine import Engine
    from streams.cli.simulating import run
    from streams.common.credentials import key_source

    settings = load_config(args)
    check_secrets(settings, credentials=True)
    engine = Engine(settings.rules(), keys=key_source(settings.auth))
    if args.input in (None, "-"):
        return run(engine, sys.stdin, sys.stdout, settings.kafka)
    try:
        source = open(args.input, encoding="utf-8")
    except OSError as error:
        raise UserError(f"input {args.input} cannot be read: {error.strerror or error}",
                        "give an existing JSON Lines file with --input, or - for stdin", exit_code=EXIT_USAGE) from error
    with source:
        return run(engine, source, sys.stdout, settings.kafka)


def _simulate_maintenance(args: argparse.Namespace) -> int:
    from streams.cli.planning import run

    if args.input is not None:
        raise UserError("--input and --maintenance are two different simulations",
                        "give one of them", exit_code=EXIT_USAGE)
    print(run(args.maintenance, args.az, at=args.at, compare=args.compare, as_json=args.json))
    return EXIT_OK


def _aware_time(text: str) -> datetime:
    try:
        parsed = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"{text!r} is not an ISO 8601 time") from error
    if parsed.tzinfo is None:
        raise argparse.ArgumentTypeError(f"{text!r} has no time zone (add Z or +00:00)")
    return parsed


def _schemas(args: argparse.Namespace) -> int:
    from streams.cli.schemas import write_schemas

    try:
        written = write_schemas(args.output)
    except OSError as error:
        raise UserError(f"cannot write into {args.output}: {error.strerror or error}",
                        "give a writable directory with --output", exit_code=EXIT_USAGE) from error
    for path in written:
        print(path)
    return EXIT_OK


def _worker(args: argparse.Namespace) -> int:
    from streams.common.topics import ensure_topics
    from streams.worker.app import Worker
    from streams.worker.running import run

    settings = load_config(args)
    check_secrets(settings, seals="commands", page_token=True, credentials=True)
    check_port(settings.worker.web_host, settings.worker.web_port, "worker.web_port (VMSTREAM_WORKER__WEB_PORT)")
    reach_kafka(settings.kafka)
    worker = Worker(settings)
    ensure_topics(settings.kafka, changelogs=worker.changelogs())
    run(worker, "DEBUG" if args.verbose else "INFO")
    return EXIT_OK


def _topics(args: argparse.Namespace) -> int:
    from streams.common.topics import ensure_topics

    settings = load_config(args)
    reach_kafka(settings.kafka)
    for name in ensure_topics(settings.kafka):
        print(f"created {name}")
    return EXIT_OK


def _api(args: argparse.Namespace) -> int:
    from streams.serve.api import main as serve_api

    return serve_api(args)


def _version() -> str:
    try:
        return version("vmstream")
    except PackageNotFoundError:  # run from a checkout that was never installed
        return "unknown"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="vmstream", description="Keeps GPU-passthrough VMs on KubeVirt right, event by event, over Kafka.",
        epilog=EXIT_CODES_HELP,
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log at DEBUG level")
    parser.add_argument("--version", action="version", version=f"vmstream {_version()}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    simulate = commands.add_parser(
        "simulate", help="run the decision engine over JSON Lines, offline",
        description="Decide JSON Lines inputs (the `tail --json` format) with the engine alone: no Kafka, "
        "no cluster; print every output, deterministically. With --maintenance, plan GPU node maintenance "
        "instead, as a what-if.", epilog=EXIT_CODES_HELP)
    simulate.add_argument("--config", help="the worker's configuration file (YAML)")
    simulate.add_argument("--input", help="JSON Lines input file, or - for stdin (the default)")
    what_if = simulate.add_argument_group(
        "maintenance what-if", "Plan GPU node maintenance offline with the planner the worker uses, and print "
        "each node's slot, each VM's fate and the totals (docs/operators.md).")
    what_if.add_argument("--maintenance", metavar="FILE",
                         help="the plan request: a plan_maintenance intent, or its spec alone (JSON)")
    what_if.add_argument("--az", metavar="FILE", help="the AZ: nodes with labels, cards by class and GPU VMs (JSON)")
    what_if.add_argument("--at", type=_aware_time, metavar="TIME",
                         help="when the plan is published (ISO 8601; default: the intent's requested_at, else now)")
    what_if.add_argument("--compare", action="store_true",
                         help="the same nodes drained one by one in name order, beside the plan")
    what_if.add_argument("--json", action="store_true", help="one JSON document instead of tables")
    simulate.set_defaults(handler=_simulate)

    schemas = commands.add_parser(
        "schemas", help="write the JSON Schemas and the AsyncAPI document",
        description="Write the JSON Schemas of every message, the AsyncAPI document of the topics and the "
        "OpenAPI document of `vmstream api`.", epilog=EXIT_CODES_HELP)
    schemas.add_argument("--output", default="docs/schemas", help="directory to write into")
    schemas.set_defaults(handler=_schemas)

    worker = commands.add_parser(
        "worker", help="run the stream processor (Faust) on Kafka",
        description="Run the stream processor: route intents and watch events, decide, publish commands, "
        "notifications, audit records and dead letters (docs/worker.md).", epilog=EXIT_CODES_HELP)
    worker.add_argument("--config", help="the configuration file (YAML)")
    add_kafka_arguments(worker)
    worker.set_defaults(handler=_worker, process=True)

    topics = commands.add_parser(
        "topics", help="create the Kafka topics (idempotent)",
        description="Create every topic of docs/contracts.md that is missing; existing ones are left as they are.",
        epilog=EXIT_CODES_HELP)
    topics.add_argument("action", choices=["create"])
    topics.add_argument("--config", help="the configuration file (YAML)")
    add_kafka_arguments(topics)
    topics.set_defaults(handler=_topics)

    api = commands.add_parser(
        "api", help="serve the read API for consoles (docs/api.md)",
        description="Serve the read API for consoles (GPU classes, VMs, nodes, drains) from the worker's "
        "table changelogs, and keep vmstream.gpu-classes current (docs/api.md).", epilog=EXIT_CODES_HELP)
    api.add_argument("--config", help="the configuration file (YAML)")
    add_kafka_arguments(api)
    api.set_defaults(handler=_api, process=True)

    requesting.add_parser(commands)
    tailing.add_parser(commands)
    replaying.add_parser(commands)
    applying.add_parser(commands)
    watching.add_parser(commands)
    notify.add_parser(commands)
    health.add_parser(commands)
    for subparser in commands.choices.values():  # one table of exit codes for every command
        if subparser.epilog is None:
            subparser.epilog = EXIT_CODES_HELP
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    return dispatch(build_parser(), argv)


if __name__ == "__main__":
    sys.exit(main())
