"""The worker's consumer fetches as configured, not with Faust's fixed 1.5 s long poll, and
fills its fetches only once the tables are recovered."""

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
    thread = worker.app.consumer._thread
    consumer = thread._create_worker_consumer(worker.app.transport)
    await consumer.start()  # joins no group: no topic is subscribed
    thread._consumer = consumer
    seen = {{"created": [consumer._fetch_max_wait_ms, consumer._fetcher._fetch_min_bytes]}}
    thread.fill_fetches(True)
    seen["deciding"] = consumer._fetcher._fetch_min_bytes
    thread.fill_fetches(False)
    seen["recovering"] = consumer._fetcher._fetch_min_bytes
    await consumer.stop()
    print(json.dumps(seen))

asyncio.run(main())
"""


def test_the_consumer_fetches_as_configured_once_recovered(kafka_bootstrap: str) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "VMSTREAM_KAFKA__BOOTSTRAP_SERVERS": kafka_bootstrap,
           "VMSTREAM_WORKER__FETCH_MAX_WAIT_MS": "7", "VMSTREAM_WORKER__FETCH_MIN_BYTES": "4096"}
    probe = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=60)
    assert probe.returncode == 0, probe.stderr
    seen = json.loads(probe.stdout.splitlines()[-1])
    assert seen == {"created": [7, 1], "deciding": 4096, "recovering": 1}
