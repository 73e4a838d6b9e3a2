"""The router's arms: the ways a step's tree can be drafted, described once from the settings.

An arm is the configured sources (`speculation.source`, merged or voted: "configured"), the
lookup datastore ("datastore"), one draft model (by name), or the majority vote of every
source ("vote"). What each one means (which models draft, whether the datastore is asked,
whether the paths are voted, how large a tree it may ask for, what its drafting costs before
it was timed) is fixed when the router starts; the loop, the tree-size policy and the selection
read it from here instead of re-deriving it from the arm's name.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from specmesh_services.common.config import SpeculationSettings
from specmesh_services.common.drafts import HEADS

FIXED_ARM = "configured"  # no selection: the sources `speculation.source` names, merged
DATASTORE_ARM = "datastore"
VOTE_ARM = "vote"  # every source drafts, the majority-voted path is verified
DATASTORE_CAPACITY = 1024  # requests one lookup call serves (the service's batch limit)


@dataclass(frozen=True)
class DraftArm:
    """One way to draft a step's tree."""

    name: str
    models: tuple[str, ...] = ()  # model drafters it drafts with ("" = the drafter's default)
    datastore: bool = False  # it asks the lookup datastore for a tree
    votes: bool = False  # its sources' paths are majority-voted (else their trees are merged)
    max_nodes: int = 0  # the largest tree a step can ask for (0: speculation off)
    depth: int = 0  # the configured tree depth
    level_seconds: float = 0.0  # one tree level of all its models (0: unknown or no model)
    # prefilling a request on its models, per context token: the cost of moving a request here
    # (SPIN's switching cost; 0: unknown, or nothing to prefill: the datastore, the heads)
    prefill_token_seconds: float = 0.0
    capacity: int = 0  # requests it drafts for at once (the selection's capacity)
    # its tree is one draft model's chain under a confidence stop, which sizes itself
    self_sized: bool = False

    @property
    def one_model(self) -> str | None:
        """The draft model it drafts with alone (no datastore, no vote, not the heads), whose
        next tree can be drafted ahead (pre-speculation); None otherwise."""
        if len(self.models) == 1 and not (self.datastore or self.votes or self.heads):
            return self.models[0]
        return None

    @property
    def heads(self) -> bool:
        """Whether the verifier's heads draft for it (they draft with each result)."""
        return HEADS in self.models

    @property
    def draft_prior(self) -> Callable[[int], float] | None:
        """Drafting seconds for a budget of n nodes before any was timed: one forward per tree
        level (depth min(n, depth)) of each of its models, at the drafters' own measurement.
        None where a model's cost is unknown or the arm has no model: the datastore's lookups
        are cheap and timed at the first one."""
        if not self.level_seconds:
            return None
        level, depth = self.level_seconds, self.depth
        return lambda n: min(n, depth) * level


@dataclass(frozen=True)
class ArmSet:
    """Every arm of a router: the configured one, those a selection chooses from."""

    configured: DraftArm
    selectable: tuple[DraftArm, ...]  # cheapest first: the datastore, the models, the vote
    voters: tuple[str, ...]  # the sources a majority vote weighs (empty: no voting)
    heads: bool  # the verifier's draft heads are one of the drafters

    def get(self, name: str | None) -> DraftArm | None:
        """The arm of that name; None for None (no arm: the step decodes plainly)."""
        if name is None:
            return None
        if name == self.configured.name:
            return self.configured
        return next((arm for arm in self.selectable if arm.name == name), None)

    @classmethod
    def build(cls, spec: SpeculationSettings, drafter_name: str, drafter_names: Sequence[str],
              drafter_costs: Mapping[str, float],
              drafter_prefill: Mapping[str, float] | None = None) -> "ArmSet":
        """`drafter_name`: the model a fixed selection drafts with; `drafter_names`: every
        model drafter; `drafter_costs`: seconds of one drafting forward per model name;
        `drafter_prefill`: seconds per context token of a prefill per model name."""
        drafts, lookup = spec.source != "datastore", spec.source != "model"
        models = tuple(drafter_names) if drafts else ()
        voting = spec.voting and spec.depth > 0
        make = _ArmMaker(spec, drafter_costs, drafter_prefill or {})
        configured = make(FIXED_ARM, (models if voting else (drafter_name,)) if drafts else (),
                          datastore=lookup, votes=voting, model_only=spec.source == "model")
        selectable = [make(DATASTORE_ARM, (), datastore=True, capacity=DATASTORE_CAPACITY)
                      ] if lookup else []
        selectable += [make(name, (name,), capacity=spec.drafter_capacity, model_only=True)
                       for name in models]
        if spec.voting:  # voting is one more arm: the bandit learns if it pays
            selectable.append(make(VOTE_ARM, models, datastore=lookup, votes=True,
                                   capacity=spec.drafter_capacity))
        voters = (*models, *((DATASTORE_ARM,) if lookup else ())) if voting else ()
        return cls(configured, tuple(selectable), voters, heads=HEADS in models)


class _ArmMaker:
    """Derives an arm's tree limit, drafting cost and self-sizing from the settings."""

    def __init__(self, spec: SpeculationSettings, costs: Mapping[str, float],
                 prefill: Mapping[str, float]) -> None:
        self.spec = spec
        self.costs = costs
        self.prefill = prefill
        self.default = next(iter(costs), "")  # the drafter's first model

    def __call__(self, name: str, models: tuple[str, ...], datastore: bool = False,
                 votes: bool = False, capacity: int = 0, model_only: bool = False) -> DraftArm:
        """`model_only`: its tree is a draft model's, depth x width (else the node budget of
        a lookup, merged or voted tree; the heads' trees are as wide as the node budget)."""
        spec = self.spec
        if HEADS in models:
            model_only = False
        max_nodes = 0 if spec.depth == 0 else (spec.depth * spec.width if model_only
                                               else spec.max_nodes)
        costs = [self.costs.get(model or self.default, 0.0) for model in models]
        level = sum(costs) if costs and all(cost > 0 for cost in costs) else 0.0
        prefill = sum(self.prefill.get(model or self.default, 0.0) for model in models
                      if model != HEADS)
        self_sized = (spec.width == 1 and spec.min_probability > 0 and len(models) == 1
                      and models != (HEADS,) and not datastore and not votes)
        return DraftArm(name, models, datastore, votes, max_nodes, spec.depth, level, prefill,
                        capacity, self_sized)
