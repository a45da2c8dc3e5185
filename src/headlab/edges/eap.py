"""Edge attribution: EAP (Syed et al. 2023), EAP-IG (Hanna et al. 2024) and EAP-IG over activations.

The score of edge U -> R is (out_U(corrupt) - out_U(clean)) . dm/d in_R, summed over positions and
averaged over prompts: the first-order estimate of the change in the mean metric m when that one edge is
patched from the corrupted run. in_R is R's own copy of the residual stream (as if each receiver read a
private copy), so its gradient is that of the receiver alone:
  eap                 the gradient on the clean run;
  eap_ig              its mean over `steps` runs whose input embeddings are interpolated from the
                      corrupted to the clean ones (alpha = k/steps, k = 0..steps-1 as hannamw/EAP-IG's
                      get_scores_eap_ig and MIB sum it: the corrupted endpoint in, the clean one out;
                      ig_steps_from=1: k = 1..steps, as the paper writes it);
  eap_ig_activations  its mean over runs in which one node at a time (the input, a layer's attention,
                      a layer's MLP) outputs the interpolation of its clean and corrupted outputs
                      (k = 1..steps, as get_scores_ig_activations sums it; ig_steps_from=0: 0..steps-1).
ig_steps_from=None (the default) takes each method's own range from the authors' code (AUTHORS_STEPS_FROM).
On a post-norm model the senders' outputs are postnorm.py's: under mib (MIB's code) a head's difference
is taken before its layer's norm; an MLP node's output is after its norm, and under shares so is an
attention node's.

Gradients are taken one layer at a time, from the logits down: the forward pass keeps only each block's
input (the clean run's own trace where the run edits nothing: eap runs no extra forward pass); each block
is run again with autograd, its receivers' gradients are turned into scores at once, and only its input's
gradient goes on. Beside the residual cache, one layer's activations are held. The runs that edit one node
(eap_ig: every alpha; eap_ig_activations: a node's alphas) go through these passes together, as stacked
copies of the prompts: each layer's receivers' gradients are summed over the copies before they meet the
senders' differences (a score is linear in them), so a pass's products are made once for all its alphas,
and its blocks run on alphas x prompts rows at once.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from ..errors import UsageError
from ..interventions.lengths import passes as prompt_passes
from ..models.hooked import HookedModel, Trace
from ..models.norms import norm_vjp
from ..progress import progress_bar
from ..tasks import Task, TaskData
from ..vocabulary import Site
from .graph import EdgeGraph
from .postnorm import attn_output, mlp_output
from .record import Recording, check_pairs, metric, metric_column, record, sender_outputs

METHODS = ("eap", "eap_ig", "eap_ig_activations")


@dataclass(frozen=True)
class Interpolation:
    """One gradient run's edit: node `what` (input | attn | mlp) of `layer` outputs clean*alpha +
    corrupt*(1-alpha); what=None: the clean run."""

    what: str | None = None
    layer: int = 0
    alpha: float = 1.0


IG_STEPS_FROM = (0, 1)  # the first k of the sum over alpha = k/steps
# hannamw/EAP-IG (src/eap/attribute.py): get_scores_eap_ig sums k = 0..steps-1, get_scores_ig_activations 1..steps
AUTHORS_STEPS_FROM = {"eap_ig": 0, "eap_ig_activations": 1}


def first_k(method: str, ig_steps_from: int | None) -> int:
    """The first k of `method`'s sum: `ig_steps_from` where given, else the authors' code's."""
    return AUTHORS_STEPS_FROM.get(method, 0) if ig_steps_from is None else ig_steps_from


def runs_of(method: str, graph: EdgeGraph, steps: int, steps_from: int | None = None) -> list[Interpolation]:
    if method == "eap":
        return [Interpolation()]
    steps_from = first_k(method, steps_from)
    if steps_from not in IG_STEPS_FROM:
        raise UsageError(f"ig_steps_from={steps_from}: choose 0 (k = 0..steps-1) or 1 (k = 1..steps)")
    return runs_at(method, graph, [k / steps for k in range(steps_from, steps_from + steps)])


def runs_at(method: str, graph: EdgeGraph, alphas: list[float]) -> list[Interpolation]:
    """eap_ig*'s gradient runs at these alphas."""
    if method == "eap_ig":
        return [Interpolation("input", 0, a) for a in alphas]
    if method == "eap_ig_activations":
        nodes = [("input", 0)] + [
            (what, layer)
            for layer in range(graph.n_layers)
            for what in ("attn", "mlp")
            if what == "attn" or layer in graph.mlp_layers
        ]
        return [Interpolation(what, layer, a) for what, layer in nodes for a in alphas]
    raise UsageError(f"unknown attribution method '{method}'; choose from: {', '.join(METHODS)}")


def scores(
    model: HookedModel,
    task: Task,
    data: TaskData,
    graph: EdgeGraph,
    method: str = "eap",
    steps: int = 5,
    prompts_per_pass: int = 16,
    show_progress: bool = False,
    ig_steps_from: int | None = None,
) -> Tensor:
    """[senders, receivers] float64: each edge's score (NaN where there is no edge). `ig_steps_from`: the
    first k of eap_ig*'s sum over alpha = k/steps (None: the authors' code's for the method, first_k)."""
    runs = runs_of(method, graph, steps, ig_steps_from)
    total = _summed(model, task, data, graph, runs, prompts_per_pass, show_progress, method)
    total /= data.n * len(runs)
    return total.masked_fill(~graph.real, float("nan"))


def doubled_steps(
    model: HookedModel,
    task: Task,
    data: TaskData,
    graph: EdgeGraph,
    method: str,
    at_steps: Tensor,
    steps: int,
    prompts_per_pass: int = 16,
    show_progress: bool = False,
    ig_steps_from: int | None = None,
) -> Tensor:
    """eap_ig*'s scores at 2 * steps interpolation steps, given `at_steps`, its scores at `steps`: the
    2m-step sum's even alphas, k/(2m) = j/m, are the m-step sum's own, so only its m odd alphas run (the
    same sums as scores(..., 2 * steps), to float64 rounding)."""
    if method not in ("eap_ig", "eap_ig_activations"):
        raise UsageError(f"only eap_ig and eap_ig_activations integrate over steps, not {method}")
    first = first_k(method, ig_steps_from)
    odd = [k / (2 * steps) for k in range(first, first + 2 * steps) if k % 2]
    runs = runs_at(method, graph, odd)
    total = _summed(model, task, data, graph, runs, prompts_per_pass, show_progress, method)
    per_alpha = len(runs) // len(odd)  # gradient runs per alpha (eap_ig_activations: one per node)
    done = at_steps.nan_to_num() * (data.n * steps * per_alpha)
    total = (done + total) / (data.n * 2 * steps * per_alpha)
    return total.masked_fill(~graph.real, float("nan"))


def _summed(
    model: HookedModel,
    task: Task,
    data: TaskData,
    graph: EdgeGraph,
    runs: list[Interpolation],
    prompts_per_pass: int,
    show_progress: bool,
    method: str,
) -> Tensor:
    """[senders, receivers] float64: the runs' scores summed over the runs and the prompts."""
    check_pairs(data)
    column = metric_column(task)
    total = torch.zeros(graph.real.shape, dtype=torch.float64)
    passes = prompt_passes(data, prompts_per_pass)
    done = 0
    with progress_bar(f"edges ({method})", total=len(passes) * len(runs), enabled=show_progress) as bar:
        for part in passes:
            with torch.no_grad():  # not inference_mode: these tensors meet autograd below
                clean = record(model, graph, part.inputs)
                corrupt = record(model, graph, part.counterfactual)  # type: ignore[arg-type]
                delta = sender_outputs(model, graph, corrupt)
                delta -= sender_outputs(model, graph, clean)
            for stack in stacks(runs):
                _accumulate(total, model, task, part, graph, delta, clean, corrupt, stack, column)
                done += len(stack)
                bar.update(done)
    return total


def stacks(runs: list[Interpolation]) -> list[list[Interpolation]]:
    """The runs in stacks that edit one node (in their order): a stack's alphas run as stacked copies of the
    prompts, one pass for them all."""
    out: list[list[Interpolation]] = []
    for run in runs:
        if out and (out[-1][0].what, out[-1][0].layer) == (run.what, run.layer):
            out[-1].append(run)
        else:
            out.append([run])
    return out


def _between(old: Tensor, new: Tensor, stack: list[Interpolation]) -> Tensor:
    """old + alpha * (new - old) at each run's alpha, the copies stacked along the first dimension."""
    return torch.cat([old + run.alpha * (new - old) for run in stack])


def _copies_summed(t: Tensor, copies: int, dim: int = 0) -> Tensor:
    """t with its `copies` stacked copies along `dim` summed (in float32 at least: a half-precision sum
    would lose the digits each copy's own product kept)."""
    if copies == 1:
        return t
    wide = torch.promote_types(t.dtype, torch.float32)
    return t.unflatten(dim, (copies, -1)).sum(dim, dtype=wide).to(t.dtype)


def _accumulate(
    total: Tensor,
    model: HookedModel,
    task: Task,
    data: TaskData,
    graph: EdgeGraph,
    delta: Tensor,
    clean: Recording,
    corrupt: Recording,
    stack: list[Interpolation],
    column: int,
) -> None:
    """Add the scores of a stack of gradient runs (one node's alphas; summed over them and their prompts)
    to total."""
    trace, node, copies = clean.trace, stack[0], len(stack)
    # blocks before the runs' edited node see the clean run's inputs: those come from the trace (one copy,
    # which every alpha shares)
    first = model.n_layers if node.what is None else 0 if node.what == "input" else node.layer
    with torch.no_grad():
        cache = list(trace.resid_pre[:first])
        h = trace.resid_final if first == model.n_layers else trace.resid_pre[first]
        if node.what == "input":
            h = _between(corrupt.trace.resid_pre[0], h, stack)  # [copies * n, pos, d]
        elif copies > 1:
            h = h.repeat(copies, 1, 1)
        for layer in range(first, model.n_layers):
            cache.append(h)
            with _interpolated(model, graph, stack, layer, clean, corrupt):
                h = model.run_blocks(h, layer, trace, copies=copies, stop=layer + 1)
    with torch.enable_grad():
        final = h.detach().requires_grad_()
        (grad,) = torch.autograd.grad(metric(model, task, data, final, column).sum(), final)
        # products in the model's dtype (a float64 copy of the differences would double their memory),
        # sums over stacks and prompt slices in float64
        flat_delta = delta.flatten(1)
        logits = len(graph.receivers) - 1
        total[:, logits] += (flat_delta @ _copies_summed(grad, copies).flatten().to(flat_delta.dtype)).double().cpu()
        for layer in reversed(range(model.n_layers)):
            x = cache[layer] if cache[layer].shape[0] == grad.shape[0] else cache[layer].repeat(copies, 1, 1)
            receivers, grad = _layer_gradients(model, graph, trace, layer, x, grad, stack, clean, corrupt)
            cols = graph.layer_receivers(layer)
            upto = graph.senders_into(cols)  # the senders after them have no edge here: no product
            total[:upto, cols] += (flat_delta[:upto] @ receivers.flatten(1).to(flat_delta.dtype).T).double().cpu()


def _layer_gradients(
    model: HookedModel,
    graph: EdgeGraph,
    trace: Trace,
    layer: int,
    x: Tensor,
    grad_out: Tensor,
    stack: list[Interpolation],
    clean: Recording,
    corrupt: Recording,
) -> tuple[Tensor, Tensor]:
    """(gradients at the layer's receivers' inputs [receivers, n, pos, d] in graph order, summed over the
    stack's copies, gradient at the block's input [copies * n, pos, d]).

    A head's receiver is the attention's input as that head's q (k, v) alone reads it: one backward pass
    gives the gradient at the q, k and v projections' outputs, whose columns are per head (nothing after
    them mixes heads); each head's part times its own weights is the gradient at the norm's output from
    that head alone, and one pass of the norm over stacked copies takes them all back through it. With
    ungrouped key/value edges under GQA (graph.expands_kv) the attention is handed k and v one copy per
    query head, so the backward pass gives each query head's gradient at its own copy; taken back to the
    projections' outputs one member of every group at a time (through the rotary, and any k norm), each
    is that query head's share of its key/value head's gradient."""
    x = x.detach().requires_grad_()
    kept: dict[str, Tensor] = {}

    def copy(name: str) -> Callable[[Tensor], Tensor]:
        def hook(t: Tensor) -> Tensor:
            kept[name] = t.clone()  # a node of its own: its gradient is that of this reader alone
            return kept[name]

        return hook

    def seen(name: str) -> Callable[[Tensor], Tensor]:
        def hook(t: Tensor) -> Tensor:
            kept[name] = t
            return t

        return hook

    def keep(name: str) -> Callable[[nn.Module, object, Tensor], None]:
        def hook(_module: nn.Module, _args: object, output: Tensor) -> None:
            kept[name] = output

        return hook

    sites, has_mlp = model.sites, layer in graph.mlp_layers
    assert sites.qkv_projs is not None and sites.qkv_split is not None  # EdgeGraph.of checked
    projs = sites.qkv_projs[layer]
    with ExitStack() as hooks:
        hooks.enter_context(
            model.input_hooks(layer, attn_in=seen("attn_in"), mlp_in=copy("mlp_in") if has_mlp else None)
        )
        for i, module in enumerate(projs):
            hooks.callback(module.register_forward_hook(keep(f"proj{i}")).remove)
        if graph.expands_kv:
            hooks.enter_context(
                model.hooks(layer, k=_expanded(kept, "k", graph.group), v=_expanded(kept, "v", graph.group))
            )
        hooks.enter_context(_interpolated(model, graph, stack, layer, clean, corrupt))
        out = model.run_blocks(x, layer, trace, copies=len(stack), stop=layer + 1)
    outs = [kept[f"proj{i}"] for i in range(len(projs))]
    copies = [kept["k"], kept["v"]] if graph.expands_kv else []
    wanted = [x, *outs, *copies] + ([kept["mlp_in"]] if has_mlp else [])
    grads = torch.autograd.grad(out, wanted, grad_out, allow_unused=True, retain_graph=bool(copies))
    grad_x = grads[0]
    assert grad_x is not None
    # None: the layer's output does not depend on its q, k, v (an interpolated attention)
    at_proj = [torch.zeros_like(o) if g is None else g for o, g in zip(outs, grads[1 : 1 + len(outs)])]
    weights = list(sites.W_QKV(layer))
    per_site = list(sites.qkv_split(at_proj))  # q, k, v: [n, pos, heads of the site, d_head]
    if copies:
        at_copies = grads[1 + len(outs) : 1 + len(outs) + 2]
        per_site = [per_site[0]] + [
            _per_query_head(kept[f"{site}_in"], outs, g, graph.group, sites.qkv_split, i)
            for i, (site, g) in enumerate(zip("kv", at_copies), 1)
        ]
        weights = [weights[0]] + [w.repeat_interleave(graph.group, 0) for w in weights[1:]]
    stacked = len(stack)
    # a site's heads at a time through the norm, their copies summed at once: the layer's gradients for
    # every copy are never held together
    receivers = []
    for g, w in zip(per_site, weights):
        per_head = torch.einsum("npge,gde->gnpd", g, w.to(g.dtype))  # [heads, copies * n, pos, d]
        receivers.append(_copies_summed(_through_norm(model, layer, kept["attn_in"], per_head), stacked, 1))
    if has_mlp:
        g = grads[-1]
        receivers.append(_copies_summed(torch.zeros_like(x) if g is None else g, stacked).unsqueeze(0))
    return torch.cat(receivers), grad_x


def _expanded(kept: dict[str, Tensor], site: str, group: int) -> Callable[[Tensor], Tensor]:
    """A k or v hook that hands the attention one copy per query head, a node of its own."""

    def hook(t: Tensor) -> Tensor:  # t: [n, kv_head, pos, d_head]
        kept[f"{site}_in"] = t
        kept[site] = t.repeat_interleave(group, 1)  # [n, head, pos, d_head]
        return kept[site]

    return hook


def _per_query_head(
    site_in: Tensor, outs: list[Tensor], grad: Tensor | None, group: int, split: Callable, index: int
) -> Tensor:
    """[n, pos, head, d_head]: each query head's gradient at its key/value head's columns of the projection
    output, from the gradient at its own copy of k or v (grad [n, head, pos, d_head]): the copies of group
    member m (heads m, m + group, ...) taken back through what lies between projection and hook at once."""
    n_kv = site_in.shape[1]
    if grad is None:  # the layer's output does not read this site (an interpolated attention)
        zero = split([torch.zeros_like(o) for o in outs])[index]
        return zero.repeat_interleave(group, 2)
    members = []
    for m in range(group):
        back = torch.autograd.grad(site_in, outs, grad[:, m::group], allow_unused=True, retain_graph=True)
        members.append(split([torch.zeros_like(o) if b is None else b for o, b in zip(outs, back)])[index])
    return torch.stack(members, 3).reshape(*members[0].shape[:2], n_kv * group, -1)  # head j*group+m at j, m


def _through_norm(model: HookedModel, layer: int, reader: Tensor, cotangents: Tensor) -> Tensor:
    """[k, n, pos, d]: k vector-Jacobian products of the layer's attention norm at `reader` [n, pos, d]
    (cotangents [k, n, pos, d]): in closed form (models/norms.norm_vjp), else from one pass of the norm
    over k stacked copies of its input: a norm acts on each position alone, and autograd's batched products
    would loop over k (no batching rule for a norm's backward)."""
    norm = model.attn_inputs[layer]
    assert norm is not None  # EdgeGraph.of checked
    closed = norm_vjp(norm, model.norm_offset, reader, cotangents)
    if closed is not None:
        return closed
    k = cotangents.shape[0]
    stacked = reader.detach().repeat(k, 1, 1).requires_grad_()
    (out,) = torch.autograd.grad(norm(stacked), stacked, cotangents.flatten(0, 1))
    return out.unflatten(0, (k, reader.shape[0]))


@contextmanager
def _interpolated(
    model: HookedModel, graph: EdgeGraph, stack: list[Interpolation], layer: int, clean: Recording, corrupt: Recording
) -> Iterator[None]:
    """Hooks that make the stack's node output its interpolated value in each copy (copy i at the alpha of
    run i), where it is in this layer."""
    node = stack[0]
    if node.what not in ("attn", "mlp") or node.layer != layer:
        yield
        return

    if node.what == "mlp":
        value = _between(corrupt.mlp[layer], clean.mlp[layer], stack)
        context = mlp_output(model, graph, layer, lambda _t: value)
    elif graph.post_norm == "shares":  # the node's output is its layer's normalised output
        value = _between(corrupt.attn[layer][1], clean.attn[layer][1], stack)
        context = attn_output(model, layer, lambda _a, _out: value)
    else:  # z, as MIB's hook_result: linear in z, before any norm
        value = _between(corrupt.z[layer], clean.z[layer], stack)
        context = model.hooks(layer, **{Site.z: lambda _t: value})
    with context:
        yield
