"""TransformerLens configs for the benchmarks' Hugging Face models, by hand (TransformerLens does not list
SmolLM2 or random-weight models by name): shared by bench_models and by peer_auto_circuit, which runs in
auto-circuit's own venv (transformer-lens 2.x, transformers 4.x), so this module imports nothing of headlab."""

from __future__ import annotations

from typing import Any

import torch


def tl_gpt2_config(c: Any, **extra: Any):
    from transformer_lens import HookedTransformerConfig

    return HookedTransformerConfig(
        n_layers=c.n_layer,
        d_model=c.n_embd,
        d_head=c.n_embd // c.n_head,
        n_heads=c.n_head,
        d_mlp=4 * c.n_embd,
        d_vocab=c.vocab_size,
        n_ctx=c.n_positions,
        act_fn="gelu_new",
        normalization_type="LN",
        eps=c.layer_norm_epsilon,
        default_prepend_bos=False,
        **extra,
    )


def tl_llama_config(c: Any, dtype: torch.dtype, n_ctx: int | None = None, **extra: Any):
    """TransformerLens's own mapping of a LlamaForCausalLM config (loading_from_pretrained), by hand. `n_ctx`
    (default: the model's max_position_embeddings) sizes the causal mask TransformerLens keeps per layer
    (n_ctx x n_ctx): SmolLM2's 8192 would be 2 GB over 30 layers, so the benchmarks pass what they need."""
    from transformer_lens import HookedTransformerConfig

    rope = getattr(c, "rope_parameters", None) or {}
    return HookedTransformerConfig(
        n_layers=c.num_hidden_layers,
        d_model=c.hidden_size,
        d_head=c.head_dim,
        n_heads=c.num_attention_heads,
        d_mlp=c.intermediate_size,
        d_vocab=c.vocab_size,
        n_ctx=n_ctx or c.max_position_embeddings,
        eps=c.rms_norm_eps,
        act_fn=c.hidden_act,
        n_key_value_heads=c.num_key_value_heads if c.num_key_value_heads != c.num_attention_heads else None,
        normalization_type="RMS",
        positional_embedding_type="rotary",
        rotary_adjacent_pairs=False,
        rotary_dim=c.head_dim,
        rotary_base=rope.get("rope_theta", getattr(c, "rope_theta", 10000.0)),
        final_rms=True,
        gated_mlp=True,
        original_architecture="LlamaForCausalLM",
        default_prepend_bos=False,
        dtype=dtype,
        **extra,
    )
