"""headlab's EAP and EAP-IG against auto-circuit 1.0.1 on the same graph, prompts and metric.

auto-circuit needs transformer-lens 2.x (it imports transformer_lens.past_key_value_caching, gone in 3.x), so
it gets a virtual environment of its own, built here on first use (outputs/bench/autocircuit-venv, ~3 min):
torch==2.13.0 first (its CPU wheel is local; an unpinned torch would fetch CUDA builds), then PEER_PINS with
torch pinned on the same line. Where that install or `import auto_circuit` fails, the script prints the
installer's or importer's own error line and exits 2.

Model (`--model`): gpt2-shape, a GPT-2-small-shaped GPT2LMHeadModel (12 x 12 heads, d_model 768; random,
torch seed 0, as circuit_speed.py) saved once with save_pretrained; or smollm2, smollm2-135m's real weights
(headlab's float32 copy of the GGUF: 30 layers x 9 query heads on 3 key/value heads). headlab loads the
directory (load_hf), auto-circuit's side converts the same file with TransformerLens 2.x
(benchmarks/peer_auto_circuit.py, raw weights; grouped-query attention ungrouped, see below).
Prompts: headlab's IOI task (the model's tokenizer: GPT-2's with BOS first, or smollm2's, which adds none;
BABA templates, the names that are one token), the
`--prompts` prompts of template 0 ("Then, [B] and [A] went to the [PLACE]. [B] gave a [OBJECT] to"): one
length, END last, as auto-circuit's "last_seq" output slice reads it; the counterfactual is headlab's
S2-flipped prompt. Metric: logit(IO) - logit(S) at END, mean over prompts (auto-circuit: answer_function
"avg_diff", grad_function "logit"). Batches of `--batch` prompts on both sides (headlab: prompts_per_pass).
Graph: on GPT-2 both sides have the same 32,491 edges (input, heads, MLPs -> each head's q/k/v input, MLPs,
logits); auto-circuit's names map one to one (Resid Start = input, A3.1 = a3.h1, MLP 3 = m3, A3.1.Q = a3.h1<q>,
Resid End = logits). Under grouped-query attention headlab has one key and one value receiver per key/value
head (a3.kv0<k>), auto-circuit one per query head (A3.0.K, A3.1.K, A3.2.K: the copies of kv head 0 that
ungrouping makes). Each copy reads the same residual stream, so a kv receiver's gradient is the sum of its
copies' and so is its edge's score: auto-circuit's copies are summed before comparing (smollm2: its 123,211
edges onto headlab's 70,651).

Definitions: auto-circuit's score is the gradient of -metric with respect to an edge mask m (the receiver
reads clean + m * (corrupt - current) of the sender), summed over batches (and IG samples): its EAP
(mask_val=0) is headlab's eap times -batches, compared after dividing that out. Its IG
(integrated_grad_samples=steps) sets every edge's mask to k/steps at once, k = 0..steps (steps + 1 points,
both ends): a path through edge space from the clean run to the corrupted one. headlab's eap_ig interpolates
the input embeddings only (alpha = k/steps, k = 1..steps, EAP-IG's paper): another path, so r < 1 is a
difference of definitions, not an error; eap is the like-for-like check.

Each method on each side runs in a subprocess of its own: a 2-prompt warm-up, then the timed call on all
prompts; peak memory is VmHWM reset just before that call (after malloc_trim), so the loaded model counts
in it; `*_added_mb` is the peak minus the resident set just before the call (the method's own memory).

Printed lines (`name: value`): model, prompts, tokens_per_prompt, batch, ig_steps, torch_threads, peer,
edges, clean_metric_headlab / clean_metric_auto_circuit (the same weights read two ways), edges_matched (and
kv_group under grouped-query attention), then
for eap and eap_ig: pearson_r (over all edges), eap_max_abs_diff, seconds (wall) and cpu_seconds (all
threads of the process: less disturbed by other work on the machine) of both sides and their ratios
(speedup, cpu_speedup: auto-circuit / headlab), peak_rss_mb and added_mb of both sides, memory_ratio
(headlab / auto-circuit peak); auto_circuit_setup_seconds; load_average_1min at the start and the end.
Exits 2 where auto-circuit cannot be installed or imported, printing peer_status with the error line.

    .venv/bin/python benchmarks/circuit_peers.py [--model gpt2-shape|smollm2] [--prompts 8] [--batch 4] [--steps 5]
(`make circuit-peers` runs both models)
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

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch

from bench_models import save_gpt2
from circuit_speed import pearson
from headlab.edges.eap import scores
from headlab.edges.graph import EdgeGraph
from headlab.models.hf import load_hf
from headlab.runtime import tune_allocator
from headlab.tasks import TaskData
from headlab.tasks.ioi import IOIConfig, IOITask
from peer_auto_circuit import reset_peak, status_kb

HERE = Path(__file__).resolve().parent
TOKENIZER = HERE.parent / "tests" / "data" / "gpt2-tokenizer"  # the repository's own copy (tests/data/README.md)
MODELS = ("gpt2-shape", "smollm2")
VENV = HERE.parent / "outputs" / "bench" / "autocircuit-venv"
TORCH_PIN = "torch==2.13.0"
# transformer-lens 2.16.1 (the last 2.x) with transformers 4.x (5.x wants huggingface-hub>=1, TL 2.x <1);
# numpy<2 is TL 2.x's, and pyarrow<20 / datasets<4 the last that import beside numpy 1.x
PEER_PINS = (
    "auto-circuit==1.0.1",
    "transformer-lens==2.16.1",
    "transformers>=4.57,<5",
    "numpy<2",
    "pyarrow<20",
    "datasets<4",
)
PEER_IMPORT = "import auto_circuit.prune_algos.mask_gradient, auto_circuit.utils.graph_utils"


# --- auto-circuit's environment ------------------------------------------------------------------------
def last_error(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    errors = [ln for ln in lines if ln.startswith("ERROR") or "Error" in ln.split(":")[0]]
    return (errors or lines or ["(no output)"])[-1][:300]


def peer_python() -> tuple[Path | None, str]:
    """(the venv's python, '') or (None, the installer's or importer's own error line)."""
    python, stamp = VENV / "bin" / "python", VENV / (".installed-" + "-".join(PEER_PINS).replace("/", "_"))
    if not stamp.exists():
        print(f"building {VENV} (auto-circuit's own environment, a few minutes)", file=sys.stderr, flush=True)
        steps = [
            [sys.executable, "-m", "venv", str(VENV)],
            [str(python), "-m", "pip", "install", "--quiet", TORCH_PIN],
            [str(python), "-m", "pip", "install", "--quiet", *PEER_PINS, TORCH_PIN],
        ]
        for cmd in steps:
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode != 0:
                return None, f"install failed: {last_error(done.stderr + done.stdout)}"
        stamp.touch()
    done = subprocess.run([str(python), "-c", PEER_IMPORT], capture_output=True, text=True)
    if done.returncode != 0:
        return None, f"import failed: {last_error(done.stderr)}"
    return python, ""


# --- shared inputs ---------------------------------------------------------------------------------------
def ioi_prompts(n: int, tokenizer_dir: str, seed: int = 0) -> dict[str, torch.Tensor]:
    """n IOI prompts of template 0 (one length, END last): clean, S2-flipped corrupt, IO and S tokens."""
    from transformers import AutoTokenizer

    task = IOITask(IOIConfig(templates="baba"))
    task.use_tokenizer(AutoTokenizer.from_pretrained(tokenizer_dir))
    data = task.build(n * len(task.templates), seed=seed)
    rows = (data.groups == 0).nonzero().flatten()  # type: ignore[union-attr]
    clean, corrupt = data.inputs["input_ids"][rows], data.counterfactual["input_ids"][rows]  # type: ignore[index]
    end = data.positions[rows, 0]
    if not bool((end == end[0]).all()):
        raise SystemExit("template 0's prompts differ in length")
    last = int(end[0]) + 1
    return {
        "clean": clean[:, :last].contiguous(),
        "corrupt": corrupt[:, :last].contiguous(),
        "io": data.answers["io"][rows],
        "s": data.answers["s"][rows],
    }


def task_data(prompts: dict[str, torch.Tensor]) -> TaskData:
    n, length = prompts["clean"].shape
    return TaskData(
        inputs={"input_ids": prompts["clean"]},
        positions=torch.full((n, 1), length - 1),
        answers={"io": prompts["io"], "s": prompts["s"]},
        counterfactual={"input_ids": prompts["corrupt"]},
    )


# --- headlab's side --------------------------------------------------------------------------------------
def worker(args: argparse.Namespace) -> int:
    """`--only METHOD`: headlab's scores on every edge, timed, with the peak memory of the timed call."""
    hm = load_hf(args.model_dir, name=args.model, need_tokenizer=False)
    data = task_data(torch.load(args.data))
    task, graph = IOITask(IOIConfig()), EdgeGraph.of(hm)
    kwargs = dict(method=args.only, steps=args.steps, prompts_per_pass=args.batch)
    scores(hm, task, data.take(slice(0, 2)), graph, **kwargs)  # warm-up
    reset_peak()
    baseline = status_kb("VmRSS")
    start, cpu = time.perf_counter(), time.process_time()
    result = scores(hm, task, data, graph, **kwargs)
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    peak = status_kb("VmHWM")
    torch.save(result, args.out)
    print(json.dumps({"seconds": seconds, "cpu_seconds": cpu, "peak_kb": peak, "baseline_kb": baseline}))
    return 0


def run(cmd: list[str], what: str) -> dict:
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        sys.stderr.write(done.stderr[-3000:])
        raise SystemExit(f"{what} failed ({done.returncode}): {last_error(done.stderr)}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def common(args: argparse.Namespace, model_dir: Path, data: Path) -> list[str]:
    out = ["--model-dir", str(model_dir), "--data", str(data), "--steps", str(args.steps), "--batch", str(args.batch)]
    return out + (["--threads", str(args.threads)] if args.threads else [])


# --- edge names ----------------------------------------------------------------------------------------------
def headlab_name(peer_edge: str, kv_group: int = 1) -> str:
    """auto-circuit's `Resid Start->A0.1.Q` as headlab's `input->a0.h1<q>`; under grouped-query attention
    (`kv_group` query heads per key/value head) its `A0.4.K` as `a0.kv1<k>`."""
    src, dest = peer_edge.split("->")

    def node(name: str) -> str:
        if name == "Resid Start":
            return "input"
        if name == "Resid End":
            return "logits"
        if name.startswith("MLP "):
            return f"m{name[4:]}"
        parts = name[1:].split(".")  # A3.1 or A3.1.Q
        if len(parts) == 2 or parts[2] == "Q" or kv_group == 1:
            head = f"a{parts[0]}.h{parts[1]}"
            return head if len(parts) == 2 else f"{head}<{parts[2].lower()}>"
        return f"a{parts[0]}.kv{int(parts[1]) // kv_group}<{parts[2].lower()}>"

    return f"{node(src)}->{node(dest)}"


def aligned(graph: EdgeGraph, ours: torch.Tensor, peer: dict) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(headlab's scores, the peer's) over the edges of headlab's graph that the peer has (the peer's
    ungrouped key/value copies summed), and how many those are."""
    index = {f"{s.name}->{r.name}": (i, j) for i, s in enumerate(graph.senders) for j, r in enumerate(graph.receivers)}
    theirs: dict[tuple[int, int], float] = {}
    for name, score in zip(peer["names"], peer["scores"].double().tolist()):
        place = index.get(headlab_name(name, peer["kv_group"]))
        if place is None or not bool(graph.real[place]):
            raise SystemExit(f"auto-circuit has an edge that headlab's graph does not: {name}")
        theirs[place] = theirs.get(place, 0.0) + score
    places = sorted(theirs)
    mine = torch.tensor([float(ours[i, j]) for i, j in places], dtype=torch.float64)
    return mine, torch.tensor([theirs[p] for p in places], dtype=torch.float64), len(places)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=MODELS, default="gpt2-shape", help="GPT-2's shape (random) or smollm2-135m")
    parser.add_argument("--root", default="outputs", help="headlab's output root (not smollm2's copy: cache_dir)")
    parser.add_argument("--prompts", type=int, default=8, help="IOI prompts (template 0)")
    parser.add_argument("--batch", type=int, default=4, help="prompts per pass, both sides")
    parser.add_argument("--steps", type=int, default=5, help="IG steps (auto-circuit: integrated_grad_samples)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads, both sides (default: torch's)")
    parser.add_argument("--only", choices=("eap", "eap_ig"), help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    parser.add_argument("--data", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    tune_allocator()  # as the CLI does
    if args.only:
        return worker(args)

    load_start = os.getloadavg()[0]
    python, error = peer_python()
    if python is None:
        print("peer: auto-circuit 1.0.1")
        print(f"peer_status: {error}")
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        data_file = Path(tmp) / "prompts.pt"
        if args.model == "smollm2":
            import headlab

            model_dir = Path(headlab.load_model("smollm2-135m", root=args.root).module.name_or_path)
            tokenizer_dir = str(model_dir)
        else:
            model_dir, tokenizer_dir = Path(tmp) / "model", str(TOKENIZER)
            save_gpt2(str(model_dir))
        prompts = ioi_prompts(args.prompts, tokenizer_dir)
        torch.save(prompts, data_file)
        hm = load_hf(str(model_dir), name=args.model, need_tokenizer=False)
        graph, data = EdgeGraph.of(hm), task_data(prompts)
        with torch.inference_mode():
            logits = hm.forward(data.inputs)[:, -1]
        n = torch.arange(len(logits))
        clean_metric = (logits[n, prompts["io"]] - logits[n, prompts["s"]]).mean().item()
        del hm
        rows: dict[str, dict] = {}
        for method in ("eap", "eap_ig"):
            ours_file, peer_file = Path(tmp) / f"{method}.pt", Path(tmp) / f"{method}_peer.pt"
            mine = run(
                [
                    sys.executable,
                    __file__,
                    "--only",
                    method,
                    "--model",
                    args.model,
                    "--out",
                    str(ours_file),
                    *common(args, model_dir, data_file),
                ],
                f"headlab's {method}",
            )
            peer = run(
                [str(python), str(HERE / "peer_auto_circuit.py"), "--method", method, "--out", str(peer_file)]
                + common(args, model_dir, data_file),
                f"auto-circuit's {method}",
            )
            rows[method] = {
                "ours": mine,
                "peer": peer,
                "scores": torch.load(ours_file),
                "peer_scores": torch.load(peer_file),
            }

    shapes = {
        "gpt2-shape": "gpt2-small-shape random (12x12, d_model 768)",
        "smollm2": "smollm2-135m real weights (30 layers x 9 query heads on 3 kv heads, d_model 576)",
    }
    print(f"model: {shapes[args.model]}, raw weights on both sides")
    print(f"prompts: {len(prompts['clean'])} IOI, template 0, S2-flipped counterfactuals")
    print(f"tokens_per_prompt: {prompts['clean'].shape[1]}")
    print(f"batch: {args.batch}")
    passes = f"headlab k = 1..{args.steps}, {args.steps} passes; auto-circuit k = 0..{args.steps}, {args.steps + 1}"
    print(f"ig_steps: {args.steps} ({passes})")
    print(f"torch_threads: {torch.get_num_threads()}")
    print("peer: auto-circuit 1.0.1 (transformer-lens 2.16.1, its own venv), mask_gradient_prune_scores")
    print(f"edges: {graph.n_edges}")
    print(f"clean_metric_headlab: {clean_metric:.6f}")
    print(f"clean_metric_auto_circuit: {rows['eap']['peer']['clean_metric']:.6f}")
    for method, row in rows.items():
        peer = row["peer_scores"]
        samples = 1 if method == "eap" else args.steps + 1
        group = row["peer"]["kv_group"]
        peer = {**peer, "scores": -peer["scores"] / (peer["batches"] * samples), "kv_group": group}  # headlab's units
        mine, theirs, matched = aligned(graph, row["scores"], peer)
        if method == "eap":
            print(f"edges_matched: {matched} of {graph.n_edges} (auto-circuit: {row['peer']['n_edges']})")
            if group > 1:
                print(f"kv_group: {group} (auto-circuit's key/value receivers summed per headlab kv receiver)")
        print(f"{method}_pearson_r: {pearson(mine, theirs):.6f}")
        if method == "eap":
            scale = mine.abs().max().item()
            print(f"eap_max_abs_diff: {(mine - theirs).abs().max().item():.3g} (largest |score| {scale:.3g})")
        ours, them = row["ours"], row["peer"]
        print(f"{method}_seconds_headlab: {ours['seconds']:.2f}")
        print(f"{method}_seconds_auto_circuit: {them['seconds']:.2f}")
        print(f"{method}_speedup: {them['seconds'] / ours['seconds']:.2f}")
        print(f"{method}_cpu_seconds_headlab: {ours['cpu_seconds']:.2f}")
        print(f"{method}_cpu_seconds_auto_circuit: {them['cpu_seconds']:.2f}")
        print(f"{method}_cpu_speedup: {them['cpu_seconds'] / ours['cpu_seconds']:.2f}")
        print(f"{method}_peak_rss_mb_headlab: {ours['peak_kb'] / 1024:.0f}")
        print(f"{method}_peak_rss_mb_auto_circuit: {them['peak_kb'] / 1024:.0f}")
        print(f"{method}_added_mb_headlab: {(ours['peak_kb'] - ours['baseline_kb']) / 1024:.0f}")
        print(f"{method}_added_mb_auto_circuit: {(them['peak_kb'] - them['baseline_kb']) / 1024:.0f}")
        print(f"{method}_memory_ratio: {ours['peak_kb'] / them['peak_kb']:.2f}")
    setup = rows["eap"]["peer"]["setup_seconds"]
    print(f"auto_circuit_setup_seconds: {setup:.1f} (model conversion and patchable_model, not timed above)")
    print(f"load_average_1min: {load_start:.2f} at the start, {os.getloadavg()[0]:.2f} at the end")
    return 0


if __name__ == "__main__":
    sys.exit(main())
