"""The site's generated pages, written by mkdocs-gen-files at every build (nothing here is committed as
Markdown): the API reference (mkdocstrings reads the docstrings), the CLI (from typer's own commands),
every config option with its default, rule and source, the studies, the model families, the benchmark
outputs kept in docs/, and the quickstart notebook (examples/quickstart.ipynb, rendered as stored).

`python docs/gen_ref_pages.py OUT` writes the same pages into OUT, to read them without mkdocs.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "docs"))

import reference_pages  # noqa: E402  (docs/reference_pages.py: the pages' text, importable by the tests)


def main() -> None:
    import mkdocs_gen_files

    for path, text in reference_pages.pages().items():
        with mkdocs_gen_files.open(path, "w") as f:
            f.write(text)
        source = reference_pages.SOURCES.get(path)
        if source is not None:
            mkdocs_gen_files.set_edit_path(path, source)
    with mkdocs_gen_files.open(reference_pages.NOTEBOOK_PAGE, "w") as f:
        f.write(reference_pages.NOTEBOOK.read_text())


if __name__ == "__main__" and len(sys.argv) > 1:
    out = Path(sys.argv[1])
    for path, text in reference_pages.pages().items():
        (out / path).parent.mkdir(parents=True, exist_ok=True)
        (out / path).write_text(text)
else:
    main()
