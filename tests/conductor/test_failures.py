"""Failures read alike in every command: the system's words, never an object's repr."""

from __future__ import annotations

import errno
import socket

from conductor.failures import cannot_listen


def test_a_listen_failure_names_the_address_and_the_reason() -> None:
    taken = OSError(errno.EADDRINUSE, "error while attempting to bind on address ('::1', 80)")
    assert cannot_listen("::1", 80, taken) == "cannot listen on [::1]:80: address already in use"
    assert cannot_listen(None, 80, taken) == "cannot listen on *:80: address already in use"
    unknown = socket.gaierror(socket.EAI_NONAME, "Name or service not known")
    assert cannot_listen("nowhere.invalid", 80, unknown) == (
        "cannot listen on nowhere.invalid:80: name or service not known"
    )
