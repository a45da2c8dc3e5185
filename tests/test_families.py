"""One FAMILIES row per model family (models/families.py), and each row true of its family: a random-weight
model of every row loads, its norms are where the row says, its residual stream is a sum of component
outputs exactly where the row says no norm sits on them, and a row that claims no suffix runs gets none.
tests/test_check.py holds every row to `headlab check` and tests/test_prefix.py every row that claims
suffix runs to full passes."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from torch import Tensor, nn

from conftest import tiny_configs
from headlab.interventions.engine import execute
from headlab.models.families import FAMILIES
from headlab.models.hf import load_hf
from headlab.models.hooked import HookedModel
from test_prefix import LastRealToken, positioned, prompts, suffix_starts

LAYER = 1  # a middle layer of the three


def test_every_row_has_a_tiny_model_of_its_own_type():
    assert sorted(tiny_configs()) == sorted(FAMILIES)
    assert all(config.model_type == name for name, config in tiny_configs().items())


def _hidden(args: tuple, kwargs: dict) -> Tensor:
    """The hidden states a module was called with, by position or by name."""
    return args[0] if args else kwargs["hidden_states"]


def _first(output: Tensor | tuple) -> Tensor:
    return output[0] if isinstance(output, tuple) else output


def _record(model: HookedModel, ids: Tensor) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """Inputs and outputs of layer LAYER's block, attention, MLP and every other module of the block."""
    block = model.blocks[LAYER]
    inputs, outputs, handles = {}, {}, []
    for name, module in block.named_modules():

        def pre(_m: nn.Module, args: tuple, kwargs: dict, name: str = name) -> None:
            if args or "hidden_states" in kwargs:
                inputs[name] = _hidden(args, kwargs)

        def post(_m: nn.Module, _args: tuple, output: Tensor | tuple, name: str = name) -> None:
            outputs[name] = _first(output)

        handles += [module.register_forward_pre_hook(pre, with_kwargs=True), module.register_forward_hook(post)]
    try:
        with torch.no_grad():
            model.forward({"input_ids": ids})
    finally:
        for handle in handles:
            handle.remove()
    return inputs, outputs


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_row_says_where_its_norms_are_and_whether_its_components_sum(family, tiny_hf_dir):
    row = FAMILIES[family]
    model = load_hf(str(tiny_hf_dir(family)), need_tokenizer=False)
    assert (
        model.family == family
        and model.residual_sum == (row.post_norms is None)
        and model.runs_suffixes == row.suffix_runs
    )
    ids = torch.randint(0, 50257, (2, 7), generator=torch.Generator().manual_seed(0))
    inputs, outputs = _record(model, ids)
    resid, attn_out, mlp_out = inputs[""], outputs[row.attn], outputs[row.mlp]
    summed = resid + attn_out + mlp_out
    if row.post_norms:
        assert not torch.allclose(outputs[""], summed, atol=1e-3)
        # the row's post-norms are what the block adds: resid + post_attn(attention) + post_mlp(mlp)
        post_attn, post_mlp = row.post_norms
        torch.testing.assert_close(inputs[post_attn], attn_out, atol=0, rtol=0)
        torch.testing.assert_close(inputs[post_mlp], mlp_out, atol=0, rtol=0)
        torch.testing.assert_close(outputs[""], resid + outputs[post_attn] + outputs[post_mlp], atol=1e-5, rtol=1e-5)
    else:
        torch.testing.assert_close(outputs[""], summed, atol=1e-5, rtol=1e-5)
    if row.attn_norm is None:  # the attention reads the residual stream itself
        torch.testing.assert_close(inputs[row.attn], resid, atol=0, rtol=0)
    else:
        torch.testing.assert_close(inputs[row.attn_norm], resid, atol=0, rtol=0)
        torch.testing.assert_close(inputs[row.attn], outputs[row.attn_norm], atol=0, rtol=0)
    if row.mlp_norm is None:  # no module of the block hands the MLP its input
        inside = (row.attn, row.mlp)
        others = [n for n in outputs if n and not any(n == m or n.startswith(m + ".") for m in inside)]
        assert others and not any(torch.equal(outputs[n], inputs[row.mlp]) for n in others)
    else:
        torch.testing.assert_close(inputs[row.mlp], outputs[row.mlp_norm], atol=0, rtol=0)
    assert model.down_projs[LAYER] is model.blocks[LAYER].get_submodule(row.down_proj)
    assert model.sites.out_projs[LAYER] is model.blocks[LAYER].get_submodule(f"{row.attn}.{row.out_proj}")


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_rows_qkv_projections_split_into_heads_as_its_weights_read(family, tiny_hf_dir):
    """Edge attribution cuts the projections' output gradients into heads with qkv_split: each head's part
    of their outputs must be the norm's output times that head's W_Q (W_K, W_V) as W_QKV reads them."""
    sites = load_hf(str(tiny_hf_dir(family)), need_tokenizer=False).sites
    assert sites.qkv_projs is not None and sites.qkv_split is not None
    x = torch.randn(2, 3, sites.d_model, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        projs = sites.qkv_projs[LAYER]
        linear = [m(x) - m(torch.zeros_like(x)) for m in projs]  # the biases out
        for part, w in zip(sites.qkv_split(linear), sites.W_QKV(LAYER), strict=True):
            torch.testing.assert_close(part, torch.einsum("npd,gde->npge", x, w), atol=1e-5, rtol=1e-4)


def test_a_row_without_suffix_runs_runs_every_position(tiny_hf_dir, monkeypatch):
    monkeypatch.setitem(FAMILIES, "llama", replace(FAMILIES["llama"], suffix_runs=False))
    model = load_hf(str(tiny_hf_dir("llama")), need_tokenizer=False)
    data, ivs = prompts(50257), positioned(model.n_layers, model.n_heads, mlp=True)
    starts = suffix_starts(model)
    full = execute(model, LastRealToken(), data, ivs, chunk_mb=0.05)
    assert not model.runs_suffixes and starts and set(starts) == {0}
    torch.testing.assert_close(full, execute(model, LastRealToken(), data, ivs, naive=True), atol=1e-5, rtol=0)
