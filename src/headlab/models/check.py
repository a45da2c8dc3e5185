"""Does headlab's view of a model agree with the model itself? Three checks, on the user's own model.

1. idle hooks: with HeadSites installed and no hook active, the logits equal transformers' own, computed
   by a second copy of the model with eager attention and with its default attention (sdpa).
2. zeroing a head: zeroing head h's z through HeadSites equals zeroing h's d_head slice of W_O's input
   in a copy of the weights.
3. kv edits: editing kv head j's k (or v) changes the output z of exactly the query heads that share
   kv head j (HeadSites.kv_head_of), on grouped-query models and on the others alike.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from .hf import Pretrained
from .hooked import HookedModel, Inputs

# float32: eager and sdpa attention differ by summation order, ~1e-6 on logits of the size a small LM
# emits; a misplaced head moves logits by a head's whole contribution, orders of magnitude more. Where
# the residual stream is large the rounding grows with it: gemma-3-270m's logits reach 134 on random
# tokens, and transformers' own eager and sdpa paths differ there by 3e-4 (each 4-5e-4 from float64).
TOLERANCE = {torch.float32: 1e-4, torch.float64: 1e-4}
# Half precision rounds every layer's output to 2^-11 (fp16) or 2^-8 (bf16) of its size, so the bound
# is relative: per unit of the largest logit; float32's likewise, above the absolute floor.
RELATIVE_TOLERANCE = {torch.float16: 1e-2, torch.bfloat16: 5e-2, torch.float32: 1e-5}
PROBE_SHAPE = (3, 12)  # sequences x tokens: long enough for every head to attend over several keys
PROBE_SEED = 0
# an edit of k or v large enough that every query head reading it changes far above the tolerance,
# even in a random-weight model whose attention is nearly uniform
EDIT_SCALE = 10.0


@dataclass(frozen=True)
class Verdict:
    """One check: ok, the largest difference measured (None: skipped, `detail` says why) and its bound."""

    name: str
    ok: bool
    max_abs_diff: float | None
    tolerance: float
    detail: str = ""

    @property
    def skipped(self) -> bool:
        return self.max_abs_diff is None

    def line(self) -> str:
        status = "skip" if self.skipped else "ok" if self.ok else "MISMATCH"
        measured = "" if self.skipped else f"max|diff| {self.max_abs_diff:.1e} (tol {self.tolerance:.0e})"
        return "  ".join(part for part in (f"{status:<4} {self.name:<20}", measured, self.detail) if part)


def check_model(model: HookedModel) -> list[Verdict]:
    """Run every check on `model` (on the device its weights are on) and return one verdict each."""
    module = model.module
    param = next(module.parameters())
    inputs = probe_inputs(model, param.device)
    was_training = module.training
    module.eval()
    try:
        with torch.no_grad():  # not inference_mode: the zero-head check copies and writes weights
            logits = model.forward(inputs)
            tol = tolerance(param.dtype, logits)
            return [
                *check_idle_hooks(model, inputs, logits, tol),
                check_zero_head(model, inputs, logits, tol),
                *check_kv_edits(model, inputs, tol),
            ]
    finally:
        module.train(was_training)


def tolerance(dtype: torch.dtype, logits: Tensor) -> float:
    relative = RELATIVE_TOLERANCE.get(dtype, 0.0) * max(1.0, logits.float().abs().max().item())
    return max(relative, TOLERANCE.get(dtype, 0.0))


def probe_inputs(model: HookedModel, device: torch.device) -> Inputs:
    """A few random token sequences from the model's vocabulary, the same on every call."""
    weight = model.unembed.weight
    assert isinstance(weight, Tensor)
    generator = torch.Generator().manual_seed(PROBE_SEED)
    ids = torch.randint(0, weight.shape[0], PROBE_SHAPE, generator=generator)
    return {"input_ids": ids.to(device)}


def max_diff(a: Tensor, b: Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


def check_idle_hooks(model: HookedModel, inputs: Inputs, ours: Tensor, tol: float) -> list[Verdict]:
    if not isinstance(model.source, Pretrained):
        return [
            Verdict("idle_hooks", True, None, tol, f"{model.family} attention has no implementation but headlab's own")
        ]
    param = next(model.module.parameters())
    verdicts, seen = [], set()
    for implementation in ("eager", None):
        reference = model.source.load(implementation, param.dtype).eval()
        nn.Module.to(reference, param.device)  # transformers' own .to is typed for its wrapper only
        used = reference.config._attn_implementation
        if used not in seen:
            seen.add(used)
            diff = max_diff(ours, reference(**inputs, use_cache=False).logits)
            verdicts.append(Verdict(f"idle_hooks_vs_{used}", diff <= tol, diff, tol))
        del reference
    return verdicts


def probe_heads(model: HookedModel) -> list[tuple[int, int]]:
    """(layer, head): the first, a middle and the last."""
    last_layer, last_head = model.n_layers - 1, model.n_heads - 1
    pairs = [(0, 0), (last_layer // 2, last_head // 2 + (last_head > 0)), (last_layer, last_head)]
    return list(dict.fromkeys(pairs))


def check_zero_head(model: HookedModel, inputs: Inputs, clean: Tensor, tol: float) -> Verdict:
    name = "zero_head_vs_W_O"
    zeroed = copy.copy(model)
    zeroed.module = copy.deepcopy(model.module)
    params = dict(model.module.named_parameters())
    copied_params = dict(zeroed.module.named_parameters())
    worst, weakest, wrong = 0.0, math.inf, []
    pairs = probe_heads(model)
    for layer, head in pairs:
        w_o = model.sites.W_O(layer)
        storage = w_o.untyped_storage().data_ptr()
        owner = next((n for n, p in params.items() if p.untyped_storage().data_ptr() == storage), None)
        if owner is None:
            return Verdict(name, False, math.inf, tol, f"W_O({layer}) is no view of the model's weights")
        # W_O's own view, laid on the copy's weight: whatever head slicing W_O does is what gets zeroed
        slice_ = copied_params[owner].as_strided(w_o.shape, w_o.stride(), w_o.storage_offset())[head]
        saved = slice_.clone()
        slice_.zero_()
        with model.sites.hooks(layer, z=zero_head(head)):
            ours = model.forward(inputs)
        diff = max_diff(ours, zeroed.forward(inputs))
        slice_.copy_(saved)
        worst, weakest = max(worst, diff), min(weakest, max_diff(ours, clean))
        if diff > tol:
            wrong.append(f"L{layer}H{head}")
    heads = " ".join(f"L{layer}H{head}" for layer, head in pairs)
    # a head that barely moves the logits cannot tell right slicing from wrong: say how much each moved
    detail = f"differs at {' '.join(wrong)}" if wrong else f"{heads}; zeroing one moves logits >= {weakest:.1e}"
    return Verdict(name, not wrong, worst, tol, detail)


def zero_head(head: int) -> Callable[[Tensor], Tensor]:
    def edit(z: Tensor) -> Tensor:
        z = z.clone()
        z[:, :, head] = 0
        return z

    return edit


def check_kv_edits(model: HookedModel, inputs: Inputs, tol: float) -> Iterator[Verdict]:
    sites = model.sites
    layers = list(dict.fromkeys(layer for layer, _ in probe_heads(model)))
    for site in ("k", "v"):
        worst, wrong = 0.0, []
        for layer in layers:
            clean = model.capture(inputs, layer, "z")
            for kv_head in range(sites.n_kv_heads):
                with sites.hooks(layer, **{site: perturb(kv_head)}):
                    edited = model.capture(inputs, layer, "z")
                change = (edited.float() - clean.float()).abs().amax(dim=(0, 1, 3)).tolist()  # per query head
                sharing = [h for h in range(sites.n_heads) if sites.kv_head_of(h) == kv_head]
                changed = [h for h, c in enumerate(change) if c > tol]
                worst = max([worst, *(c for h, c in enumerate(change) if h not in sharing)])
                if changed != sharing:
                    wrong.append(f"L{layer} kv head {kv_head} changed query heads {changed}, expected {sharing}")
        more = f" (and {len(wrong) - 1} more)" if len(wrong) > 1 else ""
        detail = wrong[0] + more if wrong else f"{sites.n_heads} query heads on {sites.n_kv_heads} kv heads"
        yield Verdict(f"{site}_edit_hits_kv_group", not wrong, worst, tol, detail)


def perturb(kv_head: int) -> Callable[[Tensor], Tensor]:
    def edit(t: Tensor) -> Tensor:
        generator = torch.Generator().manual_seed(PROBE_SEED + kv_head)
        noise = torch.randn(t[:, kv_head].shape, generator=generator).to(t.device, t.dtype)
        t = t.clone()
        t[:, kv_head] += noise * EDIT_SCALE * (1 + t[:, kv_head].abs().max())
        return t

    return edit
