"""Speed of headlab's exact head-ablation sweep against the naive TransformerLens loop.

Measures the wall-clock time of zero-ablating each of the 144 heads of a GPT-2-small-shaped model
(random weights, 64 prompts x 20 tokens; metric: mean logit[A] - logit[B] at the last position) two ways:
  headlab          `execute(..., naive=False)`: one clean trace, then per layer the interventions stacked
                   on the cached residual stream, logits read at the metric's position only;
  TransformerLens  one full `run_with_hooks` forward pass per head, zeroing `blocks.{l}.attn.hook_z`.
The TransformerLens side is a HookedTransformer (TransformerLens 3.x, the line SAELens pins) built
offline from a hand-made HookedTransformerConfig and `convert_gpt2_weights`, loaded with raw weights
(no LN folding, centering or value-bias folding), so zeroing hook_z removes exactly the head's term.
Checks that both give the same 144 values; exits non-zero if they differ by more than 1e-4.

Run from the repo root: .venv/bin/python benchmarks/sweep_speed.py [--batch-tokens N] [--repeats R]
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing here needs the hub

import torch
from transformers import GPT2Config, GPT2LMHeadModel

from headlab.interventions import CLEAN, Intervention
from headlab.interventions.engine import execute
from headlab.models.hf import load_hf
from headlab.runtime import tune_allocator
from headlab.tasks import Task, TaskData, mean_of

N_LAYERS, N_HEADS, D_MODEL, VOCAB = 12, 12, 768, 50257
N_PROMPTS, SEQ_LEN = 64, 20
TOKEN_A, TOKEN_B = 5335, 1757
TOLERANCE = 1e-4


class LogitDiff(Task):
    name = "logit_diff"
    quantities = ("logit_diff",)
    aggregates = {"logit_diff": mean_of(0)}

    def per_prompt(self, logits: torch.Tensor, data: TaskData) -> torch.Tensor:
        return (logits[..., 0, TOKEN_A] - logits[..., 0, TOKEN_B]).unsqueeze(-1)


def min_time(fn, repeats: int):
    """(min seconds over repeats, result of the last call)."""
    best, result = float("inf"), None
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        best = min(best, time.perf_counter() - start)
    return best, result


def build_hooked_transformer(hf: GPT2LMHeadModel):
    from transformer_lens import HookedTransformer, HookedTransformerConfig
    from transformer_lens.pretrained.weight_conversions import convert_gpt2_weights

    c = hf.config
    cfg = HookedTransformerConfig(
        n_layers=c.n_layer,
        d_model=c.n_embd,
        d_head=c.n_embd // c.n_head,
        n_heads=c.n_head,
        d_mlp=4 * c.n_embd,
        d_vocab=c.vocab_size,
        n_ctx=c.n_positions,
        act_fn="gelu_new",
        normalization_type="LN",
        eps=c.layer_norm_epsilon,
        default_prepend_bos=False,
    )
    model = HookedTransformer(cfg)
    model.load_and_process_state_dict(
        convert_gpt2_weights(hf, cfg),
        fold_ln=False,
        center_writing_weights=False,
        center_unembed=False,
        fold_value_biases=False,
    )
    return model.eval()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chunk-mb", type=float, default=32.0, help="passed to headlab's execute()")
    parser.add_argument("--repeats", type=int, default=1, help="time each side this many times, keep the min")
    parser.add_argument("--default-malloc", action="store_true", help="leave glibc's allocator untuned")
    args = parser.parse_args()
    tuned = False if args.default_malloc else tune_allocator()  # process-wide: both sides run with it

    torch.manual_seed(0)
    config = GPT2Config(n_layer=N_LAYERS, n_head=N_HEADS, n_embd=D_MODEL, vocab_size=VOCAB, n_positions=1024)
    with tempfile.TemporaryDirectory() as tmp:
        GPT2LMHeadModel(config).save_pretrained(tmp)
        hm = load_hf(tmp, name="gpt2-random", need_tokenizer=False)
        tl = build_hooked_transformer(hm.module)

    ids = torch.randint(0, VOCAB, (N_PROMPTS, SEQ_LEN), generator=torch.Generator().manual_seed(1))
    last = SEQ_LEN - 1
    task = LogitDiff()
    data = TaskData(inputs={"input_ids": ids}, positions=torch.full((N_PROMPTS, 1), last), answers={})
    heads = [(l, h) for l in range(N_LAYERS) for h in range(N_HEADS)]
    interventions = [CLEAN] + [Intervention("ablate_head", "zero", l, h) for l, h in heads]

    def metric(logits: torch.Tensor) -> float:
        return (logits[:, last, TOKEN_A] - logits[:, last, TOKEN_B]).mean().item()

    def zero_head(h: int):
        def hook(z, hook):  # z: [batch, pos, head, d_head]
            z[:, :, h] = 0.0
            return z

        return hook

    def tl_sweep() -> list[float]:
        return [metric(tl.run_with_hooks(ids, fwd_hooks=[(f"blocks.{l}.attn.hook_z", zero_head(h))])) for l, h in heads]

    def headlab_sweep() -> torch.Tensor:
        return execute(hm, task, data, interventions, chunk_mb=args.chunk_mb, naive=False)

    with torch.inference_mode():
        hf_logits = hm.forward({"input_ids": ids})
        tl_logits = tl(ids)  # also the TransformerLens warm-up
        clean_diff = (tl_logits - hf_logits).abs().max().item()
        del hf_logits
        # warm-up: a small sweep through every code path (clean readout, one layer of stacked copies)
        execute(hm, task, data, [CLEAN, *interventions[-N_HEADS:]], chunk_mb=args.chunk_mb)

        headlab_s, quantities = min_time(headlab_sweep, args.repeats)
        tl_s, tl_values = min_time(tl_sweep, args.repeats)

    headlab_values = quantities[1:, :, 0].mean(1)
    diff = (headlab_values - torch.tensor(tl_values, dtype=headlab_values.dtype)).abs().max().item()
    per_chunk = max(1, int(args.chunk_mb * 2**20 // (N_PROMPTS * SEQ_LEN * hm.width * 4)))

    print(f"model: gpt2-small-shape random ({N_LAYERS}x{N_HEADS}, d_model {D_MODEL})")
    print(f"prompts: {N_PROMPTS}")
    print(f"tokens_per_prompt: {SEQ_LEN}")
    print(f"interventions: {len(heads)} zero head ablations (+ clean)")
    print(f"torch_threads: {torch.get_num_threads()}")
    print(f"transformerlens: {_version('transformer-lens')} HookedTransformer, raw weights, hook_z")
    print(f"chunk_mb: {args.chunk_mb:g} (up to {min(per_chunk, N_HEADS)} heads per chunk)")
    print(f"repeats: {args.repeats}")
    print(f"allocator_tuned: {tuned}")
    print(f"tl_clean_logits_max_abs_diff: {clean_diff:.3g}")
    print(f"clean_metric_headlab: {quantities[0, :, 0].mean().item():.6f}")
    print(f"clean_metric_transformerlens: {metric(tl_logits):.6f}")
    print(f"headlab_seconds: {headlab_s:.2f}")
    print(f"transformerlens_seconds: {tl_s:.2f}")
    print(f"max_abs_diff: {diff:.3g}")
    print(f"peak_rss_mb: {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f}")
    print(f"speedup_vs_transformerlens: {tl_s / headlab_s:.2f}")
    return 0 if diff <= TOLERANCE else 1


def _version(dist: str) -> str:
    from importlib.metadata import version

    return version(dist)


if __name__ == "__main__":
    sys.exit(main())
