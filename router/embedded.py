"""The conductor's index inside the router (``conductor.embedded: true``).

The router subscribes to the prefill instances' KV-event streams itself, with the
conductor's own subscribers, sequence tracking, replays and ``PrefixCacheTable``, and asks
the table in-process: no HTTP hop per request (most of the router's own time with token
ids, bench.router_overhead's ``ids-embedded`` against ``ids``; and the conductor's CPU to
parse the query), one process less to run. The price: the router's event
loop also applies the events (in steps of ~0.5 ms, as the service does), and other routers
or tools cannot share this index. It is the router's index as ``ConductorClient`` is
(``index_client.IndexClient``), but reads a prompt's block hashes, where a conductor is sent
its ids.

With ``conductor.snapshot_path`` or ``conductor.peers`` it starts as a conductor does
(``conductor.service.recover``): the first registration round takes the newest snapshot
of the file, its previous one and the peers' (conductors, or routers serving their
embedded index's ``GET /snapshot``), resumes each of the router's streams the snapshot has
unchanged from the snapshot's sequence number (its publisher's replay gives the batches
after it) with its blocks restored, then writes the file every ``snapshot_interval_s``
and once more at close. A gap the replay cannot fill is counted
(``conductor_sequence_gaps_unrepaired_total``) and shown as the stream's ``resume_gap``
in the router's ``/health``.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Awaitable, Callable, Collection, Sequence
from pathlib import Path
from typing import Any

from conductor.config import ConductorConfig, Registration
from conductor.index import ContextKey
from conductor.manager import CapacityExceeded, RegistrationConflict, RegistrationFailed
from conductor.service import Recovery, index_manager, recover
from conductor.snapshot import Snapshots
from conductor.states import StoreState
from conductor.stream_limits import StreamLimits

from .conductor_client import registration_bodies
from .config import ConductorSection, ModelSection
from .index_client import ConductorState, Hits, IndexContext, PromptBlocks

log = logging.getLogger(__name__)
EMBEDDED = "embedded"  # its name where the router lists its conductors


class EmbeddedConductor:
    def __init__(self, section: ConductorSection | None = None) -> None:
        """``section``: the router's conductor settings (their snapshot ones; None: the
        defaults, no snapshot)."""
        section = section or ConductorSection(embedded=True)
        self._tenants: dict[str, str] = {}  # instance -> the tenant its streams are under
        # the conductor's defaults: each store's admin server on its master's host
        self.manager = index_manager(ConductorConfig(), StreamLimits())
        self.table, self.metrics = self.manager.table, self.manager.metrics
        path = section.snapshot_path
        self.snapshots = Snapshots(
            self.manager,
            Path(os.path.expanduser(path)) if path else None,
            section.snapshot_interval_s,
            section.peers,
            section.peer_timeout_s,
            section.auth_token,  # sent to the peers, asked of GET /snapshot (router.app)
        )
        self._recovered = False  # the first registration round recovers from a snapshot

    def states(self) -> dict[str, ConductorState]:
        return {EMBEDDED: ConductorState.UP}

    def degraded_reasons(self) -> list[str]:
        """None: the index is in this process (a stream it cannot subscribe to is logged)."""
        return []

    async def register(self, models: Sequence[ModelSection]) -> bool:
        """Subscribe to every stream once (a repeat changes nothing); True when all are.
        The first round starts from the newest snapshot, as a conductor does."""
        registrations = []
        for body in (body for model in models for body in registration_bodies(model)):
            self._tenants[body["instance_id"]] = body["tenant_id"] or "default"
            registrations.append(Registration.model_validate(body))
        if self._recovered:
            return await _subscribe_all(self.manager.register, registrations)
        ok = True

        async def registering(recovery: Recovery) -> None:
            nonlocal ok
            ok = await _subscribe_all(recovery.register, registrations)

        # a snapshot's other streams (a peer's) are not the router's: not adopted
        await recover(self.manager, self.snapshots, registering)
        self._recovered = True
        return ok

    def streams(self) -> dict[str, dict[str, str]]:
        """Each stream's state, and what the conductor's ``/health`` shows of it beyond:
        why it is degraded, the batches its resume from a snapshot could not replay."""
        streams: dict[str, dict[str, str]] = {}
        for key in sorted(self.manager.registrations):
            streams[key] = {"state": self.manager.state_of(key)}
            if key in self.manager.degraded:
                streams[key]["degraded"] = self.manager.degraded[key]
            if key in self.manager.resume_gaps:
                streams[key]["resume_gap"] = self.manager.resume_gaps[key]
        return streams

    async def report_instance(
        self, instance_id: str, tenant_id: str, down: bool, ttl_s: float, reason: str
    ) -> None:
        tenant = tenant_id or "default"
        if down:
            await self.manager.instance_down(instance_id, tenant, reason, ttl_s)
        else:
            await self.manager.instance_up(instance_id, tenant)

    def report_routed(self, prompt: PromptBlocks, instance_id: str) -> None:
        """Nothing: no other router asks this index (the router's own prompts in flight
        cover its requests)."""

    def decided(self, prompt: PromptBlocks) -> None:
        """Nothing: no other router shares this index's loads."""

    async def store_states(self, timeout: float) -> dict[str, StoreState]:
        return {kv_store: view["state"] for kv_store, view in self.manager.stores.view().items()}

    async def hits(self, prompt: PromptBlocks, progress_of: Collection[str]) -> Hits:
        """The prompt's hits by its block hashes, which the router's prompts in flight read
        too (hashed once); the progress of every instance is known here anyway."""
        matches = self.table.match_prefix_hashes(_context_key(prompt.context), prompt.hashes)
        return {name: (m.gpu, m.cpu, m.disk) for name, m in (matches or {}).items()}

    def indexed_until(self, instance_id: str) -> float | None:
        """The index holds every event the instance published up to this time (its clock;
        None: not known yet)."""
        tenant = self._tenants.get(instance_id)
        return None if tenant is None else self.manager.indexed_until(instance_id, tenant)

    def exposition(self) -> bytes:
        """The index's series (``conductor_*``), served on the router's ``/metrics``."""
        return self.metrics.render()

    async def close(self) -> None:
        """The last snapshot written (once recovered: never an empty index over a good
        file), then every stream stopped."""
        await self.snapshots.stop()
        await self.manager.close()


async def _subscribe_all(
    register: Callable[[Registration], Awaitable[Any]], registrations: list[Registration]
) -> bool:
    """Each stream registered; one that cannot be is logged. True when all are."""
    ok = True
    for registration in registrations:
        try:
            await register(registration)
        except (RegistrationConflict, RegistrationFailed, CapacityExceeded) as error:
            log.error("embedded index: cannot subscribe to %s: %s", registration.endpoint, error)
            ok = False
    return ok


def _context_key(context: IndexContext) -> ContextKey:
    return ContextKey(
        context.tenant_id or "default", context.model, context.lora_name, context.block_size
    )
