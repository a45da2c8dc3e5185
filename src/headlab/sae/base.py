"""The interface every SAE architecture implements (one file per architecture, after SAELens).

Parameters carry SAELens's names and shapes, so a state dict is an SAELens state dict:
  W_enc [d_in, d_sae], b_enc [d_sae], W_dec [d_sae, d_in], b_dec [d_in].
The encoder sees x - b_dec (SAELens: apply_b_dec_to_input). Inputs are hook_z flattened over heads:
[..., n_heads * d_head], head-major, as TransformerLens's `... n_heads d_head -> ... (n_heads d_head)`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from omegaconf import MISSING
from torch import Tensor, nn

from ..config_rules import BETA, COUNT, NATURAL, POSITIVE, SHARE, Each, Range, at_least, setting


@dataclass
class SaeConfig:
    """`headlab sae`: an SAE on one layer's per-head outputs z, concatenated over heads (hook_z)."""

    architecture: str = MISSING  # set by each architecture's options (registry.py)
    layer: int = setting(0, NATURAL)
    # one SAE per listed layer, in one run (None: sae.layer alone); -1 is the last layer, as Python counts
    layers: list[int] | None = setting(None, Each(Range(integer=True)))
    # experiment=attn_sae_smollm2 sizes them for smollm2 over data/alice.txt on 2 CPU cores
    expansion: int = setting(16, COUNT)  # latents per input dimension: d_sae = expansion * n_heads * d_head
    # fit on z scaled to a mean squared norm of d_in (SAELens's normalize_activations=
    # "expected_average_only_in"), so l1_coeff means the same on every model; the saved SAE takes raw z
    normalize: bool = False
    steps: int = setting(2000, COUNT)
    batch_size: int = setting(1024, COUNT)  # tokens per step
    lr: float = setting(1e-3, POSITIVE)
    warmup_steps: int = setting(100, NATURAL)
    beta1: float = setting(0.9, BETA)
    beta2: float = setting(0.999, BETA)
    # corpus: null = the task's prompts (task.n_prompts per pass, redrawn each pass); else a text file or
    # a directory of .txt / .jsonl ("text" field) files, cut into windows of context_size tokens
    corpus: str | None = None
    context_size: int = setting(64, at_least(2))
    model_batch: int = setting(64, COUNT)  # sequences per forward pass of the model
    buffer_tokens: int = setting(65_536, COUNT)  # shuffle buffer: activations mix across sequences before batching
    dead_window: int = setting(100_000, COUNT)  # tokens: a latent that did not fire on the last this many is dead
    checkpoint_every: int = setting(500, COUNT)
    eval_sequences: int = setting(256, COUNT)  # held-out sequences for the metrics, attribution and contexts
    top_contexts: int = setting(10, COUNT)  # top-activating contexts kept per feature
    context_window: int = setting(12, NATURAL)  # tokens shown before the activating one
    # features read per head for its roles, its top ones by decoder-norm share (Kissane et al. read 10)
    head_features: int = setting(10, COUNT)
    # the old rule's (polysemantic_dominated): a head dominates a feature with this share of its decoder norm
    dominance: float = setting(0.5, SHARE)


class SparseAutoencoder(nn.Module):
    architecture: ClassVar[str]  # headlab's name (sae=<name>)
    saelens_architecture: ClassVar[str]  # the architecture SAELens loads it as
    options: ClassVar[type] = SaeConfig  # its options (`sae.<option>`), a subclass adding its own

    @classmethod
    def build(cls, d_in: int, options: SaeConfig, seed: int = 0) -> SparseAutoencoder:
        """A fresh SAE on d_in inputs (d_sae = options.expansion * d_in) from its options."""
        return cls(d_in, options.expansion * d_in, seed)

    def __init__(self, d_in: int, d_sae: int, seed: int = 0):
        super().__init__()
        self.d_in, self.d_sae = d_in, d_sae
        gen = torch.Generator().manual_seed(seed)
        # decoder rows at unit norm, encoder its transpose: every latent starts as a matched filter
        w_dec = torch.randn(d_sae, d_in, generator=gen)
        w_dec /= w_dec.norm(dim=1, keepdim=True)
        self.W_dec = nn.Parameter(w_dec)
        # row-major, as a fresh [d_in, d_sae] tensor: a transposed clone would keep w_dec's strides, and
        # fused Adam copies a non-contiguous parameter in and out on every step
        self.W_enc = nn.Parameter(w_dec.t().contiguous())
        self.b_enc = nn.Parameter(torch.zeros(d_sae))
        self.b_dec = nn.Parameter(torch.zeros(d_in))

    # ------------------------------------------------------------------ the forward pass

    def pre_activation(self, x: Tensor) -> Tensor:
        """[..., d_in] -> [..., d_sae]: (x - b_dec) W_enc + b_enc."""
        return (x - self.b_dec) @ self.W_enc + self.b_enc

    def encode(self, x: Tensor) -> Tensor:
        raise NotImplementedError

    def decode(self, f: Tensor) -> Tensor:
        return f @ self.W_dec + self.b_dec

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """(reconstruction [..., d_in], feature activations [..., d_sae])."""
        f = self.encode(x)
        return self.decode(f), f

    def loss(self, x: Tensor, step: int) -> tuple[Tensor, dict[str, Tensor], Tensor]:
        """(training loss, its named parts, fires [d_sae]: on how many tokens each latent was active)
        on a batch [tokens, d_in]."""
        raise NotImplementedError

    # fit_loss's backward already leaves W_dec.grad without its part along each row (fit then skips
    # remove_parallel_grad)
    fit_loss_grad_tangent: ClassVar[bool] = False

    def fit_loss(self, x: Tensor, step: int) -> tuple[Tensor, dict[str, Tensor], Tensor]:
        """loss() as fit() takes it: the same value; its backward may also do remove_parallel_grad's work
        where an architecture can do it for less (fit_loss_grad_tangent)."""
        return self.loss(x, step)

    # ------------------------------------------------------------------ constraints kept during fitting

    @torch.no_grad()
    def normalize_decoder(self) -> None:
        self.W_dec.div_(self.W_dec.norm(dim=1, keepdim=True).clamp_min(1e-8))

    @torch.no_grad()
    def remove_parallel_grad(self) -> None:
        """Drop the part of each decoder row's gradient along the row: the step then moves the row
        on its unit sphere (to first order) instead of fighting the renormalisation."""
        if self.W_dec.grad is not None:
            # row-wise dots as a batched product: one pass, no [d_sae, d_in] temporary (sum of a product: two)
            parallel = torch.einsum("ij,ij->i", self.W_dec.grad, self.W_dec).unsqueeze(1)
            self.W_dec.grad.addcmul_(parallel, self.W_dec, value=-1)  # in place: no [d_sae, d_in] temporary

    @torch.no_grad()
    def fold_input_scale(self, scale: float) -> None:
        """Fitted on scale * x, made to take x itself: (s x - b_dec) W_enc = (x - b_dec / s)(s W_enc) and the
        reconstruction of x is (f W_dec + b_dec) / s. The same latents fire, as strongly; decoder rows
        end at norm 1 / s (SAELens reads free-norm rows)."""
        self.W_enc.mul_(scale)
        self.W_dec.div_(scale)
        self.b_dec.div_(scale)

    # ------------------------------------------------------------------ SAELens

    def saelens_fields(self) -> dict:
        """Architecture-specific fields of SAELens's cfg.json."""
        return {}
