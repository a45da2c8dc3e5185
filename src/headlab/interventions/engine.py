"""The sweep executor: exact, batched, and started from cached activations.

One clean pass caches the residual stream entering every block (and each layer's z). All interventions on
layer l then run together: the cached input of block l is stacked g times (one copy per intervention), block
l edits each copy's z as its intervention says, blocks l+1.. run on the stacked batch, and logits are
computed at the positions the metrics read only, for many chunks at once (readout.py). Layers before l are
never recomputed, nor is layer l's attention where nothing inside it is edited: its output is the output
projection of the clean z, edited (HeadSites.replayed). Where every intervention of a chunk edits positions
p.. only (a role such as END, an index), positions before p are the clean run's in every layer: blocks l..
run on positions p.. alone, attending to the clean keys and values before p (HookedModel.run_blocks), on the
families that allow it. Prompts of unequal length run in groups of like length, each through the positions
its prompts read (lengths.py). `naive=True` runs one full forward pass per intervention over the whole
padded batch instead: the reference the fast path is tested against.

`execute_joint` applies groups of interventions at several layers together (circuit knockouts): one full
forward pass per group, with every involved layer's hooks installed at once.

Both first ask of every source read from other prompts (the counterfactual, the reference prompts, a
group's mean) whether it is the prompt itself (own_sources): where it is on every prompt, the
interventions that read it would change nothing, and the run is refused in one line; where on some, a
note says on how many.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Iterator, Sequence
from contextlib import ExitStack

import torch
from jaxtyping import Float
from torch import Tensor

from ..config import option
from ..errors import UsageError
from ..models.hooked import HookedModel
from ..progress import progress_bar
from ..runtime import chunk_budget_mb
from ..tasks import Inputs, Task, TaskData
from ..vocabulary import ATTENTION_SITES, MLP_SITES, Kind, Method, Site, Source
from .attribution_patching import estimate
from .edits import Sources, chunk_size, copy_edit_hooks, edit_hooks, edits_pattern, first_edited
from .lengths import bucket, groups, through
from .options import MeanOver
from .path import run_path
from .plan import Intervention
from .readout import Readouts, read_quantities

log = logging.getLogger("headlab")

GPU_MEMORY_SHARE = 0.5  # execute's default gpu_memory_share (config.py's engine.gpu_memory_share)

# the sources read from other prompts, as a refusal or a note names them per prompt
OTHER_PROMPTS: dict[str, str] = {
    Source.counterfactual: "its counterfactual (corrupted) prompt",
    Source.reference: "its reference prompt",
    Source.mean: "every reference prompt of its group",
}
METHOD_WORDS: dict[str, str] = {
    Method.activation: "activation patching",
    Method.attribution: "attribution patching",
    Method.path: "path patching",
    Method.resample: "resample ablation",
    Method.mean: "mean ablation",
}


def _through_last_read(data: TaskData) -> TaskData:
    """Drop positions after the last one any metric reads: in a causal model they cannot matter."""
    reads = [data.positions.max(), *(p.max() for p in (data.counterfactual_positions or {}).values())]
    return through(data, int(max(reads)) + 1)


def execute(
    model: HookedModel,
    task: Task,
    data: TaskData,
    interventions: Sequence[Intervention],
    chunk_mb: float = 32.0,
    naive: bool = False,
    show_progress: bool = False,
    seed: int = 0,
    mean_over: str = "positions",
    gpu_memory_share: float = GPU_MEMORY_SHARE,
    report: dict | None = None,
) -> Float[Tensor, "interventions n Q"]:
    """Per-prompt task quantities for every intervention: [n_interventions, n_prompts, n_quantities].
    `mean_over` (positions | tokens): what mean ablation's mean is taken over (edits.Sources).
    `chunk_mb` bounds a chunk's widest activation on a CPU; on a GPU chunks take `gpu_memory_share` of its
    free memory (runtime.chunk_budget_mb). `report`, when given, receives the clean caches' size
    (cache_mb), the chunk budget (chunk_mb), the number of stacked passes (chunks) and, on a GPU, the
    peak memory allocated (peak_gpu_mb).

    Path patching and attribution patching rows go to their own executors (path.py, attribution_patching.py)."""
    if option(mean_over) != MeanOver.tokens:  # a mean over every token needs the tokens after the last read one
        data = _through_last_read(data)
    report = {} if report is None else report
    rows = Sources(model, data, (), seed, mean_over).rows  # records nothing: which row stands in for each prompt
    for text in own_sources(data, interventions, model.n_heads, rows, mean_over) + thin_means(data, interventions):
        log.warning("note: %s", text)
        report.setdefault("notes", []).append(text)
    out: list[Tensor | None] = [None] * len(interventions)
    attributed = [i for i, iv in enumerate(interventions) if iv.method == Method.attribution]
    paths = [i for i, iv in enumerate(interventions) if iv.method == Method.path]
    exact = [i for i, iv in enumerate(interventions) if iv.method not in (Method.path, Method.attribution)]
    if attributed:
        clean, estimates = estimate(model, task, data, [interventions[i] for i in attributed])
        for i, q in zip(attributed, estimates):
            out[i] = q
        if all(interventions[i].intervention == Kind.none for i in exact):  # the clean run: estimate's own
            for i in exact:
                out[i] = clean
            exact = []
    with torch.inference_mode():
        needed = {(e.source, e.site) for i in exact for e in interventions[i].edits(model.n_heads)}
        if paths:
            needed |= {(Source.reference, Site.z), (Source.clean, Site.z)}
        sources = Sources(model, data, needed, seed, mean_over)
        exact_ivs = [interventions[i] for i in exact]
        results: list[Tensor] = []
        if naive:
            results = _run_naive(model, task, data, exact_ivs, sources, show_progress, chunk_mb)
        elif exact_ivs:
            results = _run_by_length(
                model, task, data, exact_ivs, sources, chunk_mb, gpu_memory_share, show_progress, report
            )
        for i, q in zip(exact, results):
            out[i] = q
        if paths:
            budget = chunk_budget_mb(model.input_device, chunk_mb, gpu_memory_share)
            patched = run_path(model, task, data, [interventions[i] for i in paths], sources, budget, show_progress)
            for i, q in zip(paths, patched):
                out[i] = q
    device = model.input_device
    if device.type == "cuda":
        report["peak_gpu_mb"] = round(torch.cuda.max_memory_allocated(device) / 2**20, 1)
    return torch.stack(out)  # type: ignore[arg-type]


def _run_by_length(
    model: HookedModel,
    task: Task,
    data: TaskData,
    interventions: Sequence[Intervention],
    sources: Sources,
    chunk_mb: float,
    gpu_memory_share: float,
    show_progress: bool,
    report: dict,
) -> list[Tensor]:
    """_run_stacked over groups of prompts of like length, each cut to the positions it needs (lengths.py),
    where that saves enough; their quantities put back in the prompts' order."""
    grouped = groups(data, interventions)
    if grouped is None:
        return _run_stacked(
            model, task, data, interventions, sources, chunk_mb, gpu_memory_share, show_progress, report
        )
    out: list[Tensor | None] = [None] * len(interventions)
    report["length_groups"] = [length for _, length in grouped]
    chunks, caches = 0, 0.0  # the groups run one after another: their chunks add up, their caches do not
    for k, (rows, length) in enumerate(grouped, 1):
        part = bucket(data, rows, length)
        label = f"sweep ({k}/{len(grouped)}: {len(rows)} prompts, {length} positions)"
        results = _run_stacked(
            model,
            task,
            part,
            interventions,
            sources.subset(rows, part),
            chunk_mb,
            gpu_memory_share,
            show_progress,
            report,
            label,
        )
        chunks += report.get("chunks", 0)
        caches = max(caches, report.get("cache_mb", 0.0))
        for i, q in enumerate(results):
            if out[i] is None:
                out[i] = q.new_empty(data.n, *q.shape[1:])
            out[i][rows.to(q.device)] = q  # type: ignore[index]
    report.update(chunks=chunks, cache_mb=caches)
    return out  # type: ignore[return-value]


def _run_stacked(
    model: HookedModel,
    task: Task,
    data: TaskData,
    interventions: Sequence[Intervention],
    sources: Sources,
    chunk_mb: float,
    gpu_memory_share: float,
    show_progress: bool,
    report: dict,
    label: str = "sweep",
) -> list[Tensor]:
    n = data.n
    out: list[Tensor | None] = [None] * len(interventions)
    first_read = int(data.positions.min())
    suffixes = model.runs_suffixes and any(first_edited(iv, sources) for iv in interventions)

    def suffix_start(ivs: Sequence[Intervention]) -> int:
        """Where the run can start: the first position any of `ivs` edits or any metric reads."""
        return min(first_read, *(first_edited(iv, sources) for iv in ivs)) if suffixes else 0

    # Runs on suffixes read every later layer's clean keys and values, kept whole, and each layer's input
    # (and z) from the earliest start on, kept for every layer. Full runs, in layer order, take each
    # layer's clean input (and z) from a walk, which holds two layers' at a time.
    if suffixes:
        first = suffix_start([iv for iv in interventions if iv.intervention != Kind.none])
        trace = model.trace(data.inputs, keep_kv=True, keep_z=model.sites.replays, inputs_from=first)
        clean_inputs: Iterator[tuple[int, Tensor]] = iter(enumerate(trace.resid_pre))
    else:
        trace = model.trace(data.inputs, every_input=False)
        clean_inputs = model.walk(trace, keep_z=model.sites.replays)
    at_layer, clean_input = -1, trace.resid_final
    chunk_mb = chunk_budget_mb(trace.resid_final.device, chunk_mb, gpu_memory_share)  # after the caches

    by_layer: dict[int, list[int]] = defaultdict(list)
    for i, iv in enumerate(interventions):
        if iv.intervention == Kind.none:
            out[i] = read_quantities(model, task, trace.resid_final, data.positions, data, chunk_mb)[0]
        else:
            by_layer[iv.layer].append(i)  # type: ignore[index]
    chunks = []
    for layer, idx in sorted(by_layer.items()):
        # a layer's interventions that edit positions p.. alone run together on p.. (patches at END beside
        # patches at every position: each kind its own chunks), and more copies fit a chunk
        starting: dict[int, list[int]] = defaultdict(list)
        for i in idx:
            starting[suffix_start([interventions[i]])].append(i)
        for start, same in sorted(starting.items()):
            pattern = edits_pattern([interventions[i] for i in same], model.n_heads)
            per_chunk = chunk_size(model, data, chunk_mb, trace.length - start, pattern)
            chunks += [(layer, same[s : s + per_chunk]) for s in range(0, len(same), per_chunk)]
    report.update(cache_mb=round(trace.nbytes / 2**20, 3), chunk_mb=round(chunk_mb, 3), chunks=len(chunks))
    log.info("sweep: clean caches %.1f MB, %d chunks of at most %.0f MB", trace.nbytes / 2**20, len(chunks), chunk_mb)
    readouts = Readouts(model, task, data, chunk_mb)
    with progress_bar(label, total=len(chunks), enabled=show_progress) as bar:
        for done, (layer, idx) in enumerate(chunks, 1):
            chunk = [interventions[i] for i in idx]
            start = suffix_start(chunk)
            while at_layer < layer:
                at_layer, clean_input = next(clean_inputs)
            h = clean_input[:, start - trace.inputs_from :].repeat(len(chunk), 1, 1)
            read = (data.positions - start).repeat(len(chunk), 1)
            fns = edit_hooks(chunk, sources, n, model.n_heads, offset=start)
            # an MLP or neuron edit on the last layer needs the MLP at every position, not only at the
            # read ones (the edit indexes positions of the full sequence)
            only_read = None if any(s in fns for s in MLP_SITES) and layer == model.n_layers - 1 else read
            # a layer whose attention is edited at z or not at all gives the clean attention's z to the edit
            replay = model.sites.replays and not any(s in fns for s in ATTENTION_SITES)
            with model.hooks(layer, **fns):
                h = model.run_blocks(
                    h, layer, trace, copies=len(chunk), read=only_read, from_position=start, replay=replay
                )
            readouts.add(idx, h, read)
            bar.update(done)
        readouts.flush()
    for i, quantities in readouts.results.items():
        out[i] = quantities
    return out  # type: ignore[return-value]


def _run_naive(
    model: HookedModel,
    task: Task,
    data: TaskData,
    interventions: Sequence[Intervention],
    sources: Sources,
    show_progress: bool,
    chunk_mb: float = 32.0,
) -> list[Tensor]:
    groups = [[iv] for iv in interventions]
    return _run_groups(model, task, data, groups, sources, "sweep (naive)", show_progress, chunk_mb)


def _run_groups(
    model: HookedModel,
    task: Task,
    data: TaskData,
    groups: Sequence[Sequence[Intervention]],
    sources: Sources,
    label: str,
    show_progress: bool,
    chunk_mb: float = 32.0,
) -> list[Tensor]:
    """One full forward pass per group, with the hooks of every layer the group edits installed at once
    (several interventions on one layer all apply, in order); logits only at the read positions, at most
    `chunk_mb` of them at a time on a CPU (readout.read_quantities: a slice of the prompts where all of theirs
    would not fit; on a GPU, runtime.chunk_budget_mb's share of its free memory)."""
    out = []
    with progress_bar(label, total=len(groups), enabled=show_progress) as bar:
        for done, group in enumerate(groups, 1):
            by_layer: dict[int, list[Intervention]] = defaultdict(list)
            for iv in group:
                if iv.intervention != Kind.none:
                    by_layer[iv.layer].append(iv)  # type: ignore[index]
            with ExitStack() as stack:
                for layer, ivs in sorted(by_layer.items()):
                    stack.enter_context(model.hooks(layer, **copy_edit_hooks([ivs], sources, data.n, model.n_heads)))
                h = model.forward_blocks(data.inputs)
            budget = chunk_budget_mb(h.device, chunk_mb, GPU_MEMORY_SHARE)
            out.append(read_quantities(model, task, h, data.positions, data, budget)[0])
            bar.update(done)
    return out


def execute_joint(
    model: HookedModel,
    task: Task,
    data: TaskData,
    groups: Sequence[Sequence[Intervention]],
    show_progress: bool = False,
    seed: int = 0,
    chunk_mb: float = 32.0,
) -> Tensor:
    """Per-prompt task quantities [len(groups), n_prompts, n_quantities], each group's interventions
    applied together in one full forward pass (a circuit knockout): hooks go on every layer the group
    touches at once, and several interventions on one layer all apply, in the group's order. An empty
    group is the clean run. Replacement values come from one Sources, as in execute(). `chunk_mb` bounds
    the logits held at once on a CPU (_run_groups)."""
    data = _through_last_read(data)
    for group in groups:
        for iv in group:
            # path and attribution patching are not edits at one layer; they have their own executors
            if iv.intervention != Kind.none and (iv.layer is None or iv.method in (Method.path, Method.attribution)):
                raise ValueError(f"execute_joint takes exact single-layer interventions, not {iv}")
    flat = [iv for group in groups for iv in group]
    for text in own_sources(data, flat, model.n_heads, Sources(model, data, (), seed).rows):
        log.warning("note: %s", text)
    with torch.inference_mode():
        needed = {(e.source, e.site) for group in groups for iv in group for e in iv.edits(model.n_heads)}
        sources = Sources(model, data, needed, seed)
        label = "joint interventions"
        return torch.stack(_run_groups(model, task, data, groups, sources, label, show_progress, chunk_mb))


def own_sources(
    data: TaskData,
    interventions: Sequence[Intervention],
    n_heads: int,
    rows: dict[str, Tensor],
    mean_over: str = MeanOver.positions.value,
) -> list[str]:
    """Notes on the sources read from other prompts that are, on some prompts, the prompt itself (the same
    tokens and mask through its last read position, where a causal model's reads cannot tell them apart):
    there the interventions that read them change nothing. A UsageError where one is so on every prompt.
    `rows`: Sources.rows, the source row of each prompt. A mean over every token (mean_over=tokens) is
    not the prompt's own activation even over the prompt alone, so it is not asked about."""
    tokens = option(mean_over) == MeanOver.tokens
    methods: dict[str, set[str]] = defaultdict(set)
    for iv in interventions:
        for edit in iv.edits(n_heads):
            if edit.source in OTHER_PROMPTS and not (edit.source == Source.mean and tokens):
                methods[edit.source].add(METHOD_WORDS.get(iv.method, str(iv.method)))
    notes = []
    for source, words in sorted(methods.items()):
        same = _own(data, source, rows)
        count = 0 if same is None else int(same.sum())  # None: no such prompts, which Sources refuses
        said = f"{' and '.join(sorted(words))}: on {{}} {OTHER_PROMPTS[source]} is the prompt itself"
        if count == data.n:
            every = f"each of the {count} prompts" if count > 1 else "the one prompt"
            raise UsageError(said.format(every) + " (the same tokens): it changes nothing")
        if count:
            notes.append(said.format(f"{count} of the {data.n} prompts") + ", and it changes nothing there")
    return notes


def thin_means(data: TaskData, interventions: Sequence[Intervention]) -> list[str]:
    """A note where a mean ablation's mean, taken per group, rests on fewer than two reference prompts for
    some prompts: there it is a resample ablation, not a mean."""
    if data.reference is None or data.groups is None or data.reference_groups is None:
        return []
    if not any(iv.method == Method.mean for iv in interventions):
        return []
    counts = torch.bincount(data.reference_groups.cpu(), minlength=int(data.groups.max()) + 1)
    thin = counts[data.groups.cpu()] < 2
    if not thin.any():
        return []
    return [
        f"mean ablation: on {int(thin.sum())} of the {data.n} prompts the mean of the prompt's group rests on "
        f"fewer than 2 reference prompts ({int(counts.sum())} in {int((counts > 0).sum())} groups; task.n_reference "
        "sets how many)"
    ]


def _own(data: TaskData, source: str, rows: dict[str, Tensor]) -> Tensor | None:
    """[n] bool: is the prompt its own `source` through its last read position? None: no such prompts."""
    n = data.n
    through = data.positions.max(1).values.cpu()
    every = torch.arange(n)
    if source == Source.counterfactual:
        if data.counterfactual is None:
            return None
        same = _shared(data.inputs, every, data.counterfactual, every) > through
        roles = data.token_positions or {}
        for role, at in (data.counterfactual_positions or {}).items():  # a role read elsewhere: another source
            same &= at.cpu() == roles[role].cpu() if role in roles else torch.zeros_like(same)
        return same
    if data.reference is None:
        return None
    if source == Source.reference:
        return _shared(data.inputs, every, data.reference, rows[Source.reference].cpu()) > through
    # a group's mean is the prompt's own value where every reference prompt of the group is the prompt:
    # where each equals the group's first and that one equals the prompt
    n_ref = next(iter(data.reference.values())).shape[0]
    grouped = data.groups is not None and data.reference_groups is not None
    of_ref = data.reference_groups.cpu() if grouped else torch.zeros(n_ref, dtype=torch.long)  # type: ignore[union-attr]
    of_prompt = rows[Source.mean].cpu()
    size = int(max(of_ref.max(), of_prompt.max())) + 1
    first = torch.full((size,), -1).scatter_reduce(0, of_ref, torch.arange(n_ref), "amin", include_self=False)
    agreed = _shared(data.reference, torch.arange(n_ref), data.reference, first[of_ref])
    consensus = torch.zeros(size, dtype=torch.long).scatter_reduce(0, of_ref, agreed, "amin", include_self=False)
    own = _shared(data.inputs, every, data.reference, first[of_prompt].clamp_min(0))
    return (first[of_prompt] >= 0) & (own > through) & (consensus[of_prompt] > through)


def _shared(a: Inputs, rows_a: Tensor, b: Inputs, rows_b: Tensor) -> Tensor:
    """[k]: how many first positions row rows_a[j] of `a` and row rows_b[j] of `b` share in every input
    (token ids, mask); 0 where the two hold other inputs."""
    none = torch.zeros(len(rows_a), dtype=torch.long)
    if set(a) != set(b):
        return none
    width = min(next(iter(a.values())).shape[1], next(iter(b.values())).shape[1])
    same = torch.ones(len(rows_a), width, dtype=torch.bool)
    for key, x in a.items():
        x, y = x[rows_a.to(x.device)], b[key][rows_b.to(b[key].device)].to(x.device)
        if x.dim() >= 2:
            x, y = x[:, :width], y[:, :width]
        if x.shape != y.shape:
            return none
        same &= (x == y).reshape(len(rows_a), x.shape[1] if x.dim() >= 2 else 1, -1).all(-1).cpu()
    return same.long().cumprod(1).sum(1)
