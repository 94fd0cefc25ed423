"""Registrations made over ``/register`` survive a restart: a small JSON state file,
replaced atomically (temp file, fsync, rename, fsync of the directory) after every change.
The temporary file gets a fresh name, created exclusively (``mkstemp``: a symlink planted
in the directory is never followed, so the write cannot land in another file).
Changes made while a write runs share the next write: registering 1,000 engines at once
costs a few writes, not 1,000 rewrites of a growing file."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import tempfile
from collections.abc import Callable
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
        self._entries: dict[str, dict[str, Any]] = {}  # each registration as it is written
        self._lock = asyncio.Lock()
        self._changes = 0  # changes made so far
        self._written = 0  # changes the file on disk holds

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
        self._entries = {entry.key: entry.model_dump(mode="json") for entry in entries}
        return entries

    async def add(self, registration: Registration) -> None:
        self.registrations[registration.key] = registration
        self._entries[registration.key] = registration.model_dump(mode="json")
        await self._save()

    async def remove(self, key: str) -> None:
        if self.registrations.pop(key, None) is not None:
            del self._entries[key]
            await self._save()

    async def _save(self) -> None:
        """Return once the file holds this change. Writes run off the event loop (fsync
        can take long) one at a time, each with every change made before it began."""
        self._changes += 1
        change = self._changes
        async with self._lock:
            if self._written >= change:
                return  # a write that began after this change already held it
            changes = self._changes
            snapshot = {
                "version": STATE_VERSION,
                "registrations": [entry for _, entry in sorted(self._entries.items())],
            }
            try:
                await asyncio.to_thread(_write_json, self.path, snapshot)
            except OSError as error:
                reason = error.strerror or type(error).__name__
                where = f" ({error.filename})" if error.filename else ""
                log.error("state file %s not written: %s%s", self.path, reason, where)
                return
            self._written = changes


def _write_json(path: Path, data: Any) -> None:
    """Off the event loop: a thousand registrations take a while to serialize."""
    write_atomically(path, json.dumps(data, indent=1).encode())


def write_atomically(
    path: Path, data: bytes, before_replace: Callable[[Path], None] | None = None
) -> None:
    """``data`` complete on disk (a fresh temporary file, fsynced) before it replaces
    ``path`` in one step, and the directory fsynced after: a crash at any point leaves the
    old file or the new one, whole. ``before_replace(path)`` runs just before the swap."""
    path.parent.mkdir(parents=True, exist_ok=True)
    descriptor, temporary = tempfile.mkstemp(
        prefix=f".{path.name}.", suffix=".tmp", dir=path.parent
    )
    try:
        with os.fdopen(descriptor, "wb") as file:
            file.write(data)
            file.flush()
            os.fsync(file.fileno())
        if before_replace is not None:
            before_replace(path)
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)
