"""Training toy transformers from scratch: AdamW, warm-up + cosine, periodic eval, resumable.

Batches come from a generator seeded by (seed, step), so a resumed run sees exactly the batches an
uninterrupted one would, and the same seed gives the same weights.
Checkpoint directory:
  model.safetensors + config.json    the finished model (config.json has "complete": true)
  state/                             the last periodic checkpoint: weights, AdamW moments, step, curve
"""
from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any, Optional

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor

from ..config import option
from ..errors import HeadlabError
from ..models.toy import ToyConfig, ToyTransformer, hooked_toy, load_toy, save_toy
from ..progress import progress_bar
from ..results import atomic_write_bytes
from ..tasks import Task

STATE = "state"


def toy_config(model_cfg: Any, task: Task) -> ToyConfig:
    if task.vocab_size == 0:
        raise HeadlabError(f"task {task.name} has no vocabulary of its own to train a toy model on")
    if task.max_len > model_cfg.n_ctx:
        raise HeadlabError(f"task {task.name} needs n_ctx >= {task.max_len}, model has {model_cfg.n_ctx}")
    return ToyConfig(
        vocab_size=task.vocab_size,
        n_ctx=model_cfg.n_ctx,
        n_layers=model_cfg.n_layers,
        n_heads=model_cfg.n_heads,
        d_model=model_cfg.d_model,
        d_head=model_cfg.d_head,
        d_mlp=model_cfg.d_mlp,
        pos_emb=option(model_cfg.pos_emb),
        layer_norm=model_cfg.layer_norm,
    )


def lr_at(step: int, tc: Any) -> float:
    if step < tc.warmup_steps:
        return tc.lr * (step + 1) / tc.warmup_steps
    progress = (step - tc.warmup_steps) / max(1, tc.steps - tc.warmup_steps)
    return tc.lr * (tc.min_lr_frac + (1 - tc.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def _batch_generator(seed: int, step: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed * 1_000_003 + step)


def evaluate(model: ToyTransformer, task: Task, data) -> dict[str, float]:
    model.eval()
    with torch.inference_mode():
        logits = model(data.inputs["input_ids"])
    model.train()
    return task.evaluate_logits(logits, data)


def train_toy(
    model_cfg: Any,
    task: Task,
    tc: Any,
    seed: int,
    directory: Path,
    show_progress: bool = True,
    meta: Optional[dict] = None,
) -> tuple[ToyTransformer, list[dict]]:
    """Train (or resume, or reuse) a toy model in `directory`; returns it and its training curve."""
    directory = Path(directory)
    if (directory / "config.json").is_file():
        model, saved = load_toy(directory)
        if saved.get("complete"):
            return model, saved.get("curve", [])
    torch.manual_seed(seed)
    model = ToyTransformer(toy_config(model_cfg, task))
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": tc.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=tc.lr,
        betas=(tc.beta1, tc.beta2),
    )
    step, curve, elapsed = 0, [], 0.0
    if (directory / STATE / "state.json").is_file():
        step, curve, elapsed = _load_state(directory / STATE, model, opt)
    eval_data = task.build(tc.eval_prompts, seed=seed + 10_000)
    model.train()
    started = time.perf_counter() - elapsed
    stop = False
    with progress_bar(f"train {model_cfg.name}", total=tc.steps, completed=step, enabled=show_progress) as bar:
        while step < tc.steps and not stop:
            inputs, targets = task.train_batch(_batch_generator(seed, step), tc.batch_size)
            for group in opt.param_groups:
                group["lr"] = lr_at(step, tc)
            logits = model(inputs)
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            if tc.grad_clip:
                torch.nn.utils.clip_grad_norm_(model.parameters(), tc.grad_clip)
            opt.step()
            step += 1
            if step % tc.eval_every == 0 or step == tc.steps:
                metrics = {"loss": loss.item(), **evaluate(model, task, eval_data)}
                curve += [{"step": step, "metric": k, "value": v} for k, v in metrics.items()]
                bar.update(step, " ".join(f"{k}={v:.3f}" for k, v in metrics.items()))
                stop = tc.target is not None and metrics.get(tc.target, -math.inf) >= tc.target_value
            else:
                bar.update(step)
            if step % tc.checkpoint_every == 0 and step < tc.steps and not stop:
                _save_state(directory / STATE, model, opt, step, curve, time.perf_counter() - started)
    model.eval()
    final = evaluate(model, task, eval_data)
    save_toy(
        model,
        directory,
        {
            "complete": True,
            "steps": step,
            "seed": seed,
            "metrics": final,
            "curve": curve,
            "train_seconds": time.perf_counter() - started,
            **(meta or {}),
        },
    )
    return model, curve


def _save_state(where: Path, model: ToyTransformer, opt: torch.optim.Optimizer, step: int, curve: list, elapsed: float):
    where.mkdir(parents=True, exist_ok=True)
    sd = opt.state_dict()
    tensors: dict[str, Tensor] = {}
    for idx, state in sd["state"].items():
        for key, value in state.items():
            tensors[f"{idx}.{key}"] = torch.as_tensor(value).contiguous()
    for name, data in (("model.safetensors", model.state_dict()), ("optim.safetensors", tensors)):
        tmp = where / (name + ".tmp")
        save_file({k: v.contiguous() for k, v in data.items()}, str(tmp))
        tmp.replace(where / name)
    groups = [{k: v for k, v in g.items() if k != "params"} | {"params": g["params"]} for g in sd["param_groups"]]
    payload = {"step": step, "curve": curve, "param_groups": groups, "elapsed": elapsed}
    atomic_write_bytes(where / "state.json", json.dumps(payload).encode())  # written last: marks it whole


def _load_state(where: Path, model: ToyTransformer, opt: torch.optim.Optimizer) -> tuple[int, list, float]:
    try:
        payload = json.loads((where / "state.json").read_text())
        model.load_state_dict(load_file(str(where / "model.safetensors")))
        flat = load_file(str(where / "optim.safetensors"))
    except Exception as e:
        raise HeadlabError(f"corrupt training state in {where}: {str(e).splitlines()[0]}") from e
    state: dict[int, dict[str, Tensor]] = {}
    for key, value in flat.items():
        idx, name = key.split(".", 1)
        state.setdefault(int(idx), {})[name] = value
    opt.load_state_dict({"state": state, "param_groups": payload["param_groups"]})
    return payload["step"], payload["curve"], payload.get("elapsed", 0.0)


def load_or_train(model_cfg: Any, task: Task, tc: Any, seed: int, directory: Path, show_progress: bool = True):
    model, _ = train_toy(model_cfg, task, tc, seed, directory, show_progress)
    return hooked_toy(model, model_cfg.name)
