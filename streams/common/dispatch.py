"""Running one parsed subcommand: logging set up, a :class:`UserError` turned into its line.

Every subcommand goes through :func:`dispatch`, whether started as ``vmstream <command>`` or
alone (``python -m streams.serve.notify notify …``, :func:`run_alone`): the same logs, the
same one line on stderr and exit code (streams/common/errors.py). This module imports no
subcommand, so a subcommand's module run as ``__main__`` is not imported a second time.

The long-running processes (worker, watch, apply, notify, api: ``process=True`` in their
parser's defaults) log JSON lines (streams/common/logs.py), and export spans when the
environment asks for it (streams/common/spans.py); the commands a person runs log plain text.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable, Sequence

from streams.common import spans
from streams.common.errors import EXIT_CODES_HELP, EXIT_INTERRUPTED, UserError
from streams.common.logs import configure_json_logs, limit_client_logs

Handler = Callable[[argparse.Namespace], int]


def _configure_logs(args: argparse.Namespace) -> None:
    verbose = bool(getattr(args, "verbose", False))
    if getattr(args, "process", False):
        configure_json_logs("DEBUG" if verbose else "INFO")  # rate-limited: logs.RateLimit
        return
    logging.basicConfig(level=logging.DEBUG if verbose else logging.WARNING, stream=sys.stderr)
    limit_client_logs()  # a broker outage: a few lines per kind and period, not thousands
    if not verbose:
        logging.getLogger("streams").setLevel(logging.INFO)


def dispatch(parser: argparse.ArgumentParser, argv: Sequence[str] | None = None) -> int:
    """Parse, set up logging, run the subcommand; a :class:`UserError` becomes its one line."""
    args = parser.parse_args(argv)
    _configure_logs(args)
    if getattr(args, "process", False):
        spans.configure(args.command)  # nothing unless OTEL_EXPORTER_OTLP_ENDPOINT is set
    handler: Handler = args.handler
    try:
        return handler(args)
    except UserError as error:
        print(error.line(args.command), file=sys.stderr, flush=True)
        return error.exit_code
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED


def run_alone(add_parser: Callable[[argparse._SubParsersAction[argparse.ArgumentParser]], None],
              argv: Sequence[str] | None = None) -> int:
    """``python -m streams.kube.applying apply …`` and the like: one subcommand, started as
    ``vmstream`` starts it."""
    parser = argparse.ArgumentParser(prog="vmstream", epilog=EXIT_CODES_HELP)
    parser.add_argument("-v", "--verbose", action="store_true", help="log at DEBUG level")
    add_parser(parser.add_subparsers(dest="command", required=True, metavar="COMMAND"))
    return dispatch(parser, argv)
