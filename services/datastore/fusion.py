"""Weighted continuation trees and their fusion into one draft tree (SSSD 3.1.3, Algorithm 1).

Every source (the suffix-array datastore; the request's input index, once per prefix length)
gives a `WeightedTree`: its continuations merged by token path, each node counting the weighted
continuations through it; pseudo-probability = count(prefix + path) / count(prefix). `fuse` is
Algorithm 1: one priority queue over all sources' trees, a node's priority its probability times
`Discounts.discount(source, depth, match length)`; the best node joins the draft tree (sources
that agree share nodes), its children enter the queue, until `max_nodes`. The discount formula,
its storage in meta.json and its grid search (tune.py): docs/datastore.md, Fusion.
"""
from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, field_validator

from specmesh_services.common.tree import TokenTree

DATASTORE = "datastore"
INPUT = "input"


@dataclass(frozen=True)
class WeightedTree:
    """The continuations of one matched prefix, as a flat trie.

    Nodes are in breadth-first order with the children of a node contiguous and sorted by token;
    `starts` is their CSR index: the root's children are nodes starts[0] .. starts[1] - 1, node
    i's are starts[i + 1] .. starts[i + 2] - 1. `count` is the root's count (the prefix's
    matches), `counts[i]` the weighted continuations through node i. Flat lists instead of node
    objects: a datastore tree of 100 continuations x 8 tokens has hundreds of nodes, and building
    them as Python objects cost more than the whole search; `fuse` only visits the few it pops.
    """

    count: float = 0.0
    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)  # -1 = child of the root
    counts: list[float] = field(default_factory=list)
    starts: list[int] = field(default_factory=lambda: [0, 0])

    def __len__(self) -> int:
        return len(self.tokens)

    def __bool__(self) -> bool:
        return bool(self.tokens)

    def children(self, node: int) -> range:
        """The children of `node` (-1 = the root)."""
        return range(self.starts[node + 1], self.starts[node + 2])

    def probs(self) -> list[float]:
        """Per node: count(prefix + path) / count(prefix)."""
        return [c / self.count for c in self.counts] if self.count else [0.0] * len(self)

    def paths(self) -> dict[tuple[int, ...], float]:
        """{token path from the root: count} of every node (tests and debugging)."""
        path: list[tuple[int, ...]] = []
        for token, parent in zip(self.tokens, self.parents):
            path.append((*(path[parent] if parent >= 0 else ()), token))
        return dict(zip(path, self.counts))

    @classmethod
    def of(cls, continuations: Sequence[Sequence[int]], count: float | None = None,
           weights: Sequence[float] | None = None) -> WeightedTree:
        """The trie of a few continuations, in pure Python (cheaper than numpy below ~100 token
        paths: the prompt + self-output trees). `count` defaults to the number of
        continuations, `weights` to 1 each."""
        trie: dict[int, list] = {}  # token -> [count, child trie]
        for i, continuation in enumerate(continuations):
            weight = 1.0 if weights is None else float(weights[i])
            level = trie
            for token in continuation:
                entry = level.get(token)
                if entry is None:
                    entry = level[token] = [0.0, {}]
                entry[0] += weight
                level = entry[1]
        tokens: list[int] = []
        parents: list[int] = []
        counts: list[float] = []
        starts: list[int] = []
        queue = [trie]  # breadth first: the root, then node 0, 1, ... in order
        for parent, level in enumerate(queue, start=-1):
            starts.append(len(tokens))
            for token in sorted(level):
                tokens.append(int(token))
                parents.append(parent)
                counts.append(level[token][0])
                queue.append(level[token][1])
        starts.append(len(tokens))
        return cls(float(len(continuations) if count is None else count), tokens, parents,
                   counts, starts)

    @classmethod
    def from_rows(cls, rows: np.ndarray, weights: np.ndarray, count: float) -> WeightedTree:
        """The trie of the continuations in `rows` ([k, depth] token ids, -1 after a row's end),
        row j weighing weights[j]; built with numpy for the datastore's up to M x prefix
        lengths rows. Same result as `of` on the same continuations.

        Sorting the rows lexicographically puts every node's rows next to each other, so a row
        starts a new node at depth d iff it differs from the previous row somewhere in columns
        0..d; numbering those starts depth by depth gives breadth-first order with siblings
        contiguous and sorted by token."""
        rows = np.asarray(rows, np.int64)
        k, depth = rows.shape
        if k == 0 or depth == 0:
            return cls(float(count))
        order = np.lexsort(rows.T[::-1])  # lexsort's last key is the primary one
        rows = rows[order]
        weights = np.asarray(weights, np.float64)[order]
        valid = rows >= 0
        changed = np.ones_like(valid)
        changed[1:] = rows[1:] != rows[:-1]
        new = valid & np.logical_or.accumulate(changed, axis=1)  # [k, depth]: row starts a node
        per_depth = new.sum(axis=0)
        first = np.concatenate(([0], np.cumsum(per_depth)[:-1]))  # first node id of each depth
        node = np.cumsum(new, axis=0) - 1 + first  # [k, depth]: the node holding row j at depth d
        n = int(per_depth.sum())
        counts = np.bincount(node[valid], np.broadcast_to(weights[:, None], rows.shape)[valid],
                             minlength=n)
        parent = np.full_like(node, -1)
        parent[:, 1:] = node[:, :-1]
        by_depth = new.T  # depth-major selection = node id order
        parents = parent.T[by_depth]
        starts = np.searchsorted(parents, np.arange(-1, n + 1))  # parents are non-decreasing
        return cls(float(count), rows.T[by_depth].tolist(), parents.tolist(), counts.tolist(),
                   starts.tolist())


class Discounts(BaseModel):
    """Per-source, per-depth and per-match-length dampening of the sources' probabilities (the
    formula is in the module docstring)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    datastore_scale: float = Field(1.0, ge=0)
    datastore_decay: float = Field(1.0, ge=0, le=1, description="per level below the first")
    input_scale: float = Field(0.6, ge=0, description="input estimates are overconfident")
    input_decay: float = Field(1.0, ge=0, le=1, description="per level below the first")
    input_match: list[float] = Field(default_factory=lambda: [0.2, 0.5, 0.8, 1.0],
                                     description="factor per prefix match length 1..P (longer "
                                                 "matches: the last)")

    @field_validator("input_match")
    @classmethod
    def _non_empty(cls, value: list[float]) -> list[float]:
        if not value or any(v < 0 for v in value):
            raise ValueError("input_match needs one factor >= 0 per prefix length")
        return value

    def discount(self, source: str, depth: int, match_len: int = 0) -> float:
        if source == DATASTORE:
            return self.datastore_scale * self.datastore_decay ** (depth - 1)
        if source == INPUT:
            match = self.input_match[min(max(match_len, 1), len(self.input_match)) - 1]
            return self.input_scale * self.input_decay ** (depth - 1) * match
        raise ValueError(f"unknown draft source {source!r} (known: {DATASTORE}, {INPUT})")


def fuse(sources: Sequence[tuple[str, WeightedTree, int]], max_nodes: int, max_depth: int,
         discounts: Discounts) -> TokenTree:
    """Algorithm 1 over `sources` = [(source name, tree, prefix match length)]: a draft tree of at
    most `max_nodes` nodes and `max_depth` levels, nodes in insertion order (so parents come
    first), `scores` = the priority each node was inserted with, `sources` = the source that
    inserted it (the first one to reach it)."""
    if max_nodes <= 0 or max_depth <= 0:
        return TokenTree()
    tokens: list[int] = []
    parents: list[int] = []
    scores: list[float] = []
    inserted_by: list[int] = []
    draft: dict[tuple[int, int], int] = {}  # (draft parent, token) -> draft node
    names: list[str] = []
    for name, tree, _ in sources:
        if tree and name not in names:
            names.append(name)
    trees = [(tree, tree.probs(), names.index(name), name, match_len)
             for name, tree, match_len in sources if tree]
    # element: (-priority, insertion counter: ties pop first-pushed first, deterministically,
    #           source tree, node in it, depth, draft parent)
    queue: list[tuple[float, int, int, int, int, int]] = []
    counter = itertools.count()

    def push_children(t: int, node: int, depth: int, draft_parent: int) -> None:
        tree, probs, _, name, match_len = trees[t]
        factor = discounts.discount(name, depth, match_len)
        for child in tree.children(node):
            prob = probs[child] * factor
            # deviation: a zero priority (a source switched off by a zero discount) is never
            # queued, so it cannot fill the budget after the useful nodes run out
            if prob > 0:
                heapq.heappush(queue, (-prob, next(counter), t, child, depth, draft_parent))

    # initial loop: the paper writes `node.prob` (node = the root) but means the child's prob
    for t in range(len(trees)):
        push_children(t, -1, 1, -1)
    while queue and len(tokens) < max_nodes:
        neg_prob, _, t, node, depth, draft_parent = heapq.heappop(queue)
        token = trees[t][0].tokens[node]
        inserted = draft.get((draft_parent, token))
        if inserted is None:  # draft_tree.insert: a new child, else the existing one
            inserted = draft[(draft_parent, token)] = len(tokens)
            tokens.append(token)
            parents.append(draft_parent)
            scores.append(-neg_prob)
            inserted_by.append(trees[t][2])
        if depth < max_depth:
            push_children(t, node, depth + 1, inserted)
    used = sorted(set(inserted_by))
    remap = {old: new for new, old in enumerate(used)}
    return TokenTree(tuple(tokens), tuple(parents), tuple(scores),
                     tuple(remap[s] for s in inserted_by), tuple(names[s] for s in used))
