"""task=text: next-token loss over your documents, checked against a plain Hugging Face forward pass."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest
import torch
import torch.nn.functional as F

import headlab
from conftest import GPT2_TOKENIZER, error_line, run_headlab
from headlab.errors import HeadlabError, UsageError
from headlab.interventions.edits import Sources
from headlab.interventions.engine import execute
from headlab.interventions.plan import CLEAN, Intervention
from headlab.models.hf import load_hf
from headlab.vocabulary import Site, Source

SEQ_LEN = 24
DOCS = [
    "The cat sat on the mat and looked around the quiet room for a while.",
    "",
    "Hello",  # one token: it predicts nothing and is left out
    "Attention heads move information between positions; some of them copy the previous token, others look "
    "back for an earlier copy of the current one and predict what came after it.",  # cut to SEQ_LEN tokens
    "Short one here.",
    "   ",
    "Mary and John went to the store, and John gave a drink to Mary.",
    "Numbers: 1, 2, 3, 4, 5.",
]
# where z enters the attention output projection, and the MLP, in each family's blocks
MODULES = {
    "gpt2": ("transformer.h", "attn.c_proj", "mlp"),
    "llama": ("model.layers", "self_attn.o_proj", "mlp"),
    "gemma3_text": ("model.layers", "self_attn.o_proj", "mlp"),
}


def _get(root, dotted: str):
    for part in dotted.split("."):
        root = getattr(root, part)
    return root


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("text") / "corpus.txt"
    path.write_text("\n".join(DOCS) + "\n")
    return path


def _documents(tokenizer) -> list[list[int]]:
    """Each usable line's tokens (the tokenizer's defaults), cut to SEQ_LEN."""
    docs = [tokenizer(line)["input_ids"][:SEQ_LEN] for line in DOCS if line.strip()]
    return [d for d in docs if len(d) >= 2]


def _hf_losses(model_dir: Path, family: str, docs: list[list[int]], method: str) -> dict[tuple, float]:
    """Mean next-token loss per ablation, from a plain eager HF model with forward hooks: one unpadded
    forward pass per document; z is the input of the output projection, a head its slice; mean
    ablation's mean is over every token of every document."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager").eval()
    blocks_at, proj_at, mlp_at = MODULES[family]
    blocks = list(_get(hf, blocks_at))
    projs, mlps = [_get(b, proj_at) for b in blocks], [_get(b, mlp_at) for b in blocks]
    n_heads = hf.config.num_attention_heads
    d_head = getattr(hf.config, "head_dim", None) or hf.config.hidden_size // n_heads

    def mean_loss() -> float:
        total, count = 0.0, 0
        with torch.no_grad():
            for ids in docs:
                x = torch.tensor([ids])
                logits = hf(x).logits[0, :-1].double()
                total += F.cross_entropy(logits, x[0, 1:], reduction="sum").item()
                count += len(ids) - 1
        return total / count

    z_seen: dict[int, list[torch.Tensor]] = {layer: [] for layer in range(len(blocks))}
    mlp_seen: dict[int, list[torch.Tensor]] = {layer: [] for layer in range(len(blocks))}
    handles = [p.register_forward_pre_hook(lambda _m, a, l=l: z_seen[l].append(a[0][0])) for l, p in enumerate(projs)]
    handles += [m.register_forward_hook(lambda _m, _a, o, l=l: mlp_seen[l].append(o[0])) for l, m in enumerate(mlps)]
    clean = mean_loss()
    for h in handles:
        h.remove()
    z_mean = {l: torch.cat(z).mean(0) for l, z in z_seen.items()}
    mlp_mean = {l: torch.cat(o).mean(0) for l, o in mlp_seen.items()}

    def with_heads(layer: int, heads: list[int]) -> float:
        def edit(_module, args):
            z = args[0].clone()
            for h in heads:
                cols = slice(h * d_head, (h + 1) * d_head)
                z[..., cols] = 0.0 if method == "zero" else z_mean[layer][cols]
            return (z, *args[1:])

        handle = projs[layer].register_forward_pre_hook(edit)
        try:
            return mean_loss()
        finally:
            handle.remove()

    def without_mlp(layer: int) -> float:
        replace = lambda _m, _a, out: torch.zeros_like(out) if method == "zero" else mlp_mean[layer].expand_as(out)  # noqa: E731
        handle = mlps[layer].register_forward_hook(replace)
        try:
            return mean_loss()
        finally:
            handle.remove()

    out: dict[tuple, float] = {("none", -1, -1): clean}
    for layer in range(len(blocks)):
        for head in range(n_heads):
            out[("ablate_head", layer, head)] = with_heads(layer, [head])
        out[("ablate_layer", layer, -1)] = with_heads(layer, list(range(n_heads)))
        out[("ablate_mlp", layer, -1)] = without_mlp(layer)
    return out


def _losses(table: pd.DataFrame) -> dict[tuple, float]:
    rows = table[table.metric == "ce_loss"]
    key = zip(rows.intervention, rows.layer.fillna(-1).astype(int), rows["head"].fillna(-1).astype(int))
    return dict(zip(key, rows.value))


@pytest.mark.parametrize("family", ["gpt2", "llama", "gemma3_text"])
@pytest.mark.parametrize("method", ["zero", "mean"])
def test_text_loss_equals_plain_hf_forward_with_hooks(family, method, tiny_hf_dir, gpt2_tokenizer, corpus):
    model_dir = tiny_hf_dir(family)
    task = headlab.load_task("text", path=str(corpus), seq_len=SEQ_LEN)
    model = headlab.load_model(str(model_dir), task=task, tokenizer=str(GPT2_TOKENIZER))
    table = headlab.sweep(model, task, ablate="components", method=method, mean_over="tokens", n_boot=20)
    ours = _losses(table)
    expected = _hf_losses(model_dir, family, _documents(gpt2_tokenizer), method)
    assert set(ours) == set(expected)
    gaps = {k: abs(ours[k] - expected[k]) for k in expected}
    assert max(gaps.values()) < 1e-5, sorted(gaps.items(), key=lambda kv: -kv[1])[:3]
    # the ablations matter: the comparison is not between numbers that all sit at the clean loss
    assert max(abs(v - expected[("none", -1, -1)]) for v in expected.values()) > 1e-3
    assert (table.loc[table.metric == "ce_loss", "n"] == len(_documents(gpt2_tokenizer))).all()


def test_padding_does_not_change_a_documents_loss(tiny_hf_dir, tmp_path):
    model = load_hf(str(tiny_hf_dir("llama")), tokenizer=str(GPT2_TOKENIZER))
    short, longer = DOCS[4], [DOCS[0], DOCS[3]]
    (tmp_path / "alone.txt").write_text(short + "\n")
    (tmp_path / "batch.txt").write_text("\n".join([longer[0], short, longer[1]]) + "\n")
    ivs = [CLEAN, Intervention("ablate_head", "zero", 1, 2), Intervention("ablate_layer", "zero", 0)]
    quantities = {}
    for name in ("alone", "batch"):
        task = headlab.load_task("text", path=str(tmp_path / f"{name}.txt"), seq_len=SEQ_LEN)
        data = task.build(0, seed=0, model=model)
        quantities[name] = execute(model, task, data, ivs)
    alone, in_batch = quantities["alone"][:, 0], quantities["batch"][:, 1]
    assert int(alone[0, 1]) == 3  # "Short one here." is 4 GPT-2 tokens, 3 of them predicted
    torch.testing.assert_close(in_batch, alone, atol=1e-5, rtol=0)


def test_the_loss_is_read_from_the_targets_rows_and_the_normaliser_never_the_whole_vocabulary(
    tiny_hf_dir, corpus, monkeypatch
):
    """A sweep's loss sums (from each position's target row and the softmax's normaliser, a slice of the
    vocabulary at a time, a few positions at a time under a small budget) equal cross_entropy's over the whole
    readout's logits, padded positions not counted; the whole vocabulary is never unembedded."""
    model = load_hf(str(tiny_hf_dir("llama")), tokenizer=str(GPT2_TOKENIZER))
    task = headlab.load_task("text", path=str(corpus), seq_len=SEQ_LEN)
    data = task.build(0, seed=0, model=model)
    assert (data.answers["target"] == -100).any()  # documents of several lengths: padding read
    ivs = [CLEAN, Intervention("ablate_head", "zero", 1, 2), Intervention("ablate_layer", "mean", 0)]
    trace = model.trace(data.inputs)
    whole = task.per_prompt(model.readout(trace.resid_final, data.positions), data)
    made = model.readout
    monkeypatch.setattr(model, "readout", lambda *a: pytest.fail("the whole vocabulary was unembedded"))
    swept = execute(model, task, data, ivs, chunk_mb=0.05)
    torch.testing.assert_close(swept[0], whole, atol=1e-4, rtol=1e-6)
    assert torch.equal(swept[0, :, 1], (data.answers["target"] != -100).sum(-1).float())
    monkeypatch.setattr(model, "readout", made)
    monkeypatch.setattr(task, "vocab_rows", lambda *a: None)  # the interventions' losses from whole logits
    torch.testing.assert_close(swept, execute(model, task, data, ivs, chunk_mb=64.0), atol=1e-4, rtol=1e-6)
    assert swept[1:, :, 0].sub(whole[:, 0]).abs().amin(-1).gt(1e-3).all()  # both edits change the loss


def test_a_directory_is_one_document_per_txt_file_in_name_order(tiny_hf_dir, gpt2_tokenizer, tmp_path):
    model = load_hf(str(tiny_hf_dir("gpt2")), tokenizer=str(GPT2_TOKENIZER))
    (tmp_path / "b.txt").write_text("The second document,\nover two lines.\n")
    (tmp_path / "a.txt").write_text("The first one.")
    (tmp_path / "notes.md").write_text("Not a document.")
    data = headlab.load_task("text", path=str(tmp_path)).build(0, seed=0, model=model)
    texts = ["The first one.", "The second document,\nover two lines.\n"]
    for ids, mask, text in zip(data.inputs["input_ids"], data.inputs["attention_mask"], texts):
        assert ids[mask.bool()].tolist() == gpt2_tokenizer(text)["input_ids"]
    assert data.n == 2 and data.positions.shape == (2, data.inputs["input_ids"].shape[1] - 1)


def test_mean_over_positions_ignores_padding_and_tokens_pools_every_real_token(tiny_hf_dir, corpus):
    model = load_hf(str(tiny_hf_dir("gpt2")), tokenizer=str(GPT2_TOKENIZER))
    task = headlab.load_task("text", path=str(corpus), seq_len=SEQ_LEN)
    data = task.build(0, seed=0, model=model)
    mask = data.inputs["attention_mask"]
    assert (mask.sum(1) < mask.shape[1]).any()  # some documents are padded
    # each document's z alone, unpadded
    alone = [
        model.record({"input_ids": ids[m.bool()].unsqueeze(0)}, Site.z)
        for ids, m in zip(data.inputs["input_ids"], mask)
    ]
    for mean_over in ("positions", "tokens"):
        sources = Sources(model, data, {(Source.mean, Site.z)}, mean_over=mean_over)
        for layer in range(model.n_layers):
            means = sources.values[(Source.mean, Site.z)][layer][0]  # [pos, head, d_head]
            per_doc = [rec[layer][0] for rec in alone]
            if mean_over == "tokens":
                pooled = torch.cat(per_doc).mean(0)
                expected = pooled.expand(mask.shape[1], *pooled.shape)
            else:
                expected = torch.stack(
                    [torch.stack([z[p] for z in per_doc if len(z) > p]).mean(0) for p in range(mask.shape[1])]
                )
            torch.testing.assert_close(means, expected, atol=1e-6, rtol=0)


def test_bad_text_inputs_give_one_line(tiny_hf_dir, tmp_path):
    model = load_hf(str(tiny_hf_dir("gpt2")), tokenizer=str(GPT2_TOKENIZER))
    (tmp_path / "empty").mkdir()
    (tmp_path / "short.txt").write_text("\nHello\n   \nA\n")
    cases = {
        "does not exist": tmp_path / "missing.txt",
        "holds no .txt file": tmp_path / "empty",
        "has 2 tokens or more": tmp_path / "short.txt",
    }
    for words, path in cases.items():
        with pytest.raises(HeadlabError) as e:
            headlab.load_task("text", path=str(path)).build(0, seed=0, model=model)
        assert words in str(e.value) and "\n" not in str(e.value)
    (tmp_path / "long.txt").write_text(" ".join(["word"] * 300) + "\n")
    with pytest.raises(UsageError, match="exceed the model's 128 positions"):
        headlab.load_task("text", path=str(tmp_path / "long.txt"), seq_len=300).build(0, seed=0, model=model)
    with pytest.raises(UsageError, match="needs task.path"):
        headlab.load_task("text").build(0, seed=0, model=model)
    with pytest.raises(UsageError, match=r"task.seq_len=1: expected an integer >= 2"):
        headlab.load_task("text", path=str(tmp_path / "short.txt"), seq_len=1)
    untokenized = load_hf(str(tiny_hf_dir("gpt2")), need_tokenizer=False)
    with pytest.raises(HeadlabError, match="tokenizer") as e:
        headlab.sweep(untokenized, headlab.load_task("text", path=str(tmp_path / "short.txt")), ablate="heads")
    assert "\n" not in str(e.value)


def test_cli_text_run_writes_the_table_and_a_bad_path_writes_nothing(tiny_hf_dir, corpus, tmp_path):
    model = ["model=hf", f"model.path={tiny_hf_dir('gpt2')}", f"model.tokenizer={GPT2_TOKENIZER}"]
    sweep = ["ablate=heads", "ablate.method=mean", "ablate.mean_over=tokens", "output.n_boot=20"]
    missing = tmp_path / "missing.txt"
    proc = run_headlab("run", *model, "task=text", f"task.path={missing}", *sweep, cwd=tmp_path)
    assert proc.returncode != 0
    assert "does not exist" in error_line(proc)
    assert not list(tmp_path.rglob("results.*"))

    proc = run_headlab("run", *model, "task=text", f"task.path={corpus}", "task.seq_len=16", *sweep, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    (table_path,) = tmp_path.rglob("results.csv")
    table = pd.read_csv(table_path)
    loss = table[table.metric == "ce_loss"]
    assert len(loss) == 1 + 3 * 4 and set(loss.task) == {"text"} and set(loss.method) >= {"mean"}
    assert (loss.ci_low <= loss.ci_high).all() and loss.ci_low.notna().all()
