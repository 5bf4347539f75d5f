"""Running a :class:`~streams.worker.app.Worker` under Faust's own worker, logging JSON lines.

Here, not in the command (streams/cli/main.py), so that Faust stays inside streams.worker
(pyproject.toml, the import contracts).
"""

from __future__ import annotations

import faust

from streams.common.logs import logging_config
from streams.worker.app import Worker


def run(worker: Worker, level: str) -> None:
    """Run until stopped; Faust's worker logs through :func:`logging_config` (JSON lines)."""
    faust.Worker(worker.app, loglevel=level, quiet=True, logging_config=logging_config(level)).execute_from_commandline()
