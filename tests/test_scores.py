"""Head-class scores, checked against computations that do not share their code path: HF's own eager
attention weights, hand-built attention patterns, and the OV circuit rebuilt from the HF weights."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from transformers import AutoModelForCausalLM

from headlab.analysis.scores import (
    IOI_SCORES,
    SEQ_SCORES,
    in_top_k,
    induction_scores,
    ioi_scores,
    repeated_tokens,
    score_table,
)
from headlab.models.hf import load_hf
from headlab.results import LEADING
from headlab.tasks.ioi import IOIConfig, IOITask

NAMES = ["Mary", "John", "Tom", "James", "Alice", "David", "Sarah", "Paul"]
T = 6  # half length of the repeated sequences


@pytest.fixture()
def gpt2(tiny_hf_dir, gpt2_tokenizer):
    """(headlab model, the same weights as a plain eager HF model) on the tiny random GPT-2."""
    path = tiny_hf_dir("gpt2")
    model = load_hf(str(path), need_tokenizer=False)
    model.tokenizer = gpt2_tokenizer
    reference = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").eval()
    return model, reference


@pytest.fixture(scope="module")
def ioi_data(tiny_hf_dir, gpt2_tokenizer):
    task = IOITask(OmegaConf.structured(IOIConfig(names=NAMES, min_names=len(NAMES))))
    model = load_hf(str(tiny_hf_dir("gpt2")), need_tokenizer=False)
    model.tokenizer = gpt2_tokenizer
    return task.build(12, 0, model)


def _eager_attentions(reference, ids) -> list[np.ndarray]:
    with torch.inference_mode():
        return [a.numpy() for a in reference(ids, output_attentions=True).attentions]  # [n, head, q, k] each


def test_repeated_tokens_are_bos_then_two_equal_halves_of_distinct_ordinary_tokens(gpt2):
    model, _ = gpt2
    ids = repeated_tokens(model, 5, T, seed=1)
    assert ids.shape == (5, 1 + 2 * T)
    assert (ids[:, 0] == 50256).all()
    assert torch.equal(ids[:, 1 : 1 + T], ids[:, 1 + T :])
    assert all(len(set(row[1 : 1 + T].tolist())) == T for row in ids)
    assert ((ids[:, 1:] >= 1000) & (ids[:, 1:] < 20000)).all()
    assert not torch.equal(ids, repeated_tokens(model, 5, T, seed=2))


def test_sequence_scores_match_eager_attention_weights(gpt2):
    model, reference = gpt2
    n_seq = 4
    scores = induction_scores(model, n_seq, T, seed=3, batch_size=3).numpy()  # two batches
    assert scores.shape == (3, 4, n_seq, 4)
    ids = repeated_tokens(model, n_seq, T, seed=3)
    for layer, att in enumerate(_eager_attentions(reference, ids)):
        for head in range(4):
            for s in range(n_seq):
                a = att[s, head]
                prev = np.mean([a[i, i - 1] for i in range(2, 1 + 2 * T)])  # key 0 is BOS: left out
                dup = np.mean([a[i, i - T] for i in range(1 + T, 1 + 2 * T)])
                ind = np.mean([a[i, i - T + 1] for i in range(1 + T, 1 + 2 * T)])
                np.testing.assert_allclose(scores[layer, head, s, :3], [prev, dup, ind], atol=1e-6)
                # TransformerLens's normalisation: the same attention over all 2T+1 query rows
                assert scores[layer, head, s, 3] == pytest.approx(ind * T / (2 * T + 1), abs=1e-6)


def test_tl_induction_score_equals_transformerlens_detect_head(gpt2, gpt2_tokenizer):
    """TransformerLens's own detector, on a HookedTransformer holding the same GPT-2 weights, given the
    text of each sequence (its to_tokens prepends the BOS headlab's sequences open with)."""
    tl = pytest.importorskip("transformer_lens")
    from transformer_lens.head_detector import detect_head
    from transformer_lens.pretrained.weight_conversions import convert_gpt2_weights

    model, reference = gpt2
    c = reference.config
    cfg = tl.HookedTransformerConfig(
        n_layers=c.n_layer,
        d_model=c.n_embd,
        n_ctx=c.n_positions,
        d_head=c.n_embd // c.n_head,
        n_heads=c.n_head,
        d_mlp=4 * c.n_embd,
        act_fn="gelu_new",
        d_vocab=c.vocab_size,
        eps=c.layer_norm_epsilon,
        normalization_type="LN",
        original_architecture="GPT2LMHeadModel",
    )
    theirs = tl.HookedTransformer(cfg, tokenizer=gpt2_tokenizer)
    theirs.load_and_process_state_dict(
        convert_gpt2_weights(reference, cfg), fold_ln=False, center_writing_weights=False, center_unembed=False
    )
    t, n_seq = 8, 6
    ids = repeated_tokens(model, n_seq, t, seed=5)
    ours = induction_scores(model, n_seq, t, seed=5)[..., SEQ_SCORES.index("induction_score_tl")]
    compared = 0
    for s in range(n_seq):
        text = gpt2_tokenizer.decode(ids[s, 1:])
        if not torch.equal(theirs.to_tokens(text)[0], ids[s]):
            continue  # a text that tokenizes back otherwise: not the same sequence
        detected = detect_head(theirs, text, "induction_head")  # [layer, head]
        torch.testing.assert_close(ours[:, :, s], detected.float(), atol=1e-4, rtol=0)
        assert detected.max() > 0.01  # random weights: the score is no zero on every head
        compared += 1
    assert compared >= 3


def test_forced_patterns_score_one_inside_the_hook_context(gpt2):
    """Head 0 attends to the previous token, head 1 to i-T+1 and head 2 to i-T in the second half."""
    model, _ = gpt2
    layer = 1

    def force(pattern):
        pos = pattern.shape[-1]
        i = torch.arange(pos)
        second = i >= pos - T
        targets = {0: (i - 1).clamp_min(0), 1: torch.where(second, i - T + 1, i), 2: torch.where(second, i - T, i)}
        pattern = pattern.clone()
        for head, key in targets.items():
            pattern[:, head] = torch.nn.functional.one_hot(key, pos).to(pattern.dtype)
        return pattern

    with model.sites.hooks(layer, pattern=force):
        forced = induction_scores(model, 3, T, seed=0)[layer]  # [head, seq, 3]
    plain = induction_scores(model, 3, T, seed=0)[layer]
    prev, dup, ind, tl = (SEQ_SCORES.index(k) for k in SEQ_SCORES)
    assert (forced[0, :, prev] == 1).all() and (forced[0, :, [dup, ind, tl]] == 0).all()
    assert (forced[1, :, ind] == 1).all() and (forced[1, :, [prev, dup]] == 0).all()
    # TransformerLens counts the BOS row and the first copy's T rows too, which hold no induction target
    torch.testing.assert_close(forced[1, :, tl], torch.full((3,), T / (2 * T + 1)))
    assert (forced[2, :, dup] == 1).all() and (forced[2, :, [prev, ind]] == 0).all()
    torch.testing.assert_close(forced[3], plain[3])  # the untouched head
    assert (plain[:3] < 0.9).all()  # the hook is gone afterwards


def test_ioi_attention_reads_end_row_at_role_positions(gpt2, ioi_data):
    model, reference = gpt2
    scores = ioi_scores(model, ioi_data, batch_size=5).numpy()
    assert scores.shape == (3, 4, ioi_data.n, len(IOI_SCORES))
    pos = {r: ioi_data.token_positions[r].tolist() for r in ("IO", "S1", "S2", "END")}
    assert all(io != s1 != s2 for io, s1, s2 in zip(pos["IO"], pos["S1"], pos["S2"]))
    for layer, att in enumerate(_eager_attentions(reference, ioi_data.inputs["input_ids"])):
        for j, role in enumerate(("IO", "S1", "S2")):
            expected = np.array([[att[i, h, pos["END"][i], pos[role][i]] for i in range(ioi_data.n)] for h in range(4)])
            np.testing.assert_allclose(scores[layer, :, :, j], expected, atol=1e-6)


def _make_copier(gpt2_module, layer: int, head: int, token_ids: list[int], sign: float = 1.0) -> None:
    """Give one head the OV circuit x -> sign * (projection of x onto the span of the names' embeddings)."""
    d = gpt2_module.config.n_embd
    dh = d // gpt2_module.config.n_head
    basis, _ = torch.linalg.qr(gpt2_module.transformer.wte.weight[token_ids].T)  # [d, names]
    q = torch.zeros(d, dh)
    q[:, : basis.shape[1]] = basis
    attn = gpt2_module.transformer.h[layer].attn
    with torch.no_grad():
        cols = slice(2 * d + head * dh, 2 * d + (head + 1) * dh)  # the head's value columns of c_attn
        attn.c_attn.weight[:, cols] = q
        attn.c_attn.bias[cols] = 0
        attn.c_proj.weight[head * dh : (head + 1) * dh] = sign * q.T


def _hand_copy_scores(reference, data) -> np.ndarray:
    """[layer, head, n, 2]: IO in the top 5 of ln_f(+-v W_O) read out, v rebuilt from c_attn and c_proj."""
    ids, io_pos, io = data.inputs["input_ids"], data.token_positions["IO"], data.answers["io"]
    cfg = reference.config
    d, n_head, n = cfg.n_embd, cfg.n_head, len(ids)
    out = np.zeros((cfg.n_layer, n_head, n, 2))
    with torch.inference_mode():
        hidden = reference(ids, output_hidden_states=True).hidden_states  # [i]: input of block i
        for layer, block in enumerate(reference.transformer.h):
            value = block.attn.c_attn(block.ln_1(hidden[layer][torch.arange(n), io_pos]))[:, 2 * d :]
            value = value.reshape(n, n_head, d // n_head)  # GPT-2 splits the value columns head-major
            w_o = block.attn.c_proj.weight.reshape(n_head, d // n_head, d)  # Conv1D weight: [in, out]
            written = (value.unsqueeze(-1) * w_o).sum(-2)  # [n, head, d]
            for k, sign in enumerate((1, -1)):
                top = reference.lm_head(reference.transformer.ln_f(sign * written)).topk(5).indices
                out[layer, :, :, k] = (top == io[:, None, None]).any(-1).T.numpy()
    return out


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_copy_scores_match_hand_built_ov_circuit(gpt2, ioi_data, sign):
    model, reference = gpt2
    names = sorted(set(ioi_data.answers["io"].tolist()) | set(ioi_data.answers["s"].tolist()))
    for module in (model.module, reference):
        _make_copier(module, 0, 1, names, sign)  # a name mover (sign 1) or a negative name mover (-1)
    scores = ioi_scores(model, ioi_data).numpy()[..., 3:]
    np.testing.assert_array_equal(scores, _hand_copy_scores(reference, ioi_data))
    copy, negative = scores[0, 1].mean(0)
    assert (copy, negative) == ((1.0, 0.0) if sign > 0 else (0.0, 1.0))
    assert scores[1:].mean() < 0.1  # random heads rarely rank a name in the top 5 of 50257


def test_copy_scores_read_out_through_the_final_norm(gpt2, ioi_data):
    """A final-norm bias along one name's embedding puts that name in every head's top 5, whatever the
    sign; a readout that skipped the norm would not see it."""
    model, _ = gpt2
    mary = ioi_data.answers["io"][0].item()
    wte = model.module.transformer.wte.weight
    with torch.no_grad():
        model.module.transformer.ln_f.bias.copy_(10 * wte[mary] / wte[mary].norm())
    scores = ioi_scores(model, ioi_data).numpy()[..., 3:]  # [layer, head, n, 2]
    expected = (ioi_data.answers["io"] == mary).float().numpy()
    assert 0 < expected.sum() < ioi_data.n
    np.testing.assert_array_equal(scores, np.broadcast_to(expected[:, None], scores.shape))


@pytest.mark.parametrize("vocab_chunk", [50257, 4096, 777])
def test_in_top_k_counted_over_vocabulary_slices_equals_a_plain_topk(gpt2, vocab_chunk):
    """Rows whose token is the 1st..10th logit and rows with a random token: the slice count must say
    exactly what topk over the whole vocabulary says, row by row."""
    model, reference = gpt2
    torch.manual_seed(1)
    resid = torch.randn(60, reference.config.n_embd) * 3
    with torch.inference_mode():
        logits = reference.lm_head(reference.transformer.ln_f(resid))
        ranked = logits.argsort(-1, descending=True)
        token = torch.randint(0, logits.shape[1], (60,))
        token[:40] = ranked[torch.arange(40), torch.arange(40) % 10]  # rank 1..10
        expected = (logits.topk(5).indices == token[:, None]).any(-1)
        found = in_top_k(model, resid, token, vocab_chunk=vocab_chunk)
    assert expected[:40].sum() == 20 and torch.equal(found, expected)


def test_in_top_k_counts_a_tie_against_the_token(gpt2):
    """A zero output through a bias-free final norm: every logit ties, so no token is in the top 5 (topk
    would keep the first five ids, which are no names either)."""
    model, reference = gpt2
    mary = reference.config.vocab_size - 100
    with torch.inference_mode():
        assert not in_top_k(model, torch.zeros(2, reference.config.n_embd), torch.tensor([mary, mary + 1])).any()


def test_score_table_is_tidy_and_aggregates_the_per_prompt_scores(gpt2, ioi_data):
    model, _ = gpt2
    run = {"experiment": "scores", "model": "tiny-gpt2", "task": "ioi", "seed": 0}
    df = score_table(model, ioi_data, run, n_boot=50, n_seq=5, seq_len=T)
    assert list(df.columns) == LEADING
    assert set(df.metric) == set(SEQ_SCORES + IOI_SCORES)
    assert (df.groupby("metric").size() == 12).all() and (df.method == "score").all()
    assert (df.intervention == "none").all() and df.position.isna().all()
    assert set(df[df.metric.isin(SEQ_SCORES)].n) == {5} and set(df[df.metric.isin(IOI_SCORES)].n) == {ioi_data.n}
    assert ((df.ci_low <= df.value + 1e-12) & (df.value <= df.ci_high + 1e-12)).all()
    per_prompt = ioi_scores(model, ioi_data).numpy()
    row = df[(df.metric == "attn_end_to_s2") & (df.layer == 2) & (df["head"] == 3)]
    assert row.value.item() == pytest.approx(per_prompt[2, 3, :, 2].mean())
    seq = induction_scores(model, 5, T, seed=0).numpy()
    for j, name in enumerate(SEQ_SCORES):
        row = df[(df.metric == name) & (df.layer == 1) & (df["head"] == 0)]
        assert row.value.item() == pytest.approx(seq[1, 0, :, j].mean())
