"""Back in seconds after a crash: a worker killed with SIGKILL and started again at once (as a
kubelet restarts a container) decides again well within its predecessor's session.

With static group membership (``worker.group_instance_id``) the restarted worker takes its
partitions back as soon as it joins. Without it — and with Faust's 60 s session, as before —
the group waits for the dead member's session to end. The bound here is loose on purpose
(30 s, on a shared machine); ``benchmarks/recovery.py`` measures the figure.
"""

from __future__ import annotations

import json
import signal
import time

import pytest

from harness.running import Deployment, Outputs, WorkerProcess
from harness.scenarios import cluster

pytestmark = pytest.mark.kafka

CLUSTER = list(cluster().jsonl())
BOUND = 30.0  # seconds from the kill to the next decision; the session before was 60 s
STATIC = {
    "VMSTREAM_WORKER__GROUP_INSTANCE_ID": "worker-0",
    # As long as Faust's default: only static membership can bring the worker back in time.
    "VMSTREAM_WORKER__SESSION_TIMEOUT_SECONDS": "60",
}



def node_event(event_id: str) -> str:
    """A MODIFIED event of the scenario's first node, under a new id (decided: one audit record)."""
    line = json.loads(next(text for text in CLUSTER if '"kind": "Node"' in text))
    line["value"].update(event_id=event_id, type="MODIFIED")
    line["value"]["object"]["metadata"]["resourceVersion"] = "1000"
    return json.dumps(line)


def test_a_killed_worker_restarted_at_once_decides_again_within_its_session(deployment: Deployment) -> None:
    outputs = Outputs(deployment)
    first = WorkerProcess(deployment, "w1", env=STATIC).start()
    second: WorkerProcess | None = None
    try:
        deployment.publish_lines(CLUSTER)
        outputs.wait_for(lambda o: len(o.seen["audit"]) >= len(CLUSTER), what="the cluster's events decided")
        assert first.process is not None
        first.process.send_signal(signal.SIGKILL)
        killed = time.monotonic()
        first.process.wait()

        second = WorkerProcess(deployment, "w2", env=STATIC).start(timeout=BOUND)
        deployment.publish_lines([node_event("after-the-kill")])
        outputs.wait_for(lambda o: bool(o.audits(input__ref="after-the-kill")),
                         timeout=max(0.0, BOUND - (time.monotonic() - killed)),
                         what=f"a decision within {BOUND:.0f} s of the kill")
    finally:
        outputs.close()
        if second is not None:
            assert second.stop() == 0, second.tail()
        first.stop(signal.SIGKILL)
