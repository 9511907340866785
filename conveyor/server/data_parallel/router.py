"""Which data-parallel replica takes a request: the one with the fewest waiting tokens, less
the prompt tokens it already holds in its prefix cache.

The front keeps, per replica, the prompt tokens of requests it sent there that have had no byte
of answer yet (a stream's first chunk comes with its first token; a whole answer's at its end),
and the chained hashes of the full pages of prompts it sent there (most recent
``PREFIX_BLOCKS``), as the replica's block pool hashes them. A replica holding the first k
pages of a prompt saves k pages of prefill, so it scores that much less.

A replica the front could not reach (a ``--replica-url`` one gone away) is down: it takes no
request, and forgets its pages (it may come back empty), until it answers ``/health`` again.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

PREFIX_BLOCKS = 8192  # page hashes remembered per replica (~the pages of a replica's pool)


def page_hashes(token_ids: list[int], block_size: int) -> list[int]:
    """The chain of hashes of the prompt's full pages: each covers its page and all before."""
    hashes, parent = [], None
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash((parent, tuple(token_ids[start:start + block_size])))
        hashes.append(parent)
    return hashes


@dataclass
class ReplicaLoad:
    waiting_tokens: int = 0
    open_requests: int = 0
    pages: OrderedDict[int, None] = field(default_factory=OrderedDict)
    up: bool = True

    def held_pages(self, hashes: list[int]) -> int:
        """How many of the prompt's first pages this replica was sent before."""
        n = 0
        while n < len(hashes) and hashes[n] in self.pages:
            n += 1
        return n

    def remember(self, hashes: list[int]) -> None:
        for h in hashes:
            self.pages[h] = None
            self.pages.move_to_end(h)
        while len(self.pages) > PREFIX_BLOCKS:
            self.pages.popitem(last=False)


class NoReplicaUp(RuntimeError):
    """Every replica is down."""


class Router:
    def __init__(self, num_replicas: int, block_size: int) -> None:
        self.replicas = [ReplicaLoad() for _ in range(num_replicas)]
        self.block_size = block_size

    def choose(self, token_ids: list[int]) -> tuple[int, int]:
        """The replica for a prompt, and the prompt tokens it holds already; the request is
        counted as waiting there until ``started``. Raises NoReplicaUp when every one is down."""
        hashes = page_hashes(token_ids, self.block_size)
        held = [r.held_pages(hashes) * self.block_size for r in self.replicas]
        best = min(self.up(), key=lambda i: (
            self.replicas[i].waiting_tokens - held[i], self.replicas[i].open_requests, i))
        replica = self.replicas[best]
        replica.waiting_tokens += len(token_ids)
        replica.open_requests += 1
        replica.remember(hashes)
        return best, held[best]

    def started(self, replica: int, num_tokens: int) -> None:
        """The replica answered: the request waits no more."""
        self.replicas[replica].waiting_tokens -= num_tokens

    def finished(self, replica: int) -> None:
        self.replicas[replica].open_requests -= 1

    def withdraw(self, replica: int, num_tokens: int) -> None:
        """The request ``choose`` sent there never reached it."""
        self.started(replica, num_tokens)
        self.finished(replica)

    def up(self) -> list[int]:
        """The replicas that take requests; raises NoReplicaUp when none does."""
        up = [i for i, r in enumerate(self.replicas) if r.up]
        if not up:
            raise NoReplicaUp("no data-parallel replica is reachable")
        return up

    def mark_down(self, replica: int) -> None:
        self.replicas[replica].up = False
        self.replicas[replica].pages.clear()

    def mark_up(self, replica: int) -> None:
        self.replicas[replica].up = True
