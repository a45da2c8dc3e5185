"""Where a prompt's attention sinks are: its real tokens and, per head, its hidden sinks (Yu et al. 2024,
"Unveiling and Harnessing Hidden Attention Sinks", ICML).

Sink calibration (edits.py) edits patterns by these masks and the sink scores (analysis/sinks.py) count
them; both read them from here, so that neither room imports the other.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..errors import HeadlabError
from ..tasks import TaskData

ALPHA = 5.0  # Yu et al. 2024: a token is an attention sink of a head when it receives more than ALPHA / N


def real_tokens(data: TaskData) -> Tensor:
    """[prompts, pos] bool: the real tokens of the task's prompts (all, where it gives no mask)."""
    ids = data.inputs["input_ids"]
    mask = data.inputs.get("attention_mask")
    real = (mask if mask is not None else torch.ones_like(ids)).bool()
    if not real[:, 0].all():
        raise HeadlabError("sinks: some prompts do not start with a real token; sinks are read on right-padded prompts")
    return real


def hidden_sinks(pattern: Tensor, real: Tensor, alpha: float = ALPHA, fixed: float = 0.0) -> Tensor:
    """pattern [batch, head, query, key], real [batch, pos] bool -> [batch, head, key] bool: the real
    tokens after the first whose attention, averaged over the real queries at or after them, exceeds
    alpha / N (N: the prompt's real tokens), the paper's rule; or, where `fixed` > 0, exceeds `fixed`
    whatever N, the rule of ACT's released code (0.1)."""
    n_pos = pattern.shape[-1]
    causal = torch.ones(n_pos, n_pos, dtype=torch.bool, device=pattern.device).tril()
    sees = real[:, None, :, None] & causal  # [batch, 1, query, key]
    received = (pattern * sees).sum(-2) / sees.sum(-2).clamp(min=1)
    later = real.clone()
    later[:, 0] = False
    n = real.sum(-1).to(pattern.dtype)
    bound = torch.full_like(n, fixed) if fixed > 0 else alpha / n
    return (received > bound[:, None, None]) & later[:, None, :]
