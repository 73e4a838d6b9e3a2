"""A draft model's LM head over the most frequent tokens only (FR-Spec: frequency-ranked
speculative sampling, Zhao et al. 2025).

Why: a small draft spends a large share of each drafting forward in its LM head, because the
vocabulary is large (docs/decisions/draft-vocabulary.md), and most of its rows are tokens a chat
or code answer almost never uses. FR-Spec keeps the head's rows for the k most frequent tokens
of a corpus; the draft then only proposes those tokens.

Lossless: the target verifies every drafted token and emits its own token wherever the draft was
wrong, so a token outside the subset is still generated (by the target), only never guessed.
For sampling, the draft distribution is the softmax over the subset (zero elsewhere), a valid
proposal distribution for the rejection rule.

Frequencies: token counts over the lookup datastore's corpus (ShareGPT tokenized with the
target's tokenizer, `specmesh datastore build --model ...`; with the Qwen tokenizer 32,768
tokens cover 97.7% of it). The tokenizer's special tokens (end of turn, end of text) are always
kept. Deviation from the paper: it counts tokens of
SlimPajama; we count the corpus the datastore already holds, so no second corpus is needed.

    keep = frequent_tokens(counts, k=32768, always=tokenizer.all_special_ids)
    restrict_vocab(model, keep)   # model.lm_head -> SubsetHead, before packing or quantizing
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
