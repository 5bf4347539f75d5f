"""What verifying intents' credentials costs (handlers/auth.py), in-process, one core.

1. ``verify_intent`` alone, per algorithm (EdDSA, ES256, RS256);
2. the engine deciding the same set_gpu intents with ``auth: jwt`` (signed, EdDSA) and with
   ``auth: none`` (unsigned), each intent a new id on a VM of the example AZ.

    .venv/bin/python benchmarks/credentials.py [--intents 2000]
"""

from __future__ import annotations

import argparse
import json
import time
from datetime import UTC, datetime, timedelta
from typing import Any

import kit  # noqa: E402  (this directory's: puts the repository on sys.path)

from handlers.auth import KeySet, Unauthenticated, verify_intent  # noqa: E402
from handlers.config import AuthPolicy, Config  # noqa: E402
from handlers.engine import Engine, Source  # noqa: E402
from handlers.topics import INTENTS  # noqa: E402
from harness.scenarios import cluster  # noqa: E402
from samples.cluster import EXAMPLE_CONFIG  # noqa: E402
from streams.cli.simulating import Simulation  # noqa: E402
from streams.common.credentials import SigningKey, jwks, signed  # noqa: E402
from streams.common.settings import KafkaSettings  # noqa: E402

INTENTS_TOPIC = KafkaSettings().topic(INTENTS)  # the full name the worker passes as the source

NOW = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)


def intent(i: int) -> dict[str, Any]:
    return {"intent_id": f"bench-{i}", "type": "set_gpu", "requested_by": "bob@example.com", "project": "proj-b",
            "spec": {"namespace": "spx-proj-b", "name": "dev-1",
                     "gpu_class": "nvidia-a100" if i % 2 else "nvidia-rtx-pro-6000-bse"}}


def verify_rate(algorithm: str, count: int) -> float:
    key = SigningKey.generate("bench", algorithm)
    keys, policy = KeySet.from_jwks(jwks(key)), AuthPolicy()
    bodies = [signed(intent(i), key, projects=["proj-b"], now=NOW) for i in range(count)]
    started = time.perf_counter()
    for body in bodies:
        assert not isinstance(verify_intent(body["credential"], body, keys, policy, NOW), Unauthenticated)
    return count / (time.perf_counter() - started)


def engine_rate(mode: str, count: int) -> float:
    key = SigningKey.generate("bench")
    engine = Engine(Config.model_validate({**EXAMPLE_CONFIG, "auth": {"mode": mode}}), KeySet.from_jwks(jwks(key)))
    simulation = Simulation(engine)
    list(simulation.feed(cluster().jsonl()))  # the AZ, observed; each intent is decided against it
    state = simulation.state
    bodies = [signed(intent(i), key, projects=["proj-b"], now=NOW) if mode == "jwt" else intent(i)
              for i in range(count)]
    raws = [json.dumps(body).encode() for body in bodies]
    source = Source(INTENTS_TOPIC, "vm/spx-proj-b/dev-1")
    started = time.perf_counter()
    for raw in raws:
        result = engine.on_intent(state, raw, source, NOW + timedelta(seconds=1))
        assert result.decision.audit is not None and not (result.decision.audit.reason or "").startswith("unauth")
    return count / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--intents", type=int, default=2000)
    kit.add_json_option(parser)
    kit.add_small_option(parser, intents=200)
    args = kit.parse(parser)
    kit.print_load("before")
    figures: dict[str, float] = {}
    for algorithm in ("EdDSA", "ES256", "RS256"):
        rate = figures[f"verify_{algorithm}_per_s"] = verify_rate(algorithm, args.intents)
        print(f"verify_intent {algorithm}: {rate:,.0f}/s ({1e6 / rate:.0f} µs each)")
    for mode in ("none", "jwt"):
        rate = figures[f"engine_auth_{mode}_per_s"] = engine_rate(mode, args.intents)
        print(f"engine on_intent, auth: {mode}: {rate:,.0f} intents/s ({1e6 / rate:.0f} µs each)")
    kit.print_load("after")
    kit.write_json(args.json, figures)


if __name__ == "__main__":
    main()
