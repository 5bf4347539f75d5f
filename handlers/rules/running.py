"""Whether a VM runs, as its VMI shows it: one reading for the rules and the applier.

A VMI in an ended phase (:data:`~handlers.core.cluster.ENDED_PHASES`) holds nothing and runs
nothing; no VMI, the same. The applier asks :func:`already_so` after virt-api refused a
start or a stop (409): a VM already as the command would leave it makes the command a
no-op, not a failure.
"""

from __future__ import annotations

from typing import Any

from handlers.core.cluster import ENDED_PHASES

__all__ = ["ENDED_PHASES", "already_so", "vmi_runs"]


def vmi_runs(vmi: dict[str, Any] | None) -> bool:
    """A VMI object (as the API returns it) that exists and has not ended."""
    return vmi is not None and (vmi.get("status") or {}).get("phase") not in ENDED_PHASES


def already_so(action: str, vmi: dict[str, Any] | None) -> bool:
    """Is the VM already as a ``start`` or a ``stop`` would leave it? (level-based; any
    other action: no)."""
    if action == "start":
        return vmi_runs(vmi)
    if action == "stop":
        return not vmi_runs(vmi)
    return False
