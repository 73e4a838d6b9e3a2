"""The pool contract, shared by the Redis and in-memory implementations.

One step: the router `submit`s a DraftEntry, one verifier `take`s it (or `claim_stale`s one a
dead verifier left unacknowledged) and `complete`s it: atomically, if the request's token count
still equals the entry's `base_len`, append the tokens, publish the VerifyResult to `reply_to`
and acknowledge; a duplicate is dropped, a stale one answered with `stale` set. Routers read
`results`; `delete_request` announces the end on the release feed (`releases`); a draft
delivered too often is `dead_letter`ed. In full: docs/architecture.md, The pool.
"""
from __future__ import annotations

import abc
from dataclasses import dataclass

from specmesh.v1 import pool_pb2


@dataclass(frozen=True)
class Taken:
    """A draft entry delivered to a verifier, not yet acknowledged."""

    entry_id: str  # pool-assigned id (Redis stream id)
    entry: pool_pb2.DraftEntry
    deliveries: int  # 1 on first delivery, more when claimed again after a crash


def stale_result(entry: pool_pb2.DraftEntry) -> pool_pb2.VerifyResult:
    """What the router of a stale draft gets: nothing verified, re-read the request."""
    return pool_pb2.VerifyResult(request_id=entry.request_id, step=entry.step,
                                 base_len=entry.base_len, stale=True)


class Pool(abc.ABC):
    """Asynchronous pool client. Implementations must be safe for concurrent use by tasks."""

    # request state ----------------------------------------------------------------------------
    @abc.abstractmethod
    async def put_request(self, state: pool_pb2.RequestState, ttl_s: float) -> None:
        """Stores a new request's state with no generated tokens; expires after ttl_s idle."""

    @abc.abstractmethod
    async def get_request(self, request_id: str) -> tuple[pool_pb2.RequestState, list[int]] | None:
        """The request's state and generated tokens, or None if unknown/expired."""

    @abc.abstractmethod
    async def delete_request(self, request_id: str) -> None:
        """Drops the request's state and announces its id on the release feed."""

    # drafts -----------------------------------------------------------------------------------
    @abc.abstractmethod
    async def submit(self, entry: pool_pb2.DraftEntry) -> str:
        """Queues a draft for verification; returns its entry id."""

    @abc.abstractmethod
    async def take(self, consumer: str, count: int, block_s: float) -> list[Taken]:
        """Up to `count` never-delivered drafts for `consumer`, waiting up to block_s for one."""

    @abc.abstractmethod
    async def claim_stale(self, consumer: str, min_idle_s: float, count: int) -> list[Taken]:
        """Up to `count` drafts delivered to any consumer but unacknowledged for min_idle_s,
        now delivered to `consumer`."""

    @abc.abstractmethod
    async def complete(self, taken: Taken, result: pool_pb2.VerifyResult,
                       new_tokens: list[int]) -> bool:
        """Atomically applies a verification (see module doc). False if the entry was a
        duplicate or stale, or the request is gone: then nothing is appended, and for a stale
        entry of a live request its router gets `stale_result(entry)`."""

    @abc.abstractmethod
    async def reply_stale(self, taken: Taken) -> None:
        """Acknowledges a draft found stale before verification (its base_len is not the
        request's generated count) and sends its router `stale_result(entry)`."""

    @abc.abstractmethod
    async def ack(self, taken: Taken) -> None:
        """Acknowledges a draft without a result (dropped on purpose)."""

    @abc.abstractmethod
    async def dead_letter(self, taken: Taken, reason: str) -> None:
        """Gives up on a draft that keeps failing: it moves to the dead-letter stream with
        `reason`, leaves the drafts, and its router gets a VerifyResult with `error` = reason
        (the request fails at once instead of waiting for a result that never comes)."""

    @abc.abstractmethod
    async def dead_letters(self, count: int = 100) -> list[tuple[pool_pb2.DraftEntry, str]]:
        """The last `count` dead-lettered drafts and their reasons, oldest first."""

    @abc.abstractmethod
    async def has_entry(self, entry_id: str) -> bool:
        """Whether a submitted draft is still queued or being verified (False once it was
        completed, acknowledged, dead-lettered, or lost with a Redis that kept no data)."""

    @abc.abstractmethod
    async def pending(self) -> int:
        """Drafts submitted but not yet acknowledged (queued or in verification)."""

    # results ----------------------------------------------------------------------------------
    @abc.abstractmethod
    async def results(self, router_id: str, block_s: float) -> list[pool_pb2.VerifyResult]:
        """Results published for `router_id`, in publication order, waiting up to block_s."""

    # release feed -----------------------------------------------------------------------------
    @abc.abstractmethod
    async def releases(self, cursor: str, block_s: float) -> tuple[str, list[str]]:
        """Request ids released after `cursor` ("" = from now on) and the new cursor; every
        caller sees every release (broadcast), waiting up to block_s for one."""

    async def close(self) -> None:
        """Releases connections."""
