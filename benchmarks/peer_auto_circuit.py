"""auto-circuit's edge scores on the benchmark's model and prompts; run by circuit_peers.py in auto-circuit's
own virtual environment (transformer-lens 2.x), so it imports nothing from headlab.

The model: the directory circuit_peers.py names (a GPT-2 it saved with save_pretrained, or smollm2-135m's
float32 copy, a Llama), converted by TransformerLens's own convert_gpt2_weights / convert_llama_weights and
loaded with raw weights (no LN folding, centering or value-bias folding), with the flags auto-circuit's
load_tl_model sets (attention results, split q/k/v inputs, MLP inputs) and its weights frozen as
load_tl_model freezes them. A Llama with grouped-query attention is loaded with
ungroup_grouped_query_attention (each query head gets its own copy of its key/value head's weights: the same
function), since auto-circuit makes one key and one value receiver per query head. Its config.json is read
here, not by transformers 4.x's LlamaConfig, which would not see a 5.x file's rope_parameters and would
fall back to its default rotary base. The graph: patchable_model(factorized=True, separate_qkv=True,
slice_output="last_seq"). Scores: mask_gradient_prune_scores(grad_function="logit",
answer_function="avg_diff", RESAMPLE from the corrupt prompts) with mask_val=0 (EAP; auto-circuit documents
it as equal to its edge_attribution_patching) or integrated_grad_samples=steps (its IG: every edge's mask set
to k/steps, k = 0..steps, at once).

Prints one JSON line: wall and CPU seconds (all threads) and peak memory of the timed call (VmHWM, reset
just before it, as circuit_peers.py's headlab worker does), the resident set before it, setup seconds and
the clean metric.
Writes {"names": [...], "scores": tensor} (auto-circuit's edge names, its raw mask gradients).
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import gc
import json
import time
from pathlib import Path

import torch

from tl_configs import tl_gpt2_config, tl_llama_config


def status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def reset_peak() -> None:
    gc.collect()
    ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim(0)
    Path("/proc/self/clear_refs").write_text("5")


def hooked(model_dir: str, n_ctx: int):
    """The directory's model as auto-circuit's HookedTransformer (raw weights, frozen)."""
    from transformer_lens import HookedTransformer

    raw = json.loads((Path(model_dir) / "config.json").read_text())
    cfg, state = (gpt2 if raw["model_type"] == "gpt2" else llama)(model_dir, raw, n_ctx)
    model = HookedTransformer(cfg)
    model.load_and_process_state_dict(
        state, fold_ln=False, center_writing_weights=False, center_unembed=False, fold_value_biases=False
    )
    del state
    model.cfg.use_attn_result = True
    model.cfg.use_attn_in = True
    model.cfg.use_split_qkv_input = True
    model.cfg.use_hook_mlp_in = True
    model.eval()
    for param in model.parameters():
        param.requires_grad = False
    return model


def gpt2(model_dir: str, raw: dict, n_ctx: int):
    """GPT-2's own position table fixes its n_ctx, so the prompt length is not used."""
    from transformer_lens.pretrained.weight_conversions import convert_gpt2_weights
    from transformers import GPT2LMHeadModel

    hf = GPT2LMHeadModel.from_pretrained(model_dir).eval()
    cfg = tl_gpt2_config(hf.config)
    return cfg, convert_gpt2_weights(hf, cfg)


def llama(model_dir: str, raw: dict, n_ctx: int):
    """Grouped-query attention ungrouped: auto-circuit makes one key and one value receiver per query head."""
    from transformer_lens.pretrained.weight_conversions import convert_llama_weights
    from transformers import LlamaConfig, LlamaForCausalLM

    theta = (raw.get("rope_parameters") or {}).get("rope_theta", raw.get("rope_theta", 10000.0))
    kept = {k: v for k, v in raw.items() if k not in ("rope_parameters", "dtype", "transformers_version")}
    hf = LlamaForCausalLM.from_pretrained(model_dir, config=LlamaConfig(**kept, rope_theta=theta)).eval()
    grouped = hf.config.num_key_value_heads != hf.config.num_attention_heads
    cfg = tl_llama_config(hf.config, torch.float32, n_ctx=n_ctx, ungroup_grouped_query_attention=grouped)
    return cfg, convert_llama_weights(hf, cfg)


def loader(data: dict, rows: slice, batch: int):
    from auto_circuit.data import PromptDataLoader, PromptDataset

    clean, corrupt = data["clean"][rows], data["corrupt"][rows]
    answers = [a.view(1) for a in data["io"][rows]]
    wrong = [s.view(1) for s in data["s"][rows]]
    dataset = PromptDataset(clean, corrupt, answers, wrong)
    return PromptDataLoader(dataset, seq_len=None, diverge_idx=0, batch_size=min(batch, len(clean)), shuffle=False)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--data", required=True)
    ap.add_argument("--method", choices=("eap", "eap_ig"), required=True)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    from auto_circuit.prune_algos.mask_gradient import mask_gradient_prune_scores
    from auto_circuit.utils.graph_utils import patchable_model

    started = time.perf_counter()
    data = torch.load(args.data)
    tl = hooked(args.model_dir, n_ctx=data["clean"].shape[1])
    with torch.inference_mode():
        logits = tl(data["clean"])[:, -1]
        n = torch.arange(len(logits))
        clean_metric = (logits[n, data["io"]] - logits[n, data["s"]]).mean().item()
    model = patchable_model(tl, factorized=True, slice_output="last_seq", separate_qkv=True)
    setup = time.perf_counter() - started
    kwargs = dict(official_edges=None, grad_function="logit", answer_function="avg_diff")
    if args.method == "eap":
        kwargs["mask_val"] = 0.0
    else:
        kwargs["integrated_grad_samples"] = args.steps

    mask_gradient_prune_scores(model, loader(data, slice(0, 2), 2), **kwargs)  # warm-up, as headlab's worker
    full = loader(data, slice(None), args.batch)
    reset_peak()
    baseline = status_kb("VmRSS")
    start, cpu = time.perf_counter(), time.process_time()
    scores = mask_gradient_prune_scores(model, full, **kwargs)
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    peak = status_kb("VmHWM")

    edges = sorted(model.edges, key=lambda e: e.name)
    values = torch.stack([e.prune_score(scores).detach().double() for e in edges])
    torch.save({"names": [e.name for e in edges], "scores": values, "batches": len(full)}, args.out)
    report = {
        "seconds": seconds,
        "cpu_seconds": cpu,
        "peak_kb": peak,
        "baseline_kb": baseline,
        "setup_seconds": setup,
        "clean_metric": clean_metric,
        "n_edges": len(edges),
        "threads": torch.get_num_threads(),
        "kv_group": tl.cfg.n_heads // (tl.cfg.n_key_value_heads or tl.cfg.n_heads),
    }
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
