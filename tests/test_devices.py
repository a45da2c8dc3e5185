"""Dtypes, placement over devices, and the engine's memory: what runs on a GPU, checked on CPU (no GPU
here): bfloat16 and float16 sweeps, a model spread over devices by accelerate (layers offloaded to disk
use the same hooks that spread layers over GPUs), the clean caches' reported size."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

import headlab
from conftest import HF_FAMILIES
from headlab.interventions import CLEAN, Intervention
from headlab.interventions.engine import execute
from headlab.models.hf import load_hf
from test_prefix import LastRealToken, positioned, prompts

VOCAB = 50257


def sweep(model, data, ivs, **kw):
    return execute(model, LastRealToken(), data, ivs, chunk_mb=0.05, **kw)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_a_half_precision_sweep_equals_its_full_passes_and_is_near_float32(dtype, tiny_hf_dir):
    path = str(tiny_hf_dir("llama"))
    half = load_hf(path, need_tokenizer=False, dtype=dtype)
    assert next(half.module.parameters()).dtype == getattr(torch, dtype)
    data = prompts(VOCAB)
    ivs = positioned(half.n_layers, half.n_heads, mlp=True)
    fast, slow = sweep(half, data, ivs), sweep(half, data, ivs, naive=True)
    full = sweep(load_hf(path, need_tokenizer=False), data, ivs)
    # half precision rounds differently in a stacked batch than in a pass of its own: compare the effects
    # (an intervention's change of the metric) with the float32 ones at the precision's scale
    scale = (full - full[0]).abs().amax()
    eps = torch.finfo(getattr(torch, dtype)).eps
    assert (fast.float() - slow.float()).abs().amax() <= 2 * eps * full.abs().amax()
    assert ((fast.float() - fast[0].float()) - (full - full[0])).abs().amax() < 8 * eps * scale


def test_an_unknown_dtype_is_refused_in_one_line(tiny_hf_dir):
    with pytest.raises(headlab.HeadlabError, match="unknown model.dtype 'float8'; choose one of: float32"):
        load_hf(str(tiny_hf_dir("llama")), need_tokenizer=False, dtype="float8")


@pytest.mark.parametrize("family", HF_FAMILIES)
def test_a_model_spread_over_devices_sweeps_as_the_whole_model(family, tiny_hf_dir, tmp_path):
    """Layers 1.. offloaded to disk: accelerate wraps their modules' forward with the hooks that also
    move activations between GPUs; the sweep equals the model in one piece, and the hooks survive it."""
    path = str(tiny_hf_dir(family))
    whole = load_hf(path, need_tokenizer=False)
    blocks = {"gpt2": "transformer.h", "gpt_neox": "gpt_neox.layers"}.get(family, "model.layers")
    base, _ = blocks.split(".")
    placement = {n: "cpu" for n, _ in whole.module.named_children() if n != base}  # lm_head
    placement |= {f"{base}.{n}": "cpu" for n, _ in whole.module.get_submodule(base).named_children()}
    del placement[blocks]
    placement |= {f"{blocks}.{i}": "cpu" if i == 0 else "disk" for i in range(whole.n_layers)}
    spread = load_hf(path, need_tokenizer=False, device_map=placement, offload_folder=str(tmp_path))
    assert spread.dispatched and spread.input_device.type == "cpu"
    attn = spread.sites.attn_modules[-1]
    wrapped = attn.__dict__["forward"]  # accelerate's
    data = prompts(VOCAB)
    ivs = positioned(whole.n_layers, whole.n_heads, mlp=True)
    torch.testing.assert_close(sweep(spread, data, ivs), sweep(whole, data, ivs), atol=1e-5, rtol=0)
    assert attn.__dict__["forward"] is wrapped
    spread.place("cpu")  # a dispatched model stays where it was put
    assert spread.sites.out_projs[-1].weight.device.type == "meta"


def test_the_engine_reports_its_clean_caches(tiny_hf_dir):
    model = load_hf(str(tiny_hf_dir("gpt2")), need_tokenizer=False)
    report: dict = {}
    ivs = [CLEAN, *(Intervention("ablate_head", "zero", layer, 0) for layer in range(model.n_layers))]
    uneven = prompts(VOCAB)
    n, length = uneven.inputs["input_ids"].shape
    d = model.sites.d_model
    # prompts of unequal length run in groups, one after another: the largest group's caches at once
    execute(model, LastRealToken(), uneven, ivs, chunk_mb=0.05, report=report)
    need = uneven.positions.max(1).values + 1
    groups = report["length_groups"]
    sizes = [int(((need <= g) & (need > ([0, *groups][i]))).sum()) * g for i, g in enumerate(groups)]
    assert len(groups) > 1 and report["cache_mb"] == round(2 * max(sizes) * d * 4 / 2**20, 3)
    # every prompt read at the last position: one group, the whole batch
    data = replace(uneven, positions=torch.full_like(uneven.positions, length - 1))
    report = {}
    execute(model, LastRealToken(), data, ivs, chunk_mb=0.05, report=report)
    assert "length_groups" not in report
    # the first block's input and the last block's output, each [n, length, d_model] floats: the walk
    # holds the other blocks' inputs and z one layer at a time
    assert report["cache_mb"] == round(2 * n * length * d * 4 / 2**20, 3)
    assert report["chunk_mb"] == 0.05 and report["chunks"] == model.n_layers
    # edits at position 5 on: every layer's keys and values, and its input and z from the first suffix on
    positioned = [
        CLEAN,
        *(Intervention("ablate_head", "zero", layer, 0, position=5) for layer in range(model.n_layers)),
    ]
    execute(model, LastRealToken(), data, positioned, chunk_mb=0.05, report=report)
    start = min(int(data.positions.min()), 5)
    floats = n * d * (2 * model.n_layers * length + 2 * model.n_layers * (length - start) + length)
    assert start > 0 and report["cache_mb"] == round(floats * 4 / 2**20, 3)


def test_a_gpu_chunk_takes_its_share_of_free_memory(monkeypatch):
    from headlab.runtime import LIVE_ACTIVATIONS, chunk_budget_mb

    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (8 * 2**30, 80 * 2**30))
    assert chunk_budget_mb(torch.device("cuda"), 32.0, 0.5) == 0.5 * 8192 / LIVE_ACTIVATIONS
    assert chunk_budget_mb(torch.device("cuda"), 32.0, 1e-4) == 32.0  # never below the CPU's size
    assert chunk_budget_mb(torch.device("cpu"), 32.0, 0.5) == 32.0


def test_load_model_takes_a_device_map(tiny_hf_dir):
    model = headlab.load_model(str(tiny_hf_dir("llama")), device_map="auto")
    assert model.config.device_map == "auto" and model.input_device.type == "cpu"
