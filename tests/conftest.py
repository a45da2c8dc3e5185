from __future__ import annotations

from jaxtyping import install_import_hook

# The shapes in headlab's types (jaxtyping) are checked at every call of these modules while the suite runs:
# installed before anything imports headlab.
SHAPED = [
    "headlab.models.sites",
    "headlab.models.hooked",
    "headlab.analysis.qk_attribution",
    "headlab.analysis.ov_attribution",
    "headlab.interventions.edits",
    "headlab.interventions.engine",
    "headlab.interventions.lengths",
    "headlab.interventions.path",
    "headlab.interventions.readout",
    "headlab.sae.source_roles",
]
install_import_hook(SHAPED, "typecheck.checker")

import contextlib  # noqa: E402
import io
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

ROOT = Path(__file__).resolve().parents[1]
GPT2_TOKENIZER = ROOT / "tests" / "data" / "gpt2-tokenizer"  # shipped with the repo (tests/data/README.md)


def tiny_configs() -> dict:
    """model_type -> a small random-weight config, one per row of FAMILIES (tests/test_families.py
    holds them to each other)."""
    import transformers as tf

    small = dict(num_hidden_layers=3, num_attention_heads=4, hidden_size=64, intermediate_size=128)
    common = dict(**small, vocab_size=50257, max_position_embeddings=128)
    grouped = dict(**common, num_key_value_heads=2)
    return {
        "gpt2": tf.GPT2Config(n_layer=3, n_head=4, n_embd=64, vocab_size=50257, n_positions=128),
        "gpt_neox": tf.GPTNeoXConfig(**common),
        "llama": tf.LlamaConfig(**grouped),
        "qwen2": tf.Qwen2Config(**grouped),
        "qwen3": tf.Qwen3Config(**grouped, head_dim=16),
        "mistral": tf.MistralConfig(**grouped, sliding_window=4),
        # Gemma scales its embeddings by sqrt(d_model) and reads them through (1 + w) norms: at the default
        # init its heads barely move the logits, too little for tests that ask every edit to show
        "gemma": tf.GemmaConfig(**grouped, head_dim=16, initializer_range=0.1),
        "gemma2": tf.Gemma2Config(**grouped, head_dim=16, sliding_window=4),
        "gemma3_text": tf.Gemma3TextConfig(**grouped, head_dim=16, sliding_window=4),
        "olmo": tf.OlmoConfig(**grouped),
        "olmo2": tf.Olmo2Config(**grouped),
    }


# one of each q/k/v layout, MHA and GQA, and post-norms with QK-norm and windows: the heavier tests
HF_FAMILIES = ("gpt2", "gpt_neox", "llama", "qwen2", "gemma3_text")


def shared_dir(tmp_path_factory, name: str) -> Path:
    """A directory every worker of this session sees (pytest-xdist runs one per core, `make test`): what
    goes in is made once under headlab's own file locks, whichever worker asks first."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        shared = tmp_path_factory.getbasetemp().parent / name
        shared.mkdir(exist_ok=True)
        return shared
    return tmp_path_factory.mktemp(name)


@pytest.fixture(scope="session", autouse=True)
def headlab_cache(tmp_path_factory):
    """The per-user cache of this session (HEADLAB_CACHE, inherited by every headlab subprocess): the real
    models' float32 copies are made once per session, whatever a home cache holds, and none is written
    there."""
    cache = shared_dir(tmp_path_factory, "headlab-cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HEADLAB_CACHE", str(cache))
        yield cache


@pytest.fixture(scope="session")
def tiny_hf_dir(tmp_path_factory):
    """family -> a directory holding a small random-weight model written with save_pretrained."""
    from transformers import AutoModelForCausalLM

    made = {}

    def make(family: str) -> Path:
        if family not in made:
            torch.manual_seed(0)
            model = AutoModelForCausalLM.from_config(tiny_configs()[family])
            path = tmp_path_factory.mktemp(family)
            model.save_pretrained(path)
            made[family] = path
        return made[family]

    return make


@pytest.fixture(scope="session")
def tiny_hf_dir_with_tokenizer(tiny_hf_dir, gpt2_tokenizer, tmp_path_factory):
    """family -> a directory holding the tiny random model with GPT-2's tokenizer beside it, as a user's
    saved model would be."""
    from transformers import AutoModelForCausalLM

    made = {}

    def make(family: str) -> Path:
        if family not in made:
            path = tmp_path_factory.mktemp(f"{family}-with-tokenizer")
            AutoModelForCausalLM.from_pretrained(tiny_hf_dir(family)).save_pretrained(path)
            gpt2_tokenizer.save_pretrained(path)
            made[family] = path
        return made[family]

    return make


@pytest.fixture(scope="module")
def one_thread():
    """For a module of tiny models (`pytestmark = pytest.mark.usefixtures("one_thread")`): two intra-op
    threads on a shared 2-core machine only spin against each other."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def gpt2_tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(GPT2_TOKENIZER))


def counting_cfg(**kw):
    base = dict(name="counting", n_prompts=64, n_reference=64, min_len=8, max_len=24, p_noise=0.25)
    return OmegaConf.create({**base, **kw})


def toy_model_cfg(**kw):
    base = dict(
        name="toy",
        kind="toy",
        n_ctx=64,
        n_layers=1,
        n_heads=4,
        d_model=64,
        d_head=16,
        d_mlp=0,
        pos_emb="learned",
        layer_norm=True,
    )
    return OmegaConf.create({**base, **kw})


def train_cfg(**kw):
    base = dict(
        steps=2000,
        batch_size=128,
        lr=3e-3,
        min_lr_frac=0.05,
        warmup_steps=100,
        weight_decay=0.01,
        beta1=0.9,
        beta2=0.98,
        grad_clip=1.0,
        eval_every=250,
        eval_prompts=512,
        checkpoint_every=500,
        target=None,
        target_value=1.0,
    )
    return OmegaConf.create({**base, **kw})


@pytest.fixture(scope="session")
def demo_root(tmp_path_factory) -> Path:
    """An output root whose checkpoints/ hold the demo model (toy-attn-1l trained on counting with the
    default schedule, as `make demo` trains it), trained once per session: runs with output.root=<this>
    and the default model, task and train settings reuse it."""
    import headlab

    trained = shared_dir(tmp_path_factory, "demo-trained")
    headlab.load_model("toy-attn-1l", root=str(trained))
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return trained
    # each worker's own root (tests read what a run leaves in it), the checkpoint trained once for all
    root = tmp_path_factory.mktemp("demo")
    shutil.copytree(trained / "checkpoints", root / "checkpoints", ignore=shutil.ignore_patterns("*.lock"))
    return root


@pytest.fixture(scope="session")
def trained_count01(demo_root):
    """The demo model, its task and its training curve."""
    from headlab.models.toy import hooked_toy, load_toy
    from headlab.tasks.counting import CountingTask

    # the checkpoint's directory, not the lock file that sits beside it under the same name
    model, saved = load_toy(next(p for p in demo_root.glob("checkpoints/toy-attn-1l-counting-*") if p.is_dir()))
    return hooked_toy(model, "toy-attn-1l"), CountingTask(counting_cfg()), saved["curve"]


@dataclass
class CliResult:
    returncode: int
    stdout: str
    stderr: str


def run_headlab(*args: str, cwd: Path) -> CliResult:
    """`headlab ARGS` run from `cwd`: in this process through the CLI's own main() (exit code, stdout,
    stderr as a user sees them), or, for a multirun, in a subprocess, since Hydra's launchers own it."""
    if "-m" in args or "--multirun" in args:
        env = {**os.environ, "HYDRA_FULL_ERROR": "0", "COLUMNS": "120"}
        proc = subprocess.run(
            [sys.executable, "-m", "headlab", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=600
        )
        return CliResult(proc.returncode, proc.stdout, proc.stderr)
    from headlab.cli import main

    out, err = io.StringIO(), io.StringIO()
    code = 0
    here, argv = Path.cwd(), sys.argv
    os.chdir(cwd)
    sys.argv = ["headlab", *args]
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            main()
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    finally:
        os.chdir(here)
        sys.argv = argv
    return CliResult(code, out.getvalue(), err.getvalue())


def error_line(result: CliResult) -> str:
    """The one line a failed command prints on stderr."""
    lines = [ln for ln in result.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, result.stderr
    return lines[0]


# The files that take longest, run first: `make test` hands whole files to its two workers in collection
# order (--dist loadfile), and a long file handed out last leaves the other worker idle until it ends.
LONGEST_FIRST = (
    # mostly waiting on the scheduler: it runs beside the other worker's work only if it starts first (a
    # worker takes its next file once two tests of its file are left, so one behind it waits for it)
    "test_slurm.py",
    "test_gemma3.py",
    "test_docs.py",
    "test_smollm2.py",
    "test_atlas.py",
    "test_sae_text.py",
    "test_sae.py",
    "test_edges.py",
    "test_sweeps.py",
    "test_qk_attribution.py",
    "test_ioi_classes.py",
)


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest keep their order
