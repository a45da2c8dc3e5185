"""One run, as data: config -> model -> task data -> plan -> engine -> tidy table -> run dir."""
from __future__ import annotations

import json
import logging
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Optional

import pandas as pd
import torch
from omegaconf import DictConfig

from . import models, results
from .config import config_hash, option, run_info, to_plain
from .analysis.heads import attention_by_token, head_output_norms, uniform_scales
from .errors import HeadlabError, UsageError
from .interventions import plan
from .interventions.engine import execute
from .models.hooked import HookedModel
from .tasks import Task, build_task, mean_of

log = logging.getLogger("headlab")
EVAL_SEED_OFFSET = 20_000  # sweep prompts are drawn apart from training batches and training evals
CHECKPOINT_KEYS = ("model", "task", "train", "seed")


@contextmanager
def _timed(timings: dict[str, float], stage: str) -> Iterator[None]:
    start = time.perf_counter()
    yield
    timings[stage] = timings.get(stage, 0.0) + time.perf_counter() - start


def apply_threads(cfg: DictConfig) -> None:
    from .sweeps import job_threads

    threads = cfg.threads if cfg.threads and cfg.threads > 0 else job_threads()
    if threads:
        torch.set_num_threads(threads)


def already_done(cfg: DictConfig, run_dir: Path) -> bool:
    """A complete result for the same config: the job is skipped (resume, idempotent sweeps)."""
    meta = Path(run_dir) / results.META
    if not results.is_complete(run_dir):
        return False
    try:
        return json.loads(meta.read_text()).get("config_hash") == config_hash(cfg)
    except json.JSONDecodeError:
        return False


def checkpoint_dir(cfg: DictConfig) -> Path:
    """Where the toy model for this (model, task, train, seed) lives; evaluation sizes do not count."""
    plain = to_plain(cfg)
    plain["task"] = {k: v for k, v in plain["task"].items() if k not in ("n_prompts", "n_reference")}
    digest = config_hash(plain, CHECKPOINT_KEYS)
    return Path(cfg.output.root) / "checkpoints" / f"{cfg.model.name}-{cfg.task.name}-seed{cfg.seed}-{digest}"


def obtain_model(cfg: DictConfig, task: Task, show_progress: bool = True) -> HookedModel:
    """The configured model; a toy or hf model without a path is trained now (or reused if trained)."""
    kind = option(cfg.model.kind)
    if kind == "toy" and not cfg.model.path:
        from .train import load_or_train

        return load_or_train(cfg.model, task, cfg.train, cfg.seed, checkpoint_dir(cfg), show_progress)
    if kind == "hf" and not cfg.model.path:
        return _trained_hf(cfg, task, show_progress)
    return models.load(cfg.model, need_tokenizer=getattr(task, "needs_tokenizer", False))


def _trained_hf(cfg: DictConfig, task: Task, show_progress: bool) -> HookedModel:
    """A GPT-2-style model trained here on model.tokenizer's vocabulary (or reused), loaded like a hub model."""
    from .models.hf import load_hf
    from .train import train_toy

    if not cfg.model.tokenizer:
        raise HeadlabError(
            f"model {cfg.model.name} is trained here (kind hf, no path) and needs model.tokenizer=<name or dir>"
        )
    directory = checkpoint_dir(cfg)
    train_toy(cfg.model, task, cfg.train, cfg.seed, directory, show_progress)  # returns at once when finished
    return load_hf(str(directory), name=cfg.model.name, dtype=cfg.model.dtype)


def run(cfg: DictConfig, run_dir: Path, show_progress: bool = True) -> pd.DataFrame:
    previous = _previous_result(cfg, run_dir)
    if previous is not None:
        return previous
    if option(cfg.model.kind) == "pathnet" or cfg.task.name == "markov":
        return _run_pathnet(cfg, run_dir, show_progress)
    from .figures import FIGURES

    if cfg.output.figures and cfg.output.figures not in FIGURES:
        raise UsageError(f"unknown figure set '{cfg.output.figures}'; choose from: {', '.join(sorted(FIGURES))}")
    timings: dict[str, float] = {}
    apply_threads(cfg)
    task = build_task(cfg.task)
    with _timed(timings, "load_model"):
        model = obtain_model(cfg, task, show_progress)
    with _timed(timings, "build_task"):
        data = task.build(cfg.task.n_prompts, seed=cfg.seed + EVAL_SEED_OFFSET, model=model).to(cfg.device)
        model.module.to(cfg.device)
    if option(cfg.ablate.sweep) == "circuits":
        return _run_circuits(cfg, run_dir, task, model, data, timings, show_progress)
    scales = None
    if option(cfg.ablate.sweep) == "uniform":
        scales = uniform_scales(head_output_norms(model, data))
    interventions = plan(cfg, model.n_layers, model.n_heads, scales)
    unknown = sorted({iv.token for iv in interventions if iv.token} - set(data.token_positions or {}))
    if unknown:
        names = ", ".join(data.token_positions or {}) or "none"
        raise UsageError(f"task {task.name} names no position {', '.join(unknown)}; it names: {names} (or all, or an index)")
    with _timed(timings, "sweep"):
        quantities = execute(model, task, data, interventions, cfg.engine.chunk_mb, cfg.engine.naive,
                             show_progress=show_progress, seed=cfg.seed)  # fmt: skip
    with _timed(timings, "tidy"):
        info = run_info(cfg)
        df = results.tidy(info, [iv.row() for iv in interventions], quantities.cpu().numpy(),
                          task.quantities, data.answers_np(), task.aggregates,
                          n_boot=cfg.output.n_boot, per_prompt=cfg.output.per_prompt)  # fmt: skip
        if cfg.attention_by_token:
            df = results.conform(pd.concat([df, _attention_table(cfg, task, model, data, info)]))
    if cfg.head_scores:
        from .analysis.scores import score_table

        with _timed(timings, "head_scores"):
            scores = score_table(model, data, info, n_boot=cfg.output.n_boot, seed=cfg.seed)
        df = results.conform(pd.concat([df, scores], ignore_index=True))
    extra = {"n_interventions": len(interventions), "n_prompts": data.n, "model_family": model.family}
    results.write(df, run_dir, results.run_meta(config_hash(cfg), timings, extra))
    if cfg.output.figures:
        draw_figures(cfg.output.figures, df, Path(run_dir))
    return df


def _run_circuits(cfg, run_dir, task, model, data, timings, show_progress) -> pd.DataFrame:
    """ablate=circuits: the recall vs reasoning study (recall_reasoning_study.py) instead of a plain sweep."""
    from . import recall_reasoning_study

    if "kind" not in data.answers:
        raise UsageError(f"ablate=circuits needs a task with recall and reasoning prompts, not task={cfg.task.name}")
    with _timed(timings, "circuits"):
        df, extra = recall_reasoning_study.run(cfg, model, task, data, run_info(cfg), show_progress)
    extra.update({"n_prompts": data.n, "model_family": model.family})
    results.write(df, run_dir, results.run_meta(config_hash(cfg), timings, extra))
    if cfg.output.figures:
        draw_figures(cfg.output.figures, df, Path(run_dir))
    return df


def _run_pathnet(cfg: DictConfig, run_dir: Path, show_progress: bool) -> pd.DataFrame:
    """model=pathnet on task=markov: theory, samples and gradient descent instead of an intervention sweep."""
    from . import pathnet_study

    if option(cfg.model.kind) != "pathnet":
        raise UsageError(f"task=markov runs on model=pathnet, not model={cfg.model.name}")
    apply_threads(cfg)
    start = time.perf_counter()
    df, extra = pathnet_study.run(cfg, show_progress)
    timings = {"total": time.perf_counter() - start, **extra.pop("timings")}
    results.write(df, run_dir, results.run_meta(config_hash(cfg), timings, extra))
    return df


def draw_figures(name: str, table: pd.DataFrame, run_dir: Path) -> None:
    """Figures from the run's table into <run_dir>/figures (+ numbers.json); the table stands without them."""
    from .figures import FIGURES

    numbers = FIGURES[name](table, run_dir / "figures")
    results.atomic_write_bytes(run_dir / "figures" / "numbers.json", json.dumps(numbers, indent=2).encode())


def _attention_table(cfg: DictConfig, task: Task, model: HookedModel, data, info: dict) -> pd.DataFrame:
    tokens = getattr(task, "token_names", None)
    if not tokens:
        raise HeadlabError(f"task {task.name} names no tokens to group attention by")
    quantities, labels = attention_by_token(model, data, tokens)
    metrics = {f"attn_to_{name}": mean_of(j) for j, name in enumerate(tokens.values())}
    return results.tidy(info, labels, quantities, list(metrics), {}, metrics, n_boot=cfg.output.n_boot)


def _previous_result(cfg: DictConfig, run_dir: Path) -> Optional[pd.DataFrame]:
    """The table of a finished run of this same config (marked skipped), else None."""
    if not already_done(cfg, run_dir):
        return None
    log.info("skipped: %s holds a complete result for this config", run_dir)
    df = pd.read_parquet(Path(run_dir) / results.TABLE)
    df.attrs["skipped"] = True
    return df


def train(cfg: DictConfig, run_dir: Path, show_progress: bool = True) -> pd.DataFrame:
    """Train the configured toy model; its curve becomes the run's table."""
    from .train import train_toy

    if option(cfg.model.kind) == "pathnet":
        raise UsageError("model=pathnet is learned inside `headlab run` (theory, posterior samples, gradient descent)")
    previous = _previous_result(cfg, run_dir)
    if previous is not None:
        return previous
    timings: dict[str, float] = {}
    apply_threads(cfg)
    task = build_task(cfg.task)
    directory = checkpoint_dir(cfg)
    with _timed(timings, "train"):
        _, curve = train_toy(cfg.model, task, cfg.train, cfg.seed, directory, show_progress)
    df = pd.DataFrame(curve if curve else [], columns=["step", "metric", "value"])
    df = df.assign(experiment=cfg.name, model=cfg.model.name, task=cfg.task.name, seed=cfg.seed,
                   intervention="none", method="train", n=cfg.train.eval_prompts)  # fmt: skip
    df = results.conform(df)
    results.write(df, run_dir, results.run_meta(config_hash(cfg), timings, {"checkpoint": str(directory)}))
    return df


def sae(cfg: DictConfig, run_dir: Path, show_progress: bool = True) -> pd.DataFrame:
    """`headlab sae`: fit (or reuse) an SAE on one layer's z and write its tables (sae/study.py)."""
    from .sae import study

    if option(cfg.model.kind) == "pathnet":
        raise UsageError("model=pathnet has no token inputs to fit an SAE on")
    previous = _previous_result(cfg, run_dir)
    if previous is not None:
        return previous
    return study.run(cfg, run_dir, show_progress)

