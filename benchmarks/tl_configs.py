"""TransformerLens configs for the benchmarks' Hugging Face models, by hand where TransformerLens does not list
the model (SmolLM2, random weights), from TransformerLens's own table where it does (Gemma 3 270M): shared by
bench_models and by peer_auto_circuit, which runs in auto-circuit's own venv (transformer-lens 2.x, transformers
4.x), so this module imports nothing of headlab (tl_gemma3_config needs TransformerLens 3.x's table)."""

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


def tl_gemma3_config(c: Any, dtype: torch.dtype, n_ctx: int, **extra: Any):
    """TransformerLens 3.9's own config of google/gemma-3-270m (an official model: loading_from_pretrained's
    table, which reads nothing from the hub for it), checked against the HF config `c` of the weights in hand
    (a random-weight model of the same shape passes too). `n_ctx` sizes TransformerLens's masks and rotary
    tables; tokenizer_name is cleared, as the benchmarks give token ids and the hub cannot be reached."""
    from transformer_lens import HookedTransformerConfig
    from transformer_lens.loading_from_pretrained import get_pretrained_model_config

    cfg = get_pretrained_model_config("google/gemma-3-270m", dtype=dtype, n_ctx=n_ctx, default_prepend_bos=False)
    kinds = {"sliding_attention": "local", "full_attention": "global"}
    rope = getattr(c, "rope_parameters", None) or {}
    ours = dict(
        n_layers=c.num_hidden_layers,
        d_model=c.hidden_size,
        d_head=c.head_dim,
        n_heads=c.num_attention_heads,
        n_key_value_heads=c.num_key_value_heads,
        d_mlp=c.intermediate_size,
        d_vocab=c.vocab_size,
        window_size=c.sliding_window,
        attn_types=[kinds[kind] for kind in c.layer_types],
        act_fn=c.hidden_activation,
        rotary_base=rope.get("full_attention", {}).get("rope_theta", cfg.rotary_base),
        rotary_base_local=rope.get("sliding_attention", {}).get("rope_theta", cfg.rotary_base_local),
        attn_scale=c.query_pre_attn_scalar**0.5,
    )
    differ = {key: (getattr(cfg, key), value) for key, value in ours.items() if getattr(cfg, key) != value}
    if differ:
        raise ValueError(f"TransformerLens's gemma-3-270m config differs from the weights' (theirs, ours): {differ}")
    return HookedTransformerConfig.from_dict({**cfg.to_dict(), "tokenizer_name": None, **extra})
