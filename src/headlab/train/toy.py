"""Toy models (model.kind=toy): headlab's ToyTransformer on a task's own small vocabulary."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import cast

import torch
from torch import Tensor, nn

from ..config import option
from ..errors import HeadlabError
from ..io import held_exclusively
from ..models.hooked import HookedModel
from ..models.loading import ModelConfig
from ..models.toy import ToyConfig, ToyTransformer, hooked_toy, load_toy, save_toy
from ..tasks import Task
from .hf import train_hf
from .loop import adamw, fit_loop
from .options import TrainConfig

log = logging.getLogger("headlab")


def toy_config(model_cfg: ModelConfig, task: Task) -> ToyConfig:
    if task.vocab_size == 0:
        raise HeadlabError(f"task {task.name} has no vocabulary of its own to train a toy model on")
    if task.max_len > model_cfg.n_ctx:
        raise HeadlabError(f"task {task.name} needs n_ctx >= {task.max_len}, model has {model_cfg.n_ctx}")
    return ToyConfig(
        vocab_size=task.vocab_size,
        n_ctx=model_cfg.n_ctx,
        n_layers=model_cfg.n_layers,
        n_heads=model_cfg.n_heads,
        d_model=model_cfg.d_model,
        d_head=model_cfg.d_head,
        d_mlp=model_cfg.d_mlp,
        pos_emb=option(model_cfg.pos_emb),
        layer_norm=model_cfg.layer_norm,
    )


def evaluate(model: ToyTransformer, task: Task, data) -> dict[str, float]:
    was_training = model.training
    model.eval()
    with torch.inference_mode():
        logits = model(data.inputs["input_ids"])
    model.train(was_training)
    return task.evaluate_logits(logits, data)


def train_toy(
    model_cfg: ModelConfig,
    task: Task,
    tc: TrainConfig,
    seed: int,
    directory: Path,
    show_progress: bool = True,
    meta: dict | None = None,
) -> tuple[nn.Module, list[dict]]:
    """Train (or resume, or reuse) the model in `directory`; returns it and its training curve.

    model.kind=hf hands over to train_hf (a GPT2LMHeadModel); every other kind trains a ToyTransformer.
    One process at a time trains a directory: others wait for it, then reuse what it wrote.
    """
    with held_exclusively(directory):
        if option(model_cfg.kind) == "hf":
            return train_hf(model_cfg, task, tc, seed, directory, show_progress, meta)
        return _train_toy_transformer(model_cfg, task, tc, seed, Path(directory), show_progress, meta)


def _train_toy_transformer(
    model_cfg: ModelConfig,
    task: Task,
    tc: TrainConfig,
    seed: int,
    directory: Path,
    show_progress: bool,
    meta: dict | None,
) -> tuple[nn.Module, list[dict]]:
    if (directory / "config.json").is_file():
        model, saved = load_toy(directory)
        if saved.get("complete"):
            log.info("reused the trained model in %s", directory)
            return model, saved.get("curve", [])
    torch.manual_seed(seed)
    model = ToyTransformer(toy_config(model_cfg, task))
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = adamw(decay, no_decay, tc)

    def loss_fn(inputs: Tensor, targets: Tensor) -> Tensor:
        logits = model(inputs)
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100)

    step, curve, seconds, final = fit_loop(
        f"train {model_cfg.name}", model, opt, task, tc, seed, directory, loss_fn, evaluate, show_progress
    )
    save_toy(
        model,
        directory,
        {
            "complete": True,
            "steps": step,
            "seed": seed,
            "metrics": final,
            "curve": curve,
            "train_seconds": seconds,
            **(meta or {}),
        },
    )
    return model, curve


def load_or_train(
    model_cfg: ModelConfig, task: Task, tc: TrainConfig, seed: int, directory: Path, show_progress: bool = True
) -> HookedModel:
    model, _ = train_toy(model_cfg, task, tc, seed, directory, show_progress)
    return hooked_toy(cast(ToyTransformer, model), model_cfg.name)
