"""`headlab run task=needle scores=retrieval`: retrieval heads (Wu et al. 2024, analysis/retrieval.py).

Rows:
  per head      intervention "none", method "score", metric retrieval_score: the mean over the prompts whose
                needle recall exceeds `study.min_recall` (their number is `n`) of copy-paste events /
                needle length, during greedy decoding (Wu et al.'s) or teacher-forced (study.decoding);
                95% bootstrap interval over those prompts
  masking       the clean run (intervention "none", method "none"), then intervention "mask_heads", method
                "zero", site "q", group "top{k}" (the `study.top_k` best heads masked together) and
                "random{k}_{draw}" (`study.n_random` draws of k heads from outside the top
                max(top_k, `study.random_outside`)): metrics needle_recall, needle_logprob (teacher-forced
                answer) and needle_recall_drop (clean minus masked, paired over prompts)
meta.json also holds share_above_0.1, the share of heads whose retrieval score exceeds 0.1 (Wu et al.'s
retrieval heads: 3-6% of the heads of their 6B-14B models), and a few greedy answers.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from .. import results
from ..analysis.head_sets import avoided_heads, random_heads, top_heads
from ..analysis.retrieval import masked_quantities, needle_length, retrieval_scores
from ..config import run_info
from ..config_rules import COUNT, DECODINGS, NATURAL, OneOf, Range, setting
from ..errors import HeadlabError, UsageError
from ..tables import head_name
from ..tasks import mean_of, nanmean_of
from ..tasks.needle import NeedleTask
from ..vocabulary import Site, hook_name
from .context import RunContext
from .study import Study, StudyOptions
from .summary import head_table

TOP_HEADS = 10  # named in meta.json
RETRIEVAL_HEAD = 0.1  # Wu et al. call a head with a retrieval score above this a retrieval head
SHOWN_ANSWERS = 3  # greedy answers written to meta.json


@dataclass
class HeadSetOptions(StudyOptions):
    """The top heads knocked out together, against random draws of as many others (retrieval, induction)."""

    top_k: int = setting(5, COUNT)  # heads masked (retrieval) or zero-ablated (induction) together
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


def run(ctx: RunContext) -> pd.DataFrame:
    cfg, sc = ctx.cfg, ctx.options
    if sc.n_random < 0:
        raise UsageError(f"study.n_random must be 0 or more, not {sc.n_random}")
    if not isinstance(ctx.get_task(), NeedleTask):  # before a model is loaded or trained for nothing
        raise UsageError(f"study=retrieval needs needle-in-a-haystack prompts (task=needle), not task={cfg.task.name}")
    data = ctx.get_data()
    model, task = ctx.get_model(), ctx.get_task()
    n_total = model.n_layers * model.n_heads
    if not 1 <= sc.top_k <= n_total:
        raise UsageError(f"study.top_k must lie in 1..{n_total} (the heads of {model.name}), not {sc.top_k}")
    with ctx.timed("retrieval"):
        found = retrieval_scores(model, data, decoding=sc.decoding, show_progress=ctx.show_progress)
    counted = found.counted(sc.min_recall)
    if not counted.any():
        raise HeadlabError(
            f"study=retrieval: no prompt's needle recall exceeds study.min_recall={sc.min_recall} (mean "
            f"{found.recall.mean():.3f}): {model.name} does not retrieve the needle; -1 counts every prompt"
        )
    info = run_info(cfg)
    scores = found.mean(sc.min_recall)
    top = top_heads(scores, model.n_heads, sc.top_k)
    avoid = avoided_heads(scores, model.n_heads, sc.top_k, sc.random_outside)
    draws, apart = random_heads(model.n_layers, model.n_heads, avoid, sc.top_k, sc.n_random, cfg.seed)
    if not apart:
        ctx.note(f"fewer than {sc.top_k} heads besides the top {len(avoid)}: random draws may include top heads")
    with ctx.timed("masking"):
        quantities = masked_quantities(model, task, data, [top, *draws], seed=cfg.seed).cpu().numpy()
    groups = [f"top{sc.top_k}", *(f"random{sc.top_k}_{d}" for d in range(len(draws)))]
    table = pd.concat(
        [
            _score_rows(found.scores.numpy(), counted.numpy(), model.n_heads, info, cfg.output.n_boot),
            _mask_rows(quantities, groups, task, data.answers_np(), info, cfg.output.n_boot),
        ],
        ignore_index=True,
    )
    recall = quantities[..., task.quantities.index("needle_recall")].mean(1)  # [1 + groups]
    ctx.meta.update(
        {
            "top_retrieval_heads": [
                f"{head_name(*divmod(i, model.n_heads))} {scores[i].item():.3f}"
                for i in scores.argsort(descending=True, stable=True)[:TOP_HEADS].tolist()
            ],
            "decoding": sc.decoding,
            "share_above_0.1": float((scores > RETRIEVAL_HEAD).float().mean()),
            "n_above_0.1": int((scores > RETRIEVAL_HEAD).sum()),
            "n_heads": n_total,
            "recall_scoring": float(found.recall.mean()),
            "answers": _answers(model, found.answers),
            "masked_top_heads": [head_name(*h) for h in top],
            "masked_random_heads": [[head_name(*h) for h in heads] for heads in draws],
            "recall_clean": float(recall[0]),
            "recall_top_k_masked": float(recall[1]),
            "recall_random_k_masked": [float(r) for r in recall[2:]],
            "recall_random_k_masked_mean": float(recall[2:].mean()) if len(draws) else None,
            "top_k": sc.top_k,
            "n_random": sc.n_random,
            "random_outside": len(avoid),
            "min_recall": sc.min_recall,
            "n_prompts": data.n,
            "n_scored_prompts": int(counted.sum()),
            "needle_len": needle_length(data),
            "masking": "query zeroed at the copy steps (uniform attention over the context), as Wu et al. mask heads",
            "model_family": model.family,
        }
    )
    return results.conform(table)


def _answers(model, answers) -> list[str]:
    """The first few greedy answers as text (token ids where the model has no tokenizer)."""
    if answers is None:
        return []
    rows = answers[:SHOWN_ANSWERS].tolist()
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


def _mask_rows(quantities: np.ndarray, groups: list[str], task, answers: dict, info: dict, n_boot: int) -> pd.DataFrame:
    """The clean run and each masked group: the task's metrics, and the recall drop paired over prompts."""
    masked = {"intervention": "mask_heads", "method": "zero", "site": "q"}  # no hook: a group's heads may span layers
    labels = [{"intervention": "none", "method": "none"}, *({**masked, "group": g} for g in groups)]
    metrics = results.tidy(info, labels, quantities, task.quantities, answers, task.aggregates, n_boot=n_boot)
    column = task.quantities.index("needle_recall")
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
