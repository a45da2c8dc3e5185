"""Needle in a haystack (after Wu et al. 2024, arXiv 2404.15574): can the model copy back a needle it read
at a random depth of a haystack?

A needle of `needle_len` distinct random tokens sits at a random depth of a haystack of `haystack_len`
tokens; a question follows, then the needle again as the teacher-forced answer. Three layouts:
  a model with a tokenizer   [BOS] hay.. " The secret sequence is:" needle "." ..hay ask needle
                             ask, by task.prompt: question (Wu et al.'s, retrieval_head_detection.py)
                             "\nBased on the content of the book, Question: What is the secret sequence?
                             \nAnswer:"; chat, the same in the tokenizer's chat template (haystack
                             between <book> and </book>, as Wu et al. prompt chat models); cue (headlab
                             0.2's) " What is the secret sequence? The secret sequence is:", whose
                             repeated cue lets an induction head copy the needle on.
                             The haystack is a window of `task.haystack` (one long text, tokenized once)
                             or, without a file, random ordinary tokens. Token ids are joined as ids, never
                             re-tokenized, so the needle is the same ids at both places.
  a model trained here       [BOS] hay.. [KEY] needle ..hay [ASK] [KEY] needle
                             over the task's own `n_symbols` symbols (task.prompt does not apply): needles
                             from the second half, the haystack from the first, each hay token two tokens
                             back plus one (mod the half) with probability HAY_RULE, else random
  task.needles=sentences     natural facts in a text haystack, asked for as task.prompt says; the needle
                             is the answer's first needle_len tokens (tasks/needle_facts.py)
Read positions: the L copy steps, the queries whose next token is needle token j (the question's last
token, then the answer's first L-1 tokens). Per prompt: needle_recall (share of copy steps whose argmax is
the needle token) and needle_logprob (their mean log-probability). Roles: NEEDLE0.. (needle token j in
the haystack) and COPY0.. (copy step j). Answers: "needle" [n, L]; "answer" [n, A], the whole answer a
greedy decoding is scored against (a fact's answer, else the needle; padded with -1) and "answer_start"
[n], where it sits in the haystack. Counterfactual: another needle at the same place; reference: fresh
haystacks and needles at the same depths, so every role sits where it sits in the clean prompt.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor

from ..config_rules import COUNT, NATURAL, NEEDLES, Joint, OneOf, setting
from ..errors import UsageError
from ..locations import text_path
from .base import PRETRAINED_DEFAULTS, Task, TaskConfig, TaskData, mean_of
from .needle_facts import FactNeedles, asked, draw_depths, framing

PAD, BOS, KEY, ASK = range(4)
SPECIAL = ("[PAD]", "[BOS]", "[KEY]", "[ASK]")
STATEMENT = " The secret sequence is:"
STATEMENT_END = "."
QUESTION = " What is the secret sequence? The secret sequence is:"
SECRET_QUESTION = "What is the secret sequence?"
PROMPTS = ("question", "chat", "cue")  # task.prompt
MAX_HAYSTACK_CHARS = 2_000_000  # read at most this much of a haystack file: windows need far less
# A haystack of the task's own symbols follows a rule (hay token t = hay token t - 2, plus one) with this
# probability, and is trained on: predicting it needs a previous-token head, on which a standard induction
# (retrieval) head then forms. On rule-free haystacks with no loss, the model copied the needle by a
# shifted induction instead (value from p - 7, key from p - 8): its layer-1 heads attended 7 tokens past
# the needle token they copied, no retrieval head by Wu et al.'s score.
HAY_RULE = 0.9
# training: haystacks of at least this many tokens; in shorter ones the question follows the needle after a
# few fixed distances, which a layer-0 head reading one of them back turns into a shortcut.
MIN_TRAIN_HAYSTACK = 6


@dataclass
class NeedleConfig(TaskConfig):
    """Needle in a haystack (tasks/needle.py): random needle tokens hidden in a haystack, asked for at the end."""

    name: str = "needle"
    n_prompts: int = 200
    n_reference: int = 200
    # a text file (pretrained models): one long text, tokenized and cut into haystacks; null: random tokens
    haystack: str | None = None
    haystack_len: int = setting(48, COUNT)  # haystack tokens per prompt (the needle and its statement come on top)
    needle_len: int = setting(6, COUNT)
    # 0: each prompt's needle at a random depth; N: Wu et al.'s grid (retrieval_head_detection.py's
    # round(linspace(0, 100, N)) percent of the haystack, N = 10 there), prompt i at the (i mod N)-th depth
    depths: int = setting(0, NATURAL)
    n_symbols: int = setting(64, COUNT)  # models trained here: ordinary tokens of the task's own vocabulary
    # models with a tokenizer: random (needle_len random ordinary tokens after "The secret sequence is:") |
    # sentences (a fact, e.g. "The best thing to do in San Francisco is to eat a sandwich ...", asked
    # for at the end as Wu et al.'s needles are; the needle is its answer's first needle_len tokens)
    needles: str = setting("random", OneOf(NEEDLES))
    # models with a tokenizer: question (Wu et al.'s: the prompt ends with the question and "Answer:") |
    # chat (the same in the tokenizer's chat template, as Wu et al. prompt chat models) | cue (the
    # needle's cue repeated after the question, headlab 0.2's: an induction head can copy on)
    prompt: str = setting("question", OneOf(PROMPTS))
    JOINT: ClassVar[tuple[Joint, ...]] = (
        ("n_symbols", lambda c: c.n_symbols >= c.needle_len, "at least task.needle_len"),
    )


def needle_role(j: int) -> str:
    return f"NEEDLE{j}"


def copy_role(j: int) -> str:
    return f"COPY{j}"


class NeedleTask(Task):
    name = "needle"
    options = NeedleConfig
    quantities = ("needle_recall", "needle_logprob")
    smooth_quantity = "needle_logprob"
    cfg: NeedleConfig

    def __init__(self, cfg: NeedleConfig):
        self.cfg = cfg
        if cfg.needle_len < 1 or cfg.haystack_len < 0:
            raise UsageError(
                f"task.needle_len must be at least 1 and task.haystack_len at least 0, not {cfg.needle_len} and "
                f"{cfg.haystack_len}"
            )
        self.aggregates = {"needle_recall": mean_of(0), "needle_logprob": mean_of(1)}
        # a haystack file is text: it needs a tokenizer, and a pretrained model is the default then
        self.needs_tokenizer = cfg.haystack is not None
        self.default_models = PRETRAINED_DEFAULTS if cfg.haystack is not None else (("model=toy-copy",),)
        self.vocab_size = len(SPECIAL) + cfg.n_symbols
        self.max_len = cfg.haystack_len + 2 * cfg.needle_len + 4
        self.token_names = {BOS: "bos", KEY: "key", ASK: "ask"}
        self.token_strings = [*SPECIAL, *(f"s{i}" for i in range(cfg.n_symbols))]

    def refuse_model(self, name: str, has_tokenizer: bool, vocab_size: int | None) -> None:
        """Any model with a tokenizer serves (its words build the prompts); one without must have been
        trained on the task's own vocabulary."""
        if has_tokenizer:
            return
        super().refuse_model(name, has_tokenizer, vocab_size)

    # ------------------------------------------------------------------ prompts

    def build(self, n: int, seed: int, model: Any = None) -> TaskData:
        gen = torch.Generator().manual_seed(seed)
        tokenizer = getattr(model, "tokenizer", None)
        vocab = _Words(self.cfg, model) if tokenizer is not None else _Symbols(self.cfg)
        if tokenizer is None and self.cfg.haystack is not None:
            raise UsageError(
                "task.haystack is text and needs a model with a tokenizer (model=gpt2 or model.path=<dir>)"
            )
        if tokenizer is None and self.cfg.needles == "sentences":
            raise UsageError("task.needles=sentences needs a model with a tokenizer (model=gpt2 or model.path=<dir>)")
        if isinstance(vocab, _Words) and self.cfg.needles == "sentences":
            return self._build_facts(vocab, n, gen)
        depth = draw_depths(self.cfg.depths, self.cfg.haystack_len, n, gen)
        needle, hay = vocab.draw(n, gen)
        other = vocab.other_needle(needle, gen)
        ref_needle, ref_hay = vocab.draw(self.cfg.n_reference, gen)
        ref_depth = depth[torch.arange(self.cfg.n_reference) % n]
        clean = vocab.assemble(hay, depth, needle)
        vocab.check_length(clean.shape[1])
        inputs = vocab.inputs(clean)
        return TaskData(
            inputs=inputs,
            positions=self._copy_steps(clean.shape[1], n),
            answers={
                "needle": needle,
                "depth": depth.double() / max(1, self.cfg.haystack_len),
                "answer": needle,
                "answer_start": vocab.needle_start(depth),
            },
            counterfactual=vocab.inputs(vocab.assemble(hay, depth, other)),
            reference=vocab.inputs(vocab.assemble(ref_hay, ref_depth, ref_needle)),
            token_positions=self._roles(vocab.needle_start(depth), clean.shape[1]),
        )

    def _build_facts(self, vocab: _Words, n: int, gen: torch.Generator) -> TaskData:
        """task.needles=sentences: natural facts in a text haystack (tasks/needle_facts.py)."""
        made = FactNeedles(self.cfg, vocab.model.tokenizer, vocab.text, vocab.bos).build(
            n, self.cfg.n_reference, gen, vocab.other_needle
        )
        length = made.clean.shape[1]
        vocab.check_length(length)
        return TaskData(
            inputs=vocab.inputs(made.clean),
            positions=self._copy_steps(length, n),
            answers={
                "needle": made.needle,
                "depth": made.depth,
                "answer": made.answer,
                "answer_start": made.needle_start,
            },
            counterfactual=vocab.inputs(made.counterfactual),
            reference=vocab.inputs(made.reference),
            token_positions=self._roles(made.needle_start, length),
        )

    def _copy_steps(self, length: int, n: int) -> Tensor:
        """[n, L]: the query positions whose next token is needle token j (the answer ends the prompt)."""
        length_l = self.cfg.needle_len
        return torch.arange(length - length_l - 1, length - 1).expand(n, length_l).clone()

    def _roles(self, start: Tensor, length: int) -> dict[str, Tensor]:
        steps = self._copy_steps(length, start.shape[0])
        roles = {needle_role(j): start + j for j in range(self.cfg.needle_len)}
        return roles | {copy_role(j): steps[:, j] for j in range(self.cfg.needle_len)}

    def per_prompt(self, logits: Tensor, data: TaskData) -> Tensor:
        needle = data.answers["needle"].to(logits.device)  # [n, L]
        logprobs = logits.float().log_softmax(-1)
        target = needle.expand(*logits.shape[:-1])
        recall = (logits.argmax(-1) == target).float().mean(-1)
        logprob = logprobs.gather(-1, target.unsqueeze(-1)).squeeze(-1).mean(-1)
        return torch.stack([recall, logprob], dim=-1)

    # ------------------------------------------------------------------ training (own vocabulary)

    def train_batch(self, generator: torch.Generator, batch: int, step: int = 0) -> tuple[Tensor, Tensor]:
        """A batch whose haystacks all have one length, drawn from MIN_TRAIN_HAYSTACK..haystack_len.
        The loss is on the copy steps, the question, and the hay tokens the rule can predict (two hay
        tokens before them); not on the needle's first reading, which is random."""
        symbols = _Symbols(self.cfg)
        shortest = min(MIN_TRAIN_HAYSTACK, self.cfg.haystack_len)
        length = int(torch.randint(shortest, self.cfg.haystack_len + 1, (1,), generator=generator))
        depth = torch.randint(0, length + 1, (batch,), generator=generator)
        needle, hay = symbols.draw(batch, generator, length)
        seq = symbols.assemble(hay, depth, needle)
        inputs, targets = seq[:, :-1], seq[:, 1:].clone()
        question = (seq == ASK).nonzero()[:, 1].view(-1, 1)
        hay_at = symbols.is_hay(seq)
        ruled = hay_at[:, 2:] & hay_at[:, 1:-1] & hay_at[:, :-2]  # target t + 1 and the two tokens before it
        ruled = torch.cat([torch.zeros_like(ruled[:, :1]), ruled], 1)
        targets[(torch.arange(targets.shape[1]) + 1 < question) & ~ruled] = -100
        return inputs, targets

    def decision_targets(self, inputs: Tensor, targets: Tensor) -> Tensor:
        """Only the copy steps keep their targets: every position after [ASK] (predicting the haystack
        and the needle's first reading is no part of the task)."""
        after_ask = ((inputs == ASK).cumsum(1) > 0) & (inputs != ASK)
        return targets.masked_fill(~after_ask, -100)


class _Symbols:
    """The task's own vocabulary: [PAD] [BOS] [KEY] [ASK], then n_symbols ordinary symbols: the first half
    for haystacks, the second for needles."""

    first = len(SPECIAL)

    def __init__(self, cfg: NeedleConfig):
        if cfg.n_symbols < 4 * cfg.needle_len:  # the needle half holds a needle and its counterfactual
            raise UsageError(
                f"task.n_symbols={cfg.n_symbols} must be at least four times task.needle_len={cfg.needle_len}"
            )
        self.cfg = cfg

    def draw(self, n: int, gen: torch.Generator, length: int | None = None) -> tuple[Tensor, Tensor]:
        """(needles [n, L] of distinct needle symbols, haystacks [n, length] (default haystack_len) of hay
        symbols by the rule)."""
        cfg, half = self.cfg, self.cfg.n_symbols // 2
        needle = torch.rand(n, cfg.n_symbols - half, generator=gen).argsort(1)[:, : cfg.needle_len] + self.first + half
        size = cfg.haystack_len if length is None else length
        hay = torch.randint(0, half, (n, size), generator=gen)
        ruled = torch.rand(n, size, generator=gen) < HAY_RULE
        for t in range(2, size):
            hay[:, t] = torch.where(ruled[:, t], (hay[:, t - 2] + 1) % half, hay[:, t])
        return needle, hay + self.first

    def is_hay(self, ids: Tensor) -> Tensor:
        return (ids >= self.first) & (ids < self.first + self.cfg.n_symbols // 2)

    def other_needle(self, needle: Tensor, gen: torch.Generator) -> Tensor:
        """Another needle of distinct needle symbols, none of them the clean needle's."""
        n, half = needle.shape[0], self.cfg.n_symbols // 2
        taken = torch.zeros(n, self.cfg.n_symbols - half, dtype=torch.bool).scatter_(
            1, needle - self.first - half, True
        )
        scores = torch.rand(n, taken.shape[1], generator=gen).masked_fill(taken, 2.0)
        return scores.argsort(1)[:, : self.cfg.needle_len] + self.first + half

    def assemble(self, hay: Tensor, depth: Tensor, needle: Tensor) -> Tensor:
        n = hay.shape[0]
        rows = []
        for i in range(n):
            d = int(depth[i])
            rows.append(
                torch.cat(
                    [
                        torch.tensor([BOS]),
                        hay[i, :d],
                        torch.tensor([KEY]),
                        needle[i],
                        hay[i, d:],
                        torch.tensor([ASK, KEY]),
                        needle[i],
                    ]
                )
            )
        return torch.stack(rows)

    def needle_start(self, depth: Tensor) -> Tensor:
        return depth + 2  # [BOS], the haystack before the needle, [KEY]

    def inputs(self, ids: Tensor) -> dict[str, Tensor]:
        return {"input_ids": ids}

    def check_length(self, length: int) -> None:
        pass  # a toy model names its own limit (n_ctx) when it runs


class _Words:
    """A tokenizer's vocabulary: natural cues, a haystack from a text file or random ordinary tokens."""

    def __init__(self, cfg: NeedleConfig, model: Any):
        self.cfg = cfg
        self.model = model
        tok = model.tokenizer
        self.encode = lambda text: list(tok(text, add_special_tokens=False)["input_ids"])
        self.bos, book_end, closing = framing(cfg.prompt, tok)
        question = QUESTION if cfg.prompt == "cue" else book_end + asked(SECRET_QUESTION)
        self.statement, self.statement_end, self.question = map(self.encode, (STATEMENT, STATEMENT_END, question))
        self.question = self.question + closing
        rows = min(len(tok), getattr(model, "vocab_size", len(tok)))
        self.ordinary = ordinary_token_ids(tok, rows)
        if len(self.ordinary) < 2 * cfg.needle_len:
            raise UsageError(
                f"task needle: the tokenizer has {len(self.ordinary)} ordinary tokens, too few for a needle"
            )
        self.text = None if cfg.haystack is None else haystack_ids(cfg.haystack, tok)
        if self.text is not None and len(self.text) < cfg.haystack_len:
            raise UsageError(
                f"task.haystack={cfg.haystack} holds {len(self.text)} tokens, fewer than task.haystack_len="
                f"{cfg.haystack_len}"
            )

    def draw(self, n: int, gen: torch.Generator) -> tuple[Tensor, Tensor]:
        """(needles [n, L] of distinct ordinary tokens, haystacks [n, haystack_len]: windows of the text at
        random offsets, or ordinary tokens other than the needle's)."""
        cfg, m = self.cfg, len(self.ordinary)
        scores = torch.rand(n, m, generator=gen)
        order = scores.topk(cfg.needle_len, dim=1).indices
        needle = self.ordinary[order]
        if self.text is not None:
            start = torch.randint(0, len(self.text) - cfg.haystack_len + 1, (n,), generator=gen)
            return needle, self.text[start[:, None] + torch.arange(cfg.haystack_len)]
        pick = torch.randint(0, m - cfg.needle_len, (n, cfg.haystack_len), generator=gen)
        rest = scores.argsort(1)[:, : m - cfg.needle_len]  # the needle's tokens are the top scores
        return needle, self.ordinary[rest.gather(1, pick)]

    def other_needle(self, needle: Tensor, gen: torch.Generator) -> Tensor:
        scores = torch.rand(needle.shape[0], len(self.ordinary), generator=gen)
        scores[_in(self.ordinary, needle)] = -1.0  # never one of the clean needle's tokens
        return self.ordinary[scores.topk(self.cfg.needle_len, dim=1).indices]

    def assemble(self, hay: Tensor, depth: Tensor, needle: Tensor) -> Tensor:
        head = torch.tensor(self.bos, dtype=torch.long)
        statement, end = torch.tensor(self.statement), torch.tensor(self.statement_end)
        question = torch.tensor(self.question)
        rows = []
        for i in range(hay.shape[0]):
            d = int(depth[i])
            rows.append(torch.cat([head, hay[i, :d], statement, needle[i], end, hay[i, d:], question, needle[i]]))
        return torch.stack(rows)

    def needle_start(self, depth: Tensor) -> Tensor:
        return depth + len(self.bos) + len(self.statement)

    def inputs(self, ids: Tensor) -> dict[str, Tensor]:
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}

    def check_length(self, length: int) -> None:
        config = getattr(getattr(self.model, "module", None), "config", None)
        limit = getattr(config, "max_position_embeddings", None)
        if isinstance(limit, int) and length > limit:
            raise UsageError(
                f"task needle: prompts of {length} tokens exceed the model's {limit} positions; lower task.haystack_len"
            )


def _in(ids: Tensor, needle: Tensor) -> Tensor:
    """[n, m]: is ordinary token ids[k] one of prompt i's needle tokens."""
    return (ids[None, :, None] == needle[:, None, :]).any(-1)


def ordinary_token_ids(tokenizer: Any, rows: int) -> Tensor:
    """Token ids that are no special or added token: 1000..20000 for a vocabulary of more than 20000 ids,
    else all. The same choice as analysis/scores.py's ordinary_ids, made from the tokenizer alone (a task
    may not import analysis, which imports tasks)."""
    big = rows > 20000
    ids = torch.arange(1000 if big else 0, min(rows, 20000) if big else rows)
    special = set(getattr(tokenizer, "all_special_ids", [])) | set(getattr(tokenizer, "added_tokens_decoder", {}))
    return ids[~torch.isin(ids, torch.tensor(sorted(special), dtype=torch.long))]


def haystack_ids(path: str, tokenizer: Any) -> Tensor:
    """The token ids of a haystack text file (its first MAX_HAYSTACK_CHARS characters)."""
    where = text_path(path)
    if not where.is_file():
        raise UsageError(
            f"task.haystack={path}: no such file" if not where.exists() else f"task.haystack={path}: not a file"
        )
    try:
        with where.open(encoding="utf-8") as f:
            text = f.read(MAX_HAYSTACK_CHARS)
    except UnicodeDecodeError:
        raise UsageError(f"task.haystack={path}: not UTF-8 text") from None
    except OSError as e:
        raise UsageError(f"task.haystack={path}: cannot be read ({e.strerror})") from None
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if not ids:
        raise UsageError(f"task.haystack={path}: the file holds no text")
    return torch.tensor(ids, dtype=torch.long)


TASK = NeedleTask  # found by tasks/registry.py
