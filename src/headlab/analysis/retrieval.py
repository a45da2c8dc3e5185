"""Retrieval heads (Wu et al. 2024, arXiv 2404.15574): the heads that copy a needle out of the context.

Retrieval score, two ways (study.decoding):
  greedy          Wu et al.'s (their retrieval_head_detection.py): the answer is decoded greedily
                  (analysis/decoding.py) and, at every step, a head has a copy-paste event when its
                  most-attended key (top-1 attention) is a needle position holding the token just
                  generated; each event adds 1 / needle length (no position is excluded for having been
                  copied before, as in their code). A prompt counts towards the mean when its answer's
                  ROUGE-1 recall of the needle, on tokens (clipped counts), exceeds `min_recall` (theirs:
                  ROUGE-1 recall on words, above 50%). Where theirs differs: they decode up to 50 tokens or
                  to a newline and locate the needle span by token overlap; here exactly needle-length
                  steps are decoded and the task names the needle's positions (roles NEEDLE0..).
  teacher_forced  the answer in one forward pass instead of generated: copy step j is the query whose
                  next token is needle token j, the "generated" token is the model's argmax there, and an
                  event also needs that argmax to be needle token j; a prompt counts when its needle
                  recall (share of copy steps whose argmax is right) exceeds `min_recall`. What headlab
                  computed before greedy decoding existed.

Masking. Wu et al. mask a head by zeroing its query during decoding, so that it attends uniformly over the
context; here each masked head's query is zeroed at the copy steps (edits on site q at the roles COPY0..,
through the engine), the answer teacher-forced, the prompt's own positions untouched, as the paper's
prefill is.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass

import torch
from torch import Tensor

from ..interventions import Intervention
from ..interventions.engine import execute_joint
from ..models.hooked import HookedModel
from ..tasks import Task, TaskData
from ..tasks.needle import copy_role, needle_role
from ..vocabulary import Kind, Method, Site
from .decoding import greedy_decode

NEEDLE = "needle"  # the answer holding each prompt's needle tokens [n, L]


def needle_length(data: TaskData) -> int:
    """L where the prompts name the roles NEEDLE0.., COPY0.. for j < L and give the needle tokens; else 0."""
    roles = data.token_positions or {}
    needle = data.answers.get(NEEDLE)
    if needle is None or needle.dim() != 2:
        return 0
    length = needle.shape[1]
    named = all(needle_role(j) in roles and copy_role(j) in roles for j in range(length))
    return length if named else 0


def needle_layout(data: TaskData) -> tuple[Tensor, Tensor]:
    """(needle positions [n, L], copy steps [n, L]): where needle token j sits and where it is copied."""
    roles, length = data.token_positions or {}, needle_length(data)
    if not length:
        raise ValueError("these prompts name no needle roles (NEEDLE0.., COPY0..) and no 'needle' answer")
    needle = torch.stack([roles[needle_role(j)] for j in range(length)], 1)
    steps = torch.stack([roles[copy_role(j)] for j in range(length)], 1)
    return needle, steps


def retrieval_hits(pattern: Tensor, predicted: Tensor, needle: Tensor, ids: Tensor, needle_positions: Tensor) -> Tensor:
    """Copy-paste events [n, head, L] (bool).

    pattern [n, head, L, key]: each head's attention from copy step j; predicted [n, L]: the model's
    argmax at copy step j; needle [n, L]: the needle tokens; ids [n, key]: the prompt's tokens;
    needle_positions [n, L]: where the needle sits. An event: the head's most-attended key is a needle
    position holding the predicted token, and the predicted token is needle token j."""
    top = pattern.argmax(-1)  # [n, head, L]; ties go to the earliest key
    in_needle = (top.unsqueeze(-1) == needle_positions[:, None, None, :]).any(-1)
    attended = ids.gather(1, top.flatten(1)).view_as(top)
    right = (predicted == needle)[:, None, :]
    return in_needle & (attended == predicted[:, None, :]) & right


def copy_paste_events(top_keys: Tensor, tokens: Tensor, ids: Tensor, needle_positions: Tensor) -> Tensor:
    """Wu et al.'s copy-paste events during greedy decoding [n, head, steps] (bool).

    top_keys [n, head, steps]: each head's most-attended key at each step; tokens [n, steps]: the token
    generated there; ids [n, key]: the tokens at the keys; needle_positions [n, L]: where the needle sits.
    An event: the top key is a needle position and holds the generated token."""
    in_needle = (top_keys.unsqueeze(-1) == needle_positions[:, None, None, :]).any(-1)
    attended = ids.gather(1, top_keys.flatten(1)).view_as(top_keys)
    return in_needle & (attended == tokens[:, None, :])


def token_recall(tokens: Tensor, needle: Tensor) -> Tensor:
    """ROUGE-1 recall of the needle [n, L] by the answer [n, steps], on tokens: the needle's tokens found in
    the answer (each as often as it occurs in both, at most), over L."""
    in_needle = (needle[:, :, None] == needle[:, None, :]).sum(-1)  # [n, L]: how often needle token j occurs
    in_answer = (needle[:, :, None] == tokens[:, None, :]).sum(-1)
    return (torch.minimum(in_needle, in_answer) / in_needle).sum(-1) / needle.shape[1]


@dataclass
class Retrieval:
    scores: Tensor  # [layer * head (layer-major), n]: per prompt, copy-paste events / needle length
    recall: Tensor  # [n]: needle recall of the answer (greedy: ROUGE-1 on tokens; teacher-forced: per step)
    answers: Tensor | None = None  # [n, L]: the greedy answers (None: teacher-forced)

    def counted(self, min_recall: float) -> Tensor:
        """[n] bool: the prompts that count towards the retrieval score."""
        return self.recall > min_recall

    def mean(self, min_recall: float) -> Tensor:
        """[layer * head]: the retrieval score, the mean over counted prompts (NaN if none counts)."""
        keep = self.counted(min_recall)
        return self.scores[:, keep].mean(1) if keep.any() else torch.full(self.scores.shape[:1], float("nan"))


def retrieval_scores(
    model: HookedModel,
    data: TaskData,
    batch_size: int = 16,
    decoding: str = "teacher_forced",
    show_progress: bool = False,
) -> Retrieval:
    """Each head's per-prompt retrieval score on needle prompts: decoding "greedy" (Wu et al.'s) or
    "teacher_forced" (one pass per batch)."""
    if decoding == "greedy":
        return greedy_retrieval(model, data, batch_size, show_progress)
    if decoding != "teacher_forced":
        raise ValueError(f"unknown decoding '{decoding}': greedy or teacher_forced")
    return teacher_forced_retrieval(model, data, batch_size)


def greedy_retrieval(model: HookedModel, data: TaskData, batch_size: int = 8, show_progress: bool = False) -> Retrieval:
    """Wu et al.'s score: L tokens decoded greedily after the question (the prompt without its
    teacher-forced answer), the events counted at every step."""
    needle_positions, steps = needle_layout(data)
    starts = steps[:, 0]
    if not (starts == starts[0]).all():
        raise ValueError("greedy decoding needs every prompt's answer to start at one position")
    needle, ids = data.answers[NEEDLE], data.inputs["input_ids"]
    length = needle.shape[1]
    decoded = greedy_decode(model, data.inputs, int(starts[0]) + 1, length, batch_size, show_progress)
    events = copy_paste_events(decoded.top_keys, decoded.tokens, ids, needle_positions)
    scores = events.float().sum(-1) / length  # [n, layer * head]
    return Retrieval(scores.T.contiguous(), token_recall(decoded.tokens, needle), decoded.tokens)


@torch.no_grad()
def teacher_forced_retrieval(model: HookedModel, data: TaskData, batch_size: int = 16) -> Retrieval:
    """The teacher-forced score, in one forward pass per batch."""
    needle_positions, steps = needle_layout(data)
    needle, ids = data.answers[NEEDLE], data.inputs["input_ids"]
    parts, recalls = [], []
    for start in range(0, data.n, batch_size):
        rows = slice(start, start + batch_size)
        batch = {k: v[rows] for k, v in data.inputs.items()}
        with _copy_step_patterns(model, steps[rows]) as seen:
            h = model.forward_blocks(batch)
        predicted = model.readout(h, data.positions[rows]).argmax(-1)  # [b, L]
        hits = [
            retrieval_hits(seen[layer], predicted, needle[rows], ids[rows], needle_positions[rows])
            for layer in range(model.n_layers)
        ]
        parts.append(torch.cat(hits, 1).float().mean(-1))  # [b, layer * head]
        recalls.append((predicted == needle[rows]).float().mean(-1))
    return Retrieval(torch.cat(parts).T.cpu(), torch.cat(recalls).cpu())


def _copy_step_patterns(model: HookedModel, steps: Tensor) -> AbstractContextManager[dict[int, Tensor]]:
    """layer -> attention [b, head, L, key] from the copy steps only, kept as the forward pass runs: a
    full pattern per layer would grow with the square of the context."""

    def rows_of(pattern: Tensor) -> Tensor:
        rows = torch.arange(pattern.shape[0], device=pattern.device)[:, None]
        return pattern[rows, :, steps.to(pattern.device)].transpose(1, 2).float()

    return model.kept(Site.pattern, rows_of)


def mask_interventions(heads: list[tuple[int, int]], length: int, group: str) -> list[Intervention]:
    """The heads masked together: each one's query zeroed at every copy step."""
    return [
        Intervention(Kind.ablate_head, Method.zero, layer, head, site=Site.q, token=copy_role(j), group=group)
        for layer, head in heads
        for j in range(length)
    ]


def masked_quantities(
    model: HookedModel, task: Task, data: TaskData, groups: list[list[tuple[int, int]]], seed: int = 0
) -> Tensor:
    """Per-prompt task quantities [1 + len(groups), n, Q]: the clean run, then each group of heads masked
    together."""
    length = needle_length(data)
    joint = [mask_interventions(heads, length, "") for heads in groups]
    return execute_joint(model, task, data, [[], *joint], seed=seed)
