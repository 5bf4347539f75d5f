"""A restart is sent once: what the applier decides from the VM's restart record, the VMI and
KubeVirt's stop requests, case by case (no API server: the reads are given, the writes
kept). tests/kube/test_applying.py kills a real applier between virt-api's effect and its
answer and counts the restart requests virt-api received."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from kubernetes import client

from streams.kube.applying import RESTART_ANNOTATION, Applied, KubeApplier
from handlers.messages import Command, ObjectRef

ISSUED = datetime(2026, 12, 1, 10, 0, 0, 500000, tzinfo=UTC)
RESTART = Command(command_id="cmd-restart-1", type="restart_vm", cause="it-1", issued_at=ISSUED,
                  target=ObjectRef(kind="VirtualMachine", namespace="ns", name="vm"))


class Cluster(KubeApplier):
    """A KubeApplier whose VM and VMI are given and whose writes are kept, not sent."""

    def __init__(self, vm: dict[str, Any], vmi: dict[str, Any] | None) -> None:
        super().__init__(client.ApiClient(client.Configuration()))
        self.vm, self.vmi = vm, vmi
        self.writes: list[Any] = []

    def _get_vm(self, namespace: str, name: str) -> dict[str, Any]:
        return self.vm

    def _get_vmi(self, namespace: str, name: str) -> dict[str, Any] | None:
        return self.vmi

    def _call(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        self.writes.append(args[-1])
        return {}


def vm(record: dict[str, str] | None = None, requests: list[dict[str, str]] | None = None) -> dict[str, Any]:
    annotations = {RESTART_ANNOTATION: json.dumps(record)} if record else {}
    return {"metadata": {"name": "vm", "namespace": "ns", "annotations": annotations},
            "status": {"stateChangeRequests": requests} if requests else {}}


def vmi(uid: str, created: datetime = ISSUED - timedelta(hours=1), deleting: bool = False) -> dict[str, Any]:
    metadata: dict[str, Any] = {"uid": uid, "creationTimestamp": created.strftime("%Y-%m-%dT%H:%M:%SZ")}
    if deleting:
        metadata["deletionTimestamp"] = "2026-12-01T10:00:01Z"
    return {"metadata": metadata, "status": {"phase": "Running"}}


MINE = {"command": RESTART.command_id, "vmi": "uid-old"}


def test_a_first_restart_is_recorded_with_its_vmi_before_it_is_sent() -> None:
    cluster = Cluster(vm(), vmi("uid-old"))
    assert cluster._restart_done(RESTART, "ns", "vm") is None  # to be sent
    [write] = cluster.writes
    assert json.loads(write["metadata"]["annotations"][RESTART_ANNOTATION]) == MINE


@pytest.mark.parametrize(("what", "the_vm", "the_vmi"), [
    ("the old VMI is gone, the new one not created yet", vm(MINE), None),
    ("a new VMI runs", vm(MINE), vmi("uid-new")),
    ("the old VMI is being deleted", vm(MINE), vmi("uid-old", deleting=True)),
    ("virt-api asked to stop the old VMI", vm(MINE, [{"action": "Stop", "uid": "uid-old"}, {"action": "Start"}]),
     vmi("uid-old")),
])
def test_a_restart_recorded_and_under_way_is_not_sent_again(
    what: str, the_vm: dict[str, Any], the_vmi: dict[str, Any] | None
) -> None:
    cluster = Cluster(the_vm, the_vmi)
    done = cluster._restart_done(RESTART, "ns", "vm")
    assert done is not None and done.outcome == "applied", what
    assert cluster.writes == []


def test_a_restart_recorded_but_never_sent_is_sent() -> None:
    """The crash came between the record and the call: the old VMI runs, nothing asked of it."""
    cluster = Cluster(vm(MINE), vmi("uid-old"))
    assert cluster._restart_done(RESTART, "ns", "vm") is None
    assert cluster.writes == []  # the record stands


def test_a_vmi_created_in_the_same_second_after_the_command_is_no_proof_without_a_record() -> None:
    """creationTimestamp has 1 s resolution: 10:00:00 reads as before a command of 10:00:00.5.
    Without this command's record the VMI is not taken for its restart: recorded and sent."""
    cluster = Cluster(vm({"command": "cmd-earlier", "vmi": "uid-x"}), vmi("uid-new", created=ISSUED))
    assert cluster._restart_done(RESTART, "ns", "vm") is None
    assert len(cluster.writes) == 1


def test_without_a_record_a_vmi_created_after_the_command_is_its_restart() -> None:
    cluster = Cluster(vm(), vmi("uid-new", created=ISSUED + timedelta(seconds=5)))
    assert cluster._restart_done(RESTART, "ns", "vm") == Applied("noop")
    assert cluster.writes == []
