"""A token tree as one llama.cpp decode batch: each leaf gets a sequence id, each row the ids of
the leaves below it (the root also the request's own sequence). llama.cpp masks a row by its
first sequence id: it then sees the cells of that leaf's path at positions up to its own, i.e.
exactly its ancestors (and the committed context, copied into every leaf's sequence first).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class TreeRows:
    """One request's rows of a decode batch, in tree order (a parent before its children)."""

    tokens: list[int]
    positions: list[int]
    seq_ids: list[list[int]]  # per row; its first id decides what the row sees
    leaf_seqs: list[int]  # the temporary sequences the tree uses (freed after its walk)
    leaf_of: list[int]  # per row: the first leaf sequence below it (the root: its first leaf)


def tree_rows(tokens: Sequence[int], parents: Sequence[int], root_pos: int, main_seq: int,
              free_seqs: Sequence[int]) -> TreeRows:
    """Rows of a tree whose row 0 is the root (at `root_pos`, in sequence `main_seq`) and row
    i > 0 has parent row parents[i] < i; leaf sequences are taken from `free_seqs` in order."""
    n = len(tokens)
    children = [0] * n
    for i in range(1, n):
        if not 0 <= parents[i] < i:
            raise ValueError(f"row {i}: parent {parents[i]} must be an earlier row")
        children[parents[i]] += 1
    leaves = [i for i in range(1, n) if children[i] == 0]
    if len(leaves) > len(free_seqs):
        raise ValueError(f"a tree of {len(leaves)} leaves needs as many free sequences "
                         f"(llama.cpp's n_seq_max), {len(free_seqs)} left")
    below: list[list[int]] = [[] for _ in range(n)]
    for leaf, seq in zip(leaves, free_seqs):
        below[leaf].append(seq)
    depth = [0] * n
    for i in range(1, n):
        depth[i] = depth[parents[i]] + 1
    for i in range(n - 1, 0, -1):  # children come after their parents: gather bottom-up
        below[parents[i]][:0] = below[i]
    for i in range(n):
        below[i].sort()
    seq_ids = [[main_seq, *below[0]]] + [below[i] for i in range(1, n)]
    leaf_seqs = sorted(below[0])
    leaf_of = [below[i][0] if below[i] else main_seq for i in range(n)]
    return TreeRows(list(tokens), [root_pos + d for d in depth], seq_ids, leaf_seqs, leaf_of)
