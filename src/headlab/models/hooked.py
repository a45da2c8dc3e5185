"""HookedModel: one interface over every model headlab runs (HF causal LMs, toy transformers).

The sweep engine needs three things from a model, and nothing about its family:
  trace(inputs)                    one clean forward pass that keeps each block's input (the residual
                                   stream) and the extra arguments the block was called with;
  run_blocks(h, start, trace, g)   blocks start..L-1 on a batch that stacks g copies of the prompts,
                                   on every position or (runs_suffixes, a trace that kept
                                   keys and values) on positions p.. alone, the clean keys and values of
                                   the positions before p put in front of the suffix's own;
  readout(h, positions)            final norm + unembedding at the positions the metrics read only.

Besides the head sites (sites.py), every layer with an MLP has two more: "mlp", the MLP's output
[batch, pos, d_model], and "neurons", its hidden units [batch, pos, d_mlp] (the input of the down
projection, reached by a forward pre-hook on that module). Both have TransformerLens's layout and names
(hook_mlp_out, mlp.hook_post); where a model normalises the MLP's output before the residual sum
(Gemma 2), "mlp" is before that norm and hook_mlp_out after it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from jaxtyping import Float
from torch import Tensor, nn

from ..config_rules import DTYPES
from ..errors import HeadlabError
from ..vocabulary import MLP_SITES, Site
from .projections import heads_alone
from .sites import HeadSites

# Unembedding rows one slice of readout_normaliser multiplies at once: 2.3 MB of smollm2's in float32, which
# stay in cache while its positions' logits are made; the whole vocabulary at once (113 MB) runs at about
# two thirds of the rate on a CPU, its logits written to memory and read back for the softmax
VOCAB_SLICE = 1024

Inputs = dict[str, Tensor]


def torch_dtype(name: str) -> torch.dtype:
    """model.dtype's torch dtype, refused in one line when it is none of DTYPES."""
    if name not in DTYPES:
        raise HeadlabError(f"unknown model.dtype '{name}'; choose one of: {', '.join(DTYPES)}")
    return getattr(torch, name)


@dataclass
class Trace:
    batch: int
    # entering each block (the first block's alone: see walk), positions inputs_from.. of the prompts
    resid_pre: list[Float[Tensor, "batch _ d_model"]]
    block_extra: list[tuple[tuple, dict]]  # what else each block was called with (masks, rotary, ...)
    resid_final: Float[Tensor, "batch pos d_model"]  # leaving the last block
    # per layer the clean keys and values, when kept (path patching hands a layer one copy per query head)
    kv: list[tuple[Float[Tensor, "batch _ _ d_head"], Float[Tensor, "batch _ _ d_head"]]] | None = None
    z: dict[int, Float[Tensor, "batch _ head d_head"]] | None = None  # layer -> the clean z, when kept
    inputs_from: int = 0  # resid_pre and z hold positions inputs_from.. alone
    _expanded: dict = field(default_factory=dict)

    @property
    def length(self) -> int:
        return self.resid_final.shape[1]

    @property
    def nbytes(self) -> int:
        """The memory its cached activations take (the blocks' extra arguments aside: masks, tables)."""
        z = (self.z or {}).values()
        kept = [*self.resid_pre, self.resid_final, *z, *(t for kv in self.kv or [] for t in kv)]
        return sum(t.numel() * t.element_size() for t in kept)

    def extra_for(self, layer: int, copies: int, start: int = 0, stop: int | None = None) -> tuple[tuple, dict]:
        """The block's extra arguments for `copies` stacked copies of positions start..stop-1 of the prompts
        (stop None: to the last)."""
        extra = self.block_extra[layer]
        end = self.length if stop is None else stop
        if start or end != self.length:
            extra = _each_tensor(extra, lambda t: self._memo(_suffix, t, self.length, start, end))
        if copies > 1:
            extra = _each_tensor(extra, lambda t: self._memo(_repeat, t, self.batch, copies))
        return extra

    def _memo(self, fn: Callable[..., Tensor], t: Tensor, *args: int) -> Tensor:
        """fn(t, *args), made once per trace: the same masks and tables serve every chunk."""
        key = (id(t), fn.__name__, *args)
        if key not in self._expanded:
            self._expanded[key] = fn(t, *args)
        return self._expanded[key]


def _each_tensor(obj: Any, fn: Callable[[Tensor], Tensor]) -> Any:
    """obj with fn applied to every tensor inside its tuples, lists and dicts."""
    if isinstance(obj, Tensor):
        return fn(obj)
    if isinstance(obj, tuple):
        return tuple(_each_tensor(o, fn) for o in obj)
    if isinstance(obj, list):
        return [_each_tensor(o, fn) for o in obj]
    if isinstance(obj, dict):
        return {k: _each_tensor(v, fn) for k, v in obj.items()}
    return obj


def _suffix(t: Tensor, length: int, start: int, stop: int) -> Tensor:
    """Positions start..stop-1 of a positional tensor: a mask's query rows ([b, 1, q, k]: every key stays;
    the attention reads the columns of the keys it has), a table's or an id row's positions ([b, pos, ...]
    and [b, pos]), a position vector ([pos]); any other tensor as it is."""
    if t.dim() == 4 and t.shape[-2:] == (length, length):
        return t[..., start:stop, :]
    if t.dim() in (2, 3) and t.shape[1] == length:
        return t[:, start:stop]
    if t.dim() == 1 and t.shape[0] == length:
        return t[start:stop]
    return t


def _repeat(t: Tensor, batch: int, copies: int) -> Tensor:
    """A batch-shaped tensor repeated `copies` times along dim 0 (group-major, like h.repeat); but an
    attention mask shared by the heads ([batch, 1, queries, keys]) stays one per prompt, which
    headlab_attention applies to every copy: repeated, it would be the widest tensor of a long chunk."""
    if t.dim() == 0 or t.shape[0] != batch or (t.dim() == 4 and t.shape[1] == 1):
        return t
    return t.repeat(copies, *([1] * (t.dim() - 1)))


class HookedModel:
    def __init__(
        self,
        name: str,
        module: nn.Module,
        sites: HeadSites,
        blocks: list[nn.Module],
        final_norm: nn.Module,
        unembed: nn.Module,
        call: Callable[[nn.Module, Inputs], Tensor],
        family: str,
        tokenizer: Any = None,
        logit_softcap: float | None = None,
        mlps: list[nn.Module | None] | None = None,
        width: int = 0,
        down_projs: list[nn.Module | None] | None = None,
        attn_inputs: list[nn.Module | None] | None = None,
        mlp_inputs: list[nn.Module | None] | None = None,
        parallel: bool = False,
        runs_suffixes: bool = False,
        post_norms: tuple[list[nn.Module], list[nn.Module]] | None = None,
        qk_norms: tuple[list[nn.Module | None], list[nn.Module | None]] | None = None,
        norm_offset: float = 0.0,
        edges_refused: str | None = None,
        attn_scales: list[float] | None = None,
    ):
        self.name = name
        self.module = module
        self.sites = sites
        self.blocks = blocks
        self.final_norm = final_norm
        self.unembed = unembed
        self._call = call
        self.family = family
        self._tokenizer = tokenizer
        self._tokenizer_loader: Callable[[], Any] | None = None
        self.logit_softcap = logit_softcap
        self.mlps = mlps or [None] * len(blocks)
        self.down_projs = down_projs or [None] * len(blocks)  # per layer: the module whose input is "neurons"
        # per layer: the module whose input is the residual stream the attention (MLP) reads, its norm
        self.attn_inputs = attn_inputs or [None] * len(blocks)
        self.mlp_inputs = mlp_inputs or [None] * len(blocks)
        self.parallel = parallel  # attention and MLP both read the block's input (GPT-NeoX, GPT-J)
        # per layer: the norms on the attention's and the MLP's outputs (Family.post_norms: Gemma 2 and 3,
        # OLMo 2); None: the residual stream is a sum of the components' outputs
        self.post_norms = post_norms
        # False where a norm sits on a component's output: edges then follow edges/postnorm.py's rules
        self.residual_sum = post_norms is None
        # per layer: the attention's per-head query and key norms (QK-norm: Qwen3, Gemma 3), else None
        none: list[nn.Module | None] = [None] * len(blocks)
        self.q_norms, self.k_norms = qk_norms or (none, none)
        self.norm_offset = norm_offset  # its RMSNorms multiply by norm_offset + weight (models/norms.py)
        self.edges_refused = edges_refused  # why edges are not defined on it (Family.edges_refused)
        # per layer: what the attention multiplies q.k by (Gemma: query_pre_attn_scalar**-0.5)
        self.attn_scales = attn_scales or [sites.d_head**-0.5] * len(blocks)
        # run_blocks may run its blocks on a suffix of positions: they take positions only through the
        # extra arguments a Trace keeps (Family.suffix_runs; toy models)
        self.runs_suffixes = runs_suffixes
        self.width = max(width, sites.d_model)  # widest per-token activation (d_mlp or d_model)
        # the ModelConfig (models/loading.py) it was loaded from, where headlab.load_model set it
        self.config: Any = None
        self.source: object = None  # what its loader needs to load it again (hf.Pretrained); None: built here
        # where its weights came from, where a file was converted for it (a GGUF file's package, sha256)
        self.weights: dict[str, Any] | None = None

    @property
    def tokenizer(self) -> Any:
        """Its tokenizer (None: it has none); one found beside the weights loads when first asked for, a
        sweep that reads token ids alone never holds it."""
        if self._tokenizer_loader is not None:
            self._tokenizer, self._tokenizer_loader = self._tokenizer_loader(), None
        return self._tokenizer

    @tokenizer.setter
    def tokenizer(self, tokenizer: Any) -> None:
        self._tokenizer, self._tokenizer_loader = tokenizer, None

    def tokenizer_from(self, loader: Callable[[], Any]) -> None:
        """The tokenizer is what `loader` returns (None: none usable), loaded when first asked for."""
        self._tokenizer, self._tokenizer_loader = None, loader

    @property
    def n_layers(self) -> int:
        return len(self.blocks)

    @property
    def dispatched(self) -> bool:
        """Spread over several devices (model.device_map): each layer stays where it was put."""
        return bool(getattr(self.module, "hf_device_map", None))

    @property
    def input_device(self) -> torch.device:
        """Where the model reads its inputs: the device of its token embedding (HF), else of its first
        parameter (toy models: their embedding)."""
        get = getattr(self.module, "get_input_embeddings", None)
        weight = get().weight if get is not None else next(self.module.parameters())
        assert isinstance(weight, Tensor)
        return weight.device

    def place(self, device: str) -> None:
        """Move the model to `device`, unless it is dispatched over several (model.device_map)."""
        if not self.dispatched:
            self.module.to(device)

    @property
    def vocab_size(self) -> int:
        """Rows of the unembedding (a Qwen-style padded one has more than its tokenizer)."""
        weight = self.unembed.weight
        assert isinstance(weight, Tensor)
        return int(weight.shape[0])

    @property
    def n_heads(self) -> int:
        return self.sites.n_heads

    @contextmanager
    def frozen(self) -> Iterator[None]:
        """Its weights need no gradient while inside: a backward pass to activations alone then keeps no
        linear layer's input (only a weight's gradient reads it), a third of the forward's memory or more."""
        params = [p for p in self.module.parameters() if p.requires_grad]
        for p in params:
            p.requires_grad_(False)
        try:
            yield
        finally:
            for p in params:
                p.requires_grad_(True)

    def forward(self, inputs: Inputs) -> Tensor:
        """Full logits [batch, pos, vocab]."""
        return self._call(self.module, inputs)

    def record(self, inputs: Inputs, site: str = "z") -> dict[int, Tensor]:
        """layer -> one site's activation over a plain forward pass: a head site (shapes: see sites.py),
        "mlp", the MLP block's output [batch, pos, d_model], or "neurons", its hidden units
        [batch, pos, d_mlp]."""
        if site not in MLP_SITES:
            with self.sites.record((site,)) as store:
                self.forward_blocks(inputs)
            return {layer: t.contiguous() for (_, layer), t in store.items()}
        out: dict[int, Tensor] = {}

        def keep(layer: int) -> Callable[[Tensor], Tensor]:
            def store(t: Tensor) -> Tensor:
                out[layer] = t.contiguous()
                return t

            return store

        with ExitStack() as stack:
            for layer in range(self.n_layers):
                stack.enter_context(self.hooks(layer, **{site: keep(layer)}))
            self.forward_blocks(inputs)
        return out

    def capture(self, inputs: Inputs, layer: int, site: str = "z") -> Tensor:
        """One head site of one layer (shapes: see sites.py); the forward pass stops right there."""
        kept: list[Tensor] = []

        def grab(t: Tensor) -> Tensor:
            kept.append(t)
            raise _Stop

        with self.sites.hooks(layer, **{site: grab}):
            try:
                self.forward(inputs)
            except _Stop:
                pass
        return kept[0]

    def embed(self, inputs: Inputs) -> Tensor:
        """The residual stream entering the first block [batch, pos, d_model] (token and, where the model
        has them, position embeddings); no block runs."""
        return self._input_to(self.blocks[0], inputs)

    def forward_blocks(self, inputs: Inputs) -> Tensor:
        """A forward pass that stops before the final norm: hooks see every block, and no vocabulary-
        sized logits are computed. Returns the residual stream entering the final norm."""
        return self._input_to(self.final_norm, inputs)

    def _input_to(self, module: nn.Module, inputs: Inputs) -> Tensor:
        """The hidden states a forward pass hands `module`; the pass stops there."""
        kept: list[Tensor] = []

        def grab(_module, args, kwargs):
            kept.append(args[0] if args else kwargs["hidden_states"])
            raise _Stop

        handle = module.register_forward_pre_hook(grab, with_kwargs=True)
        try:
            self.forward(inputs)
        except _Stop:
            pass
        finally:
            handle.remove()
        return kept[0]

    @contextmanager
    def kept(self, site: str, read: Callable[[Tensor], Tensor]) -> Iterator[dict[int, Tensor]]:
        """layer -> read(the layer's `site` tensor), filled as a pass runs, the tensor itself left as it is:
        for what a full record (sites.record) would hold too much of, e.g. one row of every pattern."""
        seen: dict[int, Tensor] = {}

        def keep(layer: int) -> Callable[[Tensor], Tensor]:
            def hook(t: Tensor) -> Tensor:
                seen[layer] = read(t)
                return t

            return hook

        with ExitStack() as stack:
            for layer in range(self.n_layers):
                stack.enter_context(self.sites.hooks(layer, **{site: keep(layer)}))
            yield seen

    @contextmanager
    def hooks(self, layer: int, **fns: Callable[[Tensor], Tensor]) -> Iterator[None]:
        """Hooks on one layer's head sites (see HeadSites.hooks), on "mlp", its MLP output, and on
        "neurons", the MLP's hidden units (fn may edit its tensor in place and return it)."""
        mlp_fn, neurons_fn = fns.pop(Site.mlp, None), fns.pop(Site.neurons, None)
        handles = []
        try:
            if mlp_fn is not None:
                mlp = self.mlps[layer]
                if mlp is None:
                    raise ValueError(f"layer {layer} of {self.name} has no MLP")
                handles.append(mlp.register_forward_hook(lambda _m, _a, output: mlp_fn(output)))
            if neurons_fn is not None:
                down_proj = self.down_projs[layer]
                if down_proj is None:
                    raise ValueError(f"layer {layer} of {self.name} has no MLP (no down projection for neurons)")
                handles.append(down_proj.register_forward_pre_hook(_first_arg(neurons_fn)))
            with self.sites.hooks(layer, **fns):
                yield
        finally:
            for handle in handles:
                handle.remove()

    @contextmanager
    def input_hooks(
        self,
        layer: int,
        attn_in: Callable[[Tensor], Tensor] | None = None,
        mlp_in: Callable[[Tensor], Tensor] | None = None,
    ) -> Iterator[None]:
        """Hooks on the residual stream as the attention (attn_in) and the MLP (mlp_in) of one layer read
        it, before their norms: fn may return a different tensor, which that component alone then reads
        (the residual stream itself is unchanged)."""
        handles = []
        try:
            for fn, modules, what in ((attn_in, self.attn_inputs, "attention"), (mlp_in, self.mlp_inputs, "MLP")):
                if fn is None:
                    continue
                module = modules[layer]
                if module is None:
                    raise ValueError(f"layer {layer} of {self.name} has no known {what} input")
                handles.append(module.register_forward_pre_hook(_first_arg(fn)))
            yield
        finally:
            for handle in handles:
                handle.remove()

    def trace(
        self,
        inputs: Inputs,
        keep_kv: bool = False,
        keep_z: bool = False,
        every_input: bool = True,
        inputs_from: int = 0,
    ) -> Trace:
        """One clean pass keeping each block's input and extra arguments; with `keep_kv`, each layer's
        keys and values too (what run_blocks needs to run a suffix of positions), with `keep_z` each
        layer's z (what it needs to replay an attention). Without `every_input`, the first block's input
        alone (walk gives the others back one at a time); with `inputs_from` p, the inputs and z of
        positions p.. alone (all that runs on suffixes from p on read)."""
        resid_pre: list[Tensor | None] = [None] * self.n_layers
        extra: list[tuple | None] = [None] * self.n_layers
        final: list[Tensor] = []
        suffix = (lambda t: t[:, inputs_from:].clone()) if inputs_from else (lambda t: t)  # a view holds it all

        def pre_hook(layer: int):
            def hook(_module, args, kwargs):
                kw = dict(kwargs)
                h = args[0] if args else kw.pop("hidden_states")
                extra[layer] = (tuple(args[1:]), kw)
                if every_input or layer == 0:
                    resid_pre[layer] = suffix(h)

            return hook

        def post_hook(_module, _args, output):
            final.append(_hidden(output))

        handles = [b.register_forward_pre_hook(pre_hook(i), with_kwargs=True) for i, b in enumerate(self.blocks)]
        handles.append(self.blocks[-1].register_forward_hook(post_hook))
        try:
            with ExitStack() as stack:
                kept = stack.enter_context(self.sites.record(sites=(Site.k, Site.v) if keep_kv else ()))
                kept_z = stack.enter_context(self.sites.record(sites=(Site.z,) if keep_z else (), keep=suffix))
                self.forward_blocks(inputs)
        finally:
            for h in handles:
                h.remove()
        batch = next(iter(inputs.values())).shape[0]
        kv = [(kept[(Site.k, l)], kept[(Site.v, l)]) for l in range(self.n_layers)] if keep_kv else None
        inputs_kept = resid_pre if every_input else resid_pre[:1]
        z = {l: kept_z[(Site.z, l)] for l in range(self.n_layers)} if keep_z else None
        return Trace(batch, inputs_kept, extra, final[-1], kv, z, inputs_from)  # type: ignore[arg-type]

    def walk(self, trace: Trace, keep_z: bool = False) -> Iterator[tuple[int, Tensor]]:
        """(layer, that block's clean input) for every layer in order, from a trace that kept the first
        block's input alone: the clean pass again, block by block, holding two blocks' inputs at a time
        instead of every block's (at 30 layers and long prompts those outweigh the weights). With
        `keep_z`, trace.z holds the layer's clean z while it is yielded, for run_blocks' replay."""
        if trace.inputs_from:
            raise ValueError("a walk runs every position: it needs a trace that kept the whole first input")
        h = trace.resid_pre[0]
        for layer in range(self.n_layers):
            with self.sites.record(sites=(Site.z,) if keep_z else (), layers=[layer]) as kept:
                after = self.run_blocks(h, layer, trace, stop=layer + 1)
            if keep_z:
                trace.z = {layer: kept[(Site.z, layer)]}
            yield layer, h
            h = after
        if keep_z:
            trace.z = None

    def run_blocks(
        self,
        h: Tensor,
        start: int,
        trace: Trace,
        copies: int = 1,
        read: Tensor | None = None,
        stop: int | None = None,
        from_position: int = 0,
        replay: bool = False,
        to_position: int | None = None,
    ) -> Tensor:
        """Blocks start..stop-1 (default: to the last). With `read` ([batch, P] positions), the last
        block's MLP runs at those positions only: nothing after it reads the others, so their residual
        is left incomplete. With `from_position` p > 0, h holds positions p.. only (runs_suffixes, a
        trace with keep_kv): each layer attends to the trace's clean keys and values before p, which
        is exact wherever nothing before p was edited; with `to_position` q as well, h holds positions
        p..q-1 (exact: causal attention keeps later positions from changing them). With `replay` (a
        trace with keep_z), block `start`'s attention is not computed: h must be its clean input and its
        q, k, v and pattern unedited, so that its output is the output projection of the trace's z after
        the z hook."""
        if from_position and trace.kv is None:
            raise ValueError("a suffix of positions needs a trace that kept its keys and values")
        if replay and trace.z is None:
            raise ValueError("replaying an attention needs a trace that kept z")
        for layer in range(start, self.n_layers if stop is None else stop):
            args, kwargs = trace.extra_for(layer, copies, from_position, to_position)
            mlp = self.mlps[layer] if read is not None and layer == self.n_layers - 1 else None
            with ExitStack() as stack:
                stack.enter_context(_only_at(mlp, read))
                if replay and layer == start:
                    z = trace.z[layer][:, from_position - trace.inputs_from :].repeat(copies, 1, 1, 1)  # type: ignore[index]
                    stack.enter_context(self.sites.replayed(layer, z))
                elif from_position:
                    keys, values = trace.kv[layer]  # type: ignore[index]
                    stack.enter_context(
                        self.sites.prefixed(layer, keys[:, :, :from_position], values[:, :, :from_position])
                    )
                h = _hidden(self.blocks[layer](h, *args, **kwargs))
        return h

    def attention_inputs(
        self,
        h: Tensor,
        layer: int,
        trace: Trace,
        copies: int = 1,
        attn_in: Callable[[Tensor], Tensor] | None = None,
        wanted: list[tuple[str, int]] | None = None,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """(q, k, v) of block `layer`'s attention on h (shapes: sites.py), the block stopped right there:
        its attention, output projection and MLP never run. `attn_in` edits the stream the attention
        reads, as input_hooks does; the layer's q, k and v hooks run first. `wanted`: per stacked copy,
        the one (site, head) it is for: its projections then compute that head's columns alone and leave
        the rest zero (exact for that head: nothing between the projections and the sites mixes heads),
        or, where q, k and v have projections of their own, give one head, that one (models/projections.py)."""
        kept: list[Tensor] = []

        def keep(t: Tensor) -> Tensor:
            kept.append(t)
            return t

        def last(t: Tensor) -> Tensor:
            kept.append(t)
            raise _Stop

        args, kwargs = trace.extra_for(layer, copies)
        with ExitStack() as stack:
            if wanted is not None:
                stack.enter_context(heads_alone(self.sites, layer, wanted, h.shape[0] // copies))
            stack.enter_context(self.input_hooks(layer, attn_in=attn_in))
            stack.enter_context(self.sites.hooks(layer, q=keep, k=keep, v=last))
            try:
                self.blocks[layer](h, *args, **kwargs)
            except _Stop:
                pass
        q, k, v = kept
        return q, k, v

    def readout(self, h: Tensor, positions: Tensor) -> Tensor:
        """Logits [batch, n_positions, vocab] at positions [batch, n_positions] only."""
        return self._capped(self.unembed(self._normed(h, positions)))

    def readout_rows(self, h: Tensor, positions: Tensor, ids: Tensor) -> Tensor:
        """Logits [batch, n_positions, R] at positions [batch, n_positions] and the vocabulary rows ids
        [batch, R] (the same at every position) or [batch, n_positions, R] (a position's own) alone (a
        negative id reads row 0): readout's final norm, then R rows of the unembedding a prompt or
        position instead of all of them."""
        normed = self._normed(h, positions)  # [batch, P, d]
        ids = ids.to(h.device).clamp_min(0)
        weight = self.unembed.weight
        assert isinstance(weight, Tensor)
        rows = weight[ids].to(normed.dtype)  # [batch, R, d] or [batch, P, R, d]
        logits = torch.einsum("bpd,brd->bpr" if ids.dim() == 2 else "bpd,bprd->bpr", normed, rows)
        bias = getattr(self.unembed, "bias", None)
        if bias is not None:
            logits = logits + (bias[ids].unsqueeze(1) if ids.dim() == 2 else bias[ids]).to(logits.dtype)
        return self._capped(logits)

    def readout_normaliser(self, h: Tensor, positions: Tensor, rows_at_once: int) -> Tensor:
        """The log of the softmax's normaliser, logsumexp over the vocabulary of the logits readout gives
        [batch, n_positions], in float32 at least: VOCAB_SLICE rows of the unembedding at a time for
        `rows_at_once` positions, so no position's whole logits are ever held (the slices' logsumexps
        combined agree with readout's to float rounding)."""
        normed = self._normed(h, positions).flatten(0, 1)  # [batch * P, d]
        weight, bias = self.unembed.weight, getattr(self.unembed, "bias", None)
        assert isinstance(weight, Tensor)
        at_once = max(1, min(rows_at_once, normed.shape[0]))
        # where no gradient flows, every slice's float32 logits are made in one buffer and exponentiated in
        # place: a fresh tensor a slice fragments the heap that runtime.tune_allocator keeps (300 MB more
        # peak memory on smollm2's text sweep)
        grad = torch.is_grad_enabled() and normed.requires_grad
        buffer = None if grad or normed.dtype != torch.float32 else normed.new_empty(at_once * VOCAB_SLICE)
        blocks = []
        for first in range(0, normed.shape[0], at_once):
            x = normed[first : first + at_once]
            parts = []
            for s in range(0, weight.shape[0], VOCAB_SLICE):
                w, b = weight[s : s + VOCAB_SLICE], None if bias is None else bias[s : s + VOCAB_SLICE]
                if buffer is None:
                    logits = self._capped(F.linear(x, w, b))  # [rows, VOCAB_SLICE]
                    parts.append(torch.logsumexp(logits.float() if logits.element_size() < 4 else logits, dim=-1))
                    continue
                logits = torch.mm(x, w.T, out=buffer[: x.shape[0] * w.shape[0]].view(x.shape[0], w.shape[0]))
                if b is not None:
                    logits.add_(b)
                if self.logit_softcap:
                    logits.div_(self.logit_softcap).tanh_().mul_(self.logit_softcap)
                top = logits.amax(-1, keepdim=True)
                parts.append(logits.sub_(top).exp_().sum(-1).log_().add_(top.squeeze(-1)))
            blocks.append(torch.stack(parts).logsumexp(0))
        return torch.cat(blocks).view(positions.shape)

    def _normed(self, h: Tensor, positions: Tensor) -> Tensor:
        """The final norm of h [batch, pos, d] at positions [batch, P] alone."""
        rows = torch.arange(h.shape[0], device=h.device).unsqueeze(1)
        return self.final_norm(h[rows, positions.to(h.device)])

    def _capped(self, logits: Tensor) -> Tensor:
        if self.logit_softcap:
            return torch.tanh(logits / self.logit_softcap) * self.logit_softcap
        return logits


def _first_arg(fn: Callable[[Tensor], Tensor]) -> Callable:
    return lambda _module, args: (fn(args[0]), *args[1:])


class _Stop(Exception):
    """Raised by a hook to end a forward pass early."""


@contextmanager
def _only_at(mlp: nn.Module | None, positions: Tensor | None) -> Iterator[None]:
    """Run a position-wise module at `positions` only; its output elsewhere is zero."""
    if mlp is None or positions is None:
        yield
        return
    rows = torch.arange(positions.shape[0], device=positions.device).unsqueeze(1)
    shape: list = []

    def gather(_module, args):
        shape[:] = args[0].shape
        return (args[0][rows, positions], *args[1:])

    def scatter(_module, _args, output):
        full = output.new_zeros(*shape[:-1], output.shape[-1])
        full[rows, positions] = output
        return full

    handles = [mlp.register_forward_pre_hook(gather), mlp.register_forward_hook(scatter)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _hidden(output: Any) -> Tensor:
    return output[0] if isinstance(output, (tuple, list)) else output
