"""A metric that reads a few rows of the vocabulary unembeds those rows alone (Task.vocab_rows,
HookedModel.readout_rows): the same numbers as the whole readout, to float rounding, on tiny random models
of three families and on the IOI and prompts tasks' quantities (every peer's)."""

from __future__ import annotations

import pytest
import torch

from headlab.api import load_task
from headlab.config_rules import PEER_CHOICES
from headlab.interventions.readout import read_quantities
from headlab.models.hf import load_hf
from headlab.tasks import TaskData
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


@pytest.mark.parametrize("family", ["gpt2", "llama", "gemma3_text"])
def test_rows_give_the_whole_readouts_quantities(tiny_hf_dir, family):
    model = load_hf(str(tiny_hf_dir(family)), need_tokenizer=False)
    data = answers_data(model.vocab_size)
    h = torch.randn(2 * N, SEQ, model.sites.d_model, generator=torch.Generator().manual_seed(0))
    read = data.positions.repeat(2, 1)
    for task in tasks():
        full = task.per_prompt(model.readout(h, read).unflatten(0, (2, N)), data)
        columns = [c for c in range(full.shape[-1]) if task.quantities[c] not in ("io_prob", "answer_prob")]
        ids = task.vocab_rows(data, columns)
        assert ids is not None and task.vocab_rows(data, range(full.shape[-1])) is None
        rows = task.from_rows(model.readout_rows(h, read, ids.repeat(2, 1)).unflatten(0, (2, N)), data, columns)
        torch.testing.assert_close(rows, full[..., columns], rtol=1e-5, atol=1e-5)


def test_a_sweep_readout_of_a_rows_task_reads_rows_alone(tiny_hf_dir, monkeypatch):
    model = load_hf(str(tiny_hf_dir("llama")), need_tokenizer=False)
    data = answers_data(model.vocab_size)
    task = PromptsTask(PromptsConfig(peer="none"), records=[])
    task.quantities = ("logit_diff",)  # a task whose every quantity reads rows
    h = torch.randn(3 * N, SEQ, model.sites.d_model, generator=torch.Generator().manual_seed(1))
    read = data.positions.repeat(3, 1)
    want = task.per_prompt(model.readout(h, read).unflatten(0, (3, N)), data)[..., :1]
    monkeypatch.setattr(model, "readout", lambda *a: pytest.fail("the whole vocabulary was unembedded"))
    got = read_quantities(model, task, h, read, data, chunk_mb=32.0)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
