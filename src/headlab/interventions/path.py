"""Path patching (Wang et al. 2022, App. B): a sender head's output changes only along its paths into
a set of receivers.

For senders at layer l (stacked, one copy per sender, like the exact sweep):
  pass A  from the cached input of block l: the sender's z takes its reference-run value (IOI: ABC),
          every head of layers l+1.. is frozen at its clean z, MLPs are recomputed. With receivers
          "logits" the logits of this pass are the answer. Otherwise the receivers' inputs (q, k or v)
          are recorded in this pass ...
  pass B  ... and a clean run from the first receiver layer takes them, the rest of the model free.
A receiver at or before the sender's layer cannot hear it; a sender with no receiver after it changes
nothing and reads the clean quantities.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from contextlib import ExitStack

from torch import Tensor

from ..models.hooked import HookedModel
from ..models.sites import Hook
from ..progress import progress_bar
from ..tasks import Task, TaskData
from ..vocabulary import Site, Source
from .edits import Sources, chunk_size, edit_heads, edit_hooks, edits_pattern
from .plan import LOGITS, Intervention, receiver_heads
from .readout import Readouts


def run_path(
    model: HookedModel,
    task: Task,
    data: TaskData,
    senders: Sequence[Intervention],
    sources: Sources,
    chunk_mb: float = 32.0,
    show_progress: bool = False,
) -> list[Tensor]:
    n = data.n
    trace = model.trace(data.inputs)
    clean_z = sources.values[(Source.clean, Site.z)]
    clean = task.per_prompt(model.readout(trace.resid_final, data.positions), data)
    out: list[Tensor | None] = [None] * len(senders)
    groups: dict[tuple, list[int]] = defaultdict(list)
    for i, iv in enumerate(senders):
        groups[(iv.layer, iv.receivers, iv.site)].append(i)
    per_chunk = chunk_size(model, data, chunk_mb, pattern=edits_pattern(senders, model.n_heads))
    chunks = [
        (key, idx[s : s + per_chunk])
        for key, idx in sorted(groups.items(), key=lambda kv: kv[0][0])
        for s in range(0, len(idx), per_chunk)
    ]
    readouts = Readouts(model, task, data, chunk_mb)
    with progress_bar("path patching", total=len(chunks), enabled=show_progress) as bar:
        for done, ((layer, receivers, site), idx) in enumerate(chunks, 1):
            chunk = [senders[i] for i in idx]
            downstream = {l: hs for l, hs in receiver_heads(receivers).items() if l > layer}
            if receivers != LOGITS and not downstream:
                for i in idx:
                    out[i] = clean
                continue
            g = len(chunk)
            read = data.positions.repeat(g, 1)
            last = max(downstream) if downstream else model.n_layers - 1
            recorded: dict[int, Tensor] = {}
            with ExitStack() as stack:
                stack.enter_context(model.hooks(layer, **edit_hooks(chunk, sources, n, model.n_heads)))
                for l in range(layer + 1, last + 1):
                    fns: dict[str, Hook] = {Site.z: _frozen(clean_z[l], g)}
                    if l in downstream:
                        fns[site] = _keep(recorded, l)
                    stack.enter_context(model.hooks(l, **fns))
                h = trace.resid_pre[layer].repeat(g, 1, 1)
                if not downstream:
                    h = model.run_blocks(h, layer, trace, copies=g, read=read)
                else:
                    model.run_blocks(h, layer, trace, copies=g, stop=last + 1)
            if downstream:
                first = min(downstream)
                with ExitStack() as stack:
                    for l, heads in downstream.items():
                        index = edit_heads(site, heads, sources, recorded[l].device)
                        stack.enter_context(model.hooks(l, **{site: _patched(recorded[l], index)}))
                    h = model.run_blocks(trace.resid_pre[first].repeat(g, 1, 1), first, trace, copies=g, read=read)
            readouts.add(idx, h, read)
            bar.update(done)
        readouts.flush()
    for i, quantities in readouts.results.items():
        out[i] = quantities
    return out  # type: ignore[return-value]


def _frozen(clean: Tensor, copies: int) -> Hook:
    return lambda z: clean.repeat(copies, *([1] * (clean.dim() - 1)))


def _keep(store: dict[int, Tensor], layer: int) -> Hook:
    def hook(t: Tensor) -> Tensor:
        store[layer] = t.clone()
        return t

    return hook


def _patched(recorded: Tensor, heads: Tensor) -> Hook:
    def hook(t: Tensor) -> Tensor:
        t = t.clone()
        t[:, heads] = recorded[:, heads]
        return t

    return hook
