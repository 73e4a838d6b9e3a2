"""Draft heads inside plain runs: where the verifier serves heads, a round of a plain run may
verify the heads' tree below each request's next token instead of one plain row, drafted from
the hidden state the round before computed (Medusa's loop, without a round trip to the router).
Whether it pays is measured: a tree is taken when its expected tokens raise the round's tokens
a second, priced by the rounds' seconds by rows (`LookupGate.round_seconds`) and the heads'
measured tokens a round. On a GPU a tree of 17 rows costs ~1.3x one row; on two CPU cores the
gate keeps the rounds plain but for a probe.
"""
from __future__ import annotations

from specmesh_services.verifier.lookup import LookupGate


class HeadsGate:
    """Whether a request's round verifies the heads' tree of `nodes` nodes, and the tokens it
    is expected to add; a moving mean of the heads' accepted tokens a round, from an optimistic
    `prior`, and one tree every `probe_every` refusals from the first on (so a tree's rows
    get measured at once: unmeasured, the rounds' model prices a row at 0.3 of a step)."""

    def __init__(self, rounds: LookupGate, nodes: int, prior: float = 1.0, decay: float = 0.9,
                 probe_every: int = 16) -> None:
        self.rounds = rounds
        self.nodes = nodes
        self.gain = prior
        self.decay = decay
        self.probe_every = probe_every
        self.refused = 0

    def take(self, rows: int, tokens: float) -> float:
        """The tokens the tree is expected to add to a round of `rows` rows expected to give
        `tokens`, 0.0 where the round is faster a token without it."""
        if not self.nodes:
            return 0.0
        seconds = self.rounds.round_seconds
        if (tokens + self.gain) / seconds(rows + self.nodes) > tokens / seconds(rows):
            return self.gain
        self.refused += 1
        return self.gain if self.refused % self.probe_every == 1 else 0.0

    def observe(self, accepted: int) -> None:
        """A verified heads tree whose walk kept `accepted` of its tokens."""
        self.gain = self.decay * self.gain + (1 - self.decay) * accepted
