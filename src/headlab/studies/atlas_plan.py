"""`headlab plan study=atlas` (`headlab plan` with `headlab atlas`'s arguments): the atlas's time and memory,
probe by probe, before any weights are read.

Each probe's config is composed as the atlas composes it (atlas_probes.probe_config) and its prompts built
with the model's tokenizer. The sweeps (the IOI and text ablations, the copy probe's clean run) are planned
as `headlab plan` plans them (planning.predict, the engine's count at SWEEP_EFFICIENCY); the copy probe's
read-out of every head's value through the vocabulary is counted at its least, one slice of
scores.VOCAB_COLUMNS tokens a head, prompt and sign (a head whose name ranks high reads more slices). The
score probes (induction, sinks, needle-copy, and the cards' attention) run one forward pass of their
prompts each, counted by flops.forward_flops at SCORES_EFFICIENCY; composition multiplies every pair of
heads' d_head x d_model factors in float64, at FLOAT64_RATE of the float32 rate. Not counted: the
attribution cards (2.6 s of smollm2's 124.7 s in docs/benchmarks/profile_atlas-smollm2-135m.txt) and the
probes' Python. The peak memory is the largest probe's: they run one after another on one loaded model.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

from ..analysis.scores import VOCAB_COLUMNS
from ..config import Config, option
from ..errors import UsageError
from ..flops import forward_flops, matmul_gflops
from ..models.hooked import HookedModel
from ..planning import (
    SWEEP_EFFICIENCY,
    Plan,
    Shape,
    converting,
    converts,
    hf_shape,
    predict,
    reads_at_once,
    rss_mb,
    run_dtype,
    shape_of_model,
    tokenizer_mb,
)
from ..tasks import Task, TaskData, build_task
from .atlas import chosen_scores, fitted
from .atlas_probes import left_out, probe_config, probes, text_overrides
from .context import EVAL_SEED_OFFSET

# the share of the matmul rate the score probes' forward passes keep: 0.47-0.72 per probe in smollm2-135m's
# profile (docs/benchmarks/profile_atlas-smollm2-135m.txt), where their eager attention's patterns are read
SCORES_EFFICIENCY = 0.6
# float64 products against float32's on a CPU's vector units: half the lanes (composition, 0.39 of the
# float32 peak in the same profile, is 0.78 of this)
FLOAT64_RATE = 0.5


def composition_gflop(s: Shape) -> float:
    """Every writer's left factor [d_head, d_model] against every later reader's right factor, per mode,
    and the factors themselves (each head's R of a QR times its d_head x d_model weight)."""
    width = s.n_heads * s.d_head
    pairs = sum(layer for layer in range(1, s.n_layers))  # (writer layer, reader layer) pairs
    factor = 2 * width * s.d_head * s.d_model  # every head of a layer
    return (3 * pairs * 2 * width * s.d_model * width + (s.n_layers + 3 * (s.n_layers - 1)) * factor) / 1e9


def atlas_plan(cfg: Config, model: HookedModel | None = None, baseline_mb: float = 0.0) -> Plan:
    """The atlas of `cfg` (study=atlas), planned: the sum of its probes' times, the largest probe's memory.
    `model`: the run's loaded model, its shape and tokenizer read off it, the process's memory before loading
    `baseline_mb` (a run's plan beside what it measured); else the config's, no weights read."""
    if model is None:
        kind = option(cfg.model.kind)
        if kind != "hf":
            raise UsageError(f"plan: model {cfg.model.name} is built here ({kind}): plan a pretrained one")
        baseline = rss_mb()
        shape, tokenizer = hf_shape(cfg)
        name = cfg.model.name
        stand_in: object = SimpleNamespace(tokenizer=tokenizer, vocab_size=shape.vocab, module=None, name=name)
        loaded = tokenizer_mb(stand_in)
    else:
        shape, baseline, loaded, stand_in = shape_of_model(model), baseline_mb, tokenizer_mb(model), model
    options = fitted(cfg.study, cfg)  # composed with study=atlas: its AtlasOptions
    wanted = chosen_scores(options)  # every score where none is named, as the atlas runs
    has_tokenizer = getattr(stand_in, "tokenizer", None) is not None  # as the atlas runs: its probes' prompts
    rate = matmul_gflops(shape, 512, dtype=run_dtype(cfg))
    seconds: dict[str, float] = {}
    gflop, plans = 0.0, []

    def prompts(overrides: list[str]) -> tuple[Config, Task, TaskData]:
        probe = probe_config(cfg, overrides)
        task = build_task(probe.task)
        return probe, task, task.build(probe.task.n_prompts, seed=probe.seed + EVAL_SEED_OFFSET, model=stand_in)

    def forward(name: str, rows: int, tokens: int, efficiency: float = SCORES_EFFICIENCY) -> None:
        nonlocal gflop
        work = forward_flops(shape, rows, tokens) / 1e9
        gflop += work
        seconds[name] = work / (rate * efficiency)

    _, _, text = prompts(text_overrides(options, 0) if has_tokenizer else [])  # the cards' prompts
    forward("attention", *text.inputs["input_ids"].shape)
    for probe in probes():
        runs = any(s.name in wanted for s in probe.scores)
        if not runs or left_out(probe, cfg.model.name, has_tokenizer, shape.n_layers):
            continue  # as the run leaves it out
        if probe.study.name == "composition":
            work = composition_gflop(shape)
            gflop += work
            seconds[probe.name] = work / (rate * FLOAT64_RATE * SCORES_EFFICIENCY)
            continue
        if probe.study.name == "induction":
            forward(probe.name, options.repeat_sequences, 1 + 2 * options.repeat_len)
            continue
        probe_cfg, task, data = prompts(probe.overrides(options))
        # the rate measured once above serves every probe
        plan = predict(probe_cfg, shape, data, reads_at_once(task, data), baseline, loaded, rate)
        plans.append(plan)
        if probe.study.name != "sweep":  # sinks, needle-copy: their prompts' forward pass
            forward(probe.name, *data.inputs["input_ids"].shape)
            continue
        assert plan.gflop is not None and plan.seconds is not None
        gflop += plan.gflop
        seconds[probe.name] = plan.seconds - plan.load_seconds
        if probe_cfg.study.head_scores:  # the copy scores: a slice of the vocabulary a head, prompt and sign
            rows = 2 * shape.n_layers * shape.n_heads * data.n
            work = 2 * rows * shape.d_model * min(VOCAB_COLUMNS, shape.vocab) / 1e9
            gflop += work
            seconds[probe.name] += work / (rate * SWEEP_EFFICIENCY)
    largest = max(plans, key=lambda p: p.peak_host_mb) if plans else predict(cfg, shape, text, 0, baseline, loaded)
    total = sum(seconds.values()) + largest.load_seconds
    top = sorted(seconds.items(), key=lambda kv: -kv[1])
    atlas = dataclasses.replace(
        largest,
        study="atlas",
        prompts=sum(p.prompts for p in plans) + text.n,
        tokens=max([p.tokens for p in plans] + [text.inputs["input_ids"].shape[1]]),
        gflop=gflop,
        matmul_gflops=rate,
        seconds=total,
        efficiency=gflop / max(sum(seconds.values()) * rate, 1e-9),
        work=", ".join(f"{name} {s:,.0f} s" for name, s in top),
        note="" if not options.scores else f"the probes of {', '.join(sorted(options.scores))}",
    )
    # a run's own plan (model given) is made once it has loaded: the runner adds what loading converted
    return converting(atlas, shape) if model is None and converts(cfg) else atlas
