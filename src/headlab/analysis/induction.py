"""Induction heads (Olsson et al. 2022, arXiv 2209.11895): the repeat loss on repeated random tokens, the
in-context learning score on real text, and both with a set of heads zero-ablated together.

The sequences are analysis/scores.py's repeated_tokens: [BOS] x_1..x_T x_1..x_T, T distinct random
ordinary tokens. The per-head scores (previous-token, duplicate-token, induction) are that module's
induction_scores on the same sequences; this module adds what the model does with them.

Repeat loss. Per sequence, the mean next-token cross-entropy of predicting x_2..x_T in the first copy
(each from the tokens before it: random, so about log(vocabulary) for a model that cannot guess) and of
predicting x_2..x_T in the second copy (an induction head can copy each from the first copy). Both skip
x_1: the first copy's x_1 follows BOS alone, and the second copy's x_1 follows x_T, which has not been
seen followed by anything. The drop, first minus second, is the in-context learning Olsson et al. measure
(their score compares a late token's loss with an early one's in text; on a repeat, the second copy is
the late tokens and the first copy the early ones).

In-context learning score (Olsson et al.'s own, on text): the loss of the 500th token of a sequence minus
the loss of the 50th, each the next-token cross-entropy of that token given the tokens before it in the
sequence, averaged over sequences. The sequences are a text cut into consecutive pieces of 512 tokens (as
their contexts were; a BOS the tokenizer adds counts as the first token). Negative: the model predicts
late tokens better, having more context. Olsson et al. report about -0.4 nats for every model they
trained past the induction-head phase change (under -0.15 before it).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from ..errors import HeadlabError
from ..interventions import Intervention
from ..interventions.engine import execute_joint
from ..locations import text_path
from ..models.hooked import HookedModel
from ..tasks import Task, TaskData, mean_of
from ..vocabulary import Kind, Method

REPEAT_QUANTITIES = ("first_copy_loss", "second_copy_loss", "repeat_loss_drop")


def target_losses(logits: Tensor, data: TaskData) -> Tensor:
    """logits [..., n, reads, vocab] -> the cross entropy of each read's answers["target"] token [..., n, reads]."""
    target = data.answers["target"].to(logits.device).expand(logits.shape[:-1])
    wide = torch.promote_types(logits.dtype, torch.float32)  # half-precision logits: the loss in float32
    return F.cross_entropy(logits.flatten(0, -2).to(wide), target.flatten(), reduction="none").view(target.shape)


class RepeatLoss(Task):
    """The repeat loss as a task, so that the engine's joint ablation reads it like any task's metric."""

    name = "repeated_tokens"
    quantities = REPEAT_QUANTITIES
    smooth_quantity = "second_copy_loss"
    cfg = None

    def __init__(self) -> None:
        self.aggregates = {name: mean_of(j) for j, name in enumerate(REPEAT_QUANTITIES)}

    def per_prompt(self, logits: Tensor, data: TaskData) -> Tensor:
        """logits [..., n, 2(T-1), vocab] at the first copy's reads, then the second's -> [..., n, 3]."""
        loss = target_losses(logits, data)
        half = loss.shape[-1] // 2
        first, second = loss[..., :half].mean(-1), loss[..., half:].mean(-1)
        return torch.stack([first, second, first - second], dim=-1)


def repeat_data(ids: Tensor, seq_len: int) -> TaskData:
    """The repeat loss's reads of repeated_tokens' sequences [n, bos + 2T]: the positions whose logits
    predict x_2..x_T of each copy, and those tokens as the targets."""
    start = ids.shape[1] - 2 * seq_len  # 1 with BOS, else 0
    first = torch.arange(start, start + seq_len - 1)  # x_1..x_{T-1} of the first copy predict x_2..x_T
    reads = torch.cat([first, first + seq_len])
    positions = reads.expand(ids.shape[0], -1).contiguous()
    return TaskData(inputs={"input_ids": ids}, positions=positions, answers={"target": ids[:, reads + 1]})


def zero_heads(heads: list[tuple[int, int]], group: str) -> list[Intervention]:
    """The heads zero-ablated together: each one's output (site z, before W_O) zero at every position."""
    return [Intervention(Kind.ablate_head, Method.zero, layer, head, group=group) for layer, head in heads]


def ablated_repeat_loss(
    model: HookedModel, data: TaskData, groups: list[list[tuple[int, int]]], seed: int = 0
) -> Tensor:
    """Per-sequence REPEAT_QUANTITIES [1 + len(groups), n, 3]: the clean run, then each group of heads
    zero-ablated together in one pass (the engine's joint ablation)."""
    return execute_joint(model, RepeatLoss(), data, [[], *(zero_heads(heads, "") for heads in groups)], seed=seed)


# --- in-context learning on real text ----------------------------------------------------------------
# Olsson et al.'s in-context learning score: "the loss of the 500th token in the context minus the average
# loss of the 50th token in the context, averaged over dataset examples" (their contexts: 512 tokens).
ICL_TOKENS = (50, 500)  # 1-based indices into each sequence, a BOS the tokenizer adds counted as the first
ICL_QUANTITIES = ("loss_50th_token", "loss_500th_token", "icl_score")


class TokenLoss(Task):
    """The losses of the 50th and 500th tokens of each text sequence and their difference, as a task, so
    that the engine's joint ablation reads them like the repeat loss."""

    name = "icl_text"
    quantities = ICL_QUANTITIES
    smooth_quantity = "icl_score"
    cfg = None

    def __init__(self) -> None:
        self.aggregates = {name: mean_of(j) for j, name in enumerate(ICL_QUANTITIES)}

    def per_prompt(self, logits: Tensor, data: TaskData) -> Tensor:
        """logits [..., n, 2, vocab] at the reads predicting the 50th and 500th tokens -> [..., n, 3]."""
        loss = target_losses(logits, data)
        early, late = loss[..., 0], loss[..., 1]
        return torch.stack([early, late, late - early], dim=-1)


def text_sequences(tokenizer: Any, text: str, length: int) -> Tensor:
    """[n, length]: the text tokenized once and cut into consecutive sequences of `length` tokens (the
    remainder left out), each opening with the BOS the tokenizer adds by default where it adds one."""
    plain = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    bos = tokenizer.bos_token_id
    adds_bos = bos is not None and list(tokenizer("a")["input_ids"])[:1] == [bos] and plain[:1] != [bos]
    prefix = [bos] if adds_bos else []
    step = length - len(prefix)
    rows = [prefix + plain[s : s + step] for s in range(0, len(plain) - step + 1, step)]
    return torch.tensor(rows, dtype=torch.long).view(len(rows), length)


def icl_data(ids: Tensor) -> TaskData:
    """The reads of sequences [n, >= 500]: the logits at positions 48 and 498 predict the tokens at 49
    and 499 (0-based), the 50th and 500th."""
    targets = torch.tensor(ICL_TOKENS) - 1
    positions = (targets - 1).expand(ids.shape[0], -1).contiguous()
    return TaskData(inputs={"input_ids": ids}, positions=positions, answers={"target": ids[:, targets]})


def ablated_icl_score(model: HookedModel, data: TaskData, groups: list[list[tuple[int, int]]], seed: int = 0) -> Tensor:
    """Per-sequence ICL_QUANTITIES [1 + len(groups), n, 3]: the clean run, then each group of heads
    zero-ablated together."""
    return execute_joint(model, TokenLoss(), data, [[], *(zero_heads(heads, "") for heads in groups)], seed=seed)


def text_file(path: str) -> Path:
    """`path`, or the text headlab ships under that name (locations.text_path: data/alice.txt)."""
    file = text_path(path)
    if not file.is_file():
        raise HeadlabError(f"study.icl_text={path}: no such file (study.icl_text='' leaves the ICL score out)")
    return file
