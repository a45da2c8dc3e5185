"""headlab atlas: every head's scores, each equal to the one its own study writes, cached per probe, labels by
stated rules, and atlas.html used in headless Chromium (a click opens a card, the menu recolours the grid)."""

from __future__ import annotations

import html
import json
import math
import re
import shutil

import numpy as np
import pandas as pd
import pytest
import torch

import headlab
from conftest import GPT2_TOKENIZER, run_headlab
from headlab.analysis.attention_stats import entropy_and_distance
from headlab.studies.atlas_probes import CORPUS, rules
from headlab.studies.atlas_rules import labelled
from test_report import CHROMIUM, chromium, script_error

KEYS = ["layer", "head"]
# the tiny Llama's probes, small: the atlas of a 3-layer model in seconds
SMALL = dict(ioi_prompts=4, copy_prompts=6, text_docs=2, text_len=24, needle_prompts=4, repeat_sequences=6)


@pytest.fixture(scope="module")
def atlas_root(tmp_path_factory, demo_root):
    """An output root of this module's own holding the demo checkpoint: what other tests of the same worker
    ran under demo_root (its probes, its runs) cannot stand in for what this module computes."""
    root = tmp_path_factory.mktemp("atlas-root")
    shutil.copytree(demo_root / "checkpoints", root / "checkpoints", ignore=shutil.ignore_patterns("*.lock"))
    return root


@pytest.fixture(scope="module")
def demo_atlas(tmp_path_factory, atlas_root):
    """`headlab atlas` on the demo model (toy-attn-1l on counting), its probes cached under atlas_root."""
    demo_root = atlas_root
    run = tmp_path_factory.mktemp("atlas") / "run"
    args = (f"output.root={demo_root}", f"hydra.run.dir={run}", "output.n_boot=200")
    result = run_headlab("atlas", *args, cwd=run.parent)
    assert result.returncode == 0, result.stderr
    return run


def scores_of(table: pd.DataFrame, metric: str) -> pd.DataFrame:
    rows = table[(table["metric"] == metric) & (table["method"] == "score") & table["layer"].notna()]
    return rows.astype({"layer": int, "head": int}).set_index(KEYS).sort_index()


def test_demo_atlas_scores_every_head_as_the_induction_study_does(demo_atlas, atlas_root, tmp_path):
    demo_root = atlas_root
    table = pd.read_parquet(demo_atlas / "results.parquet")
    metrics = {"prev_token_score", "duplicate_token_score", "induction_score"} | {
        "attention_entropy",
        "attention_distance",
    }
    assert set(table["metric"]) == metrics  # no tokenizer: no IOI, text or needle; one layer: no composition
    assert (table.groupby("metric").size() == 4).all() and (demo_atlas / "atlas.html").is_file()
    meta = json.loads((demo_atlas / "meta.json").read_text())
    assert meta["options"]["repeat_len"] == 31  # fitted to 64 positions
    own = headlab.run(
        "scores=induction",
        "scores.n_sequences=25",
        "scores.repeat_len=31",
        "scores.top_k=0",
        "output.n_boot=200",
        f"output.root={demo_root}",
        f"hydra.run.dir={tmp_path / 'own'}",
    ).table
    for metric in ("prev_token_score", "duplicate_token_score", "induction_score"):
        mine, theirs = scores_of(table, metric), scores_of(own, metric)
        for col in ("value", "ci_low", "ci_high", "n"):
            np.testing.assert_array_equal(mine[col].to_numpy(float), theirs[col].to_numpy(float))
    ranks = scores_of(table, "induction_score")
    assert ranks["rank"].tolist() == ranks["value"].rank(ascending=False, method="min").astype(int).tolist()


def test_a_second_atlas_reads_the_cached_probes(demo_atlas, atlas_root):
    demo_root = atlas_root
    run = demo_atlas.parent / "again"
    args = (f"output.root={demo_root}", f"hydra.run.dir={run}", "output.n_boot=200")
    result = run_headlab("atlas", "--scores", "induction", *args, cwd=run.parent)
    assert result.returncode == 0, result.stderr
    meta = json.loads((run / "meta.json").read_text())
    assert meta["probes"]["induction"]["cached"] and meta["probes"]["attention"]["cached"]
    assert "induction" not in meta["seconds"]  # nothing of the probe ran again
    first, again = pd.read_parquet(demo_atlas / "results.parquet"), pd.read_parquet(run / "results.parquet")
    assert set(again["metric"]) == {"induction_score"}
    pd.testing.assert_frame_equal(
        scores_of(again, "induction_score")[["value", "ci_low"]],
        scores_of(first, "induction_score")[["value", "ci_low"]],
    )


def test_unknown_score_is_refused_in_one_line(demo_root, tmp_path):
    result = run_headlab("atlas", "--scores", "inductoin", f"output.root={demo_root}", cwd=tmp_path)
    assert result.returncode == 2 and "unknown score 'inductoin'" in result.stderr
    assert not list(tmp_path.rglob("results.parquet"))


def test_entropy_and_distance_of_uniform_causal_attention():
    """Uniform attention over the q + 1 keys a query sees: entropy log(q + 1), distance q / 2; padding
    queries do not count."""
    n = 6
    pattern = torch.tril(torch.ones(n, n))
    pattern = (pattern / pattern.sum(-1, keepdim=True))[None, None]  # [1, 1, n, n]
    real = torch.tensor([[True] * 4 + [False] * 2])
    found = entropy_and_distance(pattern, real)[0, 0]
    assert found[0].item() == pytest.approx(np.mean([math.log(q + 1) for q in range(4)]), abs=1e-6)
    assert found[1].item() == pytest.approx(np.mean([q / 2 for q in range(4)]), abs=1e-6)


def test_labels_only_where_the_stated_rule_passes():
    rows = pd.DataFrame(
        [
            dict(layer=0, head=0, metric="induction_score", value=0.7, ci_low=0.45, ci_high=0.8),
            dict(layer=0, head=1, metric="induction_score", value=0.7, ci_low=0.35, ci_high=0.9),  # interval too low
            dict(layer=0, head=2, metric="needle_copy_score", value=0.11, ci_low=0.0, ci_high=0.2),
            dict(layer=0, head=3, metric="ioi_logit_diff_change", value=-1.0, ci_low=-2, ci_high=0, clean=3.0),
            dict(layer=1, head=0, metric="ioi_logit_diff_change", value=-1.0, ci_low=-2, ci_high=0, clean=-0.5),
        ]
    )
    got = labelled(rows, rules())
    assert got["label"].tolist() == ["induction", "", "needle-copy", "IOI-supporting", ""]
    assert "0.4" in got["rule"][0] and "headlab's screen" in got["rule"][2] and "(3): -0.6" in got["rule"][3]


@pytest.fixture(scope="module")
def llama_atlas(tmp_path_factory, tiny_hf_dir):
    """The atlas of a 3-layer random Llama with GPT-2's tokenizer: every probe runs (retrieval finds no
    needle recalled, and says so)."""
    root = tmp_path_factory.mktemp("llama-atlas")
    model = headlab.load_model(str(tiny_hf_dir("llama")), tokenizer=str(GPT2_TOKENIZER), root=str(root))
    table = headlab.atlas(model, out=root / "run", root=str(root), n_boot=100, **SMALL)
    return model, table, root


def test_llama_atlas_scores_equal_their_own_studies(llama_atlas):
    model, table, root = llama_atlas
    per_head = table[~table["metric"].str.contains("composition")].groupby("metric").size()
    assert (per_head == 12).all() and len(per_head) == 10
    assert "needle_copy_score" not in set(table["metric"])  # random weights recall no needle: left out
    text = headlab.load_task("text", path=str(CORPUS), seq_len=SMALL["text_len"])
    sweep = headlab.sweep(model, text, ablate="heads", n_prompts=SMALL["text_docs"], n_boot=100)
    clean = sweep.loc[(sweep["intervention"] == "none") & (sweep["metric"] == "ce_loss"), "value"].item()
    heads = sweep[(sweep["intervention"] == "ablate_head") & (sweep["metric"] == "ce_loss")]
    expected = heads.astype({"layer": int, "head": int}).set_index(KEYS).sort_index()
    mine = scores_of(table, "text_loss_increase")
    np.testing.assert_allclose(mine["value"], expected["value"] - clean, rtol=0, atol=1e-12)
    np.testing.assert_allclose(mine["ci_low"], expected["ci_low"] - clean, rtol=0, atol=1e-12)
    copy = headlab.sweep(
        model, headlab.load_task("ioi"), ablate="none", head_scores=True, n_prompts=SMALL["copy_prompts"], n_boot=100
    )
    np.testing.assert_array_equal(scores_of(table, "copy_score")["value"], scores_of(copy, "copy_score")["value"])
    (probe,) = root.glob("atlas/*/copy-*/results.parquet")  # sequence_scores=false: the induction probe has them
    assert not set(pd.read_parquet(probe)["metric"]) & {"induction_score", "prev_token_score"}
    sinks = headlab.scores(
        model,
        headlab.load_task("text", path=str(CORPUS), seq_len=SMALL["text_len"], n_prompts=0),
        kind="sinks",
        seq_len=SMALL["text_len"],
        n_boot=100,
    )
    np.testing.assert_array_equal(
        scores_of(table, "gu_first_token_attention")["value"], scores_of(sinks, "gu_first_token_attention")["value"]
    )
    # composition: each reader's strongest writer, from the composition study's pairs
    comp = headlab.scores(model, text, kind="composition")
    q = comp[comp["metric"] == "q_composition"]
    best = q.loc[q.groupby(KEYS)["value"].idxmax()].astype({"layer": int, "head": int}).set_index(KEYS).sort_index()
    mine = scores_of(table, "q_composition_in")
    np.testing.assert_allclose(mine["value"], best["value"])
    assert mine["partner"].tolist() == [f"L{a}H{b}" for a, b in zip(best["writer_layer"], best["writer_head"])]


# The page as a person meets it: click a head, follow a partner, pick another score, search.
PROBE = """<script>
(function () {
  const cell = (name) => document.querySelector('#atlas-grid td[data-head="' + name + '"]');
  const colours = () => [...document.querySelectorAll("#atlas-grid td[data-head]")].map((td) => td.style.background);
  const before = colours();
  const menu = document.getElementById("atlas-score");
  const options = [...menu.options].map((o) => o.value);
  menu.value = "attention_distance";
  menu.dispatchEvent(new Event("change"));
  const after = colours();
  cell("L2H1").click();
  const card = document.getElementById("atlas-card");
  const opened = {head: card.dataset.head, hidden: card.hidden, rects: card.querySelectorAll("svg.pattern rect").length,
    scores: card.querySelectorAll("tr[data-metric]").length, partners: card.querySelectorAll("ul.partners a").length};
  const partner = card.querySelector("ul.partners a");
  const target = partner.dataset.head;
  partner.click();
  const search = document.getElementById("atlas-search");
  search.value = "L1";
  search.dispatchEvent(new Event("input"));
  const listed = [...document.querySelectorAll("#atlas-heads tbody tr")].map((tr) => tr.dataset.head);
  const probe = document.createElement("pre");
  probe.id = "probe";
  probe.textContent = JSON.stringify({before, after, options, opened, target, followed: card.dataset.head, listed});
  document.body.appendChild(probe);
})();
</script>"""


@pytest.mark.skipif(CHROMIUM is None, reason="no Chromium installed (Debian package: chromium)")
def test_an_atlas_score_added_from_outside_is_one_record(tiny_hf_dir, tmp_path):
    """A probe (a study, its overrides, its rows) with one score, its rule and code, registered from outside
    the package (docs/extending/atlas-score.md): the atlas runs it, labels by its rule and shows its code."""
    from headlab.studies import atlas_probes
    from headlab.studies.atlas_rules import Rule
    from headlab.studies.induction import STUDY as INDUCTION

    rule = Rule("any-prev", "AP", "my_prev_token", ">", -1.0, "value", False, "this test's cut: every head")
    probe = atlas_probes.register(
        atlas_probes.Probe(
            "my_prev",
            INDUCTION,
            (atlas_probes.Score("my_prev", ("my_prev_token",), (rule,)),),
            lambda o: ["study=induction", "study.icl_text=''", "study.n_sequences=4", "study.repeat_len=8"],
            False,
            atlas_probes.score_rows({"prev_token_score": "my_prev_token"}),
        )
    )
    try:
        with pytest.raises(headlab.UsageError, match="my_prev is taken"):
            atlas_probes.register(probe)
        model = headlab.load_model(str(tiny_hf_dir("llama")), tokenizer=str(GPT2_TOKENIZER), root=str(tmp_path))
        table = headlab.atlas(model, scores=["my_prev"], out=tmp_path / "run", root=str(tmp_path), n_boot=0)
    finally:
        atlas_probes.PROBES.remove(probe)
    mine = table[table["metric"] == "my_prev_token"]
    assert len(mine) == model.n_layers * model.n_heads and (mine["label"] == "any-prev").all()
    page = (tmp_path / "run" / "atlas.html").read_text()
    assert '"any-prev": "AP"' in page and "this test&#x27;s cut" in page


def test_atlas_page_in_headless_chromium(llama_atlas, tmp_path):
    _, table, root = llama_atlas
    page = root / "run" / "atlas.html"
    text = page.read_text()
    assert "src=" not in text and "http" not in text.replace("http://www.w3.org/2000/svg", "")  # self-contained
    probed = tmp_path / "probed.html"
    probed.write_text(text.replace("</body>", PROBE + "</body>"))
    dom = chromium("--dump-dom", probed.as_uri(), profile=tmp_path / "profile").stdout
    assert script_error(dom) is None
    probe = json.loads(html.unescape(re.search(r'<pre id="probe">(.*?)</pre>', dom, re.S)[1]))
    assert set(probe["options"]) == set(table["metric"])
    assert len(set(probe["before"])) > 3 and probe["before"] != probe["after"]  # the menu recoloured the grid
    opened = probe["opened"]
    assert opened["head"] == "L2H1" and not opened["hidden"]
    assert opened["scores"] == table[(table["layer"] == 2) & (table["head"] == 1)]["metric"].nunique()
    n = len(json.loads(re.search(r"id='atlas-data'>(.*?)</script>", text, re.S)[1])["tokens"])
    assert opened["rects"] == n * (n + 1) // 2 and opened["partners"] >= 3  # a causal pattern; q/k/v writers
    assert probe["followed"] == probe["target"] != "L2H1"  # a partner's link opens its card
    assert probe["listed"] == [f"L1H{h}" for h in range(4)]
    shot = tmp_path / "atlas.png"
    chromium(f"--screenshot={shot}", "--window-size=1200,900", page.as_uri(), profile=tmp_path / "profile")
    import matplotlib.image

    assert matplotlib.image.imread(shot)[..., :3].std() > 0.05  # not a blank page


def test_the_study_yaml_holds_the_options_defaults():
    import dataclasses

    from headlab.door import compose
    from headlab.studies.atlas_probes import AtlasOptions

    assert dataclasses.asdict(compose(["study=atlas"]).study) == dataclasses.asdict(AtlasOptions())


def test_the_atlas_numbers_hold_each_class_strongest_first_and_render_its_table(tmp_path):
    from headlab.figures import FIGURES
    from headlab.report.readme_tables import atlas_classes
    from headlab.studies.atlas import ranked

    rows = pd.DataFrame(
        [
            dict(layer=0, head=0, metric="induction_score", value=0.7, ci_low=0.45, ci_high=0.8),
            dict(layer=1, head=1, metric="induction_score", value=0.9, ci_low=0.85, ci_high=0.95),
            dict(layer=1, head=0, metric="induction_score", value=0.9, ci_low=0.3, ci_high=0.95),  # not labelled
            dict(layer=0, head=1, metric="ioi_logit_diff_change", value=-1.0, ci_low=-2, ci_high=0, clean=3.0),
            dict(layer=1, head=1, metric="ioi_logit_diff_change", value=-2.0, ci_low=-3, ci_high=-1, clean=3.0),
        ]
    )
    table = ranked(labelled(rows, rules())).assign(model="m", intervention="none")  # ranked as the atlas ranks
    numbers = FIGURES["atlas"](table, tmp_path)
    assert (tmp_path / "atlas_classes.png").is_file()
    model = numbers["models"]["m"]
    assert model["n_layers"] == 2 and model["n_heads"] == 4
    assert model["classes"]["induction"] == {"metric": "induction_score", "heads": [["L1H1", 0.9], ["L0H0", 0.7]]}
    assert model["classes"]["IOI-supporting"]["heads"] == [["L1H1", -2.0], ["L0H1", -1.0]]  # by magnitude
    rendered = atlas_classes(numbers)
    assert "| induction | 2 (50%): L1H1 0.90, L0H0 0.70 |" in rendered and "| copy | none |" in rendered
