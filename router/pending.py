"""Prefixes an instance is computing right now: sent there, maybe not indexed yet.

The conductor learns a block once the engine has computed it and published its KV event:
for a long prompt, seconds after the router sent it. Requests sharing that prefix which
arrive meanwhile (a burst of requests behind one system prompt, the next turn of a chat
whose last answer is still streaming) would find it cached nowhere and be spread by load,
and every instance would compute the same prefix again. So the router remembers which
prompt it sent where, while the request runs (its blocks are then pinned in the engine's
cache) and after it ends until the index has its blocks: until the conductor (ours, or
the index in the router) has applied the events the instance published after the end,
which may take seconds on a loaded machine; a grace period where the conductor cannot say
(the Go service). It counts the longest such prompt prefix as a GPU hit on that instance.

Prompts are compared by the conductor's chained block hashes (salted with the request's
``cache_salt``) within their LoRA adapter (an engine serving a base model and adapters
keeps their caches apart), one list per request: nothing is stored per block, and a match
looks only at requests sharing the prompt's adapter and first block, each by a binary
search (``common_prefix``, shared with the conductor's table of prompts routers report).
Instances serve one base model each, so models never cross.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Collection, Sequence

from conductor.routed import common_prefix

# a finished prompt is held until the index has the events its instance published after
# the end (looked at this often), at most MAX_PENDING_S; GRACE_S where the conductor
# cannot say how far it got (the Go service), for the events to reach it
RECHECK_S = 0.1
MAX_PENDING_S = 30.0
GRACE_S = 2.0
MAX_PER_FIRST_BLOCK = 64  # requests compared per first block: the most recent ones


class PendingPrompt:
    """One routed request's prompt: its instance, its block hashes, when it ended."""

    __slots__ = ("instance_id", "hashes", "first", "ended_at")

    def __init__(self, instance_id: str, hashes: Sequence[int], adapter: str) -> None:
        self.instance_id = instance_id
        self.hashes = hashes
        self.first = (adapter, hashes[0])  # what it is found by
        self.ended_at = 0.0


class PendingPrefixes:
    """The prompts of requests in flight (and just finished), by their first block."""

    def __init__(self) -> None:
        self._by_first_block: dict[tuple[str, int], list[PendingPrompt]] = {}
        # per instance, the finished prompts still held, in the order they ended
        self._ended: dict[str, deque[PendingPrompt]] = {}

    def awaiting_index(self) -> Collection[str]:
        """The instances of the finished prompts held: whose indexing progress matters."""
        return self._ended.keys()

    def __len__(self) -> int:
        return sum(len(prompts) for prompts in self._by_first_block.values())

    def add(
        self, instance_id: str, hashes: Sequence[int], adapter: str = ""
    ) -> PendingPrompt | None:
        """Remember a prompt (of LoRA ``adapter``, "" for none) sent to ``instance_id``
        (None: no complete block to share)."""
        if not hashes:
            return None
        prompt = PendingPrompt(instance_id, hashes, adapter)
        prompts = self._by_first_block.setdefault(prompt.first, [])
        prompts.append(prompt)
        if len(prompts) > MAX_PER_FIRST_BLOCK:
            del prompts[0]
        return prompt

    def remove(self, prompt: PendingPrompt) -> None:
        prompts = self._by_first_block.get(prompt.first, [])
        for position, held in enumerate(prompts):
            if held is prompt:
                del prompts[position]
                break
        if not prompts:
            self._by_first_block.pop(prompt.first, None)

    def forget(self, instance_id: str) -> None:
        """``instance_id``'s cache is gone or unknown (it was taken out of rotation: its
        process may have died and come back empty): none of its prompts counts any more."""
        for first, prompts in list(self._by_first_block.items()):
            kept = [prompt for prompt in prompts if prompt.instance_id != instance_id]
            if kept:
                self._by_first_block[first] = kept
            else:
                del self._by_first_block[first]
        self._ended.pop(instance_id, None)

    def end(self, prompt: PendingPrompt, at: float) -> None:
        """The request ended (``at``, wall clock): held until ``release_indexed`` says."""
        prompt.ended_at = at
        self._ended.setdefault(prompt.instance_id, deque()).append(prompt)

    @property
    def ending(self) -> bool:
        """Some finished prompt is still held."""
        return bool(self._ended)

    def release_indexed(
        self, indexed_until: Callable[[str], float | None], now: float, grace_s: float
    ) -> None:
        """Forget the finished prompts the index holds now: those that ended before the
        time up to which it holds everything their instance published (at most
        ``MAX_PENDING_S`` after the end), or, where it cannot say (None), ``grace_s`` after
        the end. Per instance they ended in order, so only the oldest are looked at."""
        for instance, ended in list(self._ended.items()):
            until = indexed_until(instance)
            while ended:
                age = now - ended[0].ended_at
                if until is None:
                    done = age >= grace_s
                else:
                    done = until >= ended[0].ended_at or age >= MAX_PENDING_S
                if not done:
                    break
                self.remove(ended.popleft())
            if not ended:
                del self._ended[instance]

    def match(self, hashes: Sequence[int], adapter: str = "") -> dict[str, int]:
        """Per instance, how many leading blocks of ``hashes`` a pending prompt of the same
        ``adapter`` there has."""
        matches: dict[str, int] = {}
        if not hashes:
            return matches
        for prompt in self._by_first_block.get((adapter, hashes[0]), ()):
            shared = common_prefix(prompt.hashes, hashes)
            if shared > matches.get(prompt.instance_id, 0):
                matches[prompt.instance_id] = shared
        return matches
