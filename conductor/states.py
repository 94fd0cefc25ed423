"""The states the service reports in /services, /health and its Prometheus enums.

``StrEnum``s: each member is its own string, so the JSON answers and metric labels carry
exactly these values.
"""

from __future__ import annotations

from enum import StrEnum


class SubscriberState(StrEnum):
    """One stream's subscriber; ``down`` > ``failed`` > the connection's own state."""

    CONNECTING = "connecting"
    CONNECTED = "connected"
    REPLAYING = "replaying"
    DISCONNECTED = "disconnected"
    STOPPED = "stopped"
    FAILED = "failed"  # one of its tasks failed; it is retried with backoff
    DOWN = "down"  # its instance was marked down (POST /instance_down)


class StoreState(StrEnum):
    """One Mooncake store, as its key-list checks find it."""

    UNCHECKED = "unchecked"
    UP = "up"
    DOWN = "down"  # its checks fail: its pools are empty, its CPU events dropped


class TaskState(StrEnum):
    """A supervised background task."""

    RUNNING = "running"
    FAILED = "failed"  # raised; restarted after a backoff
    STOPPED = "stopped"
