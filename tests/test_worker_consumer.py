"""The worker's consumer fetches as configured, not with Faust's fixed 1.5 s long poll."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from streams.locations import REPO_ROOT
from streams.running import CONFIG

# In a process of its own: a Faust app leaves threads and loops behind that pytest should not inherit.
PROBE = f"""
import asyncio, json
from streams.settings import load_settings
from streams.worker import Worker

async def main():
    worker = Worker(load_settings({str(CONFIG)!r}))
    consumer = worker.app.consumer._thread._create_worker_consumer(worker.app.transport)  # never started
    print(json.dumps([consumer._fetch_max_wait_ms, consumer._fetch_min_bytes]))
    await consumer.stop()

asyncio.run(main())
"""


def test_the_consumer_takes_its_fetch_wait_and_size_from_the_settings() -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT),
           "VMSTREAM_WORKER__FETCH_MAX_WAIT_MS": "7", "VMSTREAM_WORKER__FETCH_MIN_BYTES": "4096"}
    probe = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=60)
    assert probe.returncode == 0, probe.stderr
    assert json.loads(probe.stdout.splitlines()[-1]) == [7, 4096]
