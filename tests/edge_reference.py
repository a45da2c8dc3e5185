"""Slow, independent reference for the edge-level circuit tests (tests/test_edges.py).

A hand-built forward pass over the weights of an HF ``GPT2LMHeadModel`` or ``LlamaForCausalLM`` in which every
receiver reads its OWN private copy of the residual stream (as TransformerLens's ``use_split_qkv_input`` does), so
that one edge U->R can be patched or differentiated without touching any other receiver. Nothing here uses headlab.

Graph (EAP-IG / MIB convention):

* senders: ``input`` (token embedding, plus position embedding for GPT-2), then per layer l the heads ``a{l}.h{h}``
  (z_h @ W_O[h], without the output bias, which is a constant) and ``m{l}`` (the MLP output, biases included);
* receivers, per layer l: ``a{l}.h{h}<q>`` for every query head, then ``<k>`` for every key/value head, then ``<v>``
  for every key/value head (named ``a{l}.kv{j}<k>`` when the model has fewer kv heads than query heads, else
  ``a{l}.h{j}<k>``), then ``m{l}``; finally ``logits`` (the final residual, before the final norm). A model whose
  config says ``headlab_kv_edges = "ungrouped"`` has MIB's grouped-query graph instead: ``<k>`` and ``<v>`` for every
  query head (``a{l}.h{h}<k>``), each computed from that head's own copy with its kv head's weights;
* edges: every sender of layers < l feeds the attention receivers of layer l, ``m{l}`` also reads the heads of its
  own layer, ``logits`` reads every sender. Names are ``"{sender}->{receiver}"``.

Receivers' private inputs are the upstream sender outputs plus the constant biases (attention output biases) of the
layers before them. Norms, MLPs, the rotary embedding and the unembedding are the HF modules themselves (Llama's
RMSNorm, rotary and eager softmax round through float32 even in a float64 model; we do the same so the logits match).
Exact edge patching lets the patched receiver's change propagate through everything downstream of it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

Metric = Callable[[Tensor], Tensor]


def _shape(model) -> tuple[bool, int, int, int]:
    """(is_gpt2, n_layers, n_heads, n_kv_heads)."""
    cfg = model.config
    if cfg.model_type == "gpt2":
        return True, cfg.n_layer, cfg.n_head, cfg.n_head
    if cfg.model_type == "llama":
        n_kv = cfg.num_key_value_heads or cfg.num_attention_heads
        return False, cfg.num_hidden_layers, cfg.num_attention_heads, n_kv
    raise ValueError(f"edge_reference supports gpt2 and llama, not {cfg.model_type}")


def _ungrouped(model) -> bool:
    """Does each query head read a key and value input of its own (MIB's graph under GQA)?"""
    _, _, n_heads, n_kv = _shape(model)
    return n_kv < n_heads and getattr(model.config, "headlab_kv_edges", "grouped") == "ungrouped"


def _kv_reads(model) -> int:
    """Key (and value) receivers per layer."""
    _, _, n_heads, n_kv = _shape(model)
    return n_heads if _ungrouped(model) else n_kv


def _kv_name(model, l: int, j: int, letter: str) -> str:
    _, _, n_heads, n_kv = _shape(model)
    return f"a{l}.kv{j}<{letter}>" if n_kv < n_heads and not _ungrouped(model) else f"a{l}.h{j}<{letter}>"


def senders(model) -> list[str]:
    _, n_layers, n_heads, _ = _shape(model)
    out = ["input"]
    for l in range(n_layers):
        out += [f"a{l}.h{h}" for h in range(n_heads)] + [f"m{l}"]
    return out


def _attn_receivers(model, l: int) -> list[str]:
    _, _, n_heads, _ = _shape(model)
    qs = [f"a{l}.h{h}<q>" for h in range(n_heads)]
    return qs + [_kv_name(model, l, j, c) for c in "kv" for j in range(_kv_reads(model))]


def receivers(model) -> list[str]:
    _, n_layers, _, _ = _shape(model)
    out = []
    for l in range(n_layers):
        out += _attn_receivers(model, l) + [f"m{l}"]
    return out + ["logits"]


def _upstream(model, receiver: str) -> list[str]:
    """Senders read by one receiver, in sender order."""
    _, n_layers, n_heads, _ = _shape(model)
    all_senders = senders(model)
    if receiver == "logits":
        return all_senders
    if receiver not in receivers(model):
        raise KeyError(f"unknown receiver {receiver!r}")
    l = int(receiver[1:].split(".")[0])
    before = all_senders[: 1 + l * (n_heads + 1)]  # input and the senders of layers < l
    return before + [f"a{l}.h{h}" for h in range(n_heads)] if receiver.startswith("m") else before


def edges(model) -> list[str]:
    recv = receivers(model)
    ups = {r: set(_upstream(model, r)) for r in recv}
    return [f"{s}->{r}" for s in senders(model) for r in recv if s in ups[r]]


def _causal_softmax(scores: Tensor, fp32: bool) -> Tensor:
    n = scores.shape[-1]
    mask = torch.ones(n, n, dtype=torch.bool, device=scores.device).tril()
    scores = scores.masked_fill(~mask, float("-inf"))
    if fp32:  # as HF Llama's eager attention
        return torch.softmax(scores, dim=-1, dtype=torch.float32).to(scores.dtype)
    return torch.softmax(scores, dim=-1)


def _head(x: Tensor, weight: Tensor, bias: Tensor | None, i: int, hd: int) -> Tensor:
    """Head i's slice of a q/k/v projection (weight [n * hd, d_model], as nn.Linear) of x: [batch, pos, hd]."""
    rows = slice(i * hd, (i + 1) * hd)
    y = x @ weight[rows].T
    return y + bias[rows] if bias is not None else y


def split_forward(
    model,
    input_ids: Tensor,
    receiver_inputs: dict[str, Callable] | None = None,
    embed: Tensor | None = None,
    sender_outputs: dict[str, Tensor] | None = None,
    cut: dict[str, dict[str, Tensor]] | None = None,
) -> tuple[Tensor, dict]:
    """Logits [batch, pos, vocab] of the hand-built forward pass in which each receiver reads its own copy of the
    residual stream; receiver_inputs maps a receiver name to a callable(resid) -> new resid applied to that copy only;
    embed, where given, is the input sender's output in place of input_ids' embedding (EAP-IG's interpolation);
    sender_outputs, where given, replaces those senders' outputs (every later receiver reads the replacement).
    cut, where given, maps a receiver to {sender: the value it reads for that sender's output} (edges cut).
    Returns (logits, outputs) with outputs[sender] = that sender's output [batch, pos, d_model] in this run."""
    fixed = sender_outputs or {}
    gpt2, n_layers, n_heads, n_kv = _shape(model)
    receiver_inputs = receiver_inputs or {}
    unknown = set(receiver_inputs) - set(receivers(model))
    if unknown:
        raise KeyError(f"unknown receivers {sorted(unknown)}")
    batch, n_pos = input_ids.shape
    positions = torch.arange(n_pos, device=input_ids.device)[None].expand(batch, n_pos)
    core = model.transformer if gpt2 else model.model
    if embed is None:
        embed = core.wte(input_ids) + core.wpe(positions) if gpt2 else core.embed_tokens(input_ids)
    if not gpt2:
        cos, sin = core.rotary_emb(embed, positions)
    outputs: dict[str, Tensor] = {"input": fixed.get("input", embed)}
    const = torch.zeros_like(embed)  # attention output biases so far (not attributed to any sender)
    group, ungrouped = n_heads // n_kv, _ungrouped(model)  # query head h reads kv head h // group

    def read(receiver: str) -> Tensor:
        instead = (cut or {}).get(receiver, {})
        resid = const + sum(instead.get(s, outputs[s]) for s in _upstream(model, receiver))
        fn = receiver_inputs.get(receiver)
        return fn(resid) if fn is not None else resid

    for l in range(n_layers):
        block = core.h[l] if gpt2 else core.layers[l]
        norm1, norm2 = (block.ln_1, block.ln_2) if gpt2 else (block.input_layernorm, block.post_attention_layernorm)
        if gpt2:
            w, b, d = block.attn.c_attn.weight, block.attn.c_attn.bias, model.config.n_embd
            hd = d // n_heads
            wq, wk, wv = (w[:, i * d : (i + 1) * d].T for i in range(3))  # [out, in] like nn.Linear
            bq, bk, bv = (b[i * d : (i + 1) * d] for i in range(3))
            w_o, b_o = block.attn.c_proj.weight.T, block.attn.c_proj.bias  # [d_model, n_heads * hd]
            scale = hd**-0.5 if model.config.scale_attn_weights else 1.0
            if model.config.scale_attn_by_inverse_layer_idx:
                scale /= l + 1
        else:
            attn = block.self_attn
            hd = getattr(model.config, "head_dim", None) or model.config.hidden_size // n_heads
            wq, wk, wv, w_o = attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight, attn.o_proj.weight
            bq, bk, bv, b_o = attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias, attn.o_proj.bias
            scale = hd**-0.5

        q = torch.stack([_head(norm1(read(f"a{l}.h{h}<q>")), wq, bq, h, hd) for h in range(n_heads)], dim=1)
        # receiver j's weights: kv head j, or (ungrouped) query head j's kv head, j // group
        step = group if ungrouped else 1
        reads = range(_kv_reads(model))
        k = torch.stack([_head(norm1(read(_kv_name(model, l, j, "k"))), wk, bk, j // step, hd) for j in reads], 1)
        v = torch.stack([_head(norm1(read(_kv_name(model, l, j, "v"))), wv, bv, j // step, hd) for j in reads], 1)
        if not gpt2:
            q, k = apply_rotary_pos_emb(q, k, cos, sin)
        for h in range(n_heads):
            kv = h if ungrouped else h // group  # the k and v query head h reads
            pattern = _causal_softmax(q[:, h] @ k[:, kv].transpose(-1, -2) * scale, fp32=not gpt2)
            z = pattern @ v[:, kv]  # [batch, pos, hd]
            outputs[f"a{l}.h{h}"] = fixed.get(f"a{l}.h{h}", z @ w_o[:, h * hd : (h + 1) * hd].T)
        if b_o is not None:
            const = const + b_o
        outputs[f"m{l}"] = fixed.get(f"m{l}", block.mlp(norm2(read(f"m{l}"))))
    final_norm = core.ln_f if gpt2 else core.norm
    return model.lm_head(final_norm(read("logits"))), outputs


def _split_edge(model, edge: str) -> tuple[str, str]:
    sender, _, receiver = edge.partition("->")
    if sender not in _upstream(model, receiver):
        raise KeyError(f"{edge!r} is not an edge of this model")
    return sender, receiver


def _sender_diffs(model, clean_ids: Tensor, corrupt_ids: Tensor) -> dict[str, Tensor]:
    with torch.no_grad():
        _, clean = split_forward(model, clean_ids)
        _, corrupt = split_forward(model, corrupt_ids)
    return {s: corrupt[s] - clean[s] for s in clean}


def eap_scores(model, clean_ids: Tensor, corrupt_ids: Tensor, metric: Metric) -> dict[str, float]:
    """For every edge U->R: mean over prompts of sum over positions and d_model of
    (out_U(corrupt) - out_U(clean)) * d metric / d input_R, the gradient at R's private input in the clean run."""
    diffs = _sender_diffs(model, clean_ids, corrupt_ids)
    zero = diffs["input"]
    taps = {r: torch.zeros_like(zero, requires_grad=True) for r in receivers(model)}
    with torch.enable_grad():
        logits, _ = split_forward(model, clean_ids, {r: (lambda x, t=t: x + t) for r, t in taps.items()})
        grads = torch.autograd.grad(metric(logits).mean(), list(taps.values()))
    grad = dict(zip(taps, grads))
    out = {}
    for edge in edges(model):
        sender, receiver = edge.split("->")
        out[edge] = float((diffs[sender] * grad[receiver]).sum())
    return out


def eap_ig_scores(
    model,
    clean_ids: Tensor,
    corrupt_ids: Tensor,
    metric: Metric,
    steps: int,
    steps_from: int,
    forbidden: frozenset[str] = frozenset(),
) -> dict[str, float]:
    """EAP-IG, summed by hand: as eap_scores, with the gradient averaged over `steps` runs of the clean prompts whose
    input embedding is corrupt + alpha * (clean - corrupt), alpha = k / steps for k = steps_from .. steps_from+steps-1
    (steps_from 1: the paper's k = 1..steps; 0: hannamw/EAP-IG's code and MIB, k = 0..steps-1).
    `forbidden` edges carry the corrupted run's sender outputs in every run (the model a rival circuit must do
    without): the senders' differences come from that model's clean run, and those edges get no score."""
    with torch.no_grad():
        _, corrupt = split_forward(model, corrupt_ids)
    cut: dict[str, dict[str, Tensor]] = {}
    for edge in forbidden:
        sender, receiver = _split_edge(model, edge)
        cut.setdefault(receiver, {})[sender] = corrupt[sender]
    with torch.no_grad():
        _, clean = split_forward(model, clean_ids, cut=cut)
    diffs = {s: corrupt[s] - clean[s] for s in clean}
    grad = {r: torch.zeros_like(diffs["input"]) for r in receivers(model)}
    for k in range(steps_from, steps_from + steps):
        embed = corrupt["input"] + k / steps * (clean["input"] - corrupt["input"])
        taps = {r: torch.zeros_like(embed, requires_grad=True) for r in receivers(model)}
        with torch.enable_grad():
            fns = {r: (lambda x, t=t: x + t) for r, t in taps.items()}
            logits, _ = split_forward(model, clean_ids, fns, embed=embed, cut=cut)
            # a receiver that reads nothing the metric depends on gets no gradient (forbidden edges cut it off)
            found = torch.autograd.grad(metric(logits).mean(), list(taps.values()), allow_unused=True)
            for r, g in zip(taps, found):
                if g is not None:
                    grad[r] += g / steps
    out = {}
    for edge in edges(model):
        if edge not in forbidden:
            sender, receiver = edge.split("->")
            out[edge] = float((diffs[sender] * grad[receiver]).sum())
    return out


def eap_ig_activation_scores(
    model, clean_ids: Tensor, corrupt_ids: Tensor, metric: Metric, steps: int, steps_from: int
) -> dict[str, float]:
    """EAP-IG over activations, summed by hand as hannamw/EAP-IG's get_scores_ig_activations sums it: for each
    node in turn (the input, layer l's attention, all its heads at once, layer l's MLP) and each alpha = k / steps,
    k = steps_from .. steps_from+steps-1, a run of the clean prompts in which that node outputs
    alpha * clean + (1 - alpha) * corrupt; the receivers' gradients averaged over every node and step."""
    diffs = _sender_diffs(model, clean_ids, corrupt_ids)
    with torch.no_grad():
        _, clean = split_forward(model, clean_ids)
        _, corrupt = split_forward(model, corrupt_ids)
    n_layers = _shape(model)[1]
    nodes = [["input"]] + [
        group for l in range(n_layers) for group in ([s for s in clean if s.startswith(f"a{l}.h")], [f"m{l}"])
    ]
    grad = {r: torch.zeros_like(diffs["input"]) for r in receivers(model)}
    for node in nodes:
        for k in range(steps_from, steps_from + steps):
            alpha = k / steps
            fixed = {s: alpha * clean[s] + (1 - alpha) * corrupt[s] for s in node}
            taps = {r: torch.zeros_like(diffs["input"], requires_grad=True) for r in receivers(model)}
            with torch.enable_grad():
                fns = {r: (lambda x, t=t: x + t) for r, t in taps.items()}
                logits, _ = split_forward(model, clean_ids, fns, sender_outputs=fixed)
                # a receiver of the fixed node is cut off from the metric: no gradient reaches it in this run
                found = torch.autograd.grad(metric(logits).mean(), list(taps.values()), allow_unused=True)
                for r, g in zip(taps, found):
                    if g is not None:
                        grad[r] += g / (steps * len(nodes))
    out = {}
    for edge in edges(model):
        sender, receiver = edge.split("->")
        out[edge] = float((diffs[sender] * grad[receiver]).sum())
    return out


def exact_edge_score(model, clean_ids: Tensor, corrupt_ids: Tensor, metric: Metric, edge: str) -> float:
    """Mean over prompts of metric(patched) - metric(clean): in the patched (clean) run, receiver R's private input
    is its clean input + out_U(corrupt) - out_U(clean), the sender outputs taken from separate clean/corrupt runs."""
    sender, receiver = _split_edge(model, edge)
    delta = _sender_diffs(model, clean_ids, corrupt_ids)[sender]
    with torch.no_grad():
        clean_logits, _ = split_forward(model, clean_ids)
        patched_logits, _ = split_forward(model, clean_ids, {receiver: lambda x: x + delta})
        return float((metric(patched_logits) - metric(clean_logits)).mean())
