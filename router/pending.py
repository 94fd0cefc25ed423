"""Prefixes an instance is computing right now: sent there, maybe not indexed yet.

The conductor learns a block once the engine has computed it and published its KV event:
for a long prompt, seconds after the router sent it. Requests sharing that prefix which
arrive meanwhile (a burst of requests behind one system prompt, the next turn of a chat
whose last answer is still streaming) would find it cached nowhere and be spread by load,
and every instance would compute the same prefix again. So the router remembers which
prompt it sent where, while the request runs (its blocks are then pinned in the engine's
cache) and until the index has its blocks (a conductor service: for a grace period after
the end; an index in the router: until it has applied the instance's events published
after the end, which may take longer on a loaded machine), and counts the longest such
prompt prefix as a GPU hit on that instance.

Prompts are compared by the conductor's chained block hashes (salted with the model and
the request's ``cache_salt``, so neither crosses), one list per request: nothing is stored
per block, and a match looks only at requests sharing the prompt's first block.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Sequence

GRACE_S = 2.0  # after a request ends, for its engine's KV events to reach the conductor
# with the index in the router, whose progress it sees: kept until the index has the
# instance's events published after the end (checked this often), at most this long
RECHECK_S = 0.1
MAX_PENDING_S = 30.0
MAX_PER_FIRST_BLOCK = 64  # requests compared per first block: the most recent ones


class PendingPrompt:
    """One routed request's prompt: its instance and its block hashes."""

    __slots__ = ("instance_id", "hashes")

    def __init__(self, instance_id: str, hashes: Sequence[int]) -> None:
        self.instance_id = instance_id
        self.hashes = hashes


class PendingPrefixes:
    """The prompts of requests in flight (and just finished), by their first block."""

    def __init__(self) -> None:
        self._by_first_block: dict[int, list[PendingPrompt]] = {}
        self._per_instance: Counter[str] = Counter()

    def instances(self) -> Collection[str]:
        """The instances some pending prompt was sent to."""
        return self._per_instance.keys()

    def __len__(self) -> int:
        return sum(len(prompts) for prompts in self._by_first_block.values())

    def add(self, instance_id: str, hashes: Sequence[int]) -> PendingPrompt | None:
        """Remember a prompt sent to ``instance_id`` (None: no complete block to share)."""
        if not hashes:
            return None
        prompt = PendingPrompt(instance_id, hashes)
        prompts = self._by_first_block.setdefault(hashes[0], [])
        prompts.append(prompt)
        self._per_instance[instance_id] += 1
        if len(prompts) > MAX_PER_FIRST_BLOCK:
            self._forget(prompts.pop(0))
        return prompt

    def remove(self, prompt: PendingPrompt) -> None:
        prompts = self._by_first_block.get(prompt.hashes[0], [])
        for position, held in enumerate(prompts):
            if held is prompt:
                del prompts[position]
                self._forget(prompt)
                break
        if not prompts:
            self._by_first_block.pop(prompt.hashes[0], None)

    def _forget(self, prompt: PendingPrompt) -> None:
        self._per_instance[prompt.instance_id] -= 1
        if not self._per_instance[prompt.instance_id]:
            del self._per_instance[prompt.instance_id]

    def match(self, hashes: Sequence[int]) -> dict[str, int]:
        """Per instance, how many leading blocks of ``hashes`` a pending prompt there has."""
        matches: dict[str, int] = {}
        if not hashes:
            return matches
        for prompt in self._by_first_block.get(hashes[0], ()):
            shared = common_prefix(prompt.hashes, hashes)
            if shared > matches.get(prompt.instance_id, 0):
                matches[prompt.instance_id] = shared
        return matches


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading hashes ``a`` and ``b`` share. They are chained block hashes (each
    covers every block before it), so two lists that agree at a position agree before it:
    a binary search compares one hash per step."""
    low, high = 0, min(len(a), len(b))
    while low < high:
        middle = (low + high + 1) // 2
        if a[middle - 1] == b[middle - 1]:
            low = middle
        else:
            high = middle - 1
    return low
