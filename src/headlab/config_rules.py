"""What each config option accepts beyond its type: ranges, the words a string option knows, and the
few rules that tie two options together. A rule sits with its field (`setting(default, rule)`, in the
options dataclass of whatever module reads it; options read together say so in the class's JOINT), and
`validate` checks them all once where a run's config is composed, so a bad value stops the run in one
line before anything is trained, loaded or written.

OmegaConf already refuses a value of the wrong type (and an enum's unknown member) at composition; the
rules here are what a type cannot say.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from .errors import UsageError

MAX_LINE = 200  # an error line the user reads at a glance
MAX_VALUE = 40  # characters of a bad value quoted back


@dataclass(frozen=True)
class Range:
    """A number in [low, high]; an open end where `low_open` / `high_open` (None: unbounded)."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    integer: bool = False

    def accepts(self, value: Any) -> bool:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
            return False
        if self.low is not None and (value <= self.low if self.low_open else value < self.low):
            return False
        return not (self.high is not None and (value >= self.high if self.high_open else value > self.high))

    def describe(self) -> str:
        kind = "an integer" if self.integer else "a number"
        if self.low is not None and self.high is not None:
            left, right = "(" if self.low_open else "[", ")" if self.high_open else "]"
            return f"{kind} in {left}{self.low:g}, {self.high:g}{right}"
        if self.low is not None:
            return f"{kind} {'>' if self.low_open else '>='} {self.low:g}"
        if self.high is not None:
            return f"{kind} {'<' if self.high_open else '<='} {self.high:g}"
        return kind


@dataclass(frozen=True)
class OneOf:
    """A word from a fixed list (a string option that is not an enum in config.py)."""

    words: tuple[str, ...]

    def accepts(self, value: Any) -> bool:
        return value in self.words

    def describe(self) -> str:
        return "one of " + ", ".join(self.words)


@dataclass(frozen=True)
class Known:
    """A name from a registry that may grow after import (a plugin's circuit method): asked when checked."""

    names: Callable[[], Sequence[str]]

    def accepts(self, value: Any) -> bool:
        return value in self.names()

    def describe(self) -> str:
        return "one of " + ", ".join(self.names())


@dataclass(frozen=True)
class Matches:
    """A string of a given form (a position, a receiver)."""

    pattern: str
    form: str

    def accepts(self, value: Any) -> bool:
        return isinstance(value, str) and re.fullmatch(self.pattern, value) is not None

    def describe(self) -> str:
        return self.form


@dataclass(frozen=True)
class Each:
    """Every element of a list (or of each inner list) satisfies `rule`; at least `least` of them."""

    rule: Range | OneOf | Known | Matches
    least: int = 0

    def accepts(self, value: Any) -> bool:
        leaves = flat(value)
        return len(leaves) >= self.least and all(self.rule.accepts(v) for v in leaves)

    def describe(self) -> str:
        size = f" of at least {self.least}" if self.least else ""
        return f"a list{size}, each {self.rule.describe()}"


Rule = Range | OneOf | Known | Matches | Each


def at_least(low: float) -> Range:
    return Range(low, integer=True)


COUNT = at_least(1)  # a size or a number of steps: one at least
NATURAL = at_least(0)  # a count where 0 means "none" or "every" (the comment in config.py says which)
POSITIVE = Range(0, low_open=True)
NON_NEGATIVE = Range(0)
SHARE = Range(0, 1)  # a probability, a fraction or a share
BETA = Range(0, 1, high_open=True)  # Adam's moment decay

# the words options accept, said once here, where the door reads them; the code that acts on them imports them
DTYPES = ("float32", "bfloat16", "float16", "float64")
HEAD_KINDS = ("same_token", "uniform", "random")  # PathNet's head templates (models/pathnet.py)
MULTI_TOKEN = ("refuse", "first")  # what task=prompts does with an answer of several tokens
DECODINGS = ("greedy", "teacher_forced")  # scores=retrieval: how the answer is produced
NEEDLES = ("random", "sentences")  # task=needle with a tokenizer: which needles
PROMPT_FORMATS = ("auto", "jsonl", "csv", "autocircuit", "eap_ig", "mib")  # tasks/formats.py reads each
# the tools whose logit difference task=prompts can score by, each named as its file format (tasks/prompts.py)
PEERS = ("autocircuit", "eap_ig", "mib")
PEER_CHOICES = ("auto", "none", *PEERS)  # task.peer: auto is the file's format's peer, none is headlab's own
POSITION = Matches(r"all|-?\d+|[A-Za-z_][A-Za-z0-9_]*", "all, an index or a role name")
RECEIVER = Matches(r"logits|\d+\.\d+", "logits or a head layer.head")
MEMORY = Matches(r"\d+(\.\d+)?(MB|GB)", "a size in MB or GB: 512MB, 8GB")
RUN_NAME = Matches(r"[A-Za-z0-9_.+=-][A-Za-z0-9_.,+=@-]*", "a name of letters, digits and _.,+=@- (a dir name)")

NO_DEFAULT: Any = object()


def setting(default: Any = NO_DEFAULT, rule: Rule | None = None, *, factory: Callable[[], Any] | None = None) -> Any:
    """A dataclass field whose rule (range, words) sits beside it, for the door to check; `factory` for a
    mutable default."""
    metadata = {"rule": rule} if rule is not None else {}
    if factory is not None:
        return field(default_factory=factory, metadata=metadata)
    if default is NO_DEFAULT:
        return field(metadata=metadata)
    return field(default=default, metadata=metadata)


# Options read together: a class's JOINT holds (the option named in the error, the check, what it needs)
Joint = tuple[str, Callable[[Any], bool], str]


def flat(value: Any) -> list[Any]:
    """The leaves of a list of lists (a pathnet's heads), a list, or a dict's values."""
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        return [leaf for v in value for leaf in flat(v)]
    return [value]


def rule_for(schema: type, name: str) -> Rule | None:
    """The rule of option `name` of `schema`, the most specific class's first: a subclass that gives a
    field another default keeps its base's rule unless it sets one of its own."""
    for klass in schema.__mro__:
        found = vars(klass).get("__dataclass_fields__", {}).get(name)
        if found is not None and "rule" in found.metadata:
            return found.metadata["rule"]
    return None


def rules_of(schema: type) -> dict[str, Rule]:
    """Every field of `schema` that has a rule, with it."""
    found = {f.name: rule_for(schema, f.name) for f in dataclasses.fields(schema)}
    return {name: rule for name, rule in found.items() if rule is not None}


def shown(value: Any) -> str:
    text = str(getattr(value, "value", value)).replace("'", "")
    return text if len(text) <= MAX_VALUE else text[: MAX_VALUE - 3] + "..."


def clipped(line: str) -> str:
    """A line that fits MAX_LINE with the CLI's "error: " before it."""
    room = MAX_LINE - len("error: ") - 1
    return line if len(line) <= room else line[: room - 3] + "..."


def refusal(key: str, value: Any, expected: str) -> UsageError:
    """The one line that names the option, its value and what it accepts."""
    return UsageError(clipped(f"invalid configuration: {key}={shown(value)}: expected {expected}"))


def sections(cfg: Any) -> list[tuple[str, Any]]:
    """(prefix, dataclass instance) of the config and of every section in it (model, task, ...)."""
    found: list[tuple[str, Any]] = [("", cfg)]
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            found.append((f"{f.name}.", value))
    return found


def validate(cfg: Any, device: bool = True) -> None:
    """Refuse, in one line, the first option outside what it accepts; `device`: also whether torch can use
    cfg.device here (not where the jobs of a cluster sweep run elsewhere)."""
    for prefix, section in sections(cfg):
        schema = type(section)
        for f in dataclasses.fields(section):
            value = getattr(section, f.name)
            rule = rule_for(schema, f.name)
            if rule is None or value is None:  # None: the option's "not set" (its comment says what follows)
                continue
            if not rule.accepts(value):
                raise refusal(prefix + f.name, value, rule.describe())
        for name, holds, needs in getattr(schema, "JOINT", ()):
            if not holds(section):
                raise refusal(prefix + name, getattr(section, name), needs)
    if device:
        check_device(cfg.device)


def check_device(device: str) -> None:
    """torch can put tensors on `device` here: it parses, its backend is built in and has such a device."""
    import torch

    usable = usable_devices()
    accepted = f"a device torch can use here: {', '.join(usable)}"
    try:
        parsed = torch.device(device)
    except (RuntimeError, ValueError):
        raise refusal("device", device, accepted) from None
    backend = getattr(torch, parsed.type, None) if parsed.type != "mps" else torch.backends.mps
    if parsed.type == "cpu":
        return
    available = getattr(backend, "is_available", None)
    if available is None or not available():
        raise refusal("device", device, accepted)
    count = getattr(backend, "device_count", None)
    if parsed.index is not None and count is not None and parsed.index >= count():
        raise refusal("device", device, accepted)


def usable_devices() -> list[str]:
    import torch

    usable = ["cpu"]
    if torch.cuda.is_available():
        usable += ["cuda"] + [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    if torch.backends.mps.is_available():
        usable.append("mps")
    return usable
