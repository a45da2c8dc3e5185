"""Retrieval heads (Wu et al. 2024, arXiv 2404.15574): the heads that copy a needle out of the context.

Read against the authors' code (github.com/nightdessert/Retrieval_Head: retrieval_head_detection.py for
the score, needle_in_haystack_with_mask.py for masking). Retrieval score, two ways (study.decoding):
  greedy          theirs: the answer is decoded greedily (analysis/decoding.py), up to `max_new_tokens`
                  tokens (theirs: 50) or to the first token holding a newline, and, at every step, a head
                  has a copy-paste event when its most-attended key (top-1 attention) is a position of the
                  answer's span in the haystack holding the token just generated; each event adds 1 / the
                  span's length (no position is excluded for having been copied before, as in their code).
                  A prompt counts towards the mean when the response's recall of the answer exceeds
                  `min_recall`: ROUGE-1 recall on words (recall="words": rouge_score's rouge1 with the
                  Porter stemmer, as theirs, written out here in rouge1_recall) or on tokens (clipped
                  counts). Where theirs differs: they locate the answer's span by token overlap, the task
                  names it here (answers "answer", "answer_start"); they stop at their tokenizer's lone
                  newline token, any token holding a newline stops here. max_new_tokens=0 is headlab 0.2's:
                  needle-length steps, the needle's L tokens its span and its recall's reference.
  teacher_forced  the answer in one forward pass instead of generated: copy step j is the query whose
                  next token is needle token j, the "generated" token is the model's argmax there, and an
                  event also needs that argmax to be needle token j; a prompt counts when its needle
                  recall (share of copy steps whose argmax is right) exceeds `min_recall`. What headlab
                  computed before greedy decoding existed.

Masking (study.masking). Theirs zeroes a masked head's query during decoding, so that it attends uniformly,
and scores the greedy response by ROUGE recall: greedy_masked_recall, the prompt's pass left clean as
their prefill is. teacher_forced (headlab 0.2's): each masked head's query zeroed at the copy steps (edits
on site q at the roles COPY0.., through the engine), the answer teacher-forced.
"""

from __future__ import annotations

import re
from collections import Counter
from contextlib import AbstractContextManager
from dataclasses import dataclass
from functools import cache
from typing import Any

import torch
from torch import Tensor

from ..interventions import Intervention
from ..interventions.engine import execute_joint
from ..interventions.readout import CHUNK_MB, in_slices
from ..models.hooked import HookedModel
from ..tasks import Task, TaskData
from ..tasks.needle import copy_role, needle_role
from ..vocabulary import Kind, Method, Site
from .decoding import greedy_decode, max_positions, newline_tokens

NEEDLE = "needle"  # the answer holding each prompt's needle tokens [n, L]
ANSWER, ANSWER_START = "answer", "answer_start"  # the whole answer [n, A] (padded with -1), where it starts [n]
RECALLS = ("words", "tokens")  # study.recall
MAX_NEW_TOKENS = 50  # Wu et al.'s decode_len
STEMMED = 3  # rouge_score stems only words longer than this


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
    An event: the top key is a needle position and holds the generated token. Past a row's last step
    (tokens and top keys -1) and past a shorter needle (positions -1) there is none."""
    in_needle = (top_keys.unsqueeze(-1) == needle_positions[:, None, None, :]).any(-1) & (top_keys >= 0)
    attended = ids.gather(1, top_keys.clamp(min=0).flatten(1)).view_as(top_keys)
    return in_needle & (attended == tokens[:, None, :])


def token_recall(tokens: Tensor, needle: Tensor) -> Tensor:
    """ROUGE-1 recall of the needle [n, L] by the answer [n, steps], on tokens: the needle's tokens found in
    the answer (each as often as it occurs in both, at most), over the needle's length (-1: no token)."""
    real = needle >= 0
    in_needle = (needle[:, :, None] == needle[:, None, :]).sum(-1).clamp(min=1)  # how often needle token j occurs
    in_answer = (needle[:, :, None] == tokens[:, None, :]).sum(-1)
    found = (torch.minimum(in_needle, in_answer) / in_needle) * real
    return found.sum(-1) / real.sum(-1)


@dataclass
class Retrieval:
    scores: Tensor  # [layer * head (layer-major), n]: per prompt, copy-paste events / needle length
    recall: Tensor  # [n]: needle recall of the answer (greedy: ROUGE-1 on words or tokens; teacher-forced: per step)
    answers: Tensor | None = None  # [n, steps]: the greedy answers, -1 past their end (None: teacher-forced)

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
    max_new_tokens: int = MAX_NEW_TOKENS,
    recall: str = "words",
) -> Retrieval:
    """Each head's per-prompt retrieval score on needle prompts: decoding "greedy" (Wu et al.'s) or
    "teacher_forced" (one pass per batch)."""
    if decoding == "greedy":
        return greedy_retrieval(model, data, batch_size, show_progress, max_new_tokens, recall)
    if decoding != "teacher_forced":
        raise ValueError(f"unknown decoding '{decoding}': greedy or teacher_forced")
    return teacher_forced_retrieval(model, data, batch_size)


def greedy_retrieval(
    model: HookedModel,
    data: TaskData,
    batch_size: int = 8,
    show_progress: bool = False,
    max_new_tokens: int = MAX_NEW_TOKENS,
    recall: str = "words",
    masked: list[tuple[int, int]] | None = None,
) -> Retrieval:
    """Wu et al.'s score: the answer decoded greedily after the question (the prompt without its
    teacher-forced answer), the events counted at every step; `masked` heads' queries zeroed meanwhile."""
    _, steps = needle_layout(data)
    starts = steps[:, 0]
    if not (starts == starts[0]).all():
        raise ValueError("greedy decoding needs every prompt's answer to start at one position")
    ids = data.inputs["input_ids"]
    span, reference = answer_span(data, whole=max_new_tokens > 0)
    length = max_new_tokens or span.shape[1]
    limit = max_positions(model)
    if limit is not None:  # a toy model's few positions: as many steps as fit
        length = max(1, min(length, limit - int(starts[0])))
    stop = _newlines(model) if max_new_tokens else None
    decoded = greedy_decode(model, data.inputs, int(starts[0]) + 1, length, batch_size, show_progress, stop, masked)

    prompt_len = int(starts[0]) + 1
    seen = torch.cat([ids.cpu()[:, :prompt_len], decoded.tokens.clamp(min=0)], 1)  # what each key holds
    events = copy_paste_events(decoded.top_keys, decoded.tokens, seen, span)
    scores = events.float().sum(-1) / (span >= 0).sum(-1, keepdim=True)  # [n, layer * head]
    if recall == "words":
        got = torch.tensor(
            [rouge1_recall(*texts) for texts in zip(_texts(model, reference), _texts(model, decoded.tokens))]
        )
    elif recall == "tokens":
        got = token_recall(decoded.tokens, reference)
    else:
        raise ValueError(f"unknown recall '{recall}': {' or '.join(RECALLS)}")
    return Retrieval(scores.T.contiguous(), got, decoded.tokens)


def answer_span(data: TaskData, whole: bool = True) -> tuple[Tensor, Tensor]:
    """(positions [n, A] of the answer in the haystack, its tokens [n, A]), -1 past a shorter answer: the
    whole answer (Wu et al.'s real_needle) where the prompts name one, else the needle."""
    needle_positions, _ = needle_layout(data)
    answer = data.answers.get(ANSWER)
    if not whole or answer is None or ANSWER_START not in data.answers:
        return needle_positions.cpu(), data.answers[NEEDLE].cpu()
    answer = answer.cpu()
    at = data.answers[ANSWER_START].cpu()[:, None] + torch.arange(answer.shape[1])
    return at.masked_fill(answer < 0, -1), answer


def greedy_masked_recall(
    model: HookedModel,
    data: TaskData,
    groups: list[list[tuple[int, int]]],
    batch_size: int = 8,
    show_progress: bool = False,
    max_new_tokens: int = MAX_NEW_TOKENS,
    recall: str = "words",
) -> Tensor:
    """[len(groups), n]: the greedy response's recall with each group of heads masked together."""
    return torch.stack(
        [
            greedy_retrieval(model, data, batch_size, show_progress, max_new_tokens, recall, heads).recall
            for heads in groups
        ]
    )


def rouge1_recall(reference: str, response: str) -> float:
    """ROUGE-1 recall of `reference` by `response` on words: rouge_score's rouge1 recall with
    use_stemmer=True (Wu et al.'s scorer): lower case, every run of characters other than a-z and 0-9 a
    break, words of more than 3 characters Porter-stemmed (nltk's), clipped counts; 0 for no words."""
    want, got = Counter(rouge_words(reference)), Counter(rouge_words(response))
    return sum(min(count, got[word]) for word, count in want.items()) / max(sum(want.values()), 1)


def rouge_words(text: str) -> list[str]:
    stem = _stemmer().stem
    words = re.split(r"[^a-z0-9]+", text.lower())
    return [w for w in (stem(w) if len(w) > STEMMED else w for w in words) if re.fullmatch(r"[a-z0-9]+", w)]


@cache
def _stemmer() -> Any:
    from nltk.stem.porter import PorterStemmer  # a second of imports, paid only where words are scored

    return PorterStemmer()


def _texts(model: HookedModel, tokens: Tensor) -> list[str]:
    """Each row's tokens (-1: none) as Wu et al. read a response: decoded, special tokens left out,
    stripped; token ids as words where the model has no tokenizer."""
    rows = [[t for t in row if t >= 0] for row in tokens.tolist()]
    tokenizer = model.tokenizer
    if tokenizer is None:
        return [" ".join(map(str, row)) for row in rows]
    return [tokenizer.decode(row, skip_special_tokens=True).strip() for row in rows]


def _newlines(model: HookedModel) -> Tensor | None:
    """[vocab] bool: the tokens that end a greedy answer (a newline in their text); None without a tokenizer."""
    tokenizer = model.tokenizer
    if tokenizer is None:
        return None
    rows = min(len(tokenizer), model.vocab_size)
    found = torch.zeros(model.vocab_size, dtype=torch.bool)
    found[:rows] = newline_tokens(tokenizer, rows)
    return found


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
        predicted = in_slices(model, h, data.positions[rows], CHUNK_MB, lambda _, logits: logits.argmax(-1))  # [b, L]
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
