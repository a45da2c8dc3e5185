"""The README's reproduction tables are the numbers files the reproductions wrote (headlab.report.numbers)."""

from __future__ import annotations

import json
import re

from headlab.report import numbers as readme_numbers
from headlab.report.readme_tables import TABLES

INDEX = ("| name | paper | experiment configs |", "| --- | --- | --- |")
SECTION = re.compile(r"^## Paper reproductions\n(.*?)^## ", re.S | re.M)


def test_every_readme_table_is_what_its_numbers_file_renders():
    text = readme_numbers.README.read_text()
    assert readme_numbers.blocks(text), "the README marks no table as rendered from a numbers file"
    assert readme_numbers.differing(text) == []


def test_every_table_of_the_reproductions_section_is_rendered_from_a_numbers_file():
    section = SECTION.search(readme_numbers.README.read_text())
    assert section is not None
    outside = readme_numbers.BLOCK.sub("", section.group(1))
    # the index of reproductions names them and their configs: it holds no measured number
    index = [line for line in outside.splitlines() if line.startswith("| `") or line.startswith(INDEX)]
    typed = [line for line in outside.splitlines() if line.startswith("|") and line not in index]
    assert len(index) > 3 and typed == [], f"a table typed by hand in the README's reproductions: {typed[:1]}"


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
