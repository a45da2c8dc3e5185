"""Attention paths as kernels: the finite-width theory of Tiberi et al. (arXiv 2405.15926, Sec. 3).

With Gaussian priors, the Bayesian network's predictor is kernel regression with
    K = (1/H) sum_{pi, pi'} U_{pi pi'} C_{pi pi'},   C_{pi pi'}[mu, nu] = sigma_0^2 x_pi^mu . x_pi'^nu / D,
an order parameter U over pairs of paths weighting path-path kernels C. In the infinite-width (GP) limit
U = sigma_1^2 .. sigma_L^2 sigma_a^2 I: every path counts the same and cross-path kernels drop out. At
finite width N, with P/N of order one, U minimises the action (divided by N)
    S = log det(K + T I) + y^T (K + T I)^-1 y + entropy(U),
where the entropy comes from the prior, one term per layer over nested order parameters U_l (pairs of
partial paths (h_l, .., h_L), U_1 = U over whole paths; U_{L+1} = U_a, a scalar solved in closed form):
    S_a = N (U_a / sigma_a^2 - log U_a)
    S_l = N (Tr(U_{l+1}^-1 Tr_{h_l} U_l) / sigma_l^2 - log det U_l + H_l log det U_{l+1}),
with Tr_{h_l} the partial trace over the major index. Sampled weights give U directly:
U = < e_pi . e_pi' / N > over the posterior, e the paths' effective weights (models/pathnet.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

import torch
from torch import Tensor

from ..models.pathnet import path_tuples


def path_kernels(xa: Tensor, xb: Tensor, sigma0_sq: float = 1.0) -> Tensor:
    """C [paths, paths, n_a, n_b] from path inputs [n, paths, D]."""
    return sigma0_sq * torch.einsum("mpd,nqd->pqmn", xa, xb) / xa.shape[-1]


def kernel(c: Tensor, u: Tensor) -> Tensor:
    """K [n_a, n_b] = (1/H) sum U C, with H the number of paths in C."""
    u = (u + u.T) / 2
    return torch.einsum("pq,pqmn->mn", u, c) / c.shape[0]


def with_noise(k: Tensor, temperature: float) -> Tensor:
    """K + T I: the training outputs' covariance under the Gaussian likelihood."""
    return k + temperature * torch.eye(k.shape[0], dtype=k.dtype)


def gp_order(n_paths: int, variances: list[float]) -> Tensor:
    """U of the infinite-width limit: the product of the layers' and the readout's prior variances."""
    scale = float(torch.tensor(variances[1:]).prod())
    return scale * torch.eye(n_paths, dtype=torch.float64)


def predict(
    k_train: Tensor, k_cross: Tensor, y: Tensor, temperature: float, k_test_diag: Tensor | None = None
) -> tuple[Tensor, Tensor | None]:
    """Posterior mean y^T (K + T I)^-1 k and variance k** - k^T (K + T I)^-1 k at the test inputs."""
    solved = torch.linalg.solve(with_noise(k_train, temperature), k_cross)  # [n_train, n_test]
    mean = y @ solved
    var = None if k_test_diag is None else k_test_diag - (k_cross * solved).sum(0)
    return mean, var


def path_predictions(c_train: Tensor, c_cross: Tensor, u: Tensor, y: Tensor, temperature: float) -> Tensor:
    """Each path's share of the posterior mean at the test inputs [paths, n_test]; they sum to predict's mean.

    Path pi's output is Cov(f_pi(x*), f(X)) (K + T I)^-1 y, its covariance with the training outputs
    being (1/H) sum_pi' U_{pi pi'} C_{pi' pi}(X, x*). Zeroing a path's share removes it from the learned
    predictor without refitting (pruning a trained network)."""
    u = (u + u.T) / 2
    alpha = torch.linalg.solve(with_noise(kernel(c_train, u), temperature), y)
    return torch.einsum("pq,qpmn,m->pn", u, c_cross, alpha) / c_train.shape[0]


def marginal_nll(c_train: Tensor, u: Tensor, y: Tensor, temperature: float) -> Tensor:
    """-log N(y; 0, K(U) + T I) up to a constant: the likelihood of the other weights with V0 integrated out."""
    chol = torch.linalg.cholesky(with_noise(kernel(c_train, u), temperature))
    white = torch.linalg.solve_triangular(chol, y[:, None], upper=False)
    return 0.5 * white.pow(2).sum() + torch.log(chol.diagonal()).sum()


def correct(prediction: Tensor, y: Tensor) -> Tensor:
    """1 where the sign is right, 1/2 where the prediction is exactly 0 (no paths left: a coin flip)."""
    return (torch.sign(prediction) == y).double() + 0.5 * (prediction == 0).double()


def accuracy(prediction: Tensor, y: Tensor) -> float:
    return float(correct(prediction, y).mean())


# ---------------------------------------------------------------- the action and its minimum


@dataclass
class OrderParameters:
    u: Tensor  # U_1 over paths [H, H]
    nested: list[Tensor]  # U_1 .. U_L
    u_a: float
    action: float
    grad_max: float
    steps: int


def _partial_trace_major(u: Tensor, major: int) -> Tensor:
    rest = u.shape[0] // major
    return torch.einsum("arab->rb", u.reshape(major, rest, major, rest))


def _readout_order(trace_last: Tensor, h_last: int, var_last: float, var_a: float) -> Tensor:
    """U_a at the stationary point of S_a + S_L (equal widths)."""
    b = var_a * (h_last - 1)
    g = trace_last * var_a / var_last
    return (-b + torch.sqrt(b * b + 4 * g)) / 2


def action(
    nested: list[Tensor], c: Tensor, y: Tensor, heads: list[int], width: int, variances: list[float], temperature: float
) -> tuple[Tensor, Tensor]:
    """(S / N, U_a) for nested order parameters U_1 .. U_L (each symmetrised here)."""
    nested = [(u + u.T) / 2 for u in nested]
    a = with_noise(kernel(c, nested[0]), temperature)
    energy = torch.logdet(a) + y @ torch.linalg.solve(a, y)
    layers = len(heads)
    u_a = _readout_order(torch.trace(nested[-1]), heads[-1], variances[layers], variances[-1])
    entropy = width * (u_a / variances[-1] - torch.log(u_a))
    for l in range(layers):
        inner = _partial_trace_major(nested[l], heads[l])
        if l + 1 < layers:
            outer = nested[l + 1]
            coupling = torch.trace(torch.linalg.solve(outer, inner))
            outer_logdet = torch.logdet(outer)
        else:
            coupling, outer_logdet = inner.sum() / u_a, torch.log(u_a)
        entropy = entropy + width * (coupling / variances[l + 1] - torch.logdet(nested[l]) + heads[l] * outer_logdet)
    return (energy + entropy) / width, u_a


def gp_nested(heads: list[int], variances: list[float]) -> list[Tensor]:
    """U_1 .. U_L at the entropy's minimum (the GP limit)."""
    out = []
    for l in range(len(heads)):
        size = int(torch.tensor(heads[l:]).prod())
        out.append(float(torch.tensor(variances[l + 1 :]).prod()) * torch.eye(size, dtype=torch.float64))
    return out


def solve_order(
    c: Tensor,
    y: Tensor,
    heads: list[int],
    width: int,
    variances: list[float],
    temperature: float,
    tol: float = 1e-7,
    max_steps: int = 5_000,
    on_step: Callable[[int, float], None] | None = None,
) -> OrderParameters:
    """Minimise the action from the GP value by L-BFGS (strong Wolfe line search) until every |dS/dU| < tol.

    The authors use Adam to a tolerance of 1e-5; on these few dozen parameters L-BFGS reaches 1e-7 in a
    small fraction of the time."""
    params = [u.clone().requires_grad_(True) for u in gp_nested(heads, variances)]
    opt = torch.optim.LBFGS(
        params,
        lr=1,
        max_iter=50,
        tolerance_grad=tol / 10,
        tolerance_change=1e-15,
        history_size=50,
        line_search_fn="strong_wolfe",
    )

    def closure() -> Tensor:
        opt.zero_grad()
        loss, _ = action(params, c, y, heads, width, variances, temperature)
        loss.backward()
        return loss

    grad_max, steps, previous = float("inf"), 0, None
    while steps < max_steps:
        opt.step(closure)
        steps = opt.state[opt._params[0]]["n_iter"]
        loss = closure().detach()
        stalled = previous is not None and float(loss) == previous
        previous = float(loss)
        if not torch.isfinite(loss):
            raise FloatingPointError(f"the action became {float(loss)} (U left the positive definite cone)")
        # closure() has just run backward: every parameter has its gradient
        grad_max = max(float(cast(Tensor, p.grad).abs().max()) for p in params)
        if on_step is not None:
            on_step(min(steps, max_steps), grad_max)
        if grad_max < tol or stalled:  # stalled: float64 cannot lower the action further
            break
    with torch.no_grad():
        nested = [((p + p.T) / 2).detach() for p in params]
        value, u_a = action(nested, c, y, heads, width, variances, temperature)
    return OrderParameters(nested[0], nested, float(u_a), float(value), grad_max, steps)


# ---------------------------------------------------------------- reading U


def empirical_order(effective: Tensor) -> Tensor:
    """U [paths, paths] from effective weights [samples, paths, N]: < e_pi . e_pi' / N >."""
    return torch.einsum("spi,sqi->pq", effective, effective) / (effective.shape[0] * effective.shape[-1])


def alignment(k: Tensor, y: Tensor, top: int) -> Tensor:
    """|cos| between each of the top principal components of K and the labels [top]."""
    values, vectors = torch.linalg.eigh(k)
    order = values.argsort(descending=True)[:top]
    return (vectors[:, order].T @ y).abs() / y.norm()


def head_scores(u: Tensor, heads: list[int]) -> dict[tuple[int, int], float]:
    """Sum of |U| over the path pairs through each head (a pair counted once), divided by the largest."""
    paths = path_tuples(heads)
    scores = {}
    for l, h_count in enumerate(heads):
        for h in range(h_count):
            through = torch.tensor([p[l] == h for p in paths])
            scores[(l, h)] = float(u.abs()[through[:, None] | through[None, :]].sum())
    top = max(scores.values()) or 1.0
    return {k: v / top for k, v in scores.items()}


def kept_paths(heads: list[int], removed: list[tuple[int, int]]) -> Tensor:
    """[paths] bool: True for each path through none of the removed (layer, head)."""
    return torch.tensor([not any(p[l] == h for l, h in removed) for p in path_tuples(heads)])
