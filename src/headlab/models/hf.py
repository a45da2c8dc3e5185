"""Hugging Face causal LMs, by hub name or local path.

HF models compute attention through `headlab_attention` (hf_attention), registered in transformers'
attention interface as "headlab"; the only per-family knowledge is a model_type's row of FAMILIES (families.py).
"""

from __future__ import annotations

import logging
import shutil
import tempfile
import weakref
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import Tensor, nn

from ..errors import HeadlabError, UsageError
from ..locations import cache_dir
from .families import FAMILIES, Family, attribute, family_of
from .hooked import HookedModel, torch_dtype
from .sites import HeadSites, headlab_attention

if TYPE_CHECKING:
    from transformers import PreTrainedModel

ATTN_IMPLEMENTATION = "headlab"


@dataclass(frozen=True)
class Pretrained:
    """Where from_pretrained found a model: enough to load another copy of it."""

    path: str
    revision: str | None = None
    trust_remote_code: bool = False

    def load(self, attn_implementation: str | None, dtype: torch.dtype, **placement: Any) -> PreTrainedModel:
        """attn_implementation None: the model's own default (sdpa where transformers has it);
        `placement`: from_pretrained's device_map (and offload_folder) for a model spread over devices."""
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(
            self.path,
            revision=self.revision,
            trust_remote_code=self.trust_remote_code,
            attn_implementation=attn_implementation,
            dtype=dtype,
            **placement,
        )


def register_attention() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, hf_attention)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, bool_mask)


def bool_mask(*args: Any, **kwargs: Any) -> Tensor | None:
    """transformers' sdpa mask, True where a key takes part, always made (headlab's suffix runs slice its
    rows): a byte a query and key where the eager mask's float takes four (4 GB at 32K tokens, per layer type);
    headlab's attention fills the hidden scores as the eager path does (models/sites.py)."""
    from transformers.masking_utils import sdpa_mask

    kwargs.pop("dtype", None)
    kwargs["allow_is_causal_skip"] = False
    return sdpa_mask(*args, **kwargs)


def hf_attention(module: nn.Module, *args: Any, **kwargs: Any) -> tuple[Tensor, Tensor | None]:
    """headlab_attention, told to return the pattern where the caller asked for attentions: Llama's
    attention gets output_attentions among its kwargs, GPT-2's model drops the flag and collects each
    attention's weights with a forward hook, active while transformers' output collector holds them."""
    wanted = bool(kwargs.pop("output_attentions", False)) or _collecting_attentions()
    return headlab_attention(module, *args, output_attentions=wanted, **kwargs)


def _collecting_attentions() -> bool:
    try:  # transformers' own record of what a forward with output_attentions=True collects
        from transformers.utils.output_capturing import _active_collector

        collected = _active_collector.get()
    except (ImportError, LookupError):
        return False
    return isinstance(collected, dict) and "attentions" in collected


def _find(root: nn.Module, dotted: str | None) -> nn.Module | None:
    """Like attribute, but None when a block lacks the module (a layer without an MLP) or its family
    names none (a norm OLMo 2 does not have)."""
    if dotted is None:
        return None
    try:
        return attribute(root, dotted)
    except AttributeError:
        return None


def load_hf(
    path: str,
    name: str | None = None,
    tokenizer: str | None = None,
    revision: str | None = None,
    trust_remote_code: bool = False,
    dtype: str = "float32",
    need_tokenizer: bool = True,
    device_map: str | dict | None = None,
    offload_folder: str | None = None,
    layers_on_disk: int = 0,
) -> HookedModel:
    """`device_map` ("auto", or accelerate's dict of module -> device, "disk" with `offload_folder`):
    the model spread over devices, each layer's caches then on its layer's device. `layers_on_disk`: the
    last blocks' weights on disk (disk_placement), in a folder of the per-user cache removed with the model."""
    from transformers import AutoConfig
    from transformers.utils import logging as hf_logging

    register_attention()
    hf_logging.disable_progress_bar()  # a weight-loading bar per model would bury headlab's one-line errors
    # the hub client logs every retry as a warning; the failure is reported once, below
    logging.getLogger("huggingface_hub").setLevel(logging.ERROR)
    where = f"local directory {path}" if Path(path).exists() else f"hub model '{path}'"
    if not Path(path).exists() and (path.startswith((".", "/", "~")) or path.count("/") > 1):
        raise HeadlabError(f"cannot load local directory {path}: it does not exist (and it is no hub id)")
    try:
        config = AutoConfig.from_pretrained(path, revision=revision, trust_remote_code=trust_remote_code)
    except Exception as e:  # transformers raises OSError, ValueError or hub errors depending on the cause
        raise HeadlabError(f"cannot load {where}: {_first_line(e)}") from e
    family = family_of(config)
    if family is None:
        raise HeadlabError(
            f"unsupported architecture '{config.model_type}' ({where}); supported: {', '.join(sorted(FAMILIES))}"
        )
    source = Pretrained(path, revision, trust_remote_code)
    made = None  # an offload folder made here: removed with the model (one the caller names is theirs)
    if layers_on_disk and not device_map:
        if offload_folder is None:
            cache_dir().mkdir(parents=True, exist_ok=True)
            offload_folder = made = tempfile.mkdtemp(prefix="offload-", dir=cache_dir())
        device_map = disk_placement(config, family, layers_on_disk)
    placement = {"device_map": device_map, "offload_folder": offload_folder} if device_map else {}
    weights_dtype = torch_dtype(dtype)
    try:
        model = source.load(ATTN_IMPLEMENTATION, weights_dtype, **placement)
    except Exception as e:
        raise HeadlabError(f"cannot load weights of {where}: {_first_line(e)}") from e
    model.eval()
    tok = None
    if need_tokenizer or tokenizer:
        tok = _tokenizer(model, tokenizer or path, None if tokenizer else revision, where)
    hooked = hook_hf(model, name or path, family, tok)
    if tok is None and Path(path).is_dir():  # its own tokenizer, where usable: a task asked for later needs it
        hooked.tokenizer_from(lambda: _usable_tokenizer(model, path, revision, where))
    hooked.source = source
    if made is not None:
        weakref.finalize(hooked, shutil.rmtree, made, True)  # the copies go with the model
    return hooked


def held(module: nn.Module, read: Callable[[nn.Module], tuple[Tensor, ...]]) -> tuple[Tensor, ...]:
    """read(module): its weights as tensors; where accelerate's offload keeps them on disk (model.layers_on_disk),
    loaded for the read and copied out of it."""
    from accelerate.utils import align_module_device, has_offloaded_params

    offloaded = [m for m in module.modules() if has_offloaded_params(m)]
    if not offloaded:
        return read(module)
    with ExitStack() as stack:
        for m in offloaded:
            stack.enter_context(align_module_device(m))
        return tuple(t.detach().clone() for t in read(module))


def disk_placement(config: Any, family: Family, layers_on_disk: int) -> dict[str, str]:
    """from_pretrained's device_map with the last `layers_on_disk` blocks on "disk" and everything else on
    the CPU, read off the model built on the meta device."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        empty = AutoModelForCausalLM.from_config(config)
    blocks = family.blocks
    n = len(attribute(empty, blocks))
    if not 0 < layers_on_disk <= n:
        raise UsageError(f"model.layers_on_disk={layers_on_disk}: this model has {n} blocks")
    placement = {name: "cpu" for name, _ in empty.named_modules() if name and "." not in name}
    parents = blocks.split(".")
    for depth in range(1, len(parents)):  # the blocks' parents give way to their children
        parent = ".".join(parents[:depth])
        placement.pop(parent, None)
        child = empty.get_submodule(parent)
        placement |= {f"{parent}.{name}": "cpu" for name, _ in child.named_children()}
    placement.pop(blocks, None)
    placement |= {f"{blocks}.{i}": "disk" if i >= n - layers_on_disk else "cpu" for i in range(n)}
    return placement


def _usable_tokenizer(model: PreTrainedModel, path: str, revision: str | None, where: str) -> Any:
    try:
        return _tokenizer(model, path, revision, where)
    except HeadlabError:
        return None


def hook_hf(model: PreTrainedModel, name: str, family: Family, tokenizer: Any = None) -> HookedModel:
    cfg = model.config
    _fuse_activations(model)
    n_heads = cfg.num_attention_heads
    n_kv = getattr(cfg, "num_key_value_heads", None) or n_heads
    d_head = getattr(cfg, "head_dim", None) or cfg.hidden_size // n_heads
    blocks = list(attribute(model, family.blocks))
    attns = [attribute(b, family.attn) for b in blocks]
    outs = [attribute(a, family.out_proj) for a in attns]

    def w_o(layer: int) -> Tensor:
        weight = held(outs[layer], lambda m: (cast(Tensor, m.weight),))[0]
        w_in_out = weight if family.conv1d else weight.T
        return w_in_out.reshape(n_heads, d_head, -1)

    def w_qkv(layer: int) -> tuple[Tensor, Tensor, Tensor]:
        return held(attns[layer], lambda m: family.qkv(m, n_heads, n_kv, d_head))  # type: ignore[return-value]

    def qkv_split(outs: list[Tensor]) -> tuple[Tensor, Tensor, Tensor]:
        return family.qkv_split(outs, n_heads, n_kv, d_head)

    projs = [[attribute(a, name) for name in family.qkv_projs] for a in attns]
    sites = HeadSites(
        attns,
        w_o,
        n_heads,
        n_kv,
        d_head,
        cfg.hidden_size,
        w_qkv,
        out_projs=outs,
        qkv_projs=projs,
        qkv_split=qkv_split,
        attn_softcap=getattr(cfg, family.softcaps[0], None) if family.softcaps else None,
    )
    post = family.post_norms
    return HookedModel(
        name=name,
        module=model,
        sites=sites,
        blocks=blocks,
        final_norm=attribute(model, family.final_norm),
        unembed=model.get_output_embeddings(),
        call=_call_hf,
        family=cfg.model_type,
        tokenizer=tokenizer,
        logit_softcap=getattr(cfg, family.softcaps[1], None) if family.softcaps else None,
        mlps=[getattr(b, family.mlp, None) for b in blocks],
        width=getattr(cfg, "intermediate_size", None) or getattr(cfg, "n_inner", None) or 4 * cfg.hidden_size,
        down_projs=[_find(b, family.down_proj) for b in blocks],
        attn_inputs=[_find(b, family.attn_norm) for b in blocks],
        mlp_inputs=[_find(b, family.mlp_norm) for b in blocks],
        parallel=bool(getattr(cfg, "use_parallel_residual", False)),
        runs_suffixes=family.suffix_runs,
        post_norms=None
        if post is None
        else ([attribute(b, post[0]) for b in blocks], [attribute(b, post[1]) for b in blocks]),
        qk_norms=None if family.qk_norms is None else _qk_norms(attns, family.qk_norms),
        norm_offset=family.norm_offset,
        edges_refused=family.edges_refused,
        # transformers' attention modules keep their scale (GPT-2's with its per-layer factor)
        attn_scales=[float(getattr(a, "scaling", d_head**-0.5)) for a in attns],
    )


def _qk_norms(attns: list[nn.Module], names: tuple[str, str]) -> tuple[list[nn.Module | None], list[nn.Module | None]]:
    """Each attention's query and key norms (a layer may have none: None)."""
    return [getattr(a, names[0], None) for a in attns], [getattr(a, names[1], None) for a in attns]


def _fuse_activations(model: nn.Module) -> None:
    """gelu_new (GPT-2, GPT-J, ...) written out is five elementwise passes over the MLP's widest
    activation, 13% of a GPT-2 sweep on CPU; transformers' GELUTanh is the same function (to 5e-7) in
    one fused kernel."""
    from transformers.activations import GELUTanh, NewGELUActivation

    for parent in list(model.modules()):
        for child_name, child in parent.named_children():
            if type(child) is NewGELUActivation:
                setattr(parent, child_name, GELUTanh())


def _tokenizer(model: PreTrainedModel, source: str, revision: str | None, where: str) -> Any:
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(source, revision=revision)
    except Exception as e:
        raise HeadlabError(f"cannot load a tokenizer for {where} (set model.tokenizer=...): {_first_line(e)}") from e
    embedding = model.get_input_embeddings().weight
    assert isinstance(embedding, Tensor)  # a Parameter; nn.Module's __getattr__ is typed Tensor | Module
    rows = embedding.shape[0]
    # transformers builds an empty tokenizer from the config alone when a directory has none
    if len(tok) <= 1 or len(tok) > rows:
        raise HeadlabError(
            f"no usable tokenizer for {where}: it has {len(tok)} tokens, the model embeds {rows} "
            "(set model.tokenizer=<name or dir>)"
        )
    return tok


def _call_hf(module: nn.Module, inputs: dict[str, Tensor]) -> Tensor:
    return module(**inputs, use_cache=False).logits


def _first_line(e: BaseException) -> str:
    text = str(e).strip() or type(e).__name__
    return text.splitlines()[0][:300]
