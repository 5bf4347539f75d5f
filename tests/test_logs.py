"""Structured logs carry the ids a reader searches by."""

from __future__ import annotations

import json
import logging

from streams.logs import JsonFormatter


def test_extra_fields_become_top_level_keys() -> None:
    record = logging.LogRecord("streams.worker", logging.INFO, __file__, 1, "decided %s", ("now",), None)
    record.ref = "it-1"
    record.outcome = "accepted"
    line = json.loads(JsonFormatter().format(record))
    assert line["message"] == "decided now" and line["level"] == "info"
    assert (line["ref"], line["outcome"], line["logger"]) == ("it-1", "accepted", "streams.worker")
    assert line["at"].endswith("Z")
