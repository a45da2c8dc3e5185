"""Training models from scratch: AdamW, warm-up + cosine, periodic eval, resumable.

Two kinds of model, one loop (loop.py):
  toy  (model.kind=toy)            headlab's ToyTransformer on a task's own small vocabulary (toy.py);
  hf   (model.kind=hf, no path)    a Hugging Face GPT2LMHeadModel (tied embeddings, no dropout) on a real
                                   tokenizer (model.tokenizer), sized by n_layers, n_heads, d_model,
                                   d_mlp (n_inner; 0 = GPT-2's 4 * d_model) and n_ctx (hf.py).
bayes.py learns a PathNet otherwise: posterior samples by HMC, and gradient descent for comparison.

Checkpoint directory of a toy model:
  model.safetensors + config.json    the finished model (config.json has "complete": true, written last)
  state/                             the last periodic checkpoint: weights, AdamW moments, step, curve
Checkpoint directory of an hf model (`headlab.models.hf.load_hf(directory)` loads it like a hub model):
  config.json, model.safetensors, tokenizer files   written by save_pretrained
  training.json                      "complete": true, steps, metrics, curve; written last, so a directory
                                     without it is unfinished (training resumes from state/)
  state/                             as for toy models: model.safetensors, optim.safetensors, state.json
"""

from __future__ import annotations

from .hf import HF_DONE, evaluate_hf, finished_hf, gpt2_config, load_tokenizer, sparse_logits, train_hf
from .loop import STATE, adamw, fit_loop, lr_at
from .toy import evaluate, load_or_train, toy_config, train_toy

__all__ = [
    "HF_DONE",
    "STATE",
    "adamw",
    "evaluate",
    "evaluate_hf",
    "finished_hf",
    "fit_loop",
    "gpt2_config",
    "load_or_train",
    "load_tokenizer",
    "lr_at",
    "sparse_logits",
    "toy_config",
    "train_hf",
    "train_toy",
]
