"""What the norm in front of an attention does to the residual stream it reads, from the module itself: the
per-coordinate scale it multiplies by and whether it first subtracts the mean over d_model (a LayerNorm, not an
RMSNorm). This is what folding the norm into the weights that read its output needs, as TransformerLens's
fold_ln does (analysis/head_composition.py, `study.fold_norms`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from ..errors import UsageError


@dataclass(frozen=True)
class NormFactors:
    scale: Tensor | None  # [d_model], detached; None: the norm learns no scale (or there is no norm)
    centres: bool  # the norm subtracts the mean over d_model: a reader sees only the centred residual stream


def norm_factors(module: nn.Module | None, offset: float) -> NormFactors:
    """The factors of a norm of a model whose RMSNorms multiply by `offset` + weight (HookedModel.norm_offset,
    from its family's row: Gemma's store the scale less one); None (a family without one, OLMo 2) or
    Identity: none."""
    if module is None or isinstance(module, nn.Identity):
        return NormFactors(None, False)
    name = type(module).__name__
    weight = getattr(module, "weight", None)
    weight = weight.detach() if isinstance(weight, Tensor) else None
    # nn.LayerNorm (GPT-2, GPT-NeoX, toy models) and OLMo's parameter-free OlmoLayerNorm
    if isinstance(module, nn.LayerNorm) or name.endswith("LayerNorm"):
        return NormFactors(weight, True)
    if name.endswith("RMSNorm") and weight is not None:
        return NormFactors(offset + weight if offset else weight, False)
    raise UsageError(
        f"study.fold_norms: headlab does not know how a {name} scales its input; set study.fold_norms=false"
    )


def norm_vjp(module: nn.Module | None, offset: float, x: Tensor, cotangents: Tensor) -> Tensor | None:
    """[k, *x.shape]: the k vector-Jacobian products of the norm `module` at x [..., d] (cotangents
    [k, *x.shape]) in closed form, or None where headlab does not know the norm (norm_factors) or its weights are not
    in memory (read from disk as a pass reaches them).

    With u = scale * cotangent, x_c = x less its mean (a LayerNorm; else x) and r the factor the norm
    multiplied x_c by at each position (read off its output, so its epsilon is whatever the module used),
    the product is r (u - mean(u) - x̂ mean(u x̂)) with x̂ = r x_c, the mean(u) term a LayerNorm's alone:
    two passes over the cotangents where autograd through k stacked copies of the norm takes about ten."""
    try:
        factors = norm_factors(module, offset)
    except UsageError:
        return None
    if module is None or isinstance(module, nn.Identity):
        return cotangents
    if any(p.is_meta for p in module.parameters()):  # weights read from disk as a pass reaches them
        return None
    dtype = cotangents.dtype
    with torch.no_grad():
        x = x.detach().to(dtype)
        out = module(x).to(dtype)
        bias = getattr(module, "bias", None)
        if isinstance(bias, Tensor):
            out = out - bias.detach().to(dtype)
        xc = x - x.mean(-1, keepdim=True) if factors.centres else x
        gain = None if factors.scale is None else factors.scale.to(x.device, dtype)
        gained = xc if gain is None else xc * gain
        square = (gained * gained).sum(-1, keepdim=True)
        if not bool((square > 0).all()):  # a position of zeros: its factor cannot be read off
            return None
        r = (out * gained).sum(-1, keepdim=True) / square
        x_hat = xc * r  # [..., d]
        u = cotangents * gain if gain is not None else cotangents.clone()  # [k, ..., d]
        along = torch.linalg.vecdot(u, x_hat).unsqueeze(-1) / x.shape[-1]  # [k, ..., 1]
        if factors.centres:
            u -= u.mean(-1, keepdim=True)
        u -= along * x_hat
        u *= r
    return u
