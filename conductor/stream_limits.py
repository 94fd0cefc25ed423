"""The bounds every event stream keeps: one dataclass the config, the manager and the
subscriber all read (the config turns each field into a key, an env var and a flag)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

MIB = 1024 * 1024


def _limit(default: float, description: str) -> Any:
    """A field of StreamLimits; its description is its flag's help (``conductor.config``)."""
    return field(default=default, metadata={"description": description})


@dataclass(frozen=True, slots=True)
class StreamLimits:
    """Every bound the event streams keep, whatever publishers and clients do."""

    max_sockets: int = _limit(  # the ZMQ context's MAX_SOCKETS
        4096,
        "ZMQ sockets for all streams (3 per registration, 4 with a replay endpoint); "
        "a registration beyond them is refused (503)",
    )
    reserved_fds: int = _limit(
        256,
        "file descriptors kept free for HTTP clients and store checks; a registration "
        "that would use them is refused (503)",
    )
    max_message_bytes: int = _limit(  # ZMQ MAXMSGSIZE; vLLM batches are kilobytes
        4 * MIB,
        "largest ZMQ message a publisher may send; a larger one drops the connection, "
        "which reconnects and catches up",
    )
    receive_buffer_bytes: int = _limit(  # RCVHWM = this // max_message_bytes
        128 * MIB,
        "live event bytes one stream may queue while a replay runs; beyond them TCP "
        "pushes back on the publisher",
    )
    replay_timeout_s: float = _limit(
        2.0, "seconds to wait for each reply of a replay before the replay fails"
    )
    replay_deadline_s: float = _limit(
        30.0, "seconds a whole replay may take, however much its endpoint sends"
    )
    max_dp_ranks: int = _limit(
        16, "DP ranks one registration's batches may create; events of more are dropped"
    )
    max_lora_contexts: int = _limit(
        64, "LoRA contexts one registration's events may create; events of more are dropped"
    )
    publisher_timeout_s: float = _limit(  # TCP keepalive; plus one probe interval
        3.0,
        "seconds a publisher may stay silent to TCP keepalive probes before its "
        "connection is dropped and its blocks cleared",
    )

    def __post_init__(self) -> None:
        for name in self.__dataclass_fields__:
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)!r}")
        if self.receive_buffer_bytes < self.max_message_bytes:
            raise ValueError("receive_buffer_bytes must hold one message of max_message_bytes")

    @property
    def receive_hwm(self) -> int:
        """Messages a stream's SUB (or DEALER) queues at most: under receive_buffer_bytes."""
        return self.receive_buffer_bytes // self.max_message_bytes
