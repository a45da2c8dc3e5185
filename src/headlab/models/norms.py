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


@dataclass(frozen=True)
class HeldNorm:
    """A norm y = g * centre(x) * s + b read off one run of the module: s is fitted to its own output (its
    epsilon, its float32 arithmetic), one number per row of the last dimension."""

    gain: Tensor | None  # g: [last dim] (Gemma's 1 + w); None: 1
    centres: bool  # a LayerNorm subtracts the mean over the last dimension
    bias: Tensor | None  # b, added after the scale (a LayerNorm's bias); None: none
    scale: Tensor  # s: [..., 1], the run's 1/rms or 1/std

    def linear(self, x: Tensor) -> Tensor:
        """The norm's linear part at the held scale: g * centre(x) * s (x broadcasting against s)."""
        if self.centres:
            x = x - x.mean(-1, keepdim=True)
        return (x if self.gain is None else x * self.gain) * self.scale


def held_norm(module: nn.Module | None, x: Tensor, out: Tensor, offset: float) -> HeldNorm:
    """The norm `module` (of a model whose norm_offset is `offset`) as it ran on x (out = module(x)), its
    scale held."""
    factors = norm_factors(module, offset)
    bias = getattr(module, "bias", None)
    bias = bias.detach() if isinstance(bias, Tensor) else None
    wide = torch.promote_types(x.dtype, torch.float32)
    gain = None if factors.scale is None else factors.scale.to(x.device, wide)
    xc = x.to(wide) - x.to(wide).mean(-1, keepdim=True) if factors.centres else x.to(wide)
    gained = xc if gain is None else xc * gain
    target = out.to(wide) - (bias.to(wide) if bias is not None else 0)
    scale = (target * gained).sum(-1, keepdim=True) / (gained * gained).sum(-1, keepdim=True).clamp_min(1e-30)
    cast = lambda t: None if t is None else t.to(x.dtype)  # noqa: E731
    return HeldNorm(cast(gain), factors.centres, cast(bias), scale.to(x.dtype))


def norm_vjp(module: nn.Module | None, offset: float, x: Tensor, cotangents: Tensor) -> Tensor | None:
    """[k, *x.shape]: the k vector-Jacobian products of the norm `module` at x [..., d] (cotangents
    [k, *x.shape]) in closed form, or None where headlab does not know the norm (norm_factors) or its weights are not
    in memory (read from disk as a pass reaches them).

    With u = scale * cotangent, x_c = x less its mean (a LayerNorm; else x) and r the factor the norm
    multiplied x_c by at each position (held_norm's scale, read off its output: its epsilon is the module's),
    the product is r (u - mean(u) - x̂ mean(u x̂)) with x̂ = r x_c, the mean(u) term a LayerNorm's alone:
    two passes over the cotangents where autograd through k stacked copies of the norm takes about ten."""
    if module is None or isinstance(module, nn.Identity):
        return cotangents
    if any(p.is_meta for p in module.parameters()):  # weights read from disk as a pass reaches them
        return None
    with torch.no_grad():
        x = x.detach().to(cotangents.dtype)
        try:
            held = held_norm(module, x, module(x), offset)
        except UsageError:
            return None
        if not bool((held.scale > 0).all()):  # a position of zeros: its factor cannot be read off
            return None
        xc = x - x.mean(-1, keepdim=True) if held.centres else x
        x_hat = xc * held.scale  # [..., d]
        u = cotangents * held.gain if held.gain is not None else cotangents.clone()  # [k, ..., d]
        along = torch.linalg.vecdot(u, x_hat).unsqueeze(-1) / x.shape[-1]  # [k, ..., 1]
        if held.centres:
            u -= u.mean(-1, keepdim=True)
        u -= along * x_hat
        u *= held.scale
    return u
