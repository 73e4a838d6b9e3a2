"""The token tree: its one runtime form and its one compiler.

Runtime/wire form (`TokenTree` in protos/specmesh/v1/common.proto): flat `tokens[i]` and
`parents[i]` (-1 = child of the root), nodes topologically ordered; the root is the request's
last accepted token and is not part of the tree. `compile_tree` turns it into what a forward
pass over "root + nodes" needs: per-row depth (position offset), the ancestor mask (row i may
attend to row j iff j is i or an ancestor of i; EAGLE's form: mask row = own bit OR parent row)
and each row's children, for the lossless walk.
In the compiled form row 0 is the root and row i + 1 is node i.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from specmesh.v1 import common_pb2


@dataclass(frozen=True)
class TokenTree:
    """Draft tree continuing a root token. `scores`/`sources` are optional per-node annotations."""

    tokens: tuple[int, ...] = ()  # [n]
    parents: tuple[int, ...] = ()  # [n], -1 = child of the root, else an earlier index
    scores: tuple[float, ...] = ()  # [n] or empty
    sources: tuple[int, ...] = ()  # [n] or empty: index into source_names
    source_names: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        n = len(self.tokens)
        if len(self.parents) != n:
            raise ValueError(f"token tree has {n} tokens but {len(self.parents)} parents")
        for name in ("scores", "sources"):
            if len(getattr(self, name)) not in (0, n):
                raise ValueError(f"token tree {name} must be empty or have one entry per node ({n})")
        for i, parent in enumerate(self.parents):
            if not -1 <= parent < i:
                raise ValueError(f"token tree node {i} has parent {parent}: parents must come "
                                 f"before their children (-1 = root)")
        if any(s >= len(self.source_names) for s in self.sources):
            raise ValueError("token tree source index out of range of source_names")

    def __len__(self) -> int:
        return len(self.tokens)

    @classmethod
    def chain(cls, tokens: Sequence[int], scores: Sequence[float] = (), source: str | None = None
              ) -> "TokenTree":
        """A linear draft: each token the child of the previous one."""
        n = len(tokens)
        sources, names = ((0,) * n, (source,)) if source is not None and n else ((), ())
        return cls(tuple(tokens), tuple(range(-1, n - 1)), tuple(scores), sources, names)

    def depths(self) -> list[int]:
        """Depth of each node; children of the root have depth 1."""
        out: list[int] = []
        for parent in self.parents:
            out.append(1 if parent < 0 else out[parent] + 1)
        return out

    def path_to(self, node: int) -> list[int]:
        """Node indices from the root's child down to `node`."""
        path = []
        while node >= 0:
            path.append(node)
            node = self.parents[node]
        return path[::-1]

    def leaves(self) -> list[int]:
        has_child = set(p for p in self.parents if p >= 0)
        return [i for i in range(len(self)) if i not in has_child]

    @classmethod
    def union(cls, trees: Sequence["TokenTree"]) -> "TokenTree":
        """One tree holding every path of `trees` once: a node shared by several trees (same
        token below the same path) appears once, with the first tree's score and source. Node
        order: the first tree's nodes, then each later tree's new ones (parents stay first)."""
        tokens: list[int] = []
        parents: list[int] = []
        scores: list[float] = []
        sources: list[int] = []
        names: list[str] = []
        index: dict[tuple[int, int], int] = {}  # (parent node, token) -> node
        annotated = all(t.scores for t in trees if len(t)) and all(t.sources for t in trees if len(t))
        for tree in trees:
            mapped: list[int] = []
            for i, (token, parent) in enumerate(zip(tree.tokens, tree.parents)):
                new_parent = -1 if parent < 0 else mapped[parent]
                key = (new_parent, token)
                if key not in index:
                    index[key] = len(tokens)
                    tokens.append(token)
                    parents.append(new_parent)
                    if annotated:
                        scores.append(tree.scores[i])
                        name = tree.source_names[tree.sources[i]]
                        if name not in names:
                            names.append(name)
                        sources.append(names.index(name))
                mapped.append(index[key])
        return cls(tuple(tokens), tuple(parents), tuple(scores), tuple(sources), tuple(names))

    def subtree(self, node: int) -> "TokenTree":
        """The nodes below `node` as a tree continuing it (its children become the root's),
        in the same order, with their annotations."""
        index = {node: -1}
        keep = []
        for i in range(node + 1, len(self)):
            if self.parents[i] in index:
                index[i] = len(keep)
                keep.append(i)
        return TokenTree(tuple(self.tokens[i] for i in keep),
                         tuple(index[self.parents[i]] for i in keep),
                         tuple(self.scores[i] for i in keep) if self.scores else (),
                         tuple(self.sources[i] for i in keep) if self.sources else (),
                         self.source_names)

    def check_vocab(self, vocab_size: int) -> None:
        bad = [t for t in self.tokens if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"token tree holds ids outside the vocabulary [0, {vocab_size}): {bad[:5]}")

    # protobuf --------------------------------------------------------------------------------
    @classmethod
    def from_pb(cls, pb: common_pb2.TokenTree) -> "TokenTree":
        return cls(tuple(pb.tokens), tuple(pb.parents), tuple(pb.scores), tuple(pb.sources),
                   tuple(pb.source_names))

    def to_pb(self) -> common_pb2.TokenTree:
        return common_pb2.TokenTree(tokens=self.tokens, parents=self.parents, scores=self.scores,
                                    sources=self.sources, source_names=self.source_names)


@dataclass(frozen=True)
class CompiledTree:
    """Root + nodes as rows of one forward pass. Row 0 = root, row i + 1 = node i."""

    tokens: torch.Tensor  # [n + 1] long
    depths: torch.Tensor  # [n + 1] long, root 0: position offset from the root's position
    ancestors: torch.Tensor  # [n + 1, n + 1] bool, row i attends to row j (self included)
    children: list[list[int]] = field(default_factory=list)  # [n + 1] child rows of each row
    parents: torch.Tensor | None = None  # [n + 1] long, parent row of each row (root: -1)

    @property
    def num_rows(self) -> int:
        return int(self.tokens.shape[0])


def compile_tree(tree: TokenTree, root_token: int) -> CompiledTree:
    """Compiles `tree` below `root_token` into forward-pass buffers (on numpy rows: torch's
    per-row indexing cost ~40 us a row, 2.7 ms for a 64-node tree)."""
    n = len(tree)
    if n == 0:  # the root alone (plain steps): no numpy round
        return CompiledTree(tokens=torch.tensor([root_token]),
                            depths=torch.zeros(1, dtype=torch.long),
                            ancestors=torch.ones(1, 1, dtype=torch.bool), children=[[]],
                            parents=torch.full((1,), -1))
    parent_rows = [-1] + [p + 1 for p in tree.parents]
    depths = [0] * (n + 1)
    children: list[list[int]] = [[] for _ in range(n + 1)]
    ancestors = np.eye(n + 1, dtype=bool)
    for row in range(1, n + 1):
        parent = parent_rows[row]
        depths[row] = depths[parent] + 1
        ancestors[row] |= ancestors[parent]
        children[parent].append(row)
    return CompiledTree(tokens=torch.tensor([root_token, *tree.tokens], dtype=torch.long),
                        depths=torch.tensor(depths, dtype=torch.long),
                        ancestors=torch.from_numpy(ancestors), children=children,
                        parents=torch.tensor(parent_rows, dtype=torch.long))
