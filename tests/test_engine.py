"""The batched, cached sweep equals the naive loop and an independent hand computation."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from omegaconf import OmegaConf

from conftest import counting_cfg
from headlab.interventions import CLEAN, Intervention, plan
from headlab.interventions.engine import execute
from headlab.interventions.options import PatchConfig
from headlab.interventions.readout import READOUT_ROWS
from headlab.models.hf import load_hf
from headlab.models.toy import ToyConfig, ToyTransformer, hooked_toy
from headlab.tasks import Task, TaskData, mean_of
from headlab.tasks.counting import CountingTask


def _toy(n_layers=2, d_mlp=32, seed=0, pos_emb="learned", layer_norm=True):
    torch.manual_seed(seed)
    model = ToyTransformer(
        ToyConfig(
            vocab_size=7,
            n_ctx=32,
            n_layers=n_layers,
            n_heads=3,
            d_model=24,
            d_head=8,
            d_mlp=d_mlp,
            pos_emb=pos_emb,
            layer_norm=layer_norm,
        )
    )
    for p in model.parameters():  # larger weights than the init, so every head moves the logits
        p.data.normal_(0, 0.3)
    return hooked_toy(model.eval(), "toy")


def _sweep(n_layers, n_heads):
    ivs = [CLEAN]
    for method in ("zero", "mean", "resample"):
        ivs += [Intervention("ablate_head", method, l, h) for l in range(n_layers) for h in range(n_heads)]
        ivs += [Intervention("ablate_layer", method, l) for l in range(n_layers)]
    ivs += [Intervention("patch_head", "activation", l, h) for l in range(n_layers) for h in range(n_heads)]
    ivs += [Intervention("ablate_head", "zero", 0, 1, position=5)]
    return ivs


@pytest.mark.parametrize("pos_emb,layer_norm", [("learned", True), ("rotary", False), ("sinusoidal", True)])
def test_batched_sweep_equals_naive_loop_on_toy(pos_emb, layer_norm):
    model = _toy(pos_emb=pos_emb, layer_norm=layer_norm)
    task = CountingTask(counting_cfg())
    data = task.build(40, seed=1)
    ivs = _sweep(model.n_layers, model.n_heads)
    # two copies a chunk: a copy's widest activation is its scores and pattern (3 heads, float32)
    fast = execute(model, task, data, ivs, chunk_mb=2 * 40 * 3 * 27 * 27 * 8 / 2**20)
    slow = execute(model, task, data, ivs, naive=True)
    assert fast.shape == (len(ivs), 40, len(task.quantities))
    # the fast path runs prompts of like length apart (lengths.py): other product shapes, other rounding
    torch.testing.assert_close(fast, slow, atol=1e-5, rtol=1e-5)
    margin = task.quantities.index("label_margin")
    moved = (fast[1:, :, margin] - fast[0, :, margin]).abs().amax(1)
    assert (moved > 1e-3).float().mean() > 0.9  # nearly every intervention changes something


class _LastTokenTask(Task):
    """Logit difference of two fixed tokens at the last position: the benchmark's metric."""

    name, quantities = "last", ("logit_diff",)
    aggregates = {"logit_diff": mean_of(0)}

    def __init__(self, good: int = 11, bad: int = 7):
        self.good, self.bad = good, bad

    def per_prompt(self, logits, data):
        return (logits[..., 0, self.good] - logits[..., 0, self.bad]).unsqueeze(-1)


@pytest.mark.parametrize("family", ["gpt2", "llama", "gemma3_text"])
def test_batched_sweep_equals_naive_loop_on_hf(family, tiny_hf_dir):
    model = load_hf(str(tiny_hf_dir(family)), need_tokenizer=False)
    gen = torch.Generator().manual_seed(0)
    ids = lambda: torch.randint(0, 50257, (12, 10), generator=gen)  # noqa: E731
    data = TaskData(
        inputs={"input_ids": ids()},
        positions=torch.full((12, 1), 9),
        answers={},
        counterfactual={"input_ids": ids()},
        reference={"input_ids": ids()},
    )
    ivs = _sweep(model.n_layers, model.n_heads)
    fast = execute(model, _LastTokenTask(), data, ivs, chunk_mb=12 * 10 * 128 * 4 * 3 / 2**20)
    slow = execute(model, _LastTokenTask(), data, ivs, naive=True)
    torch.testing.assert_close(fast, slow, atol=1e-5, rtol=0)


@pytest.mark.parametrize("bound", ["budget", "rows"])
def test_chunks_are_read_out_together_in_whole_readouts(bound, tiny_hf_dir, monkeypatch):
    """A readout reads the whole unembedding however few rows it has: the sweep's copies go through it
    READOUT_ROWS rows at a time, or fewer where the budget cannot hold their logits, across chunks, not one
    readout or two per chunk; the values equal the naive loop's."""
    model = load_hf(str(tiny_hf_dir("gpt2")), need_tokenizer=False)
    gen = torch.Generator().manual_seed(0)
    n, seq = 8, 10
    data = TaskData(
        inputs={"input_ids": torch.randint(0, 50257, (n, seq), generator=gen)},
        positions=torch.full((n, 1), seq - 1),
        answers={},
    )
    ivs = [Intervention("ablate_head", "zero", l, h) for l in range(model.n_layers) for h in range(model.n_heads)]
    per_readout = 5 if bound == "budget" else READOUT_ROWS // n
    chunk_mb = 5 * n * model.vocab_size * 4 / 2**20 if bound == "budget" else 32.0
    # a chunk is a layer's heads, which no number of whole readouts makes up
    assert chunk_mb * 2**20 // (n * seq * model.width * 4) >= model.n_heads and model.n_heads % per_readout
    rows: list[int] = []
    readout = model.readout
    monkeypatch.setattr(model, "readout", lambda h, positions: rows.append(h.shape[0]) or readout(h, positions))
    fast = execute(model, _LastTokenTask(), data, ivs, chunk_mb=chunk_mb)
    whole, rest = divmod(len(ivs), per_readout)
    assert rows == [per_readout * n] * whole + [rest * n] * (rest > 0)
    monkeypatch.undo()
    slow = execute(model, _LastTokenTask(), data, ivs, naive=True)
    torch.testing.assert_close(fast, slow, atol=1e-5, rtol=0)


@pytest.mark.parametrize("family", ["gpt2", "llama", "gemma3_text"])
def test_walk_gives_back_the_full_trace_block_by_block(family, tiny_hf_dir):
    """A sweep walks the clean pass layer by layer instead of keeping every block's input: the walk's
    inputs and z equal the full trace's to the bit, and the sweep's cache holds the first input alone.
    A sweep on suffixes keeps the inputs and z of the suffixes' positions alone."""
    model = load_hf(str(tiny_hf_dir(family)), need_tokenizer=False)
    inputs = {"input_ids": torch.randint(0, 50257, (4, 9), generator=torch.Generator().manual_seed(0))}
    with torch.inference_mode():
        full = model.trace(inputs, keep_z=True)
        light = model.trace(inputs, every_input=False)
        walked = 0
        for layer, h in model.walk(light, keep_z=True):
            assert torch.equal(h, full.resid_pre[layer])
            assert light.z is not None and torch.equal(light.z[layer], full.z[layer])  # type: ignore[index]
            walked += 1
    assert walked == model.n_layers and len(light.resid_pre) == 1 and light.z is None
    torch.testing.assert_close(light.resid_final, full.resid_final, atol=0, rtol=0)
    # a sweep on suffixes from position 6 keeps each block's input and z from there on alone
    with torch.inference_mode():
        tail = model.trace(inputs, keep_z=True, inputs_from=6)
    for layer in range(model.n_layers):
        assert torch.equal(tail.resid_pre[layer], full.resid_pre[layer][:, 6:])
        assert torch.equal(tail.z[layer], full.z[layer][:, 6:])  # type: ignore[index]
    with pytest.raises(ValueError, match="whole first input"):
        next(model.walk(tail))
    report: dict = {}
    data = TaskData(inputs=inputs, positions=torch.full((4, 1), 8), answers={})
    ivs = [Intervention("ablate_head", "zero", l, 0) for l in range(model.n_layers)]
    execute(model, _LastTokenTask(), data, ivs, report=report)
    one_input_mb = 2 * full.resid_pre[0].numel() * 4 / 2**20  # the first block's input and the last's output
    assert report["cache_mb"] == pytest.approx(one_input_mb, abs=1e-3)


def test_zero_ablating_one_head_equals_hand_computation():
    """One-layer attention-only toy model, computed by hand from its weights without HeadSites."""
    model = _toy(n_layers=1, d_mlp=0)
    net = model.module
    task = CountingTask(counting_cfg())
    data = task.build(16, seed=2)
    ids = data.inputs["input_ids"]
    layer, head = 0, 1
    H, dh = 3, 8
    with torch.no_grad():
        x = net.embed.weight[ids] + net.pos.weight[: ids.shape[1]]
        a = net.blocks[0].attn
        y = net.blocks[0].ln1(x)
        q = (y @ a.q.weight.T + a.q.bias).unflatten(-1, (H, dh))
        k = (y @ a.k.weight.T + a.k.bias).unflatten(-1, (H, dh))
        v = (y @ a.v.weight.T + a.v.bias).unflatten(-1, (H, dh))
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / dh**0.5
        t = ids.shape[1]
        scores = scores.masked_fill(torch.ones(t, t).triu(1).bool(), float("-inf"))
        z = torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v)
        w_o = a.o.weight.T.reshape(H, dh, -1)
        per_head = torch.einsum("bqhd,hdm->bqhm", z, w_o)
        resid = x + per_head.sum(2) - per_head[:, :, head] + a.o.bias
        rows = torch.arange(16).unsqueeze(1)
        logits = net.unembed(net.ln_f(resid))[rows, data.positions]
        expected = task.per_prompt(logits, data)
    got = execute(model, task, data, [CLEAN, Intervention("ablate_head", "zero", layer, head)])
    torch.testing.assert_close(got[1], expected, atol=1e-5, rtol=0)
    assert (got[1] - got[0]).abs().max() > 1e-3


def test_patching_every_head_of_the_only_layer_reproduces_the_counterfactual_label():
    """At SEP the token and position are the same in both runs: only attention differs, so patching
    all of layer 0's z must give the counterfactual run's own label logits (computed without hooks)."""
    model = _toy(n_layers=1, d_mlp=0)
    task = CountingTask(counting_cfg())
    data = task.build(24, seed=3)
    got = execute(model, task, data, [CLEAN, Intervention("patch_head", "activation", 0, None)])
    with torch.inference_mode():
        cf_logits = model.forward(data.counterfactual)
    rows = torch.arange(24).unsqueeze(1)
    margin = task.quantities.index("label_margin")
    cf_quantities = task.per_prompt(cf_logits[rows, data.positions], data)
    torch.testing.assert_close(got[1, :, margin], cf_quantities[:, margin], atol=1e-5, rtol=0)
    assert (got[1, :, margin] - got[0, :, margin]).abs().max() > 1e-2


def test_plan_follows_the_config():
    patch = lambda kinds: OmegaConf.structured(PatchConfig(kinds=kinds))  # noqa: E731
    cfg = OmegaConf.create({"ablate": {"sweep": "heads", "method": "mean"}, "patch": patch(["activation"])})
    ivs = plan(cfg, n_layers=2, n_heads=3)
    assert ivs[0] == CLEAN
    assert sum(iv.intervention == "ablate_head" and iv.method == "mean" for iv in ivs) == 6
    assert sum(iv.intervention == "patch_head" for iv in ivs) == 6
    cfg = OmegaConf.create({"ablate": {"sweep": "layers", "method": "zero"}, "patch": patch([])})
    assert [iv.layer for iv in plan(cfg, 2, 3)] == [None, 0, 1]


@pytest.mark.parametrize("naive", [False, True])
def test_patching_a_role_from_a_counterfactual_laid_out_otherwise_reads_the_source_at_its_own_position(naive):
    """counterfactual_positions: z of a head at each prompt's role position takes the counterfactual's
    z at that prompt's (other) role position; checked against a hand-written hook."""
    model = _toy(n_layers=2)
    gen = torch.Generator().manual_seed(5)
    n, t = 10, 12
    ids, cf_ids = torch.randint(0, 7, (n, t), generator=gen), torch.randint(0, 7, (n, t), generator=gen)
    role, cf_role = torch.randint(2, 9, (n,), generator=gen), torch.randint(0, 11, (n,), generator=gen)
    data = TaskData(
        inputs={"input_ids": ids},
        positions=torch.full((n, 1), t - 1),
        answers={},
        counterfactual={"input_ids": cf_ids},
        token_positions={"R": role},
        counterfactual_positions={"R": cf_role},
    )
    task = _LastTokenTask(good=3, bad=1)
    layer, head = 0, 2
    got = execute(
        model, task, data, [CLEAN, Intervention("patch_head", "activation", layer, head, token="R")], naive=naive
    )
    with torch.inference_mode():
        source = model.capture({"input_ids": cf_ids}, layer, "z")  # [n, pos, head, d_head]
        rows = torch.arange(n)

        def put(z):
            z[rows, role, head] = source[rows, cf_role, head]
            return z

        with model.hooks(layer, z=put):
            logits = model.forward({"input_ids": ids})
    expected = task.per_prompt(logits[:, -1:], data)
    torch.testing.assert_close(got[1], expected, atol=1e-5, rtol=0)
    aligned = execute(
        model,
        task,
        replace(data, counterfactual_positions=None),
        [Intervention("patch_head", "activation", layer, head, token="R")],
    )
    assert (aligned[0] - got[1]).abs().max() > 1e-3  # the source position matters
