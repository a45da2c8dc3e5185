"""What a user hands in: Intervention specs, checked at the door, and their own edit functions.

headlab.execute runs any list of Interventions through the batched engine: the built-in kinds and a
user's own, one with `edit` set, a function from the site's values where the intervention touches them
to their replacement. Everything a spec names is checked here against the model and the prompts before
anything runs, each refusal one line (UsageError).

What `edit` receives, for every prompt at once: the values of the heads it names (every head if `head`
is None), prompts first and heads second, at its position (or `token`, or every position):
  z, q, k, v   [prompts, heads, d_head] at one position, [prompts, heads, positions, d_head] at every one
  pattern      [prompts, heads, keys] at one query position, [prompts, heads, queries, keys] at every one
It returns a tensor of that shape, or None where it edited its argument in place (a copy: nothing else
sees the edit). k and v live on key/value heads: under grouped-query attention an edit there reaches
every query head that shares the named head's kv head. These are not TransformerLens's hook layouts
(its hook_z and hook_q are [batch, pos, head_index, d_head]): here the heads come second at every site,
so a TransformerLens hook function copied over would index the wrong axis. The table names the site by
its TransformerLens hook all the same (`hook`, e.g. blocks.3.attn.hook_z).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from numbers import Integral
from typing import Any

import torch
from torch import Tensor

from ..errors import UsageError
from ..models.hooked import HookedModel
from ..tasks import TaskData
from ..vocabulary import HEAD_SITES, Kind, Method
from .plan import Intervention

LINE = 200  # a refusal stays one line shorter than this, a long list of names in it cut at the end
# what a built-in kind cannot do without (the others edit every head where `head` is None)
NEEDED: dict[str, tuple[str, ...]] = {
    Kind.keep_head: ("head",),
    Kind.pattern_from: ("head", "other_head"),
    Kind.values_from: ("head", "other_head"),
    Kind.path_patch: ("receivers",),
}


def checked(interventions: Sequence[Any], model: HookedModel, data: TaskData) -> list[Intervention]:
    """The interventions as the engine takes them: a negative position counted from the end of the
    prompts' (padded) length, a user's own edit's method "custom" unless it names one; refused in one
    line where anything is not of this model or these prompts."""
    if isinstance(interventions, Intervention):
        interventions = [interventions]
    return [_checked(iv, model, data) for iv in interventions]


def _checked(iv: Any, model: HookedModel, data: TaskData) -> Intervention:
    if not isinstance(iv, Intervention):
        raise UsageError(f"headlab.execute takes headlab.Intervention specs, not {type(iv).__name__}")
    name = str(iv.intervention)[:40]

    def refuse(problem: str) -> UsageError:
        line = f"intervention '{name}': {problem}"
        return UsageError(line if len(line) < LINE else line[: LINE - 4] + "...")

    kinds = {k.value for k in Kind}
    if iv.edit is not None:
        if not callable(iv.edit):
            raise refuse(f"edit must be a function of a tensor, not {type(iv.edit).__name__}")
        if not isinstance(iv.intervention, str) or not iv.intervention or iv.intervention in kinds:
            raise refuse("name your own edit (intervention='...'), not a built-in kind")
        if iv.method == Method.none:
            iv = replace(iv, method=Method.custom)
    elif iv.intervention not in kinds:
        raise refuse("not a built-in kind (headlab.vocabulary.Kind); give edit=fn for an edit of your own")
    if iv.intervention == Kind.none:
        return iv
    layer = _index(iv.layer, model.n_layers)
    if layer is None:
        raise refuse(f"layer {iv.layer!r} is not one of this model's layers 0..{model.n_layers - 1}")
    heads = {}
    for field in ("head", "other_head"):
        value = getattr(iv, field)
        heads[field] = None if value is None else _index(value, model.n_heads)
        if value is not None and heads[field] is None:
            raise refuse(f"{field} {value!r} is not one of layer {layer}'s heads 0..{model.n_heads - 1}")
    iv = replace(iv, layer=layer, **heads)
    if iv.site is not None and iv.site not in HEAD_SITES:
        raise refuse(f"unknown head site '{iv.site}'; choose from: {', '.join(HEAD_SITES)}")
    if iv.edit is None:
        for field in NEEDED.get(iv.intervention, ()):
            if getattr(iv, field) is None:
                raise refuse(f"a {iv.intervention} intervention needs {field}=...")
    iv = _placed(iv, data, refuse)
    try:
        iv.edits(model.n_heads)
    except (KeyError, ValueError) as e:  # a method the kind has no source for, a missing argument
        raise refuse(f"method '{iv.method}' does not apply ({e})") from None
    return iv


def _placed(iv: Intervention, data: TaskData, refuse: Any) -> Intervention:
    """iv with its position checked against the prompts, a negative one counted from their end."""
    if iv.token is not None:
        roles = data.token_positions or {}
        if iv.position is not None:
            raise refuse("give a position or a token, not both")
        if iv.token not in roles:
            raise refuse(f"the task names no position '{iv.token}' (it names: {', '.join(roles) or 'none'})")
        return iv
    if iv.position is None:
        return iv
    length = next(iter(data.inputs.values())).shape[1]
    position = _index(iv.position, length, negative=True)
    if position is None:
        raise refuse(f"position {iv.position!r} is not an index into prompts of {length} positions")
    last = max(int(p.max()) for p in (data.positions, *(data.counterfactual_positions or {}).values()))
    # a causal model's read positions never see a later one, and the engine drops positions after them
    if position > last:
        raise refuse(f"position {position} comes after the last one the task reads ({last}): it changes nothing")
    return replace(iv, position=position)


def _index(value: Any, size: int, negative: bool = False) -> int | None:
    """value as an index into `size` things (a negative one counted from the end where allowed), None
    if it is none; numpy and torch integers count as integers."""
    if isinstance(value, Tensor):
        if value.ndim or value.is_floating_point() or value.is_complex() or value.dtype == torch.bool:
            return None
    elif isinstance(value, bool) or not isinstance(value, Integral):
        return None
    index = int(value)
    return index % size if (-size if negative else 0) <= index < size else None


def edited(iv: Intervention, values: Tensor) -> Tensor:
    """A user's edit of `values` (a copy of the site's values where iv touches them), refused in one line
    unless it gives a tensor of their shape."""
    out = iv.edit(values)  # type: ignore[misc]  # only interventions with an edit reach here
    out = values if out is None else out  # edited in place, as TransformerLens hooks may do
    if not isinstance(out, Tensor) or out.shape != values.shape:
        got = tuple(out.shape) if isinstance(out, Tensor) else type(out).__name__
        raise UsageError(
            f"intervention '{str(iv.intervention)[:40]}': its edit returned {got} for values of shape "
            f"{tuple(values.shape)}; return the shape it receives"
        )
    return out
