"""What a run computes, counted from the shapes alone: the matrix-product FLOPs of a block, of a sweep's
stacked passes (path patching's two passes included) and of EAP / EAP-IG's scoring and faithfulness curve,
and this machine's matmul rate to divide them by. planning.py turns them into the plan's time; the suite
holds each count to torch's own count of what the engine executes (tests/test_planning.py)."""

from __future__ import annotations

import math
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from .config import Config, option

# a gradient pass's backward layer in block runs: the block run again under autograd, then its backward (about
# twice a forward pass's work)
BACKWARD_RUNS = 3
RATE_WINDOWS = 5  # product_rate's windows, the best of which it keeps


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
    tied: bool = True  # the unembedding is the embedding's matrix (one [vocab, d_model] matrix, not two)
    suffixes: bool = True  # its blocks run on a suffix of positions (HookedModel.runs_suffixes)


def block_flops(s: Shape, rows: int, tokens: int, layer: int) -> tuple[float, float]:
    """Matrix-product FLOPs of one block over `rows` prompts of `tokens` positions: (the q, k, v and output
    projections and the MLP, the scores and the weighted sum over the causal keys within a sliding window)."""
    per_token = 2 * s.d_model * (s.n_heads + 2 * s.n_kv) * s.d_head + 2 * s.n_heads * s.d_head * s.d_model
    per_token += 2 * s.d_model * s.d_mlp * (3 if s.gated else 2)
    reach = s.window if s.sliding and s.sliding[layer] and s.window else tokens
    reach = min(reach, tokens)  # query q attends to min(q + 1, reach) keys
    pairs = reach * (reach + 1) // 2 + (tokens - reach) * reach
    return rows * tokens * per_token, rows * 4 * s.n_heads * s.d_head * pairs


def replayed_flops(s: Shape, rows: int, tokens: int) -> float:
    """Matrix-product FLOPs of a block whose attention is replayed (HookedModel.run_blocks' `replay`: every
    head's z given, so no q, k, v or scores): its output projection and MLP over `rows` x `tokens` positions."""
    return rows * tokens * (2 * s.n_heads * s.d_head * s.d_model + 2 * s.d_model * s.d_mlp * (3 if s.gated else 2))


def read_block_flops(s: Shape, rows: int, tokens: int, reads: int) -> float:
    """Matrix-product FLOPs of the last block where only `reads` positions a prompt are read (run_blocks'
    `read`): its attention at every position, its MLP at the read ones."""
    mlp = 2 * s.d_model * s.d_mlp * (3 if s.gated else 2)
    return sum(block_flops(s, rows, tokens, s.n_layers - 1)) - rows * (tokens - reads) * mlp


def forward_flops(s: Shape, rows: int, tokens: int) -> float:
    """Matrix-product FLOPs of a forward pass through every block over `rows` prompts of `tokens` positions."""
    return sum(sum(block_flops(s, rows, tokens, layer)) for layer in range(s.n_layers))


def uniform_sweep(cfg: Config, s: Shape) -> list[Any]:
    """The interventions study=sweep plans for `cfg` on a model of shape `s` (the uniform sweep's scales:
    shapes only)."""
    from .interventions.plan import plan

    return plan(cfg, s.n_layers, s.n_heads, {layer: [1.0] * s.n_heads for layer in range(s.n_layers)}, {})


def most_in_one_layer(interventions: list[Any]) -> int:
    """The most of a sweep's `interventions` at one layer: the engine stacks a chunk's copies within a layer
    (interventions/engine.py), so no chunk holds more."""
    from .vocabulary import Kind

    layers = Counter(iv.layer for iv in interventions if iv.intervention != Kind.none)
    return max(layers.values(), default=0)


def sweep_gflop(cfg: Config, s: Shape, data: Any, interventions: list[Any] | None = None) -> tuple[int, float]:
    """(interventions, GFLOP) of study=sweep's stacked passes over the prompts `data` (TaskData): each
    intervention runs the blocks from its layer on (the clean run all of them), each group of prompts of like
    length through its own longest (interventions/lengths.py, as the engine runs them), from the first
    position it edits or any metric reads where the model runs suffixes (engine._run_stacked), and reads the
    logits at the read positions; path patching its two passes (path_flops); attribution patching's passes
    (attribution_gflop). `interventions`: uniform_sweep's, where the caller has them already."""
    from .interventions.edits import Sources, first_edited
    from .interventions.lengths import bucket, groups
    from .vocabulary import Kind, Method

    interventions = uniform_sweep(cfg, s) if interventions is None else interventions
    attributed = [iv for iv in interventions if iv.method == Method.attribution]
    paths = [iv for iv in interventions if iv.method == Method.path]
    others = [iv for iv in interventions if iv.method not in (Method.path, Method.attribution)]
    if attributed and all(iv.intervention == Kind.none for iv in others):  # the clean run: the estimate's own
        others = []
    rows, tokens = data.inputs["input_ids"].shape
    reads = data.positions.shape[1]
    sources = Sources.of_prompts(data, s.n_heads)
    grouped = groups(data, others)
    parts = (
        [(data, sources)]
        if grouped is None
        else [(p, sources.subset(r, p)) for r, l in grouped for p in [bucket(data, r, l)]]
    )
    suffixes = s.suffixes and any(first_edited(iv, sources) for iv in others)
    total = 0.0
    for part, of_part in parts:
        n, length = part.inputs["input_ids"].shape
        first_read = int(part.positions.min())
        starts = [
            min(first_read, first_edited(iv, of_part)) if suffixes and iv.intervention != Kind.none else 0
            for iv in others
        ]
        for start in set(starts):  # each intervention from its layer on, at positions start..
            per_layer = [positions_flops(s, n, start, length - 1, layer) for layer in range(s.n_layers)]
            total += sum(
                sum(per_layer[min(iv.layer or 0, s.n_layers - 1) :]) + n * reads * 2 * s.d_model * s.vocab
                for iv, at in zip(others, starts)
                if at == start
            )
    if paths:  # path_patch's clean run and a trace of the senders' prompts, each read out, then the senders
        total += 2 * (forward_flops(s, rows, tokens) + rows * reads * 2 * s.d_model * s.vocab)
        total += path_flops(s, data, paths, reads)
    if attributed:
        total += attribution_gflop(s, data, attributed) * 1e9
    methods = {iv.method for iv in interventions}
    if data.reference is not None and methods & {Method.mean, Method.resample, Method.path}:
        ref_rows, ref_tokens = data.reference["input_ids"].shape  # the values taken: a run of the reference set
        total += forward_flops(s, ref_rows, ref_tokens)
    if data.counterfactual is not None and Method.activation in methods:
        total += forward_flops(s, rows, tokens)  # the counterfactual run
    return len(interventions), total / 1e9


def attribution_gflop(s: Shape, data: Any, interventions: list) -> float:
    """GFLOP of attribution patching (interventions/attribution_patching.py) over the prompts `data`, a pass
    of PROMPTS_PER_PASS prompts at a time: a forward pass of the counterfactual prompts per site attributed,
    the clean trace and its logits, and a block at a time its forward pass again and its backward pass to
    the block's input (the weights frozen: a forward's products again). Where the task names no vocabulary
    rows for its quantity (Task.vocab_rows), the gradient also goes back through the whole unembedding: a
    second readout's products, not counted here."""
    from .interventions.attribution_patching import PROMPTS_PER_PASS
    from .vocabulary import Site

    sites = len({iv.site or Site.z for iv in interventions})
    rows, tokens = data.inputs["input_ids"].shape
    total = 0.0
    for first in range(0, rows, PROMPTS_PER_PASS):
        n = min(PROMPTS_PER_PASS, rows - first)
        total += (sites + 3) * forward_flops(s, n, tokens) + n * data.positions.shape[1] * 2 * s.d_model * s.vocab
    return total / 1e9


def path_flops(s: Shape, data: Any, senders: list[Any], reads: int = 1) -> float:
    """FLOPs of path patching from `senders` (Interventions) over the prompts `data` as interventions/path.py
    runs them: the senders that share receivers, site and position together, their prompts grouped by their
    round position (none given: every position, one group) and last read position, each group's clean traces
    and each sender's two passes (path_part_flops)."""
    from .interventions.edits import Sources
    from .interventions.plan import receiver_heads

    rows, tokens = data.inputs["input_ids"].shape
    sources = Sources.of_prompts(data, s.n_heads)
    together: dict[tuple, list[Any]] = {}
    for iv in senders:
        together.setdefault((iv.receivers, iv.site, iv.token, iv.position), []).append(iv)
    total = 0.0
    for (receivers, *_), ivs in together.items():
        heads, layers = sorted(receiver_heads(receivers)), [iv.layer or 0 for iv in ivs]
        place = sources.position(ivs[0])
        if place is None:
            total += path_group_flops(s, layers, heads, rows, None, tokens - 1, reads)
            continue
        at = place.cpu().long() if isinstance(place, torch.Tensor) else torch.full((rows,), place % tokens)
        total += path_groups_flops(s, layers, heads, at, data.positions.max(1).values.cpu(), reads)
    return total


def path_groups_flops(s: Shape, layers: list[int], heads: list[int], at: Any, last: Any, reads: int) -> float:
    """path_group_flops over the prompts grouped, as interventions/path.py groups them, by their round
    position `at` [n] and last read position `last` [n]."""
    groups = Counter(zip(at.tolist(), last.tolist()))
    return sum(path_group_flops(s, layers, heads, rows, a, b, reads) for (a, b), rows in groups.items())


def path_group_flops(
    s: Shape, layers: list[int], heads: list[int], rows: int, at: int | None, last: int, reads: int
) -> float:
    """FLOPs of path patching from senders at `layers` into receivers at the layers `heads` over one group of
    `rows` prompts (round position `at`, last read position `last`): its clean traces, through the last read
    position and, for receiver heads whose round position comes before it, through that, and each sender's
    two passes (path_part_flops)."""
    a_end = last + 1 if at is None or not heads or at >= last else at + 1
    traces = forward_flops(s, rows, a_end) + (forward_flops(s, rows, last + 1) if a_end != last + 1 else 0.0)
    return traces + sum(path_part_flops(s, layer, heads, rows, at, last, reads) for layer in layers)


def path_part_flops(s: Shape, layer: int, heads: list[int], rows: int, at: int | None, last: int, reads: int) -> float:
    """FLOPs of path patching from a sender at `layer` (interventions/path.py) over `rows` prompts whose round
    position is `at` (None: every position) and last read position `last`, into receiver heads at the layers
    `heads` (none: the logits). Pass A from its layer, every layer without receivers replayed (its heads at
    their clean z), through the last receiver's layer (the logits: every layer, read out), over the positions
    from the round's (on families that run suffixes) through the round's (into heads) or the last read one;
    pass B from the first receiver layer after it over the positions from the round's to the last read one,
    read out. Nothing where no receiver sits after it, or the round's position comes after every read one."""
    downstream = [r for r in heads if r > layer]
    if (heads and not downstream) or (at is not None and at > last):
        return 0.0
    start = at if at is not None and s.suffixes else 0
    a_last = at if at is not None and heads and at < last else last
    readout = rows * reads * 2 * s.d_model * s.vocab
    stop = max(downstream) + 1 if heads else s.n_layers
    pass_a = sum(
        positions_flops(s, rows, start, a_last, l) if l in heads else replayed_flops(s, rows, a_last + 1 - start)
        for l in range(layer, stop)
    )
    if not heads:
        return pass_a + readout
    return pass_a + sum(positions_flops(s, rows, start, last, l) for l in range(min(downstream), s.n_layers)) + readout


def matmul_gflops(
    s: Shape, rows: int, seconds: float = 0.3, device: str = "cpu", dtype: torch.dtype = torch.float32
) -> float:
    """This machine's rate (GFLOP/s) on the blocks' widest product, [rows, d_model] @ [d_model, d_mlp], in the
    run's `dtype` (bfloat16 runs near 10 times float32's rate on an H200, under half of it on these CPUs),
    with the threads torch has now (on `device`: a GPU's, each product waited for)."""
    a = torch.randn(max(rows, 64), s.d_model, device=device, dtype=dtype)
    b = torch.randn(s.d_model, s.d_mlp, device=device, dtype=dtype)
    return product_rate(a, b, seconds)


def product_rate(a: Tensor, b: Tensor, seconds: float) -> float:
    """GFLOP/s of a @ b over `seconds`, after one product to warm up, each waited for on a GPU: the best of
    RATE_WINDOWS windows, since a window that other work (or the threads waking) slowed tells the rate of that
    moment, not of the run (one 0.3 s window gave 50 and 171 GFLOP/s in two plans a minute apart)."""
    wait = torch.cuda.synchronize if a.is_cuda else (lambda: None)
    torch.matmul(a, b)
    wait()
    best = 0.0
    for _ in range(RATE_WINDOWS):
        count, start = 0, time.perf_counter()
        while (elapsed := time.perf_counter() - start) < seconds / RATE_WINDOWS:
            torch.matmul(a, b)
            wait()
            count += 1
        best = max(best, 2 * a.shape[0] * a.shape[1] * b.shape[1] * count / elapsed / 1e9)
    return best


@dataclass(frozen=True)
class CircuitFlops:
    """study=circuit's matrix-product GFLOP: scoring's model passes (recordings, forward, backward; exact
    patching's stacked blocks), scoring's sender-by-receiver products (EAP, EAP-IG: [senders, prompts x
    tokens x d_model] @ [that, a layer's receivers], a shape of their own) and the faithfulness curve's."""

    passes: float
    products: float
    curve: float
    # scoring's blocks run one at a time, each a fixed cost beside its FLOPs (planning.BLOCK_RUN_S): a forward
    # block counts one, a backward layer BACKWARD_RUNS (the block run again under autograd, then its backward)
    block_runs: int = 0

    @property
    def scoring(self) -> float:
        return self.passes + self.products

    @property
    def total(self) -> float:
        return self.passes + self.products + self.curve


def circuit_gflop(cfg: Config, s: Shape, data: Any) -> CircuitFlops | None:
    """EAP / EAP-IG's scoring (its passes and its products) and the faithfulness curve's matrix-product GFLOP
    of study=circuit over the prompts `data`, each pass over its prompts' groups of like length (lengths.parts,
    as they run).

    Scoring, per pass of `study.prompts_per_pass` prompts: two recordings (a forward pass each) and, per gradient
    run (EAP one, EAP-IG `steps`, EAP-IG over activations `steps` per node; with study.convergence the `steps` odd
    alphas of twice the steps again), a forward pass (over activations: from the node's layer on; EAP: none, its
    gradient run is the clean recording), each block run again and its backward pass (two more), and, once per
    node for all its alphas, each layer's receivers' gradients times the differences of the senders upstream of
    them (edges/eap.py). Exact patching (edges/exact.py): the two
    recordings, then per edge into a layer's receivers the blocks from that layer on over its prompts (edges into
    the logits read out alone). The curve: the two recordings (again for each bisection step where
    study.curve_prompts holds fewer prompts than the run's), then per circuit measured (two per fraction, and the
    bisection's) a forward pass with each receiver's input summed from its upstream senders' differences: counted
    for every receiver, the most a circuit can keep."""
    from .interventions.lengths import parts, passes

    c = cfg.study
    method = option(c.method)
    if method not in ("eap", "eap_ig", "eap_ig_activations", "exact"):
        return None
    # each set's alphas per node (edges/eap.doubled_steps runs twice the steps' odd alphas alone)
    runs = [1] if method == "eap" else [c.steps, c.steps] if c.convergence else [c.steps]
    senders, attention = edge_nodes(s, option(c.kv_edges))
    upstream = [1 + layer * (s.n_heads + 1) for layer in range(s.n_layers)]  # the input, earlier heads and MLPs
    edges = sum(u * attention + u + s.n_heads for u in upstream) + senders
    curve_circuits = 2 * len(c.fractions) + math.ceil(math.log2(edges)) if c.faithfulness else 0

    # where each gradient run's forward pass starts: the input (EAP-IG), each node's layer (over activations:
    # the input, every layer's attention and MLP; edges/eap.runs_at), or nowhere (EAP's gradient run is the
    # clean run, whose recording it reads)
    starts = [0] + [layer for layer in range(s.n_layers) for _ in range(2)] if method == "eap_ig_activations" else [0]
    starts = [s.n_layers] if method == "eap" else starts

    # each node's alphas run stacked (edges/eap.stacks): per set of alphas, a node's forward blocks from its
    # start and every layer's backward, whatever the steps
    stack_runs = sum(s.n_layers - start + BACKWARD_RUNS * s.n_layers for start in starts)

    def per_pass(n: int, tokens: int) -> tuple[float, float]:
        blocks = [sum(block_flops(s, n, tokens, layer)) for layer in range(s.n_layers)]
        alpha = sum(2 * sum(blocks) + sum(blocks[start:]) for start in starts)  # one alpha's runs
        # a layer's receivers by the senders up to its MLP's (the most any of them reads), the logits by all
        product_rows = sum((u + s.n_heads) * (attention + 1) for u in upstream) + senders
        products = len(starts) * 2 * product_rows * n * tokens * s.d_model  # a node's alphas' gradients summed first
        return sum(2 * sum(blocks) + steps * alpha for steps in runs), len(runs) * products

    # the curve's recordings held for fewer prompts than the run's: each bisection step records them again
    again = math.ceil(math.log2(edges)) if c.faithfulness and (c.curve_prompts or data.n) < data.n else 0

    def curve(n: int, tokens: int) -> float:
        mixtures = sum(2 * (attention + 1) * u * n * tokens * s.d_model for u in upstream)
        forward = forward_flops(s, n, tokens)
        return 2 * (1 + again) * forward + curve_circuits * (forward + mixtures)

    def exact(n: int, tokens: int) -> float:
        blocks = [sum(block_flops(s, n, tokens, layer)) for layer in range(s.n_layers)]
        into = [u * attention + u + s.n_heads for u in upstream]  # a layer's q/k/v receivers' edges, its MLP's
        last = read_block_flops(s, n, tokens, data.positions.shape[1])  # an edge's copies read the metric alone
        return 2 * sum(blocks) + sum(e * (sum(blocks[layer:-1]) + last) for layer, e in enumerate(into))

    per = int(c.prompts_per_pass)
    block_runs = 0
    if method == "exact":
        scoring = (exact(*part_size(data)), 0.0)  # all prompts at once, padded to the longest (edges/exact.py)
    else:
        each = [per_pass(*part_size(part)) for part in passes(data, per)]
        scoring = (sum(e[0] for e in each), sum(e[1] for e in each))
        block_runs = len(each) * (2 * s.n_layers + len(runs) * stack_runs)  # the two recordings, then the stacks
    faithfulness = sum(curve(*part_size(part)) for _, part in parts(data)) if curve_circuits else 0.0
    return CircuitFlops(scoring[0] / 1e9, scoring[1] / 1e9, faithfulness / 1e9, block_runs)


def part_size(part: Any) -> tuple[int, int]:
    """(prompts, tokens) of a pass's TaskData, padded to its longest."""
    return part.n, next(iter(part.inputs.values())).shape[1]


def edge_nodes(s: Shape, kv_edges: str) -> tuple[int, int]:
    """(senders: the input, every head and MLP; a layer's attention receivers: its heads' q, k and v inputs,
    or per key/value head under kv_edges=grouped) of the edge graph (edges/graph.py)."""
    ungrouped = kv_edges == "ungrouped"
    return 1 + s.n_layers * (s.n_heads + 1), s.n_heads * (3 if ungrouped else 1) + (0 if ungrouped else 2 * s.n_kv)


def product_gflops(
    senders: int,
    receivers: int,
    inner: int = 2**15,
    seconds: float = 0.2,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> float:
    """This machine's rate (GFLOP/s) on EAP's product shape, [senders, inner] @ [inner, receivers], in the
    model's `dtype` as edges/eap.py multiplies: few receivers make it several times slower than the blocks'
    products (gemma3-270m's 7 a layer)."""
    a = torch.randn(senders, inner, device=device, dtype=dtype)
    b = torch.randn(receivers, inner, device=device, dtype=dtype)
    return product_rate(a, b.T, seconds)


def positions_flops(s: Shape, rows: int, first: int, last: int, layer: int) -> float:
    """FLOPs of block `layer` over positions first..last of `rows` prompts, each attending to every key
    before it (a suffix after clean prefix keys, as path patching runs)."""
    return sum(block_flops(s, rows, last + 1, layer)) - sum(block_flops(s, rows, first, layer))


def path_round_flops(s: Shape, at: Any, last: Any, receiver_layer: int | None) -> float:
    """FLOPs of one path-patching round as interventions/path.py runs it, every head before the receivers'
    layer a sender (the logits: every head), prompts grouped by their round position `at` [n] and last read
    position `last` [n] (path_group_flops), each sender's logits read at one position."""
    heads = [] if receiver_layer is None else [receiver_layer]
    layers = [l for l in range(s.n_layers if receiver_layer is None else receiver_layer) for _ in range(s.n_heads)]
    return path_groups_flops(s, layers, heads, at, last, 1)


def ioi_classes_gflop(s: Shape, data: Any, n_seq: int = 100, seq_len: int = 20) -> tuple[float, float]:
    """(GFLOP of study=ioi_classes over the IOI prompts `data`, of which the rounds into receiver heads):
    the head scores (repeated random sequences, a forward pass of the prompts for the scores and one for the
    role attention, and every head's copy score: its value at IO read out through the whole vocabulary,
    twice), and the five path-patching rounds, with the reference run of the prompts (one for the rounds
    without a knockout, one for the backup round's) and every sender's logits (io_prob reads the whole
    vocabulary); the clean quantities are read from the rounds' own clean traces. The q, v and k
    rounds' receivers are the classes the earlier rounds find, unknown before the run: each is counted with
    its receivers at the one layer that costs most (analysis/ioi_classes.py ROUNDS: q at END, v at S2, k at
    S1+1); receivers found over several layers cost somewhat more (pass A to the last, pass B from the
    first)."""
    roles = data.token_positions
    rows, tokens = data.inputs["input_ids"].shape
    last = data.positions.max(1).values
    scores = forward_flops(s, n_seq, 2 * seq_len + 1) + 2 * forward_flops(s, rows, tokens)
    scores += 2 * s.n_layers * s.n_heads * rows * 2 * s.d_model * s.vocab
    runs = 2 * forward_flops(s, rows, tokens)  # the senders' reference run, and again with the knockout
    logits = 2 * path_round_flops(s, roles["END"], last, None)  # into the logits, again with the knockout
    heads = sum(
        max(path_round_flops(s, roles[role] + shift, last, layer) for layer in range(1, s.n_layers))
        for role, shift in (("END", 0), ("S2", 0), ("S1", 1))
    )
    return (scores + runs + logits + heads) / 1e9, heads / 1e9
