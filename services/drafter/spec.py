"""A draft spec parsed: `layers:N` or a model name / directory, optionally `@int8`, `@int4` or
`@auto` (docs/drafters.md, Draft specs). No torch at import: `specmesh up` parses the specs it
prepares before any model loads."""
from __future__ import annotations

from dataclasses import dataclass

WEIGHTS = ("int8", "int4", "auto")  # what may follow '@' in a spec


@dataclass(frozen=True)
class DraftSpec:
    """A parsed draft spec: `base` (layers:N or a model name/dir) and its weights."""

    base: str
    weights: str | None = None  # None: the configured dtype; "int8" | "int4" | "auto"
    layers: int | None = None  # layers:N

    @classmethod
    def parse(cls, spec: str) -> DraftSpec:
        base, at, weights = spec.rpartition("@")
        if not at:
            base, weights = spec, ""
        elif weights not in WEIGHTS and "/" in base:  # a Hub id's revision: owner/name@rev
            base, weights = spec, ""
        elif weights not in WEIGHTS:
            raise ValueError(f"bad draft spec '{spec}': after '@' expected one of "
                             f"{', '.join(WEIGHTS)}, got '{weights}'")
        if not base:
            raise ValueError(f"bad draft spec '{spec}': no model before '@'")
        layers = None
        if base.startswith("layers:"):
            try:
                layers = int(base.split(":", 1)[1])
            except ValueError:
                raise ValueError(f"bad draft spec '{spec}': expected layers:N with N an "
                                 f"integer") from None
        return cls(base, weights or None, layers)

    def quantized(self, device="cpu") -> str | None:
        """The draft's quantized weights on `device` (a torch.device or its name: "int8" /
        "int4"; `auto` resolved for this CPU), None for the configured dtype (`auto` on CUDA:
        the quantized kernels are CPU ones)."""
        kind = getattr(device, "type", None) or str(device).split(":", 1)[0]
        if kind != "cpu":
            if self.weights not in (None, "auto"):
                raise ValueError(f"draft weights @{self.weights} run on the CPU only, not on "
                                 f"{device}: use @auto or no suffix")
            return None
        if self.weights != "auto":
            return self.weights
        from specmesh_kernels.linear_rules import draft_weights  # probes torch's CPU kernels

        return draft_weights()
