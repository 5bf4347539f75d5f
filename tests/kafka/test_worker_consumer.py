"""The worker's consumer paces its fetches as configured, not with Faust's fixed 1.5 s long
poll: as fast as records come while tables recover, then full fetches while busy and long
polls while idle."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from harness.locations import REPO_ROOT
from harness.running import CONFIG

# In a process of its own: a Faust app leaves threads and loops behind that pytest should not inherit.
PROBE = f"""
import asyncio, json
from streams.common.settings import load_settings
from streams.worker.app import Worker

async def main():
    worker = Worker(load_settings({str(CONFIG)!r}))
    thread = worker.app.consumer._thread
    consumer = thread._create_worker_consumer(worker.app.transport)
    await consumer.start()  # joins no group: no topic is subscribed
    thread._consumer = consumer
    fetcher = consumer._fetcher
    pace = lambda: [fetcher._fetch_min_bytes, fetcher._fetch_max_wait_ms]
    seen = {{"created": pace()}}
    thread.pace(busy=False)
    seen["recovering, idle"] = pace()
    thread.fill_fetches(True)
    seen["recovered"] = pace()
    thread.pace(busy=False)
    seen["deciding, idle"] = pace()
    thread.pace(busy=True)
    seen["deciding, busy"] = pace()
    thread.fill_fetches(False)
    seen["rebalancing"] = pace()
    await consumer.stop()
    print(json.dumps(seen))

asyncio.run(main())
"""


def test_the_consumer_paces_its_fetches_by_what_the_worker_does(kafka_bootstrap: str) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "VMSTREAM_KAFKA__BOOTSTRAP_SERVERS": kafka_bootstrap,
           "VMSTREAM_WORKER__FETCH_MAX_WAIT_MS": "7", "VMSTREAM_WORKER__FETCH_MIN_BYTES": "4096",
           "VMSTREAM_WORKER__FETCH_IDLE_WAIT_MS": "900"}
    probe = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=60)
    assert probe.returncode == 0, probe.stderr
    seen = json.loads(probe.stdout.splitlines()[-1])
    assert seen == {
        "created": [1, 7], "recovering, idle": [1, 7],  # recovery reads as fast as records come
        "recovered": [4096, 7], "deciding, idle": [1, 900], "deciding, busy": [4096, 7],
        "rebalancing": [1, 7],
    }
