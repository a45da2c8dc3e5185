"""SAEs on attention outputs (headlab.sae), checked against computations that do not go through it:
SAELens on the exported files, plain torch hooks on the output projection (whose input is z), and
hand computations of the metrics and attributions."""

from __future__ import annotations

import dataclasses
import itertools
import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest
import torch
from omegaconf import OmegaConf
from torch import Tensor
from torch.nn import functional as F

from conftest import counting_cfg, run_headlab
from headlab.errors import HeadlabError
from headlab.models.toy import ToyConfig, ToyTransformer, hooked_toy
from headlab.sae.activations import Corpus, corpus_z, stream, task_corpus
from headlab.sae.export import load_sae, save_sae
from headlab.sae.fit import STATE, fit, resample
from headlab.sae.head_attribution import (
    decoder_head_shares,
    direct_feature_attribution,
    head_polysemanticity,
    head_roles,
    random_polysemantic_fraction,
    top_activations,
)
from headlab.sae.metrics import ce_recovered, cross_entropy, reconstruction_metrics
from headlab.sae.relu_l1 import ReluL1Config, ReluL1SAE
from headlab.sae.topk import TopKConfig, TopKEncode, TopKSAE

VOCAB, T, H, DH = 11, 10, 4, 8
D_IN = H * DH
META = {"model_name": "toy", "hook_name": "blocks.1.attn.hook_z", "context_size": T}
TOL = dict(atol=1e-5, rtol=0)


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Small tensors: one thread is as fast, and leaves the other core alone."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# ---------------------------------------------------------------- helpers


def _toy(n_layers=2, d_mlp=32, seed=0):
    torch.manual_seed(seed)
    model = ToyTransformer(
        ToyConfig(vocab_size=VOCAB, n_ctx=32, n_layers=n_layers, n_heads=H, d_model=32, d_head=DH, d_mlp=d_mlp)
    )
    for p in model.parameters():  # larger weights than the init: peaked patterns, layers that matter
        p.data.normal_(0, 0.3)
    return hooked_toy(model.eval(), "toy")


def _corpus(n=12, t=T, seed=0) -> Corpus:
    """Random ids, uneven lengths (what lies beyond a row's length is padding), next-token targets."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (n, t), generator=gen)
    lengths = torch.randint(3, t + 1, (n,), generator=gen)
    lengths[0] = t
    targets = torch.full_like(ids, -100)
    for i, length in enumerate(lengths.tolist()):
        targets[i, : length - 1] = ids[i, 1:length]
    return Corpus(ids, lengths, targets)


def _o_proj(model, layer: int) -> torch.nn.Module:
    module = model.module
    return module.blocks[layer].attn.o if hasattr(module, "blocks") else module.model.layers[layer].self_attn.o_proj


@torch.no_grad()
def _z_plain(model, layer: int, ids: Tensor) -> Tensor:
    """z [batch, pos, n_heads * d_head] as the output projection receives it (a plain torch pre-hook)."""
    kept = []
    handle = _o_proj(model, layer).register_forward_pre_hook(lambda _m, args: kept.append(args[0].clone()))
    try:
        model.module(ids)
    finally:
        handle.remove()
    return kept[0]


@torch.no_grad()
def _ce_plain(model, layer: int, corpus: Corpus, edit=None) -> float:
    """Mean CE at the corpus's targets over one plain forward pass, z edited at the output projection."""
    handle = None if edit is None else _o_proj(model, layer).register_forward_pre_hook(lambda _m, a: (edit(a[0]),))
    try:
        logits = model.module(corpus.ids)
    finally:
        if handle is not None:
            handle.remove()
    mask = corpus.targets != -100
    return F.cross_entropy(logits[mask], corpus.targets[mask]).item()


def _dist(a: Tensor, b: Tensor) -> Tensor:
    """Pairwise distances, computed exactly (cdist's matrix-product shortcut is off by ~1e-3 here)."""
    return torch.cdist(a, b, compute_mode="donot_use_mm_for_euclid_dist")


def _nontrivial(sae, seed=1):
    """Random biases and an encoder that is no longer the decoder's transpose."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        sae.b_enc.copy_(0.3 * torch.randn(sae.d_sae, generator=gen))
        sae.b_dec.copy_(0.5 * torch.randn(sae.d_in, generator=gen))
        sae.W_enc.mul_(0.5 + torch.rand(sae.W_enc.shape, generator=gen))
    return sae.eval()


def _make(arch: str, d_in=D_IN, d_sae=4 * D_IN, seed=0, **kw):
    return ReluL1SAE(d_in, d_sae, seed, **kw) if arch == "relu_l1" else TopKSAE(d_in, d_sae, seed, k=kw.get("k", 6))


def _sae_cfg(architecture: str = "relu_l1", **kw):
    """An architecture's options (relu_l1's have l1_coeff and resample_every, topk's k); the other's left out."""
    schema = TopKConfig if architecture == "topk" else ReluL1Config
    known = {f.name for f in dataclasses.fields(schema)}
    return OmegaConf.structured(schema(**{k: v for k, v in kw.items() if k in known}))


# a synthetic sparse dataset: every token is a centre plus 2 of 8 known unit directions, positive weights
N_DIR, D_SYN = 8, 16
_gen = torch.Generator().manual_seed(0)
DIRECTIONS = torch.randn(N_DIR, D_SYN, generator=_gen)
DIRECTIONS /= DIRECTIONS.norm(dim=1, keepdim=True)
CENTRE = torch.randn(D_SYN, generator=_gen)


def _sparse(n: int, seed: int) -> Tensor:
    gen = torch.Generator().manual_seed(seed)
    chosen = torch.rand(n, N_DIR, generator=gen).argsort(1)[:, :2]
    weights = torch.zeros(n, N_DIR).scatter(1, chosen, 1 + 2 * torch.rand(n, 2, generator=gen))
    return weights @ DIRECTIONS + CENTRE


def _batches(start: int, size: int = 64):
    """The stream fit reads from step `start` on; batch s depends on s alone (so resuming sees the same data)."""
    for step in itertools.count(start):
        yield _sparse(size, 10_000 + step)


# ---------------------------------------------------------------- SAELens export


@pytest.mark.parametrize("arch", ["relu_l1", "topk"])
def test_exported_sae_loads_in_saelens_and_reconstructs_like_headlab(arch, tmp_path):
    from sae_lens import SAE

    model = _toy()
    sae = _nontrivial(_make(arch, seed=3), seed=4)
    save_sae(sae, tmp_path, META)
    theirs = SAE.load_from_disk(str(tmp_path))
    assert type(theirs).__name__ == {"relu_l1": "StandardSAE", "topk": "TopKSAE"}[arch]
    assert theirs.cfg.d_in == D_IN and theirs.cfg.d_sae == 4 * D_IN
    z = model.capture({"input_ids": _corpus().ids}, 1, "z")  # hook_z: [batch, pos, n_heads, d_head]
    assert z.shape == (12, T, H, DH)
    z = z + torch.randn(z.shape, generator=torch.Generator().manual_seed(5))  # well spread around b_dec
    flat = z.flatten(-2)  # head-major, as TransformerLens's (n_heads d_head)
    with torch.no_grad():
        ours, f = sae(flat)
        got = theirs(z)
        got_f = theirs.encode(z)
    assert got.shape == z.shape
    torch.testing.assert_close(got, ours.view(z.shape), **TOL)
    torch.testing.assert_close(got_f, f, **TOL)
    active = (f > 0).sum(-1).float()
    assert active.min() > 0 and active.max() < sae.d_sae  # a real sparse code, not all or nothing
    if arch == "topk":
        assert active.max() <= 6
    # flattened [tokens, d_in]: SAELens's hook_z reshaping only reads [..., n_heads, d_head], so off
    theirs.turn_off_forward_pass_hook_z_reshaping()
    with torch.no_grad():
        torch.testing.assert_close(theirs(flat.reshape(-1, D_IN)), ours.reshape(-1, D_IN), **TOL)
    # and back through headlab's own loader
    again, cfg = load_sae(tmp_path)
    assert type(again) is type(sae) and cfg["reshape_activations"] == "hook_z"
    with torch.no_grad():
        torch.testing.assert_close(again(flat)[0], ours, **TOL)


def test_saelens_keeps_the_exported_metadata(tmp_path):
    from sae_lens import SAE

    save_sae(_make("relu_l1"), tmp_path, META)
    theirs = SAE.load_from_disk(str(tmp_path))
    assert theirs.cfg.metadata.hook_name == "blocks.1.attn.hook_z"  # what HookedSAETransformer attaches it by
    assert theirs.cfg.metadata.model_name == "toy"
    assert theirs.cfg.metadata.context_size == T


def test_load_sae_of_a_saelens_sae_reproduces_it_or_refuses(tmp_path):
    from sae_lens import StandardSAE, StandardSAEConfig

    theirs = StandardSAE(StandardSAEConfig(d_in=D_IN, d_sae=2 * D_IN, apply_b_dec_to_input=False))
    with torch.no_grad():
        for p in theirs.parameters():
            p.normal_(0, 0.5, generator=torch.Generator().manual_seed(p.numel()))
    theirs.save_model(str(tmp_path))
    try:
        ours, _ = load_sae(tmp_path)
    except HeadlabError:
        return  # refusing is fine
    x = torch.randn(20, D_IN, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(ours(x)[0], theirs(x), **TOL)


# ---------------------------------------------------------------- metrics


def test_cross_entropy_equals_a_plain_forward_pass_at_the_targets():
    model, corpus = _toy(), _corpus()
    sae = _nontrivial(_make("relu_l1", seed=2))
    assert cross_entropy(model, 1, corpus, None, model_batch=5) == pytest.approx(_ce_plain(model, 1, corpus), abs=1e-5)
    for layer in (0, 1):  # with z replaced: the same edit made at the output projection's input
        splice = lambda z: sae(z)[0]  # noqa: E731
        got = cross_entropy(model, layer, corpus, splice, model_batch=5)
        assert got == pytest.approx(_ce_plain(model, layer, corpus, splice), abs=1e-5)
        assert abs(got - _ce_plain(model, layer, corpus)) > 1e-3  # the edit mattered


@pytest.mark.parametrize("layer", [0, 1])
def test_ce_recovered_is_one_for_identity_and_zero_for_zero(layer):
    model, corpus = _toy(), _corpus()
    same = ce_recovered(model, layer, corpus, lambda z: z, model_batch=5)
    zero = ce_recovered(model, layer, corpus, torch.zeros_like, model_batch=5)
    assert same["ce_loss_recovered"] == pytest.approx(1.0, abs=1e-6)
    assert zero["ce_loss_recovered"] == pytest.approx(0.0, abs=1e-6)
    assert same["ce_clean"] == pytest.approx(_ce_plain(model, layer, corpus), abs=1e-5)
    assert zero["ce_zero_ablation"] == pytest.approx(_ce_plain(model, layer, corpus, torch.zeros_like), abs=1e-5)
    assert abs(same["ce_zero_ablation"] - same["ce_clean"]) > 0.01  # a layer that matters: a real gap
    half = ce_recovered(model, layer, corpus, lambda z: 0.5 * z, model_batch=5)
    expected = (half["ce_zero_ablation"] - _ce_plain(model, layer, corpus, lambda z: 0.5 * z)) / (
        half["ce_zero_ablation"] - half["ce_clean"]
    )
    assert half["ce_loss_recovered"] == pytest.approx(expected, abs=1e-4)


def test_reconstruction_metrics_equal_a_hand_computation():
    sae = _nontrivial(_make("relu_l1", seed=5))
    with torch.no_grad():
        sae.b_enc[:10] = -100.0  # ten latents that never fire
    x = torch.randn(50, D_IN, generator=torch.Generator().manual_seed(1))
    got = reconstruction_metrics(sae, x, batch=7)
    with torch.no_grad():
        recon, f = sae(x)
    assert got["l0"] == pytest.approx((f > 0).sum().item() / 50, abs=1e-9)
    assert got["mse"] == pytest.approx(F.mse_loss(recon, x).item(), rel=1e-5)
    ev = 1 - (x - recon).pow(2).sum() / (x - x.mean(0)).pow(2).sum()
    assert got["explained_variance"] == pytest.approx(ev.item(), abs=1e-5)
    assert got["dead_fraction"] == pytest.approx(1 - (f > 0).any(0).float().mean().item())
    assert got["dead_fraction"] >= 10 / sae.d_sae


def test_topk_l0_is_k_and_sparse_decode_equals_dense_decode():
    k = 6
    sae = TopKSAE(D_IN, 4 * D_IN, seed=3, k=k)
    with torch.no_grad():
        sae.b_enc.copy_(5.0 + torch.rand(sae.d_sae, generator=torch.Generator().manual_seed(0)))
        sae.b_dec.normal_(0, 0.5, generator=torch.Generator().manual_seed(1))
    x = torch.randn(40, D_IN, generator=torch.Generator().manual_seed(2))
    pre = sae.pre_activation(x).detach()
    assert (pre > 0).all()  # every pre-activation positive: the ReLU never bites, so L0 must be k
    with torch.no_grad():
        f = sae.encode(x)
        recon, f_fwd = sae(x)
        values, indices = sae.top(x)
    assert ((f > 0).sum(-1) == k).all()
    assert reconstruction_metrics(sae, x, batch=7)["l0"] == k
    top = pre.topk(k, dim=-1).indices  # the survivors are the k largest, with their values
    torch.testing.assert_close(f, torch.zeros_like(pre).scatter(-1, top, pre.gather(-1, top)))
    torch.testing.assert_close(f_fwd, f)
    torch.testing.assert_close(recon, f @ sae.W_dec + sae.b_dec, **TOL)
    torch.testing.assert_close(sae.decode_sparse(values, indices), sae.decode(f), **TOL)
    shaped = x.view(4, 10, D_IN)  # [batch, pos, d_in] too
    with torch.no_grad():
        torch.testing.assert_close(sae(shaped)[0], recon.view(4, 10, D_IN), **TOL)
    with torch.no_grad():  # with negative pre-activations among the top k, ReLU: fewer than k survive
        sae.b_enc.fill_(-2.0)
        f = sae.encode(x)
    pre = sae.pre_activation(x).detach()
    expected = (pre.topk(k, dim=-1).values > 0).sum(-1)
    assert torch.equal((f > 0).sum(-1), expected) and expected.min() < k and expected.max() > 0


def _dense_topk_loss(sae: TopKSAE, x: Tensor) -> Tensor:
    """The TopK loss through plain autograd: the dense pre-activation, a dense f [n, d_sae] with the top k
    (after ReLU) kept, the dense decoder product."""
    pre = (x - sae.b_dec) @ sae.W_enc + sae.b_enc
    top = pre.topk(sae.k, dim=-1)
    f = torch.zeros_like(pre).scatter(-1, top.indices, top.values.relu())
    return (f @ sae.W_dec + sae.b_dec - x).pow(2).sum(-1).mean()


def _topk_with_negatives(seed: int = 3) -> tuple[TopKSAE, Tensor]:
    """A TopK SAE whose top pre-activations are in part <= 0 (the ReLU zeroes them and their gradient)."""
    sae = _nontrivial(TopKSAE(D_IN, 4 * D_IN, seed=seed, k=6)).train()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        sae.b_enc.copy_(-2.5 + torch.randn(sae.d_sae, generator=gen))
    return sae, torch.randn(40, D_IN, generator=gen)


def _grads(params) -> list[Tensor]:
    out = [p.grad.clone() for p in params]
    for p in params:
        p.grad = None
    return out


def _assert_close_relative(got: Tensor, expected: Tensor, name: str) -> None:
    scale = expected.abs().max().item()
    assert scale > 0, name
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5 * scale, msg=name)


def test_topk_encoder_backward_equals_autograd_through_the_dense_pre_activation():
    sae, x = _topk_with_negatives()
    pre = sae.pre_activation(x).detach()
    top = pre.topk(sae.k, dim=-1).values
    assert (top <= 0).any() and (top > 0).any()  # the ReLU bites on some top entries, not on all
    x = x.view(4, 10, D_IN).requires_grad_()  # [batch, pos, d_in], and a gradient for x too
    weights = torch.randn(4, 10, sae.k, generator=torch.Generator().manual_seed(0))
    inputs = [x, sae.W_enc, sae.b_enc, sae.b_dec]

    values, indices = TopKEncode.apply(x, sae.W_enc, sae.b_enc, sae.b_dec, sae.k)
    (values * weights).sum().backward()
    got = _grads(inputs)

    dense = (x - sae.b_dec) @ sae.W_enc + sae.b_enc  # plain autograd, the top k picked from the dense tensor
    (dense.gather(-1, indices).relu() * weights).sum().backward()
    expected = _grads(inputs)
    torch.testing.assert_close(values, dense.gather(-1, indices).relu().detach(), **TOL)
    assert torch.equal(indices.sort(-1).values, dense.topk(sae.k, dim=-1).indices.sort(-1).values)
    for name, a, b in zip(["x", "W_enc", "b_enc", "b_dec"], got, expected):
        _assert_close_relative(a, b, name)
    assert (expected[1] == 0).any() and got[1].is_contiguous()  # latents outside every top k: no gradient


def _beside_dense(sae: TopKSAE, x: Tensor, loss_fn) -> tuple[Tensor, Tensor, list[Tensor], Tensor, list[Tensor]]:
    """(loss, fires, its gradients, the dense loss, its gradients) of W_enc, b_enc, W_dec, b_dec, for one of
    the SAE's losses (loss_fn: sae.loss or sae.fit_loss) against _dense_topk_loss on the same x."""
    params = [sae.W_enc, sae.b_enc, sae.W_dec, sae.b_dec]
    loss, _, fires = loss_fn(x, step=0)
    loss.backward()
    got = _grads(params)
    dense = _dense_topk_loss(sae, x)
    dense.backward()
    return loss, fires, got, dense, _grads(params)


def test_topk_loss_gradients_equal_the_dense_formulation():
    sae, x = _topk_with_negatives(seed=4)
    loss, _, got, dense, expected = _beside_dense(sae, x, sae.loss)
    assert loss.item() == pytest.approx(dense.item(), rel=1e-6)
    for name, a, b in zip(["W_enc", "b_enc", "W_dec", "b_dec"], got, expected):
        _assert_close_relative(a, b, name)


def test_topk_fit_loss_gives_the_dense_gradients_with_the_decoder_rows_parallel_part_removed():
    sae, x = _topk_with_negatives(seed=5)
    loss, fires, got, dense, expected = _beside_dense(sae, x, sae.fit_loss)
    with torch.no_grad():  # written out here: each decoder row's gradient minus its part along the row
        row = sae.W_dec / sae.W_dec.norm(dim=1, keepdim=True)
        expected[2] = expected[2] - (expected[2] * row).sum(1, keepdim=True) * row
    assert sae.fit_loss_grad_tangent and loss.item() == pytest.approx(dense.item(), rel=1e-6)
    for name, a, b in zip(["W_enc", "b_enc", "W_dec", "b_dec"], got, expected):
        _assert_close_relative(a, b, name)
    pre = sae.pre_activation(x).detach()
    top = pre.topk(sae.k, dim=-1)
    assert torch.equal(fires, torch.bincount(top.indices[top.values > 0], minlength=sae.d_sae))


def test_fit_steps_equal_steps_computed_the_dense_way(tmp_path):
    """fit's TopK steps (sparse backward, fused Adam) against the same steps by hand: dense autograd,
    torch's reference Adam, the decoder constraint as written out here."""
    steps, lr, warmup = 3, 1e-2, 2
    sc = _sae_cfg(architecture="topk", steps=steps, batch_size=64, lr=lr, warmup_steps=warmup, k=2)
    fitted = TopKSAE(D_SYN, 32, seed=0, k=2)
    fit(fitted, _batches, sc, tmp_path, show_progress=False)

    sae = TopKSAE(D_SYN, 32, seed=0, k=2)
    opt = torch.optim.Adam(sae.parameters(), lr=lr, betas=(0.9, 0.999), foreach=False, fused=False)
    for step, x in zip(range(steps), _batches(0)):
        if step == 0:
            with torch.no_grad():
                sae.b_dec.copy_(x.mean(0))
        opt.param_groups[0]["lr"] = lr * min(1.0, (step + 1) / warmup)
        opt.zero_grad()
        _dense_topk_loss(sae, x).backward()
        with torch.no_grad():
            grad, row = sae.W_dec.grad, sae.W_dec
            grad -= (grad * row).sum(1, keepdim=True) * row  # keep the step on each row's unit sphere
        opt.step()
        with torch.no_grad():
            sae.W_dec /= sae.W_dec.norm(dim=1, keepdim=True)
    for (name, a), b in zip(fitted.named_parameters(), sae.parameters()):
        assert not torch.equal(b, TopKSAE(D_SYN, 32, seed=0, k=2).get_parameter(name)), name  # it moved
        _assert_close_relative(a.detach(), b.detach(), name)


# ---------------------------------------------------------------- attribution


@pytest.mark.parametrize("layer", [0, 1])
def test_direct_feature_attribution_splits_the_pre_activation_by_head_and_source(layer):
    model = _toy()
    sae = _nontrivial(_make("relu_l1", seed=6))
    _check_dfa(model, layer, sae, _corpus().ids[0], DH)


def test_direct_feature_attribution_with_grouped_query_heads(tiny_hf_dir):
    from headlab.models.hf import load_hf

    model = load_hf(str(tiny_hf_dir("llama")), need_tokenizer=False)  # 4 query heads share 2 value heads
    assert model.sites.n_kv_heads < model.sites.n_heads
    d_head = model.sites.d_head
    sae = _nontrivial(ReluL1SAE(model.sites.n_heads * d_head, 64, seed=7))
    _check_dfa(model, 1, sae, torch.randint(0, 50257, (T,), generator=torch.Generator().manual_seed(0)), d_head)


def _check_dfa(model, layer, sae, ids, d_head):
    n_heads = model.sites.n_heads
    z = _z_plain(model, layer, ids[None])[0]  # [pos, n_heads * d_head]
    pre = sae.pre_activation(z).detach()
    for position, feature in ((0, 0), (4, 7), (T - 1, 100 % sae.d_sae), (T - 1, 3)):
        dfa = direct_feature_attribution(model, layer, sae, ids, position, feature)
        assert dfa.shape == (n_heads, T)
        assert (dfa[:, position + 1 :] == 0).all()  # causal: no later source
        w = sae.W_enc[:, feature].detach()
        expected = pre[position, feature] - sae.b_enc[feature] + sae.b_dec @ w
        torch.testing.assert_close(dfa.sum(), expected.detach(), atol=1e-4, rtol=0)
        per_head = (z[position].view(n_heads, d_head) * w.view(n_heads, d_head)).sum(-1)  # head h's slice
        torch.testing.assert_close(dfa.sum(1), per_head, atol=1e-4, rtol=0)


def test_decoder_head_shares():
    sae = _make("relu_l1", d_sae=24, seed=4)
    with torch.no_grad():
        sae.W_dec[5] = 0.0
        sae.W_dec[5, 2 * DH : 3 * DH] = torch.randn(DH)  # lives in head 2's slice only
    shares = decoder_head_shares(sae, H)
    assert shares.shape == (24, H)
    torch.testing.assert_close(shares.sum(1), torch.ones(24))
    assert shares[5].tolist() == [0.0, 0.0, 1.0, 0.0]
    norms = torch.stack([sae.W_dec[:, h * DH : (h + 1) * DH].norm(dim=1) for h in range(H)], 1).detach()
    torch.testing.assert_close(shares, norms / norms.sum(1, keepdim=True))


def test_head_polysemanticity_counts_dominated_live_features():
    shares = torch.tensor([[0.9, 0.1, 0.0], [0.7, 0.3, 0.0], [0.2, 0.8, 0.0], [0.1, 0.9, 0.0], [0.4, 0.3, 0.3]])
    frequency = torch.tensor([0.2, 0.2, 0.5, 0.0, 0.9])  # feature 3 is dead, 4 dominated by no head
    classes = torch.tensor([[0, 1, 0, 0, 0]])  # one context each: head 0's two features differ
    heads = head_polysemanticity(shares, frequency, 0.5, classes)
    assert [h["n_dominated"] for h in heads] == [2, 1, 0]
    assert heads[0]["effective_features"] == pytest.approx(2.0)  # two equally frequent features
    assert heads[1]["effective_features"] == pytest.approx(1.0) and heads[2]["effective_features"] == 0.0
    assert [h["multi_feature"] for h in heads] == [1.0, 0.0, 0.0]
    assert [h["polysemantic_dominated"] for h in heads] == [1.0, 0.0, 0.0]
    assert (
        heads[1]["min_class_overlap_dominated"] != heads[1]["min_class_overlap_dominated"]
    )  # nan: one feature, no pair


def test_polysemanticity_fails_when_a_heads_features_share_one_context_class():
    # head 0 dominates features 0-2 (head 1 features 3-4); 4 top contexts each, -1 = none
    shares = torch.tensor([[0.8, 0.2], [0.9, 0.1], [0.6, 0.4], [0.1, 0.9], [0.3, 0.7]])
    frequency = torch.tensor([0.1, 0.3, 0.2, 0.4, 0.4])
    same = torch.tensor(
        [
            [3, 3, 3, 0, 1],
            [3, 3, 3, 0, 1],
            [3, 3, -1, 0, 1],
            [3, 3, -1, 1, -1],
        ]
    )
    head0, head1 = head_polysemanticity(shares, frequency, 0.5, same)
    # by hand: every feature of head 0 has all its contexts in class 3, so each pair overlaps 1
    assert head0["n_dominated"] == 3 and head0["multi_feature"] == 1.0  # old criterion: polysemantic
    p = torch.tensor([0.1, 0.3, 0.2]) / 0.6
    assert head0["effective_features"] == pytest.approx(float((-(p * p.log()).sum()).exp()))  # 2.75
    assert head0["n_context_classes_dominated"] == 1
    assert head0["min_class_overlap_dominated"] == pytest.approx(1.0)
    assert head0["polysemantic_dominated"] == 0.0
    # head 1: feature 3 is 3/4 class 0 and 1/4 class 1, feature 4 all class 1 (3 contexts):
    # overlap min(3/4, 0) + min(1/4, 1) = 1/4 < 1/2
    assert head1["n_context_classes_dominated"] == 2
    assert head1["min_class_overlap_dominated"] == pytest.approx(0.25)
    assert head1["polysemantic_dominated"] == 1.0


def test_polysemanticity_needs_little_overlap_not_just_other_majorities():
    shares = torch.tensor([[1.0], [1.0], [1.0]])
    frequency = torch.tensor([0.5, 0.5, 0.5])
    classes = torch.tensor([[0, 1, 2], [0, 1, 2], [1, 0, 2], [-1, -1, 2]])
    (head,) = head_polysemanticity(shares, frequency, 0.5, classes)
    # feature 0: (2/3, 1/3, 0), feature 1: (1/3, 2/3, 0), feature 2: (0, 0, 1)
    # overlaps: f0-f1 1/3 + 1/3 = 2/3, f0-f2 0, f1-f2 0: three majority classes, least overlap 0
    assert (
        head["n_context_classes_dominated"] == 3
        and head["min_class_overlap_dominated"] == 0.0
        and head["polysemantic_dominated"] == 1.0
    )
    (pair,) = head_polysemanticity(shares[:2], frequency[:2], 0.5, classes[:, :2])
    # features 0 and 1 alone: other majority classes, but they overlap 2/3 >= 1/2: not unrelated
    assert pair["n_context_classes_dominated"] == 2
    assert pair["min_class_overlap_dominated"] == pytest.approx(2 / 3)
    assert pair["polysemantic_dominated"] == 0.0


def _spread_sae(main_share: float, per_head: int, n_spread: int) -> ReluL1SAE:
    """An SAE on H heads whose first H * per_head features each put main_share of their decoder norm on
    one head (features h * per_head .. on head h) and the rest evenly on the others, then n_spread
    features spread evenly over all heads, which no head's top features include."""
    sae = _make("relu_l1", d_sae=H * per_head + n_spread, seed=1)
    rest = (1 - main_share) / (H - 1)
    with torch.no_grad():
        for f in range(sae.d_sae):
            norms = torch.full((H,), 1 / H) if f >= H * per_head else torch.full((H,), rest)
            if f < H * per_head:
                norms[f // per_head] = main_share
            direction = F.normalize(torch.randn(H, DH), dim=1)
            sae.W_dec[f] = (direction * norms[:, None]).reshape(-1)
    return sae


@pytest.mark.parametrize("mixed_heads", [0, 2, 4])
def test_head_roles_read_each_heads_top_features_so_the_share_ranges_from_none_to_all(mixed_heads):
    """Three features per head (0.4 of the decoder norm on it, 0.2 on each other head: none reaches the
    old rule's 0.5), one context class per feature; the first `mixed_heads` heads get features of two
    classes, the others three features of one class. Kissane et al.'s reading finds exactly those heads
    polysemantic: 0%, 50%, 100%; the old rule finds none, having no dominated feature to read."""
    per_head, n_spread = 3, 5
    sae = _spread_sae(0.4, per_head, n_spread)
    shares = decoder_head_shares(sae, H)
    torch.testing.assert_close(shares[: H * per_head].max(1).values, torch.full((H * per_head,), 0.4))
    role = torch.zeros(sae.d_sae, dtype=torch.long)  # class of each feature's contexts
    for h in range(H):
        role[h * per_head : (h + 1) * per_head] = torch.tensor([h, h, (h + 1) % H]) if h < mixed_heads else h
    role[H * per_head :] = torch.arange(n_spread) % H  # the spread features: every class, read by no head
    classes = role.expand(4, -1).clone()  # 4 top contexts per feature, all of its class
    frequency = torch.full((sae.d_sae,), 0.1)
    heads = head_roles(shares, frequency, classes, per_head)
    expected = [1.0 if h < mixed_heads else 0.0 for h in range(H)]
    assert [h["polysemantic"] for h in heads] == expected
    assert sum(h["polysemantic"] for h in heads) / H == mixed_heads / H  # 0, 0.5, 1
    for h, head in enumerate(heads):
        assert head["n_top_features"] == per_head and head["top_feature_share"] == pytest.approx(0.4)
        counts = [0] * H
        for c in role[h * per_head : (h + 1) * per_head].tolist():
            counts[c] += 1
        assert head["roles"] == counts and head["n_roles"] == sum(c > 0 for c in counts)
        assert head["largest_role_share"] == pytest.approx(max(counts) / per_head)
        assert head["min_class_overlap"] == (0.0 if h < mixed_heads else 1.0)
    old = head_polysemanticity(shares, frequency, 0.5, classes)
    assert [h["n_dominated"] for h in old] == [0] * H and [h["polysemantic_dominated"] for h in old] == [0.0] * H


def test_the_rules_null_rate_is_how_often_random_features_of_unrelated_classes_are_drawn_together():
    # 20 live features, 10 whose contexts are all class 0 and 10 all class 1: two drawn at random overlap
    # nothing with probability 10 * 10 / C(20, 2) = 10 / 19; all of one class: never
    classes = torch.tensor([[0] * 10 + [1] * 10] * 4)
    frequency = torch.full((20,), 0.1)
    got = random_polysemantic_fraction(frequency, classes, 2, 4000, seed=1)
    assert got == pytest.approx(10 / 19, abs=0.03)
    assert random_polysemantic_fraction(frequency, torch.zeros(4, 20, dtype=torch.long), 2, 200) == 0
    dead = frequency.clone()
    dead[10:] = 0  # the class-1 features never fire: only class 0 is drawn
    assert random_polysemantic_fraction(dead, classes, 2, 200) == 0


def test_head_roles_skip_dead_features_and_rank_by_share():
    # head 0's shares rank features 1, 0, 2, 3; feature 1 is dead, so its top 2 are 0 and 2
    shares = torch.tensor([[0.8, 0.2], [0.9, 0.1], [0.7, 0.3], [0.6, 0.4]])
    frequency = torch.tensor([0.1, 0.0, 0.1, 0.1])
    classes = torch.tensor([[0, 1, 1, 0], [0, -1, 1, 1]])  # feature 3: one context of each class
    head0, head1 = head_roles(shares, frequency, classes, 2)
    assert head0["roles"] == [1, 1] and head0["top_feature_share"] == pytest.approx(0.75)
    assert head0["min_class_overlap"] == 0.0 and head0["polysemantic"] == 1.0
    # head 1: features 3 (half class 0, the tie to class 0) and 2 (class 1): overlap 1/2, not unrelated
    assert head1["roles"] == [1, 1] and head1["min_class_overlap"] == pytest.approx(0.5)
    assert head1["polysemantic"] == 0.0 and head1["n_roles"] == 2


def test_recall_reasoning_context_classes_name_each_positions_role():
    from headlab import compose
    from headlab.tasks import build_task

    task = build_task(compose("experiment=attn_sae").task)
    ids, _ = task.train_batch(torch.Generator().manual_seed(0), 40, step=10**9)
    grid, names = task.context_classes(ids)
    recall = ids[:, 3] == 2  # "=" at position 3
    assert recall.any() and (~recall).any()
    first = [names[c] for c in grid[recall.nonzero()[0, 0], :4].tolist()]
    assert first == ["start", "first entity", "recall relation", "recall ="]
    two_hop = (ids[:, -2] == 5).nonzero()[0, 0]  # "?"
    roles = [names[c] for c in grid[two_hop].tolist()]
    assert roles[:5] == ["start", "first entity", "link >", "link target", "link ."]
    assert roles[5:9] == ["link source", "link >", "link target", "link ."]
    assert roles[-2:] == ["two-hop ?", "two-hop query"]


def test_token_types_class_text_tokens():
    from headlab.sae.contexts import token_type

    assert [token_type(t) for t in (" the", "ing", " 42", ",", "  ", "a1")] == [
        "word",
        "word piece",
        "number",
        "punctuation",
        "space",
        "other",
    ]


def test_top_activations_equal_a_full_sort():
    sae = _nontrivial(_make("relu_l1", seed=8))
    x = torch.randn(50, D_IN, generator=torch.Generator().manual_seed(3))
    values, where, frequency = top_activations(sae, x, k=4, batch=7)
    with torch.no_grad():
        f = sae.encode(x)
    torch.testing.assert_close(values, f.topk(4, dim=0).values)
    picked = f.gather(0, where)
    torch.testing.assert_close(picked, values)  # each value is that token's activation
    torch.testing.assert_close(frequency, (f > 0).float().mean(0))


# ---------------------------------------------------------------- activations


def test_corpus_z_and_stream_yield_the_models_z_at_real_tokens():
    model, corpus = _toy(), _corpus()
    z = _z_plain(model, 1, corpus.ids)
    expected = torch.cat([z[i, :length] for i, length in enumerate(corpus.lengths.tolist())])
    padding = torch.cat([z[i, length:] for i, length in enumerate(corpus.lengths.tolist())])
    assert len(padding) > 0
    torch.testing.assert_close(corpus_z(model, 1, corpus, model_batch=5), expected, **TOL)
    batches = list(
        itertools.islice(
            stream(model, 1, lambda _i: corpus, batch_tokens=16, buffer_tokens=40, model_batch=5, seed=0), 8
        )
    )
    for batch in batches:
        assert batch.shape == (16, D_IN)
        assert _dist(batch, expected).min(1).values.max() < 1e-5  # every row is a real token's z
        assert _dist(batch, padding).min() > 1e-3  # and none a padding position's
    first = batches[0]
    assert _dist(first, first).add(torch.eye(16)).min() > 1e-5  # no token twice in one batch
    seen = torch.cat(batches)
    assert len(seen) == 8 * 16 > corpus.n_tokens  # more than one pass: passes(i) is drawn again
    covered = _dist(expected, seen).min(1).values < 1e-5
    assert covered.float().mean() > 0.9  # the stream goes through the corpus, not one corner of it


def test_stream_runs_a_repeating_corpus_through_the_model_once():
    model, corpus = _toy(), _corpus()
    calls = []
    capture = model.capture
    model.capture = lambda inputs, *a, **k: calls.append(len(inputs["input_ids"])) or capture(inputs, *a, **k)
    z = _z_plain(model, 1, corpus.ids)
    expected = torch.cat([z[i, :length] for i, length in enumerate(corpus.lengths.tolist())])
    same = stream(model, 1, lambda _i: corpus, batch_tokens=16, buffer_tokens=40, model_batch=5, seed=0)
    seen = torch.cat(list(itertools.islice(same, 12)))
    assert len(seen) > 2 * corpus.n_tokens  # at least two passes...
    assert sum(calls) == len(corpus.ids)  # ...and every sequence ran through the model once
    assert _dist(seen, expected).min(1).values.max() < 1e-5  # the kept z is the model's z
    calls.clear()
    fresh = stream(
        model, 1, lambda _i: corpus.rows(torch.arange(12)), batch_tokens=16, buffer_tokens=40, model_batch=5, seed=0
    )
    torch.testing.assert_close(torch.cat(list(itertools.islice(fresh, 12))), seen, **TOL)  # same batches
    assert sum(calls) > 2 * len(corpus.ids)  # a new corpus object each pass: nothing is kept


@pytest.mark.parametrize("arch", ["relu_l1", "topk"])
def test_folding_the_input_scale_gives_the_sae_of_the_scaled_input(arch):
    sae = _nontrivial(_make(arch))
    x, scale = torch.randn(50, D_IN), 3.7
    with torch.no_grad():
        recon, f = sae(scale * x)
        sae.fold_input_scale(scale)
        folded_recon, folded_f = sae(x)
    torch.testing.assert_close(folded_f, f, **TOL)  # the same latents, as strongly
    torch.testing.assert_close(folded_recon, recon / scale, **TOL)  # reconstructing x itself


def test_task_corpus_keeps_the_tasks_training_targets():
    from headlab.tasks.counting import CountingTask

    task = CountingTask(counting_cfg())
    corpus = task_corpus(task, SimpleNamespace(tokenizer=None), 16, seed=3)
    ids, targets = task.train_batch(torch.Generator().manual_seed(3), 16)
    assert torch.equal(corpus.ids, ids) and torch.equal(corpus.targets, targets)
    for row in range(16):
        last = int((targets[row] != -100).nonzero().max())
        assert int(corpus.lengths[row]) == last + 1  # real tokens: up to the last target


# ---------------------------------------------------------------- fitting


def test_relu_l1_starts_reconstructing_an_input_at_about_its_own_size():
    """Half of 16 x d_in random matched filters fire on x; unscaled, their sum along x would be 8|x|^2."""
    sae = ReluL1SAE(64, 1024, seed=3)
    x = torch.randn(256, 64, generator=torch.Generator().manual_seed(4)) * 5
    with torch.no_grad():
        recon, f = sae(x)
    along = ((recon - sae.b_dec) * x).sum(1) / x.pow(2).sum(1)
    assert along.mean().item() == pytest.approx(1.0, abs=0.1)
    assert (f > 0).float().mean().item() == pytest.approx(0.5, abs=0.05)


@pytest.mark.parametrize("arch", ["relu_l1", "topk"])
def test_fit_keeps_unit_decoder_rows_and_learns_a_sparse_dataset(arch, tmp_path):
    sae = ReluL1SAE(D_SYN, 32, seed=0, l1_coeff=0.1) if arch == "relu_l1" else TopKSAE(D_SYN, 32, seed=0, k=2)
    sc = _sae_cfg(
        architecture=arch,
        steps=150,
        batch_size=64,
        lr=1e-2,
        warmup_steps=10,
        resample_every=0,
        dead_window=10**9,
        checkpoint_every=1000,
    )
    held_out = _sparse(1024, 1)
    before = reconstruction_metrics(sae, held_out)
    record = fit(sae, _batches, sc, tmp_path, show_progress=False)
    after = reconstruction_metrics(sae, held_out)
    torch.testing.assert_close(sae.W_dec.norm(dim=1).detach(), torch.ones(32), atol=1e-5, rtol=0)
    assert after["mse"] < 0.05 * before["mse"] and after["explained_variance"] > 0.95
    assert record["steps"] == 150 and record["tokens"] == 150 * 64
    curve = pd.DataFrame(record["curve"])
    assert curve["step"].max() == 150 and {"loss", "mse", "l0", "dead_window_fraction"} <= set(curve["metric"])
    if arch == "topk":
        assert after["l0"] <= 2 and (curve.loc[curve["metric"] == "l0", "value"] <= 2).all()
    # the latents found the dictionary: each known direction has a decoder row along it
    cos = DIRECTIONS @ sae.W_dec.detach().t()
    assert cos.max(1).values.min() > 0.9


class _Interrupted(Exception):
    pass


@pytest.mark.parametrize("arch", ["relu_l1", "topk"])
def test_resumed_fit_equals_an_uninterrupted_one(arch, tmp_path):
    sc = _sae_cfg(
        architecture=arch,
        steps=20,
        batch_size=64,
        lr=1e-2,
        warmup_steps=5,
        resample_every=0,
        dead_window=256,
        checkpoint_every=5,
        l1_coeff=0.1,
        k=2,
    )
    new = lambda: ReluL1SAE(D_SYN, 32, seed=0, l1_coeff=0.1) if arch == "relu_l1" else TopKSAE(D_SYN, 32, 0, k=2)  # noqa: E731
    whole = new()
    record = fit(whole, _batches, sc, tmp_path / "whole", show_progress=False)

    def crashing(start):
        yield from itertools.islice(_batches(start), 13)
        raise _Interrupted

    with pytest.raises(_Interrupted):
        fit(new(), crashing, sc, tmp_path / "parts", show_progress=False)
    state = json.loads((tmp_path / "parts" / STATE / "state.json").read_text())
    assert state["step"] == 10  # the last checkpoint before the crash
    starts = []

    def recording(start):
        starts.append(start)
        return _batches(start)

    resumed_sae = new()
    resumed = fit(resumed_sae, recording, sc, tmp_path / "parts", show_progress=False)
    assert starts == [10]  # picked up where the checkpoint left off
    assert resumed["steps"] == record["steps"] == 20 and resumed["tokens"] == record["tokens"] == 20 * 64
    assert resumed["dead_window_fraction"] == record["dead_window_fraction"]
    for (name, a), b in zip(whole.named_parameters(), resumed_sae.parameters()):
        torch.testing.assert_close(b, a, atol=1e-6, rtol=0, msg=name)
    a, b = pd.DataFrame(record["curve"]), pd.DataFrame(resumed["curve"])
    assert list(zip(a["step"], a["metric"])) == list(zip(b["step"], b["metric"]))  # no step logged twice or lost
    assert b["value"].to_numpy() == pytest.approx(a["value"].to_numpy(), abs=1e-5)


def test_resample_reinitialises_dead_latents_only():
    torch.manual_seed(0)
    sae = _nontrivial(ReluL1SAE(D_SYN, 32, seed=1))
    opt = torch.optim.Adam(sae.parameters(), lr=1e-3)
    x = _sparse(64, 2)
    loss, _, _ = sae.loss(x, 0)
    loss.backward()
    opt.step()  # Adam moments exist
    before = {k: v.detach().clone() for k, v in sae.state_dict().items()}
    moments = {n: opt.state[p]["exp_avg"].clone() for n, p in sae.named_parameters()}
    dead = torch.zeros(32, dtype=torch.bool)
    dead[[1, 5, 30]] = True
    scale = 0.2 * before["W_enc"][:, ~dead].norm(dim=0).mean()
    resample(sae, opt, x, dead)
    w_dec, w_enc = sae.W_dec.detach(), sae.W_enc.detach()
    torch.testing.assert_close(w_dec[dead].norm(dim=1), torch.ones(3))
    candidates = x - before["b_dec"]
    candidates = candidates / candidates.norm(dim=1, keepdim=True)
    assert (w_dec[dead] @ candidates.t()).max(1).values.min() > 1 - 1e-5  # each is a (centred) input's direction
    assert not torch.allclose(w_dec[dead], before["W_dec"][dead])
    torch.testing.assert_close(w_enc[:, dead], w_dec[dead].t() * scale)
    assert (sae.b_enc.detach()[dead] == 0).all()
    torch.testing.assert_close(w_dec[~dead], before["W_dec"][~dead], atol=0, rtol=0)
    torch.testing.assert_close(w_enc[:, ~dead], before["W_enc"][:, ~dead], atol=0, rtol=0)
    torch.testing.assert_close(sae.b_enc.detach()[~dead], before["b_enc"][~dead], atol=0, rtol=0)
    assert (opt.state[sae.W_dec]["exp_avg"][dead] == 0).all() and (opt.state[sae.W_enc]["exp_avg"][:, dead] == 0).all()
    assert (opt.state[sae.b_enc]["exp_avg_sq"][dead] == 0).all()
    torch.testing.assert_close(opt.state[sae.W_dec]["exp_avg"][~dead], moments["W_dec"][~dead], atol=0, rtol=0)


def test_fit_resamples_latents_that_never_fire(tmp_path):
    torch.manual_seed(0)
    sae = ReluL1SAE(D_SYN, 32, seed=0, l1_coeff=0.1)
    with torch.no_grad():
        sae.b_enc[:3] = -1000.0  # never fire
    sc = _sae_cfg(
        architecture="relu_l1",
        steps=12,
        batch_size=64,
        lr=1e-2,
        warmup_steps=1,
        resample_every=5,
        dead_window=128,
        checkpoint_every=1000,
        l1_coeff=0.1,
    )
    record = fit(sae, _batches, sc, tmp_path, show_progress=False)
    assert (sae.b_enc[:3].detach().abs() < 1.0).all()  # reset to 0 at step 5, then a few small steps
    torch.testing.assert_close(sae.W_dec.norm(dim=1).detach(), torch.ones(32), atol=1e-5, rtol=0)
    curve = pd.DataFrame(record["curve"])
    dead = curve[curve["metric"] == "dead_window_fraction"].set_index("step")["value"]
    assert dead[2] >= 3 / 32  # dead after a window of 128 tokens
    # dead only from step 6 on: the next resampling step, 10, falls in the last resample_every steps
    sae = ReluL1SAE(D_SYN, 32, seed=0, l1_coeff=0.1)
    with torch.no_grad():
        sae.b_enc[:3] = -1000.0
    fit(sae, _batches, _sae_cfg(**{**OmegaConf.to_container(sc), "dead_window": 384}), tmp_path / "late", False)
    assert (sae.b_enc[:3].detach() == -1000.0).all()


# ---------------------------------------------------------------- study: reuse, resume


@pytest.fixture(scope="module")
def resumed_study(tmp_path_factory):
    """obtain_sae interrupted by an error in the stream's third pass, then called again: what each call drew."""
    from headlab import compose
    from headlab.studies.sae import DONE, corpora, obtain_sae, sae_dir
    from headlab.tasks.counting import CountingTask

    root = tmp_path_factory.mktemp("resume")
    cfg = compose(
        *[
            "task.n_prompts=8",
            "sae.steps=30",
            "sae.batch_size=16",
            "sae.buffer_tokens=64",
            "sae.model_batch=4",
            "sae.checkpoint_every=5",
            "sae.expansion=1",
            f"output.root={root}",
        ]
    )
    task = CountingTask(cfg.task)
    torch.manual_seed(0)
    model = hooked_toy(
        ToyTransformer(ToyConfig(vocab_size=task.vocab_size, n_ctx=32, n_heads=H, d_model=32, d_head=DH)).eval(),
        "toy-attn-1l",
    )
    passes, _ = corpora(cfg, task, model)
    drawn: list[list[Tensor]] = [[], []]

    def spy(run: int, crash_at: int | None):
        def draw(i: int) -> Corpus:
            if i == crash_at:
                raise _Interrupted
            corpus = passes(i)
            drawn[run].append(corpus.ids)
            return corpus

        return draw

    with pytest.raises(_Interrupted):
        obtain_sae(cfg, model, spy(0, 3), False)
    assert not (sae_dir(cfg) / DONE).exists()
    state = json.loads((sae_dir(cfg) / STATE / "state.json").read_text())
    sae, record = obtain_sae(cfg, model, spy(1, None), False)
    done = json.loads((sae_dir(cfg) / DONE).read_text())
    return SimpleNamespace(cfg=cfg, state=state, sae=sae, record=record, done=done, drawn=drawn, dir=sae_dir(cfg))


def test_obtain_sae_resumes_an_interrupted_fit_to_a_finished_record(resumed_study):
    r = resumed_study
    assert 0 < r.state["step"] < 30 and r.state["step"] % 5 == 0  # interrupted after a checkpoint
    assert r.done["complete"] is True and r.done["steps"] == r.record["steps"] == 30
    assert r.done["tokens"] == 30 * 16
    logged = [(p["step"], p["metric"]) for p in r.done["curve"]]
    assert len(logged) == len(set(logged)) and max(step for step, _ in logged) == 30  # none twice, none missing
    again, _ = load_sae(r.dir)  # the finished SAE on disk is the one returned
    for a, b in zip(again.parameters(), r.sae.parameters()):
        torch.testing.assert_close(a, b, atol=0, rtol=0)


def test_a_resumed_fit_streams_new_prompts(resumed_study):
    first, second = resumed_study.drawn
    assert first and second
    repeated = [b for b in second if any(a.shape == b.shape and torch.equal(a, b) for a in first)]
    assert not repeated  # "every pass draws new ones, so the stream never repeats" (activations.py)


# ---------------------------------------------------------------- study: reuse key


class _CharTokenizer:
    eos_token_id = 0

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [1 + ord(c) % 50 for c in text]}


def test_one_sae_directory_means_one_training_set(tmp_path):
    from headlab import compose
    from headlab.studies.sae import corpora, sae_dir

    (tmp_path / "doc.txt").write_text("the quick brown fox jumps over the lazy dog. " * 40)
    model = SimpleNamespace(tokenizer=_CharTokenizer(), name="toy-attn-1l")
    cfgs = [
        compose(
            *[
                f"sae.corpus={tmp_path / 'doc.txt'}",
                "sae.context_size=16",
                f"sae.eval_sequences={n}",
                f"output.root={tmp_path}",
            ]
        )
        for n in (4, 40)
    ]
    (train_a, _), (train_b, _) = (corpora(cfg, None, model) for cfg in cfgs)
    if sae_dir(cfgs[0]) == sae_dir(cfgs[1]):
        assert torch.equal(train_a(0).ids, train_b(0).ids)


# ---------------------------------------------------------------- the command


FAST = [
    "model=toy-attn-1l",
    "task=counting",
    "task.n_prompts=64",
    "train.steps=50",
    "train.eval_every=50",
    "train.eval_prompts=64",
    "train.checkpoint_every=50",
    "train.batch_size=64",
    "sae.steps=30",
    "sae.batch_size=128",
    "sae.buffer_tokens=512",
    "sae.eval_sequences=32",
    "sae.expansion=2",
    "threads=1",
]


def _check_head_roles(df: pd.DataFrame, top_n: int) -> None:
    """Each head's role rows against its top features by the table's decoder_share rows, their roles and
    overlaps counted from the table's top_context rows (source_role; none where no source drives the
    feature up) with pandas."""
    shares = df[df["metric"] == "decoder_share"].pivot_table(index="feature", columns="head", values="value")
    ctx = df[(df["metric"] == "top_context") & (df["source_role"].fillna("") != "")]
    dist = pd.crosstab(ctx["feature"], ctx["source_role"], normalize="index")  # [feature, role]
    heads = df[(df["intervention"] == "sae") & df["head"].notna() & df["feature"].isna()]
    wide = heads.pivot_table(index="head", columns="metric", values="value", dropna=False)
    in_role = heads[heads["metric"] == "top_features_in_role"]
    exact = 0
    for head in shares.columns:
        ranked = shares.loc[shares.index.isin(dist.index), head].sort_values(ascending=False, kind="stable")
        top = ranked.index[:top_n]
        row = wide.loc[head]
        assert row["n_top_features"] == len(top) and row["top_feature_share"] == pytest.approx(
            ranked.iloc[:top_n].mean()
        )
        d = dist.loc[top].to_numpy()
        overlaps = [np.minimum(d[i], d[j]).sum() for i in range(len(d)) for j in range(len(d)) if i != j]
        assert row["polysemantic"] == float(min(overlaps, default=np.nan) < 0.5)
        counts = in_role[in_role["head"] == head].set_index("source_role")["value"]
        assert counts.sum() == len(top) and row["n_roles"] == (counts > 0).sum()
        majority = dist.loc[top].apply(lambda r: set(r.index[r == r.max()]), axis=1)
        if all(len(m) == 1 for m in majority):  # a tie is broken by class order, which the table does not hold
            expected = pd.Series([next(iter(m)) for m in majority]).value_counts()
            assert counts[counts > 0].sort_index().to_dict() == expected.sort_index().to_dict()
            exact += 1
    assert exact > 0
    polysemantic = wide["polysemantic"].mean()
    top_rows = df[(df["metric"] == "polysemantic_head_fraction") & df["head"].isna()]
    assert float(top_rows["value"].iloc[0]) == pytest.approx(polysemantic)


def test_cli_sae_fits_measures_exports_then_reuses_the_fit(tmp_path):
    from sae_lens import SAE

    from headlab import compose
    from headlab.studies.sae import DONE, corpora, sae_dir
    from headlab.tasks import build_task
    from headlab.train.obtain import obtain_model

    args = [*FAST, f"output.root={tmp_path}"]
    proc = run_headlab("sae", *args, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    (run_dir,) = tmp_path.glob("runs/*/*")
    df = pd.read_parquet(run_dir / "results.parquet")
    top = df[
        (df["intervention"] == "sae")
        & (df["method"] == "relu_l1")
        & df["head"].isna()
        & df["feature"].isna()
        & (df["metric"] != "top_context")
    ]
    metrics = dict(zip(top["metric"], top["value"]))
    assert {"l0", "explained_variance", "ce_loss_recovered", "ce_clean", "ce_with_sae"} <= set(metrics)
    fit_rows = df[df["method"] == "fit"]
    assert fit_rows["step"].max() == 30
    fitted = sae_dir(compose(*args))
    assert json.loads((fitted / DONE).read_text())["complete"] is True

    _check_head_roles(df, top_n=10)

    # the reported metrics, recomputed on the held-out tokens with the SAELens copy in <run>/sae
    theirs = SAE.load_from_disk(str(run_dir / "sae"))
    cfg = compose(*args)
    task = build_task(cfg.task)
    model = obtain_model(cfg, task, False)  # the checkpoint the command trained
    _, held_out = corpora(cfg, task, model)
    x = corpus_z(model, 0, held_out, 64)
    n_heads, d_head = model.sites.n_heads, model.sites.d_head
    with torch.no_grad():
        f = theirs.encode(x.view(-1, n_heads, d_head))
        recon = theirs(x.view(-1, n_heads, d_head)).flatten(-2)
    assert metrics["l0"] == pytest.approx((f > 0).sum(-1).float().mean().item(), abs=1e-4)
    ev = 1 - (x - recon).pow(2).sum() / (x - x.mean(0)).pow(2).sum()
    assert metrics["explained_variance"] == pytest.approx(ev.item(), abs=1e-4)
    spliced = lambda z: theirs(z.view(*z.shape[:2], n_heads, d_head)).flatten(-2)  # noqa: E731
    with torch.no_grad():
        assert metrics["ce_clean"] == pytest.approx(_ce_plain(model, 0, held_out), abs=1e-4)
        assert metrics["ce_with_sae"] == pytest.approx(_ce_plain(model, 0, held_out, spliced), abs=1e-4)

    # the same command again: the fitted SAE is reused, not refitted
    stamp = (fitted / "sae_weights.safetensors").stat().st_mtime_ns
    proc = run_headlab("sae", *args, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert (fitted / "sae_weights.safetensors").stat().st_mtime_ns == stamp
    second = max(tmp_path.glob("runs/*/*"), key=lambda p: p.name)
    assert second != run_dir
    again = pd.read_parquet(second / "results.parquet")
    reused = again[(again["method"] == "relu_l1") & (again["metric"] == "l0")]["value"]
    assert reused.tolist() == pytest.approx([metrics["l0"]])

    # a layer the model does not have: one line, non-zero exit, no table
    proc = run_headlab("sae", *args, "sae.layer=5", cwd=tmp_path)
    assert proc.returncode != 0
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "sae.layer=5" in lines[0], proc.stderr
    assert len(list(tmp_path.glob("runs/*/*/results.parquet"))) == 2


def test_quick_attn_sae_reproduction_draws_from_the_table_and_reuses_its_runs(tmp_path):
    from headlab.reproduce import run_all

    logs: list[str] = []
    result = run_all("attn_sae", tmp_path, quick=True, log=logs.append)
    assert {Path(p).name for p in result["figures"]} == {
        "fig_layers.png",
        "fig_head_attribution.png",
        "fig_top_features.png",
    }
    table = pd.read_parquet(Path(result["dir"]) / "collected.parquet")
    summary = result["numbers"]["relu_l1_L1"]
    for metric in ("l0", "explained_variance", "ce_loss_recovered"):
        row = table[(table["metric"] == metric) & (table["intervention"] == "sae") & table["head"].isna()]
        assert summary[metric] == pytest.approx(float(row["value"].iloc[0]))
    shares = table[table["metric"] == "decoder_share"].pivot_table(index="feature", columns="head", values="value")
    features = result["numbers"]["features_L1_relu_l1"]
    assert features, "no feature shown"
    for name, f in features.items():  # each shown feature is dominated by the head it is listed under
        row = shares.loc[int(name[1:])]
        assert int(row.idxmax()) == f["head"] and row.max() == pytest.approx(f["share"], abs=1e-4)
        assert "[[" in f["top_context"]
    # the polysemanticity of the table's heads, and the old rules beside it
    old_rules = ["polysemantic_dominated", "multi_feature"]
    heads = table[table["metric"].isin(["polysemantic", *old_rules]) & table["head"].notna()]
    wide = heads.pivot_table(index="head", columns="metric", values="value")
    for name in ("polysemantic", *old_rules):
        assert summary[f"{name}_head_fraction"] == pytest.approx(wide[name].mean())
    assert result["numbers"]["polysemantic_criterion"]["unrelated_overlap"] == 0.5
    _check_head_roles(table, top_n=10)
    roles = table[(table["metric"] == "top_features_in_role") & (table["value"] > 0)]
    written = result["numbers"]["head_roles_relu_l1_L1"]  # per head, the roles of its top features
    assert {int(h) for h in written} == set(roles["head"])
    for head, counts in written.items():
        mine = roles[roles["head"] == int(head)]
        assert counts == dict(zip(mine["source_role"], mine["value"].astype(int)))
    contexts = table[table["metric"] == "top_context"]
    from headlab.tasks.recall_reasoning import CONTEXT_CLASSES

    assert contexts["context_class"].notna().all() and set(contexts["context_class"]) <= set(CONTEXT_CLASSES)
    assert logs[0].startswith("[1/1] run")
    run_all("attn_sae", tmp_path, quick=True, log=logs.append)
    assert logs[1].startswith("[1/1] skip (done)")


@pytest.mark.parametrize("arch", ["relu_l1", "topk"])
def test_the_exported_metadata_holds_l1_coeff_only_for_an_architecture_that_has_one(arch):
    from types import SimpleNamespace

    from headlab.door import compose
    from headlab.studies.sae import export_meta

    cfg = compose([f"sae={arch}", "sae.layer=1"])
    model = SimpleNamespace(sites=SimpleNamespace(n_heads=H, d_head=DH))
    meta = export_meta(cfg, model)  # type: ignore[arg-type]
    assert meta["hook_name"] == "blocks.1.attn.hook_z" and meta["n_heads"] == H
    assert ("l1_coeff" in meta) == (arch == "relu_l1")
