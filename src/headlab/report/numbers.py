"""The reproduction tables of README.md and the docs pages, rendered from numbers files: no number in them
is typed by hand.

A numbers file is the numbers.json a reproduction writes (`headlab reproduce NAME` ->
outputs/reproduce/NAME/numbers.json, with its provenance), kept in the repository as docs/numbers/NAME.json.
In README.md and every docs/**/*.md page each table sits between two markers naming its file and its table
(readme_tables.py):

    <!-- numbers: count01/claims -->
    | ... rendered, never edited ... |
    <!-- /numbers -->

A block may name several files joined by "+" (`ioi+ioi-gemma3-270m/models`): its table then reads each,
as {file name: numbers}, to set models side by side.

    python -m headlab.report.numbers keep NAME [DIR]   copy DIR/numbers.json (default outputs/reproduce/NAME)
    python -m headlab.report.numbers write             rewrite every block of every page from its file
    python -m headlab.report.numbers check             name every block that differs (exit 1)

tests/test_readme_numbers.py runs `check`, so a table and its file cannot disagree on main.
"""

from __future__ import annotations

import json
import re
import shutil
import sys
from pathlib import Path

from .readme_prose import PROSE, PROSE_OF_FILES
from .readme_tables import TABLES, TABLES_OF_FILES

ROOT = Path(__file__).resolve().parents[3]
README = ROOT / "README.md"
NUMBERS = ROOT / "docs" / "numbers"


def pages() -> list[Path]:
    """README.md and every Markdown page of the docs site: where numbers blocks may sit."""
    return [README, *sorted((ROOT / "docs").rglob("*.md"))]


BLOCK = re.compile(r"(<!-- numbers: ([\w+-]+)/([\w-]+) -->\n)(.*?)(<!-- /numbers -->)", re.S)


def present(name: str, numbers_dir: Path = NUMBERS) -> bool:
    """Every numbers file a block's name names is there."""
    return all((numbers_dir / f"{part}.json").is_file() for part in name.split("+"))


def render(name: str, table: str, numbers_dir: Path = NUMBERS) -> str:
    parts = name.split("+")
    for part in parts:
        if not (numbers_dir / f"{part}.json").is_file():
            raise FileNotFoundError(
                f"{numbers_dir / part}.json: no numbers file (python -m headlab.report.numbers keep {part})"
            )
    tables, tables_of_files = {**TABLES, **PROSE}, {**TABLES_OF_FILES, **PROSE_OF_FILES}  # prose: readme_prose.py
    known = [*tables, *tables_of_files]
    if (name, table) not in known:
        raise KeyError(f"no README table {name}/{table}; known: {', '.join(f'{n}/{t}' for n, t in known)}")
    loaded = {part: json.loads((numbers_dir / f"{part}.json").read_text()) for part in parts}
    text = tables_of_files[name, table](loaded) if len(parts) > 1 else tables[name, table](loaded[name])
    return text.rstrip("\n") + "\n"


def blocks(text: str) -> list[tuple[str, str, str]]:
    """(reproduction, table, the block's text) for each marked block of a README."""
    return [(m.group(2), m.group(3), m.group(4)) for m in BLOCK.finditer(text)]


def rewritten(text: str, numbers_dir: Path = NUMBERS) -> str:
    """Every block rendered from its numbers file; a block whose file is not there yet is left as it is."""

    def block(m: re.Match) -> str:
        if not present(m.group(2), numbers_dir):
            return m.group(0)
        return m.group(1) + render(m.group(2), m.group(3), numbers_dir) + m.group(5)

    return BLOCK.sub(block, text)


def differing(text: str, numbers_dir: Path = NUMBERS) -> list[str]:
    """The blocks whose text is not what their numbers file renders (or that have no numbers file)."""
    return [
        f"{n}/{t}" for n, t, body in blocks(text) if not present(n, numbers_dir) or body != render(n, t, numbers_dir)
    ]


def keep(name: str, source: Path | None = None, numbers_dir: Path = NUMBERS) -> Path:
    source = source or ROOT / "outputs" / "reproduce" / name
    numbers_dir.mkdir(parents=True, exist_ok=True)
    target = numbers_dir / f"{name}.json"
    shutil.copyfile(source / "numbers.json", target)
    return target


def main(argv: list[str]) -> int:
    command, *rest = argv or ["check"]
    if command == "keep" and rest:
        print(keep(rest[0], Path(rest[1]) if len(rest) > 1 else None))
        return 0
    if command == "write":
        for page in pages():
            text = page.read_text()
            fresh = rewritten(text)
            if fresh != text:
                page.write_text(fresh)
        return 0
    if command == "check":
        bad = [(page, name) for page in pages() for name in differing(page.read_text())]
        for page, name in bad:
            files = ", ".join(f"docs/numbers/{part}.json" for part in name.split("/")[0].split("+"))
            print(f"{page.relative_to(ROOT)}: table {name} is not what {files} renders")
        return 1 if bad else 0
    print("usage: python -m headlab.report.numbers keep NAME [DIR] | write | check", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
