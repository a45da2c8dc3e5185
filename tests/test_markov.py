"""Hidden Markov chain task and attention-path theory (Tiberi et al., arXiv 2405.15926): exact mechanics."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from headlab.analysis import paths as theory
from headlab.models.pathnet import PathNet
from headlab.tasks.markov import MarkovTask
from headlab.train.bayes import hmc
from test_cli import _error_line, headlab

HEADS = [["same_token", "random"], ["uniform", "random"]]


def markov_cfg(**kw):
    base = dict(
        name="markov",
        n_prompts=100,
        n_reference=0,
        n_train=40,
        n_steps=30,
        n_features=200,
        p_stay_plus=0.7,
        p_stay_minus=0.3,
        noise_label=1.0,
        noise_common=1.0,
        noise_orthogonal=1.0,
    )
    return OmegaConf.create({**base, **kw})


def _net(width=16, heads=HEADS, n_steps=30, n_features=200, variances=None):
    variances = variances or [1.0] * (len(heads) + 2)
    return PathNet.build(heads, n_features, n_steps + 1, width, 10.0, variances, head_seed=7)


def test_chains_stay_with_the_class_probability_and_tokens_are_laid_out():
    task = MarkovTask(markov_cfg())
    data = task.sample(4000, seed=1)
    same = (data.states[:, 1:] == data.states[:, :-1]).double()
    plus, minus = data.y > 0, data.y < 0
    assert plus.sum() == minus.sum() == 2000
    # 2000 chains x 29 transitions: the standard error of a frequency is about 0.002
    assert abs(float(same[plus].mean()) - 0.7) < 0.01
    assert abs(float(same[minus].mean()) - 0.3) < 0.01
    assert abs(float((data.states[:, 0] > 0).double().mean()) - 0.5) < 0.03
    assert data.x.shape == (4000, 31, 231)
    assert torch.equal(data.x[:, 0, :200], torch.zeros(4000, 200, dtype=torch.float64))  # BOS has no features
    assert torch.equal(data.x[0, :, 200:], torch.eye(31, dtype=torch.float64))


def test_noise_strengths_act_along_their_own_directions():
    task = MarkovTask(markov_cfg(noise_label=0.5, noise_common=2.0, noise_orthogonal=3.0))
    data = task.sample(2000, seed=2)
    v_plus, v_minus = task.state_vectors()
    clean = torch.where(data.states[..., None] > 0, v_plus, v_minus)
    noise = data.x[:, 1:, :200] - clean
    label_dir = (v_plus - v_minus) / (v_plus - v_minus).norm()
    common_dir = (v_plus + v_minus) / (v_plus + v_minus).norm()
    assert abs(float((noise @ label_dir).std()) - 0.5) < 0.01
    assert abs(float((noise @ common_dir).std()) - 2.0) < 0.03
    rest = noise - (noise @ label_dir)[..., None] * label_dir - (noise @ common_dir)[..., None] * common_dir
    assert abs(float(rest.pow(2).sum(-1).mean() / 198) - 9.0) < 0.05


def test_same_token_head_attends_to_the_previous_token_in_the_same_state_else_to_bos():
    task = MarkovTask(markov_cfg(noise_label=0.0, noise_common=0.0, noise_orthogonal=0.0))
    data = task.sample(20, seed=3)
    attn = _net().attention(data.x)[0][:, 0]  # [n, query, key] of the same-token head
    target = attn[:, 2:].argmax(-1)  # queries 2..30 (query 1 has only BOS before it)
    same = data.states[:, 1:] == data.states[:, :-1]
    expected = torch.where(same, torch.arange(1, 30), torch.zeros(1, dtype=torch.long))
    assert torch.equal(target, expected)
    assert float(attn[:, 2:].max(-1).values.min()) > 0.8  # BOS (1.5) against every same-state token (1)


def test_forward_along_paths_equals_the_layer_by_layer_network():
    task = MarkovTask(markov_cfg())
    data = task.sample(12, seed=4)
    for heads in (
        HEADS,
        [["same_token", "uniform", "random"]],
        [["random"], ["same_token", "uniform"], ["random", "uniform"]],
    ):
        net = _net(heads=heads)
        weights = net.init_weights(torch.Generator().manual_seed(0))
        torch.testing.assert_close(
            net.forward_paths(weights, net.path_inputs(data.x)), net.forward(weights, data.x), rtol=1e-10, atol=1e-12
        )


def test_pruning_a_head_removes_exactly_its_paths_from_the_network():
    task = MarkovTask(markov_cfg())
    x = task.sample(12, seed=4).x
    net = _net(heads=[["same_token", "random", "uniform"], ["uniform", "random"]])
    weights = net.init_weights(torch.Generator().manual_seed(3))
    per_path = net.path_outputs(weights, net.path_inputs(x))
    for layer, head in ((0, 1), (1, 0)):
        silenced = {**weights, f"V{layer + 1}": weights[f"V{layer + 1}"].clone()}
        silenced[f"V{layer + 1}"][head] = 0.0  # the head writes nothing
        keep = theory.kept_paths(net.heads_per_layer, [(layer, head)])
        torch.testing.assert_close(per_path[:, keep].sum(-1), net.forward(silenced, x), rtol=1e-10, atol=1e-12)


def _network_kernel(net, weights, x):
    """sigma_0^2 * Gram of df/dV0 of the layer-by-layer network: its kernel with V0 integrated out."""
    grads = []
    for i in range(x.shape[0]):
        v0 = weights["V0"].clone().requires_grad_(True)
        f = net.forward({**weights, "V0": v0}, x[i : i + 1])
        grads.append(torch.autograd.grad(f.sum(), v0)[0].flatten())
    g = torch.stack(grads)
    return net.variances[0] * g @ g.T


def test_path_kernel_with_the_weights_own_order_parameter_equals_the_network_kernel():
    task = MarkovTask(markov_cfg())
    x = task.sample(10, seed=5).x
    net = _net(width=12, variances=[1.5, 0.7, 2.0, 1.2])
    weights = net.init_weights(torch.Generator().manual_seed(1))
    u = theory.empirical_order(net.effective_weights(weights)[None])
    xp = net.path_inputs(x)
    k_paths = theory.kernel(theory.path_kernels(xp, xp, net.variances[0]), u)
    torch.testing.assert_close(k_paths, _network_kernel(net, weights, x), rtol=1e-9, atol=1e-12)


def test_gp_path_kernel_equals_the_network_kernel_averaged_over_the_prior():
    task = MarkovTask(markov_cfg())
    x = task.sample(8, seed=6).x
    net = _net(width=128)
    xp = net.path_inputs(x)
    k_gp = theory.kernel(theory.path_kernels(xp, xp), theory.gp_order(net.n_paths, net.variances))
    gen = torch.Generator().manual_seed(2)
    k_mc = sum(_network_kernel(net, net.init_weights(gen), x) for _ in range(48)) / 48
    # 48 draws at N = 128: the order parameter's sampling error is about 1/sqrt(48 * 128) ~ 1.3% per entry
    assert float(torch.linalg.norm(k_mc - k_gp) / torch.linalg.norm(k_gp)) < 0.04


def test_gp_predictor_equals_closed_form_ridge_regression_in_feature_space():
    task = MarkovTask(markov_cfg())
    train, test = task.sample(40, seed=7), task.sample(30, seed=8)
    net = _net()
    xa, xb = net.path_inputs(train.x), net.path_inputs(test.x)
    u = theory.gp_order(net.n_paths, net.variances)
    temperature = 0.05
    mean, var = theory.predict(
        theory.kernel(theory.path_kernels(xa, xa), u),
        theory.kernel(theory.path_kernels(xa, xb), u),
        train.y,
        temperature,
        k_test_diag=theory.kernel(theory.path_kernels(xb, xb), u).diagonal(),
    )
    # primal form: features phi = x_pi / sqrt(D H), concatenated over paths; posterior of w ~ N(0, I)
    scale = math.sqrt(xa.shape[-1] * net.n_paths)
    phi, phi_test = xa.flatten(1).numpy() / scale, xb.flatten(1).numpy() / scale
    a = phi.T @ phi + temperature * np.eye(phi.shape[1])
    w_mean = np.linalg.solve(a, phi.T @ train.y.numpy())
    w_cov = temperature * np.linalg.inv(a)
    np.testing.assert_allclose(mean.numpy(), phi_test @ w_mean, rtol=1e-7, atol=1e-9)
    np.testing.assert_allclose(var.numpy(), np.einsum("ni,ij,nj->n", phi_test, w_cov, phi_test), rtol=1e-6, atol=1e-9)
    per_path = theory.path_predictions(
        theory.path_kernels(xa, xa), theory.path_kernels(xa, xb), u, train.y, temperature
    )
    np.testing.assert_allclose(per_path.sum(0).numpy(), phi_test @ w_mean, rtol=1e-7, atol=1e-9)
    # a path's share is its own features' part of the ridge solution
    d = xa.shape[-1]
    np.testing.assert_allclose(per_path[1].numpy(), phi_test[:, d : 2 * d] @ w_mean[d : 2 * d], rtol=1e-7, atol=1e-9)


def test_order_parameter_is_the_gp_value_at_large_width_and_a_minimum_of_the_action_at_small_width():
    task = MarkovTask(markov_cfg())
    train = task.sample(40, seed=9)
    net = _net()
    xp = net.path_inputs(train.x)
    c = theory.path_kernels(xp, xp)
    heads, variances = net.heads_per_layer, [1.0, 0.5, 2.0, 1.5]
    wide = theory.solve_order(c, train.y, heads, 10**8, variances, 0.01)
    torch.testing.assert_close(wide.u, theory.gp_order(4, variances), atol=1e-4, rtol=0)
    narrow = theory.solve_order(c, train.y, heads, 8, variances, 0.01, tol=1e-7)
    base, _ = theory.action(narrow.nested, c, train.y, heads, 8, variances, 0.01)
    assert float(torch.linalg.norm(narrow.u - theory.gp_order(4, variances))) > 0.1  # finite width moves U
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):  # every small symmetric step away from the solution raises the action
        step = [torch.randn(u.shape, generator=gen, dtype=u.dtype) * 1e-3 for u in narrow.nested]
        moved = [u + (s + s.T) / 2 for u, s in zip(narrow.nested, step)]
        assert float(theory.action(moved, c, train.y, heads, 8, variances, 0.01)[0]) > float(base)


def test_head_scores_and_pruning_by_hand():
    u = torch.tensor([[4.0, 1.0, -2.0, 0.0], [1.0, 1.0, 0.0, 0.0], [-2.0, 0.0, 3.0, 0.5], [0.0, 0.0, 0.5, 0.2]])
    # paths (h1, h2): 0=(0,0) 1=(0,1) 2=(1,0) 3=(1,1)
    # |U| summed over rows through the head, plus the other rows' columns through it
    raw = {(0, 0): 7 + 2 + 2, (0, 1): 5.5 + 0.7 + 2, (1, 0): 7 + 5.5 + 1 + 0.5, (1, 1): 2 + 0.7 + 1 + 0.5}
    top = max(raw.values())
    assert theory.head_scores(u, [2, 2]) == pytest.approx({k: v / top for k, v in raw.items()})
    assert theory.kept_paths([2, 2], [(1, 1)]).tolist() == [True, False, True, False]
    assert theory.kept_paths([2, 2], [(0, 0), (1, 0)]).tolist() == [False, False, False, True]


def test_hmc_draws_from_a_correlated_gaussian():
    cov = torch.tensor([[0.04, 0.018], [0.018, 0.01]], dtype=torch.float64)
    precision = torch.linalg.inv(cov)
    mean = torch.tensor([1.0, -2.0], dtype=torch.float64)
    draws = []
    stats = hmc(
        lambda p: 0.5 * (p[0] - mean) @ precision @ (p[0] - mean),
        [torch.zeros(2, dtype=torch.float64)],
        n_warmup=300,
        n_samples=3000,
        gen=torch.Generator().manual_seed(0),
        trajectory=0.3,
        on_sample=lambda p: draws.append(p[0].clone()),
    )
    x = torch.stack(draws)
    assert 0.6 < stats.accept_rate < 0.95
    torch.testing.assert_close(x.mean(0), mean, atol=0.02, rtol=0)
    torch.testing.assert_close(torch.cov(x.T), cov, atol=0.004, rtol=0)


def test_split_hmc_with_an_exact_prior_flow_draws_the_gaussian_posterior():
    # prior N(0, diag(4, 0.25)) times likelihood exp(-(x - m)^T A (x - m) / 2): a Gaussian posterior
    prior_var = torch.tensor([4.0, 0.25], dtype=torch.float64)
    a = torch.tensor([[3.0, 1.0], [1.0, 2.0]], dtype=torch.float64)
    m = torch.tensor([1.0, -1.0], dtype=torch.float64)
    precision = torch.diag(1 / prior_var) + a
    cov = torch.linalg.inv(precision)
    mean = cov @ a @ m
    draws = []
    params = [torch.zeros((), dtype=torch.float64), torch.zeros((), dtype=torch.float64)]
    hmc(
        lambda p: 0.5 * (torch.stack(p) - m) @ a @ (torch.stack(p) - m),
        params,
        n_warmup=300,
        n_samples=15000,
        gen=torch.Generator().manual_seed(1),
        prior_variances=prior_var.tolist(),
        trajectory=1.0,
        on_sample=lambda p: draws.append(torch.stack(p).clone()),
    )
    x = torch.stack(draws)
    torch.testing.assert_close(x.mean(0), mean, atol=0.015, rtol=0)
    torch.testing.assert_close(torch.cov(x.T), cov, atol=0.01, rtol=0)  # posterior variances 0.32 and 0.18


FAST = [
    "experiment=markov_paths",
    "model.width=10",
    "model.samples=8",
    "model.warmup=12",
    "task.n_train=40",
    "task.n_prompts=200",
    "train.steps=200",
    "output.n_boot=20",
    "model.theory_steps=500",
]


def test_run_writes_every_method_and_pruning(tmp_path):
    proc = headlab("run", *FAST, f"output.root={tmp_path}", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    import pandas as pd

    table = pd.read_parquet(next(tmp_path.rglob("results.parquet")))
    acc = table[(table["metric"] == "test_acc") & (table["intervention"] == "none")].set_index("method")["value"]
    assert set(acc.index) == {"theory", "gp", "gp_good", "gp_good_denoising", "sample", "gd"}
    orders = table[table["metric"] == "order_parameter"]
    assert len(orders) == 4 * 16  # theory, gp, sample, gd: 4 x 4 paths
    pruned = table[(table["intervention"] == "prune") & (table["metric"] == "test_acc")]
    assert len(pruned) == 3 * 4  # theory, sample, gd x 4 heads
    meta = json.loads(next(tmp_path.rglob("meta.json")).read_text())
    assert meta["pathnet"]["theory"]["grad_max"] < 1e-7


@pytest.mark.parametrize(
    "args, needle",
    [
        (["task=markov", "model=toy-attn-1l"], "task=markov runs on model=pathnet"),
        (["model=pathnet", "task=counting"], "model=pathnet runs task=markov only"),
        (
            ["experiment=markov_paths", "model.heads=[[same_token,banana],[uniform]]"],
            "banana], [uniform]]: expected a list, each one of same_token",
        ),
        (["experiment=markov_paths", "model.reference_paths={good:[7-7]}"], "unknown path 7-7"),
    ],
)
def test_bad_pathnet_setups_fail_with_one_line(args, needle, tmp_path):
    proc = headlab("run", *args, f"output.root={tmp_path}", cwd=tmp_path)
    assert proc.returncode != 0
    assert needle in _error_line(proc)


def test_quick_reproduction_draws_every_panel(tmp_path):
    from headlab.reproduce import run_all

    result = run_all("markov", tmp_path, quick=True, log=lambda *_: None)
    names = {p.split("/")[-1] for p in result["figures"]}
    assert names == {
        "fig_accuracy.png",
        "fig_order_parameter.png",
        "fig_alignment.png",
        "fig_two_paths.png",
        "fig_pruning.png",
    }
    numbers = result["numbers"]
    assert numbers["markov_paths"]["theory"][10] > numbers["markov_paths"]["gp"]


def test_reproduction_uses_the_authors_widths_and_seed():
    from headlab.reproduce import get

    full = get("markov").runs(quick=False)
    for experiment in ("markov_paths", "markov_two_paths"):
        widths = [int(r[1].split("=")[1]) for r in full if r[0] == f"experiment={experiment}"]
        assert widths == [10, 30, 50, 100, 300, 500, 1000]  # the authors' LOOP_RUN script
    assert all("seed=3" in r for r in full)  # its --seed 3
    assert all("seed=3" in r for r in get("markov").runs(quick=True))
