"""Peak memory of each atlas probe on models with large vocabularies (issue 45): logits are never held at
every read position of every prompt at once.

gemma3-270m (google/gemma-3-270m: d_model 640, 262,144-token vocabulary, 18 layers x 4 heads; its 640 MB
embedding is also its unembedding) reads one position out into 1 MB of float32 logits; smollm2-135m
(49,152 tokens, d_model 576) into 0.19 MB. Each probe runs as `headlab atlas model=X --scores ...` runs it
(studies/atlas.py's run_probe with the atlas's default sizes; `attention` is the atlas's own probe: entropy,
distance and the cards' logit lens; `attribution` its cards' edge split and MAPS, where the headlab measured
has them), in a child process of its own (this script with --child).

The children keep glibc's own allocator settings: a buffer of 32 MB or more is mapped on its own and given
back as it is freed, so the peak is what the probe held at once, the same from run to run. --tuned calls
runtime.tune_allocator first, as the CLI does: every buffer under 1 GB then stays in glibc's heap once freed,
and the peak also counts the heap's fragmentation, which moves by up to 1 GB between identical runs
(gemma3-270m's text_ablation: 1,975 and 2,722 MB in two runs of one tree).

Per model:
  <model>_weights_mb                  the parameters' own bytes (a tied embedding counted once)
  <model>_unembedding_mb              the unembedding's (vocabulary x d_model)
  <model>_logits_per_position_mb      one read position's float32 logits
Per model and probe (a child each):
  <model>_<probe>_peak_rss_mb         VmHWM of the child: imports, the weights, the probe
  <model>_<probe>_above_loaded_mb     that peak less the RSS once every weight is resident and the tokenizer
                                      loaded (the child reads each parameter once before the probe: the mapped
                                      file's pages count in RSS as they are touched), what the probe adds
  <model>_<probe>_seconds             the probe's wall time (the machine's load moves it)
With --baseline REV the same children run again on headlab at git revision REV (its src/ and configs/, from
`git archive`), as <model>_<probe>_peak_rss_mb_baseline and so on: before and after in one run.

Run from the repo root: .venv/bin/python benchmarks/vocab_memory.py [--models gemma3-270m,smollm2-135m]
[--probes attention,induction,...] [--baseline REV] [--threads 1] [--tuned]. Every probe of both models takes
about 11 minutes on two shared CPU cores (gemma3-270m 5, smollm2-135m 6, most of it the induction probe and the
two ablation sweeps), twice that with --baseline; --probes attention,induction,retrieval,text_ablation (those
issue 45 changed) with --baseline about 6 minutes a model.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import gc
import json
import os
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

MODELS = ("gemma3-270m", "smollm2-135m")
PROBES = (
    "attention",
    "attribution",
    "induction",
    "copy",
    "sinks",
    "retrieval",
    "composition",
    "text_ablation",
    "ioi_ablation",
)
ROOT = Path(__file__).resolve().parents[1]


def status_mb(field: str) -> float:
    """A field of /proc/self/status in MB: VmRSS (resident now), VmHWM (its high-water mark)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def reset_peak() -> None:
    """Give freed heap memory back and reset VmHWM to the resident set left."""
    gc.collect()
    ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim(0)
    Path("/proc/self/clear_refs").write_text("5")


def child(model_name: str, probe_name: str, root: str, threads: int, tuned: bool) -> dict:
    """One probe on one model, as the atlas runs it: its peak RSS, above the resident weights, and seconds."""
    import torch

    from headlab.runtime import tune_allocator

    if tuned:
        tune_allocator()
    torch.set_num_threads(threads)
    from headlab.door import compose
    from headlab.studies.atlas import fitted, run_probe
    from headlab.studies.atlas_cards import attention_probe
    from headlab.studies.atlas_probes import ATTENTION_SCORES, AtlasOptions
    from headlab.studies.atlas_probes import PROBES as ATLAS_PROBES
    from headlab.studies.context import RunContext
    from headlab.tasks import build_task

    cfg = compose(["study=atlas", f"model={model_name}", f"output.root={root}", f"threads={threads}"])
    options = fitted(AtlasOptions(), cfg)
    ctx = RunContext(cfg, None, task=build_task(cfg.task))
    model = ctx.get_model(runs_task=False)
    model.place(cfg.device)
    with torch.inference_mode():  # every weight resident: the mapped file's pages, as a probe touches them
        for p in model.module.parameters():
            p.sum()
    _ = model.tokenizer  # loaded where it is first asked for (gemma3-270m's: about 500 MB resident)
    reset_peak()  # the loading's freed buffers given back first
    loaded = status_mb("VmRSS")
    if probe_name == "attribution":
        try:  # the atlas's cards of each head's typical edge and MAPS (studies/head_attribution.py)
            from headlab.studies.head_attribution import atlas_probe as attribution_probe
        except ImportError:  # a baseline before it
            return {}
    start = time.perf_counter()
    if probe_name == "attention":
        attention_probe(ctx, model, options, set(ATTENTION_SCORES))
    elif probe_name == "attribution":
        attribution_probe(ctx, model, options)
    else:
        (probe,) = [p for p in ATLAS_PROBES if p.name == probe_name]
        run_probe(ctx, model, probe, options)
    seconds = time.perf_counter() - start
    peak = status_mb("VmHWM")
    return {"peak_rss_mb": peak, "above_loaded_mb": peak - loaded, "seconds": seconds}


def model_sizes(model_name: str) -> dict[str, float]:
    """The weights' bytes (shared storage once), the unembedding's, and one position's float32 logits."""
    import headlab

    model = headlab.load_model(model_name)
    seen, total = set(), 0
    for p in model.module.parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            total += p.numel() * p.element_size()
    weight = model.unembed.weight
    return {
        "weights_mb": total / 2**20,
        "unembedding_mb": weight.numel() * weight.element_size() / 2**20,
        "logits_per_position_mb": model.vocab_size * 4 / 2**20,
    }


def baseline_tree(rev: str, where: Path) -> Path:
    """headlab's src/ and configs/ at git revision `rev`, unpacked under `where`."""
    archive = subprocess.run(["git", "archive", rev, "src", "configs"], cwd=ROOT, check=True, capture_output=True)
    path = where / "baseline.tar"
    path.write_bytes(archive.stdout)
    with tarfile.open(path) as tar:
        tar.extractall(where / "baseline", filter="data")
    return where / "baseline"


def run_child(model: str, probe: str, threads: int, tuned: bool, tree: Path | None) -> dict:
    env = dict(os.environ)
    if tree is not None:  # the baseline's headlab and configs, ahead of the installed one
        env["PYTHONPATH"] = os.pathsep.join([str(tree / "src"), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        env["HEADLAB_CONFIG_DIR"] = str(tree / "configs")
    with tempfile.TemporaryDirectory() as root:  # a fresh atlas cache: the probe runs, never read back
        cmd = [sys.executable, __file__, "--child", model, probe, root, "--threads", str(threads)]
        cmd += ["--tuned"] if tuned else []
        done = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tempfile.gettempdir())
    if done.returncode:
        raise RuntimeError(f"{model} {probe} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--probes", default=",".join(PROBES))
    ap.add_argument("--baseline", default=None, help="a git revision to measure too, e.g. HEAD~1")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--tuned", action="store_true", help="runtime.tune_allocator in each child, as the CLI calls it")
    ap.add_argument("--child", nargs=3, metavar=("MODEL", "PROBE", "ROOT"))
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(*args.child, args.threads, args.tuned)))
        return
    models, probes = args.models.split(","), args.probes.split(",")
    unknown = [p for p in probes if p not in PROBES]
    if unknown:
        sys.exit(f"unknown probe {unknown[0]}; choose from {', '.join(PROBES)}")
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        trees: dict[str, Path | None] = {"": None}
        if args.baseline:
            trees["_baseline"] = baseline_tree(args.baseline, Path(tmp))
        for model in models:
            for name, value in model_sizes(model).items():
                print(f"{model}_{name}: {value:.1f}", flush=True)
            for probe in probes:
                for suffix, tree in trees.items():
                    for name, value in run_child(model, probe, args.threads, args.tuned, tree).items():
                        print(f"{model}_{probe}_{name}{suffix}: {value:.1f}", flush=True)
    print(f"benchmark_seconds: {time.perf_counter() - started:.0f}")


if __name__ == "__main__":
    main()
