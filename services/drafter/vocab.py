"""A draft model's LM head over the most frequent tokens only (FR-Spec: frequency-ranked
speculative sampling, Zhao et al. 2025); in the drafter, applied before packing or quantizing.

    keep = frequent_tokens(counts, k=32768, always=tokenizer.all_special_ids)
    restrict_vocab(model, keep)   # model.lm_head -> SubsetHead, before packing or quantizing

Lossless: the target verifies every drafted token, so a rarer token is still generated, only
never guessed; for sampling the draft distribution is the softmax over the subset.
Deviation from FR-Spec: frequencies are counted over the lookup datastore's corpus, not
SlimPajama (docs/decisions/draft-vocabulary.md).
"""
from __future__ import annotations

import functools
import logging
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import torch
from torch import nn

log = logging.getLogger(__name__)


@functools.cache
def token_counts(tokens_file: Path, vocab_size: int) -> np.ndarray:
    """How often each token id occurs in a datastore's tokens.u32 (its document separators,
    ids >= vocab_size, are not counted). One pass over the memory-mapped file (~1 s)."""
    tokens = np.memmap(tokens_file, dtype="<u4", mode="r")
    counts = np.zeros(vocab_size, dtype=np.int64)
    chunk = 1 << 24
    for start in range(0, tokens.size, chunk):
        part = np.asarray(tokens[start:start + chunk])
        counts += np.bincount(part[part < vocab_size], minlength=vocab_size)
    return counts


def frequent_tokens(counts: np.ndarray, k: int, always: Iterable[int] = ()) -> torch.Tensor:
    """The ids of the k most frequent tokens (ties: lower id first) plus `always`, sorted."""
    if k < 1:
        raise ValueError(f"a draft vocabulary needs k >= 1 tokens, got {k}")
    order = np.argsort(-counts, kind="stable")[:k]
    keep = set(order.tolist()) | {int(t) for t in always if 0 <= int(t) < counts.size}
    return torch.tensor(sorted(keep), dtype=torch.long)


class SubsetHead(nn.Module):
    """The LM head's rows for `keep` only; returns logits over the whole vocabulary with -inf
    outside `keep`, so everything downstream (softmax, top-k) sees the usual shape."""

    def __init__(self, head: nn.Linear, keep: torch.Tensor):
        super().__init__()
        self.vocab_size, self.in_features = head.out_features, head.in_features
        if keep.numel() == 0 or int(keep.max()) >= self.vocab_size or int(keep.min()) < 0:
            raise ValueError(f"kept token ids must lie in [0, {self.vocab_size})")
        weight = head.weight.detach()
        self.proj = nn.Linear(self.in_features, keep.numel(), bias=head.bias is not None,
                              dtype=weight.dtype)
        with torch.no_grad():
            self.proj.weight.copy_(weight[keep])  # a copy: a tied embedding keeps its matrix
            if head.bias is not None:
                self.proj.bias.copy_(head.bias.detach()[keep])
        self.register_buffer("keep", keep.clone(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.proj(x)
        out = y.new_full((*y.shape[:-1], self.vocab_size), float("-inf"))
        out[..., self.keep] = y
        return out

    def extra_repr(self) -> str:
        return f"{self.keep.numel()} of {self.vocab_size} tokens"


def restrict_vocab(model: nn.Module, keep: torch.Tensor) -> int:
    """Replaces a transformers causal LM's output head by a SubsetHead over `keep`; returns the
    number of rows kept. Call it on a model with torch's own linears (before `pack_linears` or
    `quantize_linears`, which then convert the subset head's projection like any layer)."""
    head = model.get_output_embeddings()
    if type(head) is not nn.Linear:
        raise TypeError(f"restrict the vocabulary before packing or quantizing the model "
                        f"(its head is a {type(head).__name__})")
    model.set_output_embeddings(SubsetHead(head, keep))
    return keep.numel()
