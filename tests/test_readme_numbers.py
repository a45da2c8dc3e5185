"""The reproduction tables of README.md and the docs pages are the numbers files the reproductions wrote
(headlab.report.numbers)."""

from __future__ import annotations

import hashlib
import json
import re

from headlab.report import numbers as readme_numbers
from headlab.report.readme_tables import TABLES

REPRODUCTIONS = readme_numbers.ROOT / "docs" / "reproductions"
# the index of reproductions names them and their configs: it holds no measured number
INDEX = ("| name | paper | experiment configs |", "| --- | --- | --- |")
# a number that reads as measured: a decimal, a percentage (either signed), a count with thousands separators
# (not an arXiv id, nor a version or a name's part: 1.0.1, llama-3.2-1b)
MEASURED = re.compile(r"(?<![\w.])(?<!\w-)(-?\d+\.\d+|-?\d+(?:\.\d+)?%|\d{1,3}(?:,\d{3})+)(?![\w.-])")
ARXIV = re.compile(r"\b\d{4}\.\d{4,5}\b")
FENCE = re.compile(r"```.*?```", re.S)
INLINE_CODE = re.compile(r"`[^`]*`")
# Tables typed by hand whose numbers are definitions, not measurements, frozen by their content (sha256, 12
# hex): a new table holding such a number, or any edit to one of these, fails
# test_no_docs_table_holds_a_typed_number; a measured table is rendered from docs/numbers/.
TYPED_TABLES = {
    "docs/benchmarks/index.md": ["de3f81e288dd"],  # the benchmarks' commands: versions, vocabulary sizes, model shapes
    "docs/guides/atlas.md": ["c043490eabfd"],  # the labels' rules: their thresholds
}

# Numbers in a page's sentences that are not measurements: definitions (thresholds, interval levels, defaults,
# versions) and the papers' own figures. Every other number in a sentence is rendered from docs/numbers/
# (report/readme_prose.py) or not typed at all: the sentence names the command or file that gives it.
PROSE_DEFINITIONS: dict[str, str] = {
    "README.md": "3.10",
    "docs/concepts/studies.md": "0.2 95%",
    "docs/concepts/sweeps.md": "0.5",
    "docs/concepts/tasks.md": "0.7",
    "docs/extending/atlas-score.md": "95%",
    "docs/getting-started/install.md": "3.10",
    "docs/guides/ablation-patching.md": "95%",
    "docs/guides/atlas.md": "95%",
    "docs/guides/attention-paths.md": "0.01",
    "docs/guides/audit.md": "0.05",
    "docs/guides/circuits.md": "0.1 100% 0.8 80% 0.2",
    "docs/guides/compare.md": "5%",
    "docs/guides/head-attribution.md": "95% 100% -0.5",
    "docs/guides/head-scores.md": "0.3 95% 1.0 77% 92% 99% 0.4 0.5 0.1 0.2 -0.4 -0.15",
    # 1.6 GB: arithmetic on the shapes (64 x 127 x 50257 float32 logits), not a measurement
    "docs/guides/own-prompts.md": "5% 1.6",
    "docs/guides/recall-reasoning.md": "0.5",
    # ~5,300 and ~4,800: the tokens of the shipped data/alice.txt under SmolLM2's tokenizer (all, and the 75
    # windows of 64 fitted on), a fixed property of shipped data
    "docs/guides/saes.md": "5,300 4,800 0.5 1,000 0.2 80% 90% 100% 0% 50%",
    # 253,113,024: the size of the GGUF file the packages ship, checked by its sha256, not a measurement
    "docs/models/index.md": "253,113,024",
    "docs/reproductions/attn-sae.md": "1.0 0.2 0.3 90%",
    "docs/reproductions/count01.md": "95%",
    "docs/reproductions/ioi-audit.md": "80% 0.05 0.1",
    "docs/reproductions/ioi.md": "0.1 0.02 95% 87% 80% 0.5 90% 0.3",
    "docs/reproductions/recall-reasoning.md": "15%",
    "docs/reproductions/retrieval-heads.md": "0.9 0.2 5% 0.1",
}


def test_every_table_is_what_its_numbers_file_renders():
    marked = {page: readme_numbers.blocks(page.read_text()) for page in readme_numbers.pages()}
    assert any(marked.values()), "no page marks a table as rendered from a numbers file"
    assert any(marked[page] for page in REPRODUCTIONS.glob("*.md")), "the reproductions pages render no table"
    differing = {page: readme_numbers.differing(page.read_text()) for page in marked}
    assert {page: bad for page, bad in differing.items() if bad} == {}


def test_every_table_of_the_reproductions_pages_is_rendered_from_a_numbers_file():
    pages = sorted(REPRODUCTIONS.glob("*.md"))
    assert len(pages) > 3
    index = []
    for page in pages:
        outside = readme_numbers.BLOCK.sub("", page.read_text())
        index += [line for line in outside.splitlines() if line.startswith("| `") or line.startswith(INDEX)]
        typed = [line for line in outside.splitlines() if line.startswith("|") and line not in index]
        assert typed == [], f"a table typed by hand in {page.name}: {typed[:1]}"
    assert len(index) > 3


def typed_tables(text: str) -> list[str]:
    """The content hashes of a page's tables outside numbers blocks and code that hold a measured-looking
    number."""
    outside = FENCE.sub("", readme_numbers.BLOCK.sub("", text))
    tables: list[list[str]] = [[]]
    for line in outside.splitlines():
        if line.startswith("|"):
            tables[-1].append(line)
        elif tables[-1]:
            tables.append([])
    return [
        hashlib.sha256("\n".join(t).encode()).hexdigest()[:12]
        for t in tables
        if any(MEASURED.search(ARXIV.sub("", line)) for line in t[2:])  # past the header and its rule
    ]


def test_no_docs_table_holds_a_typed_number():
    pages = [*sorted((readme_numbers.ROOT / "docs").rglob("*.md")), readme_numbers.README]
    found = {str(p.relative_to(readme_numbers.ROOT)): typed_tables(p.read_text()) for p in pages}
    found = {page: hashes for page, hashes in found.items() if hashes}
    new = {page: sorted(set(h) - set(TYPED_TABLES.get(page, []))) for page, h in found.items()}
    assert {page: h for page, h in new.items() if h} == {}, (
        "a docs table holds a number typed by hand: render it from docs/numbers/ (headlab.report.numbers)"
    )
    assert found == TYPED_TABLES  # a frozen table rendered from a file since: take it off the list


def test_a_number_planted_in_a_docs_table_is_caught():
    page = readme_numbers.ROOT / "docs" / "guides" / "circuits.md"
    text = page.read_text() + "\n| method | CPR |\n| --- | --- |\n| eap_ig | 2.20 |\n"
    assert len(typed_tables(text)) == len(typed_tables(page.read_text())) + 1
    atlas = readme_numbers.ROOT / "docs" / "guides" / "atlas.md"
    edited = atlas.read_text().replace("gu_first_token_attention above 0.3", "gu_first_token_attention above 0.35")
    assert set(typed_tables(edited)) - set(TYPED_TABLES["docs/guides/atlas.md"])  # an edit to a frozen table
    definitions = "\n| option | default |\n| --- | --- |\n| steps | 5 |\n| paper | arXiv 2504.13151 |\n"
    assert typed_tables(definitions) == []


def prose_numbers(text: str) -> set[str]:
    """The measured-looking numbers of a page's sentences: outside numbers blocks, code and tables."""
    outside = INLINE_CODE.sub("", FENCE.sub("", readme_numbers.BLOCK.sub("", text)))
    lines = [ARXIV.sub("", line) for line in outside.splitlines() if not line.startswith("|")]
    return {m.group(0) for line in lines for m in MEASURED.finditer(line)}


def test_no_docs_sentence_holds_a_typed_number():
    pages = [*sorted((readme_numbers.ROOT / "docs").rglob("*.md")), readme_numbers.README]
    found = {str(p.relative_to(readme_numbers.ROOT)): prose_numbers(p.read_text()) for p in pages}
    typed = {page: sorted(n - set(PROSE_DEFINITIONS.get(page, "").split())) for page, n in found.items()}
    assert {page: n for page, n in typed.items() if n} == {}, (
        "a docs sentence holds a number typed by hand: render it from docs/numbers/ or name the file it is in"
    )
    stale = {page: sorted(set(d.split()) - found.get(page, set())) for page, d in PROSE_DEFINITIONS.items()}
    assert {page: n for page, n in stale.items() if n} == {}  # a definition no longer on its page: drop it


def test_a_number_planted_in_a_docs_sentence_is_caught():
    page = readme_numbers.ROOT / "docs" / "guides" / "circuits.md"
    planted = page.read_text() + "\nOn smollm2-135m the circuit's CPR is 2.21 with 1,204 edges (CMD -0.03).\n"
    assert prose_numbers(planted) - prose_numbers(page.read_text()) == {"2.21", "1,204", "-0.03"}
    assert prose_numbers("Set `study.target=0.8`; arXiv 2504.13151; version 1.0.1.\n") == set()


def test_a_changed_number_in_a_file_shows_as_a_differing_table(tmp_path):
    name, table = next((n, t) for n, t in TABLES if (readme_numbers.NUMBERS / f"{n}.json").is_file())
    source = json.loads((readme_numbers.NUMBERS / f"{name}.json").read_text())
    (tmp_path / f"{name}.json").write_text(json.dumps(source))
    text = f"x\n<!-- numbers: {name}/{table} -->\nstale\n<!-- /numbers -->\ny\n"
    assert readme_numbers.differing(text, tmp_path) == [f"{name}/{table}"]
    fresh = readme_numbers.rewritten(text, tmp_path)
    assert readme_numbers.differing(fresh, tmp_path) == []
    assert fresh.startswith("x\n") and fresh.endswith("<!-- /numbers -->\ny\n")

    def bump(node):  # every number in the file, a little larger
        if isinstance(node, dict):
            return {k: bump(v) for k, v in node.items()}
        if isinstance(node, list):
            return [bump(v) for v in node]
        return node * 1.37 + 0.11 if isinstance(node, float) else node

    (tmp_path / f"{name}.json").write_text(json.dumps(bump(source)))
    assert readme_numbers.differing(fresh, tmp_path) == [f"{name}/{table}"]
