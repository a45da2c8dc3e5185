"""model=pathnet on task=markov (Tiberi et al., arXiv 2405.15926), one run: theory, GP, posterior
samples, gradient descent, pruning.

Everything lands in one tidy table (results.py): test accuracy per method (theory = kernel regression
with the order parameter U that minimises the action at this width; gp = U of the infinite-width limit,
also over the reference path subsets; sample = the mean predictor over HMC posterior draws; gd = one
network trained by gradient descent), the U matrices (theory, sample, gd, gp) in long form, the
alignment of the kernels' principal components with the labels, head scores from U, and test accuracy
with heads pruned (one at a time, and cumulatively in score order and in every/random order).
"""

from __future__ import annotations

import itertools
import logging
import time
from typing import cast

import numpy as np
import pandas as pd
import torch
from torch import Tensor

from .. import results
from ..analysis import paths as theory
from ..config import Config, option, run_info
from ..errors import UsageError
from ..models.pathnet import PathNet, PathNetConfig
from ..progress import progress_bar
from ..tasks.markov import MarkovConfig, MarkovTask
from ..train.bayes import HMCStats, gradient_descent, hmc
from .context import RunContext
from .study import Study
from .summary import head_table

log = logging.getLogger("headlab")
TEST_SEED_OFFSET = 20_000  # the test chains never overlap the training chains' random stream
MAX_RANDOM_ORDERS = 120  # every pruning order up to 5 heads, else this many drawn at random


def run(ctx: RunContext) -> pd.DataFrame:
    """Theory, samples and gradient descent instead of an intervention sweep."""
    cfg = ctx.cfg
    if option(cfg.model.kind) != "pathnet":
        raise UsageError(f"task=markov runs on model=pathnet, not model={cfg.model.name}")
    with ctx.timed("total"):
        df, extra = measure(cfg, ctx.show_progress)
    ctx.timings.update(extra.pop("timings"))
    ctx.meta.update(extra)
    return df


def build(cfg: Config) -> tuple[PathNet, MarkovTask]:
    if cfg.task.name != "markov":
        raise UsageError(f"model=pathnet runs task=markov only, not task={cfg.task.name}")
    # the config's sections as composed: model=pathnet gives a PathNetConfig, task=markov a MarkovConfig
    markov, m = cast(MarkovConfig, cfg.task), cast(PathNetConfig, cfg.model)
    task = MarkovTask(markov)
    variances = list(m.variances) if m.variances is not None else [1.0] * (len(m.heads) + 2)
    net = PathNet.build(
        m.heads,
        markov.n_features,
        task.n_tokens,
        m.width,
        m.beta,
        variances,
        head_seed=m.head_seed,
        random_strength=m.random_strength,
    )
    return net, task


def parse_paths(net: PathNet, spec: list[str]) -> list[int]:
    """Path indices from strings 'h1-h2-..' (head index per layer)."""
    index = {"-".join(map(str, p)): i for i, p in enumerate(net.paths())}
    unknown = [s for s in spec if s not in index]
    if unknown:
        raise UsageError(f"unknown path {', '.join(unknown)}; paths are: {', '.join(index)}")
    return [index[s] for s in spec]


class PathNetRun:
    """The arrays of one run, and the table rows they become."""

    def __init__(self, cfg: Config, show_progress: bool = False):
        self.cfg, self.show_progress = cfg, show_progress
        self.net, self.task = build(cfg)
        train = self.task.sample(cast(MarkovConfig, cfg.task).n_train, cfg.seed)
        test = self.task.sample(cfg.task.n_prompts, cfg.seed + TEST_SEED_OFFSET)
        self.y, self.y_test = train.y, test.y
        self.x_train, self.x_test = self.net.path_inputs(train.x), self.net.path_inputs(test.x)
        s0 = self.net.variances[0]
        self.c_train = theory.path_kernels(self.x_train, self.x_train, s0)
        self.c_cross = theory.path_kernels(self.x_train, self.x_test, s0)
        self.heads = self.net.heads_per_layer
        self.labels = [self.net.path_label(p) for p in self.net.paths()]
        self.info: dict = {}

    @property
    def model_cfg(self) -> PathNetConfig:
        """cfg.model: a PathNetConfig, the one model this study runs (run() refuses any other kind)."""
        return cast(PathNetConfig, self.cfg.model)

    # -------------------------------------------------------------- predictors

    def kernel_outputs(self, u: Tensor, subset: list[int] | None = None) -> Tensor:
        """Per-path test outputs [1, paths, n_test] of kernel regression with order parameter u."""
        c_train, c_cross = self.c_train, self.c_cross
        if subset is not None:
            s = torch.tensor(subset)
            c_train, c_cross = c_train[s][:, s], c_cross[s][:, s]  # u is given over the subset
        return theory.path_predictions(c_train, c_cross, u, self.y, self.model_cfg.temperature)[None]

    def network_outputs(self, weights: dict[str, Tensor]) -> Tensor:
        """Each path's share of a network's f on the test set [paths, n_test]."""
        return self.net.path_outputs(weights, self.x_test).T.double()

    def likelihood(self, names: list[str], x: Tensor, y: Tensor, temperature: float):
        """Negative log likelihood of all weights (V0 included): squared error / 2T."""

        def fn(params: list[Tensor]) -> Tensor:
            f = self.net.forward_paths(dict(zip(names, params)), x)
            return ((f - y) ** 2).sum(dtype=torch.float64) / (2 * temperature)

        return fn

    def collapsed_likelihood(self, names: list[str], temperature: float):
        """Negative log likelihood of a, V_1..V_L with V0 integrated out: f is linear in V0 with a Gaussian
        prior, so given the other weights the outputs are Gaussian with covariance K(U) + T I."""

        def fn(params: list[Tensor]) -> Tensor:
            u = self.order_of(dict(zip(names, params)))
            return theory.marginal_nll(self.c_train, u, self.y, temperature)

        return fn

    def order_of(self, weights: dict[str, Tensor]) -> Tensor:
        return theory.empirical_order(self.net.effective_weights(weights).double()[None])

    # -------------------------------------------------------------- stages

    def run_theory(self) -> None:
        cfg = self.model_cfg
        with progress_bar("theory: minimising the action", cfg.theory_steps, enabled=self.show_progress) as bar:
            order = theory.solve_order(
                self.c_train,
                self.y,
                self.heads,
                self.net.width,
                self.net.variances,
                cfg.temperature,
                tol=cfg.theory_tol,
                max_steps=cfg.theory_steps,
                on_step=lambda s, g: bar.update(s, f"max|grad| {g:.1e}"),
            )
        if order.grad_max >= cfg.theory_tol:
            log.warning(
                "theory: max|dS/dU| = %.2e after %d steps (tolerance %.0e)", order.grad_max, order.steps, cfg.theory_tol
            )
        self.u = {"theory": order.u, "gp": theory.gp_order(self.net.n_paths, self.net.variances)}
        self.info["theory"] = {
            "steps": order.steps,
            "grad_max": order.grad_max,
            "action": order.action,
            "u_a": order.u_a,
        }
        self.outputs = {"theory": self.kernel_outputs(order.u), "gp": self.kernel_outputs(self.u["gp"])}
        for name, spec in (cfg.reference_paths or {}).items():
            subset = parse_paths(self.net, list(spec))
            self.outputs[f"gp_{name}"] = self.kernel_outputs(theory.gp_order(len(subset), self.net.variances), subset)

    def run_samples(self) -> None:
        """HMC draws; with model.collapse_input (default) V0 is integrated out and each draw's outputs are
        its exact conditional mean given the other weights (Rao-Blackwellised)."""
        cfg, net = self.model_cfg, self.net
        if cfg.samples <= 0:
            return
        collapsed = cfg.collapse_input
        dtype = torch.float64 if collapsed else getattr(torch, cfg.sample_dtype)
        gen = torch.Generator().manual_seed(self.cfg.seed)
        init = net.init_weights(gen, dtype)
        if collapsed:
            init.pop("V0")
        names = list(init)
        orders, per_path = [], []

        def keep(params: list[Tensor]) -> None:
            weights = dict(zip(names, params))
            u = self.order_of(weights)
            orders.append(u)
            per_path.append(self.kernel_outputs(u)[0] if collapsed else self.network_outputs(weights))

        if collapsed:
            likelihood = self.collapsed_likelihood(names, cfg.temperature)
        else:
            likelihood = self.likelihood(names, self.x_train.to(dtype), self.y.to(dtype), cfg.temperature)
        variances = [net.prior_variance(n) for n in names]
        start = time.perf_counter()
        with progress_bar(f"HMC, N={net.width}", cfg.warmup + cfg.samples, enabled=self.show_progress) as bar:
            stats: HMCStats = hmc(
                likelihood,
                list(init.values()),
                cfg.warmup,
                cfg.samples,
                gen,
                prior_variances=variances,
                trajectory=cfg.trajectory,
                max_leapfrog=cfg.max_leapfrog,
                on_sample=keep,
                on_iteration=lambda it, s: bar.update(it),
            )
        self.info["sample"] = {
            "collapsed_input": collapsed,
            "step_size": stats.step_size,
            "accept_rate": stats.accept_rate,
            "leapfrog_steps": stats.leapfrog_steps,
            "divergent": stats.divergent,
            "seconds": time.perf_counter() - start,
        }
        self.u["sample"] = torch.stack(orders).mean(0)
        self.outputs["sample"] = torch.stack(per_path)  # [samples, paths, n_test]

    def run_gd(self) -> None:
        train = self.cfg.train
        if train.steps <= 0:
            return
        gen = torch.Generator().manual_seed(self.cfg.seed + 1)
        init = self.net.init_weights(gen)
        names = list(init)
        temperature = self.model_cfg.temperature
        likelihood = self.likelihood(names, self.x_train, self.y, temperature)
        variances = [self.net.prior_variance(n) for n in names]
        with progress_bar(f"gradient descent, N={self.net.width}", train.steps, enabled=self.show_progress) as bar:
            params, loss = gradient_descent(
                lambda p: (likelihood(p) + _prior(p, variances)) * temperature,
                list(init.values()),
                train.steps,
                train.lr,
                on_step=lambda s, _: bar.update(s),
            )
        weights = dict(zip(names, params))
        self.u["gd"] = self.order_of(weights)
        self.outputs["gd"] = self.network_outputs(weights)[None]
        self.info["gd"] = {"final_loss": loss}

    # -------------------------------------------------------------- rows

    def predictions(self, method: str, keep: Tensor | None = None) -> Tensor:
        """Test predictions [n_test] of a method (mean over draws), with only the kept paths when given."""
        out = self.outputs[method]  # [draws, paths, n_test]
        if keep is not None:
            out = out * keep[None, :, None]
        return out.sum(1).mean(0)

    def accuracy_table(self, labels: list[dict], predictions: list[Tensor]) -> pd.DataFrame:
        y = self.y_test.numpy()
        f = torch.stack(predictions)
        quantities = np.stack([theory.correct(f, self.y_test).numpy(), f.numpy() * y], -1)  # [k, n, 2]
        aggregates = {"test_acc": lambda q, _a: q[..., 0].mean(-1), "test_margin": lambda q, _a: q[..., 1].mean(-1)}
        return results.tidy(
            run_info(self.cfg),
            labels,
            quantities,
            ("correct", "margin"),
            {"label": y},
            aggregates,
            n_boot=self.cfg.output.n_boot,
        )

    def table(self) -> pd.DataFrame:
        methods = list(self.outputs)
        labels = [{"intervention": "none", "method": m} for m in methods]
        preds = [self.predictions(m) for m in methods]
        pruned_labels, pruned_preds, random_orders = self._pruning(methods)
        frames = [self.accuracy_table(labels + pruned_labels, preds + pruned_preds), random_orders]
        frames.append(self._order_rows())
        frames.append(self._score_rows())
        frames.append(self._alignment_rows())
        df = pd.concat(frames, ignore_index=True)
        df["width"] = self.net.width
        return results.conform(df.assign(**run_info(self.cfg)))

    def _keep(self, removed: list[tuple[int, int]]) -> Tensor:
        return theory.kept_paths(self.heads, removed)

    def _pruning(self, methods: list[str]) -> tuple[list[dict], list[Tensor], pd.DataFrame]:
        """Single heads and score-ordered prefixes (rows for the bootstrap table), and random orders
        (one row per number pruned: mean accuracy over orders, interval over orders)."""
        heads = [(l, h) for l, count in enumerate(self.heads) for h in range(count)]
        orders = list(itertools.permutations(heads))
        if len(orders) > MAX_RANDOM_ORDERS:
            rng = np.random.default_rng(self.cfg.seed)
            orders = [tuple(heads[i] for i in rng.permutation(len(heads))) for _ in range(MAX_RANDOM_ORDERS)]
        labels, preds, random_rows = [], [], []
        for method in (m for m in ("theory", "sample", "gd") if m in methods):
            for l, h in heads:
                labels.append({"intervention": "prune", "method": method, "layer": l, "head": h})
                preds.append(self.predictions(method, self._keep([(l, h)])))
            scores = theory.head_scores(self.u[method], self.heads)
            by_score = sorted(heads, key=lambda lh: scores[lh])
            for k in range(1, len(heads)):
                labels.append({"intervention": "prune_by_score", "method": method, "n_pruned": k})
                preds.append(self.predictions(method, self._keep(by_score[:k])))
                accs = [theory.accuracy(self.predictions(method, self._keep(list(o[:k]))), self.y_test) for o in orders]
                random_rows.append(
                    {
                        "intervention": "prune_random",
                        "method": method,
                        "n_pruned": k,
                        "metric": "test_acc",
                        "value": float(np.mean(accs)),
                        "n": len(accs),
                        "ci_low": float(np.percentile(accs, 2.5)),
                        "ci_high": float(np.percentile(accs, 97.5)),
                    }
                )
        return labels, preds, pd.DataFrame(random_rows)

    def _order_rows(self) -> pd.DataFrame:
        rows = []
        for method, u in self.u.items():
            for i, j in itertools.product(range(len(self.labels)), repeat=2):
                rows.append(
                    {
                        "intervention": "none",
                        "method": method,
                        "metric": "order_parameter",
                        "value": float(u[i, j]),
                        "n": 1,
                        "path": self.labels[i],
                        "path_b": self.labels[j],
                    }
                )
        if "sample" in self.u:
            diff = torch.linalg.norm(self.u["sample"] - self.u["theory"]) / torch.linalg.norm(self.u["theory"])
            rows.append(
                {
                    "intervention": "none",
                    "method": "sample",
                    "metric": "u_rel_error_vs_theory",
                    "value": float(diff),
                    "n": self.model_cfg.samples,
                }
            )
        return pd.DataFrame(rows)

    def _score_rows(self) -> pd.DataFrame:
        rows = []
        for method in (m for m in ("theory", "sample", "gd") if m in self.u):
            for (l, h), score in theory.head_scores(self.u[method], self.heads).items():
                rows.append(
                    {
                        "intervention": "none",
                        "method": method,
                        "layer": l,
                        "head": h,
                        "metric": "head_score",
                        "value": score,
                        "n": 1,
                        "head_kind": self.net.heads[l][h],
                    }
                )
        return pd.DataFrame(rows)

    def _alignment_rows(self) -> pd.DataFrame:
        rows = []
        top = min(self.model_cfg.alignment_top, len(self.y))
        for method in ("theory", "gp"):
            k = theory.kernel(self.c_train, self.u[method])
            for rank, value in enumerate(theory.alignment(k, self.y, top).tolist(), 1):
                rows.append(
                    {
                        "intervention": "none",
                        "method": method,
                        "metric": "label_alignment",
                        "value": value,
                        "n": len(self.y),
                        "rank": rank,
                    }
                )
        return pd.DataFrame(rows)


def _prior(params: list[Tensor], variances: list[float]) -> Tensor:
    total = sum(torch.sum(p * p, dtype=torch.float64) / (2 * v) for p, v in zip(params, variances))
    assert isinstance(total, Tensor)  # not sum()'s start 0: a net always has parameters
    return total


def measure(cfg: Config, show_progress: bool = False) -> tuple[pd.DataFrame, dict]:
    """The run's table and what to keep in meta.json (solver, sampler and training diagnostics)."""
    study = PathNetRun(cfg, show_progress)
    timings = {}
    for stage in ("theory", "samples", "gd"):
        start = time.perf_counter()
        getattr(study, f"run_{stage}")()
        timings[stage] = time.perf_counter() - start
    df = study.table()
    for key in ("n_pruned", "rank"):
        if key in df:
            df[key] = df[key].astype("Int64")
    return df, {"pathnet": study.info, "timings": {k: round(v, 3) for k, v in timings.items()}}


STUDY = Study(
    name="pathnet",
    description="PathNet on task=markov (Tiberi et al. 2024): theory, GP, posterior samples, GD, pruning",
    run=run,
    summary=head_table,
    reads=("model", "task", "train"),
    sections=("model",),
    implied_by=(("model", "pathnet", "kind"), ("task", "markov", "name")),
)
