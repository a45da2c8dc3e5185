"""Natural needles for task=needle (task.needles=sentences): facts stated once inside a text haystack and
asked for at the end, as Wu et al. 2024's needles are ("The best thing to do in San Francisco is eat a
sandwich and sit in Dolores Park on a sunny day.", asked "What is the best thing to do in San Francisco?").

A prompt, by task.prompt:
  question  [BOS] hay.. statement answer "." ..hay "\nBased on the content of the book, Question: "
            question "\nAnswer:" needle
            Wu et al.'s prompt (retrieval_head_detection.py): it ends with the question and "Answer:"
  chat      the same inside the tokenizer's chat template, the haystack between <book> and </book>:
            Wu et al.'s prompt for chat models
  cue       [BOS] hay.. statement answer "." ..hay question statement needle
            the fact's opening repeated after the question: an induction head can copy the answer on
            (headlab 0.2's prompt)
where the needle is the answer's first `needle_len` tokens, teacher-forced at the end; the whole answer
is what Wu et al. score (their "real_needle"): greedy decoding is scored by its recall and its copy-paste
events are counted over its span. Token ids are joined as ids, never re-tokenized, so the needle is the
same ids at both places. Every prompt has one length: the hay around a fact fills what its statement and
question leave of the longest fact's. The needle goes at a random depth, moved back to the nearest
sentence end of the haystack, as Wu et al. (after Kamradt's needle test) insert theirs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ..errors import UsageError


@dataclass(frozen=True)
class Fact:
    statement: str  # its opening, which the answer completes; repeated after the question as the cue
    answer: str
    question: str


FACTS = (
    Fact(
        " The best thing to do in San Francisco is to",
        " eat a sandwich and sit in Dolores Park on a sunny day",
        " What is the best thing to do in San Francisco?",
    ),
    Fact(
        " The best thing to do in Beijing is to",
        " take a walk in Chaoyang Park and have a cup of espresso in the evening",
        " What is the best thing to do in Beijing?",
    ),
    Fact(
        " Mr Green is disliked by everyone because",
        " he is a mean person and also he cannot ride a horse or drive a car",
        " Why is Mr Green disliked by everyone?",
    ),
    Fact(
        " The secret ingredient of the baker's tarts is",
        " a spoonful of honey from the hives behind the old mill",
        " What is the secret ingredient of the baker's tarts?",
    ),
    Fact(
        " The lighthouse keeper's favourite pastime is",
        " painting small boats on smooth grey pebbles from the beach",
        " What is the lighthouse keeper's favourite pastime?",
    ),
    Fact(
        " The old clockmaker hid the key",
        " under the third stone of the garden wall near the pear tree",
        " Where did the old clockmaker hide the key?",
    ),
    Fact(
        " The most useful thing to bring on a mountain hike is",
        " a warm wool hat and a flask of sweet black tea",
        " What is the most useful thing to bring on a mountain hike?",
    ),
    Fact(
        " The captain's parrot can say",
        " good morning in seven languages and whistle a cheerful sea song",
        " What can the captain's parrot say?",
    ),
    Fact(
        " The museum's oldest treasure is",
        " a silver comb found in a river near the northern hills",
        " What is the museum's oldest treasure?",
    ),
    Fact(
        " The inventor named her first robot",
        " Pickle after the jar it knocked off the kitchen shelf",
        " What did the inventor name her first robot?",
    ),
)
SENTENCE_ENDS = (".", "!", "?", '."', '!"', '?"', ".'", "!'", "?'")
# Wu et al.'s question, after the haystack (retrieval_head_detection.py, evaluate_and_log); theirs follows
# the haystack's last word directly, a newline separates it here
ASK = "\nBased on the content of the book, Question: {question}\nAnswer:"


MARK = "\x00needle\x00"  # stands for the user's message while the chat template is split around it


def asked(question: str) -> str:
    """Wu et al.'s question text for task.prompt=question and chat."""
    return ASK.format(question=question.strip())


def framing(prompt: str, tokenizer: Any) -> tuple[list[int], str, list[int]]:
    """(token ids before the haystack, text before the question, token ids after it) for task.prompt:
    chat puts Wu et al.'s question inside the tokenizer's chat template, the haystack between <book> and
    </book>, as their code prompts chat models (Mistral-7B-Instruct, Qwen1.5-14B-Chat)."""
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    if prompt != "chat":
        return bos, "", []
    if not getattr(tokenizer, "chat_template", None):
        raise UsageError("task.prompt=chat needs a tokenizer with a chat template; task.prompt=question has none")
    message = [{"role": "user", "content": MARK}]
    text = tokenizer.apply_chat_template(message, tokenize=False, add_generation_prompt=True)
    before, after = text.split(MARK)
    encode = lambda s: list(tokenizer(s, add_special_tokens=False)["input_ids"])  # noqa: E731
    return encode(before + "<book>"), "</book>", encode(after)


@dataclass
class FactPrompts:
    clean: Tensor  # [n, T]
    counterfactual: Tensor  # another needle (random ordinary tokens) in the same place
    reference: Tensor  # [n_reference, T]: fresh haystack, random needle tokens, the same facts and depths
    needle: Tensor  # [n, L]
    needle_start: Tensor  # [n]: where the needle's first token sits
    depth: Tensor  # [n]: share of the prompt's haystack before the needle
    answer: Tensor  # [n, A]: each fact's whole answer (the needle first), padded with -1


def draw_depths(grid: int, size: int, n: int, gen: torch.Generator) -> Tensor:
    """[n] depths into haystacks of `size` tokens: uniform in 0..size, or with `grid` N > 0 prompt i at
    round(linspace(0, 100, N))[i mod N] percent of it, as Wu et al.'s depth grid places needles."""
    if grid == 0:
        return torch.randint(0, size + 1, (n,), generator=gen)
    percent = torch.linspace(0, 100, grid, dtype=torch.double).round()
    return (percent[torch.arange(n) % grid] / 100 * size).round().long()


class FactNeedles:
    """Prompts from FACTS over the haystack `text` (token ids) of a model's tokenizer."""

    def __init__(self, cfg: Any, tokenizer: Any, text: Tensor | None, bos: list[int]):
        if text is None:
            raise UsageError("task.needles=sentences needs a text haystack: task.haystack=<text file>")
        encode = lambda s: torch.tensor(tokenizer(s, add_special_tokens=False)["input_ids"], dtype=torch.long)  # noqa: E731
        self.cfg, self.text, self.bos = cfg, text, torch.tensor(bos, dtype=torch.long)
        self.answers = [encode(f.answer) for f in FACTS]
        shortest = min(len(a) for a in self.answers)
        if cfg.needle_len > shortest:
            raise UsageError(f"task.needle_len={cfg.needle_len} exceeds the shortest fact's answer ({shortest} tokens)")
        self.openings = [encode(f.statement) for f in FACTS]
        self.period = encode(".")
        if cfg.prompt == "cue":
            self.asks = [torch.cat([encode(f.question), encode(f.statement)]) for f in FACTS]
        else:
            _, book_end, after = framing(cfg.prompt, tokenizer)
            closing = torch.tensor(after, dtype=torch.long)
            self.asks = [torch.cat([encode(book_end + asked(f.question)), closing]) for f in FACTS]
        extra = [len(o) + len(a) + len(self.period) + len(q) for o, a, q in zip(self.openings, self.answers, self.asks)]
        self.hay_len = [cfg.haystack_len + max(extra) - e for e in extra]  # hay per fact: one length for all
        if len(text) < max(self.hay_len):
            raise UsageError(
                f"task.haystack={cfg.haystack} holds {len(text)} tokens, fewer than {max(self.hay_len)} "
                f"(task.haystack_len={cfg.haystack_len} and the facts' room)"
            )
        unique = text.unique()
        ends = {int(t) for t in unique if tokenizer.decode([int(t)]).rstrip().endswith(SENTENCE_ENDS)}
        self.sentence_end = torch.tensor([int(t) in ends for t in text.tolist()])

    def build(self, n: int, n_reference: int, gen: torch.Generator, other_needle: Any) -> FactPrompts:
        """other_needle(needle [n, L], gen) -> [n, L]: ordinary tokens, none of them the needle's."""
        facts = torch.randint(0, len(FACTS), (n,), generator=gen)
        windows, depths = [], []
        for i, f in enumerate(facts.tolist()):
            window, depth = self._window(f, gen, snap=True, row=i)
            windows.append(window)
            depths.append(depth)
        needle = torch.stack([self.answers[f][: self.cfg.needle_len] for f in facts.tolist()])
        other = other_needle(needle, gen)
        ref_rows = torch.arange(n_reference) % n
        ref_needle = other_needle(needle[ref_rows], gen)
        reference = []
        for i, row in enumerate(ref_rows.tolist()):
            window, _ = self._window(int(facts[row]), gen, snap=False)
            reference.append(self._row(int(facts[row]), window, depths[row], ref_needle[i]))
        clean = torch.stack([self._row(f, w, d, nd) for f, w, d, nd in zip(facts.tolist(), windows, depths, needle)])
        swapped = torch.stack([self._row(f, w, d, nd) for f, w, d, nd in zip(facts.tolist(), windows, depths, other)])
        starts = torch.tensor([len(self.bos) + d + len(self.openings[f]) for f, d in zip(facts.tolist(), depths)])
        share = torch.tensor([d / max(1, self.hay_len[f]) for f, d in zip(facts.tolist(), depths)], dtype=torch.double)
        answers = [self.answers[f] for f in facts.tolist()]
        answer = torch.full((n, max(len(a) for a in answers)), -1, dtype=torch.long)
        for i, a in enumerate(answers):
            answer[i, : len(a)] = a
        return FactPrompts(clean, swapped, torch.stack(reference), needle, starts, share, answer)

    def _window(self, fact: int, gen: torch.Generator, snap: bool, row: int = 0) -> tuple[Tensor, int]:
        """A window of the text of this fact's hay length at a random offset, and a depth in it (random, or
        row `row`'s of task.depths's grid), moved back to just after a sentence end, or to 0, when `snap`."""
        size = self.hay_len[fact]
        start = int(torch.randint(0, len(self.text) - size + 1, (1,), generator=gen))
        if self.cfg.depths:
            depth = int(draw_depths(self.cfg.depths, size, row + 1, gen)[row])
        else:
            depth = int(torch.randint(0, size + 1, (1,), generator=gen))
        if snap:
            ends = self.sentence_end[start : start + depth].nonzero()
            depth = int(ends[-1]) + 1 if len(ends) else 0
        return self.text[start : start + size], depth

    def _row(self, fact: int, window: Tensor, depth: int, needle: Tensor) -> Tensor:
        answer = torch.cat([needle, self.answers[fact][self.cfg.needle_len :]])
        statement = torch.cat([self.openings[fact], answer, self.period])
        return torch.cat([self.bos, window[:depth], statement, window[depth:], self.asks[fact], needle])
