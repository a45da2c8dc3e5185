"""What every run shares: the root config (run, output, engine), the cache key, and the hand-off of each
room's options to Hydra's ConfigStore.

Each task, study, model source and SAE architecture declares its options as a dataclass in its own module
and its room hands it to the door (ROOMS below; the door makes the ConfigStore entry
`<group>/base_<name>`); each configs/<group>/<name>.yaml starts with `defaults: [base_<name>]`, so an
unknown key or a value of the wrong type fails at composition, and each field's rule (config_rules.setting)
is checked by the door.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf

from .config_rules import MEMORY, NATURAL, POSITIVE, RUN_NAME, Range, setting

GROUPS = ("study", "model", "task", "ablate", "patch", "train", "sae", "experiment")

# A run's cache key holds this version: when what an option means, or what a study computes, changes,
# the version moves (CHANGELOG.md says so) and every run and checkpoint is recomputed once.
CACHE_VERSION = 4


def config_dir() -> Path:
    """configs/ of a source checkout, else the copy packaged inside the wheel."""
    env = os.environ.get("HEADLAB_CONFIG_DIR")
    if env:
        return Path(env).resolve()
    here = Path(__file__).resolve()
    for candidate in (here.parents[2] / "configs", here.parent / "configs"):
        if (candidate / "config.yaml").is_file():
            return candidate
    raise FileNotFoundError("headlab: configs/ not found (set HEADLAB_CONFIG_DIR)")


# The rooms that declare options: each module defines options() -> [(group, name, options dataclass)] (a
# registry's covers what was registered into it: a plugin's task or study), and the studies' room also the
# short forms that name a study (forms()). The door imports them and hands each options dataclass to
# Hydra's ConfigStore as `<group>/base_<name>` before it composes.
ROOMS = (
    "headlab.models.loading",
    "headlab.models.pathnet",
    "headlab.tasks.registry",
    "headlab.studies.registry",
    "headlab.interventions.options",
    "headlab.train.options",
    "headlab.sae.registry",
)


@dataclass
class EngineConfig:
    # Size of the widest activation in one batched pass of stacked interventions: tokens x max(d_model,
    # d_mlp) floats, or, where the attention runs eagerly (a pattern edit, a suffix of positions, a
    # softcap) at long sequences, its scores and pattern, 2 x heads x queries x keys floats
    # (edits.copy_bytes). Small enough to stay in cache beats large batches on CPUs
    # (benchmarks/sweep_speed.py).
    chunk_mb: float = setting(32.0, POSITIVE)
    # on a GPU, chunks are sized from its free memory instead: this share of it, after the clean caches
    gpu_memory_share: float = setting(0.5, Range(0, 1, low_open=True))
    naive: bool = False  # one full forward pass per intervention (the reference implementation)
    # a host-memory budget (512MB, 8GB) the run keeps (a pretrained model): its plan (planning.py) is made
    # before loading, chunk_mb lowered until the predicted peak fits planning.BUDGET_SHARE of it, and a run that
    # cannot fit is refused
    # in one line naming the least budget it needs; null: no budget
    max_memory: str | None = setting(None, MEMORY)


@dataclass
class OutputConfig:
    root: str = "outputs"
    per_prompt: bool = False
    n_boot: int = setting(1000, NATURAL)  # 0: no bootstrap interval
    print_rows: int = setting(24, NATURAL)
    figures: str | None = None  # draw this figure set (e.g. ioi) from the run's table into <run>/figures


@dataclass
class Config:
    """The root: each group's node is the dataclass its option registered (a task's, a study's, ...), so
    its type is known only once composed."""

    model: Any = MISSING  # models/loading.py's ModelConfig, or models/pathnet.py's PathNetConfig
    task: Any = MISSING  # tasks/<task>.py's options (tasks/base.py: TaskConfig)
    ablate: Any = MISSING  # interventions/options.py
    patch: Any = MISSING  # interventions/options.py
    train: Any = MISSING  # train/options.py
    sae: Any = MISSING  # sae/<architecture>.py's options (sae/base.py: SaeConfig)
    study: Any = MISSING  # studies/<study>.py's options (studies/study.py: StudyOptions)
    engine: EngineConfig = field(default_factory=EngineConfig)
    output: OutputConfig = field(default_factory=OutputConfig)
    name: str = setting("default", RUN_NAME)
    seed: int = setting(0, NATURAL)  # numpy's generators take no negative seed
    device: str = "cpu"
    # torch's threads; 0: a launcher's allotment, else one per idle core it may use (runtime.choose_threads)
    threads: int = setting(0, NATURAL)


ConfigStore.instance().store(name="base_config", node=Config)


def cache_key(parts: dict[str, Any]) -> str:
    """The short hash naming a run or a checkpoint: CACHE_VERSION and the plain form of `parts`."""
    blob = json.dumps({"cache_version": CACHE_VERSION, **to_plain(parts)}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def option(value: Any) -> str:
    """The string of a config option, whether OmegaConf gives it as an Enum member or a plain str."""
    return str(getattr(value, "value", value))


def run_info(cfg: Any) -> dict[str, Any]:
    """The columns that name a run in its tidy table."""
    return {"experiment": cfg.name, "model": cfg.model.name, "task": cfg.task.name, "seed": cfg.seed}


def to_plain(cfg: Any) -> Any:
    """Plain dicts, lists and values (enums as their names) of a typed or untyped config."""
    if isinstance(cfg, DictConfig):
        return OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)
    if dataclasses.is_dataclass(cfg) and not isinstance(cfg, type):
        return {f.name: to_plain(getattr(cfg, f.name)) for f in dataclasses.fields(cfg)}
    if isinstance(cfg, dict):
        return {k: to_plain(v) for k, v in cfg.items()}
    if isinstance(cfg, (list, tuple)):
        return [to_plain(v) for v in cfg]
    if isinstance(cfg, Enum):
        return cfg.name
    return cfg
