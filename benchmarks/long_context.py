"""Memory of head sweeps on long prompts: smollm2-135m (real weights) at 2048 tokens, headlab against
TransformerLens and nnsight, and which of them fit under a memory limit.

Model and sides: as benchmarks/smollm2_speed.py (headlab's float32 copy of the GGUF; TransformerLens's twin
from a hand-made config, n_ctx = the prompt length; nnsight on transformers' LlamaForCausalLM), plus nnsight
with transformers' `logits_to_keep=1` (logits at the last position alone: what a careful nnsight user can
ask for; TransformerLens has no such option). Prompts: `--prompts` rows of `--tokens` random tokens.
Metric: logit[5335] - logit[1757] at the last position. The sweep: zero ablation of heads of layer
`--layer`: headlab `execute` on all 9 of them, the loops (one full pass per head) on 2. Memory is what this
measures, and neither side's peak depends on how many heads it sweeps: a loop's peak is one pass's, and
headlab sizes a chunk of stacked copies by `engine.chunk_mb` whichever the layer, while its walk holds two
layers' clean inputs (any layer but the last, whose block runs at the read position alone, gives the peak
of an all-heads sweep).

Each side runs in a child process of its own, twice: unlimited, then under `--limit-gb` of RLIMIT_DATA (the
process's private writable memory, imports and weights included: a stand-in for the memory of a laptop or a
shared node). Printed per side: peak_rss_mb (VmHWM, the weights included), sweep_mb_above_warm (that peak
less the resident set after one small clean pass, which reads the weights in), seconds of the sweep as run
(not comparable across sides: 9 heads against 2 passes), and under the limit `fits` or the allocator's own
error. max_abs_diff compares the two loop heads' values with headlab's (exit 1 above 1e-4).

Run from the repo root: `make long-context` (6-8 min on 2 cores), or
.venv/bin/python benchmarks/long_context.py [--tokens 2048] [--prompts 4] [--layer 27] [--limit-gb 3]
[--random-weights]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch

from bench_models import LogitDiff, dist_version, load_hooked, reset_peak, status_kb
from smollm2_speed import Nnsight, TransformerLens, add_model_arguments, build_tl, prompts, random_smollm2
from tl_configs import tl_llama_config

TOLERANCE = 1e-4
SIDES = ("headlab", "transformerlens", "nnsight", "nnsight_logits_to_keep")
LOOP_HEADS = (0, 1)
# what an allocation refused under RLIMIT_DATA prints: torch's allocator, Python, C++, or the C library
OUT_OF_MEMORY = re.compile(r"can't allocate memory|Cannot allocate memory|MemoryError|bad_alloc|out of memory")


def sweep_fn(side: str, args):
    """A function of the prompts giving the swept heads' metrics (mean over prompts): headlab's every head of
    the layer, the loops' LOOP_HEADS."""
    if side == "headlab":
        from headlab.interventions import Intervention
        from headlab.interventions.engine import execute
        from headlab.models.hf import load_hf

        hm = load_hf(args.model_path, name="smollm2-135m", need_tokenizer=False)
        ivs = [Intervention("ablate_head", "zero", args.layer, h) for h in range(hm.n_heads)]
        warm = lambda data: hm.forward(data.inputs)
        return warm, lambda data: execute(hm, LogitDiff(), data, ivs)[:, :, 0].double().mean(1)
    heads = [(args.layer, h) for h in LOOP_HEADS]
    if side == "transformerlens":
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(args.model_path)
        cfg = tl_llama_config(config, torch.float32, n_ctx=args.tokens, init_weights=False, device="cpu")
        peer = TransformerLens(load_hooked(cfg, args.tl_weights, "cpu"))
    else:
        peer = Nnsight(args.model_path, "cpu", **({"logits_to_keep": 1} if side == "nnsight_logits_to_keep" else {}))
    return peer.clean_logits, lambda data: peer.run("ablation_zero", data, heads)[2]


def run_child(args) -> int:
    from headlab.runtime import tune_allocator

    tune_allocator()
    warm_up, sweep = sweep_fn(args.side, args)
    with torch.inference_mode():
        warm_up(prompts(1, 16, "cpu"))  # the weights' pages are read in by the first pass
    reset_peak()
    report: dict = {"warm_kb": status_kb()}
    data = prompts(args.prompts, args.tokens, "cpu")
    start = time.perf_counter()
    try:
        report["values"] = sweep(data).tolist()
        report["status"] = "fits"
    except (RuntimeError, MemoryError) as err:
        first_line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        if isinstance(err, RuntimeError) and "allocate" not in first_line:
            raise
        report["status"] = f"out of memory ({first_line[:160]})"
    report.update(seconds=time.perf_counter() - start, peak_kb=status_kb("VmHWM"))
    Path(args.out).write_text(json.dumps(report))
    return 0


def child(side: str, args, tmp: str, limit_gb: float | None) -> dict:
    out = Path(tmp) / f"{side}-{limit_gb}.json"
    cmd = [sys.executable, __file__, "--side", side, "--out", str(out), "--model-path", args.model_path]
    cmd += ["--tl-weights", args.tl_weights, "--tokens", str(args.tokens), "--prompts", str(args.prompts)]
    cmd += ["--layer", str(args.layer)]

    def limit() -> None:
        if limit_gb:
            cap = int(limit_gb * 2**30)
            resource.setrlimit(resource.RLIMIT_DATA, (cap, cap))

    done = subprocess.run(cmd, capture_output=True, text=True, preexec_fn=limit)
    if done.returncode != 0 or not out.exists():
        # a limit can also strike outside torch's allocator (an import, a thread): that too is not fitting;
        # any other failure is a failure, not a verdict on memory
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        if limit_gb and OUT_OF_MEMORY.search(done.stderr):
            return {"status": f"out of memory (exit {done.returncode}: {last[:160]})"}
        sys.stderr.write(done.stderr[-6000:])
        raise SystemExit(f"the {side} run failed with exit code {done.returncode}")
    return json.loads(out.read_text())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--layer", type=int, default=27, help="the layer whose heads are swept (not the last)")
    parser.add_argument("--limit-gb", type=float, default=3.0, help="RLIMIT_DATA of the second runs (0: none)")
    add_model_arguments(parser, SIDES)
    args = parser.parse_args()
    if args.side:
        return run_child(args)

    import headlab
    from headlab.models.hf import load_hf

    load_start = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        if args.random_weights:
            args.model_path = random_smollm2(str(Path(tmp) / "model"))
            hf = load_hf(args.model_path, name="smollm2-135m", need_tokenizer=False).module
        else:
            hf = headlab.load_model("smollm2-135m", root=args.root).module
            args.model_path = hf.name_or_path
        if not 0 <= args.layer < hf.config.num_hidden_layers - 1:
            print(f"error: --layer {args.layer}: pick one of 0..{hf.config.num_hidden_layers - 2}", file=sys.stderr)
            return 2
        args.tl_weights = str(Path(tmp) / "transformer_lens.pt")
        torch.save(build_tl(hf, args.tokens).state_dict(), args.tl_weights)
        del hf
        runs = {}
        for side in SIDES:
            runs[side] = child(side, args, tmp, None)
            print(f"{side}: {runs[side]['seconds']:.1f} s", file=sys.stderr, flush=True)  # progress
        limited = {side: child(side, args, tmp, args.limit_gb) for side in SIDES} if args.limit_gb else {}

    print(f"model: smollm2-135m{' shape, random weights' if args.random_weights else ' (real weights)'}")
    print(f"prompts: {args.prompts}")
    print(f"tokens_per_prompt: {args.tokens}")
    print(f"swept: headlab every head of layer {args.layer}; loops heads {list(LOOP_HEADS)} of it")
    print(f"transformerlens: {dist_version('transformer-lens')}; nnsight: {dist_version('nnsight')}")
    print(f"torch_threads: {torch.get_num_threads()}")
    mine = torch.tensor(runs["headlab"]["values"])[list(LOOP_HEADS)]
    worst = 0.0
    for side, run in runs.items():
        print(f"peak_rss_mb_{side}: {run['peak_kb'] / 1024:.0f}")
        print(f"sweep_mb_above_warm_{side}: {(run['peak_kb'] - run['warm_kb']) / 1024:.0f}")
        print(f"seconds_{side}: {run['seconds']:.1f}")
        if side != "headlab":
            diff = (torch.tensor(run["values"]) - mine).abs().max().item()
            worst = max(worst, diff)
            print(f"max_abs_diff_{side}_vs_headlab: {diff:.3g}")
    print(f"max_abs_diff: {worst:.3g} (goal <= {TOLERANCE:g})")
    for side, run in limited.items():
        print(f"under_{args.limit_gb:g}_gb_{side}: {run['status']}")
    if limited:
        out = [side for side, run in limited.items() if run["status"].startswith("out of memory")]
        fits = "fits" if limited["headlab"]["status"] == "fits" else "does not fit"
        print(f"under_{args.limit_gb:g}_gb: headlab {fits}; out of memory: {', '.join(out) or 'none'}")
    print(f"load_average_1min: {load_start:.2f} at the start, {os.getloadavg()[0]:.2f} at the end")
    return 0 if worst <= TOLERANCE else 1


if __name__ == "__main__":
    sys.exit(main())
