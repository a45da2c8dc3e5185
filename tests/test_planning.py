"""`headlab plan` (planning.py): a run's needs said before any weights are read. The sweep's FLOP model is
held to torch's own count of what the engine executes; the plan is written beside what each sweep run
measured; models built here are refused in one line."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pandas as pd
import pytest
import torch
from safetensors.torch import save_file
from torch.utils.flop_counter import FlopCounterMode

import headlab
from conftest import error_line, run_headlab
from headlab import planning
from headlab.analysis.head_composition import composition
from headlab.edges import eap
from headlab.edges.faithfulness import measure
from headlab.flops import BACKWARD_RUNS, circuit_gflop, sweep_gflop
from headlab.flops import block_flops as planning_block
from headlab.planning import shape_of_model
from headlab.runtime import LIVE_ACTIVATIONS, chunk_budget_mb
from headlab.studies import circuit as circuit_study
from headlab.studies.atlas_plan import composition_gflop
from headlab.studies.atlas_probes import AtlasOptions, text_overrides
from headlab.studies.context import EVAL_SEED_OFFSET


@pytest.fixture(scope="module")
def llama_dir(tiny_hf_dir_with_tokenizer):
    return tiny_hf_dir_with_tokenizer("llama")


# each case: headlab.sweep's arguments and the same sweep as overrides
SWEEPS = {
    "heads": ({"ablate": "heads"}, ["ablate=heads"]),
    "layers": ({"ablate": "layers"}, ["ablate=layers"]),
    "mean over the reference set": ({"ablate": "heads", "method": "mean"}, ["ablate=heads", "ablate.method=mean"]),
    "path into the logits": ({"ablate": "none", "patch": "path"}, ["ablate=none", "patch=path"]),
    "path into q": (
        {"ablate": "none", "patch": "path", "receivers": ["1.0", "1.2"], "receiver_site": "q"},
        ["ablate=none", "patch=path", "patch.receivers=[1.0,1.2]", "patch.receiver_site=q"],
    ),
    # the engine starts where the counterfactual prompts first differ, or at the role
    "activation": ({"ablate": "none", "patch": "activation"}, ["ablate=none", "patch=activation"]),
    "activation at END and S2": (
        {"ablate": "none", "patch": "activation", "positions": ["END", "S2"]},
        ["ablate=none", "patch=activation", "patch.positions=[END,S2]"],
    ),
    "path into k at S2": (
        {"ablate": "none", "patch": "path", "receivers": ["2.1"], "receiver_site": "k", "positions": ["S2"]},
        ["ablate=none", "patch=path", "patch.receivers=[2.1]", "patch.receiver_site=k", "patch.positions=[S2]"],
    ),
}


@pytest.mark.parametrize("sweep", SWEEPS)
def test_the_sweeps_flops_are_what_the_engine_executes(llama_dir, sweep):
    model = headlab.load_model(str(llama_dir))
    task = headlab.load_task("ioi", n_prompts=8)
    arguments, overrides = SWEEPS[sweep]
    with FlopCounterMode(display=False) as counter:
        headlab.sweep(model, task, n_boot=0, **arguments)
    cfg = headlab.compose("model=hf", f"model.path={llama_dir}", "task=ioi", "task.n_prompts=8", *overrides)
    data = task.build(8, EVAL_SEED_OFFSET, model)
    n, gflop = sweep_gflop(cfg, shape_of_model(model), data)
    heads = model.n_layers * model.n_heads
    assert n == 1 + (model.n_layers if sweep == "layers" else heads * len(arguments.get("positions", [0])))
    assert 0.85 < gflop / (counter.get_total_flops() / 1e9) < 1.2, gflop / (counter.get_total_flops() / 1e9)


def test_plan_says_memory_and_time_before_loading_and_a_run_checks_it(llama_dir, tmp_path):
    args = ("model=hf", f"model.path={llama_dir}", "task=ioi", "task.n_prompts=8", "ablate=heads")
    said = run_headlab("plan", *args, cwd=tmp_path)
    assert said.returncode == 0, said.stderr
    assert "peak host memory" in said.stdout and "time:" in said.stdout and "interventions" in said.stdout
    plan = headlab.plan(*args)
    model = headlab.load_model(str(llama_dir))
    params = sum(p.numel() for p in model.module.parameters())
    assert plan.params == params and plan.weights_mb == pytest.approx(params * 4 / 2**20)
    assert plan.prompts == 8 and plan.seconds is not None and plan.seconds > 0
    ran = run_headlab("run", *args, "output.n_boot=0", f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    assert ran.returncode == 0, ran.stderr
    meta = json.loads((tmp_path / "run" / "meta.json").read_text())
    assert meta["plan"]["gflop"] == pytest.approx(plan.gflop, abs=0.01) and meta["plan"]["params"] == params
    assert meta["measured"]["peak_host_mb"] > 0 and 0.3 < meta["measured"]["peak_host_ratio"] < 3
    circuit = headlab.plan("model=hf", f"model.path={llama_dir}", "task=ioi", "circuit=eap")
    assert circuit.seconds > 0 and "faithfulness curve" in circuit.lines()[-1]
    exact = headlab.plan("model=hf", f"model.path={llama_dir}", "task=ioi", "circuit=exact")
    assert exact.seconds is not None and exact.gflop > circuit.gflop  # an edge's blocks, where EAP takes a product
    # a circuit run checks its plan too: EAP's recordings and the senders' outputs, not a sweep's caches
    args = ("model=hf", f"model.path={llama_dir}", "task=ioi", "task.n_prompts=8", "circuit=eap")
    ran = run_headlab("run", *args, "output.n_boot=0", f"hydra.run.dir={tmp_path / 'circuit'}", cwd=tmp_path)
    assert ran.returncode == 0, ran.stderr
    meta = json.loads((tmp_path / "circuit" / "meta.json").read_text())
    assert meta["plan"]["study"] == "circuit" and 0.3 < meta["measured"]["peak_host_ratio"] < 3
    shape = shape_of_model(model)
    senders = 1 + shape.n_layers * (shape.n_heads + 1)
    assert meta["plan"]["caches_mb"] > senders * 8 * meta["plan"]["tokens"] * shape.d_model * 4 / 2**20
    attributed = headlab.plan("model=hf", f"model.path={llama_dir}", "task=ioi", "ablate=none", "patch=attribution")
    assert attributed.seconds is not None and attributed.seconds > 0


def test_a_gpu_runs_plan_holds_the_model_and_the_engines_own_chunks_on_the_device(llama_dir, monkeypatch):
    args = ("model=hf", f"model.path={llama_dir}", "task=ioi", "task.n_prompts=8", "ablate=heads")
    cpu = headlab.plan(*args)
    assert cpu.peak_device_mb == 0 and "peak device memory: none (device=cpu)" in cpu.lines()
    # the engine stacks a chunk's copies within one layer: one layer's heads' copies are the largest chunk
    assert cpu.chunk_interventions == json.loads((llama_dir / "config.json").read_text())["num_attention_heads"]
    whole = cpu.chunk_interventions * cpu.copy_mb
    # no GPU seen here: chunks of engine.chunk_mb (at most a layer's interventions), no time
    unseen = headlab.plan(*args, "device=cuda")
    device_fixed = cpu.weights_mb + cpu.caches_mb + 3 * cpu.logits_mb
    assert unseen.peak_device_mb == pytest.approx(device_fixed + LIVE_ACTIVATIONS * min(32.0, whole))
    # the host holds the largest safetensors file as the weights move to the device
    largest = max(f.stat().st_size for f in Path(llama_dir).glob("*.safetensors")) / 2**20
    assert unseen.peak_host_mb == pytest.approx(unseen.baseline_mb + unseen.tokenizer_mb + largest)
    assert unseen.seconds is None and "no GPU visible" in unseen.note
    assert "peak device memory" in unseen.lines()[2] and "on cuda" in unseen.lines()[2]
    # a device whose free memory after the weights and caches makes the engine's chunk half the whole sweep:
    # the plan's chunk is runtime.chunk_budget_mb's, as the engine will compute it there
    room = 4 * whole  # gpu_memory_share 0.5 of it over LIVE_ACTIVATIONS (4): whole / 2
    monkeypatch.setattr(planning, "device_free_mb", lambda device: cpu.weights_mb + cpu.caches_mb + room)
    monkeypatch.setattr(planning, "matmul_gflops", lambda *a, **k: 1000.0)
    seen = headlab.plan(*args, "device=cuda", "engine.chunk_mb=0.001")
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (int(room * 2**20), int(8 * room * 2**20)))
    chunk = chunk_budget_mb(torch.device("cuda"), 0.001, 0.5)
    assert chunk == pytest.approx(whole / 2)
    assert seen.device_working_mb == pytest.approx(LIVE_ACTIVATIONS * chunk + 3 * cpu.logits_mb)
    assert seen.seconds is not None and seen.matmul_gflops == 1000.0


def test_a_bfloat16_runs_plan_holds_half_the_activations_and_times_bfloat16_products(llama_dir, monkeypatch):
    args = ("model=hf", f"model.path={llama_dir}", "task=ioi", "task.n_prompts=8", "ablate=heads")
    full = headlab.plan(*args)
    asked: list[torch.dtype] = []
    monkeypatch.setattr(planning, "matmul_gflops", lambda *a, dtype=torch.float32, **k: asked.append(dtype) or 1e3)
    half = headlab.plan(*args, "model.dtype=bfloat16")
    assert asked == [torch.bfloat16]  # the engine's products are the model's dtype, and so is their rate
    # the clean caches and a chunk's copy are the model's dtype (the boolean masks are not)
    assert half.caches_mb - half.mask_mb == pytest.approx((full.caches_mb - full.mask_mb) / 2)
    assert half.copy_mb == pytest.approx(full.copy_mb / 2) and half.weights_mb == pytest.approx(full.weights_mb / 2)


def _profiled_gflop(prof: torch.profiler.profile) -> float:
    """The FLOPs the profiler counted, summed over its raw events: key_averages() would build an event
    tree first, most of a minute for a circuit run's million ops, to the same sum."""
    return sum(e.flops() for e in prof.profiler.kineto_results.events()) / 1e9


def test_attribution_patchings_flops_are_what_it_executes(llama_dir):
    model = headlab.load_model(str(llama_dir))
    task = headlab.load_task("ioi", n_prompts=40)  # two passes of PROMPTS_PER_PASS prompts
    # torch's profiler: FlopCounterMode cannot sit under autograd.grad
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], with_flops=True) as prof:
        headlab.sweep(model, task, ablate="none", patch="attribution", n_boot=0)
    executed = _profiled_gflop(prof)
    overrides = ("model=hf", f"model.path={llama_dir}", "task=ioi", "task.n_prompts=40", "ablate=none")
    cfg = headlab.compose(*overrides, "patch=attribution")
    _, gflop = sweep_gflop(cfg, shape_of_model(model), task.build(40, EVAL_SEED_OFFSET, model))
    assert 0.85 < gflop / executed < 1.2, gflop / executed


@pytest.mark.parametrize("method", ["eap", "eap_ig", "eap_ig_activations", "exact"])
def test_the_circuit_flops_are_what_scoring_and_the_curve_execute(llama_dir, method, monkeypatch):
    """Scoring's count is what it executes, and so is its count of the blocks it runs one at a time; the
    curve's counts every receiver's mixture, the most a circuit keeps, so it bounds what the curve's circuits
    execute from above."""
    model = headlab.load_model(str(llama_dir))
    task = headlab.load_task("ioi", n_prompts=8)
    blocks = {"forward": 0, "backward": 0}  # blocks run one at a time: forward, and backward layers
    run_blocks, layer_gradients, recorded = model.run_blocks, eap._layer_gradients, eap.record

    def forward(h, layer, *args, stop=None, **kwargs):
        blocks["forward"] += (model.n_layers if stop is None else stop) - layer
        return run_blocks(h, layer, *args, stop=stop, **kwargs)

    def backward(*args, **kwargs):
        blocks["backward"] += 1
        blocks["forward"] -= 1  # its block run again under autograd: a part of the backward layer's count
        return layer_gradients(*args, **kwargs)

    def recording(*args, **kwargs):
        blocks["forward"] += model.n_layers
        return recorded(*args, **kwargs)

    monkeypatch.setattr(model, "run_blocks", forward)
    monkeypatch.setattr(eap, "_layer_gradients", backward)
    monkeypatch.setattr(eap, "record", recording)
    # scoring under torch's profiler (FlopCounterMode cannot sit under autograd.grad)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], with_flops=True) as prof:
        headlab.study(model, task, "circuit", method=method, faithfulness=False, n_boot=0)
    scoring = _profiled_gflop(prof)
    monkeypatch.undo()
    # the curve alone under FlopCounterMode: it takes no gradient, and the profiler's cost per op is minutes here
    curve = FlopCounterMode(display=False)

    def counted(*args, **kwargs):
        with curve:
            return measure(*args, **kwargs)

    monkeypatch.setattr(circuit_study, "measure", counted)
    headlab.study(model, task, "circuit", method=method, faithfulness=True, n_boot=0)
    cfg = headlab.compose("model=hf", f"model.path={llama_dir}", "task=ioi", "task.n_prompts=8", f"circuit={method}")
    flops = circuit_gflop(cfg, shape_of_model(model), task.build(8, EVAL_SEED_OFFSET, model))
    assert flops is not None and (flops.products > 0) == (method != "exact")
    if method != "exact":  # a sweep's stacked chunks: no fixed cost a block in the plan
        assert flops.block_runs == blocks["forward"] + BACKWARD_RUNS * blocks["backward"], (flops.block_runs, blocks)
    ratios = (flops.scoring / scoring, curve.get_total_flops() / 1e9 / flops.curve)
    assert 0.85 < ratios[0] < 1.2 and 0.5 < ratios[1] <= 1.0, ratios


def test_a_circuit_run_under_a_budget_takes_fewer_prompts_a_pass_and_the_same_scores(llama_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(planning, "rss_mb", lambda: 500.0)  # this process's size, as the run's plan measures it
    args = ("model=hf", f"model.path={llama_dir}", "task=ioi", "task.n_prompts=8", "circuit=eap_ig")
    args = (*args, "study.faithfulness=false", "output.n_boot=0")
    plan = headlab.plan(*args)
    # 16 prompts a pass by default: all 8 at once (and the attention mask of a pass over them)
    assert plan.caches_mb == pytest.approx(8 * plan.per_prompt_mb + plan.mask_mb)
    # room for a few prompts' recordings beside the weights, this process and the engine's least chunk
    fixed = plan.peak_host_mb - plan.caches_mb + plan.mask_mb - plan.working_mb
    fixed += planning.least_working(plan)  # a circuit's passes hold their own working memory, whatever the chunk
    budget = int((fixed + 2.5 * plan.per_prompt_mb) / planning.BUDGET_SHARE) + 1  # its plan fills BUDGET_SHARE
    room = planning.kept_mb(f"{budget}MB")
    kept = run_headlab("run", *args, f"engine.max_memory={budget}MB", f"hydra.run.dir={tmp_path / 'in'}", cwd=tmp_path)
    assert kept.returncode == 0, kept.stderr
    meta = json.loads((tmp_path / "in" / "meta.json").read_text())
    per_pass = meta["budget"]["prompts_per_pass"]  # the most whose recordings fit
    assert (
        1 < per_pass < 8 and fixed + per_pass * plan.per_prompt_mb <= room < fixed + (per_pass + 1) * plan.per_prompt_mb
    )
    assert meta["budget"]["planned_peak_host_mb"] <= budget
    free = run_headlab("run", *args, f"hydra.run.dir={tmp_path / 'free'}", cwd=tmp_path)
    assert free.returncode == 0, free.stderr
    tables = [pd.read_parquet(tmp_path / d / "results.parquet") for d in ("in", "free")]
    pd.testing.assert_series_equal(tables[0]["value"], tables[1]["value"], atol=1e-6, rtol=1e-5)


def test_a_budget_the_faithfulness_curve_exceeds_holds_fewer_prompts_recordings_and_the_same_curve(
    llama_dir, tmp_path, monkeypatch
):
    monkeypatch.setattr(planning, "rss_mb", lambda: 500.0)  # this process's size, as the run's plan measures it
    args = ("model=hf", f"model.path={llama_dir}", "task=ioi", "task.n_prompts=8", "circuit=eap", "output.n_boot=0")
    plan = headlab.plan(*args, "study.prompts_per_pass=1")
    assert plan.curve_mb == pytest.approx(8 * plan.curve_prompt_mb) and plan.curve_mb > plan.per_prompt_mb
    fixed = plan.peak_host_mb - plan.caches_mb + plan.mask_mb - plan.working_mb
    fixed += planning.least_working(plan)  # a circuit's passes hold their own working memory, whatever the chunk
    # room for three prompts' curve recordings in the share of the budget its plan fills
    budget = int((fixed + 3.5 * plan.curve_prompt_mb) / planning.BUDGET_SHARE) + 1
    room = planning.kept_mb(f"{budget}MB")
    assert room > fixed + plan.per_prompt_mb
    kept = run_headlab("run", *args, f"engine.max_memory={budget}MB", f"hydra.run.dir={tmp_path / 'in'}", cwd=tmp_path)
    assert kept.returncode == 0, kept.stderr
    meta = json.loads((tmp_path / "in" / "meta.json").read_text())
    held = meta["budget"]["curve_prompts"]  # the most prompts whose curve recordings fit
    assert 1 < held < 8 and fixed + held * plan.curve_prompt_mb <= room < fixed + (held + 1) * plan.curve_prompt_mb
    assert meta["budget"]["planned_peak_host_mb"] <= budget
    # `headlab plan` with the budget: the run's settings and its peak, as the run planned them
    planned = headlab.plan(*args, f"engine.max_memory={budget}MB")
    assert planned.peak_host_mb == pytest.approx(meta["budget"]["planned_peak_host_mb"], abs=0.1)
    # its curve records the prompts again at each bisection step: more work than the same run without a budget
    assert f"study.curve_prompts={held}" in planned.lines()[-1] and planned.gflop > headlab.plan(*args).gflop
    free = run_headlab("run", *args, f"hydra.run.dir={tmp_path / 'free'}", cwd=tmp_path)
    assert free.returncode == 0, free.stderr
    tables = [pd.read_parquet(tmp_path / d / "results.parquet") for d in ("in", "free")]
    pd.testing.assert_series_equal(tables[0]["value"], tables[1]["value"], atol=1e-6, rtol=1e-5)


def test_a_model_built_here_is_refused_in_one_line(tmp_path):
    refused = run_headlab("plan", "model=toy-attn-1l", cwd=tmp_path)
    assert refused.returncode == 2 and "plan a pretrained one" in error_line(refused)


def test_a_run_keeps_its_memory_budget_or_is_refused_naming_the_least_it_needs(llama_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(planning, "rss_mb", lambda: 500.0)  # this process's size, the same in every plan below
    args = ("model=hf", f"model.path={llama_dir}", "task=ioi", "task.n_prompts=8", "ablate=heads", "output.n_boot=0")
    refused = run_headlab("run", *args, "engine.max_memory=100MB", f"hydra.run.dir={tmp_path / 'no'}", cwd=tmp_path)
    line = error_line(refused)
    assert refused.returncode == 2 and "engine.max_memory=100MB: this run needs at least" in line, refused.stderr
    assert not (tmp_path / "no" / "results.parquet").exists()
    least = float(re.search(r"at least ([\d,]+)MB", line)[1].replace(",", ""))  # type: ignore[index]
    plan = headlab.plan(*args)
    # a budget between the least and the default chunk's peak: the chunk is lowered to fit, the table unchanged
    budget = int((least + plan.peak_host_mb) / 2) + 1
    kept = run_headlab("run", *args, f"engine.max_memory={budget}MB", f"hydra.run.dir={tmp_path / 'in'}", cwd=tmp_path)
    assert kept.returncode == 0, kept.stderr
    meta = json.loads((tmp_path / "in" / "meta.json").read_text())
    assert meta["budget"]["chunk_mb"] < 32 and meta["budget"]["planned_peak_host_mb"] <= budget
    free = run_headlab("run", *args, f"hydra.run.dir={tmp_path / 'free'}", cwd=tmp_path)
    assert free.returncode == 0, free.stderr
    tables = [pd.read_parquet(tmp_path / d / "results.parquet") for d in ("in", "free")]
    pd.testing.assert_series_equal(tables[0]["value"], tables[1]["value"], atol=1e-5, rtol=1e-5)
    bad = run_headlab("run", *args, "engine.max_memory=lots", cwd=tmp_path)
    assert bad.returncode == 2 and "a size in MB or GB" in error_line(bad)


def test_weights_that_do_not_fit_the_budget_wait_on_disk_as_few_blocks_as_needed():
    from headlab.errors import UsageError
    from headlab.planning import Plan, fitted, working_mb

    work = working_mb(32, 1.0)
    # this process 510 MB, weights 1000 MB in 8 blocks of 100 MB (and 200 MB of embeddings), caches 50 MB
    plan = Plan("sweep", "m", 0, 8, 16, 1000.0, 50.0, work, 500.0, 10.0, 1560.0 + work, 1.0, 100.0, 8)
    chunk, moved = fitted(plan, 32, "1400MB")
    # k blocks on disk hold 1000 - 100 k + 200 MB (one block read at a time, counted twice): k = 6 fits a
    # 1 MB chunk's working memory (7 MB) in the 1260 MB the run plans to fill of 1400 (BUDGET_SHARE), 5 does not
    assert planning.kept_mb("1400MB") == pytest.approx(1260)
    assert moved.layers_on_disk == 6 and moved.weights_mb == 600.0
    assert moved.peak_host_mb - moved.working_mb + working_mb(chunk, 1.0) <= 1260
    assert fitted(plan, 32, "4GB") == (32, plan)  # room enough: every block in memory, the chunk as asked
    # every block on disk leaves the embeddings, one block twice and the rest: 967 MB, of which 1,075 is 90%
    with pytest.raises(UsageError, match=r"needs at least 1,075MB \(weights 400"):
        fitted(plan, 32, "900MB")


def test_a_model_with_blocks_on_disk_sweeps_as_in_memory_and_its_copies_go_with_it(llama_dir):
    import gc

    from headlab.interventions import CLEAN, Intervention
    from headlab.interventions.engine import execute
    from headlab.models.hf import load_hf
    from test_prefix import LastRealToken, prompts

    whole = load_hf(str(llama_dir), need_tokenizer=False)
    streamed = load_hf(str(llama_dir), need_tokenizer=False, layers_on_disk=2)
    layers = streamed.module.hf_device_map
    assert [layers[f"model.layers.{i}"] for i in range(3)] == ["cpu", "disk", "disk"]
    folder = streamed.module.model.layers[2].self_attn.q_proj._hf_hook.weights_map.dataset.save_folder
    data = prompts(50257)
    ivs = [CLEAN, *(Intervention("ablate_head", "zero", l, h) for l in range(3) for h in range(4))]
    got = execute(streamed, LastRealToken(), data, ivs, chunk_mb=0.05)
    expected = execute(whole, LastRealToken(), data, ivs, chunk_mb=0.05)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
    # attribution reads W_O and the q/k/v weights directly: loaded from disk for the read
    from headlab.edges.eap import scores
    from headlab.edges.graph import EdgeGraph

    task = headlab.load_task("ioi", n_prompts=4)
    ioi = task.build(4, 0, load_hf(str(llama_dir)))  # the prompts need the tokenizer, the scores do not
    a = scores(whole, task, ioi, EdgeGraph.of(whole), "eap_ig")
    b = scores(streamed, task, ioi, EdgeGraph.of(streamed), "eap_ig")
    torch.testing.assert_close(a, b, atol=1e-6, rtol=0, equal_nan=True)
    del streamed
    gc.collect()
    assert not Path(folder).exists()
    named = Path(folder).parent / "named-by-the-caller"
    kept = load_hf(str(llama_dir), need_tokenizer=False, layers_on_disk=1, offload_folder=str(named))
    del kept
    gc.collect()
    assert named.is_dir()  # a folder the caller named stays theirs
    shutil.rmtree(named)


@pytest.mark.parametrize(("role", "receivers", "site"), [("S1+1", "2.0 2.3", "k"), ("END", "logits", None)])
def test_a_path_patching_rounds_flops_are_what_it_executes(llama_dir, role, receivers, site):
    from headlab.analysis.ioi_classes import with_s1_next
    from headlab.flops import path_round_flops
    from headlab.interventions.path import path_patch
    from headlab.interventions.plan import Intervention

    model = headlab.load_model(str(llama_dir))
    task = headlab.load_task("ioi")
    data = with_s1_next(task.build(8, seed=1, model=model))
    layer = None if receivers == "logits" else 2
    senders = [
        Intervention("path_patch", "path", l, h, token=role, site=site, receivers=receivers)
        for l in range(model.n_layers if layer is None else layer)
        for h in range(model.n_heads)
    ]
    with FlopCounterMode(display=False) as counter:
        path_patch(model, task, data, senders)
    # path_patch's own clean run and reference run besides the round: a forward pass each, read out
    rows, tokens = data.inputs["input_ids"].shape
    s = shape_of_model(model)
    runs = 2 * sum(sum(planning_block(s, rows, tokens, l)) for l in range(s.n_layers))
    last = data.positions.max(1).values
    counted = path_round_flops(s, data.token_positions[role], last, layer) + runs
    assert 0.85 < counted / counter.get_total_flops() < 1.2, counted / counter.get_total_flops()


def test_the_atlas_is_planned_probe_by_probe_and_its_run_checks_it(llama_dir, tmp_path, monkeypatch):
    """Composition's count is what torch counts of its products; the atlas's plan sums its probes' (each
    ablation probe's the plan of its own sweep's command), a budget is held to its largest probe's peak, and
    the atlas run writes its plan beside what it measured."""
    monkeypatch.setattr(planning, "rss_mb", lambda: 500.0)  # this process's size, the same in every plan below
    model = headlab.load_model(str(llama_dir))
    with FlopCounterMode(display=False) as counted:
        composition(model, channels=0)
    assert composition_gflop(shape_of_model(model)) == pytest.approx(counted.get_total_flops() / 1e9, rel=0.02)
    small = ["study.ioi_prompts=4", "study.copy_prompts=6", "study.text_docs=2", "study.text_len=24"]
    args = ("model=hf", f"model.path={llama_dir}", "study=atlas", *small, "study.needle_prompts=4")
    plan = headlab.plan(*args)
    probes = dict(re.findall(r"(\w+) ([\d.]+) s", plan.work))
    assert set(probes) == {
        "attention",
        "induction",
        "copy",
        "sinks",
        "needle_copy",
        "composition",
        "ioi_ablation",
        "text_ablation",
    }
    text = headlab.plan(
        "model=hf", f"model.path={llama_dir}", *text_overrides(AtlasOptions(text_len=24), 2), "ablate=heads"
    )
    ioi = headlab.plan("model=hf", f"model.path={llama_dir}", "task=ioi", "task.n_prompts=4", "ablate=heads")
    assert plan.gflop > text.gflop + ioi.gflop and plan.seconds > text.seconds + ioi.seconds - 2 * planning.LOAD_FIXED_S
    assert plan.peak_host_mb >= max(text.peak_host_mb, ioi.peak_host_mb) - 1  # the atlas's pieces: their largest
    with pytest.raises(headlab.UsageError, match="engine.max_memory=100MB: this run needs at least"):
        headlab.plan(*args, "engine.max_memory=100MB")
    kept = headlab.plan(*args, f"engine.max_memory={int((plan.peak_host_mb - 2) / planning.BUDGET_SHARE)}MB")
    assert "engine.chunk_mb=" in kept.budget and kept.peak_host_mb <= plan.peak_host_mb - 2
    ran = run_headlab("run", *args, "output.n_boot=0", f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    assert ran.returncode == 0, ran.stderr
    meta = json.loads((tmp_path / "run" / "meta.json").read_text())
    assert meta["plan"]["study"] == "atlas" and meta["plan"]["gflop"] == pytest.approx(plan.gflop, abs=0.06)
    assert 0.3 < meta["measured"]["peak_host_ratio"] < 3


def test_loading_counts_weights_in_the_runs_dtype_as_mapped_and_others_as_read(llama_dir, tmp_path):
    """transformers maps safetensors stored in the run's dtype, and reads and converts the others: the plan
    reads the stored dtype from the first file's header."""
    base = ("model=hf", f"model.path={llama_dir}", "task=ioi", "ablate=heads")
    assert planning.maps_weights(headlab.compose(*base))  # stored and run in float32
    assert not planning.maps_weights(headlab.compose(*base, "model.dtype=bfloat16"))
    halved = tmp_path / "bf16"
    halved.mkdir()
    save_file({"weight": torch.zeros(2, 2, dtype=torch.bfloat16)}, halved / "model.safetensors")
    assert planning.maps_weights(headlab.compose("model=hf", f"model.path={halved}", "model.dtype=bfloat16"))
    assert not planning.maps_weights(headlab.compose("model=hf", f"model.path={halved}"))


def test_mapped_embeddings_no_pass_reads_are_left_out_of_the_peak(llama_dir, monkeypatch):
    """A CPU run holds of mapped weights only the pages its passes read: the embedding's lookup reads its token
    rows, and a readout of named vocabulary rows (an IOI circuit's logit difference) none of the unembedding;
    IOI's sweep reads io_prob's normaliser, the whole unembedding (benchmarks: RssFile of gemma3-270m's and the
    Llama-3.2-1B shape's EAP-IG)."""
    config = json.loads((Path(llama_dir) / "config.json").read_text())
    matrix = config["vocab_size"] * config["hidden_size"] * 4 / 2**20
    tied = config.get("tie_word_embeddings", False)
    monkeypatch.setattr(planning, "matmul_gflops", lambda *a, **k: 1000.0)  # the memory alone is asked here
    base = ("model=hf", f"model.path={llama_dir}", "task=ioi", "task.n_prompts=4")
    circuit, sweep = headlab.plan(*base, "circuit=eap_ig"), headlab.plan(*base, "ablate=heads")
    assert circuit.unread_mb == pytest.approx(matrix * (1 if tied else 2))
    assert sweep.unread_mb == pytest.approx(0 if tied else matrix)
    parts = sweep.baseline_mb + sweep.tokenizer_mb + sweep.weights_mb + sweep.caches_mb + sweep.working_mb
    assert sweep.code_mb == planning.CODE_MB  # the library code a CPU run's kernels map: in its peak
    assert sweep.peak_host_mb == pytest.approx(parts + sweep.code_mb - sweep.unread_mb)
    halved = headlab.plan(*base, "circuit=eap_ig", "model.dtype=bfloat16")  # read and converted: all resident
    assert halved.unread_mb == 0


def test_a_gguf_models_first_run_is_planned_with_its_conversion(tmp_path, monkeypatch):
    """A GGUF model's first run de-quantises its weights to float32 once, into the cache, before it loads them:
    the plan counts that time and the process's memory while it does; a run that finds the copy does not."""
    monkeypatch.setenv("HEADLAB_CACHE", str(tmp_path / "empty"))
    args = ("model=smollm2-135m", "task=ioi", "task.n_prompts=4", "ablate=heads")
    cfg = headlab.compose(*args)
    assert planning.converts(cfg)
    first = headlab.plan(*args)
    weights = first.params * 4 / 2**20  # float32
    assert first.convert_seconds == pytest.approx(weights / planning.CONVERT_MB_S)
    assert first.convert_mb == pytest.approx(first.baseline_mb + first.tokenizer_mb + planning.CONVERT_COPIES * weights)
    assert first.highest_host_mb == max(first.peak_host_mb, first.convert_mb)
    assert "de-quantised to float32 once" in first.lines()[1]
    assert not list((tmp_path / "empty").glob("weights/*"))  # planned, not converted
    from headlab.models import gguf

    made = gguf.copy_dir(gguf.locate(cfg.model.gguf_file, package=cfg.model.package))
    made.mkdir(parents=True)
    (made / gguf.PROVENANCE).write_text("{}")
    assert not planning.converts(cfg)  # the copy is there: loading reads it
