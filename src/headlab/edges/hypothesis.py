"""The circuit hypothesis tests of Shi et al. 2024 (Hypothesis Testing the Circuit Hypothesis in LLMs,
arXiv 2410.13032), read from their released code (blei-lab/circuitry, circuitry/hypothesis_testing/):
equivalence (non_equivalence.py), independence (non_independence.py) and minimality (minimality.py).

Each takes per-prompt task scores s (here the task's smooth metric, e.g. IOI's logit difference) of the
model, the circuit (everything outside it patched from the corrupted run), its complement (the circuit's
own units patched) or knocked-out circuits, and returns the statistic and a p-value. A small p-value
rejects the test's null:

- equivalence: H0 |P(s(C) > s(M)) - 1/2| <= epsilon (circuit and model equally likely to outperform each
  other); rejected: the circuit is not equivalent to the model. The statistic is the share of prompts on
  which the circuit outperforms the model, as the paper defines it (Sec. 3.1); the released code's
  function plugs the mean score difference into the same formula instead. Prompts where the two tie
  count as not outperforming, as in the paper's indicator.
- independence: H0 s(complement) is independent of s(model) over prompts, by HSIC with a Gaussian kernel
  and a permutation test (Gretton et al. 2007); rejected: the rest of the model still tracks the task.
  The kernel width is the median distance between the two samples' values, as the released code takes it.
- minimality: for each unit u of the circuit, the knockout effect mean_x (s(C) - s(C - u))^2 against the
  same effect of one random unit outside the circuit added to it, mean_x (s(C + e) - s(C))^2, over
  `n_random` draws; the statistic is how many random effects u's exceeds, and the p-value a one-sided
  binomial test of that count against `quantile` (alternative: fewer). Rejected for u: u is no more
  important than a random unit, so the circuit is not minimal. The released code leaves the correction
  for testing many units as a TODO; `minimal` here applies Bonferroni's.

tests/test_audit.py holds these to independent computations (scipy's binomial law and a direct HSIC).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

EPSILON = 0.1  # the released code's default
QUANTILE = 0.9  # minimality: the share of random units a circuit's unit must beat (the released default)
ALPHA = 0.05


@dataclass(frozen=True)
class Outcome:
    test: str  # equivalence | independence | minimality
    statistic: float
    p_value: float
    rejected: bool  # at ALPHA (minimality: after Bonferroni over the units tested)
    meaning: str  # what a rejection says, in words


def equivalence(model: np.ndarray, circuit: np.ndarray, epsilon: float = EPSILON, alpha: float = ALPHA) -> Outcome:
    """`model`, `circuit`: [n] per-prompt scores on the same prompts."""
    from scipy.stats import binom  # scipy.stats costs most of a second to import: only where it is used

    n = len(model)
    outperforms = float((circuit > model).mean())
    t_obs = abs(outperforms - 0.5)
    k = np.arange(n + 1)
    far = np.abs(k / n - 0.5) >= t_obs - 1e-12
    p = float(binom.pmf(k[far], n, 0.5 + epsilon).sum())
    return Outcome("equivalence", outperforms, min(p, 1.0), p < alpha, "the circuit is not equivalent to the model")


def hsic(x: np.ndarray, y: np.ndarray, sigma: float) -> float:
    """HSIC of two samples [n] with one Gaussian kernel of width sigma on each: trace(KHLH) / (n - 1)^2."""
    n = len(x)
    k = np.exp(-((x[:, None] - x[None, :]) ** 2) / (2 * sigma**2))
    l = np.exp(-((y[:, None] - y[None, :]) ** 2) / (2 * sigma**2))  # noqa: E741
    h = np.eye(n) - 1.0 / n
    return float(np.trace(h @ k @ h @ l) / (n - 1) ** 2)


def independence(
    model: np.ndarray, complement: np.ndarray, n_permutations: int = 1000, seed: int = 0, alpha: float = ALPHA
) -> Outcome:
    """`model`, `complement`: [n] per-prompt scores of the model and of the circuit's complement."""
    sigma = float(np.median(np.abs(model[:, None] - complement[None, :])))
    if sigma == 0:
        return Outcome("independence", 0.0, 1.0, False, "the complement still tracks the model on the task")
    observed = hsic(model, complement, sigma)
    rng = np.random.default_rng(seed)
    null = np.array([hsic(model, complement[rng.permutation(len(model))], sigma) for _ in range(n_permutations)])
    p = float((null >= observed).mean())
    return Outcome("independence", observed, p, p < alpha, "the complement still tracks the model on the task")


@dataclass(frozen=True)
class Minimality:
    outcome: Outcome  # statistic: the least p-value's unit's count; p_value: the least, Bonferroni-adjusted
    effects: np.ndarray  # [units tested] each unit's knockout effect
    random_effects: np.ndarray  # [n_random]
    p_values: np.ndarray  # [units tested] unadjusted


def minimality(
    circuit: np.ndarray,
    knocked_out: np.ndarray,
    with_random: np.ndarray,
    quantile: float = QUANTILE,
    alpha: float = ALPHA,
) -> Minimality:
    """`circuit` [n]: the circuit's per-prompt scores; `knocked_out` [units, n]: with each unit removed;
    `with_random` [n_random, n]: with one random unit from outside added."""
    from scipy.stats import binomtest

    effects = ((circuit[None, :] - knocked_out) ** 2).mean(1)
    random_effects = ((with_random - circuit[None, :]) ** 2).mean(1)
    counts = (effects[:, None] > random_effects[None, :]).sum(1)
    m = len(random_effects)
    p = np.array([binomtest(int(c), m, quantile, alternative="less").pvalue for c in counts])
    worst = int(p.argmin()) if len(p) else 0
    adjusted = min(1.0, float(p[worst]) * len(p)) if len(p) else 1.0
    outcome = Outcome(
        "minimality",
        float(counts[worst]) if len(p) else float("nan"),
        adjusted,
        adjusted < alpha,
        "some unit of the circuit matters no more than a random unit outside it",
    )
    return Minimality(outcome, effects, random_effects, p)
