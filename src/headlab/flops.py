"""What a run computes, counted from the shapes alone: the matrix-product FLOPs of a block, of a sweep's
stacked passes (path patching's two passes included) and of EAP / EAP-IG's scoring and faithfulness curve,
and this machine's matmul rate to divide them by. planning.py turns them into the plan's time; the suite
holds each count to torch's own count of what the engine executes (tests/test_planning.py)."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

import torch

from .config import Config, option


@dataclass(frozen=True)
class Shape:
    """What the plan reads of a model: its sizes and its parameter count."""

    n_layers: int
    n_heads: int
    n_kv: int
    d_head: int
    d_model: int
    d_mlp: int
    vocab: int
    gated: bool  # a gated MLP (three projections; GPT-2's has two)
    params: int
    itemsize: int  # bytes per parameter as the run holds them
    window: int | None = None  # the sliding window of the layers that have one
    sliding: tuple[bool, ...] = ()  # per layer: has a sliding window


def block_flops(s: Shape, rows: int, tokens: int, layer: int) -> tuple[float, float]:
    """Matrix-product FLOPs of one block over `rows` prompts of `tokens` positions: (the q, k, v and output
    projections and the MLP, the scores and the weighted sum over the causal keys within a sliding window)."""
    per_token = 2 * s.d_model * (s.n_heads + 2 * s.n_kv) * s.d_head + 2 * s.n_heads * s.d_head * s.d_model
    per_token += 2 * s.d_model * s.d_mlp * (3 if s.gated else 2)
    reach = s.window if s.sliding and s.sliding[layer] and s.window else tokens
    pairs = sum(min(q + 1, reach) for q in range(tokens))
    return rows * tokens * per_token, rows * 4 * s.n_heads * s.d_head * pairs


def sweep_gflop(cfg: Config, s: Shape, data: Any) -> tuple[int, float | None]:
    """(interventions, GFLOP) of study=sweep's stacked passes over the prompts `data` (TaskData): each
    intervention runs the blocks from its layer on (the clean run all of them), each group of prompts of like
    length through its own longest (interventions/lengths.py, as the engine runs them), and reads the logits
    at the read positions; path patching (every prompt whole, as interventions/path.py runs a sweep's
    senders) its two passes (path_flops). None where the sweep attributes (no time model yet)."""
    from .interventions.lengths import groups
    from .interventions.plan import plan
    from .vocabulary import Method

    ones = {layer: [1.0] * s.n_heads for layer in range(s.n_layers)}  # the uniform sweep's scales: shapes only
    interventions = plan(cfg, s.n_layers, s.n_heads, ones, {})
    if any(iv.method == Method.attribution for iv in interventions):
        return len(interventions), None
    paths = [iv for iv in interventions if iv.method == Method.path]
    others = [iv for iv in interventions if iv.method != Method.path]
    rows, tokens = data.inputs["input_ids"].shape
    reads = data.positions.shape[1]
    grouped = groups(data, others)
    sizes = [(rows, tokens)] if grouped is None else [(len(g), length) for g, length in grouped]
    total = 0.0
    for n, length in sizes:
        blocks = [sum(block_flops(s, n, length, layer)) for layer in range(s.n_layers)]
        logits = n * reads * 2 * s.d_model * s.vocab
        total += sum(sum(blocks[min(iv.layer or 0, s.n_layers - 1) :]) + logits for iv in others)
    blocks = [sum(block_flops(s, rows, tokens, layer)) for layer in range(s.n_layers)]
    if paths:  # path_patch's clean run and a trace of the senders' prompts, each read out, then the senders
        logits = rows * reads * 2 * s.d_model * s.vocab
        total += 2 * (sum(blocks) + logits) + sum(path_flops(iv, blocks, logits) for iv in paths)
    methods = {iv.method for iv in interventions}
    if data.reference is not None and methods & {Method.mean, Method.resample, Method.path}:
        ref_rows, ref_tokens = data.reference["input_ids"].shape  # the values taken: a run of the reference set
        total += sum(sum(block_flops(s, ref_rows, ref_tokens, layer)) for layer in range(s.n_layers))
    if data.counterfactual is not None and Method.activation in methods:
        total += sum(blocks)  # the counterfactual run
    return len(interventions), total / 1e9


def path_flops(iv: Any, blocks: list[float], logits: float) -> float:
    """FLOPs of path patching from the sender `iv` over every position (interventions/path.py): into the
    logits, the blocks from its layer on; into receiver heads, pass A from its layer through the last
    receiver's and pass B from the first receiver's on, where a receiver sits after it (else nothing runs)."""
    from .interventions.plan import LOGITS, receiver_heads

    layer = iv.layer or 0
    if iv.receivers == LOGITS:
        return sum(blocks[layer:]) + logits
    downstream = [r for r in receiver_heads(iv.receivers) if r > layer]
    if not downstream:
        return 0.0
    return sum(blocks[layer : max(downstream) + 1]) + sum(blocks[min(downstream) :]) + logits


def matmul_gflops(s: Shape, rows: int, seconds: float = 0.3) -> float:
    """This machine's float32 rate (GFLOP/s) on the blocks' widest product, [rows, d_model] @ [d_model, d_mlp],
    with the threads torch has now."""
    a, b = torch.randn(max(rows, 64), s.d_model), torch.randn(s.d_model, s.d_mlp)
    torch.matmul(a, b)
    count, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < seconds:
        torch.matmul(a, b)
        count += 1
    return 2 * a.shape[0] * s.d_model * s.d_mlp * count / elapsed / 1e9


def circuit_gflop(cfg: Config, s: Shape, data: Any) -> tuple[float, float] | None:
    """(EAP / EAP-IG's scoring, the faithfulness curve's) matrix-product GFLOP of study=circuit over the
    prompts `data`, each pass over its prompts' groups of like length (lengths.parts, as they run); None for
    the methods without a time model (EAP-IG over activations, exact patching).

    Scoring, per pass of `study.prompts_per_pass` prompts: two recordings (a forward pass each) and, per
    gradient run (EAP one, EAP-IG `steps`; again at twice the steps with study.convergence), a forward and a
    backward pass (three) and every sender's difference times every receiver's gradient. The curve: the
    two recordings, then per circuit measured (two per fraction, and the bisection's) a forward pass with
    each receiver's input summed from its upstream senders' differences: counted for every receiver, the
    most a circuit can keep."""
    from .interventions.lengths import parts

    c = cfg.study
    method = option(c.method)
    if method not in ("eap", "eap_ig"):
        return None
    runs = [1] if method == "eap" else [c.steps, 2 * c.steps] if c.convergence else [c.steps]
    ungrouped = option(c.kv_edges) == "ungrouped"
    attention = s.n_heads * (3 if ungrouped else 1) + (0 if ungrouped else 2 * s.n_kv)  # a layer's q/k/v receivers
    upstream = [1 + layer * (s.n_heads + 1) for layer in range(s.n_layers)]  # the input, earlier heads and MLPs
    senders, receivers = upstream[-1] + s.n_heads + 1, s.n_layers * (attention + 1) + 1
    edges = sum(u * attention + u + s.n_heads for u in upstream) + senders
    curve_circuits = 2 * len(c.fractions) + math.ceil(math.log2(edges)) if c.faithfulness else 0

    def forward(n: int, tokens: int) -> float:
        return sum(sum(block_flops(s, n, tokens, layer)) for layer in range(s.n_layers))

    def per_pass(n: int, tokens: int) -> float:
        run = 3 * forward(n, tokens) + 2 * senders * receivers * n * tokens * s.d_model
        return sum(2 * forward(n, tokens) + steps * run for steps in runs)

    def curve(n: int, tokens: int) -> float:
        mixtures = sum(2 * (attention + 1) * u * n * tokens * s.d_model for u in upstream)
        return 2 * forward(n, tokens) + curve_circuits * (forward(n, tokens) + mixtures)

    size = lambda part: (part.n, next(iter(part.inputs.values())).shape[1])  # noqa: E731
    per = int(c.prompts_per_pass)
    scoring = sum(
        per_pass(*size(part)) for i in range(0, data.n, per) for _, part in parts(data.take(slice(i, i + per)))
    )
    faithfulness = sum(curve(*size(part)) for _, part in parts(data)) if curve_circuits else 0.0
    return scoring / 1e9, faithfulness / 1e9
