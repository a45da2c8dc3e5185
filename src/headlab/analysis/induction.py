"""Induction heads (Olsson et al. 2022, arXiv 2209.11895): the repeat loss on repeated random tokens, and
that loss with a set of heads zero-ablated together.

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
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ..interventions import Intervention
from ..interventions.engine import execute_joint
from ..models.hooked import HookedModel
from ..tasks import Task, TaskData, mean_of
from ..vocabulary import Kind, Method

REPEAT_QUANTITIES = ("first_copy_loss", "second_copy_loss", "repeat_loss_drop")


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
        target = data.answers["target"].to(logits.device).expand(logits.shape[:-1])
        wide = torch.promote_types(logits.dtype, torch.float32)  # half-precision logits: the loss in float32
        loss = F.cross_entropy(logits.flatten(0, -2).to(wide), target.flatten(), reduction="none").view(target.shape)
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
