"""Deterministic ids: the same cause always names the same effect.

Commands, notifications and audit records are named by a hash of what caused them, so a
replay, a redelivery or a restarted worker reissues the *same* ids and every consumer can
drop repeats. Nothing here reads a clock or a random source.
"""

from __future__ import annotations

import hashlib


def _digest(*parts: str) -> str:
    return hashlib.sha256("\x1f".join(parts).encode()).hexdigest()[:32]


def command_id(cause: str, type_: str, target: str) -> str:
    return f"cmd-{_digest('command', cause, type_, target)}"


def notification_id(type_: str, subject: str, episode: str) -> str:
    return f"ntf-{_digest('notification', type_, subject, episode)}"


def audit_id(topic: str, ref: str, outcome: str) -> str:
    return f"aud-{_digest('audit', topic, ref, outcome)}"


def episode_id(*parts: str) -> str:
    """Name an episode (a drain, a pending restart) by what started it."""
    return _digest("episode", *parts)[:16]


def watch_event_id(kind: str, namespace: str | None, name: str, resource_version: str, type_: str) -> str:
    """Name a watch event by the object version it shows: a re-published version keeps its id."""
    return f"evt-{_digest('watch-event', kind, namespace or '', name, resource_version, type_)}"
