"""`headlab sae` over real text: context classes defined on the text, the corpus a pretrained model reads
when none is named (data/alice.txt), several layers in one run, and its numbers recomputed by hand
(a plain forward pre-hook on o_proj, SAELens's copy of each exported SAE)."""

from __future__ import annotations

import json

import pandas as pd
import pytest
import torch
from torch.nn import functional as F

from conftest import GPT2_TOKENIZER, ROOT, run_headlab
from headlab import compose
from headlab.sae.contexts import TEXT_CLASSES, text_classes
from headlab.studies.sae import corpus_path
from headlab.tasks import build_task

P, D, S, N = (TEXT_CLASSES.index(c) for c in ("punctuation", "dialogue", "sentence start", "narration"))


def test_text_classes_name_each_tokens_place_in_the_text():
    pieces = ["Alice", " said", ",", ' "', "Oh", " dear", "!", " I", " am", ' late', '!"', " Then", " she", " ran", ".",
              " The", " end", "\n", '"Who', " are", " you", "?", "\n", "It", " was"]  # fmt: skip
    expected = [S, N, P, P, D, D, P, D, D, D, P, S, N, N, P, S, N, P, D, D, D, P, P, S, N]
    ids = torch.arange(len(pieces))[None]
    grid, names = text_classes(ids, lambda i: pieces[i])
    assert names == TEXT_CLASSES
    assert grid[0].tolist() == expected
    # rows are separate texts: the second starts outside the quote the first leaves open
    two = torch.tensor([[3, 4, 5], [4, 5, 14]])
    assert text_classes(two, lambda i: pieces[i])[0].tolist() == [[P, D, D], [S, N, P]]


class _GemmaLike:
    """A character tokenizer that puts its BOS (id 1) before a text with special tokens, as Gemma's does."""

    bos_token_id, eos_token_id = 1, 2

    def __call__(self, text, add_special_tokens=True):
        ids = [3 + ord(c) % 50 for c in text]
        return {"input_ids": [1, *ids] if add_special_tokens else ids}


class _Plain(_GemmaLike):
    """The same tokenizer without a BOS before its texts (SmolLM2's and GPT-2's convention)."""

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": [3 + ord(c) % 50 for c in text]}


@pytest.mark.parametrize("bos", [True, False])
def test_text_windows_start_as_the_tokenizer_starts_a_text(bos, tmp_path):
    from types import SimpleNamespace

    from headlab.sae.activations import text_corpus

    text = "Alice was beginning to get very tired of sitting by her sister on the bank. " * 4
    (tmp_path / "a.txt").write_text(text)
    tok = _GemmaLike() if bos else _Plain()
    corpus = text_corpus(str(tmp_path / "a.txt"), SimpleNamespace(tokenizer=tok, name="m"), 16)
    stream = [3 + ord(c) % 50 for c in text] + [2]
    width = 15 if bos else 16
    n = len(stream) // width
    assert corpus.ids.shape == (n, 16)
    assert (corpus.ids[:, 0] == 1).all() == bos
    body = corpus.ids[:, 1:] if bos else corpus.ids
    assert body.flatten().tolist() == stream[: n * width]  # every token once, in order, after its BOS


def test_a_pretrained_model_on_a_task_of_its_own_vocabulary_reads_the_shipped_text():
    def path(*overrides):
        cfg = compose(*overrides)
        return corpus_path(cfg, build_task(cfg.task))

    alice = str(ROOT / "src" / "headlab" / "data" / "alice.txt")  # the file itself, not text_path's answer
    assert path("model=smollm2-135m") == alice  # counting's 26 tokens mean nothing to smollm2
    assert path("model=smollm2-135m", "task=ioi") is None  # its prompts are words: the task's prompts
    assert path("model=toy-attn-1l") is None  # a toy model reads its task
    assert path("model=smollm2-135m", "sae.corpus=/x.txt") == "/x.txt"


def test_cli_sae_fits_several_layers_over_real_text_and_each_export_loads_in_saelens(tiny_hf_dir, tmp_path):
    from sae_lens import SAE

    from headlab.models.hf import load_hf
    from headlab.sae.activations import corpus_z
    from headlab.studies.sae import corpora

    model_dir = tiny_hf_dir("llama")  # 3 layers of 4 query heads on 2 key/value heads, d_head 16
    args = [
        "model=hf",
        f"model.path={model_dir}",
        f"model.tokenizer={GPT2_TOKENIZER}",
        "sae.layers=[2,0]",
        "sae.expansion=2",
        "sae.steps=20",
        "sae.batch_size=128",
        "sae.buffer_tokens=1024",
        "sae.eval_sequences=6",
        "sae.top_contexts=4",
        f"output.root={tmp_path}",
    ]
    proc = run_headlab("sae", *args, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    (run_dir,) = tmp_path.glob("runs/*/*")
    df = pd.read_parquet(run_dir / "results.parquet")
    meta = json.loads((run_dir / "meta.json").read_text())
    assert meta["corpus"].endswith("data/alice.txt")
    top = df[(df["intervention"] == "sae") & (df["method"] == "relu_l1") & df["head"].isna() & df["feature"].isna()]
    assert sorted(top["layer"].unique()) == [0, 2]
    contexts = pd.read_parquet(run_dir / "contexts.parquet")
    assert set(contexts["context_class"]) <= set(TEXT_CLASSES) and len(set(contexts["context_class"])) >= 2

    cfg = compose(*args)
    model = load_hf(str(model_dir), tokenizer=str(GPT2_TOKENIZER))
    _, held_out = corpora(cfg, build_task(cfg.task), model)
    module = model.module
    mask = held_out.targets != -100

    def ce(layer=None, edit=None) -> float:  # one plain pass, z edited by a pre-hook on o_proj
        o_proj = module.model.layers[layer if layer is not None else 0].self_attn.o_proj
        handle = o_proj.register_forward_pre_hook(lambda _m, a: (edit(a[0]),)) if edit else None
        try:
            logits = module(held_out.ids).logits
        finally:
            if handle is not None:
                handle.remove()
        return F.cross_entropy(logits[mask], held_out.targets[mask]).item()

    with torch.no_grad():
        clean = ce()
        for layer in (0, 2):
            metrics = dict(zip(*top[top["layer"] == layer][["metric", "value"]].to_numpy().T))
            theirs = SAE.load_from_disk(str(run_dir / "sae" / f"L{layer}"))
            assert theirs.cfg.metadata.hook_name == f"blocks.{layer}.attn.hook_z"
            x = corpus_z(model, layer, held_out, 64)
            f = theirs.encode(x.view(-1, 4, 16))
            recon = theirs(x.view(-1, 4, 16)).flatten(-2)
            ev = 1 - (x - recon).pow(2).sum() / (x - x.mean(0)).pow(2).sum()
            assert metrics["l0"] == pytest.approx((f > 0).sum(-1).float().mean().item(), abs=1e-4)
            assert metrics["explained_variance"] == pytest.approx(ev.item(), abs=1e-4)
            spliced = lambda z, sae=theirs: sae(z.view(*z.shape[:2], 4, 16)).flatten(-2)  # noqa: E731
            zero = ce(layer, torch.zeros_like)
            with_sae = ce(layer, spliced)
            assert metrics["ce_clean"] == pytest.approx(clean, abs=1e-4)
            assert metrics["ce_zero_ablation"] == pytest.approx(zero, abs=1e-4)
            assert metrics["ce_with_sae"] == pytest.approx(with_sae, abs=1e-4)
            assert metrics["ce_loss_recovered"] == pytest.approx((zero - with_sae) / (zero - clean), abs=1e-3)

    # a layer the model does not have: one line, non-zero exit, no new table
    proc = run_headlab("sae", *args[:3], "sae.layers=[0,3]", f"output.root={tmp_path}", cwd=tmp_path)
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode != 0 and len(lines) == 1 and "sae.layers=3" in lines[0], proc.stderr
    assert len(list(tmp_path.glob("runs/*/*/results.parquet"))) == 1
