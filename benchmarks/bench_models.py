"""The benchmarks' random models, prompts and TransformerLens twins (shared by sweep_speed, circuit_speed,
ioi_crosscheck).

GPT-2 small's shape (12 layers x 12 heads, d_model 768, vocab 50257) with random weights (torch seed 0), and
a Llama-3.2-1B-shaped model for the GPU run. Each has a TransformerLens HookedTransformer twin built offline
from a hand-made HookedTransformerConfig and TransformerLens's own weight conversion, loaded with raw
weights (no LN folding, centering or value-bias folding), so that zeroing hook_z removes exactly a head's
term, as zeroing its slice of the attention output projection's input does in the HF model.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import json
import sys
import tempfile
import time
from collections.abc import Callable
from importlib.metadata import version
from pathlib import Path
from typing import Any

import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

from headlab.flops import block_flops
from headlab.models.hf import load_hf
from headlab.planning import shape_of_config
from headlab.tasks import Task, TaskData, mean_of
from tl_configs import tl_gpt2_config, tl_llama_config

N_LAYERS, N_HEADS, D_MODEL, VOCAB = 12, 12, 768, 50257
TOKEN_A, TOKEN_B = 5335, 1757  # the metric: logit[A] - logit[B] at the last position
# Llama 3.2 1B's shape (1.24B parameters, tied embeddings), with a short context: TransformerLens allocates an
# n_ctx x n_ctx causal mask per layer
LLAMA_1B = dict(layers=16, heads=32, kv_heads=8, d_model=2048, d_mlp=8192, vocab=128256)
# Llama-3.1-8B's sizes (its embedding and unembedding apart)
LLAMA_8B = dict(layers=32, heads=32, kv_heads=8, d_model=4096, d_mlp=14336, vocab=128256, tied=False)


class LogitDiff(Task):
    name = "logit_diff"
    quantities = ("logit_diff",)
    smooth_quantity = "logit_diff"  # what attribution patching differentiates
    aggregates = {"logit_diff": mean_of(0)}

    def per_prompt(self, logits: torch.Tensor, data: TaskData) -> torch.Tensor:
        return (logits[..., 0, TOKEN_A] - logits[..., 0, TOKEN_B]).unsqueeze(-1)

    def vocab_rows(self, data: TaskData, columns) -> torch.Tensor:
        """The two rows the metric reads: headlab unembeds those alone."""
        return torch.tensor([TOKEN_A, TOKEN_B]).expand(data.n, 2)

    def from_rows(self, rows: torch.Tensor, data: TaskData, columns) -> torch.Tensor:
        return (rows[..., 0, 0] - rows[..., 0, 1]).unsqueeze(-1)


def gpt2_config(init_range: float = 0.02) -> GPT2Config:
    return GPT2Config(
        n_layer=N_LAYERS,
        n_head=N_HEADS,
        n_embd=D_MODEL,
        vocab_size=VOCAB,
        n_positions=1024,
        initializer_range=init_range,
    )


def save_gpt2(path: str, init_range: float = 0.02) -> GPT2LMHeadModel:
    """The random GPT-2 (torch seed 0), saved with save_pretrained at `path`; returns it."""
    torch.manual_seed(0)
    model = GPT2LMHeadModel(gpt2_config(init_range)).eval()
    model.save_pretrained(path)
    return model


def build(init_range: float, with_tl: bool):
    """(headlab HookedModel, TransformerLens HookedTransformer or None) with the same random weights."""
    with tempfile.TemporaryDirectory() as tmp:
        save_gpt2(tmp, init_range)
        hm = load_hf(tmp, name="gpt2-random", need_tokenizer=False)
    tl = build_hooked_transformer(hm.module) if with_tl else None
    return hm, tl


def make_data(n: int, seq: int, changed: int, vocab: int = VOCAB) -> TaskData:
    """`n` random token rows of `seq` tokens below `vocab` (generator seed 1); each counterfactual is its
    prompt with `changed` random positions given other random tokens (same length). Metrics read the last
    position."""
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (n, seq), generator=gen)
    corrupt = ids.clone()
    for row in range(n):
        where = torch.randperm(seq, generator=gen)[:changed]
        shift = torch.randint(1, vocab, (changed,), generator=gen)
        corrupt[row, where] = (ids[row, where] + shift) % vocab  # a different token
    return TaskData(
        inputs={"input_ids": ids},
        positions=torch.full((n, 1), seq - 1),
        answers={},
        counterfactual={"input_ids": corrupt},
    )


def build_hooked_transformer(hf: GPT2LMHeadModel):
    from transformer_lens.pretrained.weight_conversions import convert_gpt2_weights

    cfg = tl_gpt2_config(hf.config)
    return _raw_weights(cfg, convert_gpt2_weights(hf, cfg))


def llama_config(
    layers: int, heads: int, kv_heads: int, d_model: int, d_mlp: int, vocab: int, tied: bool = True
) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=vocab,
        hidden_size=d_model,
        intermediate_size=d_mlp,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=d_model // heads,
        max_position_embeddings=2048,
        tie_word_embeddings=tied,
    )


def save_llama(
    path: str, config: LlamaConfig, dtype: torch.dtype, max_shard_size: str | None = None
) -> LlamaForCausalLM:
    """A random Llama (torch seed 0, initialised in float32, stored in `dtype`), saved at `path` (in shards
    of at most `max_shard_size`, where given)."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(dtype).eval()
    model.save_pretrained(path, **({"max_shard_size": max_shard_size} if max_shard_size else {}))
    return model


def save_llama_shards(
    path: str, config: LlamaConfig, dtype: torch.dtype, shard_mb: int = 2000, draw_on: str = "cpu"
) -> Path:
    """A random Llama of a shape whose float32 copy would not fit in memory (Llama-3.1-8B's: 32 GB), saved
    at `path` a shard at a time: the module built on the meta device for its parameter names and shapes,
    each tensor drawn in float32 as transformers initialises it (normal(0, initializer_range); norms 1;
    torch seed 0) on `draw_on` (a GPU draws 8B values in a second, one CPU thread in about a minute), stored
    in `dtype`. Memory: one shard. Not save_llama's values (another draw order), nor a CPU's draw."""
    from safetensors.torch import save_file

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    with torch.device("meta"):
        shapes = {name: tuple(t.shape) for name, t in LlamaForCausalLM(config).state_dict().items()}
    torch.manual_seed(0)
    shard: dict[str, torch.Tensor] = {}
    weight_map: dict[str, str] = {}
    size = total = written = 0

    def flush() -> None:  # the shard written and let go: one shard in memory at a time
        nonlocal written
        written += 1
        name = f"model-{written:05d}.safetensors"
        save_file(shard, str(out / name), metadata={"format": "pt"})
        weight_map.update({key: name for key in shard})
        shard.clear()

    for name, shape in shapes.items():
        if name.endswith("norm.weight"):
            t = torch.ones(shape, dtype=dtype)
        else:
            t = torch.empty(shape, device=draw_on).normal_(0.0, config.initializer_range).to(dtype).cpu()
        if size and size + t.nbytes > shard_mb * 2**20:
            flush()
            size = 0
        shard[name] = t
        size += t.nbytes
        total += t.nbytes
    flush()
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    config.dtype = dtype
    config.save_pretrained(out)
    return out


def build_hooked_llama(hf: LlamaForCausalLM, dtype: torch.dtype):
    from transformer_lens.pretrained.weight_conversions import convert_llama_weights

    cfg = tl_llama_config(hf.config, dtype, init_weights=False)  # every weight is then the HF model's
    return _raw_weights(cfg, convert_llama_weights(hf, cfg))


def _raw_weights(cfg, state_dict: dict):
    from transformer_lens import HookedTransformer

    model = HookedTransformer(cfg)
    model.load_and_process_state_dict(
        state_dict, fold_ln=False, center_writing_weights=False, center_unembed=False, fold_value_biases=False
    )
    return model.eval()


def load_hooked(cfg, weights: str, device: str):
    """A HookedTransformer from a saved state dict, its weights never allocated twice: built uninitialised,
    then given the file's (memory-mapped) tensors."""
    from transformer_lens import HookedTransformer

    model = HookedTransformer(cfg)
    model.load_state_dict(torch.load(weights, mmap=True), assign=True)
    return model.to(device).eval()


def min_time(fn: Callable[[], Any], repeats: int, device: str = "cpu") -> tuple[float, Any]:
    """(min seconds over repeats, result of the last call)."""
    best, result = float("inf"), None
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        if device == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return best, result


def cuda_missing(device: str) -> bool:
    """True, after saying so on stderr, where `--device cuda` was asked for and torch sees no CUDA device."""
    if device == "cuda" and not torch.cuda.is_available():
        print(f"error: --device cuda: no CUDA device here (torch {torch.__version__})", file=sys.stderr)
        return True
    return False


def status_kb(field: str = "VmRSS") -> int:
    """A kB field of /proc/self/status: VmRSS, the resident set now; VmHWM, its high-water mark (ru_maxrss
    would carry over a parent's high-water mark across a child's exec)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def reset_peak() -> None:
    """Give freed heap memory back (tune_allocator keeps it in glibc's heap), then reset VmHWM to the
    resident set that is left, so that the next VmHWM is what runs after this allocates."""
    gc.collect()
    ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim(0)
    Path("/proc/self/clear_refs").write_text("5")


def dist_version(dist: str) -> str:
    return version(dist)


def ablation_work_ratio(config: Any, prompts: int, tokens: int) -> float:
    """The matrix-product FLOPs of a loop of full forward passes (TransformerLens, nnsight: every layer, logits
    at every position) over those of headlab's stacked sweep, for a zero ablation of every head at every
    position with the metric read at one position: the speedup at equal FLOP/s, which batching alone moves.
    headlab, for a head of layer l: block l from its output projection on (its attention is the cached z's),
    blocks l+1.. whole, the last block's MLP and the logits at the read position only; plus one clean pass."""
    d, layers = config.hidden_size, config.num_hidden_layers
    heads = config.num_attention_heads
    d_head = getattr(config, "head_dim", None) or d // heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    d_mlp = getattr(config, "intermediate_size", None) or getattr(config, "n_inner", None) or 4 * d
    gated = config.model_type != "gpt2"  # gate, up and down projections, not two
    qkv, out = 2 * d * (heads + 2 * kv) * d_head, 2 * heads * d_head * d
    mlp = 2 * d * d_mlp * (3 if gated else 2)
    attention = 4 * tokens * heads * d_head  # scores and the weighted sum, per query over every key
    block, logits = qkv + out + mlp + attention, 2 * d * config.vocab_size
    n = prompts * tokens  # tokens of one pass
    loop = layers * heads * (layers * n * block + n * logits)

    def from_layer(l: int) -> float:
        """headlab's FLOPs for one head of layer l."""
        if l == layers - 1:
            return n * out + prompts * (mlp + logits)
        whole = (layers - 2 - l) * n * block
        last = n * (qkv + out + attention) + prompts * mlp
        return n * (out + mlp) + whole + last + prompts * logits

    stacked = layers * n * block + prompts * logits + heads * sum(from_layer(l) for l in range(layers))
    return loop / stacked


def forward_flops(config: Any, prompts: int, tokens: int, read_positions: int = 1) -> dict[str, float]:
    """The matrix-product FLOPs of one forward pass over `prompts` rows of `tokens` tokens, from the model's
    shapes (a Hugging Face config; headlab's plan counts them, flops.block_flops): every layer at every
    position (q, k, v and output projections, the attention scores and their weighted sum over the causal
    keys a query sees, within the sliding window on sliding layers, the MLP's projections) and the
    unembedding at `read_positions` positions a row (what the metric reads). Norms, rotary tables, softmax
    and activations are not counted. Returns "forward", and "backward": the gradient of that pass's read
    logits down to the first layer's activations (no weight gradients): each projection once more, the
    attention's scores and sum twice (gradients of q, k, v)."""
    shape = shape_of_config(config, 0, 4)
    parts = [block_flops(shape, prompts, tokens, layer) for layer in range(shape.n_layers)]
    attention = sum(a for _, a in parts)
    logits = prompts * 2 * shape.d_model * shape.vocab * read_positions
    forward = sum(d for d, _ in parts) + attention + logits
    return {"forward": float(forward), "backward": float(forward + attention)}


def matmul_peak_gflops(n: int, device: str, repeats: int = 5) -> float:
    """The machine's float32 matrix-product rate: the best of `repeats` torch.matmul of two n x n matrices
    on `device` (after one untimed product), in GFLOP/s (2 n^3 FLOPs a product)."""
    gen = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(n, n, generator=gen, device=device)
    b = torch.randn(n, n, generator=gen, device=device)
    torch.matmul(a, b)  # untimed: the first product sets up the library's buffers
    if device == "cuda":
        torch.cuda.synchronize()
    best, _ = min_time(lambda: torch.matmul(a, b), repeats, device)
    return 2 * n**3 / best / 1e9
