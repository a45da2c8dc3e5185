"""How close `headlab plan` comes: each case planned, then run in a process of its own (its peak memory its
own), the run's meta.json holding the plan beside what it measured. Prints `name: value` lines: per case
the predicted and measured seconds and peak host memory and their ratios (goal: within 30%, issue 55), with
the machine's load beside them; a case too long for 2 cores (PLAN_ONLY) is planned only, with whether its
peak fits a machine of MACHINE_GB. The LONG cases (gemma3-270m at 32K tokens, 25 minutes; the Llama-3.1-8B
shape's random bfloat16 weights, built once into outputs/bench, 15 GiB, and run on few prompts, 15 minutes)
run only where --cases names them (`make plan-bench-long`).

    python benchmarks/plan_accuracy.py [--out docs/benchmarks/plan_accuracy.txt] [--cases NAME ...] [--update]
        [--device cuda]

--update keeps the --out file's lines of the cases not run, and gives the cases run their own load lines.
--device cuda runs each case on the GPU (`device=cuda`), by default the Llama-3.1-8B shape's all-heads sweep
and EAP-IG on 64 IOI prompts (GPU_CASES, run on its random bfloat16 weights), and adds the planned and
measured peak device memory (torch.cuda.max_memory_allocated) and their ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

LLAMA8B_IOI = [
    "model=hf", "model.path={llama8b}", "model.tokenizer={tokenizer}", "model.dtype=bfloat16", "task=ioi",
    "task.n_prompts=64",
]  # fmt: skip
CASES = {
    "smollm2_ioi_heads": ["model=smollm2-135m", "task=ioi", "task.n_prompts=16", "ablate=heads"],
    "smollm2_text_layers": [
        "model=smollm2-135m", "task=text", "task.path=data/alice.txt", "task.seq_len=256", "task.n_prompts=8",
        "ablate=layers",
    ],
    "gemma3_ioi_heads": ["model=gemma3-270m", "task=ioi", "task.n_prompts=16", "ablate=heads"],
    # a GGUF model's first run (FIRST: an empty cache), which de-quantises its weights once before loading them
    "smollm2_ioi_heads_first": ["model=smollm2-135m", "task=ioi", "task.n_prompts=16", "ablate=heads"],
    "gemma3_ioi_heads_first": ["model=gemma3-270m", "task=ioi", "task.n_prompts=16", "ablate=heads"],
    "gemma3_text_heads": [
        "model=gemma3-270m", "task=text", "task.path=data/alice.txt", "task.seq_len=128", "task.n_prompts=4",
        "ablate=heads",
    ],
    "smollm2_ioi_attribution": [
        "model=smollm2-135m", "task=ioi", "task.n_prompts=64", "ablate=none", "patch=attribution",
    ],
    # patches from the counterfactual prompts run from where those first differ, or from the role patched
    "smollm2_ioi_activation": [
        "model=smollm2-135m", "task=ioi", "task.n_prompts=16", "ablate=none", "patch=activation",
        "patch.positions=[all,END]",
    ],
    # path patching: every sender's two passes (into the logits: pass A alone, its attention replayed)
    "smollm2_ioi_path": ["model=smollm2-135m", "task=ioi", "task.n_prompts=16", "ablate=none", "patch=path"],
    "gemma3_ioi_path_values": [
        "model=gemma3-270m", "task=ioi", "task.n_prompts=16", "ablate=none", "patch=path",
        "patch.receivers=[9.1,10.0]", "patch.receiver_site=v", "patch.positions=[S2]",
    ],
    # the q, v and k rounds planned with their receivers at the costliest layer; the run finds its own
    "smollm2_ioi_classes": ["model=smollm2-135m", "study=ioi_classes", "task.n_prompts=64"],
    "gemma3_ioi_classes": ["model=gemma3-270m", "study=ioi_classes", "task.n_prompts=16"],
    "smollm2_ioi_eap_ig": ["model=smollm2-135m", "task=ioi", "task.n_prompts=16", "circuit=eap_ig"],
    "gemma3_ioi_eap_ig": ["model=gemma3-270m", "task=ioi", "task.n_prompts=16", "circuit=eap_ig"],
    # one gradient run per node (61 on smollm2-135m) and step: few prompts and one step keep it to a minute
    "smollm2_ioi_eap_ig_activations": [
        "model=smollm2-135m", "task=ioi", "task.n_prompts=4", "circuit=eap_ig_activations", "study.steps=1",
        "study.faithfulness=false",
    ],
    # exact patching: a pass of blocks per edge from its receiver's layer on; two prompts keep it to minutes
    "gemma3_ioi_exact": [
        "model=gemma3-270m", "task=ioi", "task.n_prompts=2", "circuit=exact", "study.faithfulness=false",
    ],
    # every probe planned as the atlas composes it, the sweeps as `headlab plan` plans them (studies/atlas_plan.py)
    "smollm2_atlas": ["model=smollm2-135m", "study=atlas"],
    "gemma3_atlas": ["model=gemma3-270m", "study=atlas"],
    # long prompts: one document of data/devil.txt's entries joined ({long}); its head sweep takes an hour on 2
    # cores, so its layers are run: the same caches and readouts, a ninth of the interventions
    "smollm2_text_8k_layers": [
        "model=smollm2-135m", "task=text", "task.path={long}", "task.seq_len=8192", "task.n_prompts=1",
        "ablate=layers",
    ],
    # the same document at 32K tokens on gemma3-270m: its head sweep (below) takes hours on 2 cores, its layers
    # under half an hour, with the same caches and readouts and a quarter of the interventions
    "gemma3_text_32k_layers": [
        "model=gemma3-270m", "task=text", "task.path={long}", "task.seq_len=32768", "task.n_prompts=1",
        "ablate=layers",
    ],
    "gemma3_text_32k_heads": [
        "model=gemma3-270m", "task=text", "task.path={long}", "task.seq_len=32768", "task.n_prompts=1",
        "ablate=heads",
    ],
    # Llama-3.2-1B's shape, random weights in float32 ({llama1b}: streamed_weights.build, 4.7 GiB), GPT-2's
    # tokenizer: measured where 2 cores allow (a head sweep would take most of an hour: its layers)
    "llama1b_ioi_layers": ["model=hf", "model.path={llama1b}", "task=ioi", "task.n_prompts=16", "ablate=layers"],
    "llama1b_ioi_eap_ig": [
        "model=hf", "model.path={llama1b}", "task=ioi", "task.n_prompts=4", "circuit=eap_ig",
        "study.faithfulness=false",
    ],
    # Llama-3.1-8B's shape, random weights in bfloat16 ({llama8b_weights}: bench_models.save_llama_shards, 15
    # GiB), GPT-2's tokenizer: measured on few prompts, where 24 GB and 2 cores allow it in minutes
    "llama8b_ioi_layers": [
        "model=hf", "model.path={llama8b_weights}", "model.tokenizer={tokenizer}", "model.dtype=bfloat16",
        "task=ioi", "task.n_prompts=4", "ablate=layers",
    ],
    "llama8b_ioi_eap_ig_small": [
        "model=hf", "model.path={llama8b_weights}", "model.tokenizer={tokenizer}", "model.dtype=bfloat16",
        "task=ioi", "task.n_prompts=2", "circuit=eap_ig", "study.faithfulness=false",
    ],
    # the same shape at the size a study runs (its config alone, {llama8b}): planned only
    "llama8b_ioi_heads": [*LLAMA8B_IOI, "ablate=heads"],
    "llama8b_ioi_eap_ig": [*LLAMA8B_IOI, "circuit=eap_ig"],
    "llama8b_ioi_eap_ig_24gb": [*LLAMA8B_IOI, "circuit=eap_ig", "engine.max_memory=24GB"],
}  # fmt: skip
ROOT = Path(__file__).resolve().parents[1]
# hours on 2 cores, or weights not to be had: planned, and whether it fits MACHINE_GB, not run
PLAN_ONLY = ("gemma3_text_32k_heads", "llama8b_ioi_heads", "llama8b_ioi_eap_ig", "llama8b_ioi_eap_ig_24gb")
MACHINE_GB = 24
WEIGHTS_8B = ("llama8b_ioi_layers", "llama8b_ioi_eap_ig_small")  # the cases that read the 8B shape's weights
LONG = ("gemma3_text_32k_layers", *WEIGHTS_8B)  # run where named
GPU_CASES = ("llama8b_ioi_heads", "llama8b_ioi_eap_ig")  # --device cuda: the study-sized 8B cases, run
FIRST = ("smollm2_ioi_heads_first", "gemma3_ioi_heads_first")  # planned and run with an empty HEADLAB_CACHE


def case_of(line: str) -> str | None:
    """The case a line of the output is about: the longest case name its key starts with (llama8b_ioi_eap_ig_small's
    lines are not llama8b_ioi_eap_ig's)."""
    key = line.split(":")[0]
    return max((c for c in CASES if key.startswith(f"{c}_")), key=len, default=None)


def headlab(*args: str, cwd: Path, cache: Path | None = None) -> subprocess.CompletedProcess:
    env = os.environ.copy() | ({"HEADLAB_CACHE": str(cache)} if cache else {})
    return subprocess.run([sys.executable, "-m", "headlab", *args], cwd=cwd, capture_output=True, text=True, env=env)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="also write the lines here")
    parser.add_argument("--cases", nargs="*", choices=list(CASES))
    parser.add_argument("--update", action="store_true", help="replace only the cases run in the --out file")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    args = parser.parse_args(argv)
    gpu = args.device == "cuda"
    if args.cases is None:
        args.cases = list(GPU_CASES) if gpu else [c for c in CASES if c not in LONG]
    lines = [f"cpus: {os.cpu_count()}", f"load_1min_before: {os.getloadavg()[0]:.2f}"]
    kept: list[str] = []
    if args.update and args.out and args.out.exists():
        kept = [line for line in args.out.read_text().splitlines() if case_of(line) not in args.cases]
        lines = []
    print("\n".join(lines), flush=True)
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(scratch)
        long = root / "long.txt"
        long.write_text(" ".join((ROOT / "src" / "headlab" / "data" / "devil.txt").read_text().split()) + "\n")
        llama8b = root / "llama-3.1-8b-shape"
        if any(name.startswith("llama8b") for name in args.cases) and not gpu:
            sys.path.insert(0, str(ROOT / "benchmarks"))
            from bench_models import LLAMA_8B, llama_config

            llama_config(**LLAMA_8B).save_pretrained(llama8b)  # the config alone: the plan reads no weights
        llama1b = ROOT / "outputs" / "bench" / "llama-3.2-1b-shape"
        if any(name.startswith("llama1b") for name in args.cases):
            sys.path.insert(0, str(ROOT / "benchmarks"))
            from streamed_weights import build

            llama1b = build()
        llama8b_weights = ROOT / "outputs" / "bench" / "llama-3.1-8b-shape"
        needs_weights = WEIGHTS_8B + (tuple(n for n in CASES if n.startswith("llama8b")) if gpu else ())
        if any(name in needs_weights for name in args.cases) and not (llama8b_weights / "config.json").is_file():
            sys.path.insert(0, str(ROOT / "benchmarks"))
            import torch

            from bench_models import LLAMA_8B, llama_config, save_llama_shards

            save_llama_shards(str(llama8b_weights), llama_config(**LLAMA_8B), torch.bfloat16, draw_on=args.device)
        places = {
            "{llama8b_weights}": str(llama8b_weights),
            "{llama1b}": str(llama1b),
            "{long}": str(long),
            "{llama8b}": str(llama8b_weights if gpu else llama8b),  # a GPU runs the study-sized cases
            "{tokenizer}": str(ROOT / "tests" / "data" / "gpt2-tokenizer"),
        }
        for name in args.cases:
            overrides = [*CASES[name], "output.n_boot=0", f"output.root={root}", f"device={args.device}"]
            for mark, value in places.items():
                overrides = [o.replace(mark, value) for o in overrides]
            cache = root / f"cache-{name}" if name in FIRST else None
            planned = headlab("plan", *overrides, cwd=root, cache=cache)
            if planned.returncode:
                raise SystemExit(f"{name}: plan failed: {planned.stderr.strip().splitlines()[-1]}")
            if name in PLAN_ONLY and not gpu:
                peak = float(re.search(r"peak host memory: ([\d,]+) MB", planned.stdout)[1].replace(",", ""))
                seconds = float(re.search(r"time: ([\d,]+) s", planned.stdout)[1].replace(",", ""))
                said = [
                    f"{name}_planned_seconds: {seconds:.0f}",
                    f"{name}_planned_peak_host_mb: {peak:.0f}",
                    f"{name}_fits_{MACHINE_GB}gb: {peak <= MACHINE_GB * 1024}",
                ]
                budget = re.search(r"under engine.max_memory=\S+: (.*)", planned.stdout)
                if budget:  # what the run sets to keep its budget
                    said.append(f"{name}_settings: {budget[1]}")
                print("\n".join(said), flush=True)
                lines += said
                continue
            run_dir = root / name
            load = os.getloadavg()[0]
            ran = headlab("run", *overrides, f"hydra.run.dir={run_dir}", cwd=root, cache=cache)
            if ran.returncode:
                sys.stderr.write("\n".join(ran.stderr.strip().splitlines()[-20:]) + "\n")
                raise SystemExit(f"{name}: run failed: {ran.stderr.strip().splitlines()[-1]}")
            meta = json.loads((run_dir / "meta.json").read_text())
            plan, measured = meta["plan"], meta["measured"]
            said = [f"{name}_measured_seconds: {measured['seconds']:.1f}"]
            if plan["seconds"] is not None:  # a time model (sweeps, EAP and EAP-IG circuits)
                said += [
                    f"{name}_planned_seconds: {plan['seconds']:.1f}",
                    f"{name}_seconds_ratio: {measured['seconds_ratio']:.2f}",
                    f"{name}_gflop: {plan['gflop']:.0f}",
                ]
            said += [
                f"{name}_planned_peak_host_mb: {max(plan['peak_host_mb'], plan.get('convert_mb', 0.0)):.0f}",
                f"{name}_measured_peak_host_mb: {measured['peak_host_mb']:.0f}",
                f"{name}_peak_host_ratio: {measured['peak_host_ratio']:.2f}",
                f"{name}_threads: {meta['threads']['threads']}",
            ]
            if "peak_device_mb" in measured:
                said += [
                    f"{name}_planned_peak_device_mb: {plan['peak_device_mb']:.0f}",
                    f"{name}_measured_peak_device_mb: {measured['peak_device_mb']:.0f}",
                    f"{name}_peak_device_ratio: {measured.get('peak_device_ratio', float('nan')):.2f}",
                ]
            if args.update:
                said += [f"{name}_load_1min_before: {load:.2f}", f"{name}_load_1min_after: {os.getloadavg()[0]:.2f}"]
            print("\n".join(said), flush=True)
            lines += said
    if not args.update:
        lines.append(f"load_1min_after: {os.getloadavg()[0]:.2f}")
        print(lines[-1])
    if args.out:
        args.out.write_text("\n".join(kept + lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
