"""headlab's Python API: the calls behind every CLI command, for notebooks and scripts.

    import headlab
    model = headlab.load_model("toy-attn-1l")          # trained here on first use, then reused
    task = headlab.load_task("counting")
    table = headlab.sweep(model, task, ablate="heads")  # tidy pandas table, nothing written

Options are config keys (configs/ and config.py say which exist): a bare name is found in the config
section it belongs to (`n_boot=100` is output.n_boot), a name two sections share is spelled with its
section (`train__steps=300`). Bad input raises the same one-line HeadlabError the CLI prints.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd
from omegaconf import OmegaConf

from .config import Config
from .discovery import load_plugins as load_plugins
from .door import compose as compose_config
from .door import compose_checked, group_options, option_overrides
from .errors import UsageError
from .interventions import CLEAN, Intervention
from .interventions.user import checked
from .io import atomic_write_bytes
from .models.check import Verdict, check_model
from .models.hooked import HookedModel
from .models.loading import ModelConfig, ModelKind
from .planning import Plan
from .studies.context import RunContext, apply_runtime
from .studies.registry import get as get_study
from .studies.registry import named_study, resolve
from .studies.runner import BUDGET_KNOBS, execute_run, plan_of, run_in_memory, within_budget
from .task_models import choose_model
from .tasks import Task, TaskData, build_task
from .train.obtain import is_trained_here

log = logging.getLogger("headlab")


@dataclass(frozen=True)
class RunResult:
    """What `headlab run` leaves, as `headlab.run` returns it.

    Attributes:
        table: the tidy table (one row per observation; see `sweep`).
        run_dir: the run dir it was written to, or the earlier one that was reused.
        skipped: True where an earlier run of the same config was reused instead of run again.
        config: the typed config it ran.
    """

    table: pd.DataFrame
    run_dir: Path
    skipped: bool
    config: Config


def compose(*overrides: str) -> Config:
    """The typed, validated config of `headlab run <overrides>`, composed as the CLI composes it.

    Args:
        *overrides: Hydra overrides, as typed after `headlab run` (`"task=ioi"`, `"ablate.method=mean"`).

    Returns:
        The config as config.py's dataclasses, every option checked against its rule.

    Raises:
        UsageError: an unknown group option or key, a wrong type, a value outside its rule.

    Example:
        ```python
        cfg = headlab.compose("model=toy-attn-2l", "ablate.method=mean")
        assert cfg.ablate.method.value == "mean"
        ```
    """
    return compose_config(overrides)


def load_task(name: str, **options: Any) -> Task:
    """A task by name, with its config file's defaults and your options.

    Args:
        name: a task config (`headlab list task`): counting, ioi, recall_reasoning, markov, prompts, text,
            needle, or one you added.
        **options: the task's config keys, e.g. `n_prompts=200`, `templates="baba"`.

    Returns:
        The task: its config is `task.cfg`; `task.build(n, seed, model)` draws prompts (TaskData).

    Example:
        ```python
        task = headlab.load_task("counting", n_prompts=64)
        ```
    """
    cfg = compose_config([f"task={name}", *option_overrides(options, prefer=("task",))])
    return build_task(cfg.task)


def load_model(
    name_or_path: str, task: str | Task | None = None, show_progress: bool = False, **options: Any
) -> HookedModel:
    """A model ready for sweeps, with headlab's hooks on every head.

    Models trained here (toy models, `gpt2-ioi`) are trained on `task` exactly as `headlab run` trains
    them, into output.root/checkpoints, and reused when trained before.

    Args:
        name_or_path: a model config (`headlab list model`, e.g. smollm2-135m), a local directory, a GGUF
            file (dequantised once per user to float32, into locations.cache_dir()) or a hub id.
        task: the task a model trained here is trained on (a name or a Task; default: the config's task,
            counting for the toy models).
        show_progress: draw progress bars.
        **options: model, train and top-level config keys, e.g. `n_heads=8`, `train__steps=500`,
            `seed=1`, `root="outputs"`.

    Returns:
        The model: its config is `model.config`; `model.n_layers`, `model.n_heads` and `model.sites`
        (HeadSites) describe it.

    Example:
        ```python
        model = headlab.load_model("toy-attn-1l")   # trained on counting on first use, then reused
        ```
    """
    cfg = compose_config(model_overrides(name_or_path, task, options))
    if isinstance(task, Task):
        cfg.task = task.cfg
    # a pretrained model serves whatever task it is later swept on; one trained here serves its own
    named = task is not None or is_trained_here(cfg)
    return _loaded(cfg, (task if isinstance(task, Task) else build_task(cfg.task)) if named else None, show_progress)


def _loaded(cfg: Config, task: Task | None, show_progress: bool) -> HookedModel:
    """The model `cfg` names, on cfg.device; refused in one line if `task` cannot run on it (no task:
    nothing to refuse)."""
    apply_runtime(cfg)
    # the one door to a model, a study's own (RunContext.get_model): without a task, the configured one only
    # says what a model trained here is trained on
    context = RunContext(cfg, show_progress=show_progress, task=task or build_task(cfg.task))
    model = context.get_model(runs_task=task is not None)
    model.config = cfg.model
    model.place(cfg.device)
    return model


def model_overrides(name_or_path: str, task: str | Task | None, options: dict[str, Any]) -> list[str]:
    """The overrides that choose a model by config name, local directory or hub id (load_model's)."""
    if name_or_path in group_options("model"):
        chosen = [f"model={name_or_path}"]
    elif name_or_path.endswith(".gguf"):
        file = Path(name_or_path).expanduser()
        chosen = ["model=hf", f"model.path={file.parent}", f"model.gguf_file={file.name}", f"model.name={file.stem}"]
    else:
        name = Path(name_or_path).name or name_or_path
        chosen = ["model=hf", f"model.path={name_or_path}", f"model.name={name}"]
    task_name = task.name if isinstance(task, Task) else task
    return [
        *chosen,
        *([f"task={task_name}"] if task_name else []),
        *option_overrides(options, prefer=("model", "train")),
    ]


def check(model: HookedModel | str | Config, show_progress: bool = False, **options: Any) -> list[Verdict]:
    """Does headlab's view of `model` agree with the model itself? (`headlab check`)

    The checks (models/check.py): idle hooks against transformers' eager and default attention, zeroing a
    head's z against zeroing its slice of W_O, k/v edits against the query heads that share the kv head.

    Args:
        model: a loaded model; a name or path, chosen as `load_model` chooses it (with `options`); or a
            composed config (`headlab.compose("model=hf", "model.path=...")`), which `headlab check` passes.
        show_progress: draw progress bars.
        **options: as `load_model`'s, where `model` is a name or path.

    Returns:
        One Verdict per check (`ok`, `max_abs_diff`, `tolerance`, `detail`; `line()` as the CLI prints it).

    Example:
        ```python
        assert all(v.ok for v in headlab.check(model))
        ```
    """
    if isinstance(model, str):
        model = compose_config(model_overrides(model, None, options))
    if isinstance(model, Config):
        # any model has heads to check: the task only says what a model trained here is trained on
        model = _loaded(model, None, show_progress)
    return check_model(model)


def sweep(
    model: HookedModel,
    task: Task,
    ablate: str = "heads",
    method: str = "zero",
    patch: str | Sequence[str] | None = None,
    n_prompts: int | None = None,
    seed: int = 0,
    show_progress: bool = False,
    **options: Any,
) -> pd.DataFrame:
    """Ablate or patch every head (or layer, or component) and return the tidy table; nothing is written.

    This is `study(model, task, "sweep", ...)`; it equals the table `headlab run` writes for the same
    config and seed. A task or model that belongs to another study (task=markov) is refused.

    Args:
        model: a model from `load_model`.
        task: a task from `load_task`.
        ablate: an ablate option (`headlab list ablate`: heads, layers, keep_heads, components, none, ...;
            circuits is study=recall_reasoning).
        method: zero | mean | resample.
        patch: a patch option (activation, path, attribution) or a list of patching kinds.
        n_prompts: prompts drawn (default: the task's n_prompts).
        seed: draws the prompts and the bootstrap.
        show_progress: draw progress bars.
        **options: config keys, e.g. `positions=["END"]`, `sites=["z","v"]`, `n_boot=200`,
            `per_prompt=True`, `head_scores=True`, `device="cuda"`.

    Returns:
        One row per (intervention, metric): experiment, model, task, seed, intervention, method, layer,
        head, position, metric, value, n, ci_low, ci_high, hook (the site's TransformerLens hook name, e.g.
        blocks.0.attn.hook_z), and extras such as site, token, prompt_id. The row with intervention "none"
        is the clean baseline.

    Example:
        ```python
        table = headlab.sweep(model, task, ablate="heads", method="mean")
        patched = headlab.sweep(model, task, ablate="none", patch="activation")
        ```
    """
    patching = (
        {"patch": patch or "none"}
        if patch is None or isinstance(patch, str)
        else {"patch": "none", "patch__kinds": patch}
    )
    return study(
        model,
        task,
        "sweep",
        n_prompts,
        seed,
        show_progress,
        ablate=ablate,
        ablate__method=method,
        **patching,
        **options,
    )


def execute(
    model: HookedModel,
    task: Task,
    interventions: Sequence[Intervention],
    data: TaskData | None = None,
    n_prompts: int | None = None,
    seed: int = 0,
    show_progress: bool = False,
    **options: Any,
) -> pd.DataFrame:
    """Run your own list of interventions, batched as every sweep is; nothing is written.

    An Intervention is a built-in kind (`Intervention("ablate_head", "mean", layer=0, head=1)`) or your
    own: a name and `edit`, a function from the site's values where it touches them to their
    replacement, with `site` one of z (default), pattern, q, k, v (interventions/user.py says what
    `edit` receives). Bad input is refused in one line (UsageError) before anything runs.

    Args:
        model: a model from `load_model`.
        task: a task from `load_task`.
        interventions: what to run, each on the clean prompts.
        data: the prompts (`task.build(n, seed, model)`); default: those `sweep` draws for n_prompts and seed.
        n_prompts: prompts drawn where `data` is not given.
        seed: draws the prompts and the bootstrap.
        show_progress: draw progress bars.
        **options: config keys, e.g. `per_prompt=True` (rows per prompt, with prompt_id), `n_boot=200`,
            `naive=True` (one full forward pass per intervention: the reference).

    Returns:
        The tidy table `sweep` returns: the clean row (intervention "none") first, then one per
        intervention and metric.

    Example:
        ```python
        half = headlab.Intervention("half", layer=0, head=1, edit=lambda z: 0.5 * z)
        table = headlab.execute(model, task, [half])
        ```
    """
    if data is not None and n_prompts is not None:
        raise UsageError("give the prompts (data=) or how many to draw (n_prompts=), not both")
    overrides = [
        f"task={task.name}",
        "ablate=none",
        "patch=none",
        f"seed={seed}",
        *option_overrides(options, prefer=("output", "engine", "ablate")),
    ]
    ctx = _context(model, task, overrides, n_prompts, show_progress)
    ctx.data = data
    ctx.interventions = [CLEAN, *checked(interventions, ctx.get_model(), ctx.get_data())]
    return run_in_memory(get_study("sweep"), ctx)


def circuit(
    model: HookedModel,
    task: Task,
    method: str = "eap_ig",
    level: str = "edges",
    n_prompts: int | None = None,
    seed: int = 0,
    show_progress: bool = False,
    **options: Any,
) -> pd.DataFrame:
    """Edge (or node) circuit discovery on `task`'s clean and counterfactual prompts; nothing is written.

    It equals the table `headlab run task=... circuit=<method>` writes for the same config and seed.

    Args:
        model: a model from `load_model` (a pretrained one, or one trained on a task with a smooth metric).
        task: a task with counterfactual prompts and a smooth metric (ioi, prompts, recall_reasoning).
        method: eap | eap_ig | eap_ig_activations | exact, or a record registered with
            `headlab.edges.methods.register` (edges/methods.py).
        level: edges | nodes.
        n_prompts: prompts drawn (default: the task's n_prompts).
        seed: draws the prompts and the bootstrap.
        show_progress: draw progress bars.
        **options: the circuit study's options (studies/circuit.py's CircuitOptions), e.g. `steps=10`,
            `selection="greedy"`, `target=0.9`, `faithfulness=False`, `exact_check=500`.

    Returns:
        Edge rows (intervention "edge"): each edge's score, the change in the task's smooth metric (IOI:
        logit_diff) when that edge alone is patched from the counterfactual run (estimated, or exact for
        method=exact), with columns edge, sender, receiver, receiver_input and in_circuit. Rows with
        intervention "circuit": the faithfulness curve (fraction, n_edges, n_edges_ungrouped, ranking), cpr
        and cmd (95% bootstrap intervals over prompts in ci_low / ci_high), target_edges and
        target_edges_ungrouped (`edge_count="grouped"` takes the fractions over this graph's grouped
        key/value edges instead of MIB's ungrouped count), and with `convergence=True` how far the scores
        moved at twice the steps. Node rows (level="nodes", intervention "node"): each node's score.

    Example:
        ```python
        edges = headlab.circuit(model, headlab.load_task("ioi"), method="eap_ig", steps=5)
        ```
    """
    return study(model, task, "circuit", n_prompts, seed, show_progress, method=method, level=level, **options)


def scores(
    model: HookedModel,
    task: Task,
    kind: str = "sinks",
    n_prompts: int | None = None,
    seed: int = 0,
    show_progress: bool = False,
    **options: Any,
) -> pd.DataFrame:
    """Per-head scores from the attention-head literature; the table `headlab run scores=<kind>` writes,
    nothing written here.

    Args:
        model: a model from `load_model`.
        task: the prompts the scores read (composition reads the weights alone; retrieval needs task needle).
        kind: sinks (per head, the share of the prompts' queries with more than `epsilon` of their
            attention on the first token, its mean attention there, and the hidden sinks of Yu et al. 2024:
            later tokens that receive more than `alpha` / N; Gu et al. 2024's mean over all queries and the
            share of sink heads, Sink_1^epsilon, on prompts cut to `seq_len` tokens) | composition (Q-, K-,
            V-composition scores of every pair of heads in different layers, from the weights, and each
            pair's `channels` largest normalised singular values) | retrieval (task needle: each head's
            retrieval score of Wu et al. 2024, then needle recall with the `top_k` best heads masked against
            `n_random` draws of as many other heads) | induction (repeated random tokens: each head's
            induction, duplicate- and previous-token score, the repeat loss per copy, and that loss with the
            `top_k` best induction heads zero-ablated against `n_random` draws).
        n_prompts: prompts drawn (default: the task's n_prompts).
        seed: draws the prompts and the bootstrap.
        show_progress: draw progress bars.
        **options: the study's own (studies/sinks.py's SinksOptions, composition.py's
            CompositionOptions, ...), e.g. `epsilon=0.5`, `seq_len=64`, `channels=8`, `fold_norms=False`,
            `top_k=2`.

    Returns:
        The study's tidy table: one row per head and score, with 95% bootstrap intervals where the score
        is a mean over prompts.

    Example:
        ```python
        sinks = headlab.scores(model, task, kind="sinks", epsilon=0.5)
        ```
    """
    return study(model, task, kind, n_prompts, seed, show_progress, **options)


def atlas(
    model: HookedModel,
    task: Task | None = None,
    scores: Sequence[str] = (),
    out: str | Path | None = None,
    seed: int = 0,
    show_progress: bool = False,
    **options: Any,
) -> pd.DataFrame:
    """Every head of `model` on one page: the table `headlab atlas` writes, and atlas.html where `out`
    names a folder.

    Args:
        model: a model from `load_model`.
        task: the one a model trained here was trained on (default counting).
        scores: a subset of the atlas's scores (default all).
        out: a folder for atlas.html (default: none is written).
        seed: draws the probes' prompts.
        show_progress: draw progress bars.
        **options: the atlas's probe sizes (studies/atlas_probes.py's AtlasOptions, e.g. `ioi_prompts=8`)
            and config keys (`root=...`: each probe's table is cached under root/atlas/<model>/).

    Returns:
        One row per head and score (studies/atlas.py).

    Example:
        ```python
        heads = headlab.atlas(model, out="atlas")   # atlas/atlas.html
        ```
    """
    task = task or build_task(compose_config([]).task)
    overrides = _study_overrides("atlas", task, seed, {**options, "scores": list(scores)})
    ctx = _context(model, task, overrides, None, show_progress)
    ctx.run_dir = Path(out) if out is not None else None
    return run_in_memory(resolve(ctx.cfg, named="atlas"), ctx)


def study(
    model: HookedModel,
    task: Task,
    name: str = "sweep",
    n_prompts: int | None = None,
    seed: int = 0,
    show_progress: bool = False,
    **options: Any,
) -> pd.DataFrame:
    """Run any study by name on `model` and `task` and return its tidy table; nothing is written.

    It is the table `headlab run study=<name>` writes for the same config and seed. A study that cannot
    run this task or model (the sweep on task=markov) is refused in one line.

    Args:
        model: a model from `load_model`.
        task: a task from `load_task`.
        name: a study (`headlab list study`).
        n_prompts: prompts drawn (default: the task's n_prompts).
        seed: draws the prompts and the bootstrap.
        show_progress: draw progress bars.
        **options: config keys, a bare name looked up first in the study's own options
            (`study.<option>`, its options dataclass), then in the sections it reads (Study.sections:
            ablate and patch for the sweep), then everywhere.

    Returns:
        The study's tidy table.

    Example:
        ```python
        sinks = headlab.study(model, task, "sinks", epsilon=0.5)
        ```
    """
    return _run_study(model, task, name, _study_overrides(name, task, seed, options), n_prompts, show_progress)


def _study_overrides(name: str, task: Task, seed: int, options: dict[str, Any]) -> list[str]:
    """The overrides of `headlab run study=<name>` on this task and seed: a bare option is looked up first
    in the study's own options (`study.<option>`), then in its sections, then everywhere."""
    chosen = get_study(name)
    own = {k: v for k, v in options.items() if k in chosen.option_names()}
    rest = {k: v for k, v in options.items() if k not in own}
    return [
        f"study={name}",
        f"task={task.name}",
        f"seed={seed}",
        *option_overrides({f"study__{k}": v for k, v in own.items()}),
        *option_overrides(rest, prefer=(*chosen.sections, "engine", "output")),
    ]


def reuse(
    first: pd.DataFrame | str | Path,
    second: pd.DataFrame | str | Path,
    k: int = 10,
    metric: str | None = None,
    metric_second: str | None = None,
    panel: str | None = None,
    panel_second: str | None = None,
) -> pd.DataFrame:
    """Do two tasks use the same heads? Circuit reuse (Merullo et al. 2024), as `headlab reuse A B`.

    Each side is a finished table: a head sweep, whose `k` heads of largest |value - clean| are its
    important ones, or a circuit (`headlab run circuit=...`), whose heads are those its edges touch.

    Args:
        first: a DataFrame, a results.parquet, a run dir or a sweep dir.
        second: the other task's, on a model of the same shape.
        k: a sweep's important heads: its k of largest |effect|.
        metric: the metric, where a table has several (the error lists them).
        metric_second: the second table's metric (default: `metric`).
        panel: e.g. "ablate_head zero", where a table has several.
        panel_second: the second table's panel (default: `panel`).

    Returns:
        Per side and head its effect and `important`, then intervention "reuse" rows with shared_heads,
        jaccard, expected_shared_by_chance, p_value (hypergeometric), spearman_importance,
        pearson_effect and, for two circuits, shared_edges and edge_jaccard.

    Example:
        ```python
        overlap = headlab.reuse(table, patched, k=5)
        ```
    """
    from .analysis.reuse import reuse_table, side_of

    a = side_of(_table_of(first), k, metric, panel)
    b = side_of(_table_of(second), k, metric_second or metric, panel_second or panel)
    return reuse_table(a, b)


def _table_of(source: pd.DataFrame | str | Path) -> pd.DataFrame:
    if isinstance(source, pd.DataFrame):
        return source
    path = Path(source)
    if path.is_file():
        try:
            return pd.read_parquet(path)
        except (OSError, ValueError) as e:
            raise UsageError(f"{path}: not a parquet table ({type(e).__name__})") from None
    from . import results

    return results.collect(path)


def _run_study(
    model: HookedModel, task: Task, name: str, overrides: list[str], n_prompts: int | None, show_progress: bool
) -> pd.DataFrame:
    """The table of study `name` with the overrides, on this model and task, nothing written."""
    ctx = _context(model, task, overrides, n_prompts, show_progress)
    # the model and task handed in may belong to another study (a PathNet, task=markov): `name` is refused then
    return run_in_memory(resolve(ctx.cfg, named=name), ctx)


def _context(
    model: HookedModel, task: Task, overrides: list[str], n_prompts: int | None, show_progress: bool
) -> RunContext:
    """A study's context for this model and task with the config the overrides compose; writes nothing."""
    cfg = compose_config(overrides)
    cfg.task = _task_config(task, n_prompts)
    cfg.model = getattr(model, "config", None) or ModelConfig(name=model.name, kind=ModelKind.hf)
    apply_runtime(cfg)
    return RunContext(cfg, show_progress=show_progress, task=task, model=model)


def _task_config(task: Task, n_prompts: int | None) -> Any:
    cfg = task.cfg
    if n_prompts is None:
        return cfg
    if dataclasses.is_dataclass(cfg) and not isinstance(cfg, type):
        return dataclasses.replace(cfg, n_prompts=n_prompts)
    if OmegaConf.is_config(cfg):
        copy = cfg.copy()
        copy.n_prompts = n_prompts
        return copy
    raise UsageError(f"task {task.name}: its config is neither a dataclass nor an OmegaConf config")


def _unused(run_dir: Path) -> Path:
    """A timestamped run dir that an earlier run in the same second took gets a suffix (-2, -3, ...)."""
    candidate, n = run_dir, 1
    while candidate.exists():
        n += 1
        candidate = run_dir.with_name(f"{run_dir.name}-{n}")
    return candidate


def plan(*overrides: str) -> Plan:
    """What `headlab run <overrides>` will need, said before any weights are read (planning.py): peak host
    memory (weights, the clean caches, the engine's working chunk, this process) and its time on this
    machine where the study has a time model. With engine.max_memory, the plan of the run that keeps it
    (the chunk, prompts per pass and blocks on disk it will use), or its one-line refusal.

    Example:
        ```python
        print("\\n".join(headlab.plan("model=smollm2-135m", "task=ioi", "ablate=heads").lines()))
        ```
    """
    # a GPU run may be planned where no GPU is (a cluster's login node): its device is not checked here
    cfg = compose_checked(overrides, device=False)[1]
    apply_runtime(cfg)
    if not cfg.engine.max_memory:
        return plan_of(cfg)
    asked = _budget_settings(cfg)
    chosen, kept = within_budget(cfg)  # what the run sets to keep it (or the one-line refusal naming the least)
    # its time with the settings it chose (smaller chunks, a sliced faithfulness curve that records again),
    # planned again only where they differ from those asked for; the memory is the budget's plan's
    timed = kept if _budget_settings(cfg) == asked else plan_of(cfg)
    times = ("gflop", "matmul_gflops", "seconds", "efficiency", "work", "note")
    settings = ", ".join(f"{BUDGET_KNOBS[k]}={v}" for k, v in chosen.items() if k in BUDGET_KNOBS)
    return dataclasses.replace(
        kept,
        **{k: getattr(timed, k) for k in times},
        budget=f"under engine.max_memory={chosen['max_memory']}: {settings}",
    )


def _budget_settings(cfg: Any) -> list[Any]:
    """The values of the settings within_budget may change (BUDGET_KNOBS), as cfg has them now."""

    def value(key: str) -> Any:
        node = cfg
        for part in key.split("."):
            node = getattr(node, part, None)
        return node

    return [value(key) for key in BUDGET_KNOBS.values()]


def run(*overrides: str, command: str = "run", show_progress: bool = False) -> RunResult:
    """Exactly what `headlab <command> <overrides>` does for one run, from Python.

    The config is composed from configs/ and the overrides; the run dir is the one Hydra would choose
    (output.root/runs/<date>/<time>-<name>, suffixed -2, -3, ... when a run in the same second took it);
    the study runs and results.parquet, results.csv, meta.json and .hydra/config.yaml are written there.
    A run dir given by hydra.run.dir=... that already holds this config's complete result is reused.

    Args:
        *overrides: as typed after `headlab run`.
        command: run | train | sae.
        show_progress: draw progress bars.

    Returns:
        The table, the run dir, whether it was reused (`skipped`) and the config.

    Example:
        ```python
        result = headlab.run("ablate=layers", "output.n_boot=100")
        print(result.run_dir, result.skipped)
        ```
    """
    raw, cfg = compose_checked(overrides, hydra_config=True)
    chosen, note = choose_model(overrides, cfg)
    if note:
        log.warning("%s", note)
    if chosen != list(overrides):  # the task's own model: a config other than the one composed above
        raw, cfg = compose_checked(chosen, hydra_config=True)
    run_dir = Path(str(raw.hydra.run.dir))
    if not any(o.startswith("hydra.run.dir=") for o in chosen):
        run_dir = _unused(run_dir)
    table = execute_run(command, cfg, run_dir, show_progress, named=named_study(chosen))
    skipped = bool(table.attrs.get("skipped"))
    if not skipped:
        saved = run_dir / ".hydra"
        saved.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(saved / "config.yaml", OmegaConf.to_yaml(OmegaConf.structured(cfg)).encode())
        atomic_write_bytes(saved / "overrides.yaml", OmegaConf.to_yaml(OmegaConf.create(chosen)).encode())
    return RunResult(table, run_dir, skipped, cfg)
