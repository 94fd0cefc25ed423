"""One conductor route router replicas share state through (``/routed``, ``/loads``): how
this router's reports to each conductor fare, said once per change in the log, in its
metrics and in ``/health``.

A conductor that answers 404 or 405 has no such route (the Go service): it is sent none
until it accepts a registration again (``retry``: it may have been upgraded), and that is
no fault of this router's. Any other failure is one: the other replicas do not see what
this one reports there, and ``/health`` says so until a report goes through.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from prometheus_client import Counter, Gauge

from conductor.failures import describe

from .index_client import answer_text
from .notices import Notices

Post = Callable[[str, str, dict[str, Any], float], Awaitable[tuple[int, Any]]]


@dataclass(frozen=True, slots=True)
class Wording:
    """What the route shares, as the log lines and ``/health`` say it."""

    taken: str  # "routed prompts": "conductor URL takes ... again"
    refused: str  # "routed prompts": "conductor URL takes no ... (why)"
    shared: str  # "routed prompts": "router replicas do not share their ... through it"
    setting: str  # "conductor.share_routed"
    unseen: str  # what the other replicas miss, after "the other replicas do not see"
    alone: str  # what this router does meanwhile, after "it"


@dataclass
class SharedRoute:
    path: str
    wording: Wording
    reports: Counter  # labels: conductor, outcome (sent, failed)
    sharing: Gauge  # label: conductor; 1 while its reports go through
    notices: Notices
    errors: dict[str, str] = field(default_factory=dict)  # conductor -> why it takes none
    _absent: set[str] = field(default_factory=set)  # conductors without the route

    def urls(self, urls: list[str]) -> list[str]:
        """The conductors to report to: those that may have the route."""
        return [url for url in urls if url not in self._absent]

    def retry(self, url: str) -> None:
        """``url`` accepted a registration: report to it again, its next report will say."""
        self._absent.discard(url)
        self.errors.pop(url, None)

    def reasons(self) -> list[str]:
        """``/health``'s lines for the conductors whose reports fail."""
        w = self.wording
        return [
            f"conductor {url} does not take {w.refused} ({why}): the other replicas do not "
            f"see {w.unseen}, it {w.alone}"
            for url, why in self.errors.items()
        ]

    async def send(
        self, post: Post, url: str, body: dict[str, Any], timeout: float
    ) -> tuple[bool, Any]:
        """Report ``body`` to ``url``: whether it went (or cannot: no such route), and the
        conductor's answer; False when it failed (worth sending again)."""
        try:
            status, answer = await post(url, self.path, body, timeout)
        except (aiohttp.ClientError, TimeoutError) as error:
            status, answer = 0, describe(error)
        w, key = self.wording, f"{self.path} {url}"
        if status == 200:
            self.reports.labels(url, "sent").inc()
            self.sharing.labels(url).set(1)
            self.errors.pop(url, None)
            self.notices.recovered(key, "conductor %s takes %s again", url, w.taken)
            return True, answer
        self.reports.labels(url, "failed").inc()
        self.sharing.labels(url).set(0)
        if status in (404, 405):  # no such route: not a fault of this router's
            self._absent.add(url)
            self.notices.fault(
                key, "conductor %s has no %s: router replicas do not share their %s through "
                "it (%s: false stops trying)", url, self.path, w.shared, w.setting,
            )  # fmt: skip
            return True, None
        why = self.errors[url] = f"{status or 'unreachable'} {answer_text(answer)}".strip()
        self.notices.fault(
            key, "conductor %s takes no %s (%s): the other router replicas do not see %s",
            url, w.refused, why, w.unseen,
        )  # fmt: skip
        return False, answer
