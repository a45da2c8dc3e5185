"""`headlab plan`: what a run will need, said before any weights are read.

From the shapes alone (the model's config, its parameters counted on torch's meta device, the run's own
prompts built with the model's tokenizer) and a fraction of a second measuring this machine:
  weights   parameters x the run's dtype (a GGUF model runs dequantised to float32), less on a CPU the
            embedding and unembedding matrices of mapped weights where no pass reads them (unread_mb); with
            model.layers_on_disk, those blocks' weights are read from disk as a pass reaches them (one at a
            time, counted twice: accelerate reads it through a memory map into a tensor)
  caches    what a sweep keeps of the clean run: every block's input, the final residual stream
            [prompts, tokens, d_model] and each layer's keys and values, and what it records of other runs
            (recorded_mb: the reference or counterfactual prompts' values it reads); study=circuit: EAP / EAP-IG's
            recordings and the senders' outputs, or the faithfulness curve's, whichever is larger
            (circuit_mb)
  working   the engine's chunk: engine.chunk_mb of a block's widest activation, WORKING_COPIES of it alive
            at once, or the readout's logits (chunk_mb of them, one prompt's at least) with their log-softmax
            and its exponent, whichever is larger (the two are not alive together)
  device    a run on a GPU (`device=cuda`): the weights, caches and working memory are the device's, in
            tensors (torch.cuda.max_memory_allocated: the CUDA context and the allocator's cache are not
            counted); its chunks take engine.gpu_memory_share of the device's free memory over
            runtime.LIVE_ACTIVATIONS (as the engine does), at most one layer's interventions at once (the
            engine stacks a chunk within a layer); the host holds this process, the tokenizer and the
            weights as they load: the largest of the model's safetensors files (a file's pages are let go
            once its tensors have moved; the whole weights where there is no such file, as a GGUF's).
            The time's matmul rate is measured on the device, its efficiencies are the CPU's (not fitted on a
            GPU). A CPU run's plan says it uses no device memory.
  dtype     activations, caches and chunks are in the run's dtype (model.dtype), as the engine holds them;
            the logits float32
  baseline  this process before the model loads (Python, torch, transformers), measured
  tokenizer the model's tokenizer, TOKENIZER_KB a vocabulary entry (Gemma's 262,144 entries hold about 300
            MB), in `headlab plan` as in the run's own plan
  time      study=sweep: the matrix-product FLOPs of its stacked passes (each intervention runs the blocks
            from its layer on, the clean run all of them, a path-patching sender its two passes, each reads
            the logits at the read positions) over this machine's matmul rate in the run's dtype at the
            blocks' shape (measured now, SWEEP_EFFICIENCY of it: the share the engine reaches on 2 cores,
            benchmarks/smollm2_speed.py), plus loading the model (loading_s: LOAD_FIXED_S, the weights at
            LOAD_MB_S, or MAPPED_MB_S where mapped, the tokenizer at TOKENIZER_S an entry); study=circuit
            (EAP, EAP-IG over inputs and activations): its scoring's passes and its faithfulness curve's FLOPs
            (flops.circuit_gflop) at PASSES_EFFICIENCY of the rate at a pass's rows (and BLOCK_RUN_S for each
            block its passes run one at a time) and CURVE_EFFICIENCY of the rate at every prompt's (exact
            patching's scoring, stacked copies of the blocks as a sweep's, at SWEEP_EFFICIENCY), its sender-
            by-receiver products at PRODUCTS_EFFICIENCY of the rate measured at their own shape
            (flops.product_gflops), plus loading; patch=attribution: its passes (flops.attribution_gflop) at
            SWEEP_EFFICIENCY; study=ioi_classes: its head scores' and five path-patching rounds' FLOPs
            (flops.ioi_classes_gflop: the rounds into receiver heads at their costliest layer, since the
            classes the earlier rounds find are unknown before the run) at IOI_CLASSES_EFFICIENCY of that
            rate, plus loading; study=atlas: studies/atlas_plan.py. Other studies: no time model yet, said so.
Every sweep, circuit, IOI-classes and atlas run writes its plan beside what it measured (meta.json `plan`,
`measured`), so each run checks the prediction; benchmarks/plan_accuracy.py prints the ratios.
"""

from __future__ import annotations

import json
import math
import resource
import sys
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from .config import Config, option
from .errors import HeadlabError, UsageError
from .flops import (
    Shape,
    circuit_gflop,
    edge_nodes,
    ioi_classes_gflop,
    matmul_gflops,
    most_in_one_layer,
    part_size,
    product_gflops,
    sweep_gflop,
    uniform_sweep,
)
from .models.families import family_of
from .models.sites import WINDOWS_TO_SPLIT
from .runtime import LIVE_ACTIVATIONS, gpu_chunk_mb

MB = 2**20
# a block's activations alive at once per chunk, in units of engine.chunk_mb (its widest: edits.copy_bytes),
# fitted to the sweeps of benchmarks/plan_accuracy.py (smollm2-135m and gemma3-270m, IOI and text)
WORKING_COPIES = 7
SWEEP_EFFICIENCY = 0.8  # the share of the measured matmul rate the sweep engine keeps on a CPU
# loading: building the model (transformers' modules imported: 2.6 s), its weights and its tokenizer, whose
# time goes with its vocabulary (parsing tokenizer.json: 4.5 s of gemma3-270m's 262,144 entries, 0.9 s of
# smollm2-135m's 49,152). Weights stored in the run's dtype are mapped, their pages read as the passes reach
# them (the Llama-3.1-8B shape's 15 GB of bfloat16 load in 4 s); others are read and converted
LOAD_FIXED_S, LOAD_MB_S, MAPPED_MB_S, TOKENIZER_S = 2.6, 400.0, 8000.0, 1.7e-5
SAFETENSORS_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16", "F64": "float64"}
TOKENIZER_KB = 1.2  # a loaded tokenizer's memory per vocabulary entry (smollm2-135m's and gemma3-270m's)
# the pages of torch's libraries a CPU run's kernels map beyond those its imports did: resident file pages
# less the weights' grew 60-70 MB in smollm2-135m's head sweep and EAP-IG, gemma3-270m's EAP-IG and the
# Llama-3.2-1B shape's EAP-IG (/proc's RssFile at their peaks); in every CPU run's host peak (Plan.code_mb)
CODE_MB = 70.0
# a GGUF model's first run de-quantises its weights to float32 once, into the per-user cache (models/gguf.py),
# before it loads them: CONVERT_MB_S of float32 weights a second, the process holding CONVERT_COPIES copies
# of them at once beside itself and its tokenizer: smollm2-135m's first run peaked at 2.3 copies above those,
# gemma3-270m's (a vocabulary five times as large) at 3.2 (benchmarks/plan_accuracy.py's *_first cases: an
# empty cache; the conversion took about 12 and 23 s on 2 cores)
CONVERT_MB_S, CONVERT_COPIES = 45.0, 2.8
# the share of engine.max_memory a run plans to fill: the plan's peak has fallen short of the measured one by
# up to 7% under a budget (smollm2-135m's EAP-IG under 1400MB) and by up to 16% without one
# (docs/benchmarks/plan_accuracy.txt), so a budget planned to the last MB is not kept for certain
BUDGET_SHARE = 0.9
# the shares of the measured matmul rates EAP / EAP-IG's scoring and the faithfulness curve keep on a CPU in
# circuit_gflop's count, at 2 threads, from the phases' own clocks (meta.json seconds), fitted on the machine
# docs/benchmarks/plan_accuracy.txt was measured on: scoring's passes (forward, each block again, backward) of
# the rate at a pass's rows, 0.60 on smollm2-135m and 0.67 on gemma3-270m (16 IOI prompts); its products of
# product_gflops's rate at their own shape, 0.8-1.0; the curve (an upper bound for its small circuits) of the
# rate at every prompt's rows, 0.47 on smollm2-135m and 0.42 on gemma3-270m. These shares move with the machine
# more than the sweeps' (their products are small and the curve's mixtures memory-bound): on the machine of the
# fit before, whose float32 peak was 1.1-1.7 times this one's, the same runs took as long, at scoring shares of
# 0.41 and 0.52 and curve shares of 0.34 and 0.22
PASSES_EFFICIENCY, PRODUCTS_EFFICIENCY, CURVE_EFFICIENCY = 0.63, 0.9, 0.44
# and, beside those FLOPs, each block a scoring pass runs one at a time costs a fixed time (its hooks, its
# small products' launch, its weights read again), whatever few rows it has: fitted with PASSES_EFFICIENCY to
# EAP-IG over activations (61 nodes, 4 prompts, one step: 13,020 block runs, most of its time) and the two
# EAP-IG runs above; a backward layer counts flops.BACKWARD_RUNS
BLOCK_RUN_S = 0.0023
# the share of the measured matmul rate study=ioi_classes keeps on a CPU in flops.ioi_classes_gflop's count
# (its receiver rounds counted with their receivers at the costliest single layer: receivers the run finds
# over several layers cost somewhat more), at 2 threads, between smollm2-135m's on 64 IOI prompts and
# gemma3-270m's on 16, whose blocks (4 wide heads, six norms) keep a smaller share: 0.75 planned gemma3-270m
# at 0.70 of its time (docs/benchmarks/plan_accuracy.txt)
IOI_CLASSES_EFFICIENCY = 0.7
TIMED = ("sweep", "circuit", "ioi_classes")  # the studies with a time model here
# the studies whose runs write their plan beside what they measured (the atlas's: studies/atlas_plan.py)
PLANNED = (*TIMED, "atlas")


@dataclass
class Plan:
    study: str
    model: str
    params: int
    prompts: int
    tokens: int
    weights_mb: float  # all of them, in the run's dtype
    caches_mb: float
    working_mb: float
    baseline_mb: float
    tokenizer_mb: float
    peak_host_mb: float
    logits_mb: float = 0.0  # one prompt's logits at its read positions
    layer_mb: float = 0.0  # one block's weights
    n_layers: int = 0
    layers_on_disk: int = 0  # the last blocks' weights read from disk as a pass reaches them
    interventions: int | None = None
    chunk_interventions: int | None = None  # a sweep: the most of one layer's, which a chunk stacks at most
    gflop: float | None = None
    matmul_gflops: float | None = None
    seconds: float | None = None
    load_seconds: float = 0.0  # loading the model (loading_s), counted in seconds
    efficiency: float = SWEEP_EFFICIENCY  # the share of matmul_gflops the time assumes
    work: str = ""  # what the time counts
    per_prompt_mb: float = 0.0  # study=circuit: what a gradient pass holds per prompt
    mask_mb: float = 0.0  # the attention mask of a forward pass over every prompt (in caches_mb)
    copy_mb: float = 0.0  # one copy of the prompts' widest activation: the least a chunk holds
    curve_mb: float = 0.0  # study=circuit: what the faithfulness curve holds
    curve_prompt_mb: float = 0.0  # study=circuit: what the curve holds per prompt whose recordings it keeps
    note: str = ""
    budget: str = ""  # under engine.max_memory: what the run sets to keep it
    device: str = "cpu"
    peak_device_mb: float = 0.0  # a GPU run: its tensors' peak on the device
    device_working_mb: float = 0.0  # a GPU run: the engine's working memory on the device (in peak_device_mb)
    device_free_mb: float | None = None  # a GPU run: the device's free memory before loading, where seen here
    unread_mb: float = 0.0  # a CPU run's mapped weights that no pass reads (unread_mb): in no peak
    code_mb: float = 0.0  # a CPU run: the library code its kernels map as they first run (CODE_MB)
    convert_mb: float = 0.0  # a run that first converts its GGUF weights (converts): the process while it does
    convert_seconds: float = 0.0  # ... and how long that takes (in seconds)
    # its working memory is the engine's chunk (working_mb); False: its own whatever the chunk (a circuit's
    # gradient passes and curve: each layer's copies of the stream)
    chunked: bool = True

    @property
    def highest_host_mb(self) -> float:
        """The process's highest memory: the run's peak, or its GGUF conversion's where it converts first."""
        return max(self.peak_host_mb, self.convert_mb)

    def lines(self) -> list[str]:
        # on a GPU the caches and the engine's work are the device's, the weights the host's as they load
        unread = f" less {self.unread_mb:,.0f} mapped and never read" if self.unread_mb else ""
        converting = (
            f"; first its GGUF weights de-quantised to float32 once, into the cache: {self.convert_mb:,.0f} MB, "
            f"{self.convert_seconds:,.0f} s"
            if self.convert_mb
            else ""
        )
        held = (
            f"the weights as they load {self.weights_mb:,.0f}"
            if self.peak_device_mb
            else f"weights {self.weights_mb:,.0f}{unread}, caches {self.caches_mb:,.0f}, working {self.working_mb:,.0f}"
            f", library code {self.code_mb:,.0f}"
        )
        out = [
            f"plan: study={self.study} on {self.model} ({self.params / 1e6:.1f}M parameters), "
            f"{self.prompts} prompts of {self.tokens} tokens",
            f"peak host memory: {self.highest_host_mb:,.0f} MB ({held}, tokenizer {self.tokenizer_mb:,.0f}, this "
            f"process before loading {self.baseline_mb:,.0f}{converting})",
        ]
        if self.peak_device_mb:
            free = "" if self.device_free_mb is None else f"; {self.device_free_mb:,.0f} MB free now"
            out.append(
                f"peak device memory: {self.peak_device_mb:,.0f} MB on {self.device} (weights "
                f"{self.weights_mb:,.0f}, caches {self.caches_mb:,.0f}, working {self.device_working_mb:,.0f}{free})"
            )
        else:
            out.append("peak device memory: none (device=cpu)")
        if self.layers_on_disk:
            out.append(
                f"weights on disk: the last {self.layers_on_disk} of {self.n_layers} blocks ({self.layer_mb:,.0f} MB "
                "each), read as each pass reaches them (model.layers_on_disk)"
            )
        if self.seconds is not None:
            out.append(
                f"time: {self.seconds:,.0f} s ({self.work}: {self.gflop:,.0f} GFLOP at "
                f"{self.matmul_gflops:.0f} GFLOP/s measured x {self.efficiency:.2f})"
            )
        if self.note:
            out.append(self.note)
        if self.budget:
            out.append(self.budget)
        return out

    def as_meta(self) -> dict[str, Any]:
        return {k: (round(v, 2) if isinstance(v, float) else v) for k, v in asdict(self).items()}


def rss_mb() -> float:
    """This process's resident memory now, MB."""
    import psutil

    return psutil.Process().memory_info().rss / MB


def grown(plan: Plan) -> Plan:
    """The plan a budget is kept against (engine.max_memory, planned in the run's own process before it
    loads): this process's memory now as its baseline (planning imports transformers' model code, reads a
    tokenizer and builds the model on the meta device, and the run loads on top of that)."""
    now = max(rss_mb(), plan.baseline_mb)
    return replace(plan, baseline_mb=now, peak_host_mb=plan.peak_host_mb + now - plan.baseline_mb)


def peak_rss_mb() -> float:
    """This process's peak resident memory so far, MB: Linux's VmHWM, the peak of its own memory since it
    started (ru_maxrss also counts what its parent held when it forked: a run started by a large process
    would report that process's size), else ru_maxrss (KB on Linux, bytes on macOS)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / (MB if sys.platform == "darwin" else 1024)


def shape_of_config(config: Any, params: int, itemsize: int) -> Shape:
    """A Hugging Face config's sizes."""
    heads = config.num_attention_heads
    layers = config.num_hidden_layers
    kinds = getattr(config, "layer_types", None) or ["full_attention"] * layers
    return Shape(
        n_layers=layers,
        n_heads=heads,
        n_kv=getattr(config, "num_key_value_heads", None) or heads,
        d_head=getattr(config, "head_dim", None) or config.hidden_size // heads,
        d_model=config.hidden_size,
        d_mlp=getattr(config, "intermediate_size", None) or getattr(config, "n_inner", None) or 4 * config.hidden_size,
        vocab=config.vocab_size,
        gated=getattr(family_of(config), "gated_mlp", True),
        params=params,
        itemsize=itemsize,
        window=getattr(config, "sliding_window", None),
        sliding=tuple(kind == "sliding_attention" for kind in kinds),
        tied=bool(getattr(config, "tie_word_embeddings", True)),
        suffixes=getattr(family_of(config), "suffix_runs", True),
    )


def hf_source(cfg: Config) -> tuple[str, dict[str, Any]]:
    """(a directory, from_pretrained's extra arguments) holding the model's config and tokenizer, no weights
    read: the model's path, a GGUF model's float32 copy in the cache, else its GGUF file's header."""
    m = cfg.model
    if not m.gguf_file:
        if not m.path:
            raise HeadlabError(f"plan: model {m.name} has no path to read its shapes from")
        return m.path, {}
    from .models import gguf

    weights = gguf.locate(m.gguf_file, m.path, m.package, m.gguf_parts, m.sha256)
    copy = gguf.copy_dir(weights, m.sha256)
    if (copy / gguf.PROVENANCE).is_file():
        return str(copy), {}
    return str(weights.file.parent), {"gguf_file": weights.file.name}


def converts(cfg: Config) -> bool:
    """Whether the run first converts its GGUF weights to float32 (no copy of them in the cache yet)."""
    return bool(cfg.model.gguf_file) and "gguf_file" in hf_source(cfg)[1]


def converting(plan: Plan, s: Shape) -> Plan:
    """The plan of a run that first converts its GGUF weights (converts): CONVERT_COPIES copies of its float32
    weights beside this process and its tokenizer, for their size at CONVERT_MB_S."""
    weights = s.params * 4 / MB
    seconds = weights / CONVERT_MB_S
    return replace(
        plan,
        convert_mb=plan.baseline_mb + plan.tokenizer_mb + CONVERT_COPIES * weights,
        convert_seconds=seconds,
        seconds=None if plan.seconds is None else plan.seconds + seconds,
    )


def hf_shape(cfg: Config) -> tuple[Shape, Any]:
    """The model's shape (its parameters counted on the meta device) and its tokenizer."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    where, extra = hf_source(cfg)
    try:
        config = AutoConfig.from_pretrained(where, **extra)
    except Exception as e:  # transformers raises OSError, ValueError or the hub's errors by cause
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise HeadlabError(f"plan: cannot read the config of {cfg.model.name} at {where}: {first}"[:200]) from e
    with torch.device("meta"):
        params = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.tokenizer or where, **({} if cfg.model.tokenizer else extra))
    itemsize = torch.empty((), dtype=getattr(torch, cfg.model.dtype)).element_size()
    return shape_of_config(config, params, itemsize), tokenizer


def predict(
    cfg: Config,
    s: Shape,
    data: Any,
    reads: int,
    baseline_mb: float,
    tokenizer_mb: float,
    rate: float | None = None,
    vocabulary: bool = True,
) -> Plan:
    """The plan of `cfg` on a model of shape `s` and these prompts (TaskData); `rate`: this machine's matmul
    rate measured already (GFLOP/s), else measured here at the run's shape (on the run's device);
    `vocabulary`: whether a pass unembeds the whole vocabulary (reads_vocabulary)."""
    device = str(cfg.device)
    try:
        torch.device(device)
    except (RuntimeError, ValueError):
        raise UsageError(f"device={device}: not a device torch knows (cpu, cuda, cuda:1, mps)") from None
    if not device.startswith("cuda"):
        return host_plan(cfg, s, data, reads, baseline_mb, tokenizer_mb, rate, vocabulary=vocabulary)
    free = device_free_mb(device)
    if rate is None and free is not None:
        rows = data.inputs["input_ids"].numel()
        rate = matmul_gflops(s, rows, device=device, dtype=run_dtype(cfg))
    measure_on = device if free is not None else "cpu"
    return on_device(host_plan(cfg, s, data, reads, baseline_mb, tokenizer_mb, rate, measure_on), cfg, free)


def run_dtype(cfg: Config) -> torch.dtype:
    """The dtype the run computes in (model.dtype; a GGUF model's float32 copy)."""
    return getattr(torch, str(cfg.model.dtype))


def loading_mb(cfg: Config, weights_mb: float) -> float:
    """What the host holds of the weights as they load onto a GPU: transformers maps each safetensors file,
    and a file's pages go once its tensors have moved, so the largest file (in the file's dtype); the whole
    weights where model.path holds no such file (a hub name) or the model is a GGUF's (its float32 copy is
    one file)."""
    files = [] if cfg.model.gguf_file or not cfg.model.path else list(Path(cfg.model.path).glob("*.safetensors"))
    if not files:
        return weights_mb
    return max(f.stat().st_size for f in files) / MB


def device_free_mb(device: str) -> float | None:
    """The GPU's free memory now, MB; None where none is visible here (planning a cluster's run elsewhere)."""
    if not torch.cuda.is_available():
        return None
    free, _total = torch.cuda.mem_get_info(torch.device(device))
    return free / MB


def on_device(plan: Plan, cfg: Config, free_mb: float | None) -> Plan:
    """The plan of a run on a GPU: weights, caches and the engine's working memory on the device, whose
    chunks take engine.gpu_memory_share of its free memory after the weights and caches over
    LIVE_ACTIVATIONS (runtime.chunk_budget_mb), no more than every intervention's copy of the prompts; where
    the device cannot be seen here, chunks of engine.chunk_mb (the least the engine takes) and no time. The
    host holds this process, the tokenizer and the weights as they load."""
    chunk = float(cfg.engine.chunk_mb)
    if free_mb is not None:  # what the engine will see free once the weights and caches are on the device
        room = max(0.0, free_mb - plan.weights_mb - plan.caches_mb)
        chunk = gpu_chunk_mb(room, chunk, cfg.engine.gpu_memory_share)
    if plan.chunk_interventions and plan.copy_mb:
        chunk = min(chunk, plan.chunk_interventions * plan.copy_mb)
    working = plan.working_mb if plan.study == "circuit" else LIVE_ACTIVATIONS * chunk + 3 * plan.logits_mb
    host = plan.baseline_mb + plan.tokenizer_mb + loading_mb(cfg, plan.weights_mb)
    if free_mb is None and plan.seconds is not None:  # the host's rate says nothing of the GPU's
        plan = replace(plan, seconds=None, note=f"time: no GPU visible here to measure (device={cfg.device})")
    return replace(
        plan,
        device=str(cfg.device),
        peak_device_mb=plan.weights_mb + plan.caches_mb + working,
        device_working_mb=working,
        device_free_mb=free_mb,
        peak_host_mb=host,
        code_mb=0.0,
    )


def host_plan(
    cfg: Config,
    s: Shape,
    data: Any,
    reads: int,
    baseline_mb: float,
    tokenizer_mb: float,
    rate: float | None = None,
    measure_on: str = "cpu",
    vocabulary: bool = True,
) -> Plan:
    """The plan of `cfg` with everything in host memory (predict's, for a CPU run); rates not given are
    measured on `measure_on` (the run's GPU where one is visible)."""
    rows, tokens = data.inputs["input_ids"].shape
    study = cfg.study.name
    # exact edge patching runs stacked copies of the prompts a chunk at a time, as sweeps do
    exact = study == "circuit" and option(cfg.study.method) == "exact"
    dtype = run_dtype(cfg)
    block = layer_mb(s)
    on_disk = min(int(getattr(cfg.model, "layers_on_disk", 0) or 0), s.n_layers)
    weights = s.params * s.itemsize / MB - on_disk * block + (2 * block if on_disk else 0.0)
    mapped = maps_weights(cfg)
    unread = unread_mb(s, vocabulary) if mapped and not on_disk else 0.0
    activation = rows * tokens * s.d_model * s.itemsize
    caches = ((s.n_layers + 1) * activation + s.n_layers * 2 * rows * s.n_kv * tokens * s.d_head * s.itemsize) / MB
    sweep = uniform_sweep(cfg, s) if study == "sweep" else []
    caches += recorded_mb(s, data, sweep)
    chunk_rows = max(1, int(cfg.engine.chunk_mb * MB // (tokens * max(s.d_mlp, s.d_model) * s.itemsize)))
    logits = reads * s.vocab * 4 / MB  # one prompt's, float32
    # the bool attention masks a forward pass makes (models/hf.py bool_mask), [tokens, tokens] for every
    # unpadded prompt, one a prompt where some are padded, one per kind of layer (causal, sliding), and
    # models/sites.py _fused's additive float copy of a mask that is neither plain causal nor a sliding
    # window's run a block at a time (unpadded prompts of WINDOWS_TO_SPLIT windows or more)
    padded = "attention_mask" in data.inputs and not bool(data.inputs["attention_mask"].all())
    split = bool(s.window) and tokens >= WINDOWS_TO_SPLIT * (s.window or 0) and not padded
    square = tokens * tokens
    kinds = 2 if any(s.sliding) else 1
    floats = 4 * rows * square if padded or (any(s.sliding) and not split) else 0
    mask = (kinds * (rows if padded else 1) * square + floats) / MB
    copy = rows * tokens * max(s.d_mlp, s.d_model) * s.itemsize / MB  # one copy of the prompts' widest activation
    working = working_mb(cfg.engine.chunk_mb, logits, copy)
    if study == "circuit":  # no sweep chunks: EAP's recordings, and a layer's copies of the stream per receiver
        copies = alphas_at_once(cfg)
        per_prompt, curve = circuit_mb(s, rows, tokens, copies)
        curve_prompt = curve / rows if cfg.study.faithfulness else 0.0
        curve = curve_prompt * min(rows, cfg.study.curve_prompts or rows)
        caches = max(per_prompt * min(int(cfg.study.prompts_per_pass), rows), curve)
        working = (3 * s.n_heads + 1) * 3 * activation / MB
        if exact:
            working = max(working, working_mb(cfg.engine.chunk_mb, logits, copy))
    caches += mask
    plan = Plan(
        study, cfg.model.name, s.params, rows, tokens, weights, caches, working, baseline_mb, tokenizer_mb,
        baseline_mb + tokenizer_mb + weights - unread + caches + working + CODE_MB, logits, block, s.n_layers,
        on_disk,
    )  # fmt: skip
    plan.mask_mb, plan.copy_mb, plan.unread_mb, plan.code_mb = mask, copy, unread, CODE_MB
    plan.chunked = study != "circuit" or exact
    plan.load_seconds = loading_s(s, weights, mapped)
    if study == "circuit":
        plan.per_prompt_mb, plan.curve_mb, plan.curve_prompt_mb = per_prompt, curve, curve_prompt
    if study not in TIMED:
        held = "EAP / EAP-IG's recordings and the faithfulness curve's" if study == "circuit" else "a sweep's caches"
        plan.note = f"time: no time model for study={study} yet (memory above: the model and {held})"
        return plan
    if study == "ioi_classes":
        plan.gflop, rounds = ioi_classes_gflop(s, data)
        plan.matmul_gflops = rate or matmul_gflops(s, chunk_rows * tokens, dtype=dtype)
        plan.seconds = plan.gflop / (plan.matmul_gflops * IOI_CLASSES_EFFICIENCY) + plan.load_seconds
        plan.efficiency = IOI_CLASSES_EFFICIENCY
        plan.work = f"the q, v and k rounds ({rounds:,.0f} GFLOP) with their receivers at the costliest layer"
        return plan
    if study == "circuit":
        flops = circuit_gflop(cfg, s, data)
        if flops is None:
            plan.note = f"time: no time model for circuit={option(cfg.study.method)} yet (memory above)"
            return plan
        plan.gflop = flops.total
        scoring_rows = chunk_rows * tokens if exact else pass_rows(data, int(cfg.study.prompts_per_pass)) * copies
        plan.matmul_gflops = rate or matmul_gflops(s, scoring_rows, dtype=dtype)
        curve_rate = rate or (matmul_gflops(s, rows * tokens, dtype=dtype) if flops.curve else plan.matmul_gflops)
        seconds = flops.passes / (plan.matmul_gflops * (SWEEP_EFFICIENCY if exact else PASSES_EFFICIENCY))
        seconds += flops.block_runs * BLOCK_RUN_S
        seconds += flops.curve / (curve_rate * CURVE_EFFICIENCY)
        if flops.products:  # a shape of their own: every sender by one layer's receivers
            senders, attention = edge_nodes(s, option(cfg.study.kv_edges))
            product = product_gflops(senders, attention + 1, device=measure_on, dtype=dtype)
            seconds += flops.products / (product * PRODUCTS_EFFICIENCY)
        plan.seconds = seconds + plan.load_seconds
        plan.efficiency = plan.gflop / (seconds * plan.matmul_gflops)
        plan.work = (
            f"scoring: passes {flops.passes:,.0f} GFLOP, sender-by-receiver products {flops.products:,.0f}; "
            f"faithfulness curve {flops.curve:,.0f}"
        )
        return plan
    plan.interventions, plan.gflop = sweep_gflop(cfg, s, data, sweep)
    plan.chunk_interventions = most_in_one_layer(sweep)
    plan.matmul_gflops = rate or matmul_gflops(s, chunk_rows * tokens, dtype=dtype)
    plan.seconds = plan.gflop / (plan.matmul_gflops * SWEEP_EFFICIENCY) + plan.load_seconds
    plan.work = f"{plan.interventions} interventions"
    return plan


def recorded_mb(s: Shape, data: Any, interventions: list[Any]) -> float:
    """MB a sweep keeps of whole runs besides its caches (interventions/edits.py Sources, as the engine asks
    for them): each site its interventions read from other prompts, at every layer, over those prompts (the
    reference set's for resample ablation, the counterfactual prompts'; a mean's is averaged first), and
    path patching's reference and clean z and the z its passes' clean traces keep."""
    from .interventions.edits import UNRECORDED
    from .vocabulary import Method, Site, Source

    rows, tokens = data.inputs["input_ids"].shape
    references = 0 if data.reference is None else int(data.reference["input_ids"].shape[0])
    width = {Site.z: s.n_heads * s.d_head, Site.q: s.n_heads * s.d_head, Site.k: s.n_kv * s.d_head}
    width |= {Site.v: s.n_kv * s.d_head, Site.pattern: s.n_heads * tokens, Site.mlp: s.d_model, Site.neurons: s.d_mlp}
    needed = {
        (e.source, e.site)
        for iv in interventions
        if iv.method not in (Method.path, Method.attribution)
        for e in iv.edits(s.n_heads)
        if e.source not in UNRECORDED
    }
    paths = any(iv.method == Method.path for iv in interventions)
    if paths:
        needed |= {(Source.reference, Site.z), (Source.clean, Site.z)}
    # a mean's record of the reference set is let go once averaged, before the sweep's own memory is made
    total = sum(
        (references if source == Source.reference else rows) * width[site]
        for source, site in needed
        if source != Source.mean
    )
    total += rows * width[Site.z] if paths else 0
    return total * tokens * s.n_layers * s.itemsize / MB


def loading_s(s: Shape, weights_mb: float, mapped: bool) -> float:
    """Seconds to load the model: LOAD_FIXED_S, its `weights_mb` at MAPPED_MB_S where they are `mapped`
    (maps_weights) else at LOAD_MB_S, and its tokenizer's vocabulary at TOKENIZER_S an entry."""
    return LOAD_FIXED_S + weights_mb / (MAPPED_MB_S if mapped else LOAD_MB_S) + s.vocab * TOKENIZER_S


def unread_mb(s: Shape, vocabulary: bool) -> float:
    """Of mapped weights, what no pass reads, MB: a page of the file is read (and resident) only once a pass
    touches it, and the embedding's lookup touches its prompts' token rows alone; the unembedding (the same
    matrix where tied) is read whole where a pass unembeds the whole `vocabulary`, else at the rows a
    readout names (Task.vocab_rows). Seen on the resident file pages (RssFile) of gemma3-270m's and the
    Llama-3.2-1B shape's EAP-IG: their tied embedding (640 and 1,002 MB) never resident."""
    matrix = s.vocab * s.d_model * s.itemsize / MB
    return (0.0 if vocabulary else matrix) + (0.0 if s.tied else matrix)


def reads_vocabulary(cfg: Config, task: Any, data: Any) -> bool:
    """Whether some pass of the run unembeds the whole vocabulary: unless its task names the vocabulary rows
    its quantities need and no normaliser (Task.vocab_rows, needs_normaliser); a circuit reads its task's
    smooth quantity alone (edges/record.metric), other studies every quantity."""
    columns: Any = range(len(task.quantities))
    if cfg.study.name == "circuit" and task.smooth_quantity is not None:
        columns = [task.quantities.index(task.smooth_quantity)]
    return task.vocab_rows(data, columns) is None or task.needs_normaliser(columns)


def maps_weights(cfg: Config) -> bool:
    """Whether loading maps the weights' files instead of reading and converting them: safetensors files
    (a model's directory, or a GGUF model's float32 copy in the cache once made) whose tensors are in the
    run's dtype, read from the first file's header."""
    try:
        where, extra = hf_source(cfg)
    except HeadlabError:  # no files of its own (a hub name is fetched, a model trained here is made)
        return False
    files = sorted(Path(where).glob("*.safetensors")) if not extra else []
    if not files:
        return False
    try:
        with files[0].open("rb") as f:
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    except (OSError, ValueError):
        return False
    dtypes = {v["dtype"] for k, v in header.items() if k != "__metadata__"}
    return {SAFETENSORS_DTYPES.get(d) for d in dtypes} == {str(cfg.model.dtype)}


def pass_rows(data: Any, prompts_per_pass: int) -> int:
    """The rows (prompts x tokens) of EAP's mean pass: its products' M, whose rate falls with it."""
    from .interventions.lengths import passes

    each = [math.prod(part_size(part)) for part in passes(data, prompts_per_pass)]
    return max(1, sum(each) // len(each))


def reads_at_once(task: Any, data: Any) -> int:
    """How many of a prompt's read positions a readout holds the whole logits of at once: none where the task
    reads vocabulary rows (Task.vocab_rows: the normaliser's slices hold `chunk_mb` of logits), else all."""
    if task.vocab_rows(data, range(len(task.quantities))) is not None:
        return 0
    return data.positions.shape[1]


def circuit_mb(s: Shape, rows: int, tokens: int, copies: int = 1) -> tuple[float, float]:
    """What study=circuit holds at once beyond the model, MB, in residual streams ([prompts, tokens,
    d_model] in the run's dtype): (EAP / EAP-IG's, per prompt of a pass: two recordings (every block's input, z and MLP
    output, clean and corrupted), the senders' outputs of both runs and their difference, and each block's
    input again for the gradient run, in each of its `copies` (alphas_at_once); the faithfulness curve's,
    every prompt at once: the two recordings, the corrupted senders' outputs and the differences it fills in
    (edges/evaluate.py)). A run holds the larger of a pass's and the curve's."""
    senders = 1 + s.n_layers * (s.n_heads + 1)  # the input, every head, every MLP
    recordings = 2 * 3 * s.n_layers
    stream = tokens * s.d_model * s.itemsize / MB
    return (recordings + 3 * senders + copies * s.n_layers) * stream, (recordings + 2 * senders) * rows * stream


def alphas_at_once(cfg: Config) -> int:
    """The copies of a pass's prompts study=circuit's gradient runs stack: EAP-IG's alphas of one node
    (edges/eap.stacks), `study.steps` of them; one for EAP and exact patching."""
    return int(cfg.study.steps) if option(cfg.study.method) in ("eap_ig", "eap_ig_activations") else 1


def fitted_passes(plan: Plan, per_pass: int, size: str) -> tuple[int, int | None, Plan]:
    """study=circuit under the budget `size`: the most prompts per gradient pass (at most `per_pass`) whose
    predicted peak fits, the most prompts whose recordings the faithfulness curve holds at once (None:
    every prompt's fit), and the plan with them; one prompt where none does (the budget's refusal then
    names the least it needs: planning.fitted)."""
    held = plan.caches_mb - plan.mask_mb  # a pass's recordings or the curve's
    # the least a run holds beside them: a 1 MB chunk
    least = plan.peak_host_mb - held - plan.working_mb + least_working(plan)
    room = kept_mb(size) - least
    fits = int(room // plan.per_prompt_mb) if plan.per_prompt_mb else per_pass
    chosen = max(1, min(per_pass, fits, plan.prompts))
    curve_prompts, curve = None, plan.curve_mb
    if curve > room and plan.curve_prompt_mb:
        curve_prompts = max(1, min(plan.prompts, int(room // plan.curve_prompt_mb)))
        curve = curve_prompts * plan.curve_prompt_mb
    caches = max(chosen * plan.per_prompt_mb, curve) + plan.mask_mb
    fitted = replace(plan, caches_mb=caches, peak_host_mb=plan.peak_host_mb - plan.caches_mb + caches, curve_mb=curve)
    return chosen, curve_prompts, fitted


def layer_mb(s: Shape) -> float:
    """One block's weights (its projections; its norms are a rounding error), MB."""
    attention = s.d_model * (2 * s.n_heads + 2 * s.n_kv) * s.d_head
    return (attention + s.d_model * s.d_mlp * (3 if s.gated else 2)) * s.itemsize / MB


def on_disk(plan: Plan, layers: int) -> Plan:
    """The plan with the last `layers` blocks' weights on disk instead of in memory (one in memory at a
    time, counted twice: read through a memory map into a tensor)."""
    change = (plan.layers_on_disk - layers) * plan.layer_mb
    change += (2 * plan.layer_mb if layers else 0.0) - (2 * plan.layer_mb if plan.layers_on_disk else 0.0)
    return replace(
        plan, weights_mb=plan.weights_mb + change, peak_host_mb=plan.peak_host_mb + change, layers_on_disk=layers
    )


def fitted(plan: Plan, chunk_mb: float, size: str) -> tuple[float, Plan]:
    """(the chunk, the plan) that keep the budget `size`: the largest chunk (fitted_chunk) with every block's
    weights in memory, else with as few of the last blocks' weights on disk as let a 1 MB chunk fit;
    refused in one line naming the least budget where even all of them on disk do not."""
    least = least_working(plan)
    budget = kept_mb(size)
    layers = plan.layers_on_disk
    while (
        layers < plan.n_layers
        and plan.layer_mb
        and on_disk(plan, layers).peak_host_mb - plan.working_mb + least > budget
    ):
        layers += 1
    moved = on_disk(plan, layers)
    return fitted_chunk(moved, chunk_mb, size), moved


def least_working(plan: Plan) -> float:
    """The least working memory the run can hold: a 1 MB chunk's where it works in the engine's chunks, else
    its own (Plan.chunked)."""
    return working_mb(1.0, plan.logits_mb, plan.copy_mb) if plan.chunked else plan.working_mb


def working_mb(chunk_mb: float, logits_mb: float, copy_mb: float = 0.0) -> float:
    """The engine's working memory at `chunk_mb`: WORKING_COPIES chunks (one copy of the prompts at least,
    `copy_mb` of a block's widest activation, however small the chunk: a long document's exceeds it), or
    the readout's logits (chunk_mb of them, one prompt's `logits_mb` at least) with their log-softmax and its
    exponent, whichever is larger: the readout unembeds the chunks' last streams once their blocks' activations
    are let go (interventions/readout.Readouts.flush)."""
    return max(WORKING_COPIES * max(chunk_mb, copy_mb), 3 * max(chunk_mb, logits_mb))


def budget_mb(size: str) -> float:
    """engine.max_memory ("512MB", "8GB") in MB."""
    return float(size[:-2]) * (1024 if size.endswith("GB") else 1)


def kept_mb(size: str) -> float:
    """What a run under engine.max_memory=`size` plans its peak to: BUDGET_SHARE of it, MB."""
    return budget_mb(size) * BUDGET_SHARE


def budget_for(peak_mb: float) -> int:
    """The least engine.max_memory (MB) whose kept_mb holds a planned peak of `peak_mb`."""
    return math.ceil(peak_mb / BUDGET_SHARE)


def fitted_chunk(plan: Plan, chunk_mb: float, size: str) -> float:
    """The largest chunk (MB, at most `chunk_mb`, at least 1) whose predicted peak fits the budget `size`
    (kept_mb; `chunk_mb` where the run's working memory is not the chunk's: Plan.chunked); refused in one
    line, naming the least budget the run needs, where even a 1 MB chunk (its own working memory) does not fit."""
    fixed = plan.peak_host_mb - plan.working_mb
    room = kept_mb(size) - fixed
    if room < least_working(plan):
        need = budget_for(fixed + least_working(plan))
        raise UsageError(
            f"engine.max_memory={size}: this run needs at least {need:,.0f}MB (weights {plan.weights_mb:,.0f}, "
            f"caches {plan.caches_mb:,.0f}, this process {plan.baseline_mb + plan.tokenizer_mb:,.0f}): headlab plan"
        )
    low, high = 1.0, chunk_mb
    if not plan.chunked or working_mb(high, plan.logits_mb, plan.copy_mb) <= room:
        return high
    for _ in range(30):  # working_mb grows with the chunk: bisect
        middle = (low + high) / 2
        low, high = (middle, high) if working_mb(middle, plan.logits_mb, plan.copy_mb) <= room else (low, middle)
    return low


def plan_prompts(cfg: Config, task: Any, seed: int) -> Plan:
    """`headlab plan`: the run's plan, no weights read (a pretrained model, by path or GGUF file), on the
    prompts `task` builds at `seed` with the model's tokenizer."""
    if option(cfg.model.kind) != "hf":
        kind = option(cfg.model.kind)
        raise UsageError(f"plan: model {cfg.model.name} is built here ({kind}): plan a pretrained one")
    baseline = rss_mb()
    shape, tokenizer = hf_shape(cfg)
    stand_in = SimpleNamespace(tokenizer=tokenizer, vocab_size=shape.vocab, module=None, name=cfg.model.name)
    data = task.build(cfg.task.n_prompts, seed=seed, model=stand_in)
    reads, vocabulary = reads_at_once(task, data), reads_vocabulary(cfg, task, data)
    plan = predict(cfg, shape, data, reads, baseline, tokenizer_mb(stand_in), vocabulary=vocabulary)
    return converting(plan, shape) if converts(cfg) else plan


def measured(plan: Plan, seconds: float) -> dict[str, Any]:
    """What a run measured, beside its plan's prediction: seconds, peak host memory and (a GPU run) the peak of
    its tensors on the device, and their ratios."""
    peak = peak_rss_mb()
    out: dict[str, Any] = {"seconds": round(seconds, 2), "peak_host_mb": round(peak, 1)}
    out["peak_host_ratio"] = round(plan.highest_host_mb / peak, 3)
    if plan.peak_device_mb and torch.cuda.is_available():
        on_device = torch.cuda.max_memory_allocated(torch.device(plan.device)) / MB
        out["peak_device_mb"] = round(on_device, 1)
        if on_device:
            out["peak_device_ratio"] = round(plan.peak_device_mb / on_device, 3)
    if plan.seconds:
        out["seconds_ratio"] = round(plan.seconds / seconds, 3)
    return out


def tokenizer_mb(model: Any) -> float:
    """A loaded model's tokenizer's memory, estimated from its vocabulary (TOKENIZER_KB an entry)."""
    return 0.0 if model.tokenizer is None else len(model.tokenizer) * TOKENIZER_KB / 1024


def shape_of_model(model: Any) -> Shape:
    """A loaded model's shape (HookedModel): its Hugging Face config's where it has one, else its sites'."""
    params = sum(p.numel() for p in model.module.parameters())
    itemsize = next(model.module.parameters()).element_size()
    config = getattr(model.module, "config", None)
    if config is not None and hasattr(config, "num_hidden_layers"):
        return replace(shape_of_config(config, params, itemsize), suffixes=model.runs_suffixes)
    sites = model.sites
    return Shape(
        model.n_layers, model.n_heads, sites.n_kv_heads, sites.d_head, sites.d_model, model.width,
        int(model.vocab_size or 0), False, params, itemsize, suffixes=model.runs_suffixes,
    )  # fmt: skip
