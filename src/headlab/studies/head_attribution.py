"""`headlab run study=head_attribution task=ioi study.heads=[L18H6]`: why a head attends where it does and what
it writes, split exactly over the components upstream of it (analysis/qk_attribution.py, ov_attribution.py).

For each head and attention edge (a query role and a key role of the task's prompts, `study.edges`, e.g.
END:IO or S2:S1+1; by default each head's `study.n_edges` strongest), the pre-softmax score is split over pairs
(query-side component, key-side component), components being the embedding, each earlier head (`L3H2`), each
earlier MLP (`MLP3`) and `bias`, with the norms' scales held at their clean values: the terms add up to the score.
The OV split: the head's direct effect on the task's metric at its read position (IOI: logit(IO) - logit(S) at
END), through the final norm held at its clean scale, over the source it read (a role, `first`, or `other`) and
the component that wrote the value there. The largest components are checked by removing them from the residual
stream on one side with the norms held (the change equals the total) and free (how far the scales move). MAPS:
the tokens the head amplifies most and what it maps them to, from the weights.

Rows (n: prompts; 95% bootstrap intervals over them; every row names the head in layer / head and the edge):
  qk_score, attention            the clean pre-softmax score (before a softcap) and the pattern's weight
  qk_term                        query_component x key_component: the `study.top` largest pairs by |mean|
                                 (study.top=0: every pair, n^2 rows per head and edge)
  qk_query_total, qk_key_total   one side's component summed over the other side: every component, `rank`
  qk_removal                     intervention remove_component, method held | free: clean score minus the score
                                 with query_component (or key_component) removed on its side; with free,
                                 norm_scale_change (the input norm's 1/rms, edited / clean - 1) and
                                 qk_norm_scale_change (QK-norm's, the largest over heads at that position)
  ov_direct_effect               edge "read": the head's direct effect at the task's read position
  ov_term                        component x source: the `study.top` largest
  ov_component_total, ov_source_total, ov_removal (held | free, norm_scale_change weighted by attention)
  maps_amplification, maps_target   `token` the source (the `study.maps_salient` most amplified tokens of the
                                 vocabulary), `target` a token it maps to, `rank`, `target_rank`; with
                                 study.maps_vocab=prompts (the prompts' tokens alone) prompt_token_amplification,
                                 prompt_token_target
hook: blocks.{l}.attn.hook_attn_scores (the QK rows: TransformerLens's pre-softmax scores),
blocks.{l}.attn.hook_result (the OV rows: the head's output), none for MAPS (weights).

The atlas's cards (`atlas_probe`, cached under output.root/atlas/<model>/attribution-<key>): every head's typical
edge on the atlas's example prompt (its strongest from the repeated half to a key after the first token) split the
same way, what its output there writes through the final norm and who wrote its values, and MAPS's products
over the text's tokens alone (labelled so: MAPS reads the vocabulary); one prompt and one block call per layer, so
every head is on the page.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import numpy as np
import pandas as pd
import torch
from rich.table import Table

from .. import results
from ..analysis import ov_attribution as ov
from ..analysis import qk_attribution as qk
from ..analysis.ioi_classes import with_s1_next
from ..config import run_info
from ..config_rules import COUNT, NATURAL, Each, Matches, OneOf, setting
from ..errors import UsageError
from ..models.hooked import HookedModel
from ..tables import head_name, head_of
from ..tasks import TaskData
from .context import RunContext
from .study import Study, StudyOptions
from .summary import console

HEAD = Matches(r"L\d+H\d+", "a head LnHm, e.g. L18H6")
SPOT = r"(?:[A-Za-z_][A-Za-z0-9_]*|\d+)(?:[+-]\d+)?"
EDGE = Matches(f"{SPOT}:{SPOT}", "QUERY:KEY, each a role of the task's prompts (END, S1+1) or a position")
FIRST, OTHER, READ = "first", "other", "read"
MAPS_VOCABS = ("prompts", "all")
STRING_COLUMNS = ("edge", "query_component", "key_component", "component", "source", "token", "target")


@dataclass
class HeadAttributionOptions(StudyOptions):
    name: str = "head_attribution"
    # the heads to explain (none: refused at the door)
    heads: list[str] = setting(factory=list, rule=Each(HEAD, least=1))
    # attention edges QUERY:KEY (roles of the task's prompts, with an offset, or positions); none: each head's
    # n_edges strongest among the task's roles (each role as a query, each role and the token after it as a key)
    edges: list[str] = setting(factory=list, rule=Each(EDGE))
    n_edges: int = setting(2, COUNT)
    top: int = setting(20, NATURAL)  # qk_term and ov_term rows kept per head and edge (largest |mean|); 0: every one
    checks: int = setting(3, NATURAL)  # components per side (and OV) checked by removal, largest first; 0: none
    ov: bool = True  # the OV split and direct effect at the task's read position (a task with a smooth metric)
    maps_salient: int = setting(5, NATURAL)  # MAPS: the most amplified source tokens per head; 0: no MAPS
    maps_targets: int = setting(5, COUNT)  # the tokens each source maps to most
    # MAPS's source tokens: every token of the vocabulary, as MAPS reads them (all); or the task's prompts' tokens
    # alone (prompts: IOI's names, places, objects), rows then named prompt_token_* as they are not MAPS's
    maps_vocab: str = setting("all", OneOf(MAPS_VOCABS))
    maps_first_mlp: bool = True  # as MAPS: heads after layer 0 read a token as block 0's MLP writes it


@dataclass
class Edge:
    spec: str  # QUERY:KEY as the user wrote it
    queries: torch.Tensor  # [B] positions
    keys: torch.Tensor  # [B]


def parse_heads(names: list[str], model: HookedModel) -> list[tuple[int, int]]:
    """The heads named (the door has refused an empty list), each one the model has."""
    heads = []
    for name in names:
        layer, head = head_of(name)  # the option's rule checked its form
        if layer >= model.n_layers or head >= model.n_heads:
            raise UsageError(
                f"study.heads: {name} is not a head of {model.name} ({model.n_layers} layers x {model.n_heads} heads)"
            )
        heads.append((layer, head))
    return list(dict.fromkeys(heads))


def spot(spec: str, roles: dict[str, torch.Tensor], n: int) -> torch.Tensor:
    """[n] positions of one side of an edge: a role (S1+1: a role with an offset; a role the task names by that
    very name first) or a position."""
    if spec in roles:
        return roles[spec].cpu()
    found = re.fullmatch(r"([A-Za-z_][A-Za-z0-9_]*|\d+)([+-]\d+)?", spec)
    assert found is not None  # the option's rule checked its form
    base, offset = found[1], int(found[2] or 0)
    if base.isdigit():
        return torch.full((n,), int(base) + offset)
    if base not in roles:
        raise UsageError(f"study.edges: the prompts have no role {base}; roles: {', '.join(roles) or 'none'}")
    return roles[base].cpu() + offset


def edge_of(spec: str, roles: dict[str, torch.Tensor], n: int, length: int) -> Edge:
    query, key = spec.split(":")
    queries, keys = spot(query, roles, n), spot(key, roles, n)
    if bool((keys > queries).any()) or bool((keys < 0).any()) or bool((queries >= length).any()):
        raise UsageError(f"study.edges: {spec} puts its key after its query (or outside the prompt) on some prompt")
    return Edge(spec, queries, keys)


def strongest_edges(comps: qk.Components, layer: int, head: int, roles: dict[str, torch.Tensor], k: int) -> list[str]:
    """The k edges among the roles (each role a query; each other role and the token after each role a key) this
    head attends along most, by the mean pattern weight over the prompts."""
    n, length = comps.batch, comps.trace.length
    plain = [r for r in roles if re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", r) and f"{r}+1" not in roles]
    keys = [*roles, *(f"{r}+1" for r in plain)]
    found = []
    rows = torch.arange(n)
    for q in roles:
        for key in keys:
            edge = edge_of_or_none(f"{q}:{key}", roles, n, length)
            if edge is None or bool((edge.keys == edge.queries).all()):  # a token attending to itself: no edge
                continue
            weight = comps.pattern[layer][rows, head, edge.queries, edge.keys].float().mean()
            found.append((float(weight), edge.spec))
    if not found:
        raise UsageError("study=head_attribution: the task's roles give no edge (name one: study.edges=[END:IO])")
    return [spec for _, spec in sorted(found, reverse=True)[:k]]


def edge_of_or_none(spec: str, roles: dict[str, torch.Tensor], n: int, length: int) -> Edge | None:
    try:
        return edge_of(spec, roles, n, length)
    except UsageError:
        return None


def source_labels(roles: dict[str, torch.Tensor], n: int, length: int) -> tuple[list[str], torch.Tensor]:
    """(labels, [n, T] index into them): each position of each prompt named by the role there, else `first`
    (position 0) or `other`."""
    labels = [*roles, FIRST, OTHER]
    index = torch.full((n, length), labels.index(OTHER))
    index[:, 0] = labels.index(FIRST)
    rows = torch.arange(n)
    for i, role in enumerate(roles):
        at = roles[role].cpu()
        inside = at < length
        index[rows[inside], at[inside]] = i
    return labels, index


# --- the table --------------------------------------------------------------------------------------------


def intervals(values: np.ndarray, n_boot: int, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per row of values [k, n]: the mean over prompts and its 95% bootstrap interval."""
    mean = {"mean": lambda q, _a: q[..., 0].mean(-1)}
    point, low, high = results.bootstrap(values[..., None], {}, mean, n_boot=n_boot, seed=seed)["mean"]
    return point, low, high


@dataclass
class Rows:
    """The table's rows, gathered as lists of dicts plus a per-prompt value array each."""

    n_boot: int
    seed: int
    labels: list[dict] = field(default_factory=list)
    values: list[np.ndarray] = field(default_factory=list)

    def add(self, label: dict, values: np.ndarray | torch.Tensor) -> None:
        self.labels.append(label)
        self.values.append(np.asarray(values.detach().double().cpu() if isinstance(values, torch.Tensor) else values))

    def frame(self) -> pd.DataFrame:
        if not self.labels:
            return pd.DataFrame()
        values = np.stack(self.values)
        point, low, high = intervals(values, self.n_boot, self.seed)
        out = pd.DataFrame(self.labels).assign(value=point, ci_low=low, ci_high=high, n=values.shape[1])
        for col in STRING_COLUMNS:
            if col in out:
                out[col] = out[col].astype("string")
        return out


def ranked(values: np.ndarray) -> np.ndarray:
    """1 for the largest |mean| over prompts (values [k, n])."""
    order = np.argsort(-np.abs(values.mean(1)), kind="stable")
    rank = np.empty(len(order), dtype=int)
    rank[order] = np.arange(1, len(order) + 1)
    return rank


def totals_rows(rows: Rows, base: dict, metric: str, column: str, labels: list[str], totals: torch.Tensor) -> list[str]:
    """A row per label of its total over prompts (totals [B, len(labels)]) with its rank; returns the labels,
    largest |mean| first."""
    per = totals.T.double().cpu().numpy()
    for c, rank in zip(range(len(labels)), ranked(per)):
        rows.add({**base, "metric": metric, column: labels[c], "rank": int(rank)}, per[c])
    return [labels[c] for c in np.argsort(-np.abs(per.mean(1)), kind="stable")]


def top_terms_rows(
    rows: Rows, base: dict, metric: str, columns: tuple[str, str], labels: tuple[list[str], list[str]], terms, top: int
) -> None:
    """Rows of the `top` terms (terms [B, a, b]) of largest |mean|, each named by its two labels (0: all)."""
    flat = terms.flatten(1).T.double().cpu().numpy()  # [a * b, B]
    for rank, index in enumerate(np.argsort(-np.abs(flat.mean(1)), kind="stable")[: top or None], 1):
        i, j = divmod(int(index), len(labels[1]))
        rows.add(
            {**base, "metric": metric, columns[0]: labels[0][i], columns[1]: labels[1][j], "rank": rank}, flat[index]
        )


def sum_error(terms: torch.Tensor, total: torch.Tensor) -> float:
    """How far the terms' sum [B] sits from the total [B], relative to the largest |total|."""
    return float((terms.sum((1, 2)) - total).abs().max() / total.abs().max().clamp_min(1e-30))


def qk_rows(
    rows: Rows,
    comps: qk.Components,
    layer: int,
    head: int,
    edge: Edge,
    terms: torch.Tensor,
    scores: torch.Tensor,
    opts: HeadAttributionOptions,
) -> dict:
    """Rows for one head and edge from terms [B, n, n] and the clean scores [B]; returns its meta entry."""
    names = comps.names(layer)
    base = {"layer": layer, "head": head, "edge": edge.spec, "method": "qk_attribution", "intervention": "none"}
    base["hook"] = f"blocks.{layer}.attn.hook_attn_scores"
    batch = torch.arange(comps.batch)
    rows.add({**base, "metric": "attention"}, comps.pattern[layer][batch, head, edge.queries, edge.keys])
    rows.add({**base, "metric": "qk_score"}, scores)
    sides = {"query": terms.sum(2), "key": terms.sum(1)}  # [B, n] each
    top_side = {
        side: totals_rows(rows, base, f"qk_{side}_total", f"{side}_component", names, totals)
        for side, totals in sides.items()
    }
    top_terms_rows(rows, base, "qk_term", ("query_component", "key_component"), (names, names), terms, opts.top)
    worst = sum_error(terms, scores)
    checked = []
    for side in qk.SIDES:
        for name in [c for c in top_side[side] if c != qk.BIAS][: opts.checks]:
            total = sides[side][:, names.index(name)]
            for held in (True, False):
                found = qk.removal(comps, layer, head, name, side, edge.queries, edge.keys, held=held)
                label = {**base, "intervention": "remove_component", "method": "held" if held else "free"}
                label[f"{side}_component"] = name
                rows.add({**label, "metric": "qk_removal"}, found.change)
                if held:
                    checked.append(float((found.change - total).abs().max() / scores.abs().clamp_min(1e-30).max()))
                else:
                    rows.add({**label, "metric": "norm_scale_change"}, found.norm_change)
                    if found.qk_norm_change is not None:
                        rows.add({**label, "metric": "qk_norm_scale_change"}, found.qk_norm_change)
    return {
        "query": top_side["query"][:5],
        "key": top_side["key"][:5],
        "sum_error": worst,
        "removal_error": max(checked, default=0.0),
    }


def ov_rows(
    rows: Rows,
    comps: qk.Components,
    layer: int,
    head: int,
    terms: torch.Tensor,
    sources: list[str],
    reads: torch.Tensor,
    u: torch.Tensor,
    opts: HeadAttributionOptions,
) -> dict:
    """Rows for one head's OV split from terms [B, n, S] (direct effect per component and source label)."""
    names = comps.names(layer)
    base = {"layer": layer, "head": head, "edge": READ, "method": "ov_attribution", "intervention": "none"}
    base["hook"] = f"blocks.{layer}.attn.hook_result"
    effect = ov.head_effect(comps, layer, head, reads, u)
    rows.add({**base, "metric": "ov_direct_effect"}, effect)
    order = totals_rows(rows, base, "ov_component_total", "component", names, terms.sum(2))
    totals_rows(rows, base, "ov_source_total", "source", sources, terms.sum(1))
    top_terms_rows(rows, base, "ov_term", ("component", "source"), (names, sources), terms, opts.top)
    worst = sum_error(terms, effect)
    per_component = terms.sum(2).T.double().cpu().numpy()
    checked = []
    for name in [c for c in order if c != qk.BIAS][: opts.checks]:
        for held in (True, False):
            found = ov.removal(comps, layer, head, name, reads, u, held=held)
            label = {**base, "intervention": "remove_component", "method": "held" if held else "free"}
            rows.add({**label, "component": name, "metric": "ov_removal"}, found.change)
            if held:
                total = per_component[names.index(name)]
                checked.append(float(np.abs(found.change.double().cpu().numpy() - total).max()))
            else:
                rows.add({**label, "component": name, "metric": "norm_scale_change"}, found.norm_change)
    scale = float(effect.abs().max().clamp_min(1e-30))
    return {"components": order[:5], "sum_error": worst, "removal_error": max(checked, default=0.0) / scale}


def maps_rows(rows: list[dict], model: HookedModel, found: dict, base: dict, prefix: str = "maps") -> None:
    """MAPS rows (one value each, no interval: weights): {prefix}_amplification and {prefix}_target."""
    tok = model.tokenizer
    word = (lambda t: tok.decode([t])) if tok is not None else str
    for (layer, head), mappings in found.items():
        for rank, m in enumerate(mappings, 1):
            label = {**base, "layer": layer, "head": head, "token": word(m.source), "rank": rank}
            rows.append({**label, "metric": f"{prefix}_amplification", "value": m.amplification})
            for j, (target, value) in enumerate(m.targets, 1):
                mapped = {"metric": f"{prefix}_target", "target": word(target), "target_rank": j, "value": value}
                rows.append({**label, **mapped})


# --- the study --------------------------------------------------------------------------------------------


def prompts_roles(data: TaskData) -> dict[str, torch.Tensor]:
    roles = dict(data.token_positions or {})
    if "S1" in roles and "S1+1" not in roles:
        roles = dict(with_s1_next(data).token_positions or {})
    return roles


@dataclass
class Plan:
    """What one run splits: the heads, each head's edges (resolved on the prompts), the OV direction and the
    source labels."""

    heads: list[tuple[int, int]]
    edges: dict[tuple[int, int], list[Edge]]
    direction: tuple[torch.Tensor, torch.Tensor] | None  # (u [B, d], read positions [B]), None: no OV split
    sources: list[str]
    source_index: torch.Tensor  # [B, T] into sources


def split_layer(comps: qk.Components, plan: Plan, layer: int) -> tuple[dict, dict]:
    """The QK terms [B, n, n] per (head, edge spec) and the OV terms [B, n, S] per head, of one layer's heads."""
    model = comps.model
    mine = [h for l, h in plan.heads if l == layer]
    qk_terms: dict[tuple[int, str], list[torch.Tensor]] = {
        (h, e.spec): [] for h in mine for e in plan.edges[(layer, h)]
    }
    ov_terms: dict[int, list[torch.Tensor]] = {h: [] for h in mine}
    for b in range(comps.batch):
        parts = qk.layer_parts(comps, layer, b)
        for h in mine:
            kv = model.sites.kv_head_of(h)
            for edge in plan.edges[(layer, h)]:
                qk_terms[(h, edge.spec)].append(parts.terms(h, kv, int(edge.queries[b]), int(edge.keys[b])))
            if plan.direction is not None:
                u, reads = plan.direction
                per = ov.ov_terms(comps, parts, layer, h, b, int(reads[b]), u[b])  # [n, T]
                grouped = per.new_zeros(per.shape[0], len(plan.sources))
                grouped.index_add_(1, plan.source_index[b].to(per.device), per)
                ov_terms[h].append(grouped)
    stacked_qk = {key: torch.stack(terms) for key, terms in qk_terms.items()}
    return stacked_qk, {h: torch.stack(terms) for h, terms in ov_terms.items() if terms}


def plan_of(ctx: RunContext, comps: qk.Components, heads: list[tuple[int, int]], roles: dict) -> Plan:
    opts: HeadAttributionOptions = ctx.options
    n, length = comps.batch, comps.trace.length
    given = [edge_of(spec, roles, n, length) for spec in opts.edges]  # refused in one line before any split
    edges = {
        h: given or [edge_of(s, roles, n, length) for s in strongest_edges(comps, *h, roles, opts.n_edges)]
        for h in heads
    }
    direction = None
    if opts.ov:
        try:
            direction = ov.answer_direction(comps, ctx.get_task(), ctx.get_data())
        except UsageError as e:
            ctx.note(f"head_attribution: no OV split: {e}")
    sources, source_index = source_labels(roles, n, length)
    return Plan(heads, edges, direction, sources, source_index)


def run(ctx: RunContext) -> pd.DataFrame:
    cfg = ctx.cfg
    opts: HeadAttributionOptions = ctx.options
    model = ctx.get_model()
    heads = parse_heads(list(opts.heads), model)
    qk.check_model(model)
    task, data = ctx.get_task(), ctx.get_data()
    roles = prompts_roles(data)
    if not opts.edges and not roles:
        raise UsageError(f"task {task.name} names no roles: give study.edges as positions, e.g. study.edges=[9:4]")
    with ctx.timed("record"):
        comps = qk.record(model, data.inputs)
    plan = plan_of(ctx, comps, heads, roles)
    rows = Rows(cfg.output.n_boot, cfg.seed)
    meta: dict[str, dict] = {}
    with ctx.timed("attribution"):
        for layer in sorted({h[0] for h in heads}):
            qk_terms, ov_terms = split_layer(comps, plan, layer)
            for h in [h for l, h in heads if l == layer]:
                entry = meta.setdefault(head_name(layer, h), {})
                for edge in plan.edges[(layer, h)]:
                    scores = scores_of(comps, layer, h, edge)
                    entry[edge.spec] = qk_rows(rows, comps, layer, h, edge, qk_terms[(h, edge.spec)], scores, opts)
                if plan.direction is not None:
                    u, reads = plan.direction
                    entry[READ] = ov_rows(rows, comps, layer, h, ov_terms[h], plan.sources, reads, u, opts)
    table = rows.frame()
    if opts.maps_salient:
        with ctx.timed("maps"):
            vocab = data.inputs["input_ids"].unique().cpu() if opts.maps_vocab == "prompts" else None
            found = ov.maps(
                model, heads, opts.maps_salient, opts.maps_targets, vocab, through_first_mlp=opts.maps_first_mlp
            )
        plain: list[dict] = []
        # MAPS reads the vocabulary; over the prompts' tokens alone the same products are named for what they read
        method = "maps" if opts.maps_vocab == "all" else "prompt_token"
        maps_rows(plain, model, found, {"method": method, "intervention": "none", "n": 1}, method)
        table = pd.concat([table, pd.DataFrame(plain)], ignore_index=True)
    ctx.meta.update(
        {
            "heads": meta,
            "edges": {head_name(*h): [e.spec for e in found_edges] for h, found_edges in plan.edges.items()},
            "components_sum_error": comps.error,
            "model_family": model.family,
        }
    )
    if model.sites.attn_softcap:
        ctx.note(f"{model.name} soft-caps its scores at {model.sites.attn_softcap}: the split is of the score inside")
    return finished(table, run_info(cfg))


def finished(table: pd.DataFrame, info: dict) -> pd.DataFrame:
    """The table in the result schema: string and integer columns typed, the run's columns added."""
    for col in STRING_COLUMNS:
        if col in table:
            table[col] = table[col].astype("string")
    for col in ("rank", "target_rank"):
        if col in table:
            table[col] = table[col].astype("Int64")
    for key, value in info.items():
        table[key] = value
    return results.conform(table)


def scores_of(comps: qk.Components, layer: int, head: int, edge: Edge) -> torch.Tensor:
    """[B]: the clean pre-softmax scores of one edge, from the model's own clean q and k."""
    clean = comps.clean(layer)
    rows = torch.arange(comps.batch)
    kv = comps.model.sites.kv_head_of(head)
    q, k = clean["q"][rows, head, edge.queries], clean["k"][rows, kv, edge.keys]
    return qk.attention_scale(comps.model, layer) * (q * k).sum(-1)


def summary(df: pd.DataFrame, max_rows: int) -> None:
    """Per head and edge: the score, and the components that build the query and the key; per head what it
    writes."""
    top = max(3, min(8, max_rows))
    for (layer, head), part in df.groupby(["layer", "head"], sort=True):
        name = head_name(int(str(layer)), int(str(head)))
        for edge, rows in part[part["method"] == "qk_attribution"].groupby("edge", sort=False):
            score = rows.loc[rows["metric"] == "qk_score", "value"]
            weight = rows.loc[rows["metric"] == "attention", "value"]
            table = Table(title=f"{name} {edge}: score {score.iloc[0]:.3f}, attention {weight.iloc[0]:.3f}")
            for col in ("query side", "total", "key side", "total "):
                table.add_column(col, justify="left" if "side" in col else "right")
            q = _side(rows, "qk_query_total", "query_component", top)
            k = _side(rows, "qk_key_total", "key_component", top)
            for (qn, qv), (kn, kv) in zip(q, k):
                table.add_row(qn, f"{qv:.3f}", kn, f"{kv:.3f}")
            console.print(table)
        writes = part[part["metric"] == "ov_component_total"]
        if len(writes):
            effect = part.loc[part["metric"] == "ov_direct_effect", "value"].iloc[0]
            best = ", ".join(f"{n} {v:.3f}" for n, v in _side(part, "ov_component_total", "component", top))
            console.print(f"{name} direct effect {effect:.3f}: values written by {best}", highlight=False)
        amplified = part[part["metric"] == "maps_target"]
        if len(amplified):
            first = amplified[amplified["target_rank"] == 1]
            said = ", ".join(f"{s!r}->{t!r}" for s, t in zip(first["token"], first["target"]))
            console.print(f"{name} maps (weights): {said}", highlight=False)


def _side(rows: pd.DataFrame, metric: str, column: str, k: int) -> list[tuple[str, float]]:
    part = rows[rows["metric"] == metric]
    part = part.reindex(part["value"].abs().sort_values(ascending=False).index)[:k]
    return list(zip(part[column].astype(str), part["value"]))


STUDY = Study(
    name="head_attribution",
    description="why a head attends where it does and what it writes: exact QK and OV splits over upstream components",
    run=run,
    summary=summary,
    reads=("train",),
    schema=HeadAttributionOptions,
)
