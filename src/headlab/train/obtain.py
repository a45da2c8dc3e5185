"""The model a config names, ready to run: loaded from a path or hub, or trained here first (or reused).

Toy models (model.kind=toy) and GPT-2-style models on a real tokenizer (model.kind=hf without a path)
are trained on the configured task into a checkpoint directory named by everything that shapes the
weights; a finished directory is reused, an unfinished one resumed.
"""

from __future__ import annotations

from pathlib import Path

from .. import models
from ..config import Config, cache_key, option, to_plain
from ..errors import HeadlabError
from ..models.hooked import HookedModel, torch_dtype
from ..tasks import Task

CHECKPOINT_KEYS = ("model", "task", "train", "seed")
# evaluation sizes do not change a trained model
EVALUATION_KEYS = ("n_prompts", "n_reference")


def checkpoint_dir(cfg: Config) -> Path:
    """Where the model for this (model, task, train, seed) lives under output.root."""
    plain = to_plain(cfg)
    plain["task"] = {k: v for k, v in plain["task"].items() if k not in EVALUATION_KEYS}
    # weights are trained in float32, whatever dtype and devices they later run in
    plain["model"] = {k: v for k, v in plain["model"].items() if k != "device_map"} | {"dtype": "float32"}
    digest = cache_key({k: plain[k] for k in CHECKPOINT_KEYS})
    return Path(cfg.output.root) / "checkpoints" / f"{cfg.model.name}-{cfg.task.name}-seed{cfg.seed}-{digest}"


def is_trained_here(cfg: Config) -> bool:
    """A toy model, or an hf model without a path or a GGUF file: its weights come from training on the task."""
    return option(cfg.model.kind) in ("toy", "hf") and not cfg.model.path and not cfg.model.gguf_file


def obtain_model(cfg: Config, task: Task, show_progress: bool = True) -> HookedModel:
    """The configured model; one trained here is trained now, resumed, or reused if finished."""
    from . import load_or_train, train_toy

    kind = option(cfg.model.kind)
    if kind == "toy":  # trained and stored in float32, run in model.dtype
        dtype = torch_dtype(cfg.model.dtype)
        if cfg.model.path:
            model = models.load(cfg.model)
        else:
            model = load_or_train(cfg.model, task, cfg.train, cfg.seed, checkpoint_dir(cfg), show_progress)
        model.module.to(dtype)
        return model
    if kind == "hf" and is_trained_here(cfg):
        if not cfg.model.tokenizer:
            raise HeadlabError(
                f"model {cfg.model.name} is trained here (kind hf, no path) and needs model.tokenizer=<name or dir>"
            )
        from ..models.hf import load_hf

        directory = checkpoint_dir(cfg)
        train_toy(cfg.model, task, cfg.train, cfg.seed, directory, show_progress)  # returns at once when finished
        return load_hf(str(directory), name=cfg.model.name, dtype=cfg.model.dtype)
    return models.load(cfg.model, need_tokenizer=getattr(task, "needs_tokenizer", False))
