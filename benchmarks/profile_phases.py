"""Where the time of a reproduction (or the atlas) goes: every run's phases, their wall clock, the FLOPs
they execute, and the operators, copies and Python between them that take the time.

Two passes over the same runs, each run into a fresh output root, in this process:
  1. timed     the runs as `headlab reproduce NAME` runs them (meta.json's `seconds`: each phase a study
               times with RunContext.timed, plus `other` for the rest of the run: composing, writing,
               figures); the wall clock a user waits for;
  2. profiled  the same runs again, each phase under a dispatch mode that times every aten operator
               (OpTimes) and counts the FLOPs of every matrix product and attention (torch's flop registry,
               and COMPOSITES for the operators inference_mode hands over whole).
The whole run: total_gflop (every phase's executed FLOPs), seconds_at_peak (that over the peak: the least
time those products can take here) and total_peak_share (seconds_at_peak over total_seconds).
Per phase: seconds (pass 1), gflop (executed, pass 2), gflops (gflop over pass 1's seconds), peak_share
(that over the machine's float32 matmul peak, measured here: bench_models.matmul_peak_gflops on square
products of the model's MLP width), ops_share (the operators' time over the phase's profiled wall clock:
what is left is Python, hooks and the timers' own cost between operators), and the five operators with
the most time. A phase below half the peak says why on its line: `python` where
ops_share is under 0.5, `memory` where copies and elementwise operators take more time than the
products, `float64` where most of its products are in float64 (half the float32 rate: the composition
scores, compared with TransformerLens's to 1e-9), else `small products`.

Run from the repo root: .venv/bin/python benchmarks/profile_phases.py ioi [model=gemma3-270m]
                        .venv/bin/python benchmarks/profile_phases.py atlas [model=smollm2-135m]
with --out FILE to keep the report (docs/benchmarks/profile_<name>-<model>.txt) and --quick for the
reproduction's quick runs. torch's threads: threads=N among the overrides, else headlab's own choice.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

import headlab
from bench_models import matmul_peak_gflops
from headlab import reproduce
from headlab.studies.context import RunContext


def runs_of(name: str, quick: bool, overrides: list[str]) -> list[list[str]]:
    """The override lists of the runs behind `name` (a reproduction, or `atlas`), each ending in `overrides`."""
    if name == "atlas":
        return [["study=atlas", *overrides]]
    model = next((o.split("=", 1)[1] for o in overrides if o.startswith("model=")), None)
    repro = reproduce.get(name)
    others = [o for o in overrides if not o.startswith("model=")]
    return [[*run, *others] for run in repro.runs(quick, model)]


class OpTimes(TorchDispatchMode):
    """The wall clock of every aten operator, summed by name, and the FLOPs of those torch's flop counter
    knows (its registry: matrix products, attention). torch's profiler keeps every event, which for the
    millions of operators of a path-patching round outgrows 24 GB; FlopCounterMode's module hooks break
    autograd.grad (EAP-IG)."""

    def __init__(self) -> None:
        super().__init__()
        self.seconds: dict[str, float] = defaultdict(float)
        self.flops = 0
        self.flops64 = 0  # of those, in float64: half the float32 peak's rate at best

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        start = time.perf_counter()
        out = func(*args, **kwargs)
        self.seconds[str(func.overloadpacket.__name__)] += time.perf_counter() - start
        packet, flops = func.overloadpacket, 0
        if packet in flop_registry:
            flops = flop_registry[packet](*args, **kwargs, out_val=out)
        elif packet.__name__ in COMPOSITES:
            flops = COMPOSITES[packet.__name__](args, out)
        self.flops += flops
        if flops and isinstance(out, torch.Tensor) and out.dtype == torch.float64:
            self.flops64 += flops
        return out


def _einsum_flops(args: tuple, out: torch.Tensor) -> int:
    """2 x the output's size x the size of the letters summed over."""
    equation, operands = args[0], args[1]
    inputs = equation.replace(" ", "").split("->")[0].split(",")
    sizes = {
        c: n
        for spec, t in zip(inputs, operands)
        for c, n in zip(spec.replace("...", ""), t.shape[-len(spec.replace("...", "")) :])
    }
    summed = set("".join(inputs).replace(".", "")) - set(equation.split("->")[1])
    return 2 * out.numel() * math.prod(sizes[c] for c in summed)


# operators that reach a dispatch mode whole under inference_mode, which torch's flop registry counts only
# once decomposed: their FLOPs from their shapes (matrix products at 2 per multiply-add)
COMPOSITES = {
    "linear": lambda args, out: 2 * out.numel() * args[1].shape[-1],
    "matmul": lambda args, out: 2 * out.numel() * args[0].shape[-1],
    "einsum": _einsum_flops,
    "scaled_dot_product_attention": lambda args, out: 4 * out.numel() * args[1].shape[-2],
}
PRODUCTS = ("mm", "addmm", "bmm", "baddbmm", "_scaled_dot_product_flash_attention_for_cpu", *COMPOSITES)


class Phases:
    """RunContext.timed, also timing the operators and counting the FLOPs of each outermost phase (pass 2)."""

    def __init__(self) -> None:
        self.flops: dict[str, float] = defaultdict(float)
        self.flops64: dict[str, float] = defaultdict(float)
        self.wall: dict[str, float] = defaultdict(float)
        self.ops: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
        self.depth = 0

    @contextlib.contextmanager
    def timed(self, ctx: RunContext, stage: str) -> Iterator[None]:
        if self.depth:
            yield
            return
        self.depth += 1
        ops = OpTimes()
        start = time.perf_counter()
        try:
            with ops:
                yield
        finally:
            self.depth -= 1
            self.wall[stage] += time.perf_counter() - start
            self.flops[stage] += ops.flops
            self.flops64[stage] += ops.flops64
            for name, seconds in ops.seconds.items():
                self.ops[stage][name] += seconds


def timed_pass(runs: list[list[str]], root: str) -> dict[str, float]:
    seconds: dict[str, float] = defaultdict(float)
    for overrides in runs:
        start = time.perf_counter()
        result = headlab.run(*overrides, f"output.root={root}")
        wall = time.perf_counter() - start
        meta = json.loads((result.run_dir / "meta.json").read_text())
        for stage, s in meta["seconds"].items():
            seconds[stage] += s
        seconds["other"] += wall - sum(meta["seconds"].values())
        seconds["total"] += wall
    return seconds


def profiled_pass(runs: list[list[str]], root: str) -> Phases:
    phases = Phases()
    original = RunContext.timed
    RunContext.timed = lambda ctx, stage: phases.timed(ctx, stage)  # type: ignore[method-assign,assignment]
    try:
        for overrides in runs:
            headlab.run(*overrides, f"output.root={root}")
    finally:
        RunContext.timed = original  # type: ignore[method-assign]
    return phases


def why_below(ops: dict[str, float], ops_share: float, float64_share: float) -> str:
    products = sum(v for k, v in ops.items() if k in PRODUCTS)
    rest = sum(ops.values()) - products
    if ops_share < 0.5:
        return "python"
    if float64_share > 0.5:
        return "float64"
    return "memory" if rest > products else "small products"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("name", help="a reproduction (headlab reproduce --list) or atlas")
    parser.add_argument("overrides", nargs="*", help="e.g. model=gemma3-270m threads=1")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", type=Path, help="also write the report here")
    args = parser.parse_intermixed_args()
    runs = runs_of(args.name, args.quick, args.overrides)
    named = next((o.split("=", 1)[1] for o in args.overrides if o.startswith("model=")), None)
    default = reproduce.get(args.name).model if args.name != "atlas" else None
    model = headlab.load_model(named or default or "smollm2-135m")
    width = max(getattr(model.module.config, "intermediate_size", 0), model.sites.d_model)
    del model
    lines = [f"name: {args.name} {' '.join(args.overrides)}".rstrip(), f"cpus: {len(os.sched_getaffinity(0))}"]
    lines.append(f"load_1min_before: {os.getloadavg()[0]:.2f}")
    with tempfile.TemporaryDirectory() as a, tempfile.TemporaryDirectory() as b:
        seconds = timed_pass(runs, a)
        print({k: round(v, 1) for k, v in seconds.items()}, flush=True)
        lines.append(f"torch_threads: {torch.get_num_threads()}")
        peak = matmul_peak_gflops(width, "cpu")
        lines.append(f"matmul_peak_gflops: {peak:.1f}  (float32, {width} x {width})")
        phases = profiled_pass(runs, b)
    lines.append(f"load_1min_after: {os.getloadavg()[0]:.2f}")
    lines.append(f"total_seconds: {seconds['total']:.1f}")
    # the least time the run's executed products could take on this machine: a goal below it needs less
    # arithmetic (a reuse of work), not a faster kernel
    total_gflop = sum(phases.flops.values()) / 1e9
    lines.append(f"total_gflop: {total_gflop:.0f}")
    lines.append(f"seconds_at_peak: {total_gflop / peak:.1f}  (total_gflop / matmul_peak_gflops)")
    lines.append(f"total_peak_share: {total_gflop / peak / max(seconds['total'], 1e-9):.2f}")
    for stage in [s for s in seconds if s not in ("total",)]:
        wall = seconds[stage]
        line = f"{stage}_seconds: {wall:.1f}"
        if stage in phases.wall:
            gflop = phases.flops[stage] / 1e9
            ops = phases.ops[stage]
            ops_share = sum(ops.values()) / max(phases.wall[stage], 1e-9)
            share = gflop / max(wall, 1e-9) / peak
            line += f"  gflop {gflop:.1f}  gflops {gflop / max(wall, 1e-9):.1f}  peak_share {share:.2f}"
            line += f"  ops_share {min(ops_share, 1.0):.2f}"
            float64_share = phases.flops64[stage] / max(phases.flops[stage], 1)
            if float64_share:
                line += f"  float64_share {float64_share:.2f}"
            if share < 0.5 and wall > 1:
                line += f"  below_half: {why_below(ops, ops_share, float64_share)}"
            top = sorted(ops.items(), key=lambda kv: -kv[1])[:5]
            line += "\n    top ops: " + ", ".join(f"{k} {v:.1f}s" for k, v in top)
        lines.append(line)
    text = "\n".join(lines)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    sys.exit(main())
