"""Where headlab's own files are, wherever it is installed: the texts it ships (text_path)."""

from __future__ import annotations

import atexit
import contextlib
from importlib import resources
from pathlib import Path

SHIPPED = "data"  # the package's folder of texts (data/README.md there says what each one is)
# a zipped install has no file to hand out: as_file extracts one, kept until the process ends
_extracted = contextlib.ExitStack()
atexit.register(_extracted.close)


def text_path(path: str | Path) -> Path:
    """`path` where it is absolute or found from the working directory; else the text headlab ships under
    that name (`data/alice.txt` and `alice.txt` both name headlab's copy). Where neither exists, `path` as
    given, so that the caller's error names what the user typed."""
    given = Path(path).expanduser()
    if given.is_absolute() or given.exists():
        return given
    parts = given.parts[1:] if given.parts[:1] == (SHIPPED,) else given.parts
    shipped = resources.files("headlab") / SHIPPED
    for part in parts:
        shipped = shipped / part
    if not parts or ".." in parts or not shipped.is_file():
        return given
    return _extracted.enter_context(resources.as_file(shipped))
