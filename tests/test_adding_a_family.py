"""A model family added by one FAMILIES row, from outside the package (docs/extending/model-family.md).

A transformers architecture registered under a model_type headlab has never seen ("renamed_postnorm": Gemma
3's text model under another name, so with norms after each component, per-head QK-norm and Gemma's norm
offset) enters with one `Family` row and nothing else. On a random-weight model of it: a head's zero
ablation equals plain transformers with that head's slice of o_proj's input zeroed; sweeps, path patching,
EAP edges and the exact QK split equal the same weights read through the built-in gemma3_text row (held to
transformers in tests/test_gemma3.py, test_edges_postnorm.py and test_qk_attribution.py).
"""

from __future__ import annotations

import pandas as pd
import pytest
import torch

import headlab
from conftest import tiny_configs
from headlab.analysis import qk_attribution as qk
from headlab.edges.eap import scores as edge_scores
from headlab.edges.graph import EdgeGraph
from headlab.models.families import FAMILIES, Family
from headlab.models.hf import hook_hf, register_attention
from headlab.studies.context import EVAL_SEED_OFFSET

NEW_TYPE = "renamed_postnorm"
ROW = Family(
    "model.layers",
    "self_attn",
    "o_proj",
    "model.norm",
    mlp_norm="pre_feedforward_layernorm",
    post_norms=("post_attention_layernorm", "post_feedforward_layernorm"),
    qk_norms=("q_norm", "k_norm"),
    norm_offset=1.0,
    softcaps=("attn_logit_softcapping", "final_logit_softcapping"),
)


@pytest.fixture(scope="module")
def pair(gpt2_tokenizer):
    """(the new family's model, the same weights through gemma3_text's row, transformers' own model)."""
    import transformers

    class RenamedConfig(transformers.Gemma3TextConfig):
        model_type = NEW_TYPE

    class RenamedForCausalLM(transformers.Gemma3ForCausalLM):
        config_class = RenamedConfig

    transformers.AutoConfig.register(NEW_TYPE, RenamedConfig, exist_ok=True)
    transformers.AutoModelForCausalLM.register(RenamedConfig, RenamedForCausalLM, exist_ok=True)
    register_attention()
    torch.manual_seed(0)
    base = tiny_configs()["gemma3_text"]
    reference = transformers.AutoModelForCausalLM.from_config(base, attn_implementation="eager").eval()
    with torch.no_grad():  # norms away from Gemma's identity (weight 0), so that the offset matters
        for name, p in reference.named_parameters():
            if "norm" in name:
                p.normal_(0.0, 0.3)
    renamed_cfg = RenamedConfig(**{k: v for k, v in base.to_dict().items() if k != "model_type"})
    renamed = transformers.AutoModelForCausalLM.from_config(renamed_cfg, attn_implementation="headlab").eval()
    renamed.load_state_dict(reference.state_dict())
    builtin = transformers.AutoModelForCausalLM.from_config(base, attn_implementation="headlab").eval()
    builtin.load_state_dict(reference.state_dict())
    for m in (reference, renamed, builtin):
        m.requires_grad_(False)
    assert NEW_TYPE not in FAMILIES and renamed.config.model_type == NEW_TYPE
    new = hook_hf(renamed, "renamed", ROW, gpt2_tokenizer)
    return new, hook_hf(builtin, "gemma3", FAMILIES["gemma3_text"], gpt2_tokenizer), reference


@pytest.fixture(scope="module")
def ioi(pair):
    task = headlab.load_task("ioi", n_prompts=4)
    return task, task.build(4, seed=3 + EVAL_SEED_OFFSET, model=pair[0])  # the sweep's own prompts at seed=3


def test_the_row_is_all_headlab_needs_to_know(pair):
    new, builtin, _ = pair
    assert new.family == NEW_TYPE and not new.residual_sum and new.norm_offset == 1.0
    assert all(q is not None for q in new.q_norms) and new.attn_scales == builtin.attn_scales
    assert qk.norms_move(new)


def test_zero_ablating_a_head_equals_plain_transformers(pair, ioi):
    new, _, reference = pair
    task, data = ioi
    table = headlab.sweep(new, task, ablate="heads", method="zero", n_prompts=4, seed=3, n_boot=0)
    d_head = new.sites.d_head
    for layer, head in [(0, 1), (1, 3)]:

        def zero(_m, args, head=head):
            z = args[0].clone()
            z[..., head * d_head : (head + 1) * d_head] = 0
            return (z,)

        o_proj = reference.model.layers[layer].self_attn.o_proj
        handle = o_proj.register_forward_pre_hook(zero)
        try:
            logits = reference(**data.inputs).logits
        finally:
            handle.remove()
        want = task.per_prompt(logits[torch.arange(4)[:, None], data.positions], data)  # [n, quantities]
        got = table[(table["layer"] == layer) & (table["head"] == head) & (table["metric"] == task.quantities[0])]
        assert got["value"].item() == pytest.approx(want[:, 0].mean().item(), abs=1e-4)


def test_sweeps_path_patching_edges_and_the_qk_split_equal_the_builtin_row(pair, ioi):
    new, builtin, _ = pair
    task, data = ioi
    for patch in ("activation", "path"):
        a, b = (
            headlab.sweep(m, task, ablate="none", patch=patch, n_prompts=4, seed=3, n_boot=0) for m in (new, builtin)
        )
        pd.testing.assert_series_equal(a["value"], b["value"], atol=1e-5, rtol=1e-5)
    graphs = [EdgeGraph.of(m, "mib") for m in (new, builtin)]
    assert graphs[0].n_edges == graphs[1].n_edges
    got = [edge_scores(m, task, data, g, method="eap") for m, g in zip((new, builtin), graphs)]
    torch.testing.assert_close(got[0], got[1], atol=1e-5, rtol=1e-5, equal_nan=True)
    splits = []
    for m in (new, builtin):
        comps = qk.record(m, data.inputs)
        parts = qk.layer_parts(comps, 1, 0)
        splits.append(parts.terms(2, m.sites.kv_head_of(2), int(data.positions.flatten()[0]), 1))
    torch.testing.assert_close(splits[0], splits[1], atol=1e-6, rtol=1e-6)
