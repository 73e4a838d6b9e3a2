"""Sampling parameters and the per-position sampler applied to the target's logits.

Randomness is counter-based: the draw for output position p of a request comes from a generator
seeded with (request seed, p). The same seed therefore gives the same tokens whatever the tree
shape, the drafter, or which verifier replica (re-)verifies a step, and draws at different
positions are independent, which the lossless walk needs.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from specmesh.v1 import common_pb2


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy (argmax)
    top_p: float = 1.0  # nucleus mass in (0, 1]
    top_k: int = 0  # 0 = off
    seed: int | None = None

    def validate(self) -> None:
        """Raises ValueError with a message that says what to fix."""
        if not self.temperature >= 0:  # also rejects NaN
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1] (1 = off), got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if self.seed is not None and not 0 <= self.seed < 2**64:
            raise ValueError(f"seed must be in [0, 2**64), got {self.seed}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1

    @classmethod
    def from_pb(cls, pb: common_pb2.SamplingParams) -> "SamplingParams":
        return cls(temperature=pb.temperature, top_p=pb.top_p if pb.HasField("top_p") else 1.0,
                   top_k=pb.top_k,
                   seed=pb.seed if pb.HasField("seed") else None)

    def to_pb(self) -> common_pb2.SamplingParams:
        pb = common_pb2.SamplingParams(temperature=self.temperature, top_p=self.top_p,
                                       top_k=self.top_k)
        if self.seed is not None:
            pb.seed = self.seed
        return pb


def probabilities(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Target distribution after temperature, top-k, top-p (in that order, as HF `generate`).

    logits: [..., V] any float dtype; returns float32 probabilities [..., V].
    """
    logits = logits.float() / max(params.temperature, 1e-6)
    vocab = logits.shape[-1]
    if 0 < params.top_k < vocab:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
        mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        sorted_probs = sorted_probs.masked_fill(mass_before >= params.top_p, 0.0)  # top-1 always kept
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def position_seed(seed: int, position: int) -> int:
    """63-bit seed of the draw at `position` of a request seeded with `seed`."""
    digest = hashlib.blake2b(f"{seed}:{position}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


class Sampler:
    """Draws one token from a logits row for a given output position of one request."""

    def __init__(self, params: SamplingParams, seed: int):
        self.params = params
        self.seed = seed

    def sample(self, logits: torch.Tensor, position: int) -> int:
        """logits: [V]. Greedy: argmax (first index on ties, as torch/HF). Else a seeded draw."""
        if self.params.greedy:
            return int(torch.argmax(logits))
        probs = probabilities(logits, self.params)
        generator = torch.Generator().manual_seed(position_seed(self.seed, position))
        return int(torch.multinomial(probs, 1, generator=generator))
