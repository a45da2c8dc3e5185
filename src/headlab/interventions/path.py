"""Path patching (Wang et al. 2022, arXiv 2211.00593, App. B): a sender head's output changes only along
its paths into a set of receivers.

The authors' code (redwoodresearch/Easy-Transformer, easy_transformer/ioi_utils.py `path_patching`):
  pass A  the sender's output (hook_result) takes its value from the ABC prompts at `positions`, every
          head's q, k and v are frozen at their clean values (so every other head's pattern and z stay
          clean), MLPs are recomputed; the receivers' q, k or v (or the last residual, for the logits)
          are cached in this pass ...
  pass B  ... and a clean run takes them at the same `positions`, the rest of the model free.
The positions are one role per round (END into the logits and the name movers' queries, S2 into the
S-inhibition heads' values, S1+1 into the induction heads' keys: experiments.py, ioi_circuit_extraction.py).

Here, for senders at layer l (stacked, one copy per sender, as the engine stacks them):
  pass A  from block l's clean input: every head of layers l.. takes its clean z (the same as freezing its
          q, k, v), the sender's z at the role's position its reference-run value (IOI: ABC), MLPs are
          recomputed. With receivers "logits" the logits of this pass are the answer; otherwise the
          receivers' q, k or v at that position are recorded ...
  pass B  ... and a clean run from the first receiver layer takes them there, the rest of the model free.
An Intervention's `token` (or `position`) is the round's position; without one, every position (sender
and receivers alike). A receiver at or before the sender's layer cannot hear it: those senders read the
clean quantities.

Receivers are query heads, also where k and v are shared by a group of them (grouped-query attention):
for a value receiver r only z_r changes, to A_r v_patched (its siblings keep the clean v), and for a key
receiver z_r = softmax(q_r k_patched^T / sqrt(d) + mask) v. The receiver layer's k and v are handed to its
attention one copy per query head, so that receiver r's copy alone carries the patched position. (The
paper's GPT-2 small has a k and v per head, where the two readings agree; a receiver set listing every
query head of a group patches the group's shared k or v.)

Where headlab differs from the authors' code: the sender is a head's z (their hook_result is z W_O of
one head, the same change); MLPs are never senders. Nothing else: the two passes are theirs.

Exploited for speed, exactly: with every head of layers l.. frozen, pass A changes the residual stream at
the sender's position only, so it runs on that position alone (after the clean keys and values of the
positions before it) on the families whose blocks run on a suffix of positions (HookedModel.runs_suffixes),
prompts grouped by where the role and their last read position sit; pass B runs from that position on,
to the last one read. Senders of every layer run stacked: in pass A a sender's copy joins the batch at its
own layer (a staircase: each layer runs once for every sender below it), and pass B runs together the
senders whose first downstream receiver layer is the same (tests/test_ioi_classes.py holds every sender of
a stack to Wang et al.'s two passes written out in torch).

`held`: heads whose z is held at a value at one position per prompt in every pass (the clean run, the
reference run, both passes): a knockout, as the paper's backup name movers need (its name movers
mean-ablated at END).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, replace

import torch
from jaxtyping import Float
from torch import Tensor

from ..models.hooked import HookedModel
from ..models.sites import Hook
from ..progress import progress_bar
from ..tasks import Inputs, Task, TaskData
from ..vocabulary import KV_SITES, Site, Source
from .edits import Sources, chunk_size
from .plan import LOGITS, Intervention, receiver_heads
from .readout import Readouts, read_quantities


@dataclass(frozen=True)
class Held:
    """Head `head` of layer `layer` has z = value[i] ([n, d_head]) at position[i] ([n]) of prompt i."""

    layer: int
    head: int
    position: Tensor
    value: Tensor


@dataclass
class _Part:
    """The prompts `rows` whose round position is `at` (None: every position), run from position `start`:
    `a` holds them through what pass A needs, `b` through the last position read."""

    rows: Tensor
    at: int | None
    start: int
    a: TaskData
    b: TaskData


def reference_z(model: HookedModel, data: TaskData, held: Sequence[Held] = (), seed: int = 0) -> Sources:
    """The reference run's z, `held` in force: what path_patch's senders send. The same for every call on
    these prompts with these held heads, so a study of several rounds records it once."""
    data = data.paired_reference()
    if held and data.reference is not None and next(iter(data.reference.values())).shape[0] != data.n:
        raise ValueError("held heads need one reference prompt per prompt")
    with torch.inference_mode(), holding(model, held, torch.arange(data.n), 1, 0):
        return Sources(model, data, {(Source.reference, Site.z)}, seed)


def path_patch(
    model: HookedModel,
    task: Task,
    data: TaskData,
    senders: Sequence[Intervention],
    held: Sequence[Held] = (),
    chunk_mb: float = 32.0,
    show_progress: bool = False,
    seed: int = 0,
    sources: Sources | None = None,
) -> tuple[Float[Tensor, "n Q"], list[Float[Tensor, "n Q"]]]:
    """(the clean quantities [n, Q], each sender's [n, Q]), with `held` in every pass, the clean run's and
    the reference run's included. `sources`: reference_z's for these prompts and held heads, where the
    caller keeps it across calls. The clean quantities are those the passes' own clean runs read (every
    prompt is in one of them), not a run of their own."""
    data = data.paired_reference()
    if sources is None:
        sources = reference_z(model, data, held, seed)
    read: list[tuple[Tensor, Tensor]] = []
    with torch.inference_mode():
        patched = run_path(model, task, data, senders, sources, chunk_mb, show_progress, held, read)
        if sum(len(rows) for rows, _ in read) < data.n:  # no pass ran some prompts
            with holding(model, held, torch.arange(data.n), 1, 0):
                trace = model.trace(data.inputs, every_input=False)
                read = [
                    (
                        torch.arange(data.n),
                        read_quantities(model, task, trace.resid_final, data.positions, data, chunk_mb)[0],
                    )
                ]
    clean = read[0][1].new_empty(data.n, read[0][1].shape[1]).cpu()
    for rows, quantities in read:
        clean[rows] = quantities.cpu()
    return clean, patched


def run_path(
    model: HookedModel,
    task: Task,
    data: TaskData,
    senders: Sequence[Intervention],
    sources: Sources,
    chunk_mb: float = 32.0,
    show_progress: bool = False,
    held: Sequence[Held] = (),
    clean: list[tuple[Tensor, Tensor]] | None = None,
) -> list[Tensor]:
    """Each sender's task quantities [n, Q]; `clean`, where given, takes (rows, their clean quantities) of
    each group of prompts the passes run."""
    out: list[Tensor | None] = [None] * len(senders)
    work = []
    for (receivers, site, _, _), idx in _groups(senders).items():
        for part in _parts(model, data, sources, senders[idx[0]], receivers != LOGITS):
            ids = sorted(idx, key=lambda i: senders[i].layer)  # type: ignore[arg-type,return-value]
            per_chunk = chunk_size(model, part.b, chunk_mb, _length(part.b.inputs) - part.start)
            chunks = [ids[s : s + per_chunk] for s in range(0, len(ids), per_chunk)]
            work.append((part, receivers, site, chunks))
    with progress_bar("path patching", total=sum(len(w[3]) for w in work), enabled=show_progress) as bar:
        done = 0
        for part, receivers, site, chunks in work:
            run = _Run(model, task, sources, part, receivers, site, held, chunk_mb)
            if clean is not None:
                clean.append((part.rows, run.clean))
            for ids in chunks:
                run.chunk(ids, [(senders[i].layer, senders[i].head) for i in ids])  # type: ignore[misc]
                done += 1
                bar.update(done)
            for i, quantities in run.results().items():
                if out[i] is None:
                    out[i] = quantities.new_full((data.n, quantities.shape[1]), torch.nan).cpu()
                out[i][part.rows] = quantities.cpu()  # type: ignore[index]
    return out  # type: ignore[return-value]


def _groups(senders: Sequence[Intervention]) -> dict[tuple, list[int]]:
    """Senders that share receivers, site and position, in order."""
    groups: dict[tuple, list[int]] = defaultdict(list)
    for i, iv in enumerate(senders):
        groups[(iv.receivers, iv.site, iv.token, iv.position)].append(i)
    return groups


def _length(inputs: Inputs) -> int:
    return next(iter(inputs.values())).shape[1]


def _parts(model: HookedModel, data: TaskData, sources: Sources, iv: Intervention, to_heads: bool) -> list[_Part]:
    """The prompts grouped by where `iv`'s position and their last read position sit (one group for every
    position)."""
    place = sources.position(iv)
    length = _length(data.inputs)
    if place is None:
        every = torch.arange(data.n)
        whole = _rows(data, every, length)
        return [_Part(every, None, 0, whole, whole)]
    at_each = place.cpu().long() if isinstance(place, Tensor) else torch.full((data.n,), place % length)
    last_each = data.positions.max(1).values.cpu()
    parts = []
    for at, last in sorted(set(zip(at_each.tolist(), last_each.tolist()))):
        rows = torch.nonzero((at_each == at) & (last_each == last))[:, 0]
        b = _rows(data, rows, last + 1)
        a = _rows(data, rows, at + 1) if to_heads and at < last else b  # at == last: the same prompts
        parts.append(_Part(rows, at, at if model.runs_suffixes and at <= last else 0, a, b))
    return parts


def _rows(data: TaskData, rows: Tensor, length: int) -> TaskData:
    """The prompts `rows`, through position length - 1 (no counterfactual or reference prompts)."""
    seq_len = _length(data.inputs)

    def take(t: Tensor) -> Tensor:
        t = t[rows.to(t.device)]
        return t[:, :length] if t.dim() >= 2 and t.shape[1] == seq_len else t

    each = lambda d: d and {k: take(v) for k, v in d.items()}  # noqa: E731
    return replace(
        data,
        inputs=each(data.inputs),
        positions=data.positions[rows.to(data.positions.device)],
        answers={k: v[rows.to(v.device)] for k, v in data.answers.items()},
        counterfactual=None,
        reference=None,
        token_positions={k: v[rows.to(v.device)] for k, v in (data.token_positions or {}).items()} or None,
        groups=None if data.groups is None else data.groups[rows.to(data.groups.device)],
        reference_groups=None,
        counterfactual_positions=None,
    )


class _Run:
    """The two passes for one group of prompts (a _Part) and one receiver set, chunk by chunk of senders."""

    def __init__(
        self,
        model: HookedModel,
        task: Task,
        sources: Sources,
        part: _Part,
        receivers: str,
        site: str | None,
        held: Sequence[Held],
        chunk_mb: float,
    ) -> None:
        self.model, self.part, self.site, self.held = model, part, site, held
        self.heads = receiver_heads(receivers)
        start, keep_kv = part.start, part.start > 0
        with holding(model, held, part.rows, 1, 0):
            self.trace_a = model.trace(part.a.inputs, keep_kv=keep_kv, keep_z=True, inputs_from=start)
            self.trace_b = (
                self.trace_a if part.a is part.b else model.trace(part.b.inputs, keep_kv=keep_kv, inputs_from=start)
            )
        self.clean = read_quantities(model, task, self.trace_b.resid_final, part.b.positions, part.b, chunk_mb)[0]
        self.rep = model.n_heads // model.sites.n_kv_heads
        self.expand = site in KV_SITES and self.rep > 1
        if self.expand and self.trace_b.kv is not None:  # the receivers' prefix keys and values: one per query head
            kv = list(self.trace_b.kv)
            for l in self.heads:
                kv[l] = (kv[l][0].repeat_interleave(self.rep, 1), kv[l][1].repeat_interleave(self.rep, 1))
            self.trace_b = replace(self.trace_b, kv=kv)
        # the round's position within the positions run (every position: all of them)
        self.pos: int | slice = slice(None) if part.at is None else part.at - start
        self.idle = part.at is not None and part.at >= _length(part.b.inputs)  # after every read position
        _, value_rows = sources.value(Source.reference, Site.z, 0)
        self.reference_rows = value_rows[part.rows.to(value_rows.device)]
        self.sources = sources
        self.readouts = Readouts(model, task, part.b, chunk_mb)
        self.fixed: dict[int, Tensor] = {}

    def reference(self, layer: int) -> Tensor:
        """The reference run's z of these prompts at the positions run [prompts, pos, head, d_head]."""
        values, _ = self.sources.value(Source.reference, Site.z, layer)
        return values[self.reference_rows][:, self.part.start : _length(self.part.a.inputs)]

    def chunk(self, ids: list[int], sender_heads: list[tuple[int, int]]) -> None:
        """Senders `ids` (their (layer, head), in layer order) through both passes, stacked across layers.

        Pass A climbs a staircase: a sender's copy joins the batch at its own layer (the clean stream
        there), so every layer runs once for all the senders below it, not once per sender layer. Pass B
        runs the senders that share their first downstream receiver layer together from there."""
        model, start = self.model, self.part.start
        # the first receiver layer each sender reaches (n_layers: none, it reads the clean quantities)
        first_heard = [min((r for r in self.heads if r > l), default=model.n_layers) for l, _ in sender_heads]
        if self.heads:
            self.fixed.update({i: self.clean for i, f in zip(ids, first_heard) if f == model.n_layers})
            keep = [j for j, f in enumerate(first_heard) if f < model.n_layers]
            ids, sender_heads, first_heard = (
                [ids[j] for j in keep],
                [sender_heads[j] for j in keep],
                [first_heard[j] for j in keep],
            )
        if self.idle or not ids:
            self.fixed.update({i: self.clean for i in ids})
            return
        layers = [l for l, _ in sender_heads]
        stop = max(l for l in self.heads if l > layers[0]) + 1 if self.heads else model.n_layers
        read = self.part.b.positions.to(self.trace_b.resid_final.device) - start
        recorded: dict[int, Tensor] = {}
        clean_z = self.trace_a.z
        assert clean_z is not None  # kept by the trace
        h: Tensor | None = None
        for l in range(layers[0], stop):
            joining = [head for layer, head in sender_heads if layer == l]
            if joining:
                fresh = self.trace_a.resid_pre[l].repeat(len(joining), 1, 1)
                h = fresh if h is None else torch.cat([h, fresh])
            assert h is not None
            g = h.shape[0] // self.part.a.n
            reference = self.reference(l) if joining else None
            fns: dict[str, Hook] = {Site.z: _sent(clean_z[l], g, reference, joining, self.pos)}
            if l in self.heads:
                fns[self.site] = _keep(recorded, l, self.pos)  # type: ignore[index]
            replay = model.sites.replays and l not in self.heads
            last = not self.heads and l == model.n_layers - 1
            with model.hooks(l, **fns):
                h = model.run_blocks(
                    h,
                    l,
                    self.trace_a,
                    copies=g,
                    read=read.repeat(g, 1) if last else None,
                    stop=l + 1,
                    from_position=start,
                    replay=replay,
                )
        assert h is not None
        if not self.heads:
            self.readouts.add(ids, h, read.repeat(len(ids), 1))
            return
        n = self.part.b.n
        for first in sorted(set(first_heard)):
            rows = [j for j, f in enumerate(first_heard) if f == first]
            a, b, g = rows[0], rows[-1] + 1, len(rows)
            with ExitStack() as stack:
                for l, heads in self.heads.items():
                    if l >= first:
                        stack.enter_context(model.hooks(l, **self.entries(recorded[l][a * n : b * n], heads)))
                stack.enter_context(
                    holding(model, [x for x in self.held if x.layer >= first], self.part.rows, g, start)
                )
                out = model.run_blocks(
                    self.trace_b.resid_pre[first].repeat(g, 1, 1),
                    first,
                    self.trace_b,
                    copies=g,
                    read=read.repeat(g, 1),
                    from_position=start,
                )
            self.readouts.add(ids[a:b], out, read.repeat(g, 1))

    def entries(self, recorded: Tensor, heads: list[int]) -> dict[str, Hook]:
        """Hooks that hand receivers `heads` their input recorded in pass A (k and v: one copy per query
        head, only the receivers' copies patched)."""
        site, pos = self.site, self.pos
        source = [self.model.sites.kv_head_of(h) for h in heads] if site in KV_SITES else heads
        rep, expand = self.rep, self.expand

        def enter(t: Tensor) -> Tensor:
            t = t.repeat_interleave(rep, 1) if expand else t.clone()
            t[:, heads, pos] = recorded[:, source]
            return t

        hooks: dict[str, Hook] = {site: enter}  # type: ignore[dict-item]
        if expand:
            other = Site.v if site == Site.k else Site.k
            hooks[other] = lambda t: t.repeat_interleave(rep, 1)
        return hooks

    def results(self) -> dict[int, Tensor]:
        self.readouts.flush()
        return {**self.readouts.results, **self.fixed}


def _sent(clean: Tensor, copies: int, reference: Tensor | None, heads: list[int], pos: int | slice) -> Hook:
    """Every copy's z is the clean z, but the last len(heads) copies': copy c of those has head heads[c]'s
    from the reference run at `pos`."""

    def hook(z: Tensor) -> Tensor:
        out = clean.repeat(copies, 1, 1, 1)
        stacked = out.unflatten(0, (copies, clean.shape[0]))
        for c, head in enumerate(heads, start=copies - len(heads)):
            assert reference is not None
            stacked[c, :, pos, head] = reference[:, pos, head]
        return out

    return hook


def _keep(store: dict[int, Tensor], layer: int, pos: int | slice) -> Hook:
    def hook(t: Tensor) -> Tensor:
        store[layer] = t[:, :, pos].clone()
        return t

    return hook


@contextmanager
def holding(model: HookedModel, held: Sequence[Held], rows: Tensor, copies: int, start: int) -> Iterator[None]:
    """`held` in force on a batch of `copies` stacked copies of the prompts `rows`, positions start.."""
    by_layer: dict[int, list[Held]] = defaultdict(list)
    for item in held:
        by_layer[item.layer].append(item)
    with ExitStack() as stack:
        for layer, items in by_layer.items():
            stack.enter_context(model.hooks(layer, **{Site.z: _holder(items, rows, copies, start)}))
        yield


def _holder(items: list[Held], rows: Tensor, copies: int, start: int) -> Hook:
    def hook(z: Tensor) -> Tensor:
        stacked = z.unflatten(0, (copies, len(rows)))
        for item in items:
            at = item.position.to(z.device)[rows.to(z.device)] - start
            j = torch.nonzero((at >= 0) & (at < z.shape[1]))[:, 0]
            stacked[:, j, at[j], item.head] = item.value.to(z.device)[rows.to(z.device)][j].to(z.dtype)
        return z

    return hook
