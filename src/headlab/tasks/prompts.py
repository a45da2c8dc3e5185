"""Your own prompts (task=prompts): clean / corrupted pairs with their answers, from a file or from Python.

Each prompt is tokenized as the model's tokenizer does by default (its BOS where it adds one), answers
without special tokens; prompts are right-padded and `attention_mask` marks the real tokens. The read
position is a record's `position` (an index into the tokenized clean prompt, negative from its end),
else its last real token; patching can target it as END. Mean and resample ablation and path patching's
senders take their values from each record's `reference` prompt, mean ablation within its `group`; a record
without one takes its corrupted prompt (as activation patching does; every record has one), so that path
patching on a file of clean and corrupted prompts patches from the corrupted ones. An intervention whose
source is, on every prompt, the prompt itself is refused (interventions/engine.py).

Per-prompt quantities at the read position, with A the answer's alternatives and W the wrong answer's:
  logit_diff    max logit over A - max logit over W
  answer_prob   softmax probability of the answer, summed over A
  correct       1 where the best of A beats the best of W (aggregate: accuracy)
and, where the prompts are scored by a peer's definition (task.peer; by default the peer whose file
format they came in), that peer's logit difference beside them:
  autocircuit_logit_diff  mean logit over A - mean logit over W (auto-circuit's answer diff with
                          prob_func="logits": utils/tensor_ops.batch_answer_diffs, metrics/prune_metrics/
                          answer_diff.py)
  eap_ig_logit_diff       logit of A's first - logit of W's first (EAP-IG's logit_diff, ioi.ipynb:
                          labels [correct_idx, incorrect_idx] gathered, good - bad)
  mib_logit_diff          the same (MIB-circuit-track metrics.logit_diff, which run_attribution.py and
                          run_evaluation.py use; its labels are each answer's first token)
patching_score = (mean score - mean corrupted score) / (mean clean score - mean corrupted score), the
score being the peer's logit difference where there is one, else logit_diff: 1 for the clean behaviour and
0 for the corrupted one; the clean and corrupted scores of each prompt come from plain forward passes in
build(), so the patching score bootstraps like the other metrics. Where headlab differs from the peers:
the prompt's tokens are the tokenizer's (TransformerLens, which EAP-IG and MIB run on, may prepend a BOS
the tokenizer does not), a record's `position` moves the read position, and an alternative listed twice
counts once in auto-circuit's mean (auto-circuit counts it twice).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from ..config_rules import MULTI_TOKEN, NATURAL, PEER_CHOICES, PEERS, PROMPT_FORMATS, OneOf, setting
from ..errors import HeadlabError, UsageError
from .base import PRETRAINED_DEFAULTS, Aggregate, Inputs, Task, TaskConfig, TaskData, mean_of, right_padded
from .formats import Answer, Prompt, Record, read_as, short, to_record

BASELINE_MB = 256  # logits held at once by build()'s clean and corrupted forward passes


@dataclass
class PromptsConfig(TaskConfig):
    """Your own prompts: clean / corrupted pairs with answers, from a file (tasks/prompts.py)."""

    name: str = "prompts"
    n_prompts: int = setting(0, NATURAL)  # the file's first n rows; 0: every row 0: every row of the file
    path: str | None = None  # JSONL, CSV, auto-circuit JSON, EAP-IG CSV or MIB rows
    # auto (by extension and fields) | jsonl | csv | autocircuit | eap_ig | mib
    format: str = setting("auto", OneOf(PROMPT_FORMATS))
    # an answer of several tokens: refuse | first (its first token)
    multi_token: str = setting("refuse", OneOf(MULTI_TOKEN))
    counterfactual: str | None = None  # MIB: which counterfactual field is the corrupted prompt
    # whose logit difference scores the prompts (patching_score, circuits): auto (the peer whose format the
    # file is in: autocircuit, eap_ig, mib; none for jsonl / csv) | none (headlab's logit_diff) | a peer
    peer: str = setting("auto", OneOf(PEER_CHOICES))


@dataclass
class Encoded:
    clean: list[int]
    corrupted: list[int]
    reference: list[int]
    answer: list[int]
    wrong: list[int]
    position: int


def patching_score_of(column: int) -> Aggregate:
    """The patching score of the quantity in `column`, against its clean and corrupted values in build()."""

    def aggregate(quantities: np.ndarray, answers: dict[str, np.ndarray]) -> np.ndarray:
        clean, corrupted = answers["clean_score"].mean(-1), answers["corrupted_score"].mean(-1)
        with np.errstate(divide="ignore", invalid="ignore"):
            score = (quantities[..., column].mean(-1) - corrupted) / (clean - corrupted)
        return np.where(np.isfinite(score), score, np.nan)

    return aggregate


PROB = 1  # answer_prob's column: a softmax over the whole vocabulary


def quantities_at(
    logits: Tensor,
    answer: Tensor,
    wrong: Tensor,
    peer: str | None = None,
    rows_only: bool = False,
    normaliser: Tensor | None = None,
) -> Tensor:
    """logits [..., n, vocab] at the read positions, answer [n, A] and wrong [n, W] token ids (-1 pads
    the lists) -> [..., n, 3]: logit_diff, answer_prob, correct; [..., n, 4] with the peer's logit
    difference after them where a peer is named. `rows_only`: `logits` holds some rows of the vocabulary
    alone, and answer_prob comes from `normaliser` [..., n], the log of the softmax's normaliser (NaN
    without it)."""
    logits = logits.float() if logits.element_size() < 4 else logits  # half precision: sum in float32

    def gathered(ids: Tensor) -> Tensor:
        ids = ids.to(logits.device)
        return logits.gather(-1, ids.clamp_min(0).expand(*logits.shape[:-1], ids.shape[-1]))

    right, wrong_ = gathered(answer), gathered(wrong)
    right_ok, wrong_ok = (answer >= 0).to(logits.device), (wrong >= 0).to(logits.device)
    right_best = right.masked_fill(~right_ok, float("-inf"))
    diff = right_best.amax(-1) - wrong_.masked_fill(~wrong_ok, float("-inf")).amax(-1)
    if not rows_only:
        prob = torch.exp(right_best - torch.logsumexp(logits, -1, keepdim=True)).sum(-1)
    elif normaliser is not None:
        prob = torch.exp(right_best - normaliser.to(logits.device, logits.dtype).unsqueeze(-1)).sum(-1)
    else:
        prob = torch.full_like(diff, float("nan"))
    columns = [diff, prob, (diff > 0).float()]
    if peer == "autocircuit":
        mean = lambda v, ok: (v * ok).sum(-1) / ok.sum(-1)  # noqa: E731
        columns.append(mean(right, right_ok) - mean(wrong_, wrong_ok))
    elif peer is not None:  # EAP-IG and MIB: labels [first answer token, first wrong answer token]
        columns.append(right[..., 0] - wrong_[..., 0])
    return torch.stack(columns, dim=-1)


class PromptsTask(Task):
    name = "prompts"
    options = PromptsConfig
    quantities: tuple[str, ...] = ("logit_diff", "answer_prob", "correct")  # answer_prob: column PROB
    smooth_quantity = "logit_diff"
    needs_tokenizer = True
    default_models = PRETRAINED_DEFAULTS
    cfg: PromptsConfig

    def __init__(self, cfg: PromptsConfig, records: Sequence[Record] | None = None):
        self.cfg = cfg
        if cfg.multi_token not in MULTI_TOKEN:
            raise UsageError(f"unknown task.multi_token '{cfg.multi_token}'; choose from: {', '.join(MULTI_TOKEN)}")
        if cfg.peer not in PEER_CHOICES:
            raise UsageError(f"unknown task.peer '{cfg.peer}'; choose from: {', '.join(PEER_CHOICES)}")
        fmt = None
        if records is None:
            if not cfg.path:
                raise UsageError("task=prompts reads your prompts from a file: set task.path=FILE")
            fmt, records = read_as(cfg.path, cfg.format, cfg.counterfactual)
        self.records = list(records)
        # a file in a peer's format is scored as that peer scores it, unless task.peer says otherwise
        chosen = (fmt if fmt in PEERS else None) if cfg.peer == "auto" else cfg.peer
        self.peer = None if chosen == "none" else chosen
        self.aggregates = {"logit_diff": mean_of(0), "answer_prob": mean_of(1), "accuracy": mean_of(2)}
        if self.peer is not None:
            self.quantities = (*PromptsTask.quantities, f"{self.peer}_logit_diff")
            self.smooth_quantity = self.quantities[-1]
            self.aggregates[self.smooth_quantity] = mean_of(3)
        self.score_column = self.quantities.index(self.smooth_quantity)
        self.aggregates["patching_score"] = patching_score_of(self.score_column)

    def build(self, n: int, seed: int, model: Any = None) -> TaskData:
        """The first n records (n <= 0: all), in file order; `seed` draws nothing."""
        tokenizer = getattr(model, "tokenizer", None)
        if tokenizer is None:
            name = getattr(model, "name", "none")
            raise HeadlabError(f"task prompts tokenizes with the model's tokenizer; model {name} has none")
        records = self.records[:n] if 0 < n < len(self.records) else self.records
        encoded = [self._encode(r, tokenizer) for r in records]
        misaligned = [r.where for r, e in zip(records, encoded) if len(e.clean) != len(e.corrupted)]
        if misaligned:
            more = f" (and {len(misaligned) - 2} more)" if len(misaligned) > 2 else ""
            raise HeadlabError(
                f"{', '.join(misaligned[:2])}{more}: clean and corrupted prompts tokenize to different "
                "lengths; patching needs them aligned"
            )
        width = max(max(len(e.clean), len(e.reference)) for e in encoded)
        clean = right_padded([e.clean for e in encoded], tokenizer, width)
        corrupted = right_padded([e.corrupted for e in encoded], tokenizer, width)
        reference = right_padded([e.reference for e in encoded], tokenizer, width)
        positions = torch.tensor([e.position for e in encoded]).unsqueeze(1)
        answer, wrong = _ragged([e.answer for e in encoded]), _ragged([e.wrong for e in encoded])
        groups = _group_ids([r.group for r in records])
        return TaskData(
            inputs=clean,
            positions=positions,
            answers={
                "answer": answer,
                "wrong_answer": wrong,
                "clean_score": self._scores(model, clean, positions, answer, wrong),
                "corrupted_score": self._scores(model, corrupted, positions, answer, wrong),
            },
            counterfactual=corrupted,
            reference=reference,
            token_positions={"END": positions[:, 0]},
            groups=groups,
            reference_groups=groups,
        )

    def per_prompt(self, logits: Tensor, data: TaskData) -> Tensor:
        return quantities_at(logits[..., 0, :], data.answers["answer"], data.answers["wrong_answer"], self.peer)

    def vocab_rows(self, data: TaskData, columns: Sequence[int]) -> Tensor | None:
        """[n, A + W]: the answer and wrong-answer ids (-1 pads), from which every quantity follows
        (answer_prob with the normaliser)."""
        return torch.cat([data.answers["answer"], data.answers["wrong_answer"]], dim=-1)

    def needs_normaliser(self, columns: Sequence[int]) -> bool:
        return PROB in columns

    def from_rows(
        self, rows: Tensor, data: TaskData, columns: Sequence[int], normaliser: Tensor | None = None
    ) -> Tensor:
        """quantities_at on the rows alone, the answers laid out as vocab_rows lays them."""
        width = data.answers["answer"].shape[-1]
        right, wrong = data.answers["answer"], data.answers["wrong_answer"]
        at = torch.arange(rows.shape[-1], device=right.device)
        local_right = torch.where(right >= 0, at[:width], -1)
        local_wrong = torch.where(wrong >= 0, at[width:], -1)
        at_end = None if normaliser is None else normaliser[..., 0]
        every = quantities_at(rows[..., 0, :], local_right, local_wrong, self.peer, True, at_end)
        return every[..., list(columns)]

    def _scores(self, model: Any, inputs: Inputs, positions: Tensor, answer: Tensor, wrong: Tensor) -> Tensor:
        """Each prompt's score (the peer's logit difference, else logit_diff) in a plain forward pass of the
        model (no hooks)."""
        n, width = inputs["input_ids"].shape
        device = model.input_device
        out = []
        with torch.inference_mode():
            per_pass = max(1, int(BASELINE_MB * 2**20 // (width * len(model.tokenizer) * 4)))
            for s in range(0, n, per_pass):
                logits = model.forward({k: v[s : s + per_pass].to(device) for k, v in inputs.items()})
                rows = torch.arange(logits.shape[0], device=device)
                at = logits[rows, positions[s : s + per_pass, 0].to(device)]
                q = quantities_at(at, answer[s : s + per_pass], wrong[s : s + per_pass], self.peer)
                out.append(q[:, self.score_column].cpu())
        return torch.cat(out)

    def _encode(self, record: Record, tokenizer: Any) -> Encoded:
        vocab = len(tokenizer)
        clean = _tokens(record.clean, tokenizer, vocab, record.where, "clean")
        answer = self._answer_ids(record.answer, tokenizer, vocab, record.where, "answer")
        wrong = self._answer_ids(record.wrong_answer, tokenizer, vocab, record.where, "wrong_answer")
        shared = set(answer) & set(wrong)
        if shared:
            raise HeadlabError(f"{record.where}: answer and wrong_answer share token {_show(tokenizer, min(shared))}")
        position = len(clean) - 1 if record.position is None else record.position
        position += len(clean) if position < 0 else 0
        if not 0 <= position < len(clean):
            raise HeadlabError(f"{record.where}: position {record.position} is outside the {len(clean)}-token prompt")
        corrupted = _tokens(record.corrupted, tokenizer, vocab, record.where, "corrupted")
        reference = (
            corrupted
            if record.reference is None
            else _tokens(record.reference, tokenizer, vocab, record.where, "reference")
        )
        return Encoded(clean, corrupted, reference, answer, wrong, position)

    def _answer_ids(self, answer: Answer, tokenizer: Any, vocab: int, where: str, field: str) -> list[int]:
        ids: list[int] = []
        for alternative in answer:
            if isinstance(alternative, int):
                token = alternative
            else:
                pieces = tokenizer(alternative, add_special_tokens=False)["input_ids"]
                if not pieces:
                    raise HeadlabError(f"{where}: {field} {alternative!r} tokenizes to nothing")
                if len(pieces) > 1 and self.cfg.multi_token == "refuse":
                    raise HeadlabError(
                        f"{where}: {field} {short(alternative, 30)!r} is {len(pieces)} tokens; "
                        "give one-token answers or set task.multi_token=first"
                    )
                token = pieces[0]
            if not 0 <= token < vocab:
                raise HeadlabError(f"{where}: {field} token id {token} is outside the vocabulary (0..{vocab - 1})")
            if token not in ids:
                ids.append(token)
        return ids


def from_file(path: str | Path, **options: Any) -> PromptsTask:
    """task=prompts on a file (JSONL, CSV, auto-circuit JSON, EAP-IG CSV, MIB rows). Options are the task's
    config keys: format, multi_token, counterfactual, n_prompts, peer."""
    return PromptsTask(_config(path=str(path), **options))


def from_records(records: Iterable[Any], **options: Any) -> PromptsTask:
    """task=prompts on records given in Python: mappings with clean, corrupted, answer, wrong_answer and
    optionally position, reference, group. Options: multi_token, n_prompts, peer (default: none)."""
    rows = [to_record(r, f"records[{i}]") for i, r in enumerate(records)]
    if not rows:
        raise HeadlabError("from_records: no records given")
    return PromptsTask(_config(**options), rows)


def _config(**options: Any) -> PromptsConfig:
    known = sorted({f.name for f in dataclasses.fields(PromptsConfig)} - {"name"})
    unknown = sorted(set(options) - set(known))
    if unknown:
        raise UsageError(f"unknown task option {', '.join(unknown)}; choose from: {', '.join(known)}")
    return PromptsConfig(**options)


def _tokens(prompt: Prompt, tokenizer: Any, vocab: int, where: str, field: str) -> list[int]:
    if isinstance(prompt, str):
        return list(tokenizer(prompt)["input_ids"])
    if max(prompt) >= vocab:
        raise HeadlabError(f"{where}: {field} token id {max(prompt)} is outside the vocabulary (0..{vocab - 1})")
    return list(prompt)


def _ragged(rows: list[list[int]]) -> Tensor:
    """[n, longest] token ids, -1 after each row's own."""
    out = torch.full((len(rows), max(map(len, rows))), -1, dtype=torch.long)
    for i, r in enumerate(rows):
        out[i, : len(r)] = torch.tensor(r)
    return out


def _group_ids(groups: list[str | int | None]) -> Tensor | None:
    if all(g is None for g in groups):
        return None
    index: dict[str | int | None, int] = {}
    return torch.tensor([index.setdefault(g, len(index)) for g in groups])


def _show(tokenizer: Any, token: int) -> str:
    return f"{token} ({short(tokenizer.decode([token]), 30)!r})"


TASK = PromptsTask  # found by tasks/registry.py
