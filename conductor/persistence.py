"""Registrations made over ``/register`` survive a restart: a small JSON state file,
replaced atomically (temp file, fsync, rename, fsync of the directory) on every change."""

from __future__ import annotations

import asyncio
import json
import logging
import os
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from .config import ConfigError, Registration, one_line

log = logging.getLogger(__name__)
STATE_VERSION = 1


class StateFile:
    """The registrations to restore, keyed like the service (``instance|tenant|rank``)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(os.path.expanduser(path))
        self.registrations: dict[str, Registration] = {}
        self._lock = asyncio.Lock()

    def load(self) -> list[Registration]:
        """The persisted registrations; a missing file is none, a broken one an error
        (restarting without it would silently forget every engine)."""
        if not self.path.exists():
            return []
        try:
            data = json.loads(self.path.read_text(encoding="utf-8"))
            if not isinstance(data, dict) or data.get("version") != STATE_VERSION:
                raise ValueError(f"not a version {STATE_VERSION} conductor state file")
            entries = [Registration.model_validate(entry) for entry in data["registrations"]]
        except (OSError, ValueError, KeyError, TypeError) as error:
            message = one_line(error) if isinstance(error, ValidationError) else str(error)
            raise ConfigError(
                f"state file {self.path} is unreadable ({message}); fix or remove it"
            ) from None
        self.registrations = {entry.key: entry for entry in entries}
        return entries

    async def add(self, registration: Registration) -> None:
        self.registrations[registration.key] = registration
        await self._save()

    async def remove(self, key: str) -> None:
        if self.registrations.pop(key, None) is not None:
            await self._save()

    async def _save(self) -> None:
        """Write a snapshot off the event loop (fsync can take long); the lock keeps the
        writes in order, so the last snapshot is what stays on disk."""
        async with self._lock:
            snapshot = {
                "version": STATE_VERSION,
                "registrations": [
                    r.model_dump(mode="json") for _, r in sorted(self.registrations.items())
                ],
            }
            try:
                await asyncio.to_thread(_write_atomically, self.path, snapshot)
            except OSError as error:
                log.error("state file %s not written: %s", self.path, error)


def _write_atomically(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.tmp")
    with open(temporary, "w", encoding="utf-8") as file:
        json.dump(data, file, indent=1)
        file.flush()
        os.fsync(file.fileno())
    os.replace(temporary, path)
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)
