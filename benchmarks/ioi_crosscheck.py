"""IOI cross-check: headlab's per-head mean ablation and activation patching against TransformerLens.

An independent re-implementation of the same interventions with TransformerLens hooks, on the same
weights and the same prompts, compared prompt by prompt:
  model       a GPT-2-small-shaped GPT2LMHeadModel (12 layers x 12 heads, d_model 768, vocab 50257) with
              random weights (torch seed, `--init-range` as GPT2Config.initializer_range), saved with
              save_pretrained and loaded by headlab from that directory (`load_hf`, the hub-loader path),
              with the real GPT-2 tokenizer (tests/data/gpt2-tokenizer);
  prompts     headlab's IOI task (`IOITask.build`): clean prompts, S2-flipped counterfactuals, ABC
              reference prompts, the template of each prompt and its IO / S1 / S2 / END positions; by
              default 24 prompts from 6 of the 30 templates (4 each, BABA and ABBA), so that each
              per-template mean averages several ABC prompts (`--templates 0`: `build(n)` as is);
  headlab     `plan` (ablate.sweep=heads, ablate.method=mean; patch.kinds=[activation] over the chosen
              sites and positions) and `execute` (the stacked engine);
  TL          a HookedTransformer (TransformerLens 3.x) built offline from a hand-made config and
              `convert_gpt2_weights(hf_model)`, raw weights (no LN folding, weight centering or value-bias
              folding), so its hook_z / hook_v / hook_pattern are exactly the HF model's per-head values.
              Its interventions are written here from scratch:
                mean ablation (l,h): blocks.l.attn.hook_z[:, :, h] <- mean of hook_z over the ABC
                                     prompts of the prompt's own template (every position);
                patch (l,h) at z / v: hook_z / hook_v [batch, pos, head, d_head], head h <- its value in
                                     the S2-flipped run, at every position or at the prompt's role
                                     position (END, S2, ...);
                patch (l,h) at pattern: hook_pattern [batch, head, query, key], head h <- flipped run's,
                                     every query row or the role position's query row.
              Each intervention is one `run_with_hooks` started at its layer from TL's own cached clean
              `hook_resid_pre` (`start_at_layer`; earlier layers cannot change), stopped before the final
              norm, and unembedded at END only. A few cells per grid are also re-run as plain full forward
              passes (tokens -> logits at every position) to show that this shortcut changes nothing.
  compared    per prompt: logit_diff (logit IO - logit S at END) and io_prob (softmax at END), each
              computed here from TL's logits, not with headlab's metric code.

The full grids (144 heads x {mean} + 144 heads x {z, v, pattern} x {all, END, S2}) cost about 1,440
partial forward passes a side, far beyond a few minutes on 2 shared CPU cores; by default every head is
mean-ablated and each of the 9 patching grids takes the 12 heads (l, l), one per layer (`--heads
spread:K` for 12/K heads per layer, `--heads all` for the full grids: about 20 min). Effect sizes
(mean and max |intervened - clean|) are printed next to the differences, so a match is not a trivial
0 == 0; `--init-range` scales the random weights (0.05 gives about 4x larger effects).

Prints `max_abs_diff: <value>` last (the max over every compared number, headlab vs TL) and exits
non-zero if it is above 1e-4 (or if TL's clean logits differ from the HF model's by more than that).

Run from the repo root: .venv/bin/python benchmarks/ioi_crosscheck.py [--n 16] [--heads all] ...
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing here needs the hub
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch
from omegaconf import OmegaConf
from torch import Tensor
from transformers import GPT2Config, GPT2LMHeadModel

from bench_models import build_hooked_transformer  # the same raw-weight TL GPT-2 as the speed benchmark
from headlab.interventions import CLEAN, Intervention, plan
from headlab.interventions.engine import execute
from headlab.interventions.options import PatchConfig
from headlab.models.hf import load_hf
from headlab.runtime import tune_allocator
from headlab.tasks import TaskData
from headlab.tasks.ioi import IOIConfig, IOITask

TOKENIZER = Path(__file__).resolve().parents[1] / "tests" / "data" / "gpt2-tokenizer"  # tests/data/README.md
TOLERANCE = 1e-4
N_LAYERS, N_HEADS = 12, 12
QUANTITIES = ("logit_diff", "io_prob")  # compared; headlab's third quantity (correct) is logit_diff > 0


# --- the TransformerLens side ------------------------------------------------------------------------
def ioi_quantities(logits_at_end: Tensor, io: Tensor, s: Tensor) -> Tensor:
    """[n, 2]: logit IO - logit S, softmax probability of IO; logits_at_end [n, vocab]."""
    rows = torch.arange(logits_at_end.shape[0])
    logits = logits_at_end.double()
    diff = logits[rows, io] - logits[rows, s]
    io_prob = torch.softmax(logits, dim=-1)[rows, io]
    return torch.stack([diff, io_prob], dim=-1)


class TLSide:
    """Mean ablation and activation patching of single heads, written with TransformerLens hooks."""

    def __init__(self, tl, data: TaskData):
        self.tl = tl
        self.tokens = data.inputs["input_ids"]
        self.n = self.tokens.shape[0]
        self.rows = torch.arange(self.n)
        self.end = data.token_positions["END"]
        self.roles = data.token_positions
        self.io, self.s = data.answers["io"], data.answers["s"]
        self.groups = data.groups
        self.reference_groups = data.reference_groups
        self.counterfactual = data.counterfactual["input_ids"]
        self.reference = data.reference["input_ids"]
        self.resid_pre: dict[int, Tensor] = {}
        self.means: dict[int, Tensor] = {}  # layer -> [n, pos, head, d_head]: each prompt's template mean
        self.global_means: dict[int, Tensor] = {}  # layer -> [1, pos, head, d_head]: over all ABC prompts
        self.flipped: dict[tuple[str, int], Tensor] = {}  # (site, layer) -> flipped-run value

    def prepare(self, sites: set[str], need_means: bool) -> None:
        """Cache the clean residual stream, the per-template means of z over the ABC prompts and the
        S2-flipped run's z / v / pattern."""
        names = lambda suffix: lambda name: name.endswith(suffix)  # noqa: E731
        _, clean = self.tl.run_with_cache(self.tokens, names_filter=names("hook_resid_pre"))
        self.resid_pre = {l: clean[f"blocks.{l}.hook_resid_pre"] for l in range(N_LAYERS)}
        if need_means:
            _, ref = self.tl.run_with_cache(self.reference, names_filter=names("attn.hook_z"))
            for l in range(N_LAYERS):
                z = ref[f"blocks.{l}.attn.hook_z"]
                per_template = {}
                for g in self.groups.unique().tolist():
                    members = self.reference_groups == g
                    per_template[g] = z[members].mean(0)
                self.means[l] = torch.stack([per_template[g] for g in self.groups.tolist()])
                self.global_means[l] = z.mean(0, keepdim=True)
        if sites:
            hook_names = {"z": "attn.hook_z", "v": "attn.hook_v", "pattern": "attn.hook_pattern"}
            wanted = tuple(hook_names[s] for s in sites)
            _, cf = self.tl.run_with_cache(self.counterfactual, names_filter=lambda name: name.endswith(wanted))
            for site in sites:
                for l in range(N_LAYERS):
                    self.flipped[(site, l)] = cf[f"blocks.{l}.{hook_names[site]}"]

    def hook(self, kind: str, layer: int, head: int, site: str = "z", role: str | None = None, wrong: bool = False):
        """(hook name, fn) for one intervention. `wrong`: a near miss, to show the comparison would see
        one: the mean over all ABC prompts (not per template); the role position one token early; with
        every position patched, the neighbouring head's flipped value."""
        if kind == "mean":
            mean = self.means[layer]
            if wrong:
                mean = self.global_means[layer].expand_as(mean)

            def ablate(z, hook):  # z: [batch, pos, head, d_head]
                z[:, :, head] = mean[:, :, head]
                return z

            return f"blocks.{layer}.attn.hook_z", ablate
        source = self.flipped[(site, layer)]
        name = {"z": "attn.hook_z", "v": "attn.hook_v", "pattern": "attn.hook_pattern"}[site]
        pos = None if role is None else self.roles[role] - int(wrong)
        from_head = (head + 1) % N_HEADS if wrong and role is None else head

        def patch(x, hook):
            if site == "pattern":  # [batch, head, query, key]
                if pos is None:
                    x[:, head] = source[:, from_head]
                else:
                    x[self.rows, head, pos] = source[self.rows, head, pos]
            else:  # z, v: [batch, pos, head, d_head]
                if pos is None:
                    x[:, :, head] = source[:, :, from_head]
                else:
                    x[self.rows, pos, head] = source[self.rows, pos, head]
            return x

        return f"blocks.{layer}.{name}", patch

    def clean(self) -> Tensor:
        return ioi_quantities(self.tl(self.tokens)[self.rows, self.end], self.io, self.s)

    def run(self, layer: int, hook: tuple[str, Callable]) -> Tensor:
        """Start at `layer` from the cached clean residual stream; unembed at END only."""
        resid = self.tl.run_with_hooks(
            self.resid_pre[layer], start_at_layer=layer, stop_at_layer=N_LAYERS, fwd_hooks=[hook]
        )
        at_end = resid[self.rows, self.end].unsqueeze(1)  # [n, 1, d_model]
        logits = self.tl.unembed(self.tl.ln_final(at_end))[:, 0]
        return ioi_quantities(logits, self.io, self.s)

    def run_full(self, hook: tuple[str, Callable]) -> Tensor:
        """The plain way: tokens in, logits at every position out."""
        logits = self.tl.run_with_hooks(self.tokens, fwd_hooks=[hook])
        return ioi_quantities(logits[self.rows, self.end], self.io, self.s)


# --- grids ---------------------------------------------------------------------------------------------
def head_cells(spec: str) -> list[tuple[int, int]]:
    """'all' -> every head; 'spread:K' -> heads with (h - l) % K == 0 (12/K heads in every layer)."""
    every = [(l, h) for l in range(N_LAYERS) for h in range(N_HEADS)]
    if spec == "all":
        return every
    kind, _, k = spec.partition(":")
    if kind != "spread" or not k.isdigit() or not 1 <= int(k) <= N_HEADS:
        raise SystemExit(f"--heads: expected 'all' or 'spread:K' (1 <= K <= {N_HEADS}), got '{spec}'")
    return [(l, h) for l, h in every if (h - l) % int(k) == 0]


def ioi_data(task: IOITask, n: int, n_templates: int, seed: int, model) -> TaskData:
    """headlab's IOI prompts; with n_templates > 0, n of them from n_templates templates only (n / n_templates
    each), picked from a larger `task.build` pool, so that every per-template mean averages several ABC
    prompts (30 templates and a few dozen prompts would leave most templates with one prompt, and mean
    ablation would not be told apart from resampling the aligned ABC prompt)."""
    if n_templates <= 0:
        return task.build(n, seed, model)
    total = len(task.templates)
    chosen = sorted({round(i * (total - 1) / max(1, n_templates - 1)) for i in range(n_templates)})
    per = -(-n // len(chosen))
    pool = task.build(max(8 * n, 4 * per * total), seed, model)
    keep: list[int] = []
    for t in chosen:
        members = (pool.groups == t).nonzero().flatten().tolist()
        if len(members) < per:
            raise SystemExit(f"template {t}: only {len(members)} prompts in the pool, need {per}")
        keep += members[:per]
    keep = torch.tensor(sorted(keep[:n] if len(keep) > n else keep))
    width = int(pool.positions[keep].max()) + 1
    cut = lambda d: {k: v[keep, :width] if v.dim() == 2 else v[keep] for k, v in d.items()}  # noqa: E731
    return TaskData(
        inputs=cut(pool.inputs),
        positions=pool.positions[keep],
        answers=cut(pool.answers),
        counterfactual=cut(pool.counterfactual),
        reference=cut(pool.reference),
        token_positions=cut(pool.token_positions),
        groups=pool.groups[keep],
        reference_groups=pool.reference_groups[keep],
    )


def grid_name(iv: Intervention) -> str:
    if iv.intervention == "ablate_head":
        return "mean_ablation"
    where = iv.token or ("all" if iv.position is None else str(iv.position))
    return f"patch_{iv.site or 'z'}@{where}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=24, help="IOI prompts (default 24)")
    parser.add_argument(
        "--templates",
        type=int,
        default=6,
        help="draw the prompts from this many of the 30 IOI templates, evenly spread over BABA "
        "and ABBA (default 6, i.e. 4 prompts per template); 0: task.build(n) as is",
    )
    parser.add_argument("--seed", type=int, default=0, help="weights and prompts seed")
    parser.add_argument("--sites", default="z,v,pattern", help="patched head sites, comma-separated (z,v,pattern)")
    parser.add_argument(
        "--positions",
        default="all,END,S2",
        help="patched positions: all and/or IOI roles (IO,S1,S2,END), comma-separated",
    )
    parser.add_argument(
        "--heads",
        default="spread:12",
        help="heads of the patching grids: 'all' (144) or 'spread:K', the heads with "
        "(head - layer) %% K == 0 (default spread:12: one per layer, the diagonal)",
    )
    parser.add_argument("--mean-heads", default="all", help="heads of the mean-ablation grid (default all)")
    parser.add_argument("--no-mean", action="store_true", help="skip the mean-ablation grid")
    parser.add_argument(
        "--init-range",
        type=float,
        default=0.02,
        help="GPT2Config.initializer_range of the random weights (GPT-2's own: 0.02)",
    )
    parser.add_argument(
        "--full-checks",
        type=int,
        default=1,
        help="cells per grid that TL also runs as a plain full forward pass (default 1)",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=int(os.environ.get("OMP_NUM_THREADS") or 1),
        help="torch threads (default $OMP_NUM_THREADS, else 1: on 2 cores shared with other "
        "jobs, 2 threads ran 10-20x slower than 1)",
    )
    parser.add_argument("--chunk-mb", type=float, default=32.0, help="passed to headlab's execute()")
    parser.add_argument("--default-malloc", action="store_true", help="leave glibc's allocator untuned")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    tuned = False if args.default_malloc else tune_allocator()  # process-wide: both sides run with it
    sites = [s for s in args.sites.split(",") if s]
    positions = [p for p in args.positions.split(",") if p]
    for s in sites:
        if s not in ("z", "v", "pattern"):
            raise SystemExit(f"--sites: unknown site '{s}' (z, v, pattern)")
    for p in positions:
        if p not in ("all", "IO", "S1", "S2", "END"):
            raise SystemExit(f"--positions: unknown position '{p}' (all, IO, S1, S2, END)")
    if not TOKENIZER.is_dir():
        raise SystemExit(f"GPT-2 tokenizer not found at {TOKENIZER}")
    started = time.perf_counter()

    # the model: random GPT-2 small, saved and loaded back through headlab's HF loader
    torch.manual_seed(args.seed)
    config = GPT2Config(initializer_range=args.init_range)  # 12 x 12, 768, vocab 50257, n_positions 1024
    with tempfile.TemporaryDirectory() as tmp:
        GPT2LMHeadModel(config).save_pretrained(tmp)
        hm = load_hf(tmp, name="gpt2-random", tokenizer=str(TOKENIZER))
    assert (hm.n_layers, hm.n_heads) == (N_LAYERS, N_HEADS)
    tl = build_hooked_transformer(hm.module)

    task = IOITask(OmegaConf.structured(IOIConfig()))
    data = ioi_data(task, args.n, args.templates, args.seed, hm)

    # headlab's interventions, from a config as a run would make them
    cfg = OmegaConf.create(
        {
            "ablate": {"sweep": "none" if args.no_mean else "heads", "method": "mean"},
            "patch": OmegaConf.structured(
                PatchConfig(kinds=["activation"] if sites and positions else [], sites=sites, positions=positions)
            ),
        }
    )
    mean_cells, patch_cells = set(head_cells(args.mean_heads)), set(head_cells(args.heads))
    grids: dict[str, list[Intervention]] = {}
    for iv in plan(cfg, N_LAYERS, N_HEADS):
        if iv.intervention == "none":
            continue
        cells = mean_cells if iv.intervention == "ablate_head" else patch_cells
        if (iv.layer, iv.head) in cells:
            grids.setdefault(grid_name(iv), []).append(iv)

    side = TLSide(tl, data)
    with torch.inference_mode():
        hf_logits = hm.forward(data.inputs)
        tl_logits = tl(data.inputs["input_ids"])
        hf_vs_tl = (hf_logits - tl_logits).abs().max().item()
        logit_scale = hf_logits.abs().max().item()
        del hf_logits, tl_logits
        # warm-up of both sides (one layer of each kind), untimed
        execute(hm, task, data, [CLEAN, *[g[-1] for g in grids.values()]], chunk_mb=args.chunk_mb)
        side.prepare({"z"}, need_means=False)

        setup_s = time.perf_counter() - started
        results = {}
        tl_clean = side.clean()
        full_diff = 0.0
        gen = torch.Generator().manual_seed(args.seed)
        for name, ivs in grids.items():
            start = time.perf_counter()
            hl = execute(hm, task, data, [CLEAN, *ivs], chunk_mb=args.chunk_mb).double()
            hl_s = time.perf_counter() - start

            start = time.perf_counter()
            side.prepare(
                {iv.site or "z" for iv in ivs if iv.intervention == "patch_head"},
                need_means=any(iv.intervention == "ablate_head" for iv in ivs),
            )
            hooks = [
                side.hook(
                    "mean" if iv.intervention == "ablate_head" else "patch",
                    iv.layer,
                    iv.head,
                    site=iv.site or "z",
                    role=iv.token,
                )
                for iv in ivs
            ]
            tl_values = torch.stack([side.run(iv.layer, hook) for iv, hook in zip(ivs, hooks)])
            tl_s = time.perf_counter() - start

            hl_clean, hl_values = hl[0, :, : len(QUANTITIES)], hl[1:, :, : len(QUANTITIES)]
            near_miss = 0.0
            for i in torch.randperm(len(ivs), generator=gen)[: args.full_checks].tolist():
                full_diff = max(full_diff, (side.run_full(hooks[i]) - tl_values[i]).abs().max().item())
                iv = ivs[i]
                wrong = side.hook(
                    "mean" if iv.intervention == "ablate_head" else "patch",
                    iv.layer,
                    iv.head,
                    site=iv.site or "z",
                    role=iv.token,
                    wrong=True,
                )
                near_miss = max(near_miss, (side.run(iv.layer, wrong)[:, 0] - hl_values[i, :, 0]).abs().max().item())
            results[name] = {
                "cells": len(ivs),
                "headlab_s": hl_s,
                "tl_s": tl_s,
                "diff": (hl_values - tl_values).abs().amax(dim=(0, 1)),  # per quantity
                "clean_diff": (hl_clean - tl_clean).abs().max().item(),
                "effect": (tl_values - tl_clean).abs().mean(dim=(0, 1)),  # per quantity
                "effect_max": (tl_values - tl_clean).abs().amax(dim=(0, 1)),
                "near_miss": near_miss,
            }
            r = results[name]
            print(
                f"  {name}: {len(ivs)} heads, headlab {hl_s:.1f}s, TL {tl_s:.1f}s, max diff {r['diff'][0].item():.2e}",
                file=sys.stderr,
                flush=True,
            )

    clean_q = tl_clean
    headlab_total = sum(r["headlab_s"] for r in results.values())
    tl_total = sum(r["tl_s"] for r in results.values())
    worst = max([r["diff"].max().item() for r in results.values()] + [r["clean_diff"] for r in results.values()])

    print(
        f"model: gpt2-small-shape, random weights (seed {args.seed}, initializer_range {args.init_range:g}), "
        f"{N_LAYERS}x{N_HEADS} heads, d_model 768, vocab 50257; loaded by headlab via load_hf(<save_pretrained dir>)"
    )
    print(f"tokenizer: {TOKENIZER}")
    sizes = torch.bincount(data.groups)[data.groups.unique()].tolist()
    print(
        f"prompts: {data.n} IOI (BABA+ABBA) from templates {data.groups.unique().tolist()}, prompts (= ABC "
        f"prompts averaged by a mean) per template {sizes}, {data.inputs['input_ids'].shape[1]} tokens padded"
    )
    print(f"torch_threads: {torch.get_num_threads()}   allocator_tuned: {tuned}")
    print(
        f"transformerlens: {_version('transformer-lens')} HookedTransformer, raw weights; "
        f"each intervention = run_with_hooks from cached hook_resid_pre, logits at END only"
    )
    print(f"hf_vs_tl_clean_logits_max_abs_diff: {hf_vs_tl:.3g} (max |logit| {logit_scale:.3g})")
    print(f"tl_shortcut_vs_full_forward_max_abs_diff: {full_diff:.3g} ({args.full_checks} cell(s) per grid)")
    print(
        f"clean logit_diff: mean {clean_q[:, 0].mean().item():+.4f}, mean |.| {clean_q[:, 0].abs().mean().item():.4f};"
        f" io_prob mean {clean_q[:, 1].mean().item():.3g}"
    )
    print()
    header = (
        f"{'grid':<18}{'heads':>6}{'headlab_s':>11}{'tl_s':>9}{'diff logit_diff':>17}{'diff io_prob':>14}"
        f"{'mean|effect| ld':>17}{'max|effect| ld':>16}{'mean|effect| p':>16}{'near miss ld':>14}"
    )
    print(header)
    print("-" * len(header))
    for name, r in results.items():
        print(
            f"{name:<18}{r['cells']:>6}{r['headlab_s']:>11.1f}{r['tl_s']:>9.1f}{r['diff'][0].item():>17.2e}"
            f"{r['diff'][1].item():>14.2e}{r['effect'][0].item():>17.3e}{r['effect_max'][0].item():>16.3e}"
            f"{r['effect'][1].item():>16.3e}{r['near_miss']:>14.2e}"
        )
    print()
    print(
        "(diff: max over heads and prompts of |headlab - TL|; effect: |intervened - clean| per prompt, "
        "ld = logit_diff, p = io_prob;"
    )
    print(
        f" near miss: max |headlab - TL variant| on the {args.full_checks} checked cell(s), the variant being "
        "wrong on purpose: mean over all ABC prompts instead of the template's, role position - 1, "
        "or the neighbouring head's value at every position)"
    )
    print(f"clean_max_abs_diff (headlab vs TL, per prompt): {max(r['clean_diff'] for r in results.values()):.3g}")
    print(f"headlab_seconds: {headlab_total:.1f}")
    print(f"transformerlens_seconds: {tl_total:.1f}")
    print(f"speedup_vs_transformerlens: {tl_total / headlab_total:.2f}")
    print(f"setup_seconds: {setup_s:.1f}   wall_seconds: {time.perf_counter() - started:.1f}")
    print(f"max_abs_diff: {worst:.3g}")
    ok = worst <= TOLERANCE and hf_vs_tl <= TOLERANCE and full_diff <= TOLERANCE
    return 0 if ok else 1


def _version(dist: str) -> str:
    from importlib.metadata import version

    return version(dist)


if __name__ == "__main__":
    sys.exit(main())
