"""The applier: commands → the Kubernetes API → command results.

    commands topic → loop.py (Kafka: fetch, lanes by key, publish durably, commit)
        → api.py (read once → handlers/rules/judgment.py judges → act) → Applied, or RetryLater
    process.py: ``vmstream apply`` — settings, start and stop, probes

What the applier may write is handlers/rules/policy.py's to say, what each command does
handlers/rules/judgment.py's; this package reads, sends and records.
"""

from handlers.rules.judgment import RESTART_ANNOTATION
from streams.kube.applying.api import JSON_PATCH, KUBEVIRT, Applied, KubeApplier, RetryPolicy
from streams.kube.applying.loop import Applier, Lanes, ResultLedger
from streams.kube.applying.process import add_parser, main

__all__ = ["JSON_PATCH", "KUBEVIRT", "RESTART_ANNOTATION", "Applied", "Applier", "KubeApplier", "Lanes",
           "ResultLedger", "RetryPolicy", "add_parser", "main"]
