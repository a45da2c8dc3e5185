"""The computational graph of a model at the level of edges (the EAP-IG / MIB convention).

Senders, in forward order: `input` (the residual stream entering block 0), every attention head
`a{l}.h{h}` (its output z_h W_O[h] into the residual stream) and every MLP `m{l}`. Receivers: each head's
query input `a{l}.h{h}<q>`, key and value inputs, each MLP's input `m{l}`, and `logits` (the final
residual stream). An edge carries one sender's output into one receiver's input; it exists when the
sender is upstream of the receiver.

Key and value inputs under grouped-query attention (`kv_edges`):
  ungrouped  every query head reads keys and values of its own (`a{l}.h{h}<k>`), computed from its own
             copy of the stream with its key/value head's weights, as MIB's graph has them
             (TransformerLens's ungroup_grouped_query_attention, hannamw/EAP-IG's attribute); an edge
             into one query head's key input leaves its siblings' keys clean;
  grouped    each key/value head is one receiver (`a{l}.kv{j}<k>`) whose keys every query head of its
             group reads: fewer, coarser edges (smollm2-135m: 70,651 against 123,211).
Without GQA the two are the same graph (`a{l}.h{h}<k>`).

Scores and circuits are [senders, receivers] matrices over this graph; `real` says which entries are
edges. A circuit is a boolean matrix: the edges that keep their clean values. `multiplicity` says how many
ungrouped edges each edge stands for (the query heads sharing a grouped key/value input; 1 elsewhere), so a
grouped graph's circuit sizes can be counted either way (`ungrouped=True`: MIB's count).

A model that normalises each component's output before the residual sum (Gemma 2 and 3) has the same
graph; `post_norm` names the rule that says what its edges carry (postnorm.py; None elsewhere).
"""

from __future__ import annotations

import heapq
import json
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from ..errors import UsageError
from .postnorm import check_rule

if TYPE_CHECKING:
    from ..models.hooked import HookedModel

QKV = ("q", "k", "v")
KV_EDGES = ("ungrouped", "grouped")  # key/value inputs per query head (MIB's) or per key/value head


@dataclass(frozen=True)
class Sender:
    name: str
    kind: str  # input | head | mlp
    layer: int  # -1 for the input
    head: int | None = None

    @property
    def order(self) -> int:
        """Position in the forward pass: a receiver of order o reads every sender of order < o."""
        return -1 if self.kind == "input" else 2 * self.layer + (self.kind == "mlp")


@dataclass(frozen=True)
class Receiver:
    name: str
    kind: str  # q | k | v | mlp | logits
    layer: int  # n_layers for the logits
    head: int | None = None  # the query head (q) or the key/value head (k, v)


@dataclass
class EdgeGraph:
    n_layers: int
    n_heads: int
    n_kv_heads: int
    d_model: int
    parallel: bool
    mlp_layers: tuple[int, ...]
    post_norm: str | None = None  # mib | shares on a post-norm model (postnorm.py); None: a residual sum
    kv_edges: str = "ungrouped"  # KV_EDGES: key/value inputs per query head, or per key/value head
    senders: list[Sender] = field(init=False)
    receivers: list[Receiver] = field(init=False)
    real: Tensor = field(init=False)  # [senders, receivers] bool: which entries are edges
    _owners: Tensor | None = field(init=False, default=None, repr=False)

    def __post_init__(self) -> None:
        if self.kv_edges not in KV_EDGES:
            raise UsageError(f"kv_edges={self.kv_edges}: choose from {', '.join(KV_EDGES)}")
        node, kv_receivers = ("kv", self.n_kv_heads) if self.grouped else ("h", self.n_heads)
        self.senders = [Sender("input", "input", -1)]
        self.receivers = []
        for layer in range(self.n_layers):
            self.senders += [Sender(f"a{layer}.h{h}", "head", layer, h) for h in range(self.n_heads)]
            self.receivers += [Receiver(f"a{layer}.h{h}<q>", "q", layer, h) for h in range(self.n_heads)]
            for letter in ("k", "v"):
                self.receivers += [
                    Receiver(f"a{layer}.{node}{j}<{letter}>", letter, layer, j) for j in range(kv_receivers)
                ]
            if layer in self.mlp_layers:
                self.senders.append(Sender(f"m{layer}", "mlp", layer))
                self.receivers.append(Receiver(f"m{layer}", "mlp", layer))
        self.receivers.append(Receiver("logits", "logits", self.n_layers))
        reads = torch.tensor([self._reads_below(r) for r in self.receivers])
        orders = torch.tensor([s.order for s in self.senders])
        self.real = orders[:, None] < reads[None, :]

    @property
    def grouped(self) -> bool:
        """Are key/value inputs receivers per key/value head (grouped-query attention, kv_edges=grouped)?"""
        return self.n_kv_heads != self.n_heads and self.kv_edges == "grouped"

    @property
    def group(self) -> int:
        """Query heads per key/value head."""
        return self.n_heads // self.n_kv_heads

    def site_head(self, r: Receiver) -> int:
        """The head of q, k or v (as the model computes them: k and v per key/value head) that receiver r
        reads its input into."""
        assert r.head is not None, f"receiver {r.name} reads no head's q, k or v"
        return r.head // self.group if r.kind in ("k", "v") and not self.grouped else r.head

    @property
    def expands_kv(self) -> bool:
        """Do the query heads of a group read keys and values of their own (ungrouped edges under GQA)? Then
        each layer's attention is handed k and v one copy per query head."""
        return self.n_kv_heads != self.n_heads and not self.grouped

    @classmethod
    def of(cls, model: HookedModel, post_norm: str = "mib", kv_edges: str = "ungrouped") -> EdgeGraph:
        """The model's graph; `post_norm`: the rule for a model with norms on its components' outputs
        (postnorm.py: mib, MIB's code, or shares), unused elsewhere; `kv_edges`: KV_EDGES."""
        rule = check_rule(model, post_norm)
        if any(module is None for module in model.attn_inputs):
            raise UsageError(f"{model.name}: headlab does not know where its attention reads the residual stream")
        if model.sites.qkv_projs is None or model.sites.qkv_split is None:
            raise UsageError(f"{model.name}: headlab does not know its attention's q, k and v projections")
        sites = model.sites
        mlps = tuple(
            layer
            for layer, (norm, mlp) in enumerate(zip(model.mlp_inputs, model.mlps))
            if norm is not None and mlp is not None
        )
        return cls(model.n_layers, sites.n_heads, sites.n_kv_heads, sites.d_model, model.parallel, mlps, rule, kv_edges)

    def _reads_below(self, r: Receiver) -> int:
        if r.kind == "logits":
            return 2 * self.n_layers + 1
        if r.kind == "mlp" and not self.parallel:
            return 2 * r.layer + 1  # the heads of its own layer come first
        return 2 * r.layer

    def head_rows(self, layer: int) -> slice:
        """The rows of layer's heads among the senders."""
        first = 1 + sum(self.n_heads + (lower in self.mlp_layers) for lower in range(layer))
        return slice(first, first + self.n_heads)

    @property
    def n_edges(self) -> int:
        return int(self.real.sum())

    @cached_property
    def multiplicity(self) -> Tensor:
        """[senders, receivers] int64: the ungrouped graph's edges each edge stands for (0 off the graph);
        read by every circuit a faithfulness curve builds, so computed once."""
        group = self.group if self.grouped else 1
        per_receiver = torch.tensor([group if r.kind in ("k", "v") else 1 for r in self.receivers])
        return self.real.long() * per_receiver[None, :]

    def size(self, mask: Tensor, ungrouped: bool = False) -> int:
        """The edges of `mask`, each counted once or (ungrouped) as the ungrouped edges it stands for."""
        mask = mask & self.real
        return int((self.multiplicity * mask).sum()) if ungrouped else int(mask.sum())

    def total(self, ungrouped: bool = False) -> int:
        return self.size(self.real, ungrouped)

    def layer_receivers(self, layer: int) -> list[int]:
        return [i for i, r in enumerate(self.receivers) if r.layer == layer]

    def senders_into(self, receivers: list[int]) -> int:
        """How many senders have an edge into any of `receivers`: they are the first that many, as the
        senders are in order."""
        return int(self.real[:, receivers].sum(0).max())

    def upstream(self, receiver: int) -> list[int]:
        return self.real[:, receiver].nonzero().flatten().tolist()

    def edge_names(self, mask: Tensor | None = None) -> list[str]:
        """Names of the edges in `mask` (default: every edge), sender-major."""
        rows, cols = (self.real if mask is None else mask & self.real).nonzero(as_tuple=True)
        return [f"{self.senders[s].name}->{self.receivers[r].name}" for s, r in zip(rows.tolist(), cols.tolist())]

    def owners(self) -> Tensor:
        """[senders, receivers] bool: which sender node each receiver belongs to (a kv receiver belongs
        to every query head of its group)."""
        if self._owners is None:
            self._owners = self._find_owners()
        return self._owners

    def _find_owners(self) -> Tensor:
        own = torch.zeros(len(self.senders), len(self.receivers), dtype=torch.bool)
        group = self.group if self.grouped else 1
        for j, r in enumerate(self.receivers):
            for i, s in enumerate(self.senders):
                if s.layer != r.layer or r.kind == "logits":
                    continue
                if (r.kind == "mlp" and s.kind == "mlp") or (r.kind == "q" and s.kind == "head" and s.head == r.head):
                    own[i, j] = True
                elif r.kind in ("k", "v") and s.kind == "head" and s.head // group == r.head:  # type: ignore[operator]
                    own[i, j] = True
        return own

    # --- circuits -------------------------------------------------------------------------------
    def top_n(
        self, scores: Tensor, n: int, absolute: bool = True, prune: bool = True, ungrouped: bool = False
    ) -> Tensor:
        """The circuit of the n edges with the highest (absolute) scores, pruned of dangling edges; with
        `ungrouped`, n counts ungrouped edges (the best edges whose multiplicities sum to at most n)."""
        ranked = self.ranking(scores, absolute)
        mask = torch.zeros_like(self.real)
        if ungrouped:
            n = int((self.multiplicity.flatten()[ranked].cumsum(0) <= n).sum())
        chosen = ranked[:n]
        mask.view(-1)[chosen] = True
        return self.prune(mask) if prune else mask

    def top_pruned(self, scores: Tensor, k: int, allowed: Tensor | None = None) -> Tensor:
        """The circuit [senders, receivers] of the edges of highest |score| (among `allowed`, a mask like
        real; None: every edge), pruned of dangling edges, taken down the ranking until at least k survive
        the pruning (fewer only where every allowed edge is taken): a circuit of k edges, where top_n's
        prefix of k edges may prune to fewer."""
        real = self.real if allowed is None else self.real & allowed
        key = torch.where(real, scores.abs().double(), torch.tensor(float("-inf"), dtype=torch.float64))
        order = torch.argsort(key.flatten(), descending=True, stable=True)[: int(real.sum())]

        def pruned(taken: int) -> Tensor:
            mask = torch.zeros_like(self.real)
            mask.view(-1)[order[:taken]] = True
            return self.prune(mask)

        low, high = min(k, len(order)), len(order)
        best = pruned(low)
        if int(best.sum()) >= k or low == high:
            return best
        best = pruned(high)
        while high - low > 1:
            mid = (low + high) // 2
            chosen = pruned(mid)
            if int(chosen.sum()) >= k:
                high, best = mid, chosen
            else:
                low = mid
        return best

    def ranking(self, scores: Tensor, absolute: bool = True) -> Tensor:
        """Flat indices of the edges, best first (ties broken by position, so the order is stable)."""
        key = scores.abs() if absolute else scores
        key = torch.where(self.real, key.double(), torch.tensor(float("-inf"), dtype=torch.float64))
        flat = torch.argsort(key.flatten(), descending=True, stable=True)
        return flat[: self.n_edges]

    def greedy(
        self, scores: Tensor, n: int, absolute: bool = True, prune: bool = True, ungrouped: bool = False
    ) -> Tensor:
        """EAP-IG's greedy circuit: grown from the logits upward, each step taking the best edge into a
        receiver whose node is already in the circuit, until n edges (ungrouped: n ungrouped edges)."""
        key = (scores.abs() if absolute else scores).double()
        weight = self.multiplicity if ungrouped else self.real.long()
        taken = 0
        own = self.owners()
        in_node = torch.zeros(len(self.senders), dtype=torch.bool)
        mask = torch.zeros_like(self.real)
        frontier: list[tuple[float, int, int]] = []  # (-key, sender, receiver): a heap of open edges

        def open_receiver(r: int) -> None:
            for s in self.upstream(r):
                heapq.heappush(frontier, (-float(key[s, r]), s, r))

        open_receiver(len(self.receivers) - 1)  # the logits
        while frontier:
            _, s, r = heapq.heappop(frontier)
            taken += int(weight[s, r])
            if taken > n:
                break
            mask[s, r] = True
            if not in_node[s]:
                in_node[s] = True
                for owned in own[s].nonzero().flatten().tolist():
                    if not (own[:, owned] & in_node).sum() > 1:  # a kv receiver opens with its group's first head
                        open_receiver(owned)
        return self.prune(mask) if prune else mask

    def prune(self, mask: Tensor) -> Tensor:
        """Drop edges that cannot matter: from a sender no circuit edge reaches (the input always
        counts as reached), or into a node whose output goes nowhere in the circuit; to a fixed point."""
        own = self.owners()
        mask = mask & self.real
        while True:
            has_out = mask.any(1)
            has_in = (own & mask.any(0)[None, :]).any(1)
            has_in[0] = True
            alive = has_out & has_in
            receiver_alive = (own & alive[:, None]).any(0)
            receiver_alive[-1] = True
            pruned = mask & alive[:, None] & receiver_alive[None, :]
            if torch.equal(pruned, mask):
                return mask
            mask = pruned

    # --- files ----------------------------------------------------------------------------------
    def to_json(self, scores: Tensor, mask: Tensor | None = None) -> dict[str, Any]:
        """The graph in EAP-IG's JSON layout (Graph.to_json / from_json, read by MIB's tools): cfg, nodes
        with in_graph, edges with score and in_graph. GQA models add cfg.n_key_value_heads and name their
        key/value receivers a{l}.kv{j}<k|v> where they are grouped; ungrouped, the names are MIB's."""
        mask = torch.zeros_like(self.real) if mask is None else mask & self.real
        own = self.owners()
        in_graph = mask.any(1) | (own & mask.any(0)[None, :]).any(1)
        cfg: dict[str, Any] = {
            "n_layers": self.n_layers,
            "n_heads": self.n_heads,
            "parallel_attn_mlp": self.parallel,
            "d_model": self.d_model,
        }
        if self.n_kv_heads != self.n_heads:
            cfg["n_key_value_heads"] = self.n_kv_heads
            cfg["kv_edges"] = self.kv_edges
        if self.post_norm is not None:
            cfg["post_norm"] = self.post_norm
        nodes = {s.name: {"in_graph": bool(in_graph[i])} for i, s in enumerate(self.senders)}
        nodes["logits"] = {"in_graph": True}
        # every edge's values gathered at once (row-major, as nonzero lists them): a tensor indexed per edge
        # costs seconds a million edges (an 8B model has 1.6 million)
        rows, cols = self.real.nonzero(as_tuple=True)
        sender_names = [s.name for s in self.senders]
        receiver_names = [r.name for r in self.receivers]
        edges = {
            f"{sender_names[s]}->{receiver_names[r]}": {"score": score, "in_graph": kept}
            for s, r, score, kept in zip(
                rows.tolist(), cols.tolist(), scores[self.real].double().tolist(), mask[self.real].tolist()
            )
        }
        return {"cfg": cfg, "nodes": nodes, "edges": edges}

    def from_json(self, document: dict[str, Any]) -> tuple[Tensor, Tensor]:
        """(scores, circuit) from a JSON graph of this model's shape (ours, EAP-IG's or MIB's)."""
        index = {
            f"{s.name}->{r.name}": (i, j) for i, s in enumerate(self.senders) for j, r in enumerate(self.receivers)
        }
        scores = torch.full(self.real.shape, float("nan"), dtype=torch.float64)
        mask = torch.zeros_like(self.real)
        for name, entry in document.get("edges", {}).items():
            if name not in index:
                raise UsageError(f"edge '{name}' of the JSON graph does not exist in this model's graph")
            i, j = index[name]
            scores[i, j] = float(entry.get("score", float("nan")))
            mask[i, j] = bool(entry.get("in_graph", False))
        return scores, mask


def write_json(path: Any, document: dict[str, Any]) -> None:
    from ..io import atomic_write_bytes

    atomic_write_bytes(path, json.dumps(document).encode())
