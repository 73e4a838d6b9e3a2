"""Early pruning inside a verify pass (ProPD 4.1): after the target's first n layers, the early
head's Top-k of each tree row's successors decides which nodes go on through the remaining
layers (heads/early.py holds the head).

The head runs on every parent row of a tree; a node passes when its token is in its parent's
Top-k (ties kept; a token outside the head's vocabulary always passes) and survives when it and
all its ancestors pass. Prompt and chain rows are never pruned; the remaining layers run on the
survivors under the compiled mask subsampled to them, and pruned rows are rolled back.
Lossless: the walk runs over the survivors with the target's own logits. Off by default, and
the head's shape: docs/decisions/early-pruning.md.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch.nn import functional as F

if TYPE_CHECKING:
    from specmesh_services.heads.early import EarlyHead


@dataclass(frozen=True)
class PrunePlan:
    """The tree nodes of a packed pass, in packed-row coordinates."""

    node_rows: torch.Tensor  # [N] row of each node
    parent_rows: torch.Tensor  # [N] row of its parent (a root or a node)
    tokens: torch.Tensor  # [N] its token
    depth: int  # deepest node (branch elimination propagates this many levels)


class EarlyPruner:
    """An early head (services/heads/early.py) served for the verifier, with its Top-k."""

    def __init__(self, head: "EarlyHead", top_k: int, weights: str | None = "auto") -> None:
        from specmesh_services.heads.draft import served_products

        if top_k < 1:
            raise ValueError("early pruning needs top_k >= 1")
        self.layer, self.top_k, self.eps = head.layer, top_k, head.eps
        self.meta = getattr(head, "meta", {})
        self.products, self.dtype, self.weights = served_products(head.up, head.down,
                                                                  head.lm_head, weights)
        self.device = head.lm_head.device
        self.norm = head.norm.detach().to(self.device, self.dtype)
        self.columns = head.columns.cpu()
        self.nodes = 0  # nodes seen and pruned, since start
        self.pruned = 0

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        p = self.products
        h = F.rms_norm(x.to(self.dtype), (x.shape[-1],), self.norm, self.eps)
        return p["lm"](h + p["down"](F.silu(p["up"](h)))).float()

    def keep(self, x: torch.Tensor, plan: PrunePlan) -> torch.Tensor | None:
        """[T] bool: the rows that go on (None: every row)."""
        parents, inverse = torch.unique(plan.parent_rows, return_inverse=True)
        logits = self.logits(x[parents.to(x.device)].to(self.device)).cpu()
        k = min(self.top_k, logits.shape[1])
        threshold = logits.topk(k, dim=-1).values[:, -1]
        column = self.columns[plan.tokens]
        score = logits[inverse, column.clamp(min=0)]
        passed = (column < 0) | (score >= threshold[inverse])
        self.nodes += int(passed.numel())
        if bool(passed.all()):
            return None
        alive = torch.ones(x.shape[0], dtype=torch.bool)
        for _ in range(plan.depth):  # a node lives when it passes and its parent lives
            alive[plan.node_rows] = passed & alive[plan.parent_rows]
        self.pruned += int((~alive).sum())
        return alive


def plan(segments, offsets: list[int]) -> PrunePlan | None:
    """The tree nodes of `segments` (each starting at packed row `offsets[s]`); None when no
    segment has a tree node."""
    nodes, parents, tokens, depth = [], [], [], 0
    for seg, at in zip(segments, offsets):
        if seg.parents is None or seg.parents.numel() < 2:
            continue
        base = at + seg.logits_from  # the root's row
        m = int(seg.parents.numel())
        nodes.append(torch.arange(base + 1, base + m))
        parents.append(base + seg.parents[1:])
        tokens.append(seg.tokens[seg.logits_from + 1:])
        positions = seg.positions[seg.logits_from:]
        depth = max(depth, int(positions.max() - positions[0]))
    if not nodes:
        return None
    return PrunePlan(torch.cat(nodes), torch.cat(parents), torch.cat(tokens), depth)
