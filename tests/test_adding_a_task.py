"""README "Adding a task", followed step by step, in two files outside headlab and no edit of a file of
its: the task's module (its options dataclass and its Task subclass, registered) and its YAML (in the
user's config dir). The task is then listed, loaded by name with its YAML's defaults and the user's
options, refused in one line outside its rules, and swept like a built-in one, from the API and the CLI."""

from __future__ import annotations

import importlib
import os
import shutil
import subprocess
import sys

import pandas as pd
import pytest
import torch

import headlab
from conftest import error_line, run_headlab
from headlab.config import config_dir
from headlab.door import group_options
from headlab.models.toy import ToyConfig, ToyTransformer, hooked_toy
from headlab.studies.context import EVAL_SEED_OFFSET
from headlab.tasks import registry as task_registry

VOCAB = 5

# 1. the task's module: its options (a config right above its class) and the task, registered
MODULE = '''
from dataclasses import dataclass

import torch
from torch import Tensor

from headlab.config_rules import COUNT, setting
from headlab.tasks import Task, TaskData, mean_of
from headlab.tasks.base import TaskConfig
from headlab.tasks.registry import register

VOCAB = 5


@dataclass
class FirstTokenConfig(TaskConfig):
    name: str = "first_token"
    length: int = setting(4, COUNT)


@register
class FirstTokenTask(Task):
    """Recall the prompt's first token at its last position; the counterfactual changes that token."""

    name = "first_token"
    options = FirstTokenConfig
    quantities = ("margin", "correct")
    smooth_quantity = "margin"
    vocab_size = VOCAB  # a vocabulary of its own: it runs on models trained on it (here: a random one)

    def __init__(self, cfg: FirstTokenConfig):
        self.cfg = cfg
        self.max_len = cfg.length
        self.aggregates = {"margin": mean_of(0), "acc": mean_of(1)}

    def build(self, n: int, seed: int, model=None) -> TaskData:
        gen = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, VOCAB, (n, self.cfg.length), generator=gen)
        other = ids.clone()
        other[:, 0] = (ids[:, 0] + 1) % VOCAB
        reference = torch.randint(0, VOCAB, (n, self.cfg.length), generator=gen)
        return TaskData(
            inputs={"input_ids": ids},
            positions=torch.full((n, 1), self.cfg.length - 1),
            answers={"first": ids[:, 0], "wrong": other[:, 0]},
            counterfactual={"input_ids": other},
            reference={"input_ids": reference},
        )

    def train_batch(self, generator, batch: int, step: int = 0) -> tuple[Tensor, Tensor]:
        ids = torch.randint(0, VOCAB, (batch, self.cfg.length), generator=generator)
        targets = torch.full_like(ids, -100)  # the loss only where the task is decided
        targets[:, -1] = ids[:, 0]
        return ids, targets

    def per_prompt(self, logits: Tensor, data: TaskData) -> Tensor:
        last = logits[..., 0, :]  # [..., n, vocab] at the one position read
        rows = torch.arange(data.n)
        margin = last[..., rows, data.answers["first"]] - last[..., rows, data.answers["wrong"]]
        correct = (last.argmax(-1) == data.answers["first"]).to(last.dtype)
        return torch.stack([margin, correct], -1)
'''

# 2. its YAML (configs/task/first_token.yaml of the user's config dir)
YAML = """# Recall the prompt's first token at its last position.
defaults: [base_first_token]
n_prompts: 24
length: 6
"""


@pytest.fixture
def first_token_task(tmp_path, monkeypatch):
    configs, plugins = tmp_path / "configs", tmp_path / "plugins"
    shutil.copytree(config_dir(), configs)
    (configs / "task" / "first_token.yaml").write_text(YAML)
    plugins.mkdir()
    (plugins / "first_token.py").write_text(MODULE)
    monkeypatch.setenv("HEADLAB_CONFIG_DIR", str(configs))
    monkeypatch.setattr(task_registry, "REGISTERED", {})
    monkeypatch.syspath_prepend(str(plugins))
    sys.modules.pop("first_token", None)
    group_options.cache_clear()
    yield tmp_path, importlib.import_module("first_token")
    sys.modules.pop("first_token", None)
    group_options.cache_clear()


def test_a_task_added_as_the_recipe_says_is_listed_loaded_and_swept(first_token_task):
    where, module = first_token_task
    listed = run_headlab("list", "task", cwd=where)
    assert listed.returncode == 0 and "first_token" in listed.stdout.split(), listed.stdout
    task = headlab.load_task("first_token", length=5)
    assert isinstance(task, module.FirstTokenTask) and isinstance(task.cfg, module.FirstTokenConfig)
    assert (task.cfg.n_prompts, task.cfg.length) == (24, 5)  # the YAML's default and the user's option
    with pytest.raises(headlab.UsageError, match=r"task.length=0: expected an integer >= 1"):
        headlab.load_task("first_token", length=0)

    torch.manual_seed(0)
    model = hooked_toy(ToyTransformer(ToyConfig(vocab_size=VOCAB, n_ctx=8, n_layers=2, n_heads=2)).eval(), "toy")
    table = headlab.sweep(model, task, ablate="heads")
    data = task.build(24, seed=EVAL_SEED_OFFSET, model=model)
    clean = table[table["intervention"] == "none"].set_index("metric")["value"]
    with torch.no_grad():
        expected = task.evaluate_logits(model.forward(data.inputs), data)
    assert clean.to_dict() == pytest.approx(expected, abs=1e-5)
    heads = table[table["intervention"] == "ablate_head"]
    assert sorted(set(zip(heads["layer"], heads["head"]))) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert set(heads["metric"]) == {"margin", "acc"} and (heads["task"] == "first_token").all()


def test_a_task_added_outside_headlab_runs_from_the_cli(first_token_task):
    where, _ = first_token_task
    bad = run_headlab("run", "task=first_token", "task.length=0", f"output.root={where / 'bad'}", cwd=where)
    assert bad.returncode == 2 and "task.length=0" in error_line(bad)
    env = {**os.environ, "HEADLAB_PLUGINS": "first_token", "PYTHONPATH": str(where / "plugins")}
    args = ["task=first_token", "train.steps=20", "train.eval_every=10", "output.n_boot=0", f"output.root={where}"]
    proc = subprocess.run(
        [sys.executable, "-m", "headlab", "run", *args, f"hydra.run.dir={where / 'r'}"],
        cwd=where, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    table = pd.read_parquet(where / "r" / "results.parquet")
    assert set(table["task"]) == {"first_token"} and {"none", "ablate_head"} <= set(table["intervention"])
