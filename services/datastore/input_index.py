"""The prompt + self-output source (SSSD 3.1.1): an index over one request's tokens so far.

The index maps every n-gram of length 1..P of the input (prompt and generated tokens) to the
positions where it ends; `extend` adds only the n-grams ending at the new tokens (no rebuild).
`continuations` gives one weighted tree per prefix length L = 1..P: the continuations after
every earlier occurrence of the input's last L tokens (details: docs/datastore.md).
Deviation from SSSD: only the `max_occurrences` most recent occurrences of an n-gram are used
(docs/decisions/datastore-search.md).
"""
from __future__ import annotations

from collections.abc import Sequence

from specmesh_services.datastore.fusion import WeightedTree


class InputIndex:
    def __init__(self, prefix_len: int = 4, max_occurrences: int = 100) -> None:
        self.prefix_len = prefix_len
        self.max_occurrences = max_occurrences
        self.tokens: list[int] = []
        self.ends: dict[tuple[int, ...], list[int]] = {}  # n-gram -> positions of its last token

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, tokens: Sequence[int]) -> None:
        """Appends tokens, indexing the up to P new n-grams ending at each."""
        for token in tokens:
            self.tokens.append(int(token))
            end = len(self.tokens) - 1
            for length in range(1, min(self.prefix_len, end + 1) + 1):
                self.ends.setdefault(tuple(self.tokens[end - length + 1:]), []).append(end)

    def continuations(self, max_depth: int, prefix_len: int | None = None
                      ) -> list[tuple[WeightedTree, int]]:
        """[(tree, match length L)], L ascending, for each L <= P whose last-L-token n-gram
        occurred before the current end."""
        if max_depth <= 0:
            return []
        last = len(self.tokens) - 1
        out = []
        for length in range(1, min(prefix_len or self.prefix_len, self.prefix_len, last + 1) + 1):
            ends = self.ends[tuple(self.tokens[last - length + 1:])]
            # the last entry is the current end itself (indexed by the latest `extend`)
            earlier = ends[-self.max_occurrences - 1:-1]
            if earlier:
                out.append((WeightedTree.of([self.tokens[e + 1:e + 1 + max_depth]
                                             for e in earlier]), length))
        return out
