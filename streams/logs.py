"""Structured logs: one JSON object per line, with the ids a reader searches by.

Fields passed with ``extra=`` (``ref`` — the intent id, event id or command id —, ``topic``,
``outcome``, …) become top-level keys, so ``jq 'select(.ref == "it-1")'`` finds every line
about one input across the worker, the applier and the watch bridge.
"""

from __future__ import annotations

import json
import logging
from datetime import UTC, datetime
from typing import Any

_STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "at": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        entry.update({k: v for k, v in vars(record).items() if k not in _STANDARD and not k.startswith("_")})
        if record.exc_info:
            entry["error"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


def logging_config(level: str) -> dict[str, Any]:
    """A ``logging.config.dictConfig`` for JSON lines on stderr; kafka clients kept quiet."""
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"json": {"()": JsonFormatter}},
        "handlers": {"stderr": {"class": "logging.StreamHandler", "formatter": "json", "stream": "ext://sys.stderr"}},
        "root": {"level": level, "handlers": ["stderr"]},
        "loggers": {"kafka": {"level": "WARNING"}, "aiokafka": {"level": "WARNING"}},
    }
