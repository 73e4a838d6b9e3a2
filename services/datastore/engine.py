"""The lookup engine behind the datastore service: SSSD drafting for a batch of requests.

Per request it keeps an InputIndex over the prompt and everything generated so far (SSSD 3.1.1),
created on the first lookup (`reset`), extended with the accepted tokens of each later call and
dropped on Release or after `index_ttl_s` without a lookup. A batch is served in three passes:
update every request's index; look up all requests' last P tokens in the suffix-array datastore
at once (`continuations_batch`); fuse each request's datastore tree and input trees into one
draft tree (Algorithm 1). The batch is searched with numpy, not SSSD's OpenMP
(docs/decisions/datastore-search.md).
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from specmesh_services.common import datastore_files
from specmesh_services.common.config import DatastoreSettings, Settings
from specmesh_services.common.rpc import FailedPrecondition
from specmesh_services.common.tree import TokenTree
from specmesh_services.datastore.fusion import DATASTORE, INPUT, Discounts, fuse
from specmesh_services.datastore.input_index import InputIndex
from specmesh_services.datastore.suffix import SuffixDatastore
from specmesh.v1 import datastore_pb2

log = logging.getLogger(__name__)


def open_for_target(settings: Settings, tokenizer) -> SuffixDatastore:
    """Opens the configured datastore of the target's tokenizer family (datastore_files.locate)."""
    return SuffixDatastore.open(datastore_files.locate(settings, tokenizer))


@dataclass(frozen=True)
class LookupRequest:
    request_id: str
    new_tokens: list[int]  # the whole context when reset, else the tokens accepted since
    max_nodes: int
    max_depth: int
    reset: bool = False


@dataclass
class _Entry:
    index: InputIndex
    last_used: float


class LookupEngine:
    def __init__(self, store: SuffixDatastore | None, settings: DatastoreSettings,
                 discounts: Discounts | None = None, clock: Callable[[], float] = time.monotonic
                 ) -> None:
        self.store = store
        self.settings = settings
        meta_discounts = (store.meta.get("discounts") if store is not None else None)
        self.discounts = discounts or (Discounts.model_validate(meta_discounts) if meta_discounts
                                       else Discounts())
        self.clock = clock
        self.requests: dict[str, _Entry] = {}

    def info(self) -> datastore_pb2.DatastoreInfo:
        meta = self.store.meta if self.store is not None else {}
        return datastore_pb2.DatastoreInfo(
            name=meta.get("name", ""), tokenizer=meta.get("tokenizer", ""),
            num_tokens=meta.get("num_tokens", 0), num_documents=meta.get("num_documents", 0),
            active_requests=len(self.requests), discounts_json=self.discounts.model_dump_json())

    def lookup(self, items: list[LookupRequest]) -> list[TokenTree]:
        now = self.clock()
        self._expire(now)
        entries = [self._update(item, now) for item in items]
        p = self.settings.prefix_len
        contexts = [e.index.tokens[-p:] for e in entries]
        max_depths = [item.max_depth for item in items]
        store_trees = (self.store.continuations_batch(
            contexts, max(max_depths, default=0), prefix_len=p,
            max_conts=self.settings.max_conts, min_conts=self.settings.min_conts)
            if self.store is not None else [None] * len(items))
        out = []
        for item, entry, store_tree in zip(items, entries, store_trees):
            if item.max_nodes == 0 or item.max_depth == 0:
                out.append(TokenTree())
                continue
            sources = [] if store_tree is None else [(DATASTORE, store_tree, 0)]
            sources += [(INPUT, tree, match_len) for tree, match_len in
                        entry.index.continuations(item.max_depth, prefix_len=p)]
            out.append(fuse(sources, item.max_nodes, item.max_depth, self.discounts))
        return out

    def _update(self, item: LookupRequest, now: float) -> _Entry:
        entry = self.requests.get(item.request_id)
        if item.reset or entry is None:
            if not item.reset:
                raise FailedPrecondition(
                    f"no index for request {item.request_id} (expired after "
                    f"{self.settings.index_ttl_s:.0f} s idle, or the service restarted): send "
                    f"the whole context with reset=true")
            if not item.new_tokens:
                raise ValueError(f"request {item.request_id}: reset needs the whole context in "
                                 f"new_tokens")
            entry = _Entry(InputIndex(self.settings.prefix_len), now)
            self.requests[item.request_id] = entry
        entry.index.extend(item.new_tokens)
        entry.last_used = now
        return entry

    def release(self, request_ids: list[str]) -> int:
        return sum(self.requests.pop(rid, None) is not None for rid in request_ids)

    def _expire(self, now: float) -> None:
        ttl = self.settings.index_ttl_s
        stale = [rid for rid, e in self.requests.items() if now - e.last_used > ttl]
        for rid in stale:
            del self.requests[rid]
        if stale:
            log.info("dropped %d request indexes idle for over %.0f s", len(stale), ttl)
