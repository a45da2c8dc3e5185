"""Recall vs reasoning (arXiv 2510.03366): matched prompts over the same entities, one answer token each.

Two kinds of prompt share a table and every metric is reported per kind:
  recall     retrieve a stored fact:                        E_i R_r =            -> V (memorised)
  reasoning  two-hop composition over facts in the context:  a>b. d>e. b>c. e>f. ? a     -> c
Source `synthetic` (models trained here): a world of random entities, each with one value per relation,
fixed by task.world_seed. Training mixes fact statements (to memorise) and fresh reasoning problems; the
held-out reasoning problems are new draws, so their answers cannot be memorised: the same query with other
in-context links has another answer. Source `facts` (pretrained LMs): the built-in fact table
(tasks/facts.py) and reasoning prompts over its subjects, tokenised by the model's tokenizer.

Per prompt: correct (argmax is the answer), margin (answer logit minus the best other candidate of the
same kind), kind (0 recall, 1 reasoning). Counterfactual: recall with another entity, reasoning with the
query moved to the other chain (a minimal pair: same tokens, other answer). Reference (mean ablation,
resampling): fresh prompts of the same kind, meaned per kind.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, replace

import numpy as np
import torch
from torch import Tensor

from ..config_rules import COUNT, NATURAL, SHARE, OneOf, at_least, setting
from ..errors import HeadlabError, UsageError
from .base import Task, TaskConfig, TaskData, bos_prefix, right_padded

PAD, BOS, IS, ARROW, SEP, QUERY, QUERY1 = range(7)
SPECIAL = ("[PAD]", "[BOS]", "=", ">", ".", "?", "?1")  # ?1: a one-hop question, a training curriculum only
RECALL, REASONING = 0, 1
KINDS = ("recall", "reasoning")
N_LINKS = 4  # two chains of two links each
# roles of a position in a training prompt (context_classes)
CONTEXT_CLASSES = (
    "start",
    "first entity",
    "recall relation",
    "recall =",
    "link source",
    "link >",
    "link target",
    "link .",
    "two-hop ?",
    "two-hop query",
    "one-hop ?1",
    "one-hop query",
)


@dataclass
class RecallReasoningConfig(TaskConfig):
    name: str = "recall_reasoning"
    n_prompts: int = setting(400, at_least(2))  # half recall, half reasoning
    # synthetic (a world for models trained here) | facts (pretrained LMs)
    source: str = setting("synthetic", OneOf(("synthetic", "facts")))
    n_entities: int = setting(40, COUNT)
    n_relations: int = setting(3, COUNT)
    n_values: int = setting(10, COUNT)
    world_seed: int = 0  # the synthetic world's facts; the same for training and evaluation
    recall_fraction: float = setting(0.3, SHARE)  # share of fact statements in the training stream
    one_hop_fraction: float = setting(0.2, SHARE)  # share of one-hop problems after one_hop_steps
    # training steps with one-hop problems only (besides facts): the curriculum
    one_hop_steps: int = setting(2000, NATURAL)
    # facts: None starts each prompt as the tokenizer does (Gemma's <bos>; nothing for SmolLM2 or GPT-2);
    # true / false: its BOS token / nothing (tasks/base.py bos_prefix)
    prepend_bos: bool | None = None
    # facts: "statements" (cloze sentences, transitive / two-hop reasoning) | "questions" (the paper's Q/A pairs:
    # a recall question and a reasoning question over the same country, tasks/facts.py question_pairs)
    facts_style: str = setting("statements", OneOf(("statements", "questions")))


def _kind_mean(column: int, kind: int):
    def aggregate(q: np.ndarray, answers: dict[str, np.ndarray]) -> np.ndarray:
        mask = answers["kind"] == kind  # [n], or [resamples, n] for the bootstrap's
        if mask.ndim == 1:
            return q[..., mask, column].mean(-1)
        with np.errstate(invalid="ignore"):  # a resample without this kind: NaN
            return np.where(mask, q[..., column], 0).sum(-1) / mask.sum(-1)

    return aggregate


def other_kind(data: TaskData) -> TaskData:
    """The same prompts with each one's counterfactual the prompt of the other kind it is paired with
    (the i-th recall prompt with the i-th reasoning prompt: over the same entity in the synthetic world),
    its ANSWER position read where that prompt has it: patching from it carries one kind's activations
    into the other kind's run."""
    kind = data.answers["kind"]
    recall, reasoning = (kind == RECALL).nonzero().squeeze(1), (kind == REASONING).nonzero().squeeze(1)
    if len(recall) != len(reasoning):
        raise ValueError(f"pairing needs as many recall as reasoning prompts, not {len(recall)} and {len(reasoning)}")
    pair = torch.empty_like(kind)
    pair[recall], pair[reasoning] = reasoning, recall
    assert data.token_positions is not None  # both kinds of build() set ANSWER
    return replace(
        data,
        counterfactual={k: v[pair] for k, v in data.inputs.items()},
        counterfactual_positions={"ANSWER": data.token_positions["ANSWER"][pair]},
    )


class RecallReasoningTask(Task):
    name = "recall_reasoning"
    options = RecallReasoningConfig
    quantities = ("correct", "margin")
    smooth_quantity = "margin"
    cfg: RecallReasoningConfig

    def __init__(self, cfg: RecallReasoningConfig):
        self.cfg = cfg
        self.aggregates = {
            "recall_acc": _kind_mean(0, RECALL),
            "reasoning_acc": _kind_mean(0, REASONING),
            "recall_margin": _kind_mean(1, RECALL),
            "reasoning_margin": _kind_mean(1, REASONING),
        }
        if cfg.source not in ("synthetic", "facts"):
            raise UsageError(f"unknown task.source '{cfg.source}'; choose from: synthetic, facts")
        self.needs_tokenizer = cfg.source == "facts"
        if cfg.source == "facts":
            return
        if cfg.n_entities < 2 * 3 + 1:
            raise UsageError(
                f"task.n_entities must be at least 7 (two chains of three and a spare), not {cfg.n_entities}"
            )
        self.n_rel, self.n_val, self.n_ent = cfg.n_relations, cfg.n_values, cfg.n_entities
        self.rel0 = len(SPECIAL)
        self.ent0 = self.rel0 + self.n_rel
        self.val0 = self.ent0 + self.n_ent
        self.vocab_size = self.val0 + self.n_val
        self.max_len = 1 + 4 * N_LINKS + 2
        world = np.random.default_rng(cfg.world_seed)
        self.attributes = world.integers(0, self.n_val, size=(self.n_ent, self.n_rel))  # the facts to memorise
        self.token_names = {i: s for i, s in enumerate(SPECIAL)}
        # every token's text, for tables of contexts: entities e0.., relations r0.., values v0..
        self.token_strings = [
            *SPECIAL,
            *(f"r{i}" for i in range(self.n_rel)),
            *(f"e{i}" for i in range(self.n_ent)),
            *(f"v{i}" for i in range(self.n_val)),
        ]

    # ------------------------------------------------------------------ prompts

    def recall(self, entity: Tensor, relation: Tensor) -> tuple[Tensor, Tensor]:
        """Prompts [n, max_len] (right-padded) and answer tokens [n]."""
        n = entity.shape[0]
        ids = torch.full((n, self.max_len), PAD, dtype=torch.long)
        ids[:, 0], ids[:, 1], ids[:, 2], ids[:, 3] = BOS, self.ent0 + entity, self.rel0 + relation, IS
        values = torch.from_numpy(self.attributes)[entity, relation]
        return ids, self.val0 + values

    def reasoning(self, chains: Tensor, order: Tensor, query: Tensor, hops: int = 2) -> tuple[Tensor, Tensor]:
        """chains [n, 2, 3] entity ids (a>b>c, d>e>f), order [n, 4] permutation of the links,
        query [n] which chain is asked (its first entity); answer: the entity `hops` links on."""
        n = chains.shape[0]
        links = torch.stack([chains[:, 0, :2], chains[:, 0, 1:], chains[:, 1, :2], chains[:, 1, 1:]], 1)
        links = links[torch.arange(n)[:, None], order]  # [n, 4, 2] in stated order
        ids = torch.full((n, self.max_len), PAD, dtype=torch.long)
        ids[:, 0] = BOS
        body = torch.stack(
            [
                self.ent0 + links[..., 0],
                torch.full_like(links[..., 0], ARROW),
                self.ent0 + links[..., 1],
                torch.full_like(links[..., 0], SEP),
            ],
            -1,
        )
        ids[:, 1 : 1 + 4 * N_LINKS] = body.flatten(1)
        rows = torch.arange(n)
        # the question ends on the query entity itself: its own embedding is the lookup key
        ids[:, -2], ids[:, -1] = QUERY if hops == 2 else QUERY1, self.ent0 + chains[rows, query, 0]
        return ids, self.ent0 + chains[rows, query, hops]

    def context_classes(self, ids: Tensor) -> tuple[Tensor, tuple[str, ...]] | None:
        """Each position's role in its prompt ([n, pos] indices into the names): what an SAE feature's
        activating contexts are labelled with. Only what the model has seen so far decides a role: position
        1 is the first entity of a fact statement or of a problem's first link alike, and the links of
        one- and two-hop problems share roles until the question mark tells them apart."""
        if self.cfg.source == "facts":
            return None  # tokenised text: the caller falls back to token types
        names = CONTEXT_CLASSES
        n, length = ids.shape
        pos = torch.arange(length).expand(n, length)
        link = torch.tensor([names.index(c) for c in ("link source", "link >", "link target", "link .")])
        out = link[(pos - 1).clamp_min(0) % 4]
        is_recall = (ids[:, 3:4] == IS) if length > 3 else torch.zeros(n, 1, dtype=torch.bool)
        out = torch.where(is_recall & (pos == 2), names.index("recall relation"), out)
        out = torch.where(is_recall & (pos == 3), names.index("recall ="), out)
        before = torch.full_like(ids, PAD)
        before[:, 1:] = ids[:, :-1]
        for mark, hop in ((QUERY, "two-hop"), (QUERY1, "one-hop")):
            out = torch.where(~is_recall & (ids == mark), names.index(f"{hop} {SPECIAL[mark]}"), out)
            out = torch.where(~is_recall & (before == mark), names.index(f"{hop} query"), out)
        out = torch.where(pos == 1, names.index("first entity"), out)
        return torch.where(pos == 0, names.index("start"), out), names

    def _draw_reasoning(self, n: int, gen: torch.Generator, first: Tensor | None = None):
        """Two chains of three distinct entities; chain 0 starts at `first` when given."""
        scores = torch.rand(n, self.n_ent, generator=gen)
        if first is not None:
            scores[torch.arange(n), first] = 2.0  # drawn first
        chosen = scores.argsort(1, descending=True)[:, :6]
        chains = chosen.view(n, 2, 3)
        order = torch.rand(n, N_LINKS, generator=gen).argsort(1)
        return chains, order

    def _draw_facts(self, n: int, gen: torch.Generator) -> tuple[Tensor, Tensor]:
        return torch.randint(0, self.n_ent, (n,), generator=gen), torch.randint(0, self.n_rel, (n,), generator=gen)

    def build(self, n: int, seed: int, model=None) -> TaskData:
        if self.cfg.source == "facts":
            return self._build_facts(n, seed, model)
        return self._build_synthetic(n, seed)

    def _build_synthetic(self, n: int, seed: int) -> TaskData:
        """n // 2 recall prompts (every fact once when n // 2 covers them) and as many reasoning prompts
        whose query starts at the same entities."""
        gen = torch.Generator().manual_seed(seed)
        half = n // 2
        facts = self.n_ent * self.n_rel
        index = torch.arange(half) % facts if half >= facts else torch.randperm(facts, generator=gen)[:half]
        entity, relation = index // self.n_rel, index % self.n_rel
        rec_ids, rec_ans = self.recall(entity, relation)
        chains, order = self._draw_reasoning(half, gen, first=entity)
        query = torch.zeros(half, dtype=torch.long)
        rea_ids, rea_ans = self.reasoning(chains, order, query)
        # counterfactuals: another entity with another value; the other chain of the same context
        other = (entity + torch.randint(1, self.n_ent, (half,), generator=gen)) % self.n_ent
        value = torch.from_numpy(self.attributes)
        for _ in range(20):  # step to the next entity until the counterfactual's answer differs
            same = value[other, relation] == value[entity, relation]
            if not same.any():
                break
            other[same] = (other[same] + 1) % self.n_ent
        cf_rec, cf_rec_ans = self.recall(other, relation)
        cf_rea, cf_rea_ans = self.reasoning(chains, order, 1 - query)
        # reference: fresh prompts of each kind
        ref_rec, _ = self.recall(*self._draw_facts(half, gen))
        ref_chains, ref_order = self._draw_reasoning(half, gen)
        ref_rea, _ = self.reasoning(ref_chains, ref_order, torch.randint(0, 2, (half,), generator=gen))
        kind = torch.cat([torch.full((half,), RECALL), torch.full((half,), REASONING)])
        read = torch.cat([torch.full((half,), 3), torch.full((half,), self.max_len - 1)])
        return TaskData(
            inputs={"input_ids": torch.cat([rec_ids, rea_ids])},
            positions=read[:, None],
            answers={
                "answer": torch.cat([rec_ans, rea_ans]),
                "counter_answer": torch.cat([cf_rec_ans, cf_rea_ans]),
                "kind": kind,
                "candidates": self._synthetic_candidates(torch.cat([rec_ans, rea_ans]), kind),
            },
            counterfactual={"input_ids": torch.cat([cf_rec, cf_rea])},
            reference={"input_ids": torch.cat([ref_rec, ref_rea])},
            token_positions={"ANSWER": read},
            groups=kind,
            reference_groups=kind.clone(),
        )

    # ------------------------------------------------------------------ metrics and training

    def _synthetic_candidates(self, answer: Tensor, kind: Tensor) -> Tensor:
        """[n, C] the other tokens that could answer a prompt of its kind (values or entities), -1 padded."""
        values = torch.arange(self.val0, self.val0 + self.n_val)
        entities = torch.arange(self.ent0, self.ent0 + self.n_ent)
        width = max(self.n_val, self.n_ent)
        pool = torch.stack(
            [
                torch.cat([values, torch.full((width - self.n_val,), -1)]),
                torch.cat([entities, torch.full((width - self.n_ent,), -1)]),
            ]
        )
        out = pool[kind]
        return torch.where(out == answer[:, None], -1, out)

    def per_prompt(self, logits: Tensor, data: TaskData) -> Tensor:
        last = logits[..., 0, :].float()  # [..., n, vocab]
        answer = data.answers["answer"].to(last.device)
        correct = (last.argmax(-1) == answer).float()
        target = last.gather(-1, answer.expand(*last.shape[:-2], -1).unsqueeze(-1)).squeeze(-1)
        candidates = data.answers["candidates"].to(last.device)  # [n, C]
        others = last.gather(-1, candidates.clamp_min(0).expand(*last.shape[:-2], -1, -1))
        best_other = others.masked_fill(candidates < 0, float("-inf")).amax(-1)
        return torch.stack([correct, target - best_other], -1)

    # ------------------------------------------------------------------ pretrained LMs: the fact table

    def _build_facts(self, n: int, seed: int, model) -> TaskData:
        """n // 2 recall prompts from the fact table and n // 2 reasoning prompts (transitive and two-hop,
        alternating) over its single-token country subjects, in the model's tokenizer, right-padded."""
        from . import facts as table

        tok = getattr(model, "tokenizer", None)
        if tok is None:
            raise HeadlabError("task.source=facts needs the model's tokenizer (model.tokenizer=<name or dir>)")
        rng = random.Random(seed)
        usable = [f for f in table.FACTS if not table.check_single_tokens(tok, [" " + f.answer])]
        if len(usable) < 20:
            raise HeadlabError(f"only {len(usable)} fact answers are single tokens for {model.name}'s tokenizer")
        half = n // 2
        rows: list[str] = []
        kinds: list[int] = []
        answers: list[str] = []
        candidates: list[list[str]] = []
        if self.cfg.facts_style == "questions":
            self._question_rows(table, tok, rng, half, (rows, kinds, answers, candidates))
        elif self.cfg.facts_style == "statements":
            self._statement_rows(table, usable, tok, rng, half, (rows, kinds, answers, candidates))
        else:
            raise UsageError(f"unknown task.facts_style '{self.cfg.facts_style}'; choose from: statements, questions")
        bos = bos_prefix(tok, self.cfg.prepend_bos)
        encoded = [bos + tok(r, add_special_tokens=False)["input_ids"] for r in rows]
        ids = right_padded(encoded, tok)["input_ids"]  # no mask: each prompt reads at its own last token
        read = torch.tensor([len(e) - 1 for e in encoded])
        one = lambda w: tok(w, add_special_tokens=False)["input_ids"][0]  # noqa: E731
        c_width = max(len(c) for c in candidates)
        cand = torch.full((len(rows), c_width), -1, dtype=torch.long)
        for i, c in enumerate(candidates):
            cand[i, : len(c)] = torch.tensor([one(w) for w in c])
        kind = torch.tensor(kinds)
        return TaskData(
            inputs={"input_ids": ids},
            positions=read[:, None],
            answers={"answer": torch.tensor([one(a) for a in answers]), "kind": kind, "candidates": cand},
            reference={"input_ids": ids.clone()},  # means over the same prompts, per kind
            token_positions={"ANSWER": read},
            groups=kind,
            reference_groups=kind.clone(),
        )

    @staticmethod
    def _statement_rows(table, usable, tok, rng: random.Random, half: int, out: tuple) -> None:
        rows, kinds, answers, candidates = out
        subjects = table.single_token_subjects(tok)
        for fact in rng.sample(usable, min(half, len(usable))):
            prompt, answer = table.recall_prompt(fact)
            same = sorted({" " + f.answer for f in usable if f.relation == fact.relation} - {answer})
            rows.append(prompt)
            kinds.append(RECALL)
            answers.append(answer)
            candidates.append(same)
        for i in range(half):
            reasoning_kind = table.REASONING_KINDS[i % len(table.REASONING_KINDS)]
            prompt, answer, others = table.reasoning_prompt(subjects, rng, kind=reasoning_kind)
            rows.append(prompt)
            kinds.append(REASONING)
            answers.append(answer)
            candidates.append(others)

    @staticmethod
    def _question_rows(table, tok, rng: random.Random, half: int, out: tuple) -> None:
        """The i-th recall and the i-th reasoning prompt are one fact's question pair (same country)."""
        rows, kinds, answers, candidates = out
        pairs = table.question_pairs(tok)
        chosen = rng.sample(pairs, min(half, len(pairs)))
        for kind, part in ((RECALL, "recall"), (REASONING, "reasoning")):
            for pair in chosen:
                prompt, answer = getattr(pair, part)
                if kind == RECALL:
                    pool = {p.recall[1] for p in pairs if p.fact.relation == pair.fact.relation}
                else:
                    pool = {" " + c for c in table.CONTINENTS}
                rows.append(prompt)
                kinds.append(kind)
                answers.append(answer)
                candidates.append(sorted(pool - {answer}))

    def train_batch(self, generator: torch.Generator, batch: int, step: int = 0) -> tuple[Tensor, Tensor]:
        """Fact statements, two-hop problems and one-hop problems; before task.one_hop_steps every problem
        is one-hop: the in-context lookup forms first, then the second hop is learned on top of it."""
        n_recall = int(round(batch * self.cfg.recall_fraction))
        share = 1.0 if step < self.cfg.one_hop_steps else self.cfg.one_hop_fraction / (1 - self.cfg.recall_fraction)
        n_one = int(round((batch - n_recall) * min(1.0, share)))
        n_two = batch - n_recall - n_one
        rec_ids, rec_ans = self.recall(*self._draw_facts(n_recall, generator))
        parts, answers = [rec_ids], [rec_ans]
        for count, hops in ((n_two, 2), (n_one, 1)):
            chains, order = self._draw_reasoning(count, generator)
            ids, ans = self.reasoning(chains, order, torch.randint(0, 2, (count,), generator=generator), hops)
            parts.append(ids)
            answers.append(ans)
        ids = torch.cat(parts)
        targets = torch.full_like(ids, -100)
        targets[:n_recall, 3] = answers[0]
        targets[n_recall:, -1] = torch.cat(answers[1:])
        return ids, targets


TASK = RecallReasoningTask  # found by tasks/registry.py
