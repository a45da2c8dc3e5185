"""A run started beside a busy process: headlab's own choice of torch threads (threads unset) against
threads=1 and against torch's default (one thread per core), each in a child process of its own while
another process spins on one core.

torch's threads wait for their slowest one: a thread sharing its core with other work slows the whole
pass. With `threads` unset headlab counts the cores it may use that are not busy (runtime.choose_threads)
and uses that many; the goal is a run no slower than threads=1.

Printed: cores, load_1min before the runs, chosen_threads (what meta.json says), and per variant its wall
seconds (the whole command: imports, model load, sweep, writing) and sweep_seconds (meta.json's sweep
phase); then ratio_chosen_over_threads_1 (goal: <= 1.1, noise allowed) and ratio_default_over_threads_1.

Run from the repo root: .venv/bin/python benchmarks/threads_busy.py [--model smollm2-135m] [--prompts 16]
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

HEADLAB = str(Path(sys.executable).with_name("headlab"))
# a launcher's allotment or OMP_NUM_THREADS would be an explicit choice: the children run without them
EXPLICIT = ("OMP_NUM_THREADS", "SLURM_CPUS_PER_TASK", "SUBMITIT_LOCAL_JOB_ID", "MKL_NUM_THREADS")


def run(model: str, prompts: int, extra: list[str]) -> tuple[float, dict]:
    env = {k: v for k, v in os.environ.items() if k not in EXPLICIT}
    with tempfile.TemporaryDirectory() as root:
        args = [f"model={model}", "task=ioi", "ablate=heads", f"task.n_prompts={prompts}", "output.n_boot=100"]
        start = time.perf_counter()
        subprocess.run([HEADLAB, "run", *args, f"output.root={root}", *extra], env=env, check=True, capture_output=True)
        wall = time.perf_counter() - start
        meta = json.loads(next(Path(root).glob("runs/*/*/meta.json")).read_text())
    return wall, meta


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--prompts", type=int, default=16)
    args = parser.parse_args()
    cores = len(os.sched_getaffinity(0))
    print(f"cores: {cores}")
    print(f"load_1min: {os.getloadavg()[0]:.2f}")
    run(args.model, 2, ["threads=1"])  # the weights converted and cached before anything is timed
    spin = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(1.0)
        seconds = {}
        for name, extra in (("chosen", []), ("threads_1", ["threads=1"]), ("default", [f"threads={cores}"])):
            wall, meta = run(args.model, args.prompts, extra)
            seconds[name] = wall
            if name == "chosen":
                print(f"chosen_threads: {meta['threads']['threads']} ({meta['threads']['source']})")
            print(f"wall_seconds_{name}: {wall:.1f}")
            print(f"sweep_seconds_{name}: {meta['seconds'].get('sweep', float('nan')):.1f}")
    finally:
        spin.kill()
        spin.wait()
    print(f"ratio_chosen_over_threads_1: {seconds['chosen'] / seconds['threads_1']:.2f}  (goal <= 1.1)")
    print(f"ratio_default_over_threads_1: {seconds['default'] / seconds['threads_1']:.2f}")


if __name__ == "__main__":
    main()
