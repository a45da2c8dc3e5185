"""The options of the interventions a sweep runs: `ablate=<option>` (which heads, how) and `patch=<option>`
(which sites, from where), read by plan.py and the engine."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from ..config_rules import POSITION, POSITIVE, RECEIVER, SHARE, Each, OneOf, setting
from ..vocabulary import HEAD_SITES


class AblateSweep(str, Enum):
    none = "none"
    heads = "heads"  # each head ablated
    layers = "layers"  # each layer's heads ablated together
    keep_heads = "keep_heads"  # each head alone: every other head of its layer ablated
    pattern_swaps = "pattern_swaps"  # head i alone, attending with head j's pattern (all pairs)
    value_swaps = "value_swaps"  # head i alone, with head j's values (all pairs)
    # every head's output rescaled to the same mean norm: measured at the first read position and applied
    # everywhere, then at each read role of the task (Count01: SEP, Y) measured and applied there only
    uniform = "uniform"
    components = "components"  # each head, each layer's attention output, each layer's MLP output
    # recall vs reasoning: components and MLP neuron groups, head patching, selectivity, circuit knockouts
    circuits = "circuits"
    # each head's attention on its sinks (ablate.sinks) times ablate.calibration, what that gives up shared
    # among its other keys in proportion (the calibration rule of Yu et al. 2024, ACT)
    sink_calibration = "sink_calibration"


class SinkChoice(str, Enum):
    first = "first"
    hidden = "hidden"


class AblateMethod(str, Enum):
    zero = "zero"
    mean = "mean"
    resample = "resample"


class MeanOver(str, Enum):
    positions = "positions"  # one mean per position (over the reference prompts that reach it)
    tokens = "tokens"  # one mean over every real token of every reference prompt, whatever its position


class PatchKind(str, Enum):
    activation = "activation"  # exact: a head site takes its value from the counterfactual run
    path = "path"  # exact: a sender head's output changes only along its paths into the receivers
    attribution = "attribution"  # approximate: first-order estimate of activation patching, one backward


@dataclass
class AblateConfig:
    sweep: AblateSweep = AblateSweep.none
    method: AblateMethod = AblateMethod.zero
    mean_over: MeanOver = MeanOver.positions  # method=mean: what the mean is taken over (padding never counts)
    # sink_calibration: the factor (Yu et al.'s beta, 0.4) on each query's attention to the sinks, in
    # [0, 1]; 1 changes nothing
    calibration: float = setting(0.4, SHARE)  # above 1 the other keys could be left with negative attention
    # sink_calibration: which keys are sinks: first (the prompt's first token) | hidden (each head's hidden
    # sinks in each prompt, tokens after the first receiving more than sink_alpha / N: ACT's own choice)
    sinks: SinkChoice = SinkChoice.first
    sink_alpha: float = setting(5.0, POSITIVE)
    # hidden sinks: 0, more than sink_alpha / N (the paper); > 0, more than this whatever N (ACT's code: 0.1)
    sink_threshold: float = setting(0.0, SHARE)


@dataclass
class PatchConfig:
    kinds: list[PatchKind] = field(default_factory=list)
    # activation / attribution: which head sites (z | pattern | q | k | v) at which positions (all, an
    # index, or a role the task names, e.g. IOI's END, S2, S1, IO)
    sites: list[str] = setting(factory=lambda: ["z"], rule=Each(OneOf(tuple(str(s) for s in HEAD_SITES))))
    positions: list[str] = setting(factory=lambda: ["all"], rule=Each(POSITION))
    # path: every head is a sender; the receivers are "logits" or heads "layer.head", entered via
    # receiver_site (q | k | v). Senders take their value from the task's reference set (IOI: ABC).
    receivers: list[str] = setting(factory=lambda: ["logits"], rule=Each(RECEIVER))
    receiver_site: str = setting("q", OneOf(("q", "k", "v")))


def options() -> list[tuple[str, str, type]]:
    return [("ablate", "ablate", AblateConfig), ("patch", "patch", PatchConfig)]
