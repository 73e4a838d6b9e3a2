"""Sampling parameters and the per-position sampler applied to the target's logits.

Processing order as HF `generate`: penalties (repetition over prompt + generated tokens, then
presence / frequency over generated tokens), temperature, top-k, top-p; argmax at temperature 0.
Randomness is counter-based: the draw for output position p is the Gumbel-max (exponential
race) of the processed distribution under random numbers seeded with (request seed, p)
(`race_weights`), so a seed gives the same tokens whatever the tree, drafter or verifier
replica, and positions draw independently, as the lossless walk needs. A drafter racing its own
distribution with the same numbers (`coupled_scores`) drafts the target's token whenever the
races agree (docs/decisions/coupled-drafting.md).
"""
from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from specmesh.v1 import common_pb2


def require_finite(name: str, value: float) -> None:
    """Raises ValueError naming the field when `value` is NaN or infinite. A range check alone
    does not do: every comparison with NaN is false, so `if x < 0: raise` lets it through."""
    if not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value}")


# the float fields of common.proto's SamplingParams
FLOAT_FIELDS = ("temperature", "top_p", "repetition_penalty", "presence_penalty",
                "frequency_penalty")


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy (argmax)
    top_p: float = 1.0  # nucleus mass in (0, 1]
    top_k: int = 0  # 0 = off
    seed: int | None = None
    repetition_penalty: float = 1.0  # HF semantics over prompt + generated; 1 = off, > 0
    presence_penalty: float = 0.0  # OpenAI semantics over generated tokens; 0 = off, [-2, 2]
    frequency_penalty: float = 0.0  # OpenAI semantics over generated tokens; 0 = off, [-2, 2]

    def validate(self) -> None:
        """Raises ValueError with a message that names the field and says what to fix."""
        for name in FLOAT_FIELDS:
            require_finite(name, getattr(self, name))
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1] (1 = off), got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if self.seed is not None and not 0 <= self.seed < 2**64:
            raise ValueError(f"seed must be in [0, 2**64), got {self.seed}")
        if not self.repetition_penalty > 0:
            raise ValueError(f"repetition_penalty must be a finite number > 0 (1 = off, > 1 "
                             f"discourages repeats, e.g. 1.1-1.3), got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2 <= value <= 2:
                raise ValueError(f"{name} must be in [-2, 2] (0 = off, > 0 discourages repeats), "
                                 f"got {value}")

    @property
    def penalized(self) -> bool:
        """Whether any penalty is on (then sampling needs the token history)."""
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1

    @classmethod
    def from_pb(cls, pb: common_pb2.SamplingParams) -> "SamplingParams":
        def opt(name: str, default):
            return getattr(pb, name) if pb.HasField(name) else default
        return cls(temperature=pb.temperature, top_p=opt("top_p", 1.0), top_k=pb.top_k,
                   seed=opt("seed", None), repetition_penalty=opt("repetition_penalty", 1.0),
                   presence_penalty=opt("presence_penalty", 0.0),
                   frequency_penalty=opt("frequency_penalty", 0.0))

    def to_pb(self) -> common_pb2.SamplingParams:
        """Penalties that are off stay unset on the wire."""
        pb = common_pb2.SamplingParams(temperature=self.temperature, top_p=self.top_p,
                                       top_k=self.top_k)
        if self.seed is not None:
            pb.seed = self.seed
        if self.repetition_penalty != 1.0:
            pb.repetition_penalty = self.repetition_penalty
        if self.presence_penalty != 0.0:
            pb.presence_penalty = self.presence_penalty
        if self.frequency_penalty != 0.0:
            pb.frequency_penalty = self.frequency_penalty
        return pb


def apply_penalties(logits: torch.Tensor, history: torch.Tensor | Sequence[int], prompt_len: int,
                    params: SamplingParams) -> torch.Tensor:
    """Penalized copy (float32) of one logits row [V], given every token before the sampled
    position (`history`: prompt + generated, the first `prompt_len` being the prompt).

    - repetition_penalty p (HF `RepetitionPenaltyLogitsProcessor`): for each distinct token of
      the whole history, logit / p if logit >= 0 else logit * p;
    - presence / frequency (OpenAI, vLLM): over the generated tokens only, with c = occurrences,
      logit -= presence * [c > 0] + frequency * c.
    The input row is not modified.
    """
    out = logits.float().clone()
    history = torch.as_tensor(history, dtype=torch.long)
    p = params.repetition_penalty
    if p != 1.0 and history.numel():
        ids = torch.unique(history)
        seen = out[ids]
        out[ids] = torch.where(seen < 0, seen * p, seen / p)
    if params.presence_penalty != 0.0 or params.frequency_penalty != 0.0:
        generated = history[prompt_len:]
        if generated.numel():
            ids, counts = torch.unique(generated, return_counts=True)
            out[ids] -= params.presence_penalty + params.frequency_penalty * counts.float()
    return out


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


def race_weights(seed: int, position: int, width: int) -> torch.Tensor:
    """The Exp(1) variates E [width] (float32, CPU) of the draw at `position`: token i's weight
    in the race argmax_i probs_i / E_i. `width` is the target's logits width, so the verifier
    and a drafter (whatever its own vocabulary) draw the same E for the same token id."""
    generator = torch.Generator().manual_seed(position_seed(seed, position))
    return -torch.log(torch.rand(width, generator=generator))


def coupled_scores(probs: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """log(probs / E): the race's scores (their argmax is the draw; their top-k, k draws
    without replacement), -inf where probs is 0."""
    return torch.log(probs) - torch.log(weights.to(probs.device))


def greedy_token(logits: torch.Tensor) -> int:
    """argmax of one row (the first index on ties, as torch's). A float32 row on the CPU goes
    through numpy: torch's argmax wakes its thread pool, 0.2-0.9 ms right after a llama.cpp
    decode on 2 cores against numpy's 0.02 ms."""
    if logits.dtype == torch.float32 and logits.device.type == "cpu":
        return int(logits.detach().numpy().argmax())
    return int(torch.argmax(logits))


class Sampler:
    """Draws one token from a logits row for a given output position of one request.

    prompt_len: tokens of the request's prompt (presence / frequency penalties count only the
    tokens after it)."""

    def __init__(self, params: SamplingParams, seed: int, prompt_len: int = 0):
        self.params = params
        self.seed = seed
        self.prompt_len = prompt_len

    @property
    def needs_history(self) -> bool:
        """Whether `sample` reads `history` (some penalty is on); otherwise it may be None."""
        return self.params.penalized

    def sample(self, logits: torch.Tensor | np.ndarray, position: int,
               history: torch.Tensor | Sequence[int] | None = None) -> int:
        """logits: [V], the target's logits for sequence index `position` (a float32 numpy
        row too: greedy without penalties never makes it a tensor, ~0.1 ms a token right after
        a llama.cpp decode); history: ALL tokens before it (prompt + generated + the tree path
        above the sampled node), so len(history) == position. Penalties, then greedy: argmax
        (first index on ties, as torch/HF), else a seeded draw."""
        if isinstance(logits, np.ndarray):
            if self.params.greedy and not self.params.penalized:
                return int(logits.argmax())
            logits = torch.from_numpy(logits)
        if self.params.penalized:
            if history is None or len(history) != position:
                raise ValueError(f"penalties need the {position} tokens before position "
                                 f"{position}, got {'none' if history is None else len(history)}")
            logits = apply_penalties(logits, history, self.prompt_len, self.params)
        if self.params.greedy:
            return greedy_token(logits)
        probs = probabilities(logits, self.params)
        return int(torch.argmax(coupled_scores(probs, race_weights(self.seed, position,
                                                                   probs.shape[-1]))))
