"""Plain result types of the SDK, built from the gateway's protobuf messages."""
from __future__ import annotations

from dataclasses import dataclass

from specmesh.v1 import common_pb2

_FINISH = {
    common_pb2.FINISH_REASON_UNSPECIFIED: None,
    common_pb2.FINISH_REASON_STOP: "stop",
    common_pb2.FINISH_REASON_LENGTH: "length",
}


def finish_reason_name(value: int) -> str | None:
    """"stop" (end of sequence or stop sequence), "length" (max_tokens or context) or None."""
    return _FINISH[value]


@dataclass(frozen=True)
class Decision:
    """What the router decided for one step, and what came of it."""

    step: int
    arm: str  # the source chosen: a draft model, "datastore", "vote", "configured"; "" = prefill
    budget: int  # nodes asked of the sources (0 = speculation off)
    tree_size: int  # nodes verified
    expected_length: float  # tokens the router expected (bonus counted)
    emitted: int  # tokens the step emitted (accepted + bonus)
    seconds: float
    drafters: tuple[str, ...]  # sources whose nodes were in the tree
    probe: bool  # a measurement step away from the chosen size

    @classmethod
    def from_pb(cls, pb: common_pb2.StepDecision) -> "Decision":
        return cls(pb.step, pb.arm, pb.budget, pb.tree_size, pb.expected_length, pb.emitted,
                   pb.seconds, tuple(pb.drafters), pb.probe)


@dataclass(frozen=True)
class Stats:
    """Speculation statistics of one request."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    draft_tokens: int = 0  # tree nodes proposed to the verifier, summed over steps
    accepted_tokens: int = 0  # drafted tokens the target accepted (bonus tokens not counted)
    steps: int = 0  # verification steps (target forward passes)
    mean_accepted_length: float = 0.0  # tokens per step, bonus counted
    time_to_first_token_s: float = 0.0
    total_time_s: float = 0.0
    plain_steps: int = 0  # steps that verified no tree (adaptive sizing turned speculation off)
    mean_expected_length: float = 0.0  # the router's expectation, to compare with the above
    decisions: tuple[Decision, ...] = ()  # every step; in the final chunk / response only

    @classmethod
    def from_pb(cls, pb: common_pb2.GenerationStats) -> "Stats":
        fields = {name: getattr(pb, name) for name in cls.__dataclass_fields__
                  if name != "decisions"}
        return cls(**fields, decisions=tuple(Decision.from_pb(d) for d in pb.decisions))


@dataclass(frozen=True)
class Generation:
    """A finished generation."""

    text: str
    token_ids: list[int]
    finish_reason: str | None
    stats: Stats
    model: str
    request_id: str


@dataclass(frozen=True)
class Chunk:
    """A piece of a streamed generation; the last one has `finish_reason` set."""

    text: str
    token_ids: list[int]
    finish_reason: str | None
    stats: Stats
    request_id: str
