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
    """Where an edit lands. Each site is a TransformerLens hook point, named in tables as TransformerLens
    names it (hook_name); pattern, z, mlp and neurons also have its layout, but q, k and v put the head
    axis before the positions, where TransformerLens's hook_q, hook_k and hook_v have [batch, pos,
    head_index, d_head] (models/sites.py)."""

    q = "q"  # [batch, head, pos, d_head]: TransformerLens's hook_q transposed (1, 2)
    k = "k"  # [batch, kv_head, pos, d_head]: its hook_k (grouped-query: n_key_value_heads) transposed
    v = "v"  # [batch, kv_head, pos, d_head]: its hook_v transposed likewise
    pattern = "pattern"  # [batch, head, query_pos, key_pos], as hook_pattern
    z = "z"  # [batch, pos, head, d_head], as hook_z: the input of the attention output projection
    mlp = "mlp"  # the MLP block's output [batch, pos, d_model], as hook_mlp_out
    neurons = "neurons"  # the MLP's hidden units [batch, pos, d_mlp], the input of its down projection (mlp.hook_post)


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


# TransformerLens's hook points (SAELens's `hook_name`s) for the sites above, and for what headlab reads
# without editing it by that name: a head's output z_h W_O^h (its output norms, an edge's sender), the
# residual stream as one head's q, k or v input or the MLP reads it, before the norm (an edge's receiver),
# and the stream entering or leaving a block (the edge graph's input and logits)
HOOKS: dict[str, str] = {
    Site.q: "blocks.{layer}.attn.hook_q",
    Site.k: "blocks.{layer}.attn.hook_k",
    Site.v: "blocks.{layer}.attn.hook_v",
    Site.pattern: "blocks.{layer}.attn.hook_pattern",
    Site.z: "blocks.{layer}.attn.hook_z",
    Site.mlp: "blocks.{layer}.hook_mlp_out",
    Site.neurons: "blocks.{layer}.mlp.hook_post",
    "result": "blocks.{layer}.attn.hook_result",
    "q_input": "blocks.{layer}.hook_q_input",
    "k_input": "blocks.{layer}.hook_k_input",
    "v_input": "blocks.{layer}.hook_v_input",
    "mlp_in": "blocks.{layer}.hook_mlp_in",
    "resid_pre": "blocks.{layer}.hook_resid_pre",
    "resid_post": "blocks.{layer}.hook_resid_post",
}


def hook_name(site: str, layer: int | None) -> str | None:
    """The `hook` column: TransformerLens's name of `site` (a key of HOOKS) at `layer`, e.g.
    hook_name("z", 3) == "blocks.3.attn.hook_z"; None where the row has no layer (a model-level row).

    The name, not the layout: q, k and v are TransformerLens's hook_q, hook_k and hook_v with the head and
    position axes swapped (Site). On a rotary model headlab's q and k are taken after the rotation (and
    after any q/k norm), which TransformerLens hooks as hook_rot_q and hook_rot_k; the rotation is a fixed
    linear map per position, so zeroing, patching or resampling q or k, or a mean per position, does there
    what it does at hook_q / hook_k, while a mean over positions or an edit of one's own need not. Where a
    model normalises the MLP's output before the residual sum (Gemma 2's post-feedforward norm), headlab's
    mlp site is before that norm and TransformerLens's hook_mlp_out after it."""
    return None if layer is None else HOOKS[site].format(layer=int(layer))
