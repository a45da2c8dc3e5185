"""The copy score's readout on smollm2-135m: analysis/scores.py's in_top_k (the IO name among the top 5
logits, counted slice by slice of the 49,152-token vocabulary, a row leaving once 5 tokens beat the name)
against the plain topk it replaced (the whole vocabulary's logits, 128 rows at a time, topk(5)).

Rows: every head's output +-v_IO W_O^h on `--prompts` IOI prompts (270 heads x prompts x 2 signs), the
vectors ioi_scores reads out. Both readouts run in this one process, interleaved, `--repeats` times; the
min of each is kept (the machine's load moves by the minute when it is shared). The script exits non-zero
if the two disagree on any row.

Run from the repo root (`make bench` runs it): .venv/bin/python benchmarks/copy_scores.py [--prompts N]
[--repeats R] [--root outputs]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch

import headlab
from headlab.analysis.scores import TOP_K, in_top_k


def head_outputs(model, data) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows [m, d_model]: every head's v_IO W_O^h, then the same negated; the IO token of each row)."""
    kv = torch.tensor([model.sites.kv_head_of(h) for h in range(model.n_heads)])
    io_pos, io = data.token_positions["IO"], data.answers["io"]
    rows = torch.arange(data.n)
    with torch.inference_mode(), model.sites.record(("v",)) as store:
        model.forward_blocks(data.inputs)
        out = torch.stack(
            [
                torch.einsum("bhd,hdm->bhm", store[("v", layer)][rows, :, io_pos][:, kv], model.sites.W_O(layer))
                for layer in range(model.n_layers)
            ]
        )  # [layer, prompt, head, d_model]
    flat = out.reshape(-1, out.shape[-1])
    token = io[None, :, None].expand(out.shape[:3]).reshape(-1)
    return torch.cat([flat, -flat]), torch.cat([token, token])


def plain_topk(model, resid: torch.Tensor, token: torch.Tensor) -> torch.Tensor:
    hits = []
    for i in range(0, len(resid), 128):
        top = model.unembed(model.final_norm(resid[i : i + 128])).topk(TOP_K, dim=-1).indices
        hits.append((top == token[i : i + 128, None]).any(-1))
    return torch.cat(hits)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--root", default="outputs")
    args = ap.parse_args()
    model = headlab.load_model("smollm2-135m", root=args.root)
    data = headlab.load_task("ioi", n_prompts=args.prompts).build(args.prompts, 0, model)
    resid, token = head_outputs(model, data)
    times: dict[str, list[float]] = {"topk": [], "in_top_k": []}
    with torch.inference_mode():
        for _ in range(args.repeats):
            start = time.perf_counter()
            expected = plain_topk(model, resid, token)
            times["topk"].append(time.perf_counter() - start)
            start = time.perf_counter()
            found = in_top_k(model, resid, token)
            times["in_top_k"].append(time.perf_counter() - start)
    best = {k: min(v) for k, v in times.items()}
    print(f"rows: {len(resid)}")
    print(f"hits: {int(expected.sum())}")
    print(f"topk_s: {best['topk']:.2f}")
    print(f"in_top_k_s: {best['in_top_k']:.2f}")
    print(f"speedup: {best['topk'] / best['in_top_k']:.1f}")
    print(f"rows_differing: {int((found != expected).sum())}")
    print(f"load_average: {os.getloadavg()[0]:.1f}")
    if not torch.equal(found, expected):
        sys.exit(1)


if __name__ == "__main__":
    main()
