"""Indirect object identification (Wang et al. 2022, arXiv 2211.00593).

"Then, Mary and John went to the store. John gave a drink to" -> " Mary". The repeated name is the
subject S (S1, S2), the other is the indirect object IO; END is the last token. Templates are the
paper's 15 BABA templates and their ABBA versions (first mention order swapped). Every name, place and
object must be one token of the model's own tokenizer, in context; prompts of one template then share
one token layout, which is what makes per-template means and per-role positions well defined.

Sets, aligned prompt by prompt (same template, place and object, hence the same positions):
  clean           IO and S as above
  counterfactual  S2-flipped: S2 carries the IO name, so the roles (and the answer) flip
  reference       ABC: three unrelated names. Prompt i's own ABC version (reference_rows) is the source
                  of path patching and resample ablation; mean ablation's means are taken per template over
                  the whole set: those pairs and more ABC prompts over the same templates, n_reference in
                  all (the authors' scale: 100 prompts over their templates)
Quantities at END: logit difference IO - S, IO probability, correct (IO logit > S logit).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from ..config_rules import COUNT, OneOf, at_least, setting
from ..errors import HeadlabError
from .base import PRETRAINED_DEFAULTS, Task, TaskConfig, TaskData, bos_prefix, mean_of, pad_id, right_padded

log = logging.getLogger("headlab")
PROB = 1  # the column of io_prob among IOITask.quantities

BABA_TEMPLATES = (
    "Then, [B] and [A] went to the [PLACE]. [B] gave a [OBJECT] to [A]",
    "Then, [B] and [A] had a lot of fun at the [PLACE]. [B] gave a [OBJECT] to [A]",
    "Then, [B] and [A] were working at the [PLACE]. [B] decided to give a [OBJECT] to [A]",
    "Then, [B] and [A] were thinking about going to the [PLACE]. [B] wanted to give a [OBJECT] to [A]",
    "Then, [B] and [A] had a long argument, and afterwards [B] said to [A]",
    "After [B] and [A] went to the [PLACE], [B] gave a [OBJECT] to [A]",
    "When [B] and [A] got a [OBJECT] at the [PLACE], [B] decided to give it to [A]",
    "When [B] and [A] got a [OBJECT] at the [PLACE], [B] decided to give the [OBJECT] to [A]",
    "While [B] and [A] were working at the [PLACE], [B] gave a [OBJECT] to [A]",
    "While [B] and [A] were commuting to the [PLACE], [B] gave a [OBJECT] to [A]",
    "After the lunch, [B] and [A] went to the [PLACE]. [B] gave a [OBJECT] to [A]",
    "Afterwards, [B] and [A] went to the [PLACE]. [B] gave a [OBJECT] to [A]",
    "Then, [B] and [A] had a long argument. Afterwards [B] said to [A]",
    "The [PLACE] [B] and [A] went to had a [OBJECT]. [B] gave it to [A]",
    "Friends [B] and [A] found a [OBJECT] at the [PLACE]. [B] gave it to [A]",
)
ABBA_TEMPLATES = tuple(t.replace("[B] and [A]", "[A] and [B]", 1) for t in BABA_TEMPLATES)

NAMES = (
    "Aaron Adam Alex Alice Amanda Amber Amy Andrea Andrew Angela Anna Anthony Ashley Ben Brandon Brian "
    "Bryan Carl Charles Chris Christina Christine Claire Craig Daniel Danielle David Derek Diana Dustin "
    "Edward Emily Emma Eric Erica Erin Frank Gary George Grace Greg Hannah Harry Heather Helen Henry Ian "
    "Jack Jacob Jake James Jamie Jane Jason Jeff Jennifer Jeremy Jesse Jessica Jim Joe John Jonathan "
    "Jordan Joseph Joshua Julia Justin Karen Kate Katie Kelly Kevin Kim Kyle Laura Lauren Leo Linda Lisa "
    "Lucy Luke Maria Mark Martin Mary Matt Megan Michael Michelle Mike Nancy Nathan Nicole Oliver Patrick "
    "Paul Peter Rachel Rebecca Richard Robert Roger Ryan Sam Samuel Sarah Scott Sean Simon Sophie "
    "Stephanie Steve Steven Susan Thomas Tim Tom Tony Tyler Victoria William Zoe"
).split()
PLACES = ("store", "garden", "restaurant", "school", "hospital", "office", "house", "station", "park", "beach")
OBJECTS = ("ring", "kiss", "bone", "basketball", "computer", "necklace", "drink", "snack", "book", "ball")
ROLES = ("IO", "S1", "S2", "END")


@dataclass
class IOIConfig(TaskConfig):
    name: str = "ioi"
    n_prompts: int = 100  # 270 heads of smollm2-135m x 100 prompts: ~10 min on 2 CPU cores (500: ~45 min)
    templates: str = setting("both", OneOf(("baba", "abba", "both")))  # baba | abba | both
    names: list[str] | None = None  # default: headlab's list of ~130 common first names
    min_names: int = setting(20, COUNT)  # fewer single-token names than this stops the run
    held_out_every: int = setting(5, at_least(2))  # every k-th name is never trained on (models trained here)
    # names (all but the held-out) | vocab (every capitalised word token but them)
    train_names: str = setting("names", OneOf(("names", "vocab")))
    eval_names: str = setting("all", OneOf(("all", "held_out", "train")))  # all | held_out | train
    # ABC prompts behind mean ablation's means per template (at least n_prompts: each prompt's own ABC version
    # and more over the same templates, each template in turn)
    n_reference: int = setting(100, COUNT)
    # None: as the model's tokenizer does (Gemma's <bos>; nothing for SmolLM2, whose BOS is a chat marker, or
    # for GPT-2, as Wang et al.); true / false: its BOS token / nothing (tasks/base.py bos_prefix)
    prepend_bos: bool | None = None


@dataclass
class Prompts:
    ids: Tensor  # [n, pos], right-padded
    roles: dict[str, Tensor]  # role -> [n] position
    io: Tensor  # [n] token id of the correct answer
    s: Tensor  # [n] token id of the subject


class IOITask(Task):
    name = "ioi"
    options = IOIConfig
    quantities = ("logit_diff", "io_prob", "correct")  # io_prob, alone a softmax over the vocabulary: PROB
    smooth_quantity = "logit_diff"
    needs_tokenizer = True
    # GPT-2 small, else SmolLM2-135M, else the small GPT-2 trained here as experiment=ioi_trained trains it
    default_models = (*PRETRAINED_DEFAULTS, ("model=gpt2-ioi", "train=ioi", "task.train_names=vocab"))
    cfg: IOIConfig

    def __init__(self, cfg: IOIConfig):
        self.cfg = cfg
        self.aggregates = {"logit_diff": mean_of(0), "io_prob": mean_of(1), "accuracy": mean_of(2)}
        which = {"baba": BABA_TEMPLATES, "abba": ABBA_TEMPLATES, "both": BABA_TEMPLATES + ABBA_TEMPLATES}
        if cfg.templates not in which:
            raise HeadlabError(f"unknown IOI template set '{cfg.templates}'; choose from: baba, abba, both")
        self.templates = which[cfg.templates]
        self.tokenizer: Any = None
        self._vocab: dict[str, Any] = {}

    # --- vocabulary, checked against the tokenizer -------------------------------------------------
    def use_tokenizer(self, tokenizer: Any) -> None:
        if tokenizer is None:
            raise HeadlabError("task ioi needs the model's tokenizer (set model.tokenizer=...)")
        if tokenizer is self.tokenizer:
            return
        self.tokenizer = tokenizer
        names = list(self.cfg.names) if self.cfg.names else list(NAMES)
        kept, refused = _single_tokens(tokenizer, names)
        if refused:
            log.warning(
                "ioi: %d of %d names are one token for this tokenizer; left out: %s",
                len(kept),
                len(names),
                ", ".join(refused),
            )
        if len(kept) < self.cfg.min_names:
            raise HeadlabError(
                f"ioi: only {len(kept)} of {len(names)} names are single tokens for this tokenizer "
                f"(need {self.cfg.min_names}); multi-token: {', '.join(refused[:4])}"
                + (f" and {len(refused) - 4} more (listed in the warning above)" if len(refused) > 4 else "")
            )
        places, bad_places = _single_tokens(tokenizer, list(PLACES))
        objects, bad_objects = _single_tokens(tokenizer, list(OBJECTS))
        if not places or not objects:
            raise HeadlabError(f"ioi: no single-token places/objects for this tokenizer: {bad_places + bad_objects}")
        every = max(2, int(self.cfg.held_out_every))
        held_out = kept[every - 1 :: every]
        train = [n for i, n in enumerate(kept) if (i + 1) % every]
        if self.cfg.train_names == "vocab":
            # a model trained on ~100 names learns those names; on thousands of name-like words it has
            # to learn the mechanism, which then carries over to the held-out names
            train = sorted(set(_capitalized_words(tokenizer)) - set(held_out))
        elif self.cfg.train_names != "names":
            raise HeadlabError(f"unknown task.train_names '{self.cfg.train_names}'; choose from: names, vocab")
        self._vocab = {"all": kept, "held_out": held_out, "train": train, "places": places, "objects": objects}

    def names(self, split: str) -> list[str]:
        return self._vocab[split]

    @property
    def vocab_size(self) -> int:  # type: ignore[override]
        return len(self.tokenizer) if self.tokenizer is not None else 0

    @property
    def max_len(self) -> int:  # type: ignore[override]
        return 40

    # --- prompts ----------------------------------------------------------------------------------
    def _fillers(
        self, n: int, rng: np.random.Generator, names: list[str], k: int, templates: np.ndarray | None = None
    ) -> dict[str, np.ndarray]:
        if len(names) < k:
            raise HeadlabError(f"ioi: need at least {k} names, have {len(names)}")
        picks = np.stack([rng.choice(len(names), size=k, replace=False) for _ in range(n)])
        return {
            # balanced: a mean per template
            "template": rng.permutation(np.arange(n) % len(self.templates)) if templates is None else templates,
            "names": np.asarray(names)[picks],
            "place": np.asarray(self._vocab["places"])[rng.integers(0, len(self._vocab["places"]), n)],
            "object": np.asarray(self._vocab["objects"])[rng.integers(0, len(self._vocab["objects"]), n)],
        }

    def _encode(self, fill: dict[str, np.ndarray], a: np.ndarray, b: np.ndarray, b2: np.ndarray) -> Prompts:
        """Prompts from templates: [A] <- a, first [B] <- b, second [B] <- b2; the final [A] is cut off."""
        tok = self.tokenizer
        bos = bos_prefix(tok, self.cfg.prepend_bos)
        rows: list[list[int]] = []
        roles: dict[str, list[int]] = {r: [] for r in ROLES}
        for i, t in enumerate(fill["template"]):
            text, spans = _fill(self.templates[t], a[i], b[i], b2[i], fill["place"][i], fill["object"][i])
            enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
            ids, offsets = list(enc["input_ids"]), [tuple(o) for o in enc["offset_mapping"]]
            for role, (start, end) in spans.items():
                # offsets either include a token's leading space or not, depending on the tokenizer
                at = [j for j, o in enumerate(offsets) if o in ((start, end), (start + 1, end))]
                if not at:
                    raise HeadlabError(f"ioi: '{text[start + 1 : end]}' is not one token in context: {text!r}")
                roles[role].append(len(bos) + at[0])
            roles["END"].append(len(bos) + len(ids) - 1)
            rows.append(bos + ids)
        padded = right_padded(rows, tok)["input_ids"]  # no mask: each prompt reads at its own END
        token = lambda names: torch.tensor([_token_id(tok, x) for x in names])  # noqa: E731
        return Prompts(padded, {r: torch.tensor(v) for r, v in roles.items()}, token(a), token(b))

    def build(self, n: int, seed: int, model: Any = None) -> TaskData:
        if self.tokenizer is None or (model is not None and model.tokenizer not in (None, self.tokenizer)):
            self.use_tokenizer(getattr(model, "tokenizer", None) or self.tokenizer)
        rng = np.random.default_rng(seed)
        fill = self._fillers(n, rng, self.names(self.cfg.eval_names), 2)
        a, b = fill["names"][:, 0], fill["names"][:, 1]
        clean = self._encode(fill, a, b, b)
        flipped = self._encode(fill, a, b, a)
        abc = self._fillers(n, rng, self.names(self.cfg.eval_names), 3)["names"]
        reference = self._encode(fill, abc[:, 0], abc[:, 1], abc[:, 2])
        for other in (flipped, reference):
            if other.ids.shape != clean.ids.shape or any((other.roles[r] != clean.roles[r]).any() for r in ROLES):
                raise HeadlabError("ioi: counterfactual prompts do not line up with the clean ones")
        extra_n = max(self.cfg.n_reference - n, 0)
        more_templates = _topped_up(fill["template"], extra_n)
        if extra_n:
            more = self._fillers(extra_n, rng, self.names(self.cfg.eval_names), 3, more_templates)
            extra = self._encode(more, *more["names"].T).ids
            width = max(clean.ids.shape[1], extra.shape[1])
            wide = lambda ids: F.pad(ids, (0, width - ids.shape[1]), value=pad_id(self.tokenizer))  # noqa: E731
            clean, flipped = (replace(p, ids=wide(p.ids)) for p in (clean, flipped))
            reference = replace(reference, ids=torch.cat([wide(reference.ids), wide(extra)]))
        groups = torch.as_tensor(fill["template"], dtype=torch.long)
        return TaskData(
            inputs={"input_ids": clean.ids},
            positions=clean.roles["END"].unsqueeze(1),
            answers={"io": clean.io, "s": clean.s, "template": groups},
            counterfactual={"input_ids": flipped.ids},
            reference={"input_ids": reference.ids},
            token_positions=clean.roles,
            groups=groups,
            reference_groups=torch.cat([groups, torch.as_tensor(more_templates, dtype=torch.long)]),
            reference_rows=torch.arange(n),
        )

    def prompt_start(self) -> str:
        tok = self.tokenizer
        return tok.decode(bos_prefix(tok, self.cfg.prepend_bos)) if tok is not None else ""

    def per_prompt(self, logits: Tensor, data: TaskData) -> Tensor:
        at_end = logits[..., 0, :]
        at_end = at_end.float() if at_end.element_size() < 4 else at_end  # half precision: sum in float32
        io, s = data.answers["io"].to(logits.device), data.answers["s"].to(logits.device)
        shape = at_end.shape[:-1]
        io_logit = at_end.gather(-1, io.expand(shape).unsqueeze(-1)).squeeze(-1)
        s_logit = at_end.gather(-1, s.expand(shape).unsqueeze(-1)).squeeze(-1)
        io_prob = torch.exp(io_logit - torch.logsumexp(at_end, dim=-1))
        diff = io_logit - s_logit
        return torch.stack([diff, io_prob, (diff > 0).float()], dim=-1)

    def vocab_rows(self, data: TaskData, columns: Sequence[int]) -> Tensor | None:
        """[n, 2]: IO's and S's ids, from which every quantity follows (io_prob with the normaliser)."""
        return torch.stack([data.answers["io"], data.answers["s"]], dim=-1)

    def needs_normaliser(self, columns: Sequence[int]) -> bool:
        return PROB in columns

    def from_rows(
        self, rows: Tensor, data: TaskData, columns: Sequence[int], normaliser: Tensor | None = None
    ) -> Tensor:
        at_end = rows[..., 0, :]
        at_end = at_end.float() if at_end.element_size() < 4 else at_end
        diff = at_end[..., 0] - at_end[..., 1]

        def column(c: int) -> Tensor:
            if c == PROB:
                assert normaliser is not None, "io_prob needs the normaliser (needs_normaliser)"
                return torch.exp(at_end[..., 0] - normaliser[..., 0])
            return diff if c == 0 else (diff > 0).float()

        return torch.stack([column(c) for c in columns], dim=-1)

    def train_batch(self, generator: torch.Generator, batch: int, step: int = 0) -> tuple[Tensor, Tensor]:
        """IOI prompts over the training names; the loss is taken at END only (target: IO)."""
        seed = int(torch.randint(0, 2**62, (1,), generator=generator))
        rng = np.random.default_rng(seed)
        fill = self._fillers(batch, rng, self.names("train"), 2)
        p = self._encode(fill, fill["names"][:, 0], fill["names"][:, 1], fill["names"][:, 1])
        targets = torch.full_like(p.ids, -100)
        targets[torch.arange(batch), p.roles["END"]] = p.io
        return p.ids, targets


def _topped_up(templates: np.ndarray, total: int) -> np.ndarray:
    """Templates for `total` more reference prompts: the prompts' templates, the one with fewest so far
    first (the lowest index among equals), so every template in use gets its share."""
    used = np.unique(templates)
    counts = np.bincount(templates, minlength=int(used.max()) + 1)
    out = np.empty(total, dtype=templates.dtype)
    for k in range(total):
        t = used[np.argmin(counts[used])]
        out[k], counts[t] = t, counts[t] + 1
    return out


def _token_id(tokenizer: Any, word: str) -> int:
    return tokenizer(" " + word, add_special_tokens=False)["input_ids"][0]


def _capitalized_words(tokenizer: Any) -> list[str]:
    """Every token that is a space and a capitalised word of 3+ letters (name-like: ' Aaron', ' Abbey')."""
    words = tokenizer.batch_decode([[i] for i in range(len(tokenizer))])
    return [
        w[1:]
        for w in words
        if len(w) > 3 and w[0] == " " and w[1].isupper() and w[2:].isalpha() and w[2:].islower() and w[1:].isascii()
    ]


def _single_tokens(tokenizer: Any, words: list[str]) -> tuple[list[str], list[str]]:
    """(words that are one token with a leading space, the others), order kept."""
    kept: list[str] = []
    refused: list[str] = []
    for w in words:
        (kept if len(tokenizer(" " + w, add_special_tokens=False)["input_ids"]) == 1 else refused).append(w)
    return kept, refused


def _fill(template: str, a: str, b: str, b2: str, place: str, obj: str) -> tuple[str, dict[str, tuple[int, int]]]:
    """The prompt text (template without its final ' [A]') and the character span of IO, S1 and S2."""
    body = template[: template.rindex(" [A]")]
    text, spans, i, b_seen = "", {}, 0, 0
    while i < len(body):
        if body.startswith("[A]", i) or body.startswith("[B]", i):
            is_a = body[i + 1] == "A"
            word = a if is_a else (b if b_seen == 0 else b2)
            role = "IO" if is_a else ("S1" if b_seen == 0 else "S2")
            b_seen += 0 if is_a else 1
            start = len(text) - 1 if text.endswith(" ") else len(text)  # a token carries its leading space
            text += word
            spans[role] = (start, len(text))
            i += 3
        elif body.startswith("[PLACE]", i):
            text, i = text + place, i + len("[PLACE]")
        elif body.startswith("[OBJECT]", i):
            text, i = text + obj, i + len("[OBJECT]")
        else:
            text, i = text + body[i], i + 1
    return text, spans


TASK = IOITask  # found by tasks/registry.py
