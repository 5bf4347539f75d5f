"""``python -m harness``: the development harness's command, run from a checkout.

``kafka up|down|status`` a local broker, ``kube up|down|status|user`` a local control plane
with KubeVirt, ``demo`` the worker on them with a realistic scenario. None of it is part of
the product: the ``vmstream`` command does not know these subcommands.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from harness import demo, localkafka, localkube
from streams.common.logs import limit_client_logs


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m harness",
        description="vmstream's development harness: a local Kafka, a local control plane, the demo.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log at DEBUG level")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    kafka = commands.add_parser("kafka", help="a local single-node Kafka broker (no Docker)",
                                description="A local single-node Apache Kafka broker (KRaft, no Docker).",
                                add_help=False)
    kafka.add_argument("options", nargs=argparse.REMAINDER, help="up|down|status, --port, --state-dir, --reset")
    kafka.set_defaults(handler=lambda args: localkafka.main(args.options))
    kube = commands.add_parser("kube", help="a local kube-apiserver + etcd with KubeVirt (virt-api, virt-controller)",
                               description="A local kube-apiserver and etcd with KubeVirt's CRDs and KubeVirt's "
                                           "own virt-api and virt-controller.",
                               add_help=False)
    kube.add_argument("options", nargs=argparse.REMAINDER, help="up|down|status|user")
    kube.set_defaults(handler=lambda args: localkube.main(args.options))
    demo.add_parser(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING, stream=sys.stderr)
    limit_client_logs()
    if not args.verbose:
        logging.getLogger("streams").setLevel(logging.INFO)
        logging.getLogger("harness").setLevel(logging.INFO)
    result: int = args.handler(args)
    return result


if __name__ == "__main__":
    sys.exit(main())
