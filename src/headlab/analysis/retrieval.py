"""Retrieval heads (Wu et al. 2024, arXiv 2404.15574): the heads that copy a needle out of the context.

Retrieval score. Wu et al. decode greedily and, at every step, count for each head a copy-paste event when
the generated token is in the needle and the head's most-attended key (top-1 attention) is a needle
position holding that same token; each event adds 1 / needle length, and a head's score is the mean over
the tests whose answer recovered the needle (ROUGE-1 recall above 50%). Here the answer is teacher-forced
in one forward pass instead of generated: copy step j is the query whose next token is needle token j, the
"generated" token is the model's argmax there, and an event also needs that argmax to be needle token j.
A prompt counts towards the mean when its needle recall (share of copy steps whose argmax is right)
exceeds `min_recall` (0.5 stands in for the paper's ROUGE filter).

Masking. Wu et al. mask a head by zeroing its query during decoding, so that it attends uniformly over the
context; here each masked head's query is zeroed at the copy steps (edits on site q at the roles COPY0..,
through the engine), the prompt's own positions untouched, as the paper's prefill is.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from ..interventions import Intervention
from ..interventions.engine import execute_joint
from ..models.hooked import HookedModel
from ..tasks import Task, TaskData
from ..tasks.needle import copy_role, needle_role
from ..vocabulary import Kind, Method, Site

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


@dataclass
class Retrieval:
    scores: Tensor  # [layer * head (layer-major), n]: per prompt, copy-paste events / needle length
    recall: Tensor  # [n]: teacher-forced needle recall

    def counted(self, min_recall: float) -> Tensor:
        """[n] bool: the prompts that count towards the retrieval score."""
        return self.recall > min_recall

    def mean(self, min_recall: float) -> Tensor:
        """[layer * head]: the retrieval score, the mean over counted prompts (NaN if none counts)."""
        keep = self.counted(min_recall)
        return self.scores[:, keep].mean(1) if keep.any() else torch.full(self.scores.shape[:1], float("nan"))


@torch.no_grad()
def retrieval_scores(model: HookedModel, data: TaskData, batch_size: int = 16) -> Retrieval:
    """Each head's per-prompt retrieval score on needle prompts, in one teacher-forced pass per batch."""
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


@contextmanager
def _copy_step_patterns(model: HookedModel, steps: Tensor) -> Iterator[dict[int, Tensor]]:
    """layer -> attention [b, head, L, key] from the copy steps only, kept as the forward pass runs: a
    full pattern per layer would grow with the square of the context."""
    seen: dict[int, Tensor] = {}

    def keep(layer: int):
        def hook(pattern: Tensor) -> Tensor:
            rows = torch.arange(pattern.shape[0], device=pattern.device)[:, None]
            seen[layer] = pattern[rows, :, steps.to(pattern.device)].transpose(1, 2).float()
            return pattern

        return hook

    with ExitStack() as stack:
        for layer in range(model.n_layers):
            stack.enter_context(model.sites.hooks(layer, pattern=keep(layer)))
        yield seen


def top_heads(scores: Tensor, n_heads: int, k: int) -> list[tuple[int, int]]:
    """The k (layer, head) of highest score (layer-major scores; ties to the lower index)."""
    order = sorted(range(len(scores)), key=lambda i: (-float(scores[i]), i))
    return [divmod(i, n_heads) for i in order[:k]]


def random_heads(
    n_layers: int, n_heads: int, avoid: list[tuple[int, int]], k: int, draws: int, seed: int
) -> tuple[list[list[tuple[int, int]]], bool]:
    """`draws` sets of k distinct heads, each drawn (seeded) from the heads not in `avoid` (Wu et al.'s
    baseline masks random non-retrieval heads), or from every head when fewer than k remain; the flag
    says whether the avoided heads stayed out."""
    every = [(layer, head) for layer in range(n_layers) for head in range(n_heads)]
    pool = [h for h in every if h not in avoid]
    apart = len(pool) >= k
    pool = pool if apart else every
    rng = np.random.default_rng(seed)
    return [[pool[i] for i in sorted(rng.choice(len(pool), size=k, replace=False))] for _ in range(draws)], apart


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
