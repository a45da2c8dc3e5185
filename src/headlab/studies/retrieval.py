"""`headlab run task=needle scores=retrieval`: retrieval heads (Wu et al. 2024, analysis/retrieval.py).

By default Wu et al.'s decoding and scoring (their retrieval_head_detection.py and
needle_in_haystack_with_mask.py): the prompt ends with the question and "Answer:" (task.prompt=question), the
answer is decoded greedily up to 50 tokens or a newline (study.max_new_tokens), scored by ROUGE-1 recall on
words (study.recall), and masked heads are masked while the answer is decoded, the response scored again
(study.masking). The prompts are task=needle's: by default random tokens in a 48-token random haystack, not
Wu et al.'s; their natural-text haystacks and sentence needles are `experiment=retrieval_heads_smollm2`'s
(1,000-token windows of data/alice.txt), and their grid of lengths times 10 depths is not run by default.
`study.haystack_lens` runs one set of task.n_prompts prompts per haystack length (Wu et al.: 1K tokens
and up), the scores pooled over every set as theirs are. headlab 0.2's variants stay as options:
task.prompt=cue, study.max_new_tokens=0, study.recall=tokens, study.masking=teacher_forced,
study.decoding=teacher_forced.

Rows:
  per head      intervention "none", method "score", metric retrieval_score: the mean over the prompts whose
                answer recall exceeds `study.min_recall` (their number is `n`) of copy-paste events /
                answer length; 95% bootstrap interval over those prompts
  masking       the clean run (intervention "none", method "none"), then intervention "mask_heads", method
                "zero", site "q", group "top{k}" (the `study.top_k` best heads masked together) and
                "random{k}_{draw}" (`study.n_random` draws of k heads from outside the top
                max(top_k, `study.random_outside`)): metrics needle_recall (greedy masking: the response's
                recall; teacher-forced: the copy steps', and needle_logprob) and needle_recall_drop (clean
                minus masked, paired over prompts); `study.top_k=0` leaves masking and overlap out
  overlap       intervention "none", method "overlap", metric top_k_induction_overlap: how many of the
                top_k retrieval heads are among the top_k heads by induction score (analysis/scores.py's
                induction_scores on `study.overlap_sequences` repeated random sequences; 0 leaves it out)
meta.json also holds share_above_0.1, the share of heads whose retrieval score exceeds 0.1 (Wu et al.'s
retrieval heads: 3-6% of the heads of their 6B-14B models), per haystack length the recall and seconds,
the heads shared with the top induction heads, and a few greedy answers.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

import numpy as np
import pandas as pd
import torch

from .. import results
from ..analysis.decoding import max_positions
from ..analysis.head_sets import avoided_heads, random_heads, top_heads
from ..analysis.retrieval import (
    MAX_NEW_TOKENS,
    RECALLS,
    Retrieval,
    greedy_masked_recall,
    masked_quantities,
    needle_length,
    retrieval_scores,
)
from ..analysis.scores import induction_scores
from ..config import run_info
from ..config_rules import COUNT, DECODINGS, NATURAL, Each, OneOf, Range, setting
from ..errors import HeadlabError, UsageError
from ..models.hooked import HookedModel
from ..tables import head_name
from ..tasks import TaskData, mean_of, nanmean_of
from ..tasks.needle import NeedleTask
from ..vocabulary import Site, hook_name
from .context import EVAL_SEED_OFFSET, RunContext
from .study import Study, StudyOptions
from .summary import head_table

TOP_HEADS = 10  # named in meta.json
RETRIEVAL_HEAD = 0.1  # Wu et al. call a head with a retrieval score above this a retrieval head
SHOWN_ANSWERS = 3  # greedy answers written to meta.json
INDUCTION_REPEAT = 50  # the induction study's repeated random tokens (study=induction's repeat_len)


@dataclass
class HeadSetOptions(StudyOptions):
    """The top heads knocked out together, against random draws of as many others (retrieval, induction)."""

    top_k: int = setting(5, NATURAL)  # heads masked (retrieval) or zero-ablated (induction) together; 0: none
    n_random: int = setting(5, NATURAL)  # draws of as many random other heads, for the baseline
    # random draws stay out of the top `random_outside` heads by score: Wu et al.'s code draws outside its
    # top 100 (of 1024 heads); on a model with fewer heads, as many as leave top_k to draw from
    random_outside: int = setting(100, NATURAL)


@dataclass
class RetrievalOptions(HeadSetOptions):
    name: str = "retrieval"
    # a prompt counts towards the retrieval score when its needle recall exceeds this: Wu et al. count a
    # test when ROUGE-1 recall exceeds 50%; a negative value counts every prompt
    min_recall: float = setting(0.5, Range(high=1))
    # greedy: Wu et al.'s copy-paste events while the answer is decoded greedily | teacher_forced: the
    # answer in one pass
    decoding: str = setting("greedy", OneOf(DECODINGS))
    # greedy steps at most, a row ending at a token holding a newline: Wu et al.'s decode_len is 50; 0 is
    # headlab 0.2's: needle_len steps, the needle's tokens the answer scored
    max_new_tokens: int = setting(MAX_NEW_TOKENS, NATURAL)
    # words: ROUGE-1 recall on words, Porter-stemmed (Wu et al.'s rouge_score rouge1) | tokens: on tokens
    recall: str = setting("words", OneOf(RECALLS))
    # greedy: Wu et al.'s, queries zeroed while the answer is decoded, the response's recall scored |
    # teacher_forced: headlab 0.2's, queries zeroed at the copy steps of the teacher-forced answer
    masking: str = setting("greedy", OneOf(DECODINGS))
    # haystack lengths, one set of task.n_prompts prompts each, scores pooled (Wu et al.: 1K tokens up to
    # their model's context); [] is task.haystack_len alone
    haystack_lens: list[int] = setting(factory=list, rule=Each(COUNT))
    # repeated random sequences for the top_k induction heads the top retrieval heads are compared with
    # (study=induction's 50); 0 leaves the comparison out
    overlap_sequences: int = setting(50, NATURAL)


def run(ctx: RunContext) -> pd.DataFrame:
    cfg, sc = ctx.cfg, ctx.options
    if sc.n_random < 0:
        raise UsageError(f"study.n_random must be 0 or more, not {sc.n_random}")
    if not isinstance(ctx.get_task(), NeedleTask):  # before a model is loaded or trained for nothing
        raise UsageError(f"study=retrieval needs needle-in-a-haystack prompts (task=needle), not task={cfg.task.name}")
    if sc.masking == "greedy" and sc.decoding != "greedy":
        raise UsageError("study.masking=greedy scores greedy answers: it needs study.decoding=greedy")
    model, task = ctx.get_model(), ctx.get_task()
    assert isinstance(task, NeedleTask)
    n_total = model.n_layers * model.n_heads
    if not 0 <= sc.top_k <= n_total:
        raise UsageError(f"study.top_k must lie in 0..{n_total} (the heads of {model.name}), not {sc.top_k}")
    sets = _prompt_sets(ctx, model, task)
    found, seconds = [], {}
    for length, _, data in sets:
        start = time.perf_counter()
        with ctx.timed("retrieval"):
            found.append(
                retrieval_scores(
                    model, data, 8, sc.decoding, ctx.show_progress, max_new_tokens=sc.max_new_tokens, recall=sc.recall
                )
            )
        seconds[length] = time.perf_counter() - start
    pooled = _pooled(found)
    counted = pooled.counted(sc.min_recall)
    if not counted.any():
        raise HeadlabError(
            f"study=retrieval: no prompt's needle recall exceeds study.min_recall={sc.min_recall} (mean "
            f"{pooled.recall.mean():.3f}): {model.name} does not retrieve the needle; -1 counts every prompt"
        )
    info = run_info(cfg)
    scores = pooled.mean(sc.min_recall)
    parts = [_score_rows(pooled.scores.numpy(), counted.numpy(), model.n_heads, info, cfg.output.n_boot)]
    ctx.meta.update(
        {
            "top_retrieval_heads": [
                f"{head_name(*divmod(i, model.n_heads))} {scores[i].item():.3f}"
                for i in scores.argsort(descending=True, stable=True)[:TOP_HEADS].tolist()
            ],
            "decoding": sc.decoding,
            "max_new_tokens": sc.max_new_tokens,
            "recall": sc.recall,
            "prompt": task.cfg.prompt if model.tokenizer is not None else "symbols",
            "share_above_0.1": float((scores > RETRIEVAL_HEAD).float().mean()),
            "n_above_0.1": int((scores > RETRIEVAL_HEAD).sum()),
            "n_heads": n_total,
            "recall_scoring": float(pooled.recall.mean()),
            "by_haystack_len": {
                str(length): {
                    "prompt_tokens": int(data.inputs["input_ids"].shape[1]),
                    "n_prompts": data.n,
                    "recall": float(got.recall.mean()),
                    "n_scored_prompts": int(got.counted(sc.min_recall).sum()),
                    "seconds_scoring": round(seconds[length], 2),
                }
                for (length, _, data), got in zip(sets, found)
            },
            "answers": _answers(model, pooled.answers),
            "top_k": sc.top_k,
            "min_recall": sc.min_recall,
            "n_prompts": int(sum(data.n for _, _, data in sets)),
            "n_scored_prompts": int(counted.sum()),
            "needle_len": needle_length(sets[0][2]),
            "model_family": model.family,
        }
    )
    if sc.top_k == 0:  # the scores alone (the atlas's probe)
        return results.conform(pd.concat(parts, ignore_index=True))
    top = top_heads(scores, model.n_heads, sc.top_k)
    avoid = avoided_heads(scores, model.n_heads, sc.top_k, sc.random_outside)
    draws, apart = random_heads(model.n_layers, model.n_heads, avoid, sc.top_k, sc.n_random, cfg.seed)
    if not apart:
        ctx.note(f"fewer than {sc.top_k} heads besides the top {len(avoid)}: random draws may include top heads")
    with ctx.timed("masking"):
        quantities, names = _masked(ctx, model, sets, found, [top, *draws])
    groups = [f"top{sc.top_k}", *(f"random{sc.top_k}_{d}" for d in range(len(draws)))]
    parts.append(_mask_rows(quantities, names, groups, info, cfg.output.n_boot))
    shared = None
    if sc.overlap_sequences:
        with ctx.timed("induction_scores"):
            shared = _induction_overlap(model, top, sc.overlap_sequences, cfg.seed)
        parts.append(_overlap_rows(len(shared), sc.top_k, info))
    recall = quantities[..., names.index("needle_recall")].mean(1)  # [1 + groups]
    ctx.meta.update(
        {
            "masked_top_heads": [head_name(*h) for h in top],
            "masked_random_heads": [[head_name(*h) for h in heads] for heads in draws],
            "masking": sc.masking,
            "recall_clean": float(recall[0]),
            "recall_top_k_masked": float(recall[1]),
            "recall_random_k_masked": [float(r) for r in recall[2:]],
            "recall_random_k_masked_mean": float(recall[2:].mean()) if len(draws) else None,
            "top_k_induction_overlap": None if shared is None else len(shared),
            "top_k_also_induction": None if shared is None else [head_name(*h) for h in shared],
            "n_random": sc.n_random,
            "random_outside": len(avoid),
        }
    )
    return results.conform(pd.concat(parts, ignore_index=True))


def _prompt_sets(ctx: RunContext, model: HookedModel, task: NeedleTask) -> list[tuple[int, NeedleTask, TaskData]]:
    """(haystack length, its task, its prompts) for each of study.haystack_lens, else the run's own."""
    lengths = list(ctx.options.haystack_lens)
    if not lengths:
        return [(task.cfg.haystack_len, task, ctx.get_data())]
    sets = []
    for length in lengths:
        each = NeedleTask(replace(task.cfg, haystack_len=length))
        with ctx.timed("build_task"):
            data = each.build(task.cfg.n_prompts, seed=ctx.cfg.seed + EVAL_SEED_OFFSET, model=model)
        sets.append((length, each, data.to(str(model.input_device))))
    return sets


def _pooled(found: list[Retrieval]) -> Retrieval:
    """The prompts of every haystack length as one set; answers padded with -1 to the longest."""
    answers = None
    if all(f.answers is not None for f in found):
        width = max(f.answers.shape[1] for f in found)  # type: ignore[union-attr]
        answers = torch.cat(
            [torch.nn.functional.pad(f.answers, (0, width - f.answers.shape[1]), value=-1) for f in found]  # type: ignore[union-attr,arg-type]
        )
    return Retrieval(torch.cat([f.scores for f in found], 1), torch.cat([f.recall for f in found]), answers)


def _masked(
    ctx: RunContext, model: HookedModel, sets: list, found: list[Retrieval], groups: list[list[tuple[int, int]]]
) -> tuple[np.ndarray, list[str]]:
    """Per-prompt quantities [1 + len(groups), n, Q] over every prompt set (the clean run first), and
    their names."""
    sc = ctx.options
    if sc.masking == "greedy":
        parts = [
            torch.cat(
                [
                    got.recall[None],
                    greedy_masked_recall(model, data, groups, 8, ctx.show_progress, sc.max_new_tokens, sc.recall),
                ]
            )
            for (_, _, data), got in zip(sets, found)
        ]
        return torch.cat(parts, 1)[..., None].numpy(), ["needle_recall"]
    parts = [masked_quantities(model, task, data, groups, seed=ctx.cfg.seed).cpu() for _, task, data in sets]
    return torch.cat(parts, 1).numpy(), list(sets[0][1].quantities)


def _induction_overlap(model: HookedModel, top: list[tuple[int, int]], n_seq: int, seed: int) -> list[tuple[int, int]]:
    """The heads of `top` that are also among as many heads of highest induction score, on n_seq
    repeated random sequences (as short as the model's positions need)."""
    limit = max_positions(model)
    repeat = INDUCTION_REPEAT if limit is None else min(INDUCTION_REPEAT, (limit - 1) // 2)
    induction = induction_scores(model, n_seq, repeat, seed)[..., 2].mean(-1).flatten()  # [layer * head]
    best = set(top_heads(induction, model.n_heads, len(top)))
    return [h for h in top if h in best]


def _overlap_rows(shared: int, k: int, info: dict) -> pd.DataFrame:
    row = {"intervention": "none", "method": "overlap", "metric": "top_k_induction_overlap", "value": float(shared)}
    return pd.DataFrame([{**info, **row, "n": k}])


def _answers(model, answers) -> list[str]:
    """The first few greedy answers as text (token ids where the model has no tokenizer)."""
    if answers is None:
        return []
    rows = [[t for t in row if t >= 0] for row in answers[:SHOWN_ANSWERS].tolist()]
    tokenizer = model.tokenizer
    return [tokenizer.decode(row) if tokenizer is not None else " ".join(map(str, row)) for row in rows]


def _score_rows(scores: np.ndarray, counted: np.ndarray, n_heads: int, info: dict, n_boot: int) -> pd.DataFrame:
    """retrieval_score per head: per-prompt scores [heads, n], prompts that do not count left out as NaN."""
    labels = [
        {
            "intervention": "none",
            "method": "score",
            "layer": layer,
            "head": head,
            "hook": hook_name(Site.pattern, layer),  # the score counts the key each head attends to most
        }
        for layer, head in (divmod(i, n_heads) for i in range(scores.shape[0]))
    ]
    quantities = np.where(counted[None, :], scores, np.nan)[..., None].astype(np.float64)
    metrics = {"retrieval_score": nanmean_of(0)}
    rows = results.tidy(info, labels, quantities, ["retrieval_score"], {}, metrics, n_boot=n_boot)
    return rows.assign(n=int(counted.sum()))


def _mask_rows(quantities: np.ndarray, names: list[str], groups: list[str], info: dict, n_boot: int) -> pd.DataFrame:
    """The clean run and each masked group: its metrics, and the recall drop paired over prompts."""
    masked = {"intervention": "mask_heads", "method": "zero", "site": "q"}  # no hook: a group's heads may span layers
    labels = [{"intervention": "none", "method": "none"}, *({**masked, "group": g} for g in groups)]
    aggregates = {name: mean_of(i) for i, name in enumerate(names)}
    metrics = results.tidy(info, labels, quantities, names, {}, aggregates, n_boot=n_boot)
    column = names.index("needle_recall")
    drop = (quantities[:1, :, column] - quantities[1:, :, column])[..., None]
    aggregate = {"needle_recall_drop": mean_of(0)}
    drops = results.tidy(info, labels[1:], drop, ["needle_recall_drop"], {}, aggregate, n_boot=n_boot)
    return pd.concat([metrics, drops], ignore_index=True)


STUDY = Study(
    name="retrieval",
    description="retrieval heads on task=needle (Wu et al. 2024): scores, then top heads masked vs random",
    run=run,
    summary=head_table,
    reads=("train",),
    figures="scores",
    schema=RetrievalOptions,
)
