"""Where study=audit's circuit comes from: a circuit.json (ours, EAP-IG's or MIB's layout), an ioi_classes
run's classed heads, or heads named by the user; and `headlab audit RUN_DIR`'s overrides."""

from __future__ import annotations

import json
from pathlib import Path

import yaml
from torch import Tensor

from ..edges.graph import EdgeGraph
from ..errors import UsageError
from ..tables import head_of
from .circuit import CIRCUIT_FILE

RUN_KEYS = ("model", "task", "seed", "device", "engine", "train")  # what of a run's overrides an audit keeps
GRAPH_OPTIONS = ("method", "steps", "ig_steps_from", "kv_edges", "post_norm")  # a circuit run's, kept alike


def audit_overrides(run_dir: Path) -> list[str]:
    """`headlab audit RUN_DIR`: the overrides of `headlab run study=audit` on the run's model, task and
    seed, auditing its circuit (a circuit run's circuit.json) or its head classes (an ioi_classes run's)."""
    hydra = run_dir / ".hydra"
    try:
        given = yaml.safe_load((hydra / "overrides.yaml").read_text()) or []
        study = (yaml.safe_load((hydra / "config.yaml").read_text()) or {}).get("study", {})
    except (OSError, yaml.YAMLError) as e:
        raise UsageError(f"{run_dir}: not a headlab run dir (its .hydra/ cannot be read: {e})") from e
    kept = [o for o in given if o.split("=")[0].lstrip("+").split(".")[0] in RUN_KEYS]
    circuit = f"study.circuit='{run_dir.resolve()}'"  # quoted: a run dir's name may hold '='
    if study.get("name") == "circuit":
        if not (run_dir / CIRCUIT_FILE).is_file():
            raise UsageError(f"{run_dir}: a circuit run without {CIRCUIT_FILE} (study.level=nodes?): nothing to audit")
        options = [f"study.{k}={'null' if study[k] is None else study[k]}" for k in GRAPH_OPTIONS if k in study]
        return ["study=audit", *kept, *options, circuit]
    if study.get("name") == "ioi_classes":
        return ["study=audit", *kept, circuit]
    raise UsageError(f"{run_dir}: a {study.get('name')} run; audit reads a circuit or an ioi_classes run")


def is_classes_run(path: Path) -> bool:
    return (path / "meta.json").is_file() and not (path / CIRCUIT_FILE).is_file()


def classed_heads(run_dir: Path) -> list[str]:
    """The heads an ioi_classes run put in a class (its meta.json's `classes`, "layer.head"), as units."""
    try:
        classes = json.loads((run_dir / "meta.json").read_text()).get("classes") or {}
    except (OSError, json.JSONDecodeError) as e:
        raise UsageError(f"{run_dir}: its meta.json cannot be read ({e})") from e
    heads = [f"a{h.split('.')[0]}.h{h.split('.')[1]}" for members in classes.values() for h in members]
    if not heads:
        raise UsageError(f"{run_dir}: neither a circuit.json nor an ioi_classes run with classed heads")
    return heads


def circuit_file(given: str, graph: EdgeGraph) -> tuple[Tensor, Tensor, Path]:
    """(edge scores, edge circuit, the file) of a circuit.json or a run dir holding one."""
    path = Path(given)
    path = path / CIRCUIT_FILE if path.is_dir() else path
    if not path.is_file():
        raise UsageError(f"study.circuit={given}: neither a circuit.json nor a run dir holding one")
    try:
        document = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise UsageError(f"{path}: not a JSON graph ({e})") from e
    scores, mask = graph.from_json(document)
    if not mask.any():
        raise UsageError(f"{path}: no edge is in_graph")
    return scores, mask, path


def head_unit(name: str) -> str:
    """A head's unit name (a9.h6) from either spelling (a9.h6, L9H6)."""
    try:
        layer, head = head_of(name)
    except ValueError:
        return name
    return f"a{layer}.h{head}"
