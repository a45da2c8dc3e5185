"""How the cost of an all-heads sweep grows, for headlab, TransformerLens and nnsight; and EAP-IG against edges.

Model: a small GPT-2-family GPT2LMHeadModel with random weights (torch seed 0): d_model 64, 4 heads of 16,
vocab 8192, n_positions 2048, `layers` deep (4 unless the axis varies it; small so that the grid runs in
minutes on 2 shared cores); headlab loads it with load_hf,
TransformerLens gets its raw-weight twin (bench_models.build_hooked_transformer), nnsight wraps a second copy
of the HF model. Prompts: random tokens (bench_models.make_data); metric: logit[5335] - logit[1757] at the
last position. The sweep: every head zero-ablated at every position (headlab `execute`; TransformerLens one
run_with_hooks pass per head on hook_z; nnsight one trace per head on attn.c_proj's input). Axes:
  prompts   8, 32, 128, 512 prompts of 16 tokens
  tokens    16, 128, 1024, 2048 tokens, 1 prompt
  heads     2, 4, 8, 16 layers (8 to 64 heads), 16 prompts of 16 tokens
  edges     EAP-IG (5 steps) over every edge of the 2-, 4-, 8-, 16-layer models, 8 prompts of 16 tokens,
            against a TransformerLens loop patching one edge per forward pass (circuit_speed.tl_loop) on
            `--loop` edges (3 at least), scaled to every edge (plus its two cached runs); nnsight has no EAP-IG
The loops cost one pass per head (edge) whichever it is: they run on `--loop` heads (edges) and are scaled.
All sides live in this one process and run each point in turn (interleaved), three times (`--repeats`), the
best kept: under a shared machine's load a point moves by tens of percent, the slopes over a 16-256x range
much less.
Memory: peak_mb is the peak resident set during the sweep above the resident set just before it (freed heap
given back with malloc_trim, VmHWM reset through /proc/self/clear_refs): what the sweep itself allocates,
the loaded weights excluded. A loop's peak is one pass's, so running it on a few heads measures it whole.
On CUDA (--device cuda) the clock waits for the GPU and peak_mb is torch.cuda.max_memory_allocated above the
memory allocated before the sweep. Slope: least squares of log(seconds) and log(peak_mb) on log(x), per side and axis;
marginal: the slope of what the two largest points add above the smallest point's cost (scaling.marginal), the
fixed costs that a fitted slope mixes in subtracted. Goal: headlab's marginal slopes no steeper than the
flattest peer's.

Writes outputs/bench/scaling.csv (every point), scaling_slopes.csv, scaling.png, and copies the figure to
docs/scaling.png (the README's). Run from the repo root: `make scaling`
(52 s on 2 quiet cores, best of 3 per point).
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import numpy as np
import pandas as pd
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from bench_models import LogitDiff, build_hooked_transformer, cuda_missing, make_data, reset_peak, status_kb
from circuit_speed import tl_loop, tl_sample
from headlab.edges.eap import scores
from headlab.edges.graph import EdgeGraph
from headlab.interventions import CLEAN, Intervention
from headlab.interventions.engine import execute
from headlab.models.hf import load_hf
from headlab.runtime import tune_allocator
from sweep_speed import metric

VOCAB, D_MODEL, HEADS = 8192, 64, 4
AXES = {
    "prompts": dict(values=[8, 32, 128, 512], tokens=16, layers=4),
    "tokens": dict(values=[16, 128, 1024, 2048], prompts=1, layers=4),
    "heads": dict(values=[2, 4, 8, 16], prompts=16, tokens=16),
    "edges": dict(values=[2, 4, 8, 16], prompts=8, tokens=16),
}
SIDES = ("headlab", "transformerlens", "nnsight")


class EdgeLogitDiff(LogitDiff):
    smooth_quantity = "logit_diff"


def measured(fn, device: str = "cpu") -> tuple[float, float, object]:
    """(seconds, peak MB above the resident set before, result) of fn(); on CUDA the peak is the GPU's
    (torch.cuda.max_memory_allocated above what was allocated before) and the clock waits for the GPU."""
    gc.collect()
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        start = time.perf_counter()
        result = fn()
        torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        return seconds, (torch.cuda.max_memory_allocated() - before) / 2**20, result
    reset_peak()
    before = status_kb("VmRSS")
    start = time.perf_counter()
    result = fn()
    seconds = time.perf_counter() - start
    return seconds, (status_kb("VmHWM") - before) / 1024, result


class Models:
    """The three sides' copies of one random model `layers` deep."""

    def __init__(self, layers: int, device: str):
        config = GPT2Config(n_layer=layers, n_head=HEADS, n_embd=D_MODEL, vocab_size=VOCAB, n_positions=2048)
        torch.manual_seed(0)
        hf = GPT2LMHeadModel(config).eval()
        with tempfile.TemporaryDirectory() as tmp:
            hf.save_pretrained(tmp)
            self.hm = load_hf(tmp, name=f"gpt2-random-{layers}l", need_tokenizer=False)
            from nnsight import NNsight

            self.nn = NNsight(GPT2LMHeadModel.from_pretrained(tmp).to(device).eval())
        self.hm.module.to(device)
        self.tl = build_hooked_transformer(hf).to(device)
        self.layers, self.device = layers, device
        self.cells = [(l, h) for l in range(layers) for h in range(HEADS)]

    def sample(self, k: int) -> list[tuple[int, int]]:
        return [self.cells[i * len(self.cells) // k] for i in range(min(k, len(self.cells)))]

    def headlab(self, data, chunk_mb: float):
        ivs = [CLEAN, *(Intervention("ablate_head", "zero", l, h) for l, h in self.cells)]
        return lambda: execute(self.hm, LogitDiff(), data, ivs, chunk_mb=chunk_mb)

    def transformerlens(self, data, heads):
        ids = data.inputs["input_ids"]

        def zero(h: int):
            def hook(z, hook):
                z[:, :, h] = 0.0
                return z

            return hook

        def loop():
            with torch.inference_mode():
                return [
                    metric(self.tl.run_with_hooks(ids, fwd_hooks=[(f"blocks.{l}.attn.hook_z", zero(h))])[:, -1])
                    for l, h in heads
                ]

        return loop

    def nnsight(self, data, heads):
        ids, d_head = data.inputs["input_ids"], D_MODEL // HEADS

        def loop():
            values = []
            with torch.inference_mode():
                for l, h in heads:
                    with self.nn.trace(ids):
                        self.nn.transformer.h[l].attn.c_proj.input[:, :, h * d_head : (h + 1) * d_head] = 0
                        logits = self.nn.output.logits[:, -1].save()
                    values.append(metric(logits))
            return values

        return loop


def sweep_point(axis: str, x: int, models: Models, data, args) -> list[dict]:
    rows = []
    heads = models.sample(args.loop)
    scale = len(models.cells) / len(heads)
    runs = {
        "headlab": (models.headlab(data, args.chunk_mb), 1.0),
        "transformerlens": (models.transformerlens(data, heads), scale),
        "nnsight": (models.nnsight(data, heads), scale),
    }
    small = data.take(slice(0, 2))
    for warm in (models.headlab(small, args.chunk_mb), models.transformerlens(small, heads[:1])):
        warm()  # every code path once, on 2 prompts
    models.nnsight(small, heads[:1])()
    for _ in range(args.repeats):
        for side, (fn, factor) in runs.items():
            seconds, peak, _ = measured(fn, models.device)
            rows.append(dict(axis=axis, x=x, side=side, seconds=seconds * factor, peak_mb=peak))
    return rows


def edges_point(x: int, models: Models, data, args) -> list[dict]:
    task, graph = EdgeLogitDiff(), EdgeGraph.of(models.hm)
    n_edges = int(graph.real.sum())
    eap_ig = lambda d: lambda: scores(models.hm, task, d, graph, method="eap_ig", steps=5, prompts_per_pass=8)
    eap_ig(data.take(slice(0, 2)))()  # warm-up
    edges = tl_sample(graph, graph.real, max(3, args.loop))  # one q, k and v edge at least
    rows = []
    for _ in range(args.repeats):
        seconds, peak, _ = measured(eap_ig(data), models.device)
        rows.append(dict(axis="edges", x=n_edges, side="headlab", seconds=seconds, peak_mb=peak))
        seconds, peak, (_, cache_s, per_edge) = measured(lambda: tl_loop(models.tl, graph, data, edges), models.device)
        total = cache_s + float(np.mean(per_edge)) * n_edges
        rows.append(dict(axis="edges", x=n_edges, side="transformerlens", seconds=total, peak_mb=peak))
    return rows


def slopes(points: pd.DataFrame) -> pd.DataFrame:
    rows = []
    for (axis, side), group in points.groupby(["axis", "side"], sort=False):
        best = group.groupby("x").min(numeric_only=True).reset_index()
        logx = np.log(best["x"].to_numpy(float))
        row = dict(axis=axis, side=side, points=len(best))
        for what in ("seconds", "peak_mb"):
            y = best[what].to_numpy(float).clip(min=1e-3)
            row[f"slope_{what}"] = round(float(np.polyfit(logx, np.log(y), 1)[0]), 3)
            row[f"marginal_{what}"] = marginal(best["x"].to_numpy(float), y)
        rows.append(row)
    return pd.DataFrame(rows)


def marginal(x: np.ndarray, y: np.ndarray) -> float:
    """The slope of what the largest sizes add, the smallest point's cost (mostly fixed: imports aside, a
    sweep's set-up, its clean pass, its first readout) subtracted: log((y3 - y0) / (y2 - y0)) over
    log((x3 - x0) / (x2 - x0)) for the two largest points 2, 3 and the smallest 0. NaN where the costs do
    not grow past the smallest point's (all fixed)."""
    if len(x) < 3:
        return float("nan")
    grown, wider = y[-2:] - y[0], x[-2:] - x[0]
    if (grown <= 0).any():
        return float("nan")
    return round(float(np.log(grown[1] / grown[0]) / np.log(wider[1] / wider[0])), 3)


def figure(points: pd.DataFrame, table: pd.DataFrame, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = {"prompts": "prompts", "tokens": "tokens per prompt", "heads": "heads (model depth)", "edges": "edges"}
    fig, axes = plt.subplots(2, len(AXES), figsize=(4.2 * len(AXES), 7.5))
    for col, axis in enumerate(AXES):
        for row, what in enumerate(("seconds", "peak_mb")):
            ax = axes[row, col]
            for side in SIDES:
                group = points[(points.axis == axis) & (points.side == side)]
                if group.empty:
                    continue
                best = group.groupby("x").min(numeric_only=True).reset_index()
                slope = table[(table.axis == axis) & (table.side == side)][f"slope_{what}"].item()
                ax.plot(best["x"], best[what].clip(lower=1e-3), "o-", label=f"{side} (slope {slope:.2f})")
            ax.set_xscale("log")
            ax.set_yscale("log")
            ax.set_xlabel(labels[axis])
            ax.set_ylabel("seconds" if what == "seconds" else "peak memory above the weights (MB)")
            ax.set_title(("EAP-IG" if axis == "edges" else "all-heads zero ablation") + f" vs {labels[axis]}")
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--loop", type=int, default=1, help="heads (edges) the peers' loops run on, then scaled")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each point, the best kept")
    parser.add_argument("--chunk-mb", type=float, default=32.0)
    parser.add_argument("--axes", default=",".join(AXES), help="which axes to run (comma-separated)")
    parser.add_argument("--quick", action="store_true", help="two small points per axis: a check that it runs")
    parser.add_argument("--out", default="outputs/bench")
    parser.add_argument("--replot", help="a points csv (scaling.csv) to redraw the figure and slopes from")
    parser.add_argument("--docs", default="docs", help="where the README's copy of the figure goes ('' for none)")
    args = parser.parse_args()
    if cuda_missing(args.device):
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.replot:
        return write_outputs(pd.read_csv(args.replot), out, args.docs)
    tune_allocator()
    load_start = os.getloadavg()[0]
    rows: list[dict] = []
    models: dict[int, Models] = {}
    for axis in args.axes.split(","):
        spec = AXES[axis]
        for x in spec["values"][:2] if args.quick else spec["values"]:
            layers = x if axis in ("heads", "edges") else spec["layers"]
            if layers not in models:
                models.clear()  # one model in memory at a time
                gc.collect()
                models[layers] = Models(layers, args.device)
            n = x if axis == "prompts" else spec["prompts"]
            seq = x if axis == "tokens" else spec["tokens"]
            data = make_data(n, seq, changed=min(3, seq), vocab=VOCAB).to(args.device)
            if axis == "edges":
                new = edges_point(x, models[layers], data, args)
            else:
                new = sweep_point(axis, len(models[layers].cells) if axis == "heads" else x, models[layers], data, args)
            rows += new
            pd.DataFrame(rows).to_csv(out / "scaling.csv", index=False)  # so far: a cut-short run keeps its points
            for r in new:
                print(f"{axis}_{r['x']}_{r['side']}: {r['seconds']:.3f} s, {r['peak_mb']:.0f} MB", flush=True)
    write_outputs(pd.DataFrame(rows), out, args.docs)
    print(f"load_average_1min: {load_start:.2f} at the start, {os.getloadavg()[0]:.2f} at the end")
    return 0


def write_outputs(points: pd.DataFrame, out: Path, docs: str) -> int:
    """The points, the slopes table and the figure (and its copy for the README)."""
    table = slopes(points)
    points.to_csv(out / "scaling.csv", index=False)
    table.to_csv(out / "scaling_slopes.csv", index=False)
    figure(points, table, out / "scaling.png")
    if docs:
        Path(docs).mkdir(exist_ok=True)
        shutil.copy(out / "scaling.png", Path(docs) / "scaling.png")
    for r in table.itertuples():
        print(
            f"slope_{r.axis}_{r.side}: seconds {r.slope_seconds:.2f} (marginal {r.marginal_seconds:.2f}), "
            f"peak_mb {r.slope_peak_mb:.2f} (marginal {r.marginal_peak_mb:.2f})"
        )
    for line in goal_lines(points, table):
        print(line)
    return 0


def goal_lines(points: pd.DataFrame, table: pd.DataFrame) -> list[str]:
    """Per axis: headlab's slopes against the flattest peer's (issue 34's goal: none steeper), and at the
    axis's largest point how many times faster and leaner headlab is than each peer (a fitted slope mixes
    the growing work with each side's fixed cost per sweep; this ratio does not)."""
    lines = []
    for axis, group in points.groupby("axis", sort=False):
        slope = table[table.axis == axis].set_index("side")
        peers = [side for side in slope.index if side != "headlab"]
        for what in ("seconds", "peak_mb"):
            mine, flattest = slope.loc["headlab", f"slope_{what}"], slope.loc[peers, f"slope_{what}"].min()
            verdict = "met" if mine <= flattest else "NOT met"
            lines.append(f"slope_goal_{axis}_{what}: headlab {mine:.2f}, flattest peer {flattest:.2f} ({verdict})")
            mine, flattest = slope.loc["headlab", f"marginal_{what}"], slope.loc[peers, f"marginal_{what}"].min()
            verdict = "met" if not mine > flattest else "NOT met"  # NaN: nothing grows past the fixed cost
            lines.append(f"marginal_goal_{axis}_{what}: headlab {mine:.2f}, flattest peer {flattest:.2f} ({verdict})")
        best = group.groupby(["side", "x"]).min(numeric_only=True)
        x = group["x"].max()
        mine = best.loc[("headlab", x)]
        for side in peers:
            peer = best.loc[(side, x)]
            faster, leaner = peer.seconds / mine.seconds, peer.peak_mb / max(mine.peak_mb, 1e-3)
            lines.append(f"largest_{axis}_{x}_vs_{side}: headlab {faster:.1f}x faster, {leaner:.1f}x less memory")
    return lines


if __name__ == "__main__":
    sys.exit(main())
