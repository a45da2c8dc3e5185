"""The SAE architectures by name (`sae=<name>`): each is a SparseAutoencoder subclass with its options
dataclass. A module of this package that declares its class as `SAE` is a built-in architecture, found by
its module alone (discovery.declared); one from outside the package enters by register_sae_class, as
SAELens's register_sae_class does. The door hands each options class to Hydra as `sae/base_<name>`."""

from __future__ import annotations

from functools import cache

from ..config import option
from ..discovery import declared
from ..errors import UsageError
from .base import SaeConfig, SparseAutoencoder

ARCHITECTURES: dict[str, type[SparseAutoencoder]] = {}  # architectures from outside the package


@cache
def builtin() -> dict[str, type[SparseAutoencoder]]:
    """The architectures defined in this package's modules, imported on first use."""
    return {cls.architecture: cls for cls in declared(__package__, "SAE")}


def architectures() -> dict[str, type[SparseAutoencoder]]:
    """Architecture name -> its class, which builds from its `options` dataclass."""
    return {**builtin(), **ARCHITECTURES}


def register_sae_class(name: str, cls: type[SparseAutoencoder], options: type[SaeConfig]) -> None:
    """Add an architecture: `sae=<name>` then builds `cls` from `options` (its YAML: configs/sae/<name>.yaml)."""
    if cls.architecture != name or cls.options is not options:
        raise UsageError(f"SAE {name}: its class must name it (architecture) and its options ({options.__name__})")
    if name in builtin():
        raise UsageError(f"SAE architecture {name} is built in; choose another name")
    ARCHITECTURES[name] = cls


def options() -> list[tuple[str, str, type]]:
    return [("sae", name, cls.options) for name, cls in architectures().items()]


def build_sae(sc: SaeConfig, d_in: int, seed: int = 0) -> SparseAutoencoder:
    """A fresh SAE of the architecture `sc` names, from its options."""
    arch, known = option(sc.architecture), architectures()
    if arch not in known:
        raise UsageError(f"unknown SAE architecture '{arch}'; choose from: {', '.join(known)}")
    return known[arch].build(d_in, sc, seed)
