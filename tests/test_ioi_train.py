"""A small GPT-2 trained here on IOI with GPT-2's own tokenizer: held-out names, save_pretrained, resume.

The session fixture trains experiment=ioi_trained's model (shortened) once; the tests share it.
"""

from __future__ import annotations

import json

import pytest
import torch
from omegaconf import OmegaConf

from conftest import GPT2_TOKENIZER
from headlab.errors import HeadlabError

STEPS = 300  # the shortened schedule of the fixture; the full one (>= 95% on held-out names) is
# measured by benchmarks/ioi_trained.py, too slow for a unit test
HELD_OUT_IO_PROB = 0.1  # by now the model copies a never-trained name from its context (chance: 2e-5)


def _cfg(tmp_path, *overrides: str):
    from headlab import compose

    return compose(
        *["experiment=ioi_trained", f"model.tokenizer={GPT2_TOKENIZER}", f"output.root={tmp_path}", *overrides]
    )


def _tiny(tmp_path, *overrides: str):
    """A model too small to learn anything, trained for a few steps: for the checkpoint mechanics only."""
    return _cfg(
        tmp_path,
        "model.n_layers=1",
        "model.n_heads=2",
        "model.d_model=32",
        "model.d_mlp=64",
        "train.steps=6",
        "train.eval_every=3",
        "train.checkpoint_every=3",
        "train.eval_prompts=16",
        "train.target=null",
        *overrides,
    )


@pytest.fixture(scope="session")
def trained_ioi(tmp_path_factory):
    """(in-memory model, task, checkpoint dir, curve) of model=gpt2-ioi trained for STEPS steps."""
    from headlab.tasks import build_task
    from headlab.train import train_toy
    from headlab.train.obtain import checkpoint_dir

    cfg = _cfg(
        tmp_path_factory.mktemp("ioi"),
        f"train.steps={STEPS}",
        "train.target=null",
        "train.eval_every=150",
        "train.eval_prompts=64",
    )
    task = build_task(cfg.task)
    directory = checkpoint_dir(cfg)
    model, curve = train_toy(cfg.model, task, cfg.train, cfg.seed, directory, show_progress=False)
    return model, task, directory, curve, cfg


def test_held_out_names_are_copied_from_the_context(trained_ioi):
    from headlab.train import evaluate_hf

    model, task, _, curve, _ = trained_ioi
    assert not set(task.names("held_out")) & set(task.names("train"))
    data = task.build(300, seed=123)  # eval_names=held_out: both names of every prompt never trained on
    metrics = evaluate_hf(model, task, data)
    assert metrics["io_prob"] >= HELD_OUT_IO_PROB, metrics
    assert sorted({r["step"] for r in curve})[-1] == STEPS


def test_checkpoint_loads_like_a_hub_model_with_the_same_logits(trained_ioi):
    from headlab.models.hf import load_hf

    model, task, directory, _, _ = trained_ioi
    assert json.loads((directory / "training.json").read_text())["complete"] is True
    assert (directory / "model.safetensors").is_file() and (directory / "config.json").is_file()
    hooked = load_hf(str(directory))  # architecture, weights and tokenizer, all from the directory
    assert hooked.tokenizer is not None and len(hooked.tokenizer) == model.config.vocab_size
    assert (hooked.n_layers, hooked.n_heads) == (model.config.n_layer, model.config.n_head)
    ids = task.build(16, seed=7).inputs["input_ids"]
    with torch.inference_mode():
        ours = model(input_ids=ids).logits
        theirs = hooked.forward({"input_ids": ids})
    torch.testing.assert_close(theirs, ours, atol=1e-4, rtol=1e-4)


def test_headlab_train_reuses_the_checkpoint(trained_ioi, tmp_path):
    from headlab.studies import execute_run
    from headlab.tasks import build_task
    from headlab.train.obtain import obtain_model

    model, _, directory, _, cfg = trained_ioi
    stamp = (directory / "training.json").stat().st_mtime_ns
    df = execute_run("train", cfg, tmp_path / "run", show_progress=False)  # finished: reused, not retrained
    assert (directory / "training.json").stat().st_mtime_ns == stamp
    assert {"accuracy", "logit_diff", "loss"} <= set(df["metric"]) and df["step"].max() == STEPS
    task = build_task(cfg.task)
    hooked = obtain_model(cfg, task, show_progress=False)
    assert all(torch.equal(p, hooked.module.state_dict()[n]) for n, p in model.state_dict().items())


def test_resume_matches_uninterrupted_and_half_written_dirs_are_not_done(tmp_path, monkeypatch):
    import headlab.train as train
    from headlab.tasks import build_task
    from headlab.train import hf, loop

    cfg = _tiny(tmp_path)
    task = build_task(cfg.task)
    a, _ = train.train_toy(cfg.model, task, cfg.train, 0, tmp_path / "a", False)
    b, _ = train.train_toy(cfg.model, task, cfg.train, 0, tmp_path / "b", False)
    assert json.loads((tmp_path / "b" / "state" / "state.json").read_text())["step"] == 3
    # killed while writing the finished model: weights and config.json are there, the marker is not
    (tmp_path / "b" / "training.json").unlink()
    resumed = []
    real = loop.load_state
    monkeypatch.setattr(loop, "load_state", lambda *args, **kwargs: resumed.append(1) or real(*args, **kwargs))
    c, curve = train.train_toy(cfg.model, task, cfg.train, 0, tmp_path / "b", False)
    assert resumed and sorted({r["step"] for r in curve}) == [3, 6]
    other, _ = train.train_toy(cfg.model, task, cfg.train, 1, tmp_path / "c", False)
    for name, p in a.state_dict().items():
        assert torch.equal(p, b.state_dict()[name]), name
        assert torch.equal(p, c.state_dict()[name]), name
    assert any(not torch.equal(p, other.state_dict()[n]) for n, p in a.state_dict().items())
    assert c.transformer.wte.weight.data_ptr() == c.lm_head.weight.data_ptr()  # tied, as in GPT-2
    # finished: reused as it is, whatever the schedule says now
    monkeypatch.setattr(hf, "fit_loop", lambda *a, **k: pytest.fail("a finished model was trained again"))
    longer = OmegaConf.merge(cfg.train, {"steps": 99999})
    again, _ = train.train_toy(cfg.model, task, longer, 0, tmp_path / "b", False)
    assert all(torch.equal(p, again.state_dict()[n]) for n, p in a.state_dict().items())


def test_a_model_trained_here_needs_a_tokenizer(tmp_path):
    from headlab.studies import execute_run
    from headlab.tasks import build_task
    from headlab.train.obtain import obtain_model

    cfg = _tiny(tmp_path, "model.tokenizer=null")
    task = build_task(cfg.task)
    with pytest.raises(HeadlabError, match="model.tokenizer"):
        obtain_model(cfg, task, show_progress=False)
    with pytest.raises(HeadlabError, match="model.tokenizer"):
        execute_run("train", cfg, tmp_path / "run", show_progress=False)
