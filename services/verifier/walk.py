"""The lossless walk (DESIGN.md): sample the target at each node, descend while the sample is
one of the node's children, emit the first sample that is not as the bonus token.

Every emitted token is a draw from the target's own (processed) distribution at its position,
so the output distribution is exactly the target's at any temperature; at temperature 0 the
walk reproduces the target's greedy decoding token for token. Drafts need no probabilities.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from services.common.sampling import Sampler
from services.common.tree import CompiledTree


@dataclass(frozen=True)
class WalkResult:
    rows: list[int]  # accepted rows of the compiled tree (row = node index + 1), root excluded
    tokens: list[int]  # their tokens
    bonus: int  # the target's token after the accepted path

    @property
    def nodes(self) -> list[int]:
        """Accepted node indices in the wire tree."""
        return [r - 1 for r in self.rows]


def walk(tree: CompiledTree, logits: torch.Tensor, sampler: Sampler, root_position: int
         ) -> WalkResult:
    """logits: [n + 1, V], row i = target logits after compiled row i.
    root_position: sequence index of the root; a row at depth d samples index root_position + d + 1.
    """
    assert logits.shape[0] == tree.num_rows, "one logits row per compiled tree row"
    row, rows, tokens = 0, [], []
    while True:
        depth = int(tree.depths[row])
        y = sampler.sample(logits[row], root_position + depth + 1)
        child = next((c for c in tree.children[row] if int(tree.tokens[c]) == y), None)
        if child is None:
            return WalkResult(rows, tokens, y)
        rows.append(child)
        tokens.append(y)
        row = child
