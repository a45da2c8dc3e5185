"""What the norm in front of an attention does to the residual stream it reads, from the module itself: the
per-coordinate scale it multiplies by and whether it first subtracts the mean over d_model (a LayerNorm, not an
RMSNorm). This is what folding the norm into the weights that read its output needs, as TransformerLens's
fold_ln does (analysis/head_composition.py, `study.fold_norms`).
"""

from __future__ import annotations

from dataclasses import dataclass

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
