"""The reproduction tables of README.md and the docs pages are the numbers files the reproductions wrote
(headlab.report.numbers)."""

from __future__ import annotations

import json

from headlab.report import numbers as readme_numbers
from headlab.report.readme_tables import TABLES

REPRODUCTIONS = readme_numbers.ROOT / "docs" / "reproductions"
# the index of reproductions names them and their configs: it holds no measured number
INDEX = ("| name | paper | experiment configs |", "| --- | --- | --- |")


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
