"""Prompt lookup inside plain runs: while the verifier decodes a run of plain tokens, a request
whose last `n` tokens occurred before in its own prompt or output gets the tokens that followed
that occurrence (its latest) as a chain, verified in the run's next forward: llama.cpp's
`ngram-simple` speculation, without a round trip to the router. The walk keeps only what the
target itself produces (lossless as every tree); a miss costs a plain step.
"""
from __future__ import annotations

from collections.abc import Sequence


class NgramLookup:
    """The latest earlier occurrence of each `n`-gram of one request's tokens, indexed as the
    tokens grow (the list is only ever appended to)."""

    def __init__(self, n: int) -> None:
        if n < 1:
            raise ValueError("an n-gram has at least one token")
        self.n = n
        self.after: dict[tuple[int, ...], int] = {}  # n-gram -> where its latest continuation starts
        self.indexed = n  # n-grams whose continuation starts before this are in `after`

    def draft(self, tokens: Sequence[int], limit: int) -> list[int]:
        """Up to `limit` tokens that followed the latest earlier occurrence of the last n tokens
        ([] when they did not occur before)."""
        n, end = self.n, len(tokens)
        for start in range(self.indexed, end):  # every n-gram with at least one token after it
            self.after[tuple(tokens[start - n:start])] = start
        self.indexed = max(self.indexed, end)
        if limit <= 0 or end <= n:
            return []
        start = self.after.get(tuple(tokens[end - n:end]))
        return [] if start is None else list(tokens[start:start + limit])


class LookupGate:
    """How many of a lookup's tokens a round verifies (0: none): the length with the most
    expected tokens a second for the round, from the rounds' measured seconds by rows and the
    lookups' measured acceptance by depth. A row the rounds never had is priced optimistically
    (`explore` of a one-row round more than the largest measured), so each length gets tried;
    on a target whose extra rows cost nearly a whole step (the 1.5B on two cores) the gate
    then keeps its rounds plain, but for one token every `probe_every` lookups, so a cost or
    acceptance that changes (another batch size, more predictable text) is seen."""

    def __init__(self, max_tokens: int, decay: float = 0.9, explore: float = 0.3,
                 probe_every: int = 16) -> None:
        self.max_tokens = max_tokens
        self.probe_every = probe_every
        self.lookups = 0
        self.decay = decay
        self.explore = explore
        self.seconds: dict[int, float] = {}  # rows of a round -> its seconds (moving average)
        self.offered = [0] * (max_tokens + 1)  # depth j: chains that reached it (j - 1 kept)
        self.accepted = [0] * (max_tokens + 1)  # ... and kept its token

    def observe_round(self, rows: int, seconds: float) -> None:
        old = self.seconds.get(rows)
        self.seconds[rows] = seconds if old is None else self.decay * old + (1 - self.decay) * seconds

    def observe_chain(self, drafted: int, accepted: int) -> None:
        """A verified chain of `drafted` tokens whose first `accepted` were kept: depth j counts
        where the j - 1 above it were accepted (the acceptance given the path)."""
        for depth in range(1, min(drafted, accepted + 1, self.max_tokens) + 1):
            self.offered[depth] += 1
            self.accepted[depth] += depth <= accepted

    def round_seconds(self, rows: int) -> float:
        """A round of `rows` rows: measured, else between the measured ones, else above the
        largest by `explore` times the smallest round's seconds a row."""
        if not self.seconds:
            return 1.0 + self.explore * (rows - 1)
        if rows in self.seconds:
            return self.seconds[rows]
        below = max((r for r in self.seconds if r < rows), default=None)
        above = min((r for r in self.seconds if r > rows), default=None)
        if below is None:
            return self.seconds[above] * rows / above
        if above is not None:
            w = (rows - below) / (above - below)
            return (1 - w) * self.seconds[below] + w * self.seconds[above]
        smallest = min(self.seconds)
        return self.seconds[below] + self.explore * self.seconds[smallest] / smallest * (rows - below)

    def length(self, rows: int, tokens: float, available: int) -> tuple[int, float]:
        """(k, expected tokens of those k) for one request's lookup of `available` tokens in a
        round that holds `rows` rows expected to give `tokens` tokens so far."""
        best, best_gain, best_rate, gain, reach = 0, 0.0, tokens / self.round_seconds(rows), 0.0, 1.0
        first = 0.0
        for k in range(1, min(available, self.max_tokens) + 1):
            reach *= (self.accepted[k] + 1) / (self.offered[k] + 2)  # depth k accepted (Laplace)
            gain += reach
            first = first or gain
            rate = (tokens + gain) / self.round_seconds(rows + k)
            if rate > best_rate:
                best, best_gain, best_rate = k, gain, rate
        self.lookups += available > 0
        if best == 0 and available > 0 and self.lookups % self.probe_every == 0:
            return 1, first
        return best, best_gain
