"""The lossless walk: sample the target at each node, descend while the sample is one of the
node's children, emit the first sample that is not as the bonus token.

Every emitted token is a draw from the target's own processed distribution at its position
(penalties, then temperature / top-k / top-p; argmax at temperature 0), so the output is
distributed exactly as the target's, token for token its greedy decoding at temperature 0;
drafts need no probabilities. A row is sampled only after every node above it was accepted, so
its penalty history is what the target would have seen decoding alone (docs/architecture.md,
The lossless rule).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specmesh_services.common.sampling import Sampler, coupled_scores, probabilities, race_weights
from specmesh_services.common.tree import CompiledTree


@dataclass(frozen=True)
class WalkResult:
    rows: list[int]  # accepted rows of the compiled tree (row = node index + 1), root excluded
    tokens: list[int]  # their tokens
    bonus: int  # the target's token after the accepted path

    @property
    def nodes(self) -> list[int]:
        """Accepted node indices in the wire tree."""
        return [r - 1 for r in self.rows]


def walk(tree: CompiledTree, logits: torch.Tensor, sampler: Sampler, tokens: Sequence[int]
         ) -> WalkResult:
    """logits: [n + 1, V], row i = target logits after compiled row i.
    tokens: the request's committed sequence (prompt + generated); the root is tokens[-1] at
    sequence index len(tokens) - 1, and a row at depth d samples index len(tokens) + d with
    history tokens + the d accepted tokens above it.
    """
    assert logits.shape[0] == tree.num_rows, "one logits row per compiled tree row"
    assert len(tokens) > 0 and int(tree.tokens[0]) == tokens[-1], "the root is tokens[-1]"
    base = len(tokens)
    history = None
    if sampler.needs_history:  # one buffer: committed tokens, then the path as it is accepted
        history = torch.empty(base + int(tree.depths.max()), dtype=torch.long)
        history[:base] = torch.as_tensor(tokens, dtype=torch.long)
    row, rows, accepted = 0, [], []
    while True:
        depth = int(tree.depths[row])
        y = sampler.sample(logits[row], base + depth,
                           None if history is None else history[:base + depth])
        child = next((c for c in tree.children[row] if int(tree.tokens[c]) == y), None)
        if child is None:
            return WalkResult(rows, accepted, y)
        rows.append(child)
        accepted.append(y)
        if history is not None:
            history[base + depth] = y
        row = child


def row_draws(tree: CompiledTree, logits: torch.Tensor, sampler: Sampler,
              tokens: Sequence[int], base: int | None = None) -> torch.Tensor:
    """Every row's draw at once, on the logits' device: [n + 1] long, row i's draw being what
    `walk` samples at row i if it reaches it (its history is the committed tokens and the
    tree path down to i, fixed by the tree). The same operations as `Sampler.sample`, row-wise;
    `walk_draws` then walks the tree on the host after a single copy. `base`: the committed
    tokens' count where `tokens` is not all of them (unpenalized sampling reads no history)."""
    params, device = sampler.params, logits.device
    base, vocab = len(tokens) if base is None else base, logits.shape[-1]
    out = logits.float()
    if params.penalized:
        history = torch.as_tensor(tokens, dtype=torch.long).to(device)
        path = tree.ancestors.to(device).clone()
        path[:, 0] = False  # the root is tokens[-1], already in the history
        rows, cols = path.nonzero(as_tuple=True)
        on_path = torch.zeros(tree.num_rows, vocab, device=device)
        on_path.index_put_((rows, tree.tokens.to(device)[cols]),
                           torch.ones(rows.numel(), device=device), accumulate=True)
        p = params.repetition_penalty
        if p != 1.0:
            seen = (torch.bincount(history, minlength=vocab) > 0) | (on_path > 0)
            out = torch.where(seen, torch.where(out < 0, out * p, out / p), out)
        if params.presence_penalty != 0.0 or params.frequency_penalty != 0.0:
            counts = torch.bincount(history[sampler.prompt_len:], minlength=vocab) + on_path
            out = torch.where(counts > 0, out - (params.presence_penalty
                                                 + params.frequency_penalty * counts), out)
    if params.greedy:
        return torch.argmax(out, dim=-1)
    probs = probabilities(out, params)
    depths = tree.depths.tolist()
    weights = {d: race_weights(sampler.seed, base + d, vocab) for d in set(depths)}
    race = torch.stack([weights[d] for d in depths]).to(device, non_blocking=True)
    return torch.argmax(coupled_scores(probs, race), dim=-1)


def walk_draws(tree: CompiledTree, draws: Sequence[int]) -> WalkResult:
    """`walk` over draws made beforehand (`row_draws`, copied to the host)."""
    row, rows, accepted = 0, [], []
    while True:
        y = draws[row]
        child = next((c for c in tree.children[row] if int(tree.tokens[c]) == y), None)
        if child is None:
            return WalkResult(rows, accepted, y)
        rows.append(child)
        accepted.append(y)
        row = child
