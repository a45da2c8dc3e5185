"""IOI on a model that has the behaviour: a small GPT-2 trained here on IOI text (real GPT-2 tokenizer).

Trains model=gpt2-ioi with train=ioi (experiment=ioi_trained; or reuses its checkpoint), then on prompts
whose names were never trained on:
  - clean IO accuracy and logit difference;
  - mean ablation (ABC, per template) of every head: the heads whose ablation drops the logit
    difference most, with their END attention to IO / S1 / S2 (head scores);
  - exact activation patching of every head's z vs attribution patching: Pearson r and the speed ratio.
Prints `pearson_r: ...` last.

    .venv/bin/python benchmarks/ioi_trained.py [--prompts 200] [--root outputs]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
import torch

from headlab import compose
from headlab.analysis.scores import ioi_scores
from headlab.config import Config
from headlab.interventions import CLEAN, Intervention
from headlab.interventions.engine import execute
from headlab.models.hooked import HookedModel
from headlab.studies.context import EVAL_SEED_OFFSET, apply_runtime
from headlab.tasks import Task, TaskData, build_task
from headlab.train.obtain import obtain_model

TOKENIZER = Path(__file__).resolve().parents[1] / "tests" / "data" / "gpt2-tokenizer"  # tests/data/README.md


def arguments(description: str, prompts: int) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--prompts", type=int, default=prompts)
    ap.add_argument("--root", default="outputs")
    ap.add_argument("--tokenizer", default=str(TOKENIZER))
    ap.add_argument("overrides", nargs="*", help="extra Hydra overrides, e.g. train.steps=3000")
    return ap.parse_args()


def trained_model(args: argparse.Namespace) -> tuple[Config, HookedModel, Task, TaskData]:
    """gpt2-ioi as experiment=ioi_trained trains it (or its checkpoint), its task and evaluation prompts."""
    cfg = compose(
        *["experiment=ioi_trained", f"model.tokenizer={args.tokenizer}", f"output.root={args.root}", *args.overrides]
    )
    apply_runtime(cfg)
    task = build_task(cfg.task)
    started = time.perf_counter()
    model = obtain_model(cfg, task)
    print(
        f"model: {cfg.model.name} ({model.n_layers} layers x {model.n_heads} heads), ready in "
        f"{time.perf_counter() - started:.1f} s"
    )
    return cfg, model, task, task.build(args.prompts, seed=cfg.seed + EVAL_SEED_OFFSET, model=model)


def main() -> None:
    args = arguments(__doc__.splitlines()[0], 200)
    cfg, model, task, data = trained_model(args)
    L, H = model.n_layers, model.n_heads
    cells = [(l, h) for l in range(L) for h in range(H)]

    clean = execute(model, task, data, [CLEAN])[0]
    print(f"held-out names: {len(task.names('held_out'))}; prompts: {data.n}")
    print(
        f"clean: accuracy {clean[:, 2].mean():.3f}  logit_diff {clean[:, 0].mean():.3f}  "
        f"io_prob {clean[:, 1].mean():.3f}"
    )

    ablated = execute(model, task, data, [Intervention("ablate_head", "mean", l, h) for l, h in cells])
    drop = (ablated[:, :, 0].mean(1) - clean[:, 0].mean()).view(L, H)
    scores = ioi_scores(model, data).mean(2)  # [L, H, 5]: END->IO, END->S1, END->S2, copy, negative copy
    print("heads by mean-ablation effect on logit_diff (most negative first):")
    print("  head   d_logit_diff  END->IO  END->S1  END->S2  copy")
    for i in drop.flatten().argsort()[:5].tolist():
        l, h = divmod(i, H)
        s = scores[l, h]
        print(f"  {l}.{h:<4} {float(drop[l, h]):+12.3f}  {s[0]:7.3f}  {s[1]:7.3f}  {s[2]:7.3f}  {s[3]:5.2f}")
    rank = {int(i): r for r, i in enumerate(drop.flatten().argsort().tolist(), 1)}
    movers = [(l, h) for l, h in cells if scores[l, h, 0] > scores[l, h, 1] + scores[l, h, 2]]
    print("heads whose END attention goes to IO (more than to S1 + S2), with their ablation rank:")
    for l, h in movers:
        print(
            f"  {l}.{h}: END->IO {scores[l, h, 0]:.3f}, d_logit_diff {float(drop[l, h]):+.3f}, "
            f"rank {rank[l * H + h]} of {L * H}"
        )
    rows = []
    for position in ({}, {"token": "END"}):
        exact_ivs = [Intervention("patch_head", "activation", l, h, site="z", **position) for l, h in cells]
        approx_ivs = [Intervention("patch_head", "attribution", l, h, site="z", **position) for l, h in cells]
        t0 = time.perf_counter()
        exact = execute(model, task, data, exact_ivs)
        t1 = time.perf_counter()
        approx = execute(model, task, data, approx_ivs)
        t2 = time.perf_counter()
        e = (exact[:, :, 0].mean(1) - clean[:, 0].mean()).numpy()
        a = (approx[:, :, 0].mean(1) - clean[:, 0].mean()).numpy()
        r = float(np.corrcoef(e, a)[0, 1])
        where = position.get("token", "all")
        rows.append(r)
        print(
            f"patching z at {where}: exact {t1 - t0:.2f} s, attribution {t2 - t1:.2f} s "
            f"(speed ratio {(t1 - t0) / (t2 - t1):.1f}x), Pearson r {r:.3f}, "
            f"largest exact effect {e[np.abs(e).argmax()]:+.3f}"
        )
    torch.set_printoptions(precision=3)
    print(f"pearson_r: {rows[0]:.3f}")


if __name__ == "__main__":
    main()
