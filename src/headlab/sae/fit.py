"""Fitting an SAE: Adam with a linear warm-up, unit-norm decoder rows, dead-latent resampling,
resumable checkpoints, a progress bar.

A latent is dead when it has not fired on the last sae.dead_window training tokens. relu_l1 resamples
dead latents every sae.resample_every steps (never in the last resample_every steps), after Anthropic's
"Towards Monosemanticity": each takes, as its decoder row, an input the SAE reconstructs badly (drawn
with probability proportional to its squared error), its encoder column is that direction scaled to
0.2 x the mean norm of the live encoder columns, its bias 0, and its Adam moments are reset.

Checkpoint directory (one per model, layer and SAE config):
  cfg.json + sae_weights.safetensors   SAELens's layout (export.py); loads in SAELens as is
  headlab.json                         "complete", steps, tokens, the training curve; written last
  state/                               the last periodic checkpoint: weights, Adam moments, dead-latent
                                       clock and step, for resume
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from ..io import has_state, load_state, optimizer_tensors, reading_state, restore_optimizer, save_state
from ..progress import progress_bar
from .base import SparseAutoencoder

STATE = "state"
STATE_LABEL = "SAE training state"
LOG_POINTS = 20  # training-curve rows per fit


def lr_at(step: int, sc: Any) -> float:
    return sc.lr * min(1.0, (step + 1) / sc.warmup_steps) if sc.warmup_steps > 0 else sc.lr


def fit(
    sae: SparseAutoencoder,
    batches: Callable[[int], Iterator[Tensor]],
    sc: Any,
    directory: Path,
    show_progress: bool = True,
    label: str = "fit sae",
) -> dict:
    """Fit until sc.steps, resuming from directory/state; batches(step) streams from that step on.
    Returns {"steps", "tokens", "seconds", "curve", "dead_window_fraction"}."""
    opt = torch.optim.Adam(sae.parameters(), lr=sc.lr, betas=(sc.beta1, sc.beta2), fused=_fusable(sae))
    step, tokens, elapsed = 0, 0, 0.0
    curve: list[dict] = []
    last_fired = torch.zeros(sae.d_sae, dtype=torch.long)
    if has_state(directory / STATE):
        step, tokens, elapsed, curve, last_fired = _load_state(directory / STATE, sae, opt)
    log_every = max(1, sc.steps // LOG_POINTS)
    resample_every = getattr(sc, "resample_every", 0)  # an option of the architectures that resample (relu_l1)
    source = batches(step)
    started = time.perf_counter() - elapsed
    with progress_bar(label, total=sc.steps, completed=step, enabled=show_progress) as bar:
        while step < sc.steps:
            x = next(source)
            if step == 0:
                with torch.no_grad():
                    sae.b_dec.copy_(x.mean(0))  # the decoder bias starts at the data's centre
            for group in opt.param_groups:
                group["lr"] = lr_at(step, sc)
            loss, parts, fires = sae.fit_loss(x, step)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            if not sae.fit_loss_grad_tangent:
                sae.remove_parallel_grad()
            opt.step()
            sae.normalize_decoder()
            step += 1
            tokens += x.shape[0]
            last_fired[fires > 0] = tokens
            dead = (
                (tokens - last_fired >= sc.dead_window)
                if tokens >= sc.dead_window
                else torch.zeros_like(fires, dtype=torch.bool)
            )
            if resample_every > 0 and step % resample_every == 0 and step <= sc.steps - resample_every and dead.any():
                resample(sae, opt, x, dead)
                last_fired[dead] = tokens  # a fresh latent gets a full window to prove itself
            if step % log_every == 0 or step == sc.steps:
                row = {
                    "loss": loss.item(),
                    **{k: v.item() for k, v in parts.items()},
                    "l0": fires.sum().item() / x.shape[0],
                    "dead_window_fraction": dead.float().mean().item(),
                }
                curve += [{"step": step, "metric": k, "value": v} for k, v in row.items()]
                bar.update(step, f"mse={row['mse']:.4g} l0={row['l0']:.1f} dead={row['dead_window_fraction']:.2f}")
            else:
                bar.update(step)
            if step % sc.checkpoint_every == 0 and step < sc.steps:
                _save_state(directory / STATE, sae, opt, step, tokens, time.perf_counter() - started, curve, last_fired)
    dead_fraction = float((tokens - last_fired >= sc.dead_window).float().mean()) if tokens >= sc.dead_window else 0.0
    return {
        "steps": step,
        "tokens": tokens,
        "seconds": time.perf_counter() - started,
        "curve": curve,
        "dead_window_fraction": dead_fraction,
    }


def _fusable(sae: SparseAutoencoder) -> bool:
    """Adam's fused kernel (one pass over each parameter instead of a dozen; 5 ms a step against 60 on
    2 cores at d_sae 12288) where torch has it for these tensors: the same update up to float rounding."""
    return all(p.dtype.is_floating_point and p.device.type in ("cpu", "cuda") for p in sae.parameters())


@torch.no_grad()
def resample(sae: SparseAutoencoder, opt: torch.optim.Optimizer, x: Tensor, dead: Tensor) -> None:
    idx = dead.nonzero().squeeze(1)
    recon, _ = sae(x)
    err = (x - recon).pow(2).sum(-1)
    if float(err.sum()) <= 0:
        return
    pick = torch.multinomial(err.pow(2) / err.pow(2).sum(), len(idx), replacement=True)
    directions = x[pick] - sae.b_dec
    directions /= directions.norm(dim=1, keepdim=True).clamp_min(1e-8)
    alive = ~dead
    scale = 0.2 * (sae.W_enc[:, alive].norm(dim=0).mean() if alive.any() else 1.0)
    sae.W_dec[idx] = directions
    sae.W_enc[:, idx] = directions.t() * scale
    sae.b_enc[idx] = 0.0
    for param, rows in ((sae.W_dec, (idx, slice(None))), (sae.W_enc, (slice(None), idx)), (sae.b_enc, (idx,))):
        state = opt.state.get(param, {})
        for key in ("exp_avg", "exp_avg_sq"):
            if key in state:
                state[key][rows] = 0.0


def _adam_names(sae: SparseAutoencoder) -> dict[Tensor, str]:
    return {p: f"adam.{n}" for n, p in sae.named_parameters()}


def _save_state(
    where: Path,
    sae: SparseAutoencoder,
    opt: torch.optim.Optimizer,
    step: int,
    tokens: int,
    elapsed: float,
    curve: list,
    last_fired: Tensor,
) -> None:
    tensors = {f"sae.{k}": v.detach().contiguous() for k, v in sae.state_dict().items()}
    tensors["last_fired"] = last_fired
    tensors.update(optimizer_tensors(opt, _adam_names(sae)))
    payload = {"step": step, "tokens": tokens, "elapsed": elapsed, "curve": curve}
    save_state(where, {"state": tensors}, payload)


def _load_state(
    where: Path, sae: SparseAutoencoder, opt: torch.optim.Optimizer
) -> tuple[int, int, float, list, Tensor]:
    tensors, payload = load_state(where, STATE_LABEL, files=["state"])
    flat = tensors["state"]
    with reading_state(where, STATE_LABEL):
        sae.load_state_dict({k[4:]: v for k, v in flat.items() if k.startswith("sae.")})
    restore_optimizer(opt, flat, _adam_names(sae))
    return payload["step"], payload["tokens"], payload["elapsed"], payload["curve"], flat["last_fired"]
