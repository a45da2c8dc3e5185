"""The `hook` column: every row's site by its TransformerLens hook name, so headlab's tables join with
TransformerLens's and SAELens's on (hook, head). Real sweeps through the API on a small random GPT-2."""

from __future__ import annotations

import pandas as pd
import pytest
import torch

import headlab
from conftest import GPT2_TOKENIZER
from headlab import results
from headlab.sae.export import hook_name as sae_hook_name
from headlab.vocabulary import HOOKS, Site, hook_name

N = dict(n_prompts=8, n_boot=0)


@pytest.fixture(scope="module")
def gpt2(tiny_hf_dir):
    """3 layers of 4 heads, each with an MLP, on IOI (counterfactual prompts, an END role)."""
    model = headlab.load_model(str(tiny_hf_dir("gpt2")), tokenizer=str(GPT2_TOKENIZER))
    return model, headlab.load_task("ioi")


def hooks(table: pd.DataFrame) -> list:
    return [None if pd.isna(h) else h for h in table["hook"]]


def test_the_names_are_transformerlens_own():
    """Written out as TransformerLens names its hook points (HookedTransformer.hook_dict; SAELens's
    hook_name), not derived from headlab's own code."""
    assert hook_name(Site.z, 3) == "blocks.3.attn.hook_z"
    assert hook_name(Site.pattern, 3) == "blocks.3.attn.hook_pattern"
    assert hook_name(Site.q, 0) == "blocks.0.attn.hook_q"
    assert hook_name(Site.k, 0) == "blocks.0.attn.hook_k"
    assert hook_name(Site.v, 11) == "blocks.11.attn.hook_v"
    assert hook_name(Site.mlp, 2) == "blocks.2.hook_mlp_out"
    assert hook_name(Site.neurons, 2) == "blocks.2.mlp.hook_post"
    assert hook_name("result", 5) == "blocks.5.attn.hook_result"
    assert hook_name("q_input", 1) == "blocks.1.hook_q_input"
    assert hook_name("k_input", 1) == "blocks.1.hook_k_input"
    assert hook_name("v_input", 1) == "blocks.1.hook_v_input"
    assert hook_name("mlp_in", 1) == "blocks.1.hook_mlp_in"
    assert hook_name("resid_pre", 0) == "blocks.0.hook_resid_pre"
    assert hook_name("resid_post", 11) == "blocks.11.hook_resid_post"
    assert hook_name("z", None) is None  # a model-level row
    assert sae_hook_name(4) == "blocks.4.attn.hook_z"  # what SAELens attaches an attention SAE at
    assert set(Site) <= set(HOOKS)  # every site an edit lands on has its name


def test_components_sweep_names_z_and_mlp_out_row_by_row(gpt2):
    model, task = gpt2
    table = headlab.sweep(model, task, ablate="components", method="mean", **N)
    assert list(table.columns[:15]) == results.LEADING
    for row, hook in zip(table.itertuples(), hooks(table)):
        expected = {
            "none": None,
            "ablate_head": f"blocks.{row.layer}.attn.hook_z",
            "ablate_layer": f"blocks.{row.layer}.attn.hook_z",  # every head's z: the head is empty
            "ablate_mlp": f"blocks.{row.layer}.hook_mlp_out",
        }[row.intervention]
        assert hook == expected, row
    assert table.loc[table["intervention"] == "ablate_layer", "head"].isna().all()
    assert set(table["intervention"]) == {"none", "ablate_head", "ablate_layer", "ablate_mlp"}


def test_patching_names_the_patched_site(gpt2):
    model, task = gpt2
    sites = ["z", "pattern", "q", "k", "v"]
    table = headlab.sweep(model, task, ablate="none", patch="activation", sites=sites, positions=["END"], **N)
    patched = table[table["intervention"] == "patch_head"]
    assert set(patched["site"]) == set(sites) and len(patched) == 5 * 3 * 4 * table["metric"].nunique()
    for row, hook in zip(patched.itertuples(), hooks(patched)):
        assert hook == f"blocks.{row.layer}.attn.hook_{row.site}", row
    assert hooks(table[table["intervention"] == "none"]) == [None] * table["metric"].nunique()


def test_pattern_edits_swaps_neurons_and_own_edits(gpt2):
    model, task = gpt2
    iv = headlab.Intervention
    table = headlab.execute(
        model,
        task,
        [
            iv("ablate_head", "zero", layer=1, head=2, site="pattern"),
            iv("calibrate_sink", "calibration", layer=0, head=1, scale=(0.5,)),
            iv("flat", layer=2, head=0, site="pattern", edit=lambda p: p.mean(-1, keepdim=True).expand_as(p)),
            iv("half", layer=2, head=3, edit=lambda z: 0.5 * z),  # site z by default
            iv("half_k", layer=1, head=0, site="k", edit=lambda k: 0.5 * k),
            iv("pattern_from", layer=1, head=0, other_head=3),  # the swap alone: one hook
            iv("values_from", layer=1, head=0, other_head=3),
            iv("pattern_from", "zero", layer=1, head=0, other_head=3),  # and the others' z: two hooks
            iv("ablate_neurons", "zero", layer=0, neurons=(1, 5), group="two"),
            iv("path_patch", "path", layer=0, head=1, receivers="logits"),
            iv("scale_heads", layer=2, scale=(1.0, 0.5, 1.0, 1.0)),
        ],
        **N,
    )
    per_row = table[table["metric"] == "logit_diff"]
    assert hooks(per_row) == [
        None,  # the clean run
        "blocks.1.attn.hook_pattern",
        "blocks.0.attn.hook_pattern",
        "blocks.2.attn.hook_pattern",
        "blocks.2.attn.hook_z",
        "blocks.1.attn.hook_k",
        "blocks.1.attn.hook_pattern",
        "blocks.1.attn.hook_v",
        None,
        "blocks.0.mlp.hook_post",
        "blocks.0.attn.hook_z",  # the sender's z; the receivers are in `receivers`
        "blocks.2.attn.hook_z",
    ]


def test_scores_read_off_the_pattern_or_v(gpt2):
    model, task = gpt2
    sinks = headlab.scores(model, task, kind="sinks", **N)
    heads = sinks[sinks["layer"].notna()]
    assert len(heads) and hooks(heads) == [f"blocks.{layer}.attn.hook_pattern" for layer in heads["layer"]]
    assert hooks(sinks[sinks["metric"] == "sink_1"]) == [None]  # one value for the whole model
    scored = headlab.sweep(model, task, ablate="none", head_scores=True, **N)
    scored = scored[scored["method"] == "score"]
    for row, hook in zip(scored.itertuples(), hooks(scored)):
        site = "v" if row.metric in ("copy_score", "negative_copy_score") else "pattern"
        assert hook == f"blocks.{row.layer}.attn.hook_{site}", row
    assert {"induction_score", "attn_end_to_io", "copy_score"} <= set(scored["metric"])


def test_circuit_edges_name_receiver_and_sender(gpt2):
    model, task = gpt2
    table = headlab.circuit(model, task, method="eap", faithfulness=False, **N)
    edges = table[table["intervention"] == "edge"]
    receiver = {"q": "hook_q_input", "k": "hook_k_input", "v": "hook_v_input", "mlp": "hook_mlp_in"}
    for row, hook in zip(edges.itertuples(), hooks(edges)):
        if row.receiver_input == "logits":
            assert hook == "blocks.2.hook_resid_post", row  # the stream the last block leaves
        else:
            assert hook == f"blocks.{row.layer}.{receiver[row.receiver_input]}", row
        if row.sender == "input":
            assert row.sender_hook == "blocks.0.hook_resid_pre", row
        elif row.sender.startswith("m"):
            assert row.sender_hook == f"blocks.{row.sender_layer}.hook_mlp_out", row
        else:
            assert row.sender_hook == f"blocks.{row.sender_layer}.attn.hook_result", row


def test_a_transformerlens_style_table_joins_on_hook_and_head(gpt2):
    """A table keyed as TransformerLens users key theirs (hook name, head index), plain object strings
    and ints, merges with headlab's rows: one match per head, none for the clean run."""
    model, task = gpt2
    table = headlab.sweep(model, task, ablate="heads", method="zero", **N)
    sinks = headlab.scores(model, task, kind="sinks", **N)
    theirs = pd.DataFrame(
        [
            {"hook": f"blocks.{layer}.attn.{name}", "head": head, "theirs": 10 * layer + head}
            for name in ("hook_z", "hook_pattern")
            for layer in range(3)
            for head in range(4)
        ]
    )
    for ours in (table, sinks):
        metric = ours["metric"].iloc[0]
        rows = ours[ours["metric"] == metric]
        joined = rows.merge(theirs, on=["hook", "head"], how="inner")
        assert len(joined) == 12 and (joined["theirs"] == 10 * joined["layer"] + joined["head"]).all()
    assert table.merge(theirs, on=["hook", "head"])["intervention"].eq("ablate_head").all()


def test_every_name_is_a_transformerlens_hook_and_only_q_k_v_are_laid_out_otherwise(tiny_hf_dir):
    """Where TransformerLens is installed (SAELens brings it), its own HookedTransformer holds every name
    hook_name gives, and its tensors there have headlab's layout but for q, k and v (head and position
    swapped), grouped-query k and v on kv heads in both."""
    tl = pytest.importorskip("transformer_lens")
    cfg = tl.HookedTransformerConfig(
        n_layers=2,
        d_model=16,
        n_ctx=8,
        d_head=4,
        n_heads=4,
        n_key_value_heads=2,
        d_mlp=32,
        act_fn="gelu",
        d_vocab=10,
        use_attn_result=True,
        use_split_qkv_input=True,
        use_hook_mlp_in=True,
    )
    theirs = tl.HookedTransformer(cfg)
    assert all(hook_name(site, 1) in theirs.hook_dict for site in HOOKS)
    _, cache = theirs.run_with_cache(torch.randint(0, 10, (3, 5)))
    ours = headlab.load_model(str(tiny_hf_dir("llama")))  # 4 heads on 2 kv heads as well
    ids = {"input_ids": torch.randint(0, 100, (3, 5))}
    for site in (Site.q, Site.k, Site.v, Site.pattern, Site.z):
        mine = ours.record(ids, site)[1]
        if site in (Site.q, Site.k, Site.v):
            mine = mine.transpose(1, 2)
        batch_pos_heads = 4 if site == Site.pattern else 3  # the pattern's last two axes are positions
        assert mine.shape[:batch_pos_heads] == cache[hook_name(site, 1)].shape[:batch_pos_heads], site
