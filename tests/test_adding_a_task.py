"""README "Adding a task", followed step by step: a task module (a Task subclass), its config dataclass, its
YAML in configs/task/ and its line in the task registry; the task is then listed, loaded by name with its
YAML's defaults and the user's options, and swept like a built-in one. The registry line, the dataclass's
ConfigStore entry and the YAML go into this test's copies of them, not into the package."""

from __future__ import annotations

import shutil
from dataclasses import dataclass

import pytest
import torch
from hydra.core.config_store import ConfigStore
from torch import Tensor

import headlab
from conftest import run_headlab
from headlab.composition import group_options
from headlab.config import TASK_SCHEMAS, TaskConfig, config_dir
from headlab.models.toy import ToyConfig, ToyTransformer, hooked_toy
from headlab.studies.context import EVAL_SEED_OFFSET
from headlab.tasks import Task, TaskData, mean_of
from headlab.tasks import registry as task_registry

VOCAB = 5


# 1. the task's config (config.py): its name and options, defaults for `headlab.load_task`
@dataclass
class FirstTokenConfig(TaskConfig):
    name: str = "first_token"
    length: int = 4


# 2. the task (tasks/first_token.py): prompts, the positions the metrics read, per-prompt quantities,
# and the metrics as functions of those
class FirstTokenTask(Task):
    """Recall the prompt's first token at its last position; the counterfactual changes that token."""

    name = "first_token"
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

    def per_prompt(self, logits: Tensor, data: TaskData) -> Tensor:
        last = logits[..., 0, :]  # [..., n, vocab] at the one position read
        rows = torch.arange(data.n)
        margin = last[..., rows, data.answers["first"]] - last[..., rows, data.answers["wrong"]]
        correct = (last.argmax(-1) == data.answers["first"]).to(last.dtype)
        return torch.stack([margin, correct], -1)


# 3. its YAML (configs/task/first_token.yaml)
YAML = """# Recall the prompt's first token at its last position.
defaults: [base_first_token]
name: first_token
n_prompts: 24
length: 6
"""


@pytest.fixture
def first_token_task(tmp_path, monkeypatch):
    configs = tmp_path / "configs"
    shutil.copytree(config_dir(), configs)
    (configs / "task" / "first_token.yaml").write_text(YAML)
    monkeypatch.setenv("HEADLAB_CONFIG_DIR", str(configs))
    # config.py: the dataclass in TASK_SCHEMAS, which register_configs stores as base_first_token
    monkeypatch.setitem(TASK_SCHEMAS, "first_token", FirstTokenConfig)
    ConfigStore.instance().store(group="task", name="base_first_token", node=FirstTokenConfig)
    # 4. tasks/registry.py: the task's line
    built_in = task_registry.registry
    monkeypatch.setattr(task_registry, "registry", lambda: {**built_in(), "first_token": FirstTokenTask})
    group_options.cache_clear()
    yield tmp_path
    group_options.cache_clear()
    del ConfigStore.instance().repo["task"]["base_first_token.yaml"]


def test_a_task_added_as_the_recipe_says_is_listed_loaded_and_swept(first_token_task):
    listed = run_headlab("list", "task", cwd=first_token_task)
    assert listed.returncode == 0 and "first_token" in listed.stdout.split(), listed.stdout
    task = headlab.load_task("first_token", length=5)
    assert isinstance(task, FirstTokenTask) and isinstance(task.cfg, FirstTokenConfig)
    assert (task.cfg.n_prompts, task.cfg.length) == (24, 5)  # the YAML's default and the user's option

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
