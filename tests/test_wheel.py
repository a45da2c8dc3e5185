"""The wheel runs anywhere: built from this checkout, installed (not editable) into a fresh virtual
environment, and run from a directory that is not the checkout, it finds its configs, its shipped text and
its launchers inside itself. The environment reuses the installed dependencies (a .pth line to this
interpreter's site-packages) instead of installing them again, which never processes that directory's own
.pth files: the editable headlab there cannot shadow the wheel."""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pandas as pd
import pytest

from conftest import ROOT


def _run(args: list, cwd: Path, env: dict) -> subprocess.CompletedProcess:
    proc = subprocess.run([str(a) for a in args], cwd=cwd, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"{args}: exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


@pytest.fixture(scope="module")
def wheel_env(tmp_path_factory):
    """(the fresh environment's bin/, the environment variables its commands run with)."""
    where = tmp_path_factory.mktemp("wheel")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "HEADLAB_CONFIG_DIR")}
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--no-input"]
    # the installed build backend (the test extra's hatchling): offline, nothing fetched
    _run([*pip, "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-w", where / "dist", ROOT], where, env)
    (wheel,) = (where / "dist").glob("headlab-*.whl")
    venv = where / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", venv], where, env)
    python = venv / "bin" / "python"
    purelib = _run([python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"], where, env).stdout.strip()
    deps = sorted({sysconfig.get_path("purelib"), sysconfig.get_path("platlib")})
    (Path(purelib) / "headlab-deps.pth").write_text("".join(f"{d}\n" for d in deps))
    # the dependencies' own pip, run by the new interpreter through that line, installs into the new
    # environment (and leaves the editable headlab alone, outside it); `pip --python` would need pip 22.3
    _run([python, *pip[1:], "install", "--no-deps", "--no-index", wheel], where, env)
    return venv / "bin", env


def test_the_installed_wheel_imports_from_itself_and_reads_its_shipped_text(wheel_env, tmp_path):
    bin_dir, env = wheel_env
    code = "import headlab, headlab.locations as l; print(headlab.__file__); print(l.text_path('data/alice.txt'))"
    module, alice = _run([bin_dir / "python", "-c", code], tmp_path, env).stdout.split()
    venv = bin_dir.parent.resolve()
    assert Path(module).resolve().is_relative_to(venv) and Path(alice).resolve().is_relative_to(venv)
    assert not Path(module).resolve().is_relative_to(ROOT)


def test_reproduce_lists_the_packaged_reproductions(wheel_env, tmp_path):
    bin_dir, env = wheel_env
    listed = _run([bin_dir / "headlab", "reproduce", "--list"], tmp_path, env).stdout
    assert "retrieval_heads" in listed and "count01" in listed


def test_the_demo_runs_on_the_packaged_default_config(wheel_env, demo_root, tmp_path):
    """`headlab run` as `make demo` runs it, on the session's demo model (conftest's demo_root): the wheel's
    default config must hash to that same checkpoint, so nothing is trained again."""
    bin_dir, env = wheel_env
    _run([bin_dir / "headlab", "run", f"output.root={demo_root}", f"hydra.run.dir={tmp_path / 'run'}"], tmp_path, env)
    assert (tmp_path / "run" / "results.parquet").is_file()
    assert len(list(demo_root.glob("checkpoints/*/model.safetensors"))) == 1


def test_the_atlas_sink_probe_reads_the_shipped_text_on_smollm2(wheel_env, headlab_cache, tmp_path):
    """smollm2's float32 copy comes from the session's cache (test_smollm2.py made it, or this makes it
    there once), and the sink probe's documents from the text inside the wheel."""
    bin_dir, env = wheel_env
    _run([bin_dir / "headlab", "atlas", "model=smollm2-135m", "--scores", "sink"], tmp_path, env)
    (run,) = (tmp_path / "outputs" / "runs").glob("*/*")
    sink = pd.read_parquet(run / "results.parquet").query("metric == 'gu_first_token_attention'")
    # 42: alice.txt's documents of at least 64 tokens (2 of its 44 are shorter)
    assert len(sink) == 270 and set(sink["task"]) == {"text"} and set(sink["n"]) == {42}
    assert len(list((headlab_cache / "weights").glob("SmolLM2-135M-Instruct.Q4_1-*/model.safetensors"))) == 1
