"""Logits are never held at every read position of every prompt at once (issue 45): readouts, the joint
ablations' losses, the mean of the heads' logits and the logit lens read a slice at a time, and give what
the whole readout gives (to 1e-5), on a tiny random Gemma 3 (its tied 50,257-token unembedding); the atlas
cards' received attention has a column per token the prompts hold, not per token of the vocabulary."""

from __future__ import annotations

import pytest
import torch

from headlab.analysis.attention_stats import attention_profile, logit_lens_top
from headlab.analysis.heads import mean_head_logits
from headlab.analysis.induction import RepeatLoss, repeat_data, zero_heads
from headlab.analysis.sinks import real_tokens
from headlab.interventions.engine import execute, execute_joint
from headlab.interventions.plan import CLEAN, Intervention
from headlab.interventions.readout import in_slices
from headlab.models import hooked
from headlab.models.hf import load_hf
from headlab.tasks import TaskData
from headlab.tasks.text import IGNORE, TextConfig, TextTask

N, SEQ = 5, 12


@pytest.fixture(scope="module")
def model(tiny_hf_dir):
    return load_hf(str(tiny_hf_dir("gemma3_text")), need_tokenizer=False)


def row_mb(model) -> float:
    """One read position's float32 logits, in MB."""
    return model.vocab_size * 4 / 2**20


def text_data(vocab: int) -> TaskData:
    """N documents of SEQ tokens, the last two right-padded, every real token after the first read."""
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (N, SEQ), generator=gen)
    mask = torch.ones(N, SEQ, dtype=torch.long)
    mask[-2:, SEQ - 4 :] = 0
    target = ids[:, 1:].masked_fill(mask[:, 1:] == 0, IGNORE)
    return TaskData(
        inputs={"input_ids": ids, "attention_mask": mask},
        positions=torch.arange(SEQ - 1).expand(N, -1).contiguous(),
        answers={"target": target},
        reference={"input_ids": ids.roll(1, 0), "attention_mask": mask.roll(1, 0)},
    )


def logged_readout(model, monkeypatch) -> list[int]:
    """The number of logits each readout makes from now on."""
    made: list[int] = []
    readout = model.readout

    def logged(h, positions):
        logits = readout(h, positions)
        made.append(logits.numel())
        return logits

    monkeypatch.setattr(model, "readout", logged)
    return made


def test_text_loss_never_holds_a_documents_logits(model, monkeypatch):
    """A budget of two positions' logits: the sweep (clean run included) and the naive loop never unembed the
    whole vocabulary; the normaliser's slices hold at most the budget's logits, and the losses equal those of
    one whole readout per copy."""
    task, data = TextTask(TextConfig(seq_len=SEQ)), text_data(model.vocab_size)
    ivs = [CLEAN, *(Intervention("ablate_head", "zero", layer, head) for layer in (0, 2) for head in range(4))]
    budget = 2 * row_mb(model)
    held: list[int] = []
    normaliser = model.readout_normaliser

    def logged(h, positions, rows_at_once):
        held.append(min(rows_at_once, positions.numel()) * min(hooked.VOCAB_SLICE, model.vocab_size))
        return normaliser(h, positions, rows_at_once)

    monkeypatch.setattr(model, "readout_normaliser", logged)
    monkeypatch.setattr(model, "readout", lambda *a: pytest.fail("the whole vocabulary was unembedded"))
    fast = execute(model, task, data, ivs, chunk_mb=budget)
    naive = execute(model, task, data, ivs, naive=True, chunk_mb=budget)
    assert held and max(held) * 4 <= budget * 2**20
    monkeypatch.undo()
    monkeypatch.setattr(task, "vocab_rows", lambda *a: None)  # whole logits, one readout a copy
    whole = execute(model, task, data, ivs, naive=True, chunk_mb=1e6)
    torch.testing.assert_close(fast, whole, atol=1e-5, rtol=1e-6)
    torch.testing.assert_close(naive, whole, atol=1e-5, rtol=1e-6)
    with torch.inference_mode():  # the clean run, unchunked, by hand
        clean = task.per_prompt(model.readout(model.forward_blocks(data.inputs), data.positions), data)
    # losses near 120 here: float32 rounding of a plain pass against the sweep's is a few ulps (1.9e-7 of
    # the value seen on this machine's BLAS), so relative as well
    torch.testing.assert_close(fast[0], clean, atol=1e-5, rtol=1e-6)


def test_repeat_loss_of_ablated_heads_is_read_a_sequence_at_a_time(model, monkeypatch):
    """The induction probe's joint ablations (execute_joint) on less than one sequence's logits read one
    sequence at a time and give the whole readout's repeat losses."""
    t = 6
    half = torch.randint(0, model.vocab_size, (4, t), generator=torch.Generator().manual_seed(2))
    data = repeat_data(torch.cat([half, half], 1), t)
    groups = [[], zero_heads([(1, 0), (2, 3)], ""), zero_heads([(0, 1)], "")]
    made = logged_readout(model, monkeypatch)
    sliced = execute_joint(model, RepeatLoss(), data, groups, chunk_mb=row_mb(model))
    assert max(made) == data.positions.shape[1] * model.vocab_size  # one sequence's reads
    monkeypatch.undo()
    whole = execute_joint(model, RepeatLoss(), data, groups, chunk_mb=1e6)
    torch.testing.assert_close(sliced, whole, atol=1e-5, rtol=0)


def test_mean_head_logits_are_averaged_a_slice_of_prompts_at_a_time(model, monkeypatch):
    """The uniform sweep's mean of the heads' logits reads every head's logits for a slice of the prompts
    at a time (the budget over the heads), and equals the mean of each head's whole logits."""
    task, data = TextTask(TextConfig(seq_len=SEQ)), text_data(model.vocab_size)
    layer = 1
    made = logged_readout(model, monkeypatch)
    sliced = mean_head_logits(model, task, data, layer, chunk_mb=4 * 2 * (SEQ - 1) * row_mb(model))
    assert max(made) == 2 * (SEQ - 1) * model.vocab_size  # two prompts, for each of the 4 heads
    monkeypatch.undo()
    whole = mean_head_logits(model, task, data, layer, chunk_mb=1e6)
    torch.testing.assert_close(sliced, whole, atol=1e-5, rtol=0)
    keep = [Intervention("keep_head", "zero", layer, head) for head in range(model.n_heads)]
    per_head = execute_joint(model, task, data, [[iv] for iv in keep], chunk_mb=1e6)  # each head alone
    assert not torch.allclose(whole, per_head.mean(0))  # the mean of the logits, not of the losses


def test_slices_of_rows_give_the_whole_readout(model):
    """in_slices (the teacher-forced retrieval's argmax) equals the whole readout's, row by row."""
    h = torch.randn(N, SEQ, model.sites.d_model, generator=torch.Generator().manual_seed(3))
    read = torch.tensor([[1, 4, 7]]).expand(N, -1)
    with torch.inference_mode():
        whole = model.readout(h, read)
        sliced = in_slices(model, h, read, 2 * 3 * row_mb(model), lambda _, logits: logits)
        argmax = in_slices(model, h, read, 3 * row_mb(model), lambda _, logits: logits.argmax(-1))
    torch.testing.assert_close(sliced, whole, atol=1e-5, rtol=0)
    assert torch.equal(argmax, whole.argmax(-1))


def test_logit_lens_reads_the_vocabulary_in_slices(model, monkeypatch):
    """The atlas cards' logit lens, 1,000 tokens at a time, finds the top tokens and logits of the whole
    readout of every vector."""
    monkeypatch.setattr(model, "tokenizer", None)  # every row of the unembedding names a token
    vectors = torch.randn(9, model.sites.d_model, generator=torch.Generator().manual_seed(4))
    values, ids = logit_lens_top(model, vectors, 8, columns=1000)
    with torch.no_grad():
        whole = model.unembed(model.final_norm(vectors)).float().topk(8, dim=-1)
    torch.testing.assert_close(values, whole.values, atol=1e-5, rtol=0)
    assert torch.equal(ids, whole.indices)


def test_received_attention_has_a_column_per_token_the_prompts_hold(model):
    """The atlas cards' received attention keeps a column per token id the prompts hold (`tokens`), not per id
    of the vocabulary; put back in place, it is each id's mass summed over every real query, by hand."""
    data = text_data(model.vocab_size)
    profile = attention_profile(model, data, batch_size=2)
    ids, real = data.inputs["input_ids"], real_tokens(data)
    assert torch.equal(profile.tokens, torch.unique(ids)) and profile.received.shape[1] == len(profile.tokens)
    with torch.inference_mode():
        patterns = model.record(data.inputs, "pattern")
    expected = torch.zeros(model.n_layers * model.n_heads, int(ids.max()) + 1, dtype=torch.float64)
    for layer, pattern in patterns.items():
        mass = (pattern.float() * real[:, None, :, None]).sum(2)  # [n, head, key]: from real queries
        block = expected[layer * model.n_heads : (layer + 1) * model.n_heads]
        block.index_add_(1, ids.flatten(), mass.permute(1, 0, 2).flatten(1).double())
    torch.testing.assert_close(profile.received, expected[:, profile.tokens], atol=1e-5, rtol=0)
    assert not expected.index_fill(1, profile.tokens, 0).any()  # no mass on an id the prompts do not hold
