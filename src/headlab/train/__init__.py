"""Training models from scratch: AdamW, warm-up + cosine, periodic eval, resumable.

Two kinds of model, one loop:
  toy  (model.kind=toy)            headlab's ToyTransformer on a task's own small vocabulary;
  hf   (model.kind=hf, no path)    a Hugging Face GPT2LMHeadModel (tied embeddings, no dropout) on a real
                                   tokenizer (model.tokenizer), sized by n_layers, n_heads, d_model,
                                   d_mlp (n_inner; 0 = GPT-2's 4 * d_model) and n_ctx.
Batches come from a generator seeded by (seed, step), so a resumed run sees exactly the batches an
uninterrupted one would, and the same seed gives the same weights.

Checkpoint directory of a toy model:
  model.safetensors + config.json    the finished model (config.json has "complete": true, written last)
  state/                             the last periodic checkpoint: weights, AdamW moments, step, curve
Checkpoint directory of an hf model (`headlab.models.hf.load_hf(directory)` loads it like a hub model):
  config.json, model.safetensors, tokenizer files   written by save_pretrained
  training.json                      "complete": true, steps, metrics, curve; written last, so a directory
                                     without it is unfinished (training resumes from state/)
  state/                             as for toy models
"""
from __future__ import annotations

import json
import logging
import math
import time
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from safetensors.torch import load_file, load_model, save_file, save_model
from torch import Tensor, nn

from ..config import option
from ..errors import HeadlabError
from ..models.toy import ToyConfig, ToyTransformer, hooked_toy, load_toy, save_toy
from ..progress import progress_bar
from ..results import atomic_write_bytes
from ..tasks import Task

STATE = "state"
HF_DONE = "training.json"  # the completion marker of an hf checkpoint directory


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
) -> tuple[nn.Module, list[dict]]:
    """Train (or resume, or reuse) the model in `directory`; returns it and its training curve.

    model.kind=hf hands over to train_hf (a GPT2LMHeadModel); every other kind trains a ToyTransformer.
    """
    if option(model_cfg.kind) == "hf":
        return train_hf(model_cfg, task, tc, seed, directory, show_progress, meta)
    directory = Path(directory)
    if (directory / "config.json").is_file():
        model, saved = load_toy(directory)
        if saved.get("complete"):
            return model, saved.get("curve", [])
    torch.manual_seed(seed)
    model = ToyTransformer(toy_config(model_cfg, task))
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = _adamw(decay, no_decay, tc)

    def loss_fn(inputs: Tensor, targets: Tensor) -> Tensor:
        logits = model(inputs)
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100)

    eval_data = task.build(tc.eval_prompts, seed=seed + 10_000)
    step, curve, seconds = _fit(f"train {model_cfg.name}", model, opt, task, tc, seed, directory, loss_fn,
                                lambda: evaluate(model, task, eval_data), show_progress)  # fmt: skip
    final = evaluate(model, task, eval_data)
    model.eval()
    save_toy(
        model,
        directory,
        {"complete": True, "steps": step, "seed": seed, "metrics": final, "curve": curve,
         "train_seconds": seconds, **(meta or {})},
    )  # fmt: skip
    return model, curve


# --- Hugging Face GPT-2-style models on a real tokenizer -------------------------------------------------
def load_tokenizer(model_cfg: Any) -> Any:
    """The tokenizer a model trained here uses: model.tokenizer, a hub name or a local directory."""
    if not model_cfg.tokenizer:
        raise HeadlabError(
            f"model {model_cfg.name}: an hf model trained here needs a tokenizer (set model.tokenizer=<name or dir>)"
        )
    from transformers import AutoTokenizer

    logging.getLogger("huggingface_hub").setLevel(logging.ERROR)
    try:
        return AutoTokenizer.from_pretrained(model_cfg.tokenizer)
    except Exception as e:  # OSError, ValueError or hub errors depending on the cause
        first = (str(e).strip() or type(e).__name__).splitlines()[0][:300]
        raise HeadlabError(f"cannot load tokenizer '{model_cfg.tokenizer}' for model {model_cfg.name}: {first}") from e


def gpt2_config(model_cfg: Any, task: Task, tokenizer: Any) -> Any:
    """A GPT2Config from headlab's model fields; vocabulary = the tokenizer's, no dropout (exact resume)."""
    from transformers import GPT2Config

    if task.max_len > model_cfg.n_ctx:
        raise HeadlabError(f"task {task.name} needs n_ctx >= {task.max_len}, model has {model_cfg.n_ctx}")
    if model_cfg.d_model % model_cfg.n_heads:
        raise HeadlabError(f"model {model_cfg.name}: d_model {model_cfg.d_model} is not a multiple of n_heads "
                           f"{model_cfg.n_heads} (GPT-2 heads are d_model / n_heads wide)")  # fmt: skip
    return GPT2Config(
        vocab_size=len(tokenizer),
        n_positions=model_cfg.n_ctx,
        n_embd=model_cfg.d_model,
        n_layer=model_cfg.n_layers,
        n_head=model_cfg.n_heads,
        n_inner=model_cfg.d_mlp or None,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )


def sparse_logits(model: nn.Module, input_ids: Tensor, rows: Tensor, cols: Tensor) -> Tensor:
    """Logits at (rows, cols) only: the final hidden states there, through the unembedding."""
    hidden = model.base_model(input_ids=input_ids, use_cache=False).last_hidden_state
    return model.lm_head(hidden[rows, cols])


def evaluate_hf(model: nn.Module, task: Task, data) -> dict[str, float]:
    """Task.evaluate_logits, computing logits at data.positions only (never [n, pos, vocab])."""
    was_training = model.training
    model.eval()
    rows = torch.arange(data.n).unsqueeze(1).expand_as(data.positions)
    with torch.inference_mode():
        logits = sparse_logits(model, data.inputs["input_ids"], rows, data.positions)  # [n, P, vocab]
    model.train(was_training)
    quantities = task.per_prompt(logits, data).cpu().numpy()
    answers = data.answers_np()
    return {name: float(fn(quantities, answers)) for name, fn in task.aggregates.items()}


def train_hf(
    model_cfg: Any,
    task: Task,
    tc: Any,
    seed: int,
    directory: Path,
    show_progress: bool = True,
    meta: Optional[dict] = None,
) -> tuple[nn.Module, list[dict]]:
    """Train (or resume, or reuse) a GPT2LMHeadModel in `directory`, written with save_pretrained."""
    from transformers import GPT2LMHeadModel

    directory = Path(directory)
    finished = _finished_hf(directory)
    if finished is not None:
        return finished
    if not getattr(task, "needs_tokenizer", False) or not hasattr(task, "use_tokenizer"):
        raise HeadlabError(f"task {task.name} has its own vocabulary, not a tokenizer's: train a toy model on it")
    tokenizer = load_tokenizer(model_cfg)
    task.use_tokenizer(tokenizer)
    torch.manual_seed(seed)
    model = GPT2LMHeadModel(gpt2_config(model_cfg, task, tokenizer))
    wte = model.get_input_embeddings().weight
    if tc.embedding_std is not None:
        with torch.no_grad():
            wte.normal_(0.0, tc.embedding_std)
    if tc.freeze_embeddings:
        wte.requires_grad_(False)  # tied: the unembedding is frozen with it
    # Embeddings stay out of weight decay, as LayerNorm gains and biases do: tokens never seen in
    # training (held-out names) would otherwise have their rows shrunk towards zero.
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2 and id(p) not in embeddings]
    no_decay = [p for p in params if p.dim() < 2 or id(p) in embeddings]
    opt = _adamw(decay, no_decay, tc)

    def loss_fn(inputs: Tensor, targets: Tensor) -> Tensor:
        rows, cols = (targets != -100).nonzero(as_tuple=True)
        logits = sparse_logits(model, inputs, rows, cols)
        return torch.nn.functional.cross_entropy(logits, targets[rows, cols])

    eval_data = task.build(tc.eval_prompts, seed=seed + 10_000)
    step, curve, seconds = _fit(f"train {model_cfg.name}", model, opt, task, tc, seed, directory, loss_fn,
                                lambda: evaluate_hf(model, task, eval_data), show_progress)  # fmt: skip
    model.eval()
    final = evaluate_hf(model, task, eval_data)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # headlab's own bar already showed the training
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    done = {"complete": True, "kind": "hf", "steps": step, "seed": seed, "metrics": final, "curve": curve,
            "train_seconds": seconds, **(meta or {})}  # fmt: skip
    atomic_write_bytes(directory / HF_DONE, json.dumps(done, indent=2).encode())  # last: marks it finished
    return model, curve


def _finished_hf(directory: Path) -> Optional[tuple[nn.Module, list[dict]]]:
    """The finished model in `directory` and its curve, or None when training has not finished there."""
    marker = directory / HF_DONE
    if not marker.is_file():
        return None
    from transformers import GPT2LMHeadModel

    try:
        saved = json.loads(marker.read_text())
    except json.JSONDecodeError as e:
        raise HeadlabError(f"corrupt checkpoint marker {marker}: {e}") from e
    if not saved.get("complete"):
        return None
    try:
        model = GPT2LMHeadModel.from_pretrained(directory)
    except Exception as e:
        first = (str(e).strip() or type(e).__name__).splitlines()[0][:300]
        raise HeadlabError(f"corrupt checkpoint in {directory}: {first}") from e
    return model.eval(), saved.get("curve", [])


# --- the loop and its resumable state --------------------------------------------------------------------
def _adamw(decay: list[Tensor], no_decay: list[Tensor], tc: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": tc.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=tc.lr,
        betas=(tc.beta1, tc.beta2),
    )


def _fit(
    label: str,
    model: nn.Module,
    opt: torch.optim.Optimizer,
    task: Task,
    tc: Any,
    seed: int,
    directory: Path,
    loss_fn: Callable[[Tensor, Tensor], Tensor],
    eval_fn: Callable[[], dict[str, float]],
    show_progress: bool,
) -> tuple[int, list[dict], float]:
    """Train until tc.steps or the target metric, resuming from directory/state; (steps, curve, seconds)."""
    step, curve, elapsed = 0, [], 0.0
    if (directory / STATE / "state.json").is_file():
        step, curve, elapsed = _load_state(directory / STATE, model, opt)
    model.train()
    started = time.perf_counter() - elapsed
    stop = False
    with progress_bar(label, total=tc.steps, completed=step, enabled=show_progress) as bar:
        while step < tc.steps and not stop:
            inputs, targets = task.train_batch(_batch_generator(seed, step), tc.batch_size, step=step)
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
    return step, curve, time.perf_counter() - started


def _save_state(where: Path, model: nn.Module, opt: torch.optim.Optimizer, step: int, curve: list, elapsed: float):
    where.mkdir(parents=True, exist_ok=True)
    sd = opt.state_dict()
    tensors: dict[str, Tensor] = {}
    for idx, state in sd["state"].items():
        for key, value in state.items():
            tensors[f"{idx}.{key}"] = torch.as_tensor(value).contiguous()
    tmp = where / "model.safetensors.tmp"
    save_model(model, str(tmp))  # safetensors' save_model: tied weights (GPT-2's lm_head) are stored once
    tmp.replace(where / "model.safetensors")
    tmp = where / "optim.safetensors.tmp"
    save_file(tensors, str(tmp))
    tmp.replace(where / "optim.safetensors")
    groups = [{k: v for k, v in g.items() if k != "params"} | {"params": g["params"]} for g in sd["param_groups"]]
    payload = {"step": step, "curve": curve, "param_groups": groups, "elapsed": elapsed}
    atomic_write_bytes(where / "state.json", json.dumps(payload).encode())  # written last: marks it whole


def _load_state(where: Path, model: nn.Module, opt: torch.optim.Optimizer) -> tuple[int, list, float]:
    try:
        payload = json.loads((where / "state.json").read_text())
        load_model(model, str(where / "model.safetensors"))
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
