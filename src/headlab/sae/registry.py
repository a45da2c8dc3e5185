"""The SAE architectures by name (`sae=<name>`): each is a SparseAutoencoder subclass with its options
dataclass, registered together, as SAELens's register_sae_class does; the door hands each options class to
Hydra as `sae/base_<name>`."""

from __future__ import annotations

from ..config import option
from ..errors import UsageError
from .base import SaeConfig, SparseAutoencoder
from .relu_l1 import ReluL1SAE
from .topk import TopKSAE

ARCHITECTURES: dict[str, type[SparseAutoencoder]] = {}


def register_sae_class(name: str, cls: type[SparseAutoencoder], options: type[SaeConfig]) -> None:
    """Add an architecture: `sae=<name>` then builds `cls` from `options` (its YAML: configs/sae/<name>.yaml)."""
    if cls.architecture != name or cls.options is not options:
        raise UsageError(f"SAE {name}: its class must name it (architecture) and its options ({options.__name__})")
    ARCHITECTURES[name] = cls


register_sae_class("relu_l1", ReluL1SAE, ReluL1SAE.options)
register_sae_class("topk", TopKSAE, TopKSAE.options)


def options() -> list[tuple[str, str, type]]:
    return [("sae", name, cls.options) for name, cls in ARCHITECTURES.items()]


def build_sae(sc: SaeConfig, d_in: int, seed: int = 0) -> SparseAutoencoder:
    """A fresh SAE of the architecture `sc` names, from its options."""
    arch = option(sc.architecture)
    if arch not in ARCHITECTURES:
        raise UsageError(f"unknown SAE architecture '{arch}'; choose from: {', '.join(ARCHITECTURES)}")
    return ARCHITECTURES[arch].build(d_in, sc, seed)
