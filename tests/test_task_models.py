"""A task brings its own default model when the configured one cannot serve it; a task refuses a model
it cannot run on, before any work, in one line."""

from __future__ import annotations

import shutil

import pytest

import headlab
from conftest import GPT2_TOKENIZER, error_line, run_headlab
from headlab.task_models import choose_model


@pytest.fixture
def offline_cache(tmp_path, monkeypatch):
    """An empty Hugging Face cache and no hub: nothing can be downloaded."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    return tmp_path / "hub"


def _cache_tokenizer(cache, repo: str = "gpt2"):
    """The real GPT-2 tokenizer files laid out as the hub cache keeps a download of `repo`."""
    if not GPT2_TOKENIZER.is_dir():
        pytest.skip(f"GPT-2 tokenizer not found at {GPT2_TOKENIZER}")
    snapshot = cache / f"models--{repo}" / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True)
    (cache / f"models--{repo}" / "refs").mkdir()
    (cache / f"models--{repo}" / "refs" / "main").write_text("0" * 40)
    for f in GPT2_TOKENIZER.iterdir():
        shutil.copy(f, snapshot / f.name)
    return snapshot


def test_tasks_the_toy_model_serves_keep_it():
    assert choose_model(["task=counting"]) == (["task=counting"], None)
    assert choose_model(["task=ioi", "model=gpt2-ioi"]) == (["task=ioi", "model=gpt2-ioi"], None)


def test_ioi_runs_on_gpt2_where_it_can_be_had_else_on_the_model_trained_here(offline_cache):
    with pytest.raises(headlab.UsageError, match=r"^task=ioi needs a pretrained model .* none of gpt2, gpt2-ioi"):
        choose_model(["task=ioi", "ablate=heads"])
    snapshot = _cache_tokenizer(offline_cache)  # the tokenizer alone: GPT-2's weights are still missing
    chosen, note = choose_model(["task=ioi", "ablate=heads"])
    assert chosen == ["task=ioi", "ablate=heads", "model=gpt2-ioi", "train=ioi", "task.train_names=vocab"]
    assert note is not None and note.startswith("task=ioi runs on gpt2-ioi") and "model=" in note
    (snapshot / "config.json").write_text("{}")  # now GPT-2 small itself is in the cache
    chosen, note = choose_model(["task=ioi"])
    assert chosen == ["task=ioi", "model=gpt2"] and note is not None and note.startswith("task=ioi runs on gpt2 ")
    chosen, note = choose_model(["task=ioi", "model.path=x"])  # the user chose: nothing is added
    assert chosen == ["task=ioi", "model.path=x"] and note is None


def test_a_task_refuses_a_model_it_cannot_run_on(tiny_hf_dir, gpt2_tokenizer, demo_root, tmp_path):
    proc = run_headlab(
        "run", "model=hf", f"model.path={tiny_hf_dir('gpt2')}", f"model.tokenizer={GPT2_TOKENIZER}", cwd=tmp_path
    )
    line = error_line(proc)
    assert proc.returncode == 2 and "task counting has its own 7-token vocabulary and model" in line
    assert len(line) < 200 and not list(tmp_path.rglob("results.parquet"))
    proc = run_headlab("run", "task=ioi", "model=toy-attn-1l", f"output.root={demo_root}", cwd=tmp_path)
    line = error_line(proc)
    assert proc.returncode == 2 and line.startswith("error: task ioi encodes words with a model's tokenizer")
    model = headlab.load_model("toy-attn-1l", root=str(demo_root))
    with pytest.raises(headlab.UsageError, match="task ioi encodes words"):
        headlab.sweep(model, headlab.load_task("ioi"))


def test_head_scores_run_on_any_task_and_leave_the_ioi_scores_out_where_there_are_no_ioi_roles(demo_root):
    model = headlab.load_model("toy-attn-1l", root=str(demo_root))
    table = headlab.sweep(model, headlab.load_task("counting", n_prompts=32), ablate="none", head_scores=True)
    scores = table[table["method"] == "score"]
    assert set(scores["metric"]) == {"prev_token_score", "duplicate_token_score", "induction_score"}
    assert len(scores) == 3 * model.n_heads and scores["value"].between(0, 1).all()


def test_a_sweep_keeps_its_overrides_for_hydra():
    assert choose_model(["ablate.method=zero,mean"]) == (["ablate.method=zero,mean"], None)
    assert choose_model(["task=ioi,counting"]) == (["task=ioi,counting"], None)
