"""Edge-level circuits on a model that has the IOI behaviour: EAP and EAP-IG against exact edge patching.

Trains model=gpt2-ioi as experiment=ioi_trained does (or reuses its checkpoint), then on IOI prompts whose
names it never trained on scores every edge of its graph three ways (the metric: logit difference IO - S
at END):
  eap       one clean and one corrupted forward pass, one backward;
  eap_ig    5 interpolation steps over the input embeddings;
  exact     every edge patched alone from the counterfactual (ABC) run.
Prints the Pearson r of each estimate with the exact scores, the seconds each took, the faithfulness
curve of EAP-IG's circuits (top k% of edges by score, MIB's sizes), CPR, CMD, and the smallest circuit
recovering 80% of the clean-corrupted gap. Prints `eap_ig_vs_exact_pearson: ...` last.

    .venv/bin/python benchmarks/ioi_edges.py [--prompts 100] [--root outputs]
"""

from __future__ import annotations

import time

import numpy as np
import torch

from headlab.edges.eap import scores
from headlab.edges.exact import exact_scores
from headlab.edges.faithfulness import measure
from headlab.edges.graph import EdgeGraph
from ioi_trained import arguments, trained_model  # benchmarks/ is the script's folder


def main() -> None:
    _, model, task, data = trained_model(arguments(__doc__.splitlines()[0], 100))
    graph = EdgeGraph.of(model)
    print(f"prompts: {data.n}")
    print(f"edges: {graph.n_edges}")
    found: dict[str, torch.Tensor] = {}
    for method in ("eap", "eap_ig", "exact"):
        start = time.perf_counter()
        if method == "exact":
            found[method] = exact_scores(model, task, data, graph)
        else:
            found[method] = scores(model, task, data, graph, method, steps=5)
        print(f"seconds_{method}: {time.perf_counter() - start:.2f}")
    exact = found["exact"][graph.real].numpy()
    top = graph.edge_names()
    order = np.argsort(-np.abs(exact))[:8]
    print("strongest exact edges: " + ", ".join(f"{top[i]} {exact[i]:+.2f}" for i in order))
    f = measure(model, task, data, graph, found["eap_ig"])
    print(f"clean_logit_diff: {f.clean:.3f}")
    print(f"corrupted_logit_diff: {f.corrupted:.3f}")
    for p in f.points:
        print(f"faithfulness_{p.ranking}_{p.fraction:g}: {p.faithfulness:.3f} ({p.n_edges} edges)")
    print(f"cpr: {f.cpr:.3f}")
    print(f"cmd: {f.cmd:.3f}")
    print(f"circuit_edges_for_80pct: {f.target_edges} of {graph.n_edges} (faithfulness {f.target_faithfulness:.3f})")
    r = {m: float(np.corrcoef(found[m][graph.real].numpy(), exact)[0, 1]) for m in ("eap", "eap_ig")}
    print(f"eap_vs_exact_pearson: {r['eap']:.3f}")
    print(f"eap_ig_vs_exact_pearson: {r['eap_ig']:.3f}")


if __name__ == "__main__":
    main()
