"""Speed and accuracy of headlab's edge-level circuit discovery against a per-edge TransformerLens loop.

Model: a GPT-2-small-shaped GPT2LMHeadModel (12 layers x 12 heads, d_model 768, vocab 50257) with random
weights (torch seed 0, `--init-range` as GPT2Config.initializer_range; 0.02 is GPT-2's own init std),
saved with save_pretrained and loaded by headlab (`load_hf`), and the same weights as a TransformerLens
HookedTransformer built offline (bench_models.build_hooked_transformer: raw weights, no LN folding,
centering or value-bias folding). Edge graph: the EAP-IG / MIB convention (headlab.edges.graph), senders
input / heads / MLPs, receivers each head's q, k, v inputs, each MLP input and the logits.
Prompts: `--prompts` random token rows of `--tokens` tokens; each counterfactual is its prompt with
`--changed` random positions given other random tokens (same length). Metric: logit[5335] - logit[1757]
at the last position, averaged over prompts (a LogitDiff task with smooth_quantity = "logit_diff").
Every score is the change in that mean metric when one edge is patched from the counterfactual run.

Printed lines (`name: value`):
  model, prompts, tokens_per_prompt, changed_tokens, init_range, torch_threads, transformerlens, chunk_mb
                                   the setup
  edges                            edges in the graph (32,491 for GPT-2 small)
  clean_metric, corrupt_metric     mean logit diff on the clean / counterfactual prompts (headlab)
  eap_seconds                      headlab `scores(method="eap")` for every edge (after a 2-prompt warm-up),
                                   timed in a subprocess of its own (`--only eap`): the min of `--repeats` calls
  eap_ig_seconds                   the same for `method="eap_ig"`, `--steps` interpolation steps (one call)
  exact_sample_edges               edges in the exact sample: spread over receiver layers in proportion to
                                   their edge counts, at least 4 per receiver layer and the logits, at least
                                   one MLP receiver per layer, the rest at random (seed 2)
  exact_seconds                    headlab `exact_scores(which=sample)` on that sample (one call)
  exact_seconds_all_extrapolated   fixed + (exact_seconds - fixed) * edges / sample, where fixed is an
                                   `exact_scores` call with no edge (two recording passes and the clean metric)
  exact_sample_mean_abs_effect, exact_sample_max_abs_effect
                                   size of the exact effects on the sample, so that the agreements below are
                                   not a trivial 0 == 0
  tl_sample_edges                  edges patched by the TransformerLens loop: taken from the exact sample,
                                   round-robin over receiver kinds (q, k, v, mlp, logits) and sender kinds
  tl_exact_loop_seconds_per_edge   the min over the sample's edges of one full `run_with_hooks` forward pass, with
                                   use_split_qkv_input, use_attn_result and use_hook_mlp_in on: the sender's
                                   difference (corrupt - clean; hook_embed + hook_pos_embed for the input,
                                   blocks.l.attn.hook_result[:, :, h] for a head, blocks.l.hook_mlp_out for an
                                   MLP, from two cached runs) added at the receiver's hook only
                                   (blocks.l.hook_{q,k,v}_input[:, :, h], blocks.l.hook_mlp_in, or
                                   blocks.11.hook_resid_post for the logits); every edge costs the same pass,
                                   so the min is the time least disturbed by other work, as for eap_seconds
  tl_exact_loop_seconds_per_edge_median
                                   the median over the edges
  tl_exact_loop_seconds_all_extrapolated
                                   the two cached runs + seconds per edge * edges
  tl_sample_max_abs_effect         the largest |effect| among the TL loop's edges
  max_abs_diff_exact_vs_transformerlens
                                   max |headlab exact - TL loop| over the TL sample (the script exits non-zero
                                   above 1e-3; float32 noise is about 1e-6 here)
  max_abs_diff_edge                the edge where it is largest, with both values
  peak_rss_mb_eap, peak_rss_mb_eap_ig
                                   the peak resident set (VmHWM, reset through /proc/self/clear_refs just
                                   before the timed call) of the `--only` subprocess during its timed call:
                                   the model, the prompts and everything the method allocates
  baseline_rss_mb                  that subprocess's resident set just before the timed call (model weights,
                                   prompts, Python and torch)
  peak_rss_mb_per_million_edges_eap
                                   (peak_rss_mb_eap - baseline_rss_mb) / (edges / 1e6): the memory eap itself
                                   adds to the process above the loaded model, spread over this graph's edges.
                                   Not a per-edge cost: it grows with senders x prompts_per_pass x tokens x
                                   d_model (the activation differences), not with the edges; it scales only to
                                   graphs of this shape at these prompts and tokens
  eap_vs_exact_pearson             Pearson r of eap and exact scores over the exact sample
  peer_auto_circuit, peer_eap_ig   the peer implementations (see PEER_* below)
  load_average_1min                the machine's 1-minute load average when the script started and ended: all
                                   timings are wall-clock seconds, inflated by whatever else runs (on 2 shared
                                   cores eap took from 7 s to 28 s from one run to the next)
  eap_speedup_vs_exact_loop        tl_exact_loop_seconds_all_extrapolated / eap_seconds
  eap_ig_vs_exact_pearson          Pearson r of eap_ig and exact scores over the exact sample (last line)

Before the baseline is read the worker returns freed heap memory to the system (malloc_trim): building the
model leaves a second copy's worth in glibc's heap, which tune_allocator would otherwise keep resident.
Timings are wall-clock, on whatever else the machine runs: compare runs only at similar load averages.

Run from the repo root: .venv/bin/python benchmarks/circuit_speed.py [--prompts 16] [--exact-sample 200]
[--tl-sample 20] [--threads N]   (`make circuit-bench`; 4 to 10 minutes on 2 shared CPU cores)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing here needs the hub
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch
from torch import Tensor

from bench_models import (
    D_MODEL,
    N_HEADS,
    N_LAYERS,
    TOKEN_A,
    TOKEN_B,
    LogitDiff,
    build,
    make_data,
    reset_peak,
    status_kb,
)
from headlab.edges.eap import scores
from headlab.edges.exact import exact_scores
from headlab.edges.graph import EdgeGraph
from headlab.runtime import tune_allocator
from headlab.tasks import TaskData

TOLERANCE = 1e-3
# Peers, checked by hand on 2026-11-23 (a pip dry-run in a throwaway venv takes minutes and the network, too
# much for a benchmark run; the script only checks whether auto_circuit imports here):
#   auto-circuit 1.0.1 (PyPI, its latest): `pip install auto-circuit torch==2.13.0 transformers==5.23.0
#   transformer-lens==3.9.0` resolves and installs without changing torch, transformers or transformer-lens (it
#   adds jax, dm-haiku, tracr-pypi, ...), but `import auto_circuit.data` fails: it imports the undeclared `attr`
#   (attrs), then `transformer_lens.past_key_value_caching` / `HookedTransformerKeyValueCache`, which
#   transformer-lens 3.x removed (now transformer_lens.cache.key_value_cache.TransformerLensKeyValueCache).
#   It resolves only with transformer-lens<3 (2.16.1, and numpy 1.26.4), against our bench pin >=3.9,<4.
#   EAP-IG (hannamw/EAP-IG): no eap-ig distribution on PyPI; it is installed from its GitHub repository.
PEER_AUTO_CIRCUIT = (
    "not usable beside torch==2.13.0 (auto-circuit 1.0.1 installs without changing torch, transformers or "
    "transformer-lens 3.9.0, but does not import: it needs transformer_lens.past_key_value_caching, removed in "
    "transformer-lens 3.x, and the undeclared attrs; it resolves only with transformer-lens<3, against our pin); "
    "benchmarks/circuit_peers.py (make circuit-peers) runs it in a virtual environment of its own"
)
PEER_EAP_IG = "hannamw/EAP-IG is not on PyPI (installed from its GitHub repository only): not run"


class EdgeLogitDiff(LogitDiff):
    smooth_quantity = "logit_diff"


def weight_checksum(hm) -> float:
    with torch.no_grad():
        return float(sum(p.double().sum() for p in hm.module.parameters()))


# --- peak memory ------------------------------------------------------------------------------------
def worker(args: argparse.Namespace) -> int:
    """`--only METHOD`: time one attribution method on every edge and measure its peak memory."""
    hm, _ = build(args.init_range, with_tl=False)
    data = make_data(args.prompts, args.tokens, args.changed)
    task, graph = EdgeLogitDiff(), EdgeGraph.of(hm)
    kwargs = dict(method=args.only, steps=args.steps, prompts_per_pass=args.prompts_per_pass)
    scores(hm, task, data.take(slice(0, 2)), graph, **kwargs)  # warm-up
    reset_peak()
    baseline = status_kb("VmRSS")
    seconds = float("inf")
    for _ in range(args.repeats if args.only == "eap" else 1):
        start = time.perf_counter()
        result = scores(hm, task, data, graph, **kwargs)
        seconds = min(seconds, time.perf_counter() - start)
    peak = status_kb("VmHWM")
    torch.save(result, args.scores_out)
    report = {"seconds": seconds, "peak_kb": peak, "baseline_kb": baseline}
    print(json.dumps({**report, "checksum": weight_checksum(hm)}))
    return 0


def run_worker(method: str, args: argparse.Namespace, out: Path) -> tuple[dict, Tensor]:
    cmd = [sys.executable, __file__, "--only", method, "--scores-out", str(out)]
    for flag in ("prompts", "tokens", "changed", "steps", "prompts_per_pass", "init_range", "threads", "repeats"):
        value = getattr(args, flag)
        if value is not None:
            cmd += [f"--{flag.replace('_', '-')}", str(value)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        sys.stderr.write(done.stderr)
        raise SystemExit(f"the {method} worker failed ({done.returncode})")
    return json.loads(done.stdout.strip().splitlines()[-1]), torch.load(out)


# --- the exact sample --------------------------------------------------------------------------------
def exact_sample(graph: EdgeGraph, size: int, seed: int = 2) -> Tensor:
    """[S, R] bool: `size` edges spread over receiver layers in proportion to their edge counts (at least 4
    per layer and for the logits, at least one into each MLP)."""
    gen = torch.Generator().manual_seed(seed)
    layer_of = torch.tensor([r.layer for r in graph.receivers])
    counts = torch.stack([(graph.real & (layer_of == l)[None, :]).sum() for l in range(graph.n_layers + 1)])
    want = torch.clamp((counts.double() * size / counts.sum()).round().long(), min=4)
    mask = torch.zeros_like(graph.real)
    for layer in range(graph.n_layers + 1):
        in_layer = graph.real & (layer_of == layer)[None, :]
        mlp = [j for j, r in enumerate(graph.receivers) if r.layer == layer and r.kind == "mlp"]
        for j in mlp:  # one edge into the MLP first
            senders = graph.real[:, j].nonzero().flatten()
            mask[senders[torch.randint(len(senders), (1,), generator=gen)], j] = True
        rest = (in_layer & ~mask).flatten().nonzero().flatten()
        take = max(0, int(want[layer]) - int((mask & in_layer).sum()))
        mask.view(-1)[rest[torch.randperm(len(rest), generator=gen)[:take]]] = True
    return mask


def tl_sample(graph: EdgeGraph, sample: Tensor, size: int, seed: int = 3) -> list[tuple[int, int]]:
    """`size` edges of the exact sample, round-robin over receiver kinds, varied over sender kinds."""
    gen = torch.Generator().manual_seed(seed)
    edges = sample.nonzero().tolist()
    order = torch.randperm(len(edges), generator=gen).tolist()
    pools: dict[str, list[tuple[int, int]]] = {}
    for i in order:
        s, r = edges[i]
        pools.setdefault(graph.receivers[r].kind, []).append((s, r))
    for kind, pool in pools.items():  # alternate sender kinds within each receiver kind
        by_sender: dict[str, list[tuple[int, int]]] = {}
        for s, r in pool:
            by_sender.setdefault(graph.senders[s].kind, []).append((s, r))
        pools[kind] = [e for group in zip_longest_all(list(by_sender.values())) for e in group]
    chosen: list[tuple[int, int]] = []
    kinds = [k for k in ("q", "k", "v", "mlp", "logits") if k in pools]
    while len(chosen) < size and any(pools[k] for k in kinds):
        for k in kinds:
            if pools[k] and len(chosen) < size:
                chosen.append(pools[k].pop(0))
    return chosen


def zip_longest_all(lists: list[list]) -> list[list]:
    """Round-robin rows: [[a0, b0, c0], [a1, b1], ...]."""
    rows = []
    for i in range(max((len(x) for x in lists), default=0)):
        rows.append([x[i] for x in lists if i < len(x)])
    return rows


# --- the TransformerLens loop ----------------------------------------------------------------------------
def tl_loop(
    tl, graph: EdgeGraph, data: TaskData, edges: list[tuple[int, int]]
) -> tuple[list[float], float, list[float]]:
    """(the change in the mean metric for each edge, seconds of the two cached runs, seconds of each edge)."""
    tl.set_use_split_qkv_input(True)
    tl.set_use_attn_result(True)
    tl.set_use_hook_mlp_in(True)
    clean_ids, corrupt_ids = data.inputs["input_ids"], data.counterfactual["input_ids"]
    last = clean_ids.shape[1] - 1

    def mean_metric(logits: Tensor) -> float:
        return (logits[:, last, TOKEN_A] - logits[:, last, TOKEN_B]).mean().item()

    def sender_names(s: int) -> list[str]:
        sender = graph.senders[s]
        if sender.kind == "input":
            return ["hook_embed", "hook_pos_embed"]
        if sender.kind == "head":
            return [f"blocks.{sender.layer}.attn.hook_result"]
        return [f"blocks.{sender.layer}.hook_mlp_out"]

    needed = sorted({name for s, _ in edges for name in sender_names(s)})
    start = time.perf_counter()
    clean_logits, clean_cache = tl.run_with_cache(clean_ids, names_filter=lambda name: name in needed)
    _, corrupt_cache = tl.run_with_cache(corrupt_ids, names_filter=lambda name: name in needed)
    base = mean_metric(clean_logits)
    cache_seconds = time.perf_counter() - start

    def difference(s: int) -> Tensor:
        sender = graph.senders[s]
        total = sum(corrupt_cache[n] - clean_cache[n] for n in sender_names(s))
        return total[:, :, sender.head] if sender.kind == "head" else total

    def add_at_head(d: Tensor, head: int):
        def hook(t: Tensor, hook) -> Tensor:  # [batch, pos, head, d_model]
            t = t.clone()
            t[:, :, head] += d
            return t

        return hook

    def add(d: Tensor):
        return lambda t, hook: t + d

    values, seconds = [], []
    for s, r in edges:
        start = time.perf_counter()
        receiver, d = graph.receivers[r], difference(s)
        if receiver.kind in ("q", "k", "v"):
            hook = (f"blocks.{receiver.layer}.hook_{receiver.kind}_input", add_at_head(d, receiver.head))
        elif receiver.kind == "mlp":
            hook = (f"blocks.{receiver.layer}.hook_mlp_in", add(d))
        else:
            hook = (f"blocks.{graph.n_layers - 1}.hook_resid_post", add(d))
        values.append(mean_metric(tl.run_with_hooks(clean_ids, fwd_hooks=[hook])) - base)
        seconds.append(time.perf_counter() - start)
    return values, cache_seconds, seconds


def peer_auto_circuit() -> str:
    """The hand-checked finding above, unless auto_circuit is installed here (then whether it imports)."""
    try:
        import auto_circuit.data  # noqa: F401
    except ImportError as error:
        if isinstance(error, ModuleNotFoundError) and error.name == "auto_circuit":
            return PEER_AUTO_CIRCUIT
        return f"installed here but does not import ({type(error).__name__}: {error})"
    return "imports here; not benchmarked by this script"


def pearson(a: Tensor, b: Tensor) -> float:
    a, b = a.double() - a.double().mean(), b.double() - b.double().mean()
    return float((a * b).sum() / (a.norm() * b.norm()))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=16, help="tokens per prompt")
    parser.add_argument("--changed", type=int, default=3, help="tokens changed in each counterfactual prompt")
    parser.add_argument("--exact-sample", type=int, default=200, help="edges patched exactly by headlab")
    parser.add_argument("--tl-sample", type=int, default=20, help="edges of that sample patched by the TL loop")
    parser.add_argument("--steps", type=int, default=5, help="eap_ig interpolation steps")
    parser.add_argument("--prompts-per-pass", type=int, default=16)
    parser.add_argument("--chunk-mb", type=float, default=32.0, help="exact_scores' chunk (headlab's default)")
    parser.add_argument("--init-range", type=float, default=0.02, help="GPT2Config.initializer_range")
    parser.add_argument("--repeats", type=int, default=3, help="time eap this many times, keep the min")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--only", choices=("eap", "eap_ig"), help=argparse.SUPPRESS)
    parser.add_argument("--scores-out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    tune_allocator()  # as the CLI does
    if args.only:
        return worker(args)

    load_start = os.getloadavg()[0]
    hm, tl = build(args.init_range, with_tl=True)
    data = make_data(args.prompts, args.tokens, args.changed)
    task, graph = EdgeLogitDiff(), EdgeGraph.of(hm)
    with tempfile.TemporaryDirectory() as tmp:
        eap_run, eap = run_worker("eap", args, Path(tmp) / "eap.pt")
        ig_run, eap_ig = run_worker("eap_ig", args, Path(tmp) / "eap_ig.pt")
    checksum = weight_checksum(hm)
    if abs(eap_run["checksum"] - checksum) > 1e-6 * abs(checksum) or ig_run["checksum"] != eap_run["checksum"]:
        raise SystemExit("the worker processes built other weights than this one")

    sample = exact_sample(graph, args.exact_sample)
    n_sample = int(sample.sum())
    late = torch.tensor([r.layer >= graph.n_layers - 1 for r in graph.receivers])
    exact_scores(hm, task, data.take(slice(0, 2)), graph, sample & late[None, :], args.chunk_mb)  # warm-up
    start = time.perf_counter()
    exact_scores(hm, task, data, graph, torch.zeros_like(graph.real), args.chunk_mb)
    fixed = time.perf_counter() - start
    start = time.perf_counter()
    exact = exact_scores(hm, task, data, graph, sample, args.chunk_mb)
    exact_seconds = time.perf_counter() - start
    exact_all = fixed + (exact_seconds - fixed) * graph.n_edges / n_sample

    edges = tl_sample(graph, sample, args.tl_sample)
    with torch.inference_mode():
        tl(data.inputs["input_ids"][:2])  # warm-up
        tl_values, cache_seconds, edge_seconds = tl_loop(tl, graph, data, edges)
        clean = hm.forward(data.inputs)
        corrupt = hm.forward(data.counterfactual)
    last = args.tokens - 1
    clean_metric = (clean[:, last, TOKEN_A] - clean[:, last, TOKEN_B]).mean().item()
    corrupt_metric = (corrupt[:, last, TOKEN_A] - corrupt[:, last, TOKEN_B]).mean().item()
    per_edge = min(edge_seconds)  # every edge costs the same full forward pass: the min is the least disturbed
    tl_all = cache_seconds + per_edge * graph.n_edges
    headlab_values = torch.tensor([float(exact[s, r]) for s, r in edges], dtype=torch.float64)
    diffs = (headlab_values - torch.tensor(tl_values, dtype=torch.float64)).abs()
    worst = int(diffs.argmax())
    worst_name = f"{graph.senders[edges[worst][0]].name}->{graph.receivers[edges[worst][1]].name}"

    on = sample & graph.real
    effects = exact[on]
    baseline_mb = eap_run["baseline_kb"] / 1024
    print(f"model: gpt2-small-shape random ({N_LAYERS}x{N_HEADS}, d_model {D_MODEL})")
    print(f"prompts: {args.prompts}")
    print(f"tokens_per_prompt: {args.tokens}")
    print(f"changed_tokens: {args.changed}")
    print(f"init_range: {args.init_range:g}")
    print(f"torch_threads: {torch.get_num_threads()}")
    print(f"transformerlens: {_version('transformer-lens')} HookedTransformer, raw weights, split qkv input")
    print(f"chunk_mb: {args.chunk_mb:g}")
    print(f"edges: {graph.n_edges}")
    print(f"clean_metric: {clean_metric:.6f}")
    print(f"corrupt_metric: {corrupt_metric:.6f}")
    print(f"eap_seconds: {eap_run['seconds']:.2f}")
    print(f"eap_ig_seconds: {ig_run['seconds']:.2f}")
    print(f"exact_sample_edges: {n_sample}")
    print(f"exact_seconds: {exact_seconds:.2f}")
    print(f"exact_seconds_all_extrapolated: {exact_all:.0f}")
    print(f"exact_sample_mean_abs_effect: {effects.abs().mean().item():.3g}")
    print(f"exact_sample_max_abs_effect: {effects.abs().max().item():.3g}")
    print(f"tl_sample_edges: {len(edges)}")
    print(f"tl_exact_loop_seconds_per_edge: {per_edge:.3f}")
    print(f"tl_exact_loop_seconds_per_edge_median: {sorted(edge_seconds)[len(edge_seconds) // 2]:.3f}")
    print(f"tl_exact_loop_seconds_all_extrapolated: {tl_all:.0f}")
    print(f"tl_sample_max_abs_effect: {max(abs(v) for v in tl_values):.3g}")
    print(f"max_abs_diff_exact_vs_transformerlens: {diffs.max().item():.3g}")
    print(f"max_abs_diff_edge: {worst_name} (headlab {headlab_values[worst]:.6g}, TL {tl_values[worst]:.6g})")
    print(f"peak_rss_mb_eap: {eap_run['peak_kb'] / 1024:.0f}")
    print(f"peak_rss_mb_eap_ig: {ig_run['peak_kb'] / 1024:.0f}")
    print(f"baseline_rss_mb: {baseline_mb:.0f}")
    per_million = (eap_run["peak_kb"] - eap_run["baseline_kb"]) / 1024 / (graph.n_edges / 1e6)
    print(f"peak_rss_mb_per_million_edges_eap: {per_million:.0f}")
    print(f"eap_vs_exact_pearson: {pearson(eap[on], effects):.4f}")
    print(f"peer_auto_circuit: {peer_auto_circuit()}")
    print(f"peer_eap_ig: {PEER_EAP_IG}")
    print(f"load_average_1min: {load_start:.2f} at the start, {os.getloadavg()[0]:.2f} at the end")
    print(f"eap_speedup_vs_exact_loop: {tl_all / eap_run['seconds']:.1f}")
    print(f"eap_ig_vs_exact_pearson: {pearson(eap_ig[on], effects):.4f}")
    return 0 if diffs.max().item() <= TOLERANCE else 1


def _version(dist: str) -> str:
    from importlib.metadata import version

    return version(dist)


if __name__ == "__main__":
    sys.exit(main())
