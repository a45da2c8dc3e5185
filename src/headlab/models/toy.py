"""A small transformer trained from scratch, in one file (after nanoGPT).

Attention goes through `headlab_attention`, so toy models expose the same head sites as HF models.
Checkpoints are safetensors plus a JSON config; nothing is unpickled.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import cast

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from ..errors import HeadlabError
from .hooked import HookedModel
from .sites import HeadSites, headlab_attention, prefix_length

WEIGHTS = "model.safetensors"
CONFIG = "config.json"


@dataclass
class ToyConfig:
    vocab_size: int
    n_ctx: int = 64
    n_layers: int = 1
    n_heads: int = 4
    d_model: int = 64
    d_head: int = 16
    d_mlp: int = 0  # 0: attention-only
    pos_emb: str = "learned"  # learned | sinusoidal | rotary | none
    layer_norm: bool = True


def _rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class ToyAttention(nn.Module):
    # buffers (register_buffer): declared for the type checker
    mask: Tensor
    cos: Tensor
    sin: Tensor

    def __init__(self, cfg: ToyConfig, layer: int):
        super().__init__()
        self.cfg, self.layer_idx = cfg, layer
        inner = cfg.n_heads * cfg.d_head
        self.q = nn.Linear(cfg.d_model, inner)
        self.k = nn.Linear(cfg.d_model, inner)
        self.v = nn.Linear(cfg.d_model, inner)
        self.o = nn.Linear(inner, cfg.d_model)
        mask = torch.full((cfg.n_ctx, cfg.n_ctx), float("-inf")).triu(1)
        self.register_buffer("mask", mask, persistent=False)
        if cfg.pos_emb == "rotary":
            inv = 1.0 / (10000 ** (torch.arange(0, cfg.d_head, 2).float() / cfg.d_head))
            angles = torch.outer(torch.arange(cfg.n_ctx).float(), inv)
            self.register_buffer("cos", torch.cat((angles, angles), -1).cos(), persistent=False)
            self.register_buffer("sin", torch.cat((angles, angles), -1).sin(), persistent=False)

    def forward(self, x: Tensor) -> Tensor:
        b, t, _ = x.shape
        split = lambda y: y.view(b, t, self.cfg.n_heads, self.cfg.d_head).transpose(1, 2)  # noqa: E731
        q, k, v = split(self.q(x)), split(self.k(x)), split(self.v(x))
        start = prefix_length(self)  # x holds positions start.. (HeadSites.prefixed)
        if self.cfg.pos_emb == "rotary":
            cos, sin = self.cos[start : start + t], self.sin[start : start + t]
            q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        mask = self.mask[start : start + t, : start + t]
        z, _ = headlab_attention(self, q, k, v, mask, scaling=self.cfg.d_head**-0.5)
        return self.o(z.reshape(b, t, -1))


class ToyBlock(nn.Module):
    def __init__(self, cfg: ToyConfig, layer: int):
        super().__init__()
        norm = (lambda: nn.LayerNorm(cfg.d_model)) if cfg.layer_norm else nn.Identity
        self.ln1, self.attn = norm(), ToyAttention(cfg, layer)
        self.mlp = None
        if cfg.d_mlp:
            self.ln2 = norm()
            self.mlp = nn.Sequential(nn.Linear(cfg.d_model, cfg.d_mlp), nn.GELU(), nn.Linear(cfg.d_mlp, cfg.d_model))

    def forward(self, h: Tensor) -> Tensor:
        h = h + self.attn(self.ln1(h))
        if self.mlp is not None:
            h = h + self.mlp(self.ln2(h))
        return h


class ToyTransformer(nn.Module):
    pos_table: Tensor  # a buffer (register_buffer), with sinusoidal positions only

    def __init__(self, cfg: ToyConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        if cfg.pos_emb == "learned":
            self.pos = nn.Embedding(cfg.n_ctx, cfg.d_model)
        elif cfg.pos_emb == "sinusoidal":
            self.register_buffer("pos_table", _sinusoid(cfg.n_ctx, cfg.d_model), persistent=False)
        self.blocks = nn.ModuleList(ToyBlock(cfg, i) for i in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model) if cfg.layer_norm else nn.Identity()
        self.unembed = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.apply(_init)

    def embed_tokens(self, input_ids: Tensor) -> Tensor:
        h = self.embed(input_ids)
        t = input_ids.shape[1]
        if self.cfg.pos_emb == "learned":
            h = h + self.pos.weight[:t]
        elif self.cfg.pos_emb == "sinusoidal":
            h = h + self.pos_table[:t]
        return h

    def forward(self, input_ids: Tensor) -> Tensor:
        if input_ids.shape[1] > self.cfg.n_ctx:
            raise HeadlabError(f"sequence of {input_ids.shape[1]} tokens exceeds the model's n_ctx={self.cfg.n_ctx}")
        h = self.embed_tokens(input_ids)
        for block in self.blocks:
            h = block(h)
        return self.unembed(self.ln_f(h))


def _sinusoid(n: int, d: int) -> Tensor:
    pos = torch.arange(n).float().unsqueeze(1)
    div = torch.exp(torch.arange(0, d, 2).float() * (-math.log(10000.0) / d))
    table = torch.zeros(n, d)
    table[:, 0::2], table[:, 1::2] = torch.sin(pos * div), torch.cos(pos * div)
    return table


def _init(m: nn.Module) -> None:
    if isinstance(m, nn.Linear):
        nn.init.normal_(m.weight, std=0.02)
        if m.bias is not None:
            nn.init.zeros_(m.bias)
    elif isinstance(m, nn.Embedding):
        nn.init.normal_(m.weight, std=0.02)


def hooked_toy(model: ToyTransformer, name: str) -> HookedModel:
    cfg = model.cfg
    blocks = cast(list[ToyBlock], list(model.blocks))  # nn.ModuleList is not generic

    def w_o(layer: int) -> Tensor:
        # nn.Linear stores [d_model, heads*d_head]; head h reads columns h*d_head:(h+1)*d_head
        return blocks[layer].attn.o.weight.T.reshape(cfg.n_heads, cfg.d_head, cfg.d_model)

    def w_qkv(layer: int) -> tuple[Tensor, Tensor, Tensor]:
        attn = blocks[layer].attn  # nn.Linear [heads * d_head, d_model] each
        q, k, v = (p.weight.unflatten(0, (cfg.n_heads, cfg.d_head)).transpose(1, 2) for p in (attn.q, attn.k, attn.v))
        return q, k, v

    attns: list[nn.Module] = [b.attn for b in blocks]
    outs: list[nn.Module] = [b.attn.o for b in blocks]

    def qkv_split(outs: list[Tensor]) -> tuple[Tensor, Tensor, Tensor]:
        q, k, v = (t.unflatten(-1, (cfg.n_heads, cfg.d_head)) for t in outs)
        return q, k, v

    projs: list[list[nn.Module]] = [[b.attn.q, b.attn.k, b.attn.v] for b in blocks]
    sites = HeadSites(
        attns,
        w_o,
        cfg.n_heads,
        cfg.n_heads,
        cfg.d_head,
        cfg.d_model,
        w_qkv,
        outs,
        returns_pattern=False,
        qkv_projs=projs,
        qkv_split=qkv_split,
    )
    return HookedModel(
        name=name,
        module=model,
        sites=sites,
        blocks=list(blocks),
        final_norm=model.ln_f,
        unembed=model.unembed,
        call=lambda m, inputs: m(inputs["input_ids"]),
        family="toy",
        mlps=[b.mlp for b in blocks],
        width=cfg.d_mlp,
        down_projs=[None if b.mlp is None else b.mlp[2] for b in blocks],  # Linear(d_mlp, d_model)
        attn_inputs=[b.ln1 for b in blocks],
        mlp_inputs=[b.ln2 if b.mlp is not None else None for b in blocks],
        runs_suffixes=True,  # its attention reads where a suffix starts from HeadSites (prefix_length)
    )


def save_toy(model: ToyTransformer, directory: Path, extra: dict | None = None) -> None:
    from ..io import atomic_write_bytes

    directory.mkdir(parents=True, exist_ok=True)
    tmp = directory / (WEIGHTS + ".tmp")
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(tmp))
    tmp.replace(directory / WEIGHTS)
    meta = {"toy_config": asdict(model.cfg), **(extra or {})}
    atomic_write_bytes(directory / CONFIG, json.dumps(meta, indent=2).encode())


def load_toy(directory: Path) -> tuple[ToyTransformer, dict]:
    directory = Path(directory)
    try:
        meta = json.loads((directory / CONFIG).read_text())
        model = ToyTransformer(ToyConfig(**meta["toy_config"]))
        state = load_file(str(directory / WEIGHTS))
        model.load_state_dict(state)
    except FileNotFoundError as e:
        raise HeadlabError(f"no toy checkpoint in {directory}: {Path(e.filename).name} is missing") from e
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise HeadlabError(f"corrupt checkpoint config {directory / CONFIG}: {e}") from e
    except (SafetensorError, RuntimeError, OSError) as e:
        raise HeadlabError(f"corrupt checkpoint weights {directory / WEIGHTS}: {str(e).splitlines()[0]}") from e
    model.eval()
    return model, meta
