"""What each config option accepts beyond its type: ranges, the words a string option knows, and the
few rules that tie two options together. One table, checked by `validate` once where a run's config is
composed, so a bad value stops the run in one line before anything is trained, loaded or written.

OmegaConf already refuses a value of the wrong type (and an enum's unknown member) at composition; the
rules here are what a type cannot say.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .config import (
    AblateConfig,
    CircuitConfig,
    Config,
    CountingConfig,
    EngineConfig,
    IOIConfig,
    MarkovConfig,
    ModelConfig,
    NeedleConfig,
    OutputConfig,
    PatchConfig,
    PathNetConfig,
    PromptsConfig,
    RecallReasoningConfig,
    SaeConfig,
    ScoresConfig,
    TaskConfig,
    TextConfig,
    TrainConfig,
)
from .errors import UsageError
from .vocabulary import HEAD_SITES

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
    """Every element of a list (or of each inner list) satisfies `rule`."""

    rule: Range | OneOf | Matches

    def accepts(self, value: Any) -> bool:
        return all(self.rule.accepts(v) for v in flat(value))

    def describe(self) -> str:
        return f"a list, each {self.rule.describe()}"


Rule = Range | OneOf | Matches | Each


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
RUN_NAME = Matches(r"[A-Za-z0-9_.+=-][A-Za-z0-9_.,+=@-]*", "a name of letters, digits and _.,+=@- (a dir name)")

# (schema, field) -> rule; a subclass's entry overrides its base's (PromptsConfig's n_prompts: 0 is every row)
RULES: dict[tuple[type, str], Rule] = {
    (ModelConfig, "dtype"): OneOf(DTYPES),
    (ModelConfig, "device_map"): OneOf(("auto", "balanced", "balanced_low_0", "sequential")),
    (ModelConfig, "n_layers"): COUNT,
    (ModelConfig, "n_heads"): COUNT,
    (ModelConfig, "d_model"): COUNT,
    (ModelConfig, "d_head"): COUNT,
    (ModelConfig, "d_mlp"): NATURAL,  # 0: attention only
    (ModelConfig, "n_ctx"): COUNT,
    (PathNetConfig, "width"): COUNT,
    (PathNetConfig, "heads"): Each(OneOf(HEAD_KINDS)),
    (PathNetConfig, "beta"): POSITIVE,
    (PathNetConfig, "random_strength"): NON_NEGATIVE,
    (PathNetConfig, "variances"): Each(POSITIVE),
    (PathNetConfig, "temperature"): POSITIVE,
    (PathNetConfig, "theory_tol"): POSITIVE,
    (PathNetConfig, "theory_steps"): COUNT,
    (PathNetConfig, "samples"): NATURAL,
    (PathNetConfig, "warmup"): NATURAL,
    (PathNetConfig, "trajectory"): POSITIVE,
    (PathNetConfig, "max_leapfrog"): COUNT,
    (PathNetConfig, "sample_dtype"): OneOf(("float32", "float64")),
    (PathNetConfig, "alignment_top"): COUNT,
    (TaskConfig, "n_prompts"): COUNT,
    (TaskConfig, "n_reference"): COUNT,
    (CountingConfig, "min_len"): COUNT,
    (CountingConfig, "max_len"): COUNT,
    (CountingConfig, "p_noise"): SHARE,
    (IOIConfig, "templates"): OneOf(("baba", "abba", "both")),
    (IOIConfig, "min_names"): COUNT,
    (IOIConfig, "held_out_every"): at_least(2),
    (IOIConfig, "train_names"): OneOf(("names", "vocab")),
    (IOIConfig, "eval_names"): OneOf(("all", "held_out", "train")),
    (RecallReasoningConfig, "n_prompts"): at_least(2),  # half recall, half reasoning
    (RecallReasoningConfig, "source"): OneOf(("synthetic", "facts")),
    (RecallReasoningConfig, "n_entities"): COUNT,
    (RecallReasoningConfig, "n_relations"): COUNT,
    (RecallReasoningConfig, "n_values"): COUNT,
    (RecallReasoningConfig, "recall_fraction"): SHARE,
    (RecallReasoningConfig, "one_hop_fraction"): SHARE,
    (RecallReasoningConfig, "one_hop_steps"): NATURAL,
    (RecallReasoningConfig, "facts_style"): OneOf(("statements", "questions")),
    (MarkovConfig, "n_train"): COUNT,
    (MarkovConfig, "n_steps"): COUNT,
    (MarkovConfig, "n_features"): COUNT,
    (MarkovConfig, "p_stay_plus"): SHARE,
    (MarkovConfig, "p_stay_minus"): SHARE,
    (MarkovConfig, "noise_label"): NON_NEGATIVE,
    (MarkovConfig, "noise_common"): NON_NEGATIVE,
    (MarkovConfig, "noise_orthogonal"): NON_NEGATIVE,
    (PromptsConfig, "n_prompts"): NATURAL,  # 0: every row of the file
    (PromptsConfig, "format"): OneOf(PROMPT_FORMATS),
    (PromptsConfig, "multi_token"): OneOf(MULTI_TOKEN),
    (PromptsConfig, "peer"): OneOf(PEER_CHOICES),
    (TextConfig, "n_prompts"): NATURAL,  # 0: every document
    (TextConfig, "seq_len"): at_least(2),  # a next token to predict after the first
    (NeedleConfig, "haystack_len"): COUNT,
    (NeedleConfig, "needle_len"): COUNT,
    (NeedleConfig, "n_symbols"): COUNT,
    (NeedleConfig, "needles"): OneOf(NEEDLES),
    (AblateConfig, "sink_threshold"): SHARE,
    (AblateConfig, "calibration"): SHARE,  # above 1 the other keys could be left with negative attention
    (AblateConfig, "sink_alpha"): POSITIVE,
    (PatchConfig, "sites"): Each(OneOf(tuple(str(s) for s in HEAD_SITES))),
    (PatchConfig, "positions"): Each(POSITION),
    (PatchConfig, "receivers"): Each(RECEIVER),
    (PatchConfig, "receiver_site"): OneOf(("q", "k", "v")),
    (TrainConfig, "steps"): COUNT,
    (TrainConfig, "batch_size"): COUNT,
    (TrainConfig, "lr"): POSITIVE,
    (TrainConfig, "min_lr_frac"): SHARE,
    (TrainConfig, "warmup_steps"): NATURAL,
    (TrainConfig, "weight_decay"): NON_NEGATIVE,
    (TrainConfig, "beta1"): BETA,
    (TrainConfig, "beta2"): BETA,
    (TrainConfig, "grad_clip"): NON_NEGATIVE,  # 0: no clipping
    (TrainConfig, "eval_every"): COUNT,
    (TrainConfig, "eval_prompts"): COUNT,
    (TrainConfig, "checkpoint_every"): COUNT,
    (TrainConfig, "embedding_std"): POSITIVE,
    (SaeConfig, "layer"): NATURAL,
    (SaeConfig, "layers"): Each(NATURAL),
    (SaeConfig, "expansion"): COUNT,
    (SaeConfig, "l1_coeff"): NON_NEGATIVE,
    (SaeConfig, "l1_warmup_steps"): NATURAL,
    (SaeConfig, "k"): COUNT,
    (SaeConfig, "steps"): COUNT,
    (SaeConfig, "batch_size"): COUNT,
    (SaeConfig, "lr"): POSITIVE,
    (SaeConfig, "warmup_steps"): NATURAL,
    (SaeConfig, "beta1"): BETA,
    (SaeConfig, "beta2"): BETA,
    (SaeConfig, "context_size"): at_least(2),
    (SaeConfig, "model_batch"): COUNT,
    (SaeConfig, "buffer_tokens"): COUNT,
    (SaeConfig, "resample_every"): NATURAL,  # 0: never
    (SaeConfig, "dead_window"): COUNT,
    (SaeConfig, "checkpoint_every"): COUNT,
    (SaeConfig, "eval_sequences"): COUNT,
    (SaeConfig, "top_contexts"): COUNT,
    (SaeConfig, "context_window"): NATURAL,
    (SaeConfig, "dominance"): SHARE,
    (CircuitConfig, "steps"): COUNT,
    (CircuitConfig, "ig_steps_from"): Range(0, 1, integer=True),  # 0 or 1 (attribution.IG_STEPS_FROM)
    (CircuitConfig, "target"): SHARE,
    (CircuitConfig, "fractions"): Each(Range(0, 1, low_open=True)),
    (CircuitConfig, "exact_check"): NATURAL,
    (CircuitConfig, "prompts_per_pass"): COUNT,
    (ScoresConfig, "epsilon"): SHARE,
    (ScoresConfig, "alpha"): POSITIVE,
    (ScoresConfig, "hidden_threshold"): SHARE,
    (ScoresConfig, "seq_len"): NATURAL,  # 0: prompts as the task gives them
    (ScoresConfig, "channels"): NATURAL,  # 0: no channels
    (ScoresConfig, "top_k"): COUNT,
    (ScoresConfig, "n_random"): NATURAL,
    (ScoresConfig, "min_recall"): Range(high=1),  # negative: every prompt counts
    (ScoresConfig, "decoding"): OneOf(DECODINGS),
    (ScoresConfig, "random_outside"): NATURAL,  # 0: the top_k
    (ScoresConfig, "repeat_len"): at_least(2),  # a repeated token whose next token the earlier copy shows
    (ScoresConfig, "n_sequences"): COUNT,
    (ScoresConfig, "icl_len"): at_least(500),  # the 500th token's loss is the score's late term
    (EngineConfig, "chunk_mb"): POSITIVE,
    (EngineConfig, "gpu_memory_share"): Range(0, 1, low_open=True),
    (OutputConfig, "n_boot"): NATURAL,  # 0: no bootstrap interval
    (OutputConfig, "print_rows"): NATURAL,
    (Config, "name"): RUN_NAME,
    (Config, "seed"): NATURAL,  # numpy's generators take no negative seed
    (Config, "threads"): NATURAL,  # 0: torch's default
}

# Options read together: (schema, the option named in the error, the check, what it needs)
Joint = tuple[type, str, Callable[[Any], bool], str]
JOINT: tuple[Joint, ...] = (
    (CountingConfig, "max_len", lambda c: c.max_len >= c.min_len, "at least task.min_len"),
    (NeedleConfig, "n_symbols", lambda c: c.n_symbols >= c.needle_len, "at least task.needle_len"),
)


def flat(value: Any) -> list[Any]:
    """The leaves of a list of lists (a pathnet's heads), a list, or a dict's values."""
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        return [leaf for v in value for leaf in flat(v)]
    return [value]


def rule_for(schema: type, name: str) -> Rule | None:
    """The rule of option `name` of `schema`, the most specific class's first."""
    for klass in schema.__mro__:
        if (klass, name) in RULES:
            return RULES[(klass, name)]
    return None


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


def sections(cfg: Config) -> list[tuple[str, Any]]:
    """(prefix, dataclass instance) of the config and of every section in it (model, task, ...)."""
    found: list[tuple[str, Any]] = [("", cfg)]
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            found.append((f"{f.name}.", value))
    return found


def validate(cfg: Config, device: bool = True) -> None:
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
        for klass, name, holds, needs in JOINT:
            if isinstance(section, klass) and not holds(section):
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
