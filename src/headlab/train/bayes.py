"""Learning a PathNet: posterior samples by Hamiltonian Monte Carlo, and gradient descent for comparison.

The posterior is prior (Gaussian, variance sigma_l^2 per block) times likelihood exp(-sum (f - y)^2 / 2T).
The sampler is HMC (Neal 2011) with an identity mass matrix, trajectories of fixed (jittered) length and
the step size tuned during warm-up by dual averaging to a target acceptance rate (Hoffman and Gelman 2014,
Alg. 5); warm-up draws are discarded. Given the Gaussian prior's precisions, the Hamiltonian is split
(Shahbaba et al. 2014): the prior and kinetic part flows exactly (a rotation of each (theta, p) pair) and
only the likelihood's gradient kicks. With millions of weights, plain leapfrog must shrink its step as
dims^-1/4 to integrate the prior accurately; the split integrator's error comes from the likelihood alone.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

import torch
from torch import Tensor

Potential = Callable[[list[Tensor]], Tensor]  # parameters -> negative log density (scalar, float64)


@dataclass
class HMCStats:
    step_size: float = 0.0
    accept_rate: float = 0.0  # mean Metropolis acceptance probability over the kept draws
    leapfrog_steps: int = 0
    divergent: int = 0  # kept draws whose energy error exceeded 1000


def _grad(potential: Potential, params: list[Tensor]) -> tuple[Tensor, list[Tensor]]:
    params = [p.detach().requires_grad_(True) for p in params]
    value = potential(params)
    return value.detach(), list(torch.autograd.grad(value, params))


def _kinetic(momenta: list[Tensor]) -> Tensor:
    return cast(Tensor, sum(torch.sum(m * m, dtype=torch.float64) for m in momenta)) / 2


def _drift(params, momenta, eps: float, omegas: list[float] | None):
    """Move for time eps under the kinetic energy, plus the Gaussian prior when its omegas are given."""
    if omegas is None:
        return [p.detach() + eps * m for p, m in zip(params, momenta)], momenta
    new_params, new_momenta = [], []
    for p, m, w in zip(params, momenta, omegas):
        c, s = math.cos(w * eps), math.sin(w * eps)
        new_params.append(p.detach() * c + m * (s / w))
        new_momenta.append(m * c - p.detach() * (w * s))
    return new_params, new_momenta


def _prior_energy(params, omegas: list[float] | None) -> Tensor:
    if omegas is None:
        return torch.zeros((), dtype=torch.float64)
    energies = (w * w * torch.sum(p.detach() * p.detach(), dtype=torch.float64) for p, w in zip(params, omegas))
    return cast(Tensor, sum(energies)) / 2


def _leapfrog(potential, params, momenta, grads, eps: float, n: int, omegas=None):
    momenta = [m - eps / 2 * g for m, g in zip(momenta, grads)]
    for i in range(n):
        params, momenta = _drift(params, momenta, eps, omegas)
        value, grads = _grad(potential, params)
        if not torch.isfinite(value):
            return params, momenta, grads, value
        scale = eps if i < n - 1 else eps / 2
        momenta = [m - scale * g for m, g in zip(momenta, grads)]
    return params, momenta, grads, value


def hmc(
    potential: Potential,
    init: list[Tensor],
    n_warmup: int,
    n_samples: int,
    gen: torch.Generator,
    prior_variances: list[float] | None = None,
    trajectory: float = 1.5,
    target_accept: float = 0.8,
    max_leapfrog: int = 512,
    on_sample: Callable[[list[Tensor]], None] | None = None,
    on_iteration: Callable[[int, HMCStats], None] | None = None,
) -> HMCStats:
    """Draw n_samples states after n_warmup tuning iterations; on_sample sees each kept state.

    With prior_variances (one per parameter tensor), the target is potential + sum |p|^2 / 2 var, and the
    prior part is integrated exactly; potential is then the likelihood term alone."""
    omegas = None if prior_variances is None else [v**-0.5 for v in prior_variances]
    params = [p.detach().clone() for p in init]
    value, grads = _grad(potential, params)
    eps = _initial_step(potential, params, value, grads, gen, omegas)
    mu, log_avg, h_avg = math.log(10 * eps), 0.0, 0.0  # dual averaging state
    stats = HMCStats()
    accepted_sum = 0.0
    for it in range(1, n_warmup + n_samples + 1):
        jitter = 0.8 + 0.4 * float(torch.rand((), generator=gen))
        n_steps = max(1, min(max_leapfrog, round(trajectory * jitter / eps)))
        momenta = [torch.randn(p.shape, generator=gen, dtype=p.dtype) for p in params]
        h0 = value + _prior_energy(params, omegas) + _kinetic(momenta)
        new_params, new_momenta, new_grads, new_value = _leapfrog(
            potential, params, momenta, grads, eps, n_steps, omegas
        )
        h1 = new_value + _prior_energy(new_params, omegas) + _kinetic(new_momenta)
        error = float(h1 - h0) if torch.isfinite(h1) else math.inf
        accept_prob = math.exp(min(0.0, -error)) if math.isfinite(error) else 0.0
        if float(torch.rand((), generator=gen)) < accept_prob:
            params, grads, value = new_params, new_grads, new_value
        if it <= n_warmup:
            t = it
            h_avg = (1 - 1 / (t + 10)) * h_avg + (target_accept - accept_prob) / (t + 10)
            log_eps = mu - math.sqrt(t) / 0.05 * h_avg
            weight = t**-0.75
            log_avg = weight * log_eps + (1 - weight) * log_avg
            eps = math.exp(log_eps) if it < n_warmup else math.exp(log_avg)
        else:
            accepted_sum += accept_prob
            stats.divergent += int(not math.isfinite(error) or error > 1000)
            stats.leapfrog_steps += n_steps
            if on_sample is not None:
                on_sample(params)
        if on_iteration is not None:
            on_iteration(it, stats)
    stats.step_size = eps
    stats.accept_rate = accepted_sum / max(n_samples, 1)
    return stats


def _initial_step(potential, params, value, grads, gen, omegas) -> float:
    """Double or halve a step size until one leapfrog step's acceptance crosses 1/2 (Hoffman-Gelman Alg. 4)."""

    def log_accept(eps: float) -> float:
        momenta = [torch.randn(p.shape, generator=gen, dtype=p.dtype) for p in params]
        new_params, new_momenta, _, new_value = _leapfrog(potential, params, momenta, grads, eps, 1, omegas)
        error = float(
            new_value
            + _prior_energy(new_params, omegas)
            + _kinetic(new_momenta)
            - value
            - _prior_energy(params, omegas)
            - _kinetic(momenta)
        )
        return -error if math.isfinite(error) else -math.inf

    eps, half = 0.1, math.log(0.5)
    direction = 1 if log_accept(eps) > half else -1
    for _ in range(60):
        candidate = eps * 2.0**direction
        if (log_accept(candidate) > half) != (direction > 0):
            return candidate if direction < 0 else eps
        eps = candidate
    return eps


def gradient_descent(
    loss_fn: Callable[[list[Tensor]], Tensor],
    init: list[Tensor],
    steps: int,
    lr: float,
    on_step: Callable[[int, float], None] | None = None,
) -> tuple[list[Tensor], float]:
    """Adam on loss_fn from init (full batch); returns the parameters and the final loss."""
    params = [p.detach().clone().requires_grad_(True) for p in init]
    opt = torch.optim.Adam(params, lr=lr)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, steps, eta_min=lr * 0.01)
    loss = torch.tensor(float("nan"))
    for step in range(1, steps + 1):
        opt.zero_grad()
        loss = loss_fn(params)
        loss.backward()
        opt.step()
        sched.step()
        if on_step is not None:
            on_step(step, float(loss.detach()))
    return [p.detach() for p in params], float(loss.detach())
