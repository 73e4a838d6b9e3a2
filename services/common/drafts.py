"""Which drafters a mesh runs, from the configured draft specs (`Settings.drafters`, else the
model's default draft). A heads spec ("heads", "heads:PATH") names the draft heads, which the
verifier serves (they read the target's own hidden states); the drafter service serves every
other spec (draft models)."""
from __future__ import annotations

from pathlib import Path

from specmesh_services.common import models

HEADS = "heads"  # the drafter name of the verifier's heads


def is_heads_spec(spec: str) -> bool:
    return spec == HEADS or spec.startswith(HEADS + ":")


def heads_path(spec: str) -> Path | None:
    """The folder a heads spec names (None: the model's own heads)."""
    _, _, path = spec.partition(":")
    return Path(path).expanduser() if path else None


def draft_specs(settings) -> list[str]:
    """The configured draft specs, or the model's default draft (layers:8 for a model the
    registry does not know)."""
    if settings.drafters:
        return list(settings.drafters)
    source = models.REGISTRY.get(settings.model)
    return [source.default_draft if source else "layers:8"]


def model_specs(settings) -> list[str]:
    """The draft models the drafter service serves: every draft spec but the heads."""
    return [s for s in draft_specs(settings) if not is_heads_spec(s)]


def heads_spec(settings) -> str | None:
    """The heads spec among the draft specs (at most one), or None."""
    found = [s for s in draft_specs(settings) if is_heads_spec(s)]
    if len(found) > 1:
        raise ValueError(f"at most one heads draft spec, got {', '.join(found)}")
    return found[0] if found else None


def serves_drafter(settings) -> bool:
    """Whether the mesh runs the drafter service: the source uses draft models and a draft
    spec other than the heads is in effect."""
    return settings.speculation.source != "datastore" and bool(model_specs(settings))


def serves_heads(settings) -> bool:
    """Whether the verifier drafts with heads: a heads spec, speculation on, a source that
    uses the drafters."""
    return (settings.speculation.source != "datastore" and settings.speculation.depth > 0
            and heads_spec(settings) is not None)


def router_drafters(settings, model_names: list[str] | None
                    ) -> tuple[str, list[str] | None]:
    """(the drafter a fixed selection drafts with, every drafter name) as the router takes
    them: the first draft spec drafts alone ("" = the drafter service's first model);
    `model_names` are the drafter service's models (None: not asked), the heads added."""
    specs = draft_specs(settings)
    spec = heads_spec(settings)
    first = HEADS if is_heads_spec(specs[0]) else ""
    if spec is None:
        return first, model_names
    if model_names is None:
        model_names = [""] if len(specs) > 1 else []
    return first, [*model_names, HEADS]
