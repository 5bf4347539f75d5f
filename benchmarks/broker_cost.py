"""What a produce round trip costs the broker: cold, warm, and one at a time.

One broker started for the run, one producer as the applier's (``DurableProducer``): rounds
of ``--per-round`` round trips, each a batch of ``--records`` records of 900 bytes (an
applier's release: audit records and results) sent and waited for, back to back. Each round
prints the broker's CPU per round trip and per record. Then, warm: batches five times
larger, and round trips paced at ``--rate`` per second, as commands that arrive one by one
are released. The broker's idle CPU is measured last and printed, not subtracted.

Why it matters: ``apply_rate.py`` runs on two cores, where the broker's CPU is taken from
the API server. A broker just started spends several times the CPU on a request that it
spends once its JIT has compiled the paths every request takes, a few thousand requests
later: a benchmark that starts its broker and measures at once charges that to whatever
uses Kafka first. And a request that arrives alone costs the broker more than one of a
stream (each wakes its threads anew): what the applier's ``apply.release_seconds`` saves.

    .venv/bin/python benchmarks/broker_cost.py
    .venv/bin/python benchmarks/broker_cost.py --rounds 2 --per-round 300   # a quick run
"""

from __future__ import annotations

import argparse
import sys
import time

import kit  # noqa: E402  (this directory's: puts the repository on sys.path)

from streams.common.durable import DurableProducer, Record  # noqa: E402
from streams.common.settings import KafkaSettings  # noqa: E402

VALUE = b"x" * 900  # about an audit record's size


def round_trips(out: DurableProducer, pid: int, count: int, records: int,
                rate: float | None = None) -> tuple[float, float]:
    """(broker CPU ms per round trip, round trips per second) over ``count`` round trips,
    back to back or ``rate`` per second."""
    before, started = kit.cpu_of(pid).total, time.monotonic()
    for number in range(count):
        if rate is not None:
            kit.sleep_until(started + number / rate)
        out.send_all([Record("audit" if index % 2 else "results", f"k{number}-{index}".encode(), VALUE)
                      for index in range(records)])
    return 1000 * (kit.cpu_of(pid).total - before) / count, count / (time.monotonic() - started)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--per-round", type=int, default=750, help="round trips per round")
    parser.add_argument("--records", type=int, default=2, help="records per round trip")
    parser.add_argument("--rate", type=float, default=40.0, help="round trips per second, paced")
    args = parser.parse_args()
    kit.print_load("start")
    with kit.broker() as broker:
        if broker.pid is None:
            print("KAFKA_BOOTSTRAP_SERVERS names a broker this script did not start: its CPU cannot be read")
            return 2
        kit.create_topics(broker.bootstrap, ["audit", "results"])
        out = DurableProducer(KafkaSettings(bootstrap_servers=broker.bootstrap), client_id="broker-cost")
        try:
            done = 0
            for round_ in range(args.rounds):
                per_trip, rate = round_trips(out, broker.pid, args.per_round, args.records)
                done += args.per_round
                print(f"round trips {done - args.per_round + 1:>6}–{done:<6} {args.records} records each: "
                      f"broker {per_trip:5.2f} ms per round trip, {per_trip / args.records:5.2f} ms per record, "
                      f"{rate:4.0f} round trips/s; {kit.load_average()}")
            records = 5 * args.records
            per_trip, rate = round_trips(out, broker.pid, args.per_round // 5, records)
            print(f"warm, {records} records each: broker {per_trip:5.2f} ms per round trip, "
                  f"{per_trip / records:5.2f} ms per record, {rate:4.0f} round trips/s")
            for paced in (False, True, False):
                per_trip, rate = round_trips(out, broker.pid, args.per_round, args.records,
                                             args.rate if paced else None)
                print(f"warm, {args.records} records each, {'paced' if paced else 'back to back'}: "
                      f"broker {per_trip:5.2f} ms per round trip at {rate:4.0f} round trips/s; {kit.load_average()}")
            before = kit.cpu_of(broker.pid).total
            time.sleep(5)  # measuring the idle broker over a fixed span, not synchronising
            print(f"idle: the broker alone {1000 * (kit.cpu_of(broker.pid).total - before) / 5:.0f} ms of CPU per s "
                  "(in every figure above)")
        finally:
            out.close()
    kit.print_load("end")
    return 0


if __name__ == "__main__":
    sys.exit(main())
