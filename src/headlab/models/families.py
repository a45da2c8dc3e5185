"""What headlab knows of each Hugging Face model family, one `Family` row per transformers `model_type`.

Attention itself needs no row: every family computes it through headlab's attention function (sites.py).
A row says where the modules around it are and every way families differ that headlab must know: how
q, k and v are stored, the norms (their gain offset, the norms on each component's output, per-head q/k
norms), the soft-caps, what edges it admits, and whether a block can run on a suffix of positions. The row
is resolved once, when the model is hooked (hf.hook_hf): no module outside models/ asks a family's name.
A random-weight model of every row is held to its row (tests/test_families.py), to the checks of `headlab
check` (tests/test_check.py) and, where it claims suffix runs, to full passes (tests/test_prefix.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from torch import Tensor, nn

QKV = tuple[Tensor, Tensor, Tensor]


def attribute(root: nn.Module, dotted: str) -> Any:
    """root.a.b.c for dotted "a.b.c": a module or a weight."""
    for part in dotted.split("."):
        root = getattr(root, part)
    return root


def separate_qkv(attn: nn.Module, n_heads: int, n_kv: int, d_head: int) -> QKV:
    """q_proj, k_proj, v_proj: nn.Linear [heads * d_head, d_model] each (Llama and most later families)."""
    q, k, v = (
        attribute(attn, f"{x}_proj.weight").unflatten(0, (n, d_head)) for x, n in zip("qkv", (n_heads, n_kv, n_kv))
    )
    return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)


def conv1d_qkv(attn: nn.Module, n_heads: int, n_kv: int, d_head: int) -> QKV:
    """c_attn: GPT-2's Conv1D [d_model, 3 * d_model], q, k and v side by side."""
    per_head = (
        attribute(attn, "c_attn.weight").unflatten(1, (3, n_heads, d_head)).transpose(0, 2)
    )  # [head, 3, d_model, d_head]
    return per_head[:, 0], per_head[:, 1], per_head[:, 2]


def interleaved_qkv(attn: nn.Module, n_heads: int, n_kv: int, d_head: int) -> QKV:
    """query_key_value: nn.Linear [3 * d_model, d_model], q, k and v interleaved per head (GPT-NeoX)."""
    per_head = (
        attribute(attn, "query_key_value.weight").unflatten(0, (n_heads, 3, d_head)).transpose(2, 3)
    )  # [head, 3, d_model, d_head]
    return per_head[:, 0], per_head[:, 1], per_head[:, 2]


# How the q, k and v projections' outputs [..., features] split into heads: (q [..., head, d_head], k and v
# [..., kv_head, d_head]), the layouts the three weight readers above read (edges/eap.py cuts
# each projection's output gradient into per-head parts with them)
def separate_split(outs: list[Tensor], n_heads: int, n_kv: int, d_head: int) -> QKV:
    q, k, v = outs
    return q.unflatten(-1, (n_heads, d_head)), k.unflatten(-1, (n_kv, d_head)), v.unflatten(-1, (n_kv, d_head))


def conv1d_split(outs: list[Tensor], n_heads: int, n_kv: int, d_head: int) -> QKV:
    per_head = outs[0].unflatten(-1, (3, n_heads, d_head))
    return per_head[..., 0, :, :], per_head[..., 1, :, :], per_head[..., 2, :, :]


def interleaved_split(outs: list[Tensor], n_heads: int, n_kv: int, d_head: int) -> QKV:
    per_head = outs[0].unflatten(-1, (n_heads, 3, d_head))
    return per_head[..., 0, :], per_head[..., 1, :], per_head[..., 2, :]


@dataclass(frozen=True)
class Family:
    """Module paths are dotted attribute names: `blocks` and `final_norm` from the model, the rest from
    one block (`out_proj` from the attention module)."""

    blocks: str  # ModuleList of decoder blocks
    attn: str  # attention module inside a block
    out_proj: str  # output projection inside the attention module (its input is z)
    final_norm: str
    # W_Q [head, d_model, d_head], W_K, W_V [kv_head, d_model, d_head] of one attention module
    qkv: Callable[[nn.Module, int, int, int], QKV] = separate_qkv
    # the modules (in the attention module) whose outputs hold q, k and v before any per-head operation
    # (rotary, q/k norms), and how those outputs split into heads: the layout `qkv` reads
    qkv_projs: tuple[str, ...] = ("q_proj", "k_proj", "v_proj")
    qkv_split: Callable[[list[Tensor], int, int, int], QKV] = separate_split
    conv1d: bool = False  # out_proj is GPT-2's Conv1D, weight [in, out], not nn.Linear's [out, in]
    mlp: str = "mlp"  # position-wise feed-forward inside a block
    down_proj: str = "mlp.down_proj"  # the MLP's output projection (its input is "neurons")
    attn_norm: str | None = "input_layernorm"  # the norm the attention reads the residual stream through
    mlp_norm: str | None = "post_attention_layernorm"  # the same for the MLP; None: the block has none
    # the norms on the attention's and the MLP's outputs before the residual sum (block attributes): the
    # residual stream is then no sum of the components' outputs, and edges between them (circuit=...)
    # follow a rule of edges/postnorm.py; None: a residual sum
    post_norms: tuple[str, str] | None = None
    # why headlab's edges are not defined on the family (refused in one line); None: they are
    edges_refused: str | None = None
    # the per-head query and key norms inside the attention module (QK-norm); None: none
    qk_norms: tuple[str, str] | None = None
    # its RMSNorms multiply by norm_offset + weight (Gemma's store the scale less one)
    norm_offset: float = 0.0
    # the config's soft-caps of the attention scores and of the logits (tanh(s / cap) * cap), by attribute
    softcaps: tuple[str, str] | None = None
    # the blocks take positions only through the arguments a Trace keeps (masks [batch, 1, query, key],
    # rotary tables [batch, pos, d], position ids), so a sweep may run them on a suffix of positions;
    # tests/test_prefix.py holds every row that says so to full passes. False for a family whose blocks
    # work out positions themselves: its sweeps then run every position
    suffix_runs: bool = True
    gated_mlp: bool = True  # the MLP has three projections (gate, up, down); GPT-2's and GPT-NeoX's have two


_LLAMA = Family("model.layers", "self_attn", "o_proj", "model.norm")
_QK_NORMS = ("q_norm", "k_norm")
_POST_NORMS = ("post_attention_layernorm", "post_feedforward_layernorm")
_SOFTCAPS = ("attn_logit_softcapping", "final_logit_softcapping")
# Gemma 2 and 3 norm each component's output and read the MLP through pre_feedforward_layernorm; Gemma 3
# norms each head's q and k
_GEMMA2 = Family(
    "model.layers",
    "self_attn",
    "o_proj",
    "model.norm",
    mlp_norm="pre_feedforward_layernorm",
    post_norms=_POST_NORMS,
    norm_offset=1.0,
    softcaps=_SOFTCAPS,
)

FAMILIES: dict[str, Family] = {
    "gpt2": Family(
        "transformer.h",
        "attn",
        "c_proj",
        "transformer.ln_f",
        qkv=conv1d_qkv,
        qkv_projs=("c_attn",),
        qkv_split=conv1d_split,
        conv1d=True,
        down_proj="mlp.c_proj",
        attn_norm="ln_1",
        mlp_norm="ln_2",
        gated_mlp=False,
    ),
    "gpt_neox": Family(
        "gpt_neox.layers",
        "attention",
        "dense",
        "gpt_neox.final_layer_norm",
        qkv=interleaved_qkv,
        qkv_projs=("query_key_value",),
        qkv_split=interleaved_split,
        down_proj="mlp.dense_4h_to_h",
        gated_mlp=False,
    ),
    "llama": _LLAMA,
    "qwen2": _LLAMA,
    "mistral": _LLAMA,
    "qwen3": replace(_LLAMA, qk_norms=_QK_NORMS),
    "gemma": replace(_LLAMA, norm_offset=1.0),
    "olmo": _LLAMA,
    "gemma2": _GEMMA2,
    "gemma3_text": replace(_GEMMA2, qk_norms=_QK_NORMS),
    # OLMo 2 norms only the components' outputs (post_attention_layernorm, post_feedforward_layernorm)
    "olmo2": Family(
        "model.layers",
        "self_attn",
        "o_proj",
        "model.norm",
        attn_norm=None,
        mlp_norm=None,
        post_norms=_POST_NORMS,
        qk_norms=_QK_NORMS,
        edges_refused="its attention reads the residual stream through no norm and its q/k norms span every "
        "head, so a head's query and key inputs are not its own",
    ),
}


def family_of(config: Any) -> Family | None:
    """A Hugging Face config's row (by its model_type); None for a family headlab does not know."""
    return FAMILIES.get(config.model_type)
