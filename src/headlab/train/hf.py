"""Hugging Face GPT-2-style models (model.kind=hf, no path) trained on a real tokenizer."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, cast

import torch
from torch import Tensor, nn

from ..errors import HeadlabError
from ..io import atomic_write_bytes
from ..models.loading import ModelConfig
from ..tasks import Task
from .loop import adamw, fit_loop
from .options import TrainConfig

log = logging.getLogger("headlab")

HF_DONE = "training.json"  # the completion marker of an hf checkpoint directory


def load_tokenizer(model_cfg: ModelConfig) -> Any:
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


def gpt2_config(model_cfg: ModelConfig, task: Task, tokenizer: Any) -> Any:
    """A GPT2Config from headlab's model fields; vocabulary = the tokenizer's, no dropout (exact resume)."""
    from transformers import GPT2Config

    if task.max_len > model_cfg.n_ctx:
        raise HeadlabError(f"task {task.name} needs n_ctx >= {task.max_len}, model has {model_cfg.n_ctx}")
    if model_cfg.d_model % model_cfg.n_heads:
        raise HeadlabError(
            f"model {model_cfg.name}: d_model {model_cfg.d_model} is not a multiple of n_heads "
            f"{model_cfg.n_heads} (GPT-2 heads are d_model / n_heads wide)"
        )
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
    base, head = cast(nn.Module, model.base_model), cast(nn.Module, model.lm_head)
    hidden = base(input_ids=input_ids, use_cache=False).last_hidden_state
    return head(hidden[rows, cols])


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
    model_cfg: ModelConfig,
    task: Task,
    tc: TrainConfig,
    seed: int,
    directory: Path,
    show_progress: bool = True,
    meta: dict | None = None,
) -> tuple[nn.Module, list[dict]]:
    """Train (or resume, or reuse) a GPT2LMHeadModel in `directory`, written with save_pretrained."""
    from transformers import GPT2LMHeadModel

    directory = Path(directory)
    finished = finished_hf(directory)
    if finished is not None:
        log.info("reused the trained model in %s", directory)
        return finished
    if not getattr(task, "needs_tokenizer", False) or not hasattr(task, "use_tokenizer"):
        raise HeadlabError(f"task {task.name} has its own vocabulary, not a tokenizer's: train a toy model on it")
    tokenizer = load_tokenizer(model_cfg)
    task.use_tokenizer(tokenizer)
    torch.manual_seed(seed)
    model = GPT2LMHeadModel(gpt2_config(model_cfg, task, tokenizer))
    wte = cast(Tensor, model.get_input_embeddings().weight)
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
    opt = adamw(decay, no_decay, tc)

    def loss_fn(inputs: Tensor, targets: Tensor) -> Tensor:
        rows, cols = (targets != -100).nonzero(as_tuple=True)
        logits = sparse_logits(model, inputs, rows, cols)
        return torch.nn.functional.cross_entropy(logits, targets[rows, cols])

    step, curve, seconds, final = fit_loop(
        f"train {model_cfg.name}", model, opt, task, tc, seed, directory, loss_fn, evaluate_hf, show_progress
    )
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # headlab's own bar already showed the training
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    done = {
        "complete": True,
        "kind": "hf",
        "steps": step,
        "seed": seed,
        "metrics": final,
        "curve": curve,
        "train_seconds": seconds,
        **(meta or {}),
    }
    atomic_write_bytes(directory / HF_DONE, json.dumps(done, indent=2).encode())  # last: marks it finished
    return model, curve


def finished_hf(directory: Path) -> tuple[nn.Module, list[dict]] | None:
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
