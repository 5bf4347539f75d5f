"""Deterministic ids: the same cause always names the same effect.

Commands, notifications and audit records are named by a hash of what caused them, so a
replay, a redelivery or a restarted worker reissues the *same* ids and every consumer can
drop repeats. Nothing here reads a clock or a random source.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any


def _digest(*parts: str) -> str:
    return hashlib.sha256("\x1f".join(parts).encode()).hexdigest()[:32]


def command_id(cause: str, type_: str, target: str) -> str:
    return f"cmd-{_digest('command', cause, type_, target)}"


def notification_id(type_: str, subject: str, episode: str) -> str:
    return f"ntf-{_digest('notification', type_, subject, episode)}"


def audit_id(topic: str, ref: str, outcome: str) -> str:
    return f"aud-{_digest('audit', topic, ref, outcome)}"


def unauthenticated_ref(topic: str, intent_id: str, body: Mapping[str, Any]) -> str:
    """What an intent refused for who asks is audited under (``ref``'s place in its audit id):
    its id and a digest of its whole body, so each forged copy of one id is audited once and
    apart from the real intent. Its sender, who knows the body, can name its audit record."""
    return f"{intent_id}/{episode_id(topic, json.dumps(body, sort_keys=True))}"


def episode_id(*parts: str) -> str:
    """Name an episode (a drain, a pending restart) by what started it."""
    return _digest("episode", *parts)[:16]


def watch_event_id(kind: str, namespace: str | None, name: str, resource_version: str, type_: str) -> str:
    """Name a watch event by the object version it shows: a re-published version keeps its id."""
    return f"evt-{_digest('watch-event', kind, namespace or '', name, resource_version, type_)}"
