"""Next-token cross-entropy over your text: which heads, layers and MLPs a language model's loss needs.

`task.path` is a file (one document per non-empty line) or a directory (one document per `.txt` file,
in name order); data/alice.txt and data/devil.txt, not found from the working directory, are the texts
headlab ships (locations.text_path). Each document is one sequence, tokenized as the model's tokenizer
does by default (its BOS included where it adds one) and cut to `task.seq_len` tokens; a document of
fewer than 2 tokens predicts nothing and is left out. Documents are right-padded to the longest one, with an
`attention_mask`; every real token but the first is predicted from the ones before it.

Per document the quantities are the sum of its token losses and the number of tokens it predicts; the
metric `ce_loss` is the sum of the sums over the sum of the counts (the mean over every predicted token
of the corpus), so the bootstrap resamples documents. The reference set of mean and resample ablation
is the corpus itself, in a shuffled cyclic order (document i's resample source is another document).
Mean ablation for text wants `ablate.mean_over=tokens` (one mean per head over every real token).

Memory: the loss reads every position, seq_len - 1 per document, but never a position's whole logits: a
sweep reads each position's target row and the softmax's normaliser, a slice of the vocabulary at a time
(Task.vocab_rows, interventions/readout.py), at most `engine.chunk_mb` of logits at once however long the
document (gemma3-270m's 262,144-token vocabulary would be 1 MB of float32 logits a position). per_prompt,
from whole logits, computes the loss LOSS_SLICE_ELEMENTS logits at a time.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from ..config_rules import NATURAL, at_least, setting
from ..errors import HeadlabError, UsageError
from ..locations import text_path
from .base import PRETRAINED_DEFAULTS, Task, TaskConfig, TaskData, right_padded

log = logging.getLogger("headlab")

IGNORE = -100  # target of a padded position: no loss there
LOSS_SLICE_ELEMENTS = 2**24  # logits per slice of the loss (64 MB in float32)


@dataclass
class TextConfig(TaskConfig):
    """Next-token cross-entropy over a text: one document per line of a file or per .txt file of a dir."""

    name: str = "text"
    n_prompts: int = setting(0, NATURAL)  # documents; 0: every document 0: every document
    path: str | None = None
    # tokens per document at most (the tokenizer's BOS included) a next token to predict after the first
    seq_len: int = setting(128, at_least(2))


def mean_loss(quantities: np.ndarray, _answers: dict[str, np.ndarray]) -> np.ndarray:
    """Mean loss per predicted token over the documents: sum of loss sums / sum of token counts."""
    return quantities[..., 0].sum(-1, dtype=np.float64) / quantities[..., 1].sum(-1, dtype=np.float64)


class TextTask(Task):
    name = "text"
    options = TextConfig
    quantities = ("loss_sum", "n_tokens")
    smooth_quantity = "loss_sum"
    needs_tokenizer = True
    default_models = PRETRAINED_DEFAULTS
    cfg: TextConfig

    def __init__(self, cfg: TextConfig) -> None:
        self.cfg = cfg
        self.aggregates = {"ce_loss": mean_loss}
        if cfg.seq_len < 2:
            raise UsageError(f"task.seq_len must be at least 2 (a token and the one it predicts), not {cfg.seq_len}")

    def documents(self) -> list[str]:
        """The texts under task.path, in order (empty lines and files left out)."""
        if not self.cfg.path:
            raise UsageError("task text needs task.path=<a text file, one document per line, or a directory of .txt>")
        path = text_path(self.cfg.path)
        if not path.exists():
            raise HeadlabError(f"task text: {path} does not exist")
        files = sorted(p for p in path.glob("*.txt") if p.is_file()) if path.is_dir() else [path]
        if not files:
            raise HeadlabError(f"task text: {path} holds no .txt file")
        try:
            texts = [f.read_text(encoding="utf-8") for f in files]
        except (OSError, UnicodeDecodeError) as e:
            raise HeadlabError(f"task text: cannot read {path} as UTF-8 text: {e}") from e
        docs = texts if path.is_dir() else texts[0].splitlines()
        return [d for d in docs if d.strip()]

    def build(self, n: int, seed: int, model: Any = None) -> TaskData:
        tok = getattr(model, "tokenizer", None)
        if tok is None:
            raise HeadlabError("task text needs the model's tokenizer (set model.tokenizer=<name or dir>)")
        docs = self.documents()
        encoded = tok(docs, truncation=True, max_length=self.cfg.seq_len)["input_ids"] if docs else []
        rows = [list(ids) for ids in encoded if len(ids) >= 2]
        if len(rows) < len(encoded):
            log.warning(
                "text: %d of %d documents have fewer than 2 tokens, left out", len(encoded) - len(rows), len(encoded)
            )
        if not rows:
            raise HeadlabError(f"task text: no document in {self.cfg.path} has 2 tokens or more")
        rows = rows[:n] if n > 0 else rows
        width = max(map(len, rows))
        # a learned position table has no row past its end: one line here, not an IndexError mid-sweep
        context = getattr(getattr(getattr(model, "module", None), "config", None), "max_position_embeddings", None)
        if isinstance(context, int) and width > context:
            raise UsageError(
                f"task text: documents of {width} tokens exceed the model's {context} positions "
                f"(set task.seq_len={context} or less)"
            )
        padded = right_padded(rows, tok, width)
        ids, mask = padded["input_ids"], padded["attention_mask"]
        target = ids[:, 1:].masked_fill(mask[:, 1:] == 0, IGNORE)
        # a cycle through the documents in random order: each one's resample source is another document,
        # and the set (hence every mean over it) is the corpus itself
        order = np.random.default_rng(seed).permutation(len(rows))
        source = torch.empty(len(rows), dtype=torch.long)
        source[order] = torch.from_numpy(np.roll(order, -1))
        return TaskData(
            inputs={"input_ids": ids, "attention_mask": mask},
            positions=torch.arange(width - 1).expand(len(rows), -1).contiguous(),
            answers={"target": target},
            reference={"input_ids": ids[source], "attention_mask": mask[source]},
        )

    def per_prompt(self, logits: Tensor, data: TaskData) -> Tensor:
        target = data.answers["target"].to(logits.device).expand(logits.shape[:-1])
        flat_logits, flat_target = logits.reshape(-1, logits.shape[-1]), target.reshape(-1)
        step = max(1, LOSS_SLICE_ELEMENTS // logits.shape[-1])
        wide = torch.promote_types(logits.dtype, torch.float32)  # half-precision logits: the loss in float32
        losses = torch.cat(
            [
                F.cross_entropy(
                    flat_logits[s : s + step].to(wide), flat_target[s : s + step], ignore_index=IGNORE, reduction="none"
                )
                for s in range(0, flat_target.shape[0], step)
            ]
        ).view(target.shape)
        return _sums(losses, target)

    def vocab_rows(self, data: TaskData, columns: Sequence[int]) -> Tensor:
        """[n, P, 1]: each read position's next token (a padded one reads row 0, its loss not counted)."""
        return data.answers["target"].unsqueeze(-1)

    def needs_normaliser(self, columns: Sequence[int]) -> bool:
        return True

    def from_rows(
        self, rows: Tensor, data: TaskData, columns: Sequence[int], normaliser: Tensor | None = None
    ) -> Tensor:
        """A token's loss is the normaliser less its logit: cross_entropy's, without the vocabulary's logits."""
        assert normaliser is not None, "the loss needs the normaliser (needs_normaliser)"
        target = data.answers["target"].to(rows.device).expand(rows.shape[:-1])
        logit = rows[..., 0].float() if rows.element_size() < 4 else rows[..., 0]
        losses = (normaliser.to(logit.dtype) - logit).masked_fill(target == IGNORE, 0.0)
        return _sums(losses, target)[..., list(columns)]


def _sums(losses: Tensor, target: Tensor) -> Tensor:
    """[..., n, P] token losses -> [..., n, 2]: each document's loss sum and its count of predicted tokens."""
    counted = (target != IGNORE).to(losses.dtype)
    return torch.stack([losses.sum(-1), counted.sum(-1)], dim=-1)


TASK = TextTask  # found by tasks/registry.py
