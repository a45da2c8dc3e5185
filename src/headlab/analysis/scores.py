"""Head-class scores for IOI (Wang et al. 2022, arXiv 2211.00593), one table to read the paper's classes
off: name movers (END attends to IO and copies it), negative name movers (attend to IO, write against
it), S-inhibition (END attends to S2), induction, duplicate-token and previous-token heads.

Two prompt sets, hence two sample sizes in the table's `n` column:
  repeated random tokens  [BOS] x_1..x_T x_1..x_T   prev_token_score, duplicate_token_score, induction_score,
                                                    induction_score_tl
  the task's IOI prompts                            attn_end_to_{io,s1,s2}, copy_score, negative_copy_score

Two induction scores, each named for whose it is. induction_score is Olsson et al.'s prefix matching
(arXiv 2209.11895): the mean attention of the second copy's T queries to the token after their earlier
copy. induction_score_tl is TransformerLens's head detector (transformer_lens/head_detector.py,
detect_head(model, text, "induction_head") with its defaults: error_measure "mul", BOS and current token
kept): its detection pattern marks key j for query q where token q equals token j-1 (1 <= j <= q), and the
score is the attention on marked keys summed over every query row, BOS's and the first copy's included,
over the attention summed over every row (2T+1 on a sequence with BOS). On these sequences only the second
copy's queries have a mark, so it is induction_score x T / (2T+1). TransformerLens prepends a BOS to the
text (to_tokens); headlab's sequences open with the tokenizer's BOS, so the two agree there. Where a
tokenizer has no BOS (Qwen2.5), TransformerLens prepends its EOS in its place and headlab prepends
nothing: the rows are 2T, not 2T+1, and the patterns are those of a sequence without it.
Every score reads the model through HeadSites, so it sees whatever hooks are active around the call.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import torch
import torch.nn.functional as F
from torch import Tensor

from .. import results
from ..errors import HeadlabError
from ..models.hooked import HookedModel
from ..tasks import TaskData, mean_of
from ..vocabulary import Site, hook_name

SEQ_SCORES = ("prev_token_score", "duplicate_token_score", "induction_score", "induction_score_tl")
IOI_SCORES = ("attn_end_to_io", "attn_end_to_s1", "attn_end_to_s2", "copy_score", "negative_copy_score")
# the site each score reads (the table's hook): the copy scores read v at IO, then weights alone
SCORE_SITES = {name: Site.pattern for name in SEQ_SCORES + IOI_SCORES[:3]} | {
    "copy_score": Site.v,
    "negative_copy_score": Site.v,
}
TOP_K = 5  # the paper's copy score: is the name among the top-5 logits
_UNEMBED_ROWS = 2048  # vectors read out at once,
VOCAB_COLUMNS = 4096  # against this many tokens at once: [2048, 4096] floats, 32 MB whatever the vocabulary


def ordinary_ids(model: HookedModel, low: int | None = None, high: int | None = None) -> Tensor:
    """Token ids [m] in [low, high) that are not special or added tokens of the tokenizer.

    Defaults: with a tokenizer of more than 20000 ids, 1000..20000 (common words in BPE vocabularies,
    clear of the byte/control tokens some put first and the reserved tokens others put last); otherwise
    the whole vocabulary, which for a toy model without tokenizer includes its task's special tokens."""
    weight = model.unembed.weight
    assert isinstance(weight, Tensor)  # a Parameter; nn.Module's __getattr__ is typed Tensor | Module
    vocab = weight.shape[0]
    tok = model.tokenizer
    if tok is not None:
        vocab = min(vocab, len(tok))  # Qwen-style unembeddings are padded past the tokenizer
    big = tok is not None and vocab > 20000
    low = (1000 if big else 0) if low is None else low
    high = min(vocab, (20000 if big else vocab) if high is None else high)
    ids = torch.arange(low, high)
    if tok is not None:
        special = set(getattr(tok, "all_special_ids", [])) | set(getattr(tok, "added_tokens_decoder", {}))
        ids = ids[~torch.isin(ids, torch.tensor(sorted(special), dtype=torch.long))]
    return ids


def repeated_tokens(
    model: HookedModel,
    n_seq: int,
    seq_len: int,
    seed: int = 0,
    vocab_low: int | None = None,
    vocab_high: int | None = None,
) -> Tensor:
    """[n_seq, bos + 2*seq_len]: T = seq_len distinct random ordinary tokens, then the same T again.

    Distinct tokens make each second-half token's earlier copy unique, so the duplicate and induction
    targets are one position each."""
    ids = ordinary_ids(model, vocab_low, vocab_high)
    if len(ids) < seq_len:
        raise HeadlabError(f"scores: {len(ids)} candidate token ids for sequences of {seq_len} distinct tokens")
    g = torch.Generator().manual_seed(seed)
    half = torch.stack([ids[torch.randperm(len(ids), generator=g)[:seq_len]] for _ in range(n_seq)])
    bos = getattr(model.tokenizer, "bos_token_id", None)
    prefix = [torch.full((n_seq, 1), bos, dtype=torch.long)] if bos is not None else []
    return torch.cat([*prefix, half, half], dim=1)


def induction_scores(
    model: HookedModel,
    n_seq: int = 100,
    seq_len: int = 20,
    seed: int = 0,
    vocab_low: int | None = None,
    vocab_high: int | None = None,
    batch_size: int = 32,
) -> Tensor:
    """[layer, head, n_seq, 4] per-sequence SEQ_SCORES on repeated random tokens (see repeated_tokens).

    prev_token_score: mean attention from i to i-1 over every i whose i-1 is a sequence token (not BOS);
    duplicate_token_score / induction_score: mean attention from each second-half i to i-T (its earlier
    copy) / to i-T+1 (the token that followed the earlier copy); induction_score_tl: detector_score of
    the pattern against induction_detection (the module docstring)."""
    ids = repeated_tokens(model, n_seq, seq_len, seed, vocab_low, vocab_high).to(model.input_device)
    marks = induction_detection(ids)  # [n_seq, pos, pos]
    t = seq_len
    start = ids.shape[1] - 2 * t  # 1 with BOS, else 0
    query = torch.arange(start + 1, start + 2 * t)
    second = torch.arange(start + t, start + 2 * t)
    chunks = []
    with torch.inference_mode():
        for b in range(0, n_seq, batch_size):
            patterns = model.record({"input_ids": ids[b : b + batch_size]}, "pattern")
            per_layer = []
            for layer in range(model.n_layers):
                p = patterns[layer].float()  # [batch, head, q_pos, k_pos]
                per_layer.append(
                    torch.stack(
                        [
                            p[..., query, query - 1].mean(-1),
                            p[..., second, second - t].mean(-1),
                            p[..., second, second - t + 1].mean(-1),
                            detector_score(p, marks[b : b + batch_size, None]),
                        ],
                        dim=-1,
                    )
                )
            chunks.append(torch.stack(per_layer))  # [layer, batch, head, 4]
    return torch.cat(chunks, dim=1).transpose(1, 2).cpu()


def induction_detection(ids: Tensor) -> Tensor:
    """ids [n, pos] -> [n, pos, pos] bool: TransformerLens's induction detection pattern of each sequence,
    key j marked for query q where ids[q] == ids[j - 1] and 1 <= j <= q (its duplicate-token pattern, the
    diagonal left out, shifted one key to the right, the first key column cleared, then lower-triangular)."""
    same = ids[:, :, None] == ids[:, None, :]  # [n, q, k]: token q equals token k
    marks = torch.zeros_like(same)
    marks[:, :, 1:] = same[:, :, :-1]
    return marks & torch.ones_like(same[0]).tril()  # j <= q, i.e. token j - 1 before query q


def detector_score(pattern: Tensor, marks: Tensor) -> Tensor:
    """TransformerLens's "mul" similarity: the attention on marked (query, key) pairs over all attention,
    each summed over the whole [q, k] pattern. pattern [..., q, k], marks broadcastable -> [...]."""
    return (pattern * marks).sum((-2, -1)) / pattern.sum((-2, -1))


IOI_ROLES = ("IO", "S1", "S2", "END")


def has_ioi_roles(data: TaskData) -> bool:
    """The IOI scores need the IO, S1, S2 and END positions and the IO answer (task ioi has them)."""
    roles = data.token_positions or {}
    return all(r in roles for r in IOI_ROLES) and "io" in data.answers


def ioi_scores(model: HookedModel, data: TaskData, batch_size: int = 16) -> Tensor:
    """[layer, head, n, 5] per-prompt IOI_SCORES.

    attn_end_to_*: pattern[END, role position]. copy_score: 1 when the IO token is among the top-5 logits
    of final_norm(v_IO W_O^h) unembedded, where v_IO is the head's own value vector at the IO position;
    negative_copy_score: the same for -v_IO W_O^h (a negative name mover writes against IO).

    An approximation, said plainly: the paper feeds the OV circuit the name's embedding after the first
    MLP layer; here the input is the real residual entering the head's layer at IO (through that layer's
    norm and W_V, value bias included), which for a late head already carries earlier heads' writes. The
    output bias of the layer is left out, since it is not the head's."""
    if not has_ioi_roles(data):
        raise HeadlabError("scores: the task data needs IO, S1, S2 and END positions and an 'io' answer (task ioi)")
    roles = data.token_positions or {}
    kv = torch.tensor([model.sites.kv_head_of(h) for h in range(model.n_heads)])
    chunks = []
    with torch.inference_mode():
        for b in range(0, data.n, batch_size):
            part = slice(b, b + batch_size)
            with model.sites.record(("pattern", "v")) as store:
                model.forward_blocks({k: v[part] for k, v in data.inputs.items()})
            pos = {r: roles[r][part] for r in ("IO", "S1", "S2", "END")}
            io = data.answers["io"][part]
            rows = torch.arange(len(io), device=pos["END"].device)
            attn, written = [], []
            for layer in range(model.n_layers):
                at_end = store[("pattern", layer)][rows, :, pos["END"]].float()  # [batch, head, k_pos]
                attn.append(torch.stack([at_end[rows, :, pos[r]] for r in ("IO", "S1", "S2")], dim=-1))
                v_io = store[("v", layer)][rows, :, pos["IO"]][:, kv]  # [batch, head, d_head]
                written.append(torch.einsum("bhd,hdm->bhm", v_io, model.sites.W_O(layer)))  # [batch, head, d_model]
            out = torch.stack(written)  # [layer, batch, head, d_model]: every layer's heads read out together
            token = io.to(out.device)[None, :, None].expand(out.shape[:3]).reshape(-1)
            flat = out.reshape(-1, out.shape[-1])
            copies = [in_top_k(model, sign * flat, token).view(out.shape[:3]).float() for sign in (1, -1)]
            per_layer = torch.cat([torch.stack(attn), torch.stack(copies, dim=-1)], dim=-1)
            chunks.append(per_layer)  # [layer, batch, head, 5]
    return torch.cat(chunks, dim=1).transpose(1, 2).cpu()


def in_top_k(model: HookedModel, resid: Tensor, token: Tensor, vocab_chunk: int = VOCAB_COLUMNS) -> Tensor:
    """resid [m, d_model], token [m] -> [m] bool: token among the TOP_K logits of resid read out alone
    (final norm, then the unembedding), i.e. fewer than TOP_K other tokens have a logit >= its own. A tie
    counts against the token (topk would break it by index), so an output the norm maps to zero, all
    logits equal, is no copy.

    Counted over slices of vocab_chunk tokens instead of a topk over the whole vocabulary: a row leaves
    as soon as TOP_K tokens beat it, which for most heads' outputs is within the first slice, so the
    unembedding is multiplied out in full only for the rows that do rank their token high. (A logit
    softcap is monotone, so it cannot change the top k and is not applied.)"""
    weight = model.unembed.weight
    bias = getattr(model.unembed, "bias", None)
    assert isinstance(weight, Tensor)  # a Parameter; nn.Module's __getattr__ is typed Tensor | Module
    hits = []
    for i in range(0, resid.shape[0], _UNEMBED_ROWS):
        x = model.final_norm(resid[i : i + _UNEMBED_ROWS])  # [rows, d_model]
        tok = token[i : i + _UNEMBED_ROWS].to(x.device)
        names, which = torch.unique(tok, return_inverse=True)  # IOI's answers: a few dozen names
        own = F.linear(x, weight[names], None if bias is None else bias[names])  # a matmul, as the slices'
        own = own.gather(1, which[:, None])  # [rows, 1]
        beaten = torch.zeros(len(x), dtype=torch.long, device=x.device)
        live = torch.arange(len(x), device=x.device)  # the rows not yet beaten TOP_K times
        for start in range(0, weight.shape[0], vocab_chunk):
            if not len(live):
                break
            end = min(start + vocab_chunk, weight.shape[0])
            logits = F.linear(x[live], weight[start:end], None if bias is None else bias[start:end])
            above = logits >= own[live]
            mine = (tok[live] >= start) & (tok[live] < end)  # the token itself is no competitor
            above[mine.nonzero()[:, 0], tok[live][mine] - start] = False
            beaten[live] += above.sum(-1)
            live = live[beaten[live] < TOP_K]
        hits.append(beaten < TOP_K)
    return torch.cat(hits)


def score_table(
    model: HookedModel,
    data: TaskData,
    run_info: dict,
    n_boot: int = 1000,
    seed: int = 0,
    n_seq: int = 100,
    seq_len: int = 20,
    vocab_low: int | None = None,
    vocab_high: int | None = None,
    sequences: bool = True,
) -> pd.DataFrame:
    """Tidy rows (intervention "none", method "score", per layer and head) for SEQ_SCORES over n_seq random
    sequences (made with `seed`) and, where the task's prompts have IOI's roles, IOI_SCORES over them,
    with bootstrap intervals. sequences=False leaves SEQ_SCORES out (the atlas reads them off its own
    induction probe)."""
    labels = [
        {"intervention": "none", "method": "score", "layer": layer, "head": head}
        for layer in range(model.n_layers)
        for head in range(model.n_heads)
    ]
    frames = []
    # a task's own small vocabulary (Count01 has 7 tokens) holds fewer distinct tokens than seq_len
    seq_len = max(2, min(seq_len, len(ordinary_ids(model, vocab_low, vocab_high))))
    sets: list[tuple[Tensor, tuple[str, ...]]] = []
    if sequences:
        sets.append((induction_scores(model, n_seq, seq_len, seed, vocab_low, vocab_high), SEQ_SCORES))
    if has_ioi_roles(data):
        sets.append((ioi_scores(model, data), IOI_SCORES))
    for scores, names in sets:
        quantities = scores.numpy().reshape(len(labels), scores.shape[2], len(names)).astype(np.float64)
        metrics = {name: mean_of(j) for j, name in enumerate(names)}
        table = results.tidy(run_info, labels, quantities, names, {}, metrics, n_boot=n_boot)
        hooks = [hook_name(SCORE_SITES[m], int(layer)) for m, layer in zip(table["metric"], table["layer"])]
        frames.append(table.assign(hook=pd.array(hooks, dtype="string")))
    return results.conform(pd.concat(frames or [pd.DataFrame()], ignore_index=True))
