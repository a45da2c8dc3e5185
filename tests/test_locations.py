"""Where headlab's own files are: the texts it ships, found by name from any working directory (a user's
file of that name first), and the per-user cache, chosen by $HEADLAB_CACHE, $XDG_CACHE_HOME or home."""

from __future__ import annotations

from pathlib import Path

import headlab
from headlab.locations import cache_dir, text_path

PACKAGE = Path(headlab.__file__).resolve().parent


def test_a_shipped_text_is_found_by_name_from_any_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for name in ("alice", "devil"):
        shipped = PACKAGE / "data" / f"{name}.txt"
        assert text_path(f"data/{name}.txt") == shipped == text_path(f"{name}.txt")
        assert shipped.read_text(encoding="utf-8").strip()


def test_a_users_own_file_comes_first_and_a_missing_one_is_returned_as_typed(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "alice.txt").write_text("mine\n")
    assert text_path("data/alice.txt") == Path("data/alice.txt")  # relative, as the user typed it
    assert text_path("data/nowhere.txt") == Path("data/nowhere.txt")
    assert text_path("data") == Path("data")  # a directory of the user's
    assert text_path(tmp_path / "gone.txt") == tmp_path / "gone.txt"  # absolute: never looked up
    for outside in ("cli.py", "data/../cli.py"):  # the package's other files are no texts of its
        assert text_path(outside) == Path(outside)


def test_the_text_task_reads_the_shipped_text_from_elsewhere(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    docs = headlab.load_task("text", path="data/alice.txt").documents()
    assert len(docs) == 44 and docs[0].startswith("Alice")


def test_the_cache_is_headlab_cache_else_xdg_else_home(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("HEADLAB_CACHE", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    assert cache_dir() == tmp_path / "home" / ".cache" / "headlab"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/cache")  # invalid in the XDG spec: ignored
    assert cache_dir() == tmp_path / "home" / ".cache" / "headlab"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "xdg" / "headlab"
    monkeypatch.setenv("HEADLAB_CACHE", str(tmp_path / "mine"))
    assert cache_dir() == tmp_path / "mine"


def test_the_texts_live_inside_the_package_only():
    assert all((PACKAGE / "data" / name).is_file() for name in ("alice.txt", "devil.txt", "README.md"))
    assert not (PACKAGE.parents[1] / "data").exists()  # no second copy beside src/ to drift from the shipped one
