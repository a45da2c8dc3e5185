"""What an SAE learns from: token sequences (a corpus) and the stream of one layer's z they produce.

A corpus is token ids [n, pos], the number of real tokens per row, and the model's loss targets
[n, pos] (-100: no loss there), which the cross-entropy metrics read:
  task prompts   the task's training sequences (`task.train_batch`), each up to its last target, with
                 the targets the model was trained on; every pass draws new ones, so the stream never
                 repeats (tasks that train nothing give their evaluation prompts, next-token targets);
  text           a file, or a directory of .txt / .jsonl ("text" field) files, tokenised by the model's
                 tokenizer, cut into windows of context_size tokens; targets: the next token.
                 A relative path not found from the working directory names a text headlab ships
                 (locations.text_path): data/alice.txt (~5,300 tokens of SmolLM2's tokenizer), a
                 pretrained model's corpus when the user names none, or data/devil.txt.
The stream runs the model in batches of sequences (stopping at the layer), keeps z at real tokens,
flattened over heads ([tokens, n_heads * d_head]), and mixes them in a shuffle buffer before batching:
activations never need to fit in memory, and one batch never holds a single sequence's tokens only.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from ..errors import HeadlabError, UsageError
from ..locations import text_path
from ..models.hooked import HookedModel
from ..tasks.base import bos_prefix

TEXT_SUFFIXES = (".txt", ".jsonl")
AFTER_CURRICULUM = 10**9  # a training step past every task's curriculum: the stream the model ended on


@dataclass
class Corpus:
    ids: Tensor  # [n, pos]
    lengths: Tensor  # [n] real tokens per row
    targets: Tensor  # [n, pos] next-token targets, -100 where the model takes no loss

    @property
    def n_tokens(self) -> int:
        return int(self.lengths.sum())

    def rows(self, index: Tensor) -> Corpus:
        return Corpus(self.ids[index], self.lengths[index], self.targets[index])


def task_corpus(task: Any, model: HookedModel, n: int, seed: int) -> Corpus:
    if model.tokenizer is not None and hasattr(task, "use_tokenizer"):
        task.use_tokenizer(model.tokenizer)
    try:
        ids, targets = task.train_batch(torch.Generator().manual_seed(seed), n, step=AFTER_CURRICULUM)
    except NotImplementedError:
        data = task.build(n, seed=seed, model=model)
        if "input_ids" not in data.inputs:
            raise UsageError(f"task {task.name} has no token prompts to fit an SAE on") from None
        ids = data.inputs["input_ids"]
        lengths = data.positions.max(1).values + 1
        return Corpus(ids, lengths, _next_tokens(ids, lengths))
    has_target = targets != -100
    lengths = ids.shape[1] - has_target.flip(1).int().argmax(1)  # up to the last target
    return Corpus(ids, torch.where(has_target.any(1), lengths, ids.shape[1]), targets)


def _next_tokens(ids: Tensor, lengths: Tensor) -> Tensor:
    targets = torch.full_like(ids, -100)
    targets[:, :-1] = ids[:, 1:]
    return targets.masked_fill(torch.arange(ids.shape[1]) >= lengths[:, None] - 1, -100)


def text_corpus(path: str, model: HookedModel, context_size: int) -> Corpus:
    tok = model.tokenizer
    if tok is None:
        raise UsageError(f"sae.corpus={path} is text: model {model.name} needs a tokenizer (model.tokenizer=...)")
    docs = _read_texts(text_path(path))
    sep = [tok.eos_token_id] if tok.eos_token_id is not None else []
    stream: list[int] = []
    for doc in docs:
        stream += tok(doc, add_special_tokens=False)["input_ids"] + sep
    # each window starts as the tokenizer starts a text (Gemma's <bos>: without it Gemma reads text badly)
    start = bos_prefix(tok, None)
    width = context_size - len(start)
    n = len(stream) // width if width > 0 else 0
    if n < 2:
        raise HeadlabError(f"corpus {path} has {len(stream)} tokens: fewer than two windows of {context_size}")
    body = torch.tensor(stream[: n * width]).view(n, width)
    ids = torch.cat([torch.tensor(start, dtype=body.dtype).expand(n, len(start)), body], 1)
    lengths = torch.full((n,), context_size)
    return Corpus(ids, lengths, _next_tokens(ids, lengths))


def _read_texts(path: Path) -> list[str]:
    if not path.exists():
        raise UsageError(f"corpus {path} does not exist")
    files = sorted(p for p in path.rglob("*") if p.suffix in TEXT_SUFFIXES) if path.is_dir() else [path]
    if not files:
        raise UsageError(f"corpus directory {path} holds no {' or '.join(TEXT_SUFFIXES)} files")
    docs: list[str] = []
    for f in files:
        if f.suffix == ".jsonl":
            for i, line in enumerate(f.read_text(errors="replace").splitlines(), 1):
                if line.strip():
                    try:
                        docs.append(json.loads(line)["text"])
                    except (json.JSONDecodeError, KeyError, TypeError) as e:
                        raise HeadlabError(f"{f}:{i}: not a JSON object with a 'text' field") from e
        else:
            docs.append(f.read_text(errors="replace"))
    return docs


def layer_z(model: HookedModel, layer: int, ids: Tensor) -> Tensor:
    """z of one layer, [batch, pos, n_heads * d_head] (head-major, as TransformerLens's hook_z flattened)."""
    with torch.no_grad():
        z = model.capture({"input_ids": ids}, layer, "z")
    return z.reshape(*z.shape[:2], -1)


def corpus_z(model: HookedModel, layer: int, corpus: Corpus, model_batch: int) -> Tensor:
    """z at every real token of the corpus, [tokens, d_in], in (row, position) order."""
    parts = []
    for start in range(0, corpus.ids.shape[0], model_batch):
        part = corpus.rows(torch.arange(start, min(start + model_batch, corpus.ids.shape[0])))
        parts.append(layer_z(model, layer, part.ids)[real_tokens(part)])
    return torch.cat(parts)


def real_tokens(corpus: Corpus) -> Tensor:
    """[n, pos] bool: the tokens that are not padding."""
    return torch.arange(corpus.ids.shape[1]) < corpus.lengths[:, None]


def stream(
    model: HookedModel,
    layer: int,
    passes: Callable[[int], Corpus],
    batch_tokens: int,
    buffer_tokens: int,
    model_batch: int,
    seed: int,
) -> Iterator[Tensor]:
    """Endless batches [batch_tokens, d_in]; passes(i) is the corpus of pass i (the same corpus each time,
    or fresh prompts). A corpus that comes back as the same object (a text file) runs through the model
    once: its z is kept (up to CACHE_BYTES) and later passes only reshuffle it."""
    gen = torch.Generator().manual_seed(seed)
    buffer_tokens = max(buffer_tokens, 2 * batch_tokens)
    buffer: Tensor | None = None
    pass_index = 0
    pending: list[Tensor] = []  # row indices of the current corpus, one model batch each
    corpus: Corpus | None = None
    cache = ZCache()
    while True:
        while buffer is None or buffer.shape[0] < buffer_tokens:
            if not pending:
                corpus = passes(pass_index)
                pass_index += 1
                order = torch.randperm(corpus.ids.shape[0], generator=gen)
                pending = [order[i : i + model_batch] for i in range(0, len(order), model_batch)]
            assert corpus is not None
            rows = pending.pop(0)
            part = corpus.rows(rows)
            acts = cache.z(model, layer, corpus, rows)[real_tokens(part)]
            buffer = acts if buffer is None else torch.cat([buffer, acts])
        buffer = buffer[torch.randperm(buffer.shape[0], generator=gen)]
        emit = (buffer.shape[0] // 2 // batch_tokens) * batch_tokens
        for i in range(0, emit, batch_tokens):
            yield buffer[i : i + batch_tokens]
        buffer = buffer[emit:]


# z kept for a corpus that repeats: 512 MiB holds ~230k tokens of a 576-wide z (smollm2-135m)
CACHE_BYTES = 512 * 2**20


class ZCache:
    """z [n, pos, d_in] of the rows of one corpus object seen so far; a new corpus object starts it over."""

    def __init__(self) -> None:
        self.corpus: Corpus | None = None
        self.values: Tensor | None = None
        self.filled = torch.zeros(0, dtype=torch.bool)

    def z(self, model: HookedModel, layer: int, corpus: Corpus, rows: Tensor) -> Tensor:
        if corpus is self.corpus and self.values is not None and bool(self.filled[rows].all()):
            return self.values[rows]
        z = layer_z(model, layer, corpus.ids[rows])
        if corpus is not self.corpus:
            self.corpus, self.values = corpus, None
            if corpus.ids.numel() * z.shape[-1] * z.element_size() <= CACHE_BYTES:
                self.values = z.new_zeros(*corpus.ids.shape, z.shape[-1])
                self.filled = torch.zeros(corpus.ids.shape[0], dtype=torch.bool)
        if self.values is not None:
            self.values[rows] = z
            self.filled[rows] = True
        return z
