"""Intervention specs and the plan that a config expands to."""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Optional

SOURCES = {"zero": "zero", "mean": "mean", "resample": "reference", "activation": "counterfactual"}


@dataclass(frozen=True)
class Intervention:
    intervention: str  # none | ablate_head | ablate_layer | patch_head
    method: str = "none"  # none | zero | mean | resample | activation
    layer: Optional[int] = None
    head: Optional[int] = None  # None with a layer: every head of that layer
    position: Optional[int] = None  # None: every position

    @property
    def source(self) -> str:
        """Where the replacement z comes from: zero | mean | reference | counterfactual."""
        return SOURCES[self.method]

    def row(self) -> dict[str, Any]:
        return asdict(self)


CLEAN = Intervention("none")


def plan(cfg: Any, n_layers: int, n_heads: int) -> list[Intervention]:
    """The clean baseline first, then the ablation sweep, then the patching sweep."""
    out = [CLEAN]
    sweep = str(getattr(cfg.ablate.sweep, "value", cfg.ablate.sweep))
    method = str(getattr(cfg.ablate.method, "value", cfg.ablate.method))
    if sweep == "heads":
        out += [Intervention("ablate_head", method, l, h) for l in range(n_layers) for h in range(n_heads)]
    elif sweep == "layers":
        out += [Intervention("ablate_layer", method, l) for l in range(n_layers)]
    patch = str(getattr(cfg.patch.kind, "value", cfg.patch.kind))
    if patch == "activation":
        out += [Intervention("patch_head", "activation", l, h) for l in range(n_layers) for h in range(n_heads)]
    return out
