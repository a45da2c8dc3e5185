"""The training loop both kinds of model share: AdamW, warm-up + cosine, periodic eval, resumable.

Batches come from a generator seeded by (seed, step), so a resumed run sees exactly the batches an
uninterrupted one would, and the same seed gives the same weights.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from ..config import option
from ..io import has_state, load_state, optimizer_groups, optimizer_tensors, restore_optimizer, save_state
from ..progress import progress_bar
from ..tasks import Task, TaskData
from .options import LossPositions

log = logging.getLogger("headlab")
STATE = "state"
STATE_LABEL = "training state"


def lr_at(step: int, tc: Any) -> float:
    if step < tc.warmup_steps:
        return tc.lr * (step + 1) / tc.warmup_steps
    progress = (step - tc.warmup_steps) / max(1, tc.steps - tc.warmup_steps)
    return tc.lr * (tc.min_lr_frac + (1 - tc.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def _batch_generator(seed: int, step: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed * 1_000_003 + step)


def adamw(decay: Sequence[Tensor], no_decay: Sequence[Tensor], tc: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": tc.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=tc.lr,
        betas=(tc.beta1, tc.beta2),
    )


def fit_loop(
    label: str,
    model: nn.Module,
    opt: torch.optim.Optimizer,
    task: Task,
    tc: Any,
    seed: int,
    directory: Path,
    loss_fn: Callable[[Tensor, Tensor], Tensor],
    evaluate: Callable[[Any, Task, TaskData], dict[str, float]],
    show_progress: bool,
) -> tuple[int, list[dict], float, dict[str, float]]:
    """Train until tc.steps or the target metric, resuming from directory/state, evaluating on
    tc.eval_prompts prompts of their own seed; (steps, curve, seconds, the final evaluation, in eval mode)."""
    eval_data = task.build(tc.eval_prompts, seed=seed + 10_000)

    def eval_fn() -> dict[str, float]:
        return evaluate(model, task, eval_data)

    step, elapsed = 0, 0.0
    curve: list[dict] = []
    if has_state(directory / STATE):
        step, curve, elapsed = _load_state(directory / STATE, model, opt)
    # says in the job's log whether this attempt trained from scratch or went on from a checkpoint
    log.info("%s: %s at step %d of %d in %s", label, "resumed" if step else "started", step, tc.steps, directory)
    model.train()
    started = time.perf_counter() - elapsed
    stop = False
    # a config built in code (not from TrainConfig) may not name the option: the default then
    at_decision = option(getattr(tc, "loss_positions", LossPositions.all)) == LossPositions.decision.value
    with progress_bar(label, total=tc.steps, completed=step, enabled=show_progress) as bar:
        while step < tc.steps and not stop:
            inputs, targets = task.train_batch(_batch_generator(seed, step), tc.batch_size, step=step)
            if at_decision:
                targets = task.decision_targets(inputs, targets)
            for group in opt.param_groups:
                group["lr"] = lr_at(step, tc)
            loss = loss_fn(inputs, targets)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            if tc.grad_clip:
                torch.nn.utils.clip_grad_norm_(model.parameters(), tc.grad_clip)
            opt.step()
            step += 1
            if step % tc.eval_every == 0 or step == tc.steps:
                metrics = {"loss": loss.item(), **eval_fn()}
                curve += [{"step": step, "metric": k, "value": v} for k, v in metrics.items()]
                bar.update(step, " ".join(f"{k}={v:.3f}" for k, v in metrics.items()))
                stop = tc.target is not None and metrics.get(tc.target, -math.inf) >= tc.target_value
            else:
                bar.update(step)
            if step % tc.checkpoint_every == 0 and step < tc.steps and not stop:
                _save_state(directory / STATE, model, opt, step, curve, time.perf_counter() - started)
    seconds = time.perf_counter() - started
    model.eval()
    return step, curve, seconds, eval_fn()


def _save_state(
    where: Path, model: nn.Module, opt: torch.optim.Optimizer, step: int, curve: list, elapsed: float
) -> None:
    payload = {"step": step, "curve": curve, "param_groups": optimizer_groups(opt), "elapsed": elapsed}
    save_state(where, {"model": model, "optim": optimizer_tensors(opt)}, payload)


def _load_state(where: Path, model: nn.Module, opt: torch.optim.Optimizer) -> tuple[int, list, float]:
    tensors, payload = load_state(where, STATE_LABEL, modules={"model": model}, files=["optim"])
    restore_optimizer(opt, tensors["optim"], groups=payload["param_groups"])
    return payload["step"], payload["curve"], payload.get("elapsed", 0.0)
