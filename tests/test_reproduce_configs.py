"""configs/reproduce/*.yaml expand to the run grids the reproductions were written with in Python."""

from __future__ import annotations

import os
from pathlib import Path

import pandas as pd
import pytest

from headlab import reproduce
from headlab.errors import HeadlabError, UsageError
from headlab.figures import FIGURES

# The run grids as Python functions wrote them before they became YAML: the reference the files must match,
# run for run and override for override (the order names the run dirs and the order they run in).


def count01_runs(quick: bool) -> list[list[str]]:
    heads, seeds = ((1, 2, 4), (0,)) if quick else ((1, 2, 4, 8), (0, 1, 2))
    fast = ["train.steps=400", "task.n_prompts=128", "output.n_boot=100"] if quick else []
    out = []
    for loss in ("all", "decision"):
        for h in heads:
            for s in seeds:
                model = [f"model.n_heads={h}", f"model.name=toy-attn-1l-h{h}-{loss}", f"train.loss_positions={loss}"]
                model += [f"seed={s}", *fast]
                out += [
                    ["experiment=count01_heads", "ablate.method=zero", *model],
                    ["experiment=count01_heads", "ablate.method=mean", *model],
                    ["experiment=count01_aggregation", *model],
                ]
                if h > 1:
                    out += [["experiment=count01_value_swaps", *model], ["experiment=count01_pattern_swaps", *model]]
    return out


def markov_runs(quick: bool) -> list[list[str]]:
    widths = (10, 100) if quick else (10, 30, 50, 100, 300, 500, 1000)
    fast = (
        ["model.samples=10", "model.warmup=20", "task.n_prompts=300", "train.steps=300", "output.n_boot=50"]
        if quick
        else []
    )
    out = [
        [f"experiment={exp}", f"model.width={n}", "seed=3", *fast]
        for exp in ("markov_paths", "markov_two_paths")
        for n in widths
    ]
    return out + [["experiment=markov_pruning", "model.width=30", "seed=3", *fast]]


def recall_reasoning_runs(quick: bool) -> list[list[str]]:
    fast = ["train.steps=300", "task.n_entities=12", "task.n_prompts=120", "output.n_boot=50"] if quick else []
    return [["experiment=recall_reasoning", *fast]]


def recall_reasoning_facts_runs(quick: bool) -> list[list[str]]:
    facts = ["task.source=facts", "task.facts_style=questions", "task.n_prompts=40"]
    fast = ["task.n_prompts=8", "output.n_boot=50"] if quick else []
    return [["experiment=recall_reasoning", "model=smollm2-135m", *facts, *fast]]


def head_attribution_runs(quick: bool) -> list[list[str]]:
    fast = ["task.n_prompts=4", "output.n_boot=50"] if quick else []
    cases = [
        ("smollm2-135m", "L17H4,L18H6", "S2:S1+1"),
        ("smollm2-135m", "L23H0,L23H1,L23H2,L23H7,L24H4", "END:IO"),
        ("smollm2-135m", "L20H0", "END:S2"),
        ("gemma3-270m", "L5H2,L5H3", "S2:S1+1"),
        ("gemma3-270m", "L11H2,L12H1,L17H0", "END:IO"),
    ]
    return [
        [
            f"model={m}",
            "study=head_attribution",
            "task=ioi",
            "task.n_prompts=16",
            f"study.heads=[{h}]",
            f"study.edges=[{e}]",
        ]
        + fast
        for m, h, e in cases
    ]


def attn_sae_smollm2_runs(quick: bool) -> list[list[str]]:
    return [
        [
            "experiment=attn_sae_smollm2",
            "model=smollm2-135m",
            "sae.layers=[0,-10,-1]",
            *(["sae.steps=50"] if quick else []),
        ]
    ]


def attn_sae_runs(quick: bool) -> list[list[str]]:
    base = ["experiment=attn_sae"]
    relu = ["sae.l1_warmup_steps=300", "sae.resample_every=750"]  # relu_l1's own options, as before 0.2
    if quick:
        return [[*base, "sae.layer=1", *relu, "sae.steps=200", "train.steps=200", "train.target=null"]]
    own = {"relu_l1": relu, "topk": ["sae.k=8"]}
    return [[*base, f"sae={arch}", f"sae.layer={layer}", *own[arch]] for layer in range(4) for arch in own]


def ioi_runs(quick: bool) -> list[list[str]]:
    fast = ["task.n_prompts=6", "output.n_boot=50"] if quick else []
    smol = "model=smollm2-135m"
    out = [
        ["study=ioi_classes", smol, "task.n_prompts=64", *fast],
        [smol, "task=ioi", "ablate=heads", "ablate.method=mean", "task.n_prompts=16", *fast],
        [smol, "task=ioi", "circuit=eap_ig", "study.convergence=true", "task.n_prompts=16", *fast],
    ]
    gpt2 = os.environ.get("HEADLAB_GPT2_DIR")
    if gpt2:
        out += [
            ["study=ioi_classes", "model=gpt2", f"model.path={gpt2}", "task.n_prompts=100", *fast],
            ["experiment=ioi_circuit", f"model.path={gpt2}", *fast],
        ]
    return out


def ioi_trained_runs(quick: bool) -> list[list[str]]:
    fast = (
        ["train.steps=300", "train.target=null", "train.eval_every=150", "train.eval_prompts=64"]
        + ["task.n_prompts=48", "output.n_boot=50"]
        if quick
        else []
    )
    gpt2 = os.environ.get("HEADLAB_GPT2_DIR")
    out = [
        ["experiment=ioi_trained", "study.head_scores=true", *fast],
        ["experiment=ioi_trained", "circuit=eap_ig", *fast],
    ]
    return out + ([["experiment=ioi_circuit", f"model.path={gpt2}", *fast]] if gpt2 else [])


def retrieval_heads_runs(quick: bool) -> list[list[str]]:
    if quick:
        return [
            ["experiment=retrieval_heads", "seed=0", "task.n_prompts=64", "output.n_boot=50"],
            ["experiment=retrieval_heads_smollm2", "task.n_prompts=4", "study.n_random=2", "output.n_boot=50"],
        ]
    return [
        *(["experiment=retrieval_heads", f"seed={seed}"] for seed in (0, 1, 2)),
        ["experiment=retrieval_heads_smollm2"],
    ]


def retrieval_wu_runs(quick: bool) -> list[list[str]]:
    if quick:
        return [
            [
                "experiment=retrieval_heads_smollm2",
                "task.depths=2",
                "task.n_prompts=2",
                "study.n_random=1",
                "output.n_boot=50",
            ]
        ]
    grid = ["task.depths=10", "task.n_prompts=10", "study.haystack_lens=[1000,2000,4000]"]
    return [
        ["experiment=retrieval_heads_smollm2", *grid],
        [
            "experiment=retrieval_heads_smollm2",
            "model=gemma3-270m",
            "task.prompt=question",
            *grid,
            "study.top_k=4",
            "study.random_outside=7",
        ],
    ]


def ioi_audit_runs(quick: bool) -> list[list[str]]:
    small = "task.n_prompts=6 study.held_out=6 study.resamples=1 study.draws=0 study.n_random=10"
    small += " study.permutations=100 study.n_boot=50"
    full = ["task.n_prompts=16", "study.max_units=0", "study.rival_scores=cut"]
    audit = ["study=audit", "model=smollm2-135m", "task=ioi", *(small.split() if quick else full)]
    classes = [
        "study=ioi_classes",
        "model=smollm2-135m",
        *(["task.n_prompts=6", "output.n_boot=50"] if quick else ["task.n_prompts=64"]),
    ]
    if quick:
        return [
            audit,
            classes,
            [*audit[:3], "study.circuit={previous}", *audit[3:]],
            [*audit[:3], "study.level=heads", *audit[3:]],
        ]
    activations = "study.methods=[eap,eap_ig,eap_ig_activations]"
    return [[*audit, activations], classes, [*audit, "study.circuit={previous}"], [*audit, "study.level=heads"]]


def atlas_runs(quick: bool) -> list[list[str]]:
    small = "study.repeat_sequences=4 study.ioi_prompts=4 study.copy_prompts=8 study.text_docs=1 study.needle_prompts=4"
    return [["study=atlas", f"model={m}", *(small.split() if quick else [])] for m in ("smollm2-135m", "gemma3-270m")]


REFERENCE = {
    "atlas": (atlas_runs, "run"),
    "ioi_audit": (ioi_audit_runs, "run"),
    "retrieval_heads": (retrieval_heads_runs, "run"),
    "retrieval_wu": (retrieval_wu_runs, "run"),
    "count01": (count01_runs, "run"),
    "markov": (markov_runs, "run"),
    "recall_reasoning": (recall_reasoning_runs, "run"),
    "recall_reasoning_facts": (recall_reasoning_facts_runs, "run"),
    "head_attribution": (head_attribution_runs, "run"),
    "attn_sae": (attn_sae_runs, "sae"),
    "attn_sae_smollm2": (attn_sae_smollm2_runs, "sae"),
    "ioi": (ioi_runs, "run"),
    "ioi_trained": (ioi_trained_runs, "run"),
}


def test_every_reproduction_is_declared():
    assert set(reproduce.registry()) == set(REFERENCE)


@pytest.mark.parametrize("quick", [False, True], ids=["full", "quick"])
@pytest.mark.parametrize("name", sorted(REFERENCE))
def test_declared_grid_expands_to_the_python_grid(name, quick):
    runs, command = REFERENCE[name]
    repro = reproduce.get(name)
    assert repro.runs(quick) == runs(quick)
    figures = {
        "retrieval_heads": "scores",
        "retrieval_wu": "scores",
        "ioi_trained": "ioi",
        "recall_reasoning_facts": "recall_reasoning",
        "attn_sae_smollm2": "attn_sae",
        "ioi_audit": "audit",
    }.get(name, name)  # the per-head score figures serve it
    assert repro.command == command and repro.figures == figures and repro.figures in FIGURES


def test_a_run_that_needs_an_environment_variable_runs_only_where_it_is_set(monkeypatch):
    runs = [{"runs": ["a=1", {"run": "model.path={HEADLAB_X}", "env": "HEADLAB_X"}]}]
    monkeypatch.delenv("HEADLAB_X", raising=False)
    assert reproduce.expand(runs) == [["a=1"]]
    monkeypatch.setenv("HEADLAB_X", "/some/dir")
    assert reproduce.expand(runs) == [["a=1"], ["model.path=/some/dir"]]


def test_previous_names_the_run_dir_of_the_run_before_it(tmp_path, monkeypatch):
    from headlab import studies

    seen: list[tuple[str, Path]] = []
    monkeypatch.setattr(studies, "already_done", lambda *a, **k: False)

    def execute_run(command, cfg, run_dir, **k):
        run_dir.mkdir(parents=True)
        seen.append((cfg, run_dir))

    monkeypatch.setattr(studies, "execute_run", execute_run)
    monkeypatch.setattr(reproduce.results, "collect", lambda base: pd.DataFrame())
    reproduce.run_all("ioi_audit", tmp_path, quick=True, log=lambda line: None)
    (_, classes_dir), (audit_cfg, audit_dir) = seen[1], seen[2]
    assert audit_cfg.study.circuit == str(classes_dir.resolve())
    assert "previous" in audit_dir.name  # the dir is named by the run as written: the same on every machine


def test_unknown_reproduction_names_the_known_ones():
    known = "atlas, attn_sae, attn_sae_smollm2, count01"
    with pytest.raises(UsageError, match=f"unknown reproduction 'nope'; choose from: {known}"):
        reproduce.get("nope")


def test_grid_block_templating_unless_and_quick():
    runs = [
        {
            "grid": {"a": [1, 2], "b": ["x", "y"]},
            "runs": ["k={a}", {"run": "j={b}", "unless": {"a": 1}}],
            "append": "tail=t{a}",
        },
        "one=run 'q=two words'",
    ]
    assert reproduce.expand(runs) == [
        ["k=1", "tail=t1"],
        ["k=1", "tail=t1"],
        ["k=2", "tail=t2"],
        ["j=x", "tail=t2"],
        ["k=2", "tail=t2"],
        ["j=y", "tail=t2"],
        ["one=run", "q=two words"],
    ]
    assert reproduce.expand(runs, {"a": [2], "b": [True]}, "z=1") == [
        ["k=2", "tail=t2", "z=1"],
        ["j=true", "tail=t2", "z=1"],
        ["one=run", "q=two words", "z=1"],
    ]


GOOD = "paper: P\ncommand: run\nfigures: ioi\n"


@pytest.mark.parametrize(
    "text, needle",
    [
        ("paper: [unclosed\n", "not readable as YAML"),
        ("- a\n- b\n", "the file: must be a mapping"),
        ("paper: P\ncommand: run\nruns: [a=1]\n", "missing figures"),
        (GOOD + "runs: [a=1]\nextra: 1\n", "unknown key extra"),
        ("paper: P\ncommand: train\nfigures: ioi\nruns: [a=1]\n", "command: must be one of run, sae"),
        ("paper: P\ncommand: run\nfigures: nope\nruns: [a=1]\n", "figures: must be one of"),
        (GOOD + "runs: []\n", "runs: must be a non-empty list"),
        (GOOD + "runs:\n  - grid: {a: []}\n    runs: [x=1]\n", "a must be a non-empty list of scalars"),
        (GOOD + "runs:\n  - grid: {a: [1]}\n    runs: ['x={b}']\n", "{b} is no grid variable here"),
        (GOOD + "runs:\n  - grid: {a: [1]}\n    runs: [{run: x=1, unless: {b: 1}}]\n", "unless"),
        (GOOD + "runs: [x=1]\nquick: {grid: {a: [1]}}\n", "quick: grid names a, in no grid block"),
        (GOOD + "runs: [x=1]\nquick: {steps: 1}\n", "quick: unknown key steps"),
        (GOOD + 'runs: ["x=\'1"]\n', "quotation"),
        (GOOD + "runs: [[x=1, y=2]]\n", "a run must be a line of overrides"),
    ],
)
def test_a_malformed_file_fails_in_one_line_that_names_it(tmp_path: Path, text: str, needle: str):
    path = tmp_path / "broken.yaml"
    path.write_text(text)
    with pytest.raises(HeadlabError) as info:
        reproduce.load(path)
    message = str(info.value)
    assert "\n" not in message and message.startswith(str(path)) and needle in message, message


@pytest.mark.parametrize("quick", [False, True], ids=["full", "quick"])
def test_a_reproduction_with_a_model_runs_its_runs_on_the_model_a_user_names(quick, monkeypatch):
    monkeypatch.delenv("HEADLAB_GPT2_DIR", raising=False)
    repro = reproduce.get("ioi")
    assert repro.model == "smollm2-135m" and repro.runs(quick, "smollm2-135m") == ioi_runs(quick)
    on_gemma = [[o.replace("smollm2-135m", "gemma3-270m") for o in run] for run in ioi_runs(quick)]
    assert repro.runs(quick, "gemma3-270m") == on_gemma
    assert reproduce.model_override(("model=gemma3-270m", "output.n_boot=5")) == ("gemma3-270m", ("output.n_boot=5",))
    with pytest.raises(UsageError, match="one model= per reproduction"):
        reproduce.model_override(("model=a", "model=b"))
    with pytest.raises(UsageError, match="reproduction count01 runs on the models it names"):
        reproduce.get("count01").runs(quick, "gemma3-270m")
