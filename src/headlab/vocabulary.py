"""The words interventions are made of: sites, sources and kinds, each an enum defined here once.

A leaf module (it imports nothing of headlab) so that models, interventions, studies and figures can all
name the same things. The members are `str` enums: they compare equal to their plain names ("z" ==
Site.z), print as those names and land in tables as those names.
"""

from __future__ import annotations

from enum import Enum


class Name(str, Enum):
    """A str enum that prints and formats as its value (as `enum.StrEnum` does from Python 3.11)."""

    def __str__(self) -> str:
        return str(self.value)

    def __format__(self, spec: str) -> str:
        return format(str(self.value), spec)

    def __repr__(self) -> str:
        # a dataclass holding members (an Intervention in an error message) reads as it did with plain strings
        return repr(str(self.value))


class Site(Name):
    """Where an edit lands. Head sites use TransformerLens's names and shapes (models/sites.py)."""

    q = "q"  # [batch, head, pos, d_head]
    k = "k"  # [batch, kv_head, pos, d_head]
    v = "v"  # [batch, kv_head, pos, d_head]
    pattern = "pattern"  # [batch, head, query_pos, key_pos]
    z = "z"  # [batch, pos, head, d_head], the input of the attention output projection
    mlp = "mlp"  # the MLP block's output [batch, pos, d_model]
    neurons = "neurons"  # the MLP's hidden units [batch, pos, d_mlp], the input of its down projection


# z first: the site an ablation edits unless told otherwise, and the order tables and figures list them in
HEAD_SITES: tuple[Site, ...] = (Site.z, Site.pattern, Site.q, Site.k, Site.v)
ATTENTION_SITES: tuple[Site, ...] = (Site.pattern, Site.q, Site.k, Site.v)  # inside the attention, before z
KV_SITES: tuple[Site, ...] = (Site.k, Site.v)  # live on key/value heads (shared under GQA)
MLP_SITES: tuple[Site, ...] = (Site.mlp, Site.neurons)


class Source(Name):
    """Where an edit's replacement value comes from."""

    zero = "zero"
    mean = "mean"  # the mean over the task's reference prompts (of the prompt's group, if it has one)
    reference = "reference"  # one reference prompt's value (resample ablation, path patching's senders)
    counterfactual = "counterfactual"  # the paired counterfactual prompt's value (activation patching)
    clean = "clean"  # the clean run's own value (path patching holds the receivers' other inputs here)
    head = "head"  # another head's value in the same run (pattern and value swaps)
    scale = "scale"  # the site's own value times a factor
    # the site's own pattern, its first key's attention times a factor and what that gives up shared among
    # the other keys in proportion to their attention (sink calibration, interventions/edits.py)
    calibrate = "calibrate"
    calibrate_hidden = "calibrate_hidden"  # the same with the head's hidden sinks (analysis/sinks.py) as sinks
    function = "function"  # a user's function of the site's own value (headlab.Intervention's `edit`)


class Kind(Name):
    """What an intervention does: one row of the result table (see interventions/plan.py)."""

    none = "none"
    ablate_head = "ablate_head"
    ablate_layer = "ablate_layer"
    keep_head = "keep_head"
    patch_head = "patch_head"
    pattern_from = "pattern_from"
    values_from = "values_from"
    scale_heads = "scale_heads"
    ablate_mlp = "ablate_mlp"
    ablate_neurons = "ablate_neurons"
    path_patch = "path_patch"
    calibrate_sink = "calibrate_sink"


class Method(Name):
    """The `method` column: how an intervention's replacement is made."""

    none = "none"
    zero = "zero"
    mean = "mean"
    resample = "resample"
    activation = "activation"  # exact patching from the counterfactual
    attribution = "attribution"  # first-order estimate of activation patching
    path = "path"
    swap = "swap"
    uniform = "uniform"
    calibration = "calibration"  # the attention calibration rule of Yu et al. 2024 (ACT), on the first token
    calibration_hidden = "calibration_hidden"  # the same on each head's hidden sinks, as ACT itself
    custom = "custom"  # a user's own edit (headlab.Intervention with `edit`), named in the intervention column


# typed by str: methods arrive as plain strings from configs and callers (members hash as their values)
SOURCE_OF_METHOD: dict[str, Source] = {
    Method.zero: Source.zero,
    Method.mean: Source.mean,
    Method.resample: Source.reference,
    Method.activation: Source.counterfactual,
    Method.attribution: Source.counterfactual,
    Method.path: Source.reference,
}
