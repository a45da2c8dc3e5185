"""Context classes of corpus positions, the roles of features in sae/head_attribution.py's head_roles: a
head is polysemantic when two of its top features fire in unrelated contexts, i.e. in different classes.

Kissane et al. (arXiv 2406.17759, section 4) read each GPT-2-small head's top 10 features by eye and call
a head polysemantic when they serve unrelated roles. Here the role of a feature is the class distribution
of its top-activating contexts, with classes defined on the text itself (no labels needed):

  text_classes  for prose (a text corpus), one class per position, first match wins:
                  punctuation   the token has no letter or digit (punctuation, spaces, line breaks)
                  dialogue      the token lies inside a double quotation ("..." or curly quotes)
                  sentence start the first token of a sentence: after . ! ? : ; or a line break
                  narration     any other word of narration
                Quotes are tracked along each row's text, which starts outside quotes at a sentence
                start (a quote left open at a line break closes there: prose reopens a quote on the
                next paragraph). Windows cut from one text are classed as one row, so a window
                that starts mid-sentence or mid-quote is classed right (studies/sae.py).
  token_type    a coarse class of one token's text (word, word piece, number, punctuation, space),
                for corpora whose task names no roles of its own
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

TEXT_CLASSES = ("punctuation", "dialogue", "sentence start", "narration")
QUOTES = '"\u201c\u201d'
SENTENCE_ENDS = ".!?:;"


def token_type(text: str) -> str:
    """A coarse class of a token's text, for corpora whose task names no roles."""
    bare = text.strip()
    if not bare:
        return "space"
    if bare.isdigit():
        return "number"
    if bare.isalpha():
        return "word" if text[0].isspace() else "word piece"
    if all(not c.isalnum() for c in bare):
        return "punctuation"
    return "other"


def text_classes(ids: Tensor, text: Callable[[Any], str]) -> tuple[Tensor, tuple[str, ...]]:
    """([n, pos] index into TEXT_CLASSES of every position of token rows ids [n, pos], TEXT_CLASSES);
    text(id) is the token's text."""
    out = torch.empty(ids.shape, dtype=torch.long)
    for r, row in enumerate(ids.tolist()):
        inside, starts = False, True  # a row starts outside quotes, at a sentence start
        for p, token in enumerate(row):
            piece = text(token)
            bare = piece.strip()
            lead = len(piece) - len(piece.lstrip("".join(c for c in piece if not c.isalnum())))
            inside = _quoted(piece[:lead], inside)  # a quote that opens on this token's own word
            if not any(c.isalnum() for c in piece):
                out[r, p] = 0
            elif inside:
                out[r, p] = 1
            elif starts and bare:
                out[r, p] = 2
            else:
                out[r, p] = 3
            inside = _quoted(piece[lead:], inside)
            if "\n" in piece:
                inside, starts = False, True
            elif bare:
                ending = bare.rstrip(QUOTES + ")")
                starts = bool(ending) and ending[-1] in SENTENCE_ENDS
    return out, TEXT_CLASSES


def _quoted(chars: str, inside: bool) -> bool:
    """Inside quotes after these characters: a straight quote toggles, curly ones open and close."""
    for c in chars:
        if c == '"':
            inside = not inside
        elif c in QUOTES:
            inside = c == "\u201c"
    return inside
