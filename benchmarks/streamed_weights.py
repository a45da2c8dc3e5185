"""Weights larger than the budget: a random-weight model of the Llama-3.2-1B shape in float32 (4.7 GiB of
weights) swept under `engine.max_memory` below its weights, against the same sweep in memory.

The model: bench_models' LLAMA_1B, Llama-3.2-1B's sizes (16 layers, 32 query and 8 key/value heads of 64,
d_model 2048, d_mlp 8192, vocabulary 128,256, tied embeddings), torch seed 0 (save_llama), saved once into
outputs/bench/llama-3.2-1b-shape (shards of 500 MB) with GPT-2's tokenizer (tests/data). The run:
`headlab run model=hf model.path=<it> task=ioi task.n_prompts=4 ablate=layers` (every head of each layer
zero-ablated together, one layer at a time), each in its own process: once with `engine.max_memory=<budget>`
(the plan leaves the last blocks' weights on disk, model.layers_on_disk, and lowers the chunk), once
without. Printed: the plan, each run's peak resident memory (ru_maxrss of its process, which counts the
pages of the memory-mapped files it reads: the safetensors shards at loading, each offloaded block as it
is read) and, sampled from /proc every 20 ms, its peak anonymous memory (RssAnon: what the budget holds)
and file-backed pages (RssFile, which the system drops under pressure), its seconds, and the largest
difference between the two tables; then EAP-IG (`circuit=eap_ig`, 5 steps, no faithfulness curve) under
the same budget, its peak memory and seconds: the plan holds a sweep's memory (the weights, the caches and
the chunk), not EAP-IG's gradients and sender outputs, so EAP-IG's peak is measured here, not kept.

Run from the repo root: `python benchmarks/streamed_weights.py [--budget 3GB]`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "outputs" / "bench" / "llama-3.2-1b-shape"
TOKENIZER = ROOT / "tests" / "data" / "gpt2-tokenizer"


def build() -> Path:
    if (MODEL / "config.json").is_file():
        return MODEL
    import torch
    from transformers import AutoTokenizer

    from bench_models import LLAMA_1B, llama_config, save_llama

    save_llama(str(MODEL), llama_config(**LLAMA_1B), torch.float32, max_shard_size="500MB")
    AutoTokenizer.from_pretrained(TOKENIZER).save_pretrained(MODEL)
    return MODEL


def run(name: str, extra: list[str], out: Path, study: tuple[str, ...] = ("ablate=layers",)) -> dict:
    run_dir = out / name
    shutil.rmtree(run_dir, ignore_errors=True)
    args = [
        sys.executable, "-m", "headlab", "run", "model=hf", f"model.path={MODEL}", "task=ioi", "task.n_prompts=4",
        *study, "output.n_boot=0", f"hydra.run.dir={run_dir}", *extra,
    ]  # fmt: skip
    started = time.perf_counter()
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    peaks = {"VmRSS": 0, "RssAnon": 0, "RssFile": 0}
    while proc.poll() is None:  # the child's anonymous and file-backed resident pages, sampled
        try:
            status = Path(f"/proc/{proc.pid}/status").read_text()
        except OSError:
            break
        for line in status.splitlines():
            key, _, value = line.partition(":")
            if key in peaks:
                peaks[key] = max(peaks[key], int(value.split()[0]))
        time.sleep(0.02)
    _, err = proc.communicate()
    if proc.returncode != 0:
        raise SystemExit(f"{name}: {err.strip().splitlines()[-1]}")
    meta = json.loads((run_dir / "meta.json").read_text())
    meta["wall_seconds"] = time.perf_counter() - started
    meta["peak_rss_mb"], meta["peak_anon_mb"], meta["peak_file_mb"] = (peaks[k] / 1024 for k in peaks)
    meta["table"] = pd.read_parquet(run_dir / "results.parquet")
    return meta


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", default="3GB")
    a = parser.parse_args()
    build()
    out = ROOT / "outputs" / "bench" / "streamed_weights"
    load = os.getloadavg()[0]
    streamed = run("streamed", [f"engine.max_memory={a.budget}"], out)
    whole = run("in_memory", [], out)
    budget, plan = streamed["budget"], streamed["plan"]
    print(f"model: Llama-3.2-1B shape, random weights, float32 ({plan['params'] / 1e9:.2f}B parameters)")
    print(f"weights_mb: {plan['params'] * 4 / 2**20:,.0f}")
    print(f"budget: {a.budget}")
    print(f"layers_on_disk: {budget['layers_on_disk']} of 16")
    print(f"chunk_mb: {budget['chunk_mb']}")
    print(f"planned_peak_host_mb: {budget['planned_peak_host_mb']:,.0f}")
    for label, m in (("streamed", streamed), ("in_memory", whole)):
        print(f"{label}_peak_host_mb: {m['measured']['peak_host_mb']:,.0f} (ru_maxrss)")
        print(f"{label}_peak_anonymous_mb: {m['peak_anon_mb']:,.0f} (RssAnon, sampled every 20 ms)")
        print(f"{label}_peak_file_backed_mb: {m['peak_file_mb']:,.0f} (RssFile: mapped files' pages)")
    print(f"streamed_seconds: {streamed['wall_seconds']:.1f}")
    print(f"in_memory_seconds: {whole['wall_seconds']:.1f}")
    diff = (streamed["table"]["value"] - whole["table"]["value"]).abs().max()
    print(f"max_abs_difference: {diff:.2e}")
    eap = run("eap_ig_streamed", [f"engine.max_memory={a.budget}"], out, ("circuit=eap_ig", "study.faithfulness=false"))
    print(f"eap_ig_layers_on_disk: {eap['budget']['layers_on_disk']} of 16")
    print(f"eap_ig_streamed_peak_rss_mb: {eap['peak_rss_mb']:,.0f} (VmRSS, sampled every 20 ms)")
    print(f"eap_ig_streamed_peak_anonymous_mb: {eap['peak_anon_mb']:,.0f}")
    print(f"eap_ig_streamed_peak_file_backed_mb: {eap['peak_file_mb']:,.0f}")
    print(f"eap_ig_streamed_seconds: {eap['wall_seconds']:.1f}")
    print(f"load_average_1min: {load:.2f} at the start, {os.getloadavg()[0]:.2f} at the end")


if __name__ == "__main__":
    main()
