"""Keeps an engine's streams registered with one conductor, and withdraws them.

``/register`` is idempotent (an identical body again is a 200), so the keeper simply posts
every stream again every ``interval_s``: a conductor restarted without its state file
relearns the engine within one interval, and sooner when it was down, since a conductor
that does not answer is retried with a backoff doubling from ``MIN_BACKOFF_S`` up to the
interval. A 409 means the conductor holds another registration under this instance's key
(a pod restarted with a new IP, whose old registration the conductor persisted): the
keeper owns its instance id, so it unregisters the stale one and registers again. Any
other refusal (400, 401, 403) is a configuration error: logged with the conductor's
reason, named in ``/health``, tried again every interval.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from typing import Any

import aiohttp

from conductor.failures import describe

from .streams import describe_body

log = logging.getLogger("fleet.registrar")

MIN_BACKOFF_S = 0.5
REGISTERED, UNREACHABLE, REFUSED, PENDING = "registered", "unreachable", "refused", "pending"


def unregister_body(body: Mapping[str, Any]) -> dict[str, Any]:
    return {key: body[key] for key in ("instance_id", "tenant_id", "dp_rank")}


class ConductorKeeper:
    """One conductor: the state of each stream's registration there."""

    def __init__(
        self,
        session: aiohttp.ClientSession,
        url: str,
        bodies: list[dict[str, Any]],
        interval_s: float,
        auth_token: str = "",
    ) -> None:
        self.url = url
        self.bodies = bodies
        self.interval_s = interval_s
        self._session = session
        self._headers = {"Authorization": f"Bearer {auth_token}"} if auth_token else {}
        self.states: dict[int, str] = {body["dp_rank"]: PENDING for body in bodies}
        self.error = ""  # the last failure, for /health
        self.registrations = 0  # successful rounds
        self.last_registered: float | None = None  # time.time() of the last good round

    @property
    def holds_all(self) -> bool:
        return all(state == REGISTERED for state in self.states.values())

    def view(self) -> dict[str, Any]:
        return {
            "registered": self.holds_all,
            "streams": {str(rank): state for rank, state in self.states.items()},
            "error": self.error,
            "last_registered": self.last_registered,
        }

    async def keep(self) -> None:
        """Registers every stream, then again every interval, until cancelled."""
        backoff = MIN_BACKOFF_S
        while True:
            outcome = await self.register_all()
            if outcome == UNREACHABLE:
                await asyncio.sleep(min(backoff, self.interval_s))
                backoff = min(2 * backoff, self.interval_s)
            else:
                backoff = MIN_BACKOFF_S
                await asyncio.sleep(self.interval_s)

    async def register_all(self) -> str:
        """One round over every stream: ``registered``, ``refused`` (some stream was) or
        ``unreachable`` (the conductor did not answer, or failed)."""
        outcome = REGISTERED
        for body in self.bodies:
            state = await self._register(body)
            if state != REGISTERED and outcome != UNREACHABLE:
                outcome = state
        if outcome == REGISTERED:
            self.error = ""
            self.registrations += 1
            self.last_registered = time.time()
        return outcome

    def _set(self, rank: int, state: str, error: str = "") -> str:
        self.states[rank] = state
        if error:
            self.error = error
        return state

    async def _register(self, body: dict[str, Any]) -> str:
        rank = body["dp_rank"]
        before = self.states[rank]
        try:
            status, text = await self._post("/register", body)
            if status == 409:
                log.warning(
                    "conductor=%s holds another registration of instance_id=%s dp_rank=%d "
                    "(%s): replacing it", self.url, body["instance_id"], rank, text.strip(),
                )  # fmt: skip
                await self._post("/unregister", unregister_body(body))
                status, text = await self._post("/register", body)
        except (aiohttp.ClientError, TimeoutError) as error:
            reason = describe(error)
            if before != UNREACHABLE:
                log.warning("conductor unreachable url=%s error=%s", self.url, reason)
            return self._set(rank, UNREACHABLE, reason)
        if status == 200:
            if before != REGISTERED:
                again = "re-registered" if before != PENDING else "registered"
                log.info("%s conductor=%s %s", again, self.url, describe_body(body))
            else:
                log.debug("still registered conductor=%s dp_rank=%d", self.url, rank)
            return self._set(rank, REGISTERED)
        reason = f"status {status}: {text.strip()[:300]}"
        if status >= 500:
            if before != UNREACHABLE:
                log.warning("conductor failed url=%s %s", self.url, reason)
            return self._set(rank, UNREACHABLE, reason)
        if before != REFUSED:
            log.error("registration refused conductor=%s dp_rank=%d %s", self.url, rank, reason)
        return self._set(rank, REFUSED, reason)

    async def unregister_all(self) -> bool:
        """Withdraws every stream (a stream the conductor does not know is gone too); True
        when every one is."""
        withdrawn = 0
        for body in self.bodies:
            rank = body["dp_rank"]
            try:
                status, text = await self._post("/unregister", unregister_body(body))
            except (aiohttp.ClientError, TimeoutError) as error:
                log.warning(
                    "unregister failed conductor=%s dp_rank=%d error=%s",
                    self.url, rank, describe(error),
                )  # fmt: skip
                continue
            if status in (200, 404):
                withdrawn += 1
                self.states[rank] = PENDING
                log.info(
                    "unregistered conductor=%s instance_id=%s tenant_id=%s dp_rank=%d%s",
                    self.url, body["instance_id"], body["tenant_id"], rank,
                    "" if status == 200 else " (it did not hold it)",
                )  # fmt: skip
            else:
                log.warning(
                    "unregister refused conductor=%s dp_rank=%d status=%d %s",
                    self.url, rank, status, text.strip()[:300],
                )  # fmt: skip
        return withdrawn == len(self.bodies)

    async def _post(self, path: str, body: Mapping[str, Any]) -> tuple[int, str]:
        async with self._session.post(
            f"{self.url}{path}", json=body, headers=self._headers
        ) as response:
            return response.status, await response.text()
