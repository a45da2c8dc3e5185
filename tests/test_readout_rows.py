"""A metric that reads a few rows of the vocabulary unembeds those rows alone (Task.vocab_rows,
HookedModel.readout_rows), with the softmax's normaliser a slice of the vocabulary at a time where a
probability needs it (HookedModel.readout_normaliser): the same numbers as the whole readout, to float
rounding, on tiny random models of several families and on the IOI and prompts tasks' quantities (every
peer's). The text task's loss: tests/test_text.py."""

from __future__ import annotations

import pytest
import torch

from headlab.api import load_task
from headlab.config_rules import PEER_CHOICES
from headlab.interventions.readout import read_quantities, rows_quantities
from headlab.models import hooked
from headlab.models.hf import load_hf
from headlab.tasks import Task, TaskData, mean_of
from headlab.tasks.prompts import PromptsConfig, PromptsTask

N, SEQ, P = 6, 9, 1


def answers_data(vocab: int) -> TaskData:
    gen = torch.Generator().manual_seed(3)
    answer = torch.randint(0, vocab, (N, 2), generator=gen)
    wrong = torch.randint(0, vocab, (N, 3), generator=gen)
    answer[0, 1] = -1  # padded lists
    wrong[1, 1:] = -1
    return TaskData(
        inputs={"input_ids": torch.randint(0, vocab, (N, SEQ), generator=gen)},
        positions=torch.randint(2, SEQ, (N, P), generator=gen),
        answers={"answer": answer, "wrong_answer": wrong, "io": answer[:, 0], "s": wrong[:, 0]},
    )


def tasks():
    yield load_task("ioi")
    for peer in PEER_CHOICES:
        if peer != "auto":
            yield PromptsTask(PromptsConfig(peer=peer), records=[])


@pytest.mark.parametrize("family", ["gpt2", "llama", "gemma2", "gemma3_text"])
def test_the_normaliser_a_slice_of_the_vocabulary_at_a_time_is_the_whole_readouts_logsumexp(
    tiny_hf_dir, family, monkeypatch
):
    """gemma2's final softcap included; slices of 1,000 rows (the last one short) and blocks of 5 positions."""
    model = load_hf(str(tiny_hf_dir(family)), need_tokenizer=False)
    monkeypatch.setattr(hooked, "VOCAB_SLICE", 1000)
    h = torch.randn(N, SEQ, model.sites.d_model, generator=torch.Generator().manual_seed(0))
    read = torch.arange(SEQ).expand(N, -1)
    whole = torch.logsumexp(model.readout(h, read), dim=-1)
    torch.testing.assert_close(model.readout_normaliser(h, read, 5), whole, rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("family", ["gpt2", "llama", "gemma3_text"])
def test_rows_give_the_whole_readouts_quantities(tiny_hf_dir, family):
    """Every quantity, the probabilities with the normaliser; any subset of the columns alone."""
    model = load_hf(str(tiny_hf_dir(family)), need_tokenizer=False)
    data = answers_data(model.vocab_size)
    h = torch.randn(2 * N, SEQ, model.sites.d_model, generator=torch.Generator().manual_seed(0))
    read = data.positions.repeat(2, 1)
    for task in tasks():
        full = task.per_prompt(model.readout(h, read).unflatten(0, (2, N)), data)
        every = range(full.shape[-1])
        for columns in (every, [c for c in every if task.needs_normaliser([c])], [len(every) - 1, 0]):
            got = rows_quantities(model, task, h, read, data, columns, chunk_mb=1.0)
            assert got is not None
            torch.testing.assert_close(got, full[..., list(columns)], rtol=1e-5, atol=1e-6)


def test_a_sweep_readout_of_a_rows_task_never_unembeds_the_whole_vocabulary(tiny_hf_dir, monkeypatch):
    model = load_hf(str(tiny_hf_dir("llama")), need_tokenizer=False)
    data = answers_data(model.vocab_size)
    task = PromptsTask(PromptsConfig(peer="none"), records=[])
    h = torch.randn(3 * N, SEQ, model.sites.d_model, generator=torch.Generator().manual_seed(1))
    read = data.positions.repeat(3, 1)
    want = task.per_prompt(model.readout(h, read).unflatten(0, (3, N)), data)
    monkeypatch.setattr(model, "readout", lambda *a: pytest.fail("the whole vocabulary was unembedded"))
    got = read_quantities(model, task, h, read, data, chunk_mb=32.0)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


class TwoRowsDifference(Task):
    """A task of a user's own, as benchmarks/bench_models.py's: from_rows without the normaliser it never
    needs (the signature before the normaliser was added)."""

    name = "two_rows_difference"
    quantities = ("difference",)
    aggregates = {"difference": mean_of(0)}

    def per_prompt(self, logits: torch.Tensor, data: TaskData) -> torch.Tensor:
        return (logits[..., 0, 3] - logits[..., 0, 5]).unsqueeze(-1)

    def vocab_rows(self, data: TaskData, columns) -> torch.Tensor:
        return torch.tensor([3, 5]).expand(data.n, 2)

    def from_rows(self, rows: torch.Tensor, data: TaskData, columns) -> torch.Tensor:
        return (rows[..., 0, 0] - rows[..., 0, 1]).unsqueeze(-1)


def test_a_task_whose_from_rows_takes_no_normaliser_reads_its_rows(tiny_hf_dir):
    model = load_hf(str(tiny_hf_dir("llama")), need_tokenizer=False)
    data, task = answers_data(model.vocab_size), TwoRowsDifference()
    h = torch.randn(2 * N, SEQ, model.sites.d_model, generator=torch.Generator().manual_seed(2))
    read = data.positions.repeat(2, 1)
    want = task.per_prompt(model.readout(h, read).unflatten(0, (2, N)), data)
    torch.testing.assert_close(read_quantities(model, task, h, read, data, chunk_mb=32.0), want, rtol=1e-5, atol=1e-6)
