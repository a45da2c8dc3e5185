"""Where headlab's own files are, wherever it is installed: the texts it ships (text_path) and the
per-user cache that outlives any one working directory (cache_dir)."""

from __future__ import annotations

import atexit
import contextlib
import os
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


def cache_dir() -> Path:
    """$HEADLAB_CACHE, else $XDG_CACHE_HOME/headlab, else ~/.cache/headlab: what headlab derives from files
    that are the same for every run (a GGUF model's float32 copy), made once per user, not once per
    working directory."""
    if os.environ.get("HEADLAB_CACHE"):
        return Path(os.environ["HEADLAB_CACHE"]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    # the XDG spec: a relative value is invalid and ignored
    return (Path(xdg) if os.path.isabs(xdg) else Path.home() / ".cache") / "headlab"
