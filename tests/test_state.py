"""Resumable state: a save cut short leaves the previous state whole."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from headlab import io


def test_a_save_cut_before_its_state_json_resumes_whole_from_the_previous_state(tmp_path, monkeypatch):
    where = tmp_path / "state"
    model = nn.Linear(3, 2)
    first = {k: v.clone() for k, v in model.state_dict().items()}
    io.save_state(where, {"model": model, "extra": {"x": torch.ones(2)}}, {"step": 1})
    with torch.no_grad():
        model.weight.add_(1.0)

    def killed(path, data):
        raise KeyboardInterrupt  # the job is killed between the new weights and state.json

    monkeypatch.setattr(io, "atomic_write_bytes", killed)
    with pytest.raises(KeyboardInterrupt):
        io.save_state(where, {"model": model, "extra": {"x": torch.zeros(2)}}, {"step": 2})
    monkeypatch.undo()

    restored = nn.Linear(3, 2)
    tensors, payload = io.load_state(where, "state", modules={"model": restored}, files=["extra"])
    assert payload["step"] == 1
    assert torch.equal(restored.weight, first["weight"]) and torch.equal(tensors["extra"]["x"], torch.ones(2))

    io.save_state(where, {"model": model, "extra": {"x": torch.zeros(2)}}, {"step": 2})
    tensors, payload = io.load_state(where, "state", modules={"model": restored}, files=["extra"])
    assert payload["step"] == 2 and torch.equal(restored.weight, model.weight)
    assert sorted(p.name for p in where.glob("*.safetensors")) == ["extra.2.safetensors", "model.2.safetensors"]


def test_a_training_option_names_its_own_checkpoint():
    from headlab.api import compose_config
    from headlab.train.obtain import checkpoint_dir

    cfg = compose_config([])
    decision = compose_config(["train.loss_positions=decision"])
    assert checkpoint_dir(decision) != checkpoint_dir(cfg)
    assert checkpoint_dir(compose_config(["study=circuit"])) == checkpoint_dir(cfg)  # the study trains nothing else
