"""The options of `headlab train` and of every model trained here (`train=<option>`), read by loop.py."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from ..config_rules import BETA, COUNT, NATURAL, NON_NEGATIVE, POSITIVE, SHARE, setting


class LossPositions(str, Enum):
    all = "all"  # every next token
    decision = "decision"  # only the tokens the task is decided at (Task.decision_targets)


@dataclass
class TrainConfig:
    steps: int = setting(2000, COUNT)
    batch_size: int = setting(128, COUNT)
    lr: float = setting(3e-3, POSITIVE)
    min_lr_frac: float = setting(0.05, SHARE)
    warmup_steps: int = setting(100, NATURAL)
    weight_decay: float = setting(0.01, NON_NEGATIVE)
    beta1: float = setting(0.9, BETA)
    beta2: float = setting(0.98, BETA)
    grad_clip: float = setting(1.0, NON_NEGATIVE)  # 0: no clipping
    eval_every: int = setting(250, COUNT)
    eval_prompts: int = setting(512, COUNT)
    checkpoint_every: int = setting(500, COUNT)
    target: str | None = None  # metric name for early stop, e.g. label_acc
    target_value: float = 1.0
    # Token embeddings drawn with this std instead of the model's own init, and frozen: all tokens then
    # stay alike, so what a model learns on some names carries over to names it never saw.
    embedding_std: float | None = setting(None, POSITIVE)
    freeze_embeddings: bool = False
    # decision: loss only where the task is decided; next-token loss everywhere also rewards modelling the
    # task's random strings, an objective that can shape the heads in ways the task does not ask for
    loss_positions: LossPositions = LossPositions.all


def options() -> list[tuple[str, str, type]]:
    return [("train", "train", TrainConfig)]
