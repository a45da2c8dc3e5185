"""Loading a model from its config: by hub name, local path or GGUF file (HF), or from a toy checkpoint
directory."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import cast

from ..config import ModelConfig, option
from ..errors import HeadlabError
from .hooked import HookedModel

log = logging.getLogger("headlab")


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

            directory, weights = gguf.converted(gguf.locate(cfg.gguf_file, cfg.path, cfg.package))
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
