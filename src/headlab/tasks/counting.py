"""Count01 (arXiv 2502.06923): does a string over {0, 1} (2 is noise) hold more 1s than 0s?

Sequence: BOS x_1 .. x_n SEP y EOS, with y the answer written as the symbol 0 or 1. The model is trained
on every next token, so at y it must predict EOS although y is the same token as the string's symbols:
only attention to SEP tells the two apart. That is the auxiliary syntactic task of the paper.
Metrics: label accuracy (at SEP, logit of 1 vs 0), ROC AUC of that logit difference, [EOS] accuracy
(argmax at y is EOS). Counterfactual: the same string with 0 and 1 swapped (same noise, answer flipped).
Roles (interventions can target them): SEP, where the label is decided, and Y, the answer token, where
[EOS] is decided; they are the two read positions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import pandas as pd
import torch
from torch import Tensor

from ..config_rules import COUNT, SHARE, Joint, setting
from .base import Task, TaskConfig, TaskData, mean_of

ZERO, ONE, NOISE, SEP, EOS, BOS, PAD = range(7)
TOKENS = ("0", "1", "2", "[SEP]", "[EOS]", "[BOS]", "[PAD]")


@dataclass
class CountingConfig(TaskConfig):
    name: str = "counting"
    min_len: int = setting(8, COUNT)
    max_len: int = setting(24, COUNT)
    p_noise: float = setting(0.25, SHARE)
    JOINT: ClassVar[tuple[Joint, ...]] = (("max_len", lambda c: c.max_len >= c.min_len, "at least task.min_len"),)


def roc_auc(scores: np.ndarray, labels: np.ndarray) -> np.ndarray:
    """ROC AUC along the last axis (Mann-Whitney U with mid-ranks for ties)."""
    labels = np.broadcast_to(labels, scores.shape).astype(bool)
    # pandas' mid-ranks (scipy.stats.rankdata's, whose import costs every run most of a second); a NaN score
    # leaves its whole row unranked, as scipy's does
    rows = scores.reshape(-1, scores.shape[-1])
    ranks = pd.DataFrame(rows).rank(axis=1, method="average").to_numpy(copy=True)
    ranks[np.isnan(rows).any(-1)] = np.nan
    ranks = ranks.reshape(scores.shape)
    n_pos = labels.sum(-1)
    n_neg = labels.shape[-1] - n_pos
    with np.errstate(invalid="ignore", divide="ignore"):
        return ((ranks * labels).sum(-1) - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg)


class CountingTask(Task):
    name = "counting"
    options = CountingConfig
    quantities = ("label_correct", "eos_correct", "label_margin", "signed_margin")
    vocab_size = len(TOKENS)
    token_names = {ZERO: "0", ONE: "1", NOISE: "2", SEP: "sep", BOS: "bos"}
    # attention_by_token ratios, per prompt: the weight on one 2 over the weight on one 1 (one 0), from SEP
    attention_ratios = {"noise_ratio": ("2", "1"), "noise_ratio_to_0": ("2", "0")}
    cfg: CountingConfig

    def __init__(self, cfg: CountingConfig):
        self.cfg = cfg
        self.max_len = cfg.max_len + 3
        self.aggregates = {
            "label_acc": mean_of(0),
            "roc_auc": lambda q, a: roc_auc(q[..., 2], a["label"]),
            "eos_acc": mean_of(1),
            "logit_diff": mean_of(3),
        }

    def sample(self, lengths: Tensor, gen: torch.Generator) -> tuple[Tensor, Tensor]:
        """Strings [n, max_len] (PAD beyond each length) with no ties, and their labels."""
        n, width = lengths.shape[0], self.cfg.max_len
        strings = torch.full((n, width), PAD)
        todo = torch.arange(n)
        while len(todo):
            u = torch.rand(len(todo), width, generator=gen)
            bits = torch.randint(0, 2, (len(todo), width), generator=gen)
            s = torch.where(u < self.cfg.p_noise, torch.full_like(bits, NOISE), bits)
            s[torch.arange(width) >= lengths[todo, None]] = PAD
            ones, zeros = (s == ONE).sum(1), (s == ZERO).sum(1)
            ok = ones != zeros
            strings[todo[ok]] = s[ok]
            todo = todo[~ok]
        labels = ((strings == ONE).sum(1) > (strings == ZERO).sum(1)).long()
        return strings, labels

    def assemble(self, strings: Tensor, labels: Tensor, lengths: Tensor) -> Tensor:
        """[BOS, string, SEP, y, EOS] right-padded: [n, max_len + 4]."""
        n = strings.shape[0]
        seq = torch.full((n, self.cfg.max_len + 4), PAD)
        seq[:, 0] = BOS
        seq[:, 1 : self.cfg.max_len + 1] = strings
        rows = torch.arange(n)
        seq[rows, lengths + 1] = SEP
        seq[rows, lengths + 2] = labels
        seq[rows, lengths + 3] = EOS
        return seq

    def lengths(self, n: int, gen: torch.Generator) -> Tensor:
        return torch.randint(self.cfg.min_len, self.cfg.max_len + 1, (n,), generator=gen)

    def train_batch(self, generator: torch.Generator, batch: int, step: int = 0) -> tuple[Tensor, Tensor]:
        lengths = self.lengths(batch, generator)
        seq = self.assemble(*self.sample(lengths, generator), lengths)
        inputs, targets = seq[:, :-1], seq[:, 1:].clone()
        targets[targets == PAD] = -100
        return inputs, targets

    def decision_targets(self, inputs: Tensor, targets: Tensor) -> Tensor:
        """Only y (predicted at SEP) and EOS (predicted at y) keep their targets: the string itself is
        random and predicting it is no part of the task."""
        after_sep = torch.zeros_like(inputs, dtype=torch.bool)
        after_sep[:, 1:] = inputs[:, :-1] == SEP
        return targets.masked_fill(~((inputs == SEP) | after_sep), -100)

    def build(self, n: int, seed: int, model=None) -> TaskData:
        gen = torch.Generator().manual_seed(seed)
        lengths = self.lengths(n, gen)
        strings, labels = self.sample(lengths, gen)
        flipped = torch.where(strings == ZERO, ONE, torch.where(strings == ONE, ZERO, strings))
        ref_strings, ref_labels = self.sample(lengths, gen)  # same lengths: positions line up
        prompt = lambda seq: seq[:, :-1].masked_fill(seq[:, :-1] == EOS, PAD)  # noqa: E731 (ends at y)
        clean = prompt(self.assemble(strings, labels, lengths))
        cf = prompt(self.assemble(flipped, 1 - labels, lengths))
        ref = prompt(self.assemble(ref_strings, ref_labels, lengths))
        positions = torch.stack([lengths + 1, lengths + 2], dim=1)  # SEP (label), y (EOS)
        return TaskData(
            inputs={"input_ids": clean},
            positions=positions,
            token_positions={"SEP": positions[:, 0], "Y": positions[:, 1]},
            answers={"label": labels},
            counterfactual={"input_ids": cf},
            reference={"input_ids": ref},
        )

    def per_prompt(self, logits: Tensor, data: TaskData) -> Tensor:
        label = data.answers["label"].to(logits.device)
        at_sep, at_y = logits[..., 0, :], logits[..., 1, :]
        margin = at_sep[..., ONE] - at_sep[..., ZERO]
        sign = label * 2 - 1
        label_correct = ((margin > 0).long() == label).float()
        eos_correct = (at_y.argmax(-1) == EOS).float()
        return torch.stack([label_correct, eos_correct, margin, margin * sign], dim=-1)


TASK = CountingTask  # found by tasks/registry.py
