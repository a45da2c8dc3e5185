"""Loading a model from its config: by hub name or local path (HF), or from a toy checkpoint directory."""

from __future__ import annotations

from pathlib import Path
from typing import cast

from ..config import ModelConfig, option
from ..errors import HeadlabError
from .hooked import HookedModel


def load(cfg: ModelConfig, need_tokenizer: bool = False) -> HookedModel:
    """A model from its config: HF by hub name or local path, or a trained toy checkpoint directory."""
    kind = option(cfg.kind)
    if kind == "hf":
        from .hf import load_hf

        # no runtime check here, as before: obtain_model sends an hf model without a path to training
        return load_hf(
            cast(str, cfg.path),
            name=cfg.name,
            tokenizer=cfg.tokenizer,
            revision=cfg.revision,
            trust_remote_code=cfg.trust_remote_code,
            dtype=cfg.dtype,
            need_tokenizer=need_tokenizer,
            device_map=cfg.device_map,
        )
    if kind == "toy":
        from .toy import hooked_toy, load_toy

        if not cfg.path:
            raise HeadlabError("a toy model needs a checkpoint directory (model.path) or training first")
        model, _ = load_toy(Path(cfg.path))
        return hooked_toy(model, cfg.name)
    raise HeadlabError(f"model kind '{kind}' is not available yet")
