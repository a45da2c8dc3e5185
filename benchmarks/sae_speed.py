"""Speed of headlab's SAE fitter against SAELens's trainer, on the same stored activations.

What runs:
  activations  a GPT-2-small-shaped model (n_embd 768, 12 heads of 64, 2 layers, GPT-2 tokenizer's vocabulary)
               with RANDOM weights (no pretrained GPT-2 on this machine), loaded through headlab's load_hf;
               layer 1's z (hook_z flattened over heads: d_in 768) is collected with headlab's layer_z over
               windows of 64 token ids drawn from a Zipf-like law over the vocabulary, stored once as a
               safetensors file and read back. The last sequences are held out for evaluation; the rest,
               shuffled once (seeded), is fed batch by batch in the SAME order to every fitter, each token
               once (enough sequences are stored for steps x batch tokens).
               Weights are drawn N(0, --init-range^2), default 0.1 rather than GPT-2's 0.02: at 0.02 the
               random heads attend almost uniformly (layer 1, last position: entropy 4.13 of at most 4.16
               nats), so z is a running mean of value vectors, dense and nearly low-rank (the top 200 of 768
               directions hold 94% of its variance), nothing like trained attention. At 0.1 a head puts
               0.75 of its weight on one token on average (entropy 0.74), as trained heads that attend to a
               previous token, a name or BOS do, and z is a sparse mix of value vectors of attended tokens:
               the structure an SAE is for. The script prints these numbers for the weights it draws.
  TopK pair    headlab `fit()` + `TopKSAE` against SAELens `SAETrainer` + `TopKTrainingSAE` (its real
               training path: training_forward_pass, Adam, grad clipping, LR scheduler, dead-feature and
               sparsity bookkeeping; wandb, evals and checkpoints off). Same d_sae (16 x 768), k, batch,
               lr, linear warm-up, steps, seed of the data order, thread count. L0 is matched by
               construction (k per token, less only where a top pre-activation is <= 0).
  ReLU-L1 pair (--relu) headlab `ReluL1SAE` against SAELens `StandardTrainingSAE`, same l1 coefficient. L0
               is NOT matched: headlab penalises sum |f| with unit-norm decoder rows, SAELens penalises
               sum |f_i| ||W_dec,i|| with free-norm rows initialised at norm 0.1 and clips the gradient
               norm at 1, so the same coefficient lands at different sparsity. Resampling is off
               (SAELens's standard trainer has none).
  headlab's TopK step has one dense product, the encoder's forward [batch, d_in] x [d_in, d_sae]: its
  backward sums over the k selected latents of each token (TopKEncode, sae/topk.py), decoding is an
  embedding bag over k rows of W_dec (TopKDecode; in fitting, decoding, the residual and its squared sum are
  one op, TopKSquaredError, which also takes the decoder gradient's part along each row off), Adam is
  torch's fused kernel. SAELens's step runs the
  same forward product and autograd's dense backward through it: two more products of its size (the
  grads of W_enc and of x - b_dec).
  Each fitter keeps its own defaults where the libraries differ: headlab starts with unit-norm decoder
  rows (ReLU: encoder W_dec^T x 2 d_in / d_sae) and b_dec at the first batch's mean, keeps rows at unit
  norm; SAELens (TopK) starts with rows at
  norm 0.1, b_dec 0, selects the top k of pre-activation x ||W_dec row|| (rescale_acts_by_decoder_norm)
  and clips gradients. Neither side's dead-latent machinery acts within these steps (SAELens's TopK
  auxiliary loss needs latents dead for 1000 steps).

Timing: only the fitting loop, from the moment the (warm-up + 1)-th batch is handed out to the return of
the fit call (the first --warmup-timing steps, which include one-off allocations, are not timed);
tokens/s = timed steps x batch / seconds. One process, torch.set_num_threads(--threads) for both, the
fitters run one after the other. On a shared machine the step times move with other processes' load;
the table also gives batch / median step time (med_tok/s), which a burst of contention moves less.
Before either fitter runs, glibc is set to keep large buffers in its heap (headlab.runtime.tune_allocator,
which headlab's CLI calls in every process), so neither pays fresh page faults for its per-step tensors.

Evaluation: ONE function for every SAE, headlab's reconstruction_metrics (L0, MSE, explained variance =
1 - residual SS / total SS about the mean, dead fraction) on the held-out tokens. SAELens's weights are
brought into a headlab SAE of the same architecture (for TopK after SAELens's own inference fold of the
decoder norms, process_state_dict_for_saving_inference); the script checks that SAELens's forward and
the headlab copy agree on held-out tokens (max_abs_diff lines).

What the numbers mean: throughput is a property of the fitters and the shapes (d_in, d_sae, batch, k),
not of the weights, so tokens/s and their ratio carry over to real GPT-2 activations of this shape.
Explained variance does not: it depends on the data (--init-range) and after 200 steps both SAEs are
far from converged. Read the EV columns as "the two fitters, on the same data and budget, reach this
reconstruction", never as the quality an SAE would reach on real GPT-2. Measured here (200 steps, batch
1024, k 32): at --init-range 0.02 SAELens keeps ~170 latents alive (dead 0.986) and, on that nearly
low-rank z, reaches EV 0.516 against headlab's 0.509 (dead 0.135; headlab's dense-backward fitter, before the
sparse backward); the README has the default's numbers.

smollm2 over real text (--data smollm2 or both, the default): the same TopK pair on smollm2-135m's z
(layer --smollm2-layer, 9 heads x 64: d_in 576, d_sae 16 x 576) at every token of --smollm2-text (default
data/devil.txt, Bierce's Devil's Dictionary: 1,309 windows of 64 as `headlab sae` cuts them, the last tenth,
8,320 tokens, held out), 75,456 training tokens fed about 3 times over (200 steps of 1024), each pass in a
fresh seeded order, the same order for both fitters. Its lines start with smollm2_; smollm2_goal says
whether headlab reached >= 3x SAELens's tokens/s at equal or better held-out explained variance.
Measured (2 quiet cores, 2026-11-26): seed 0 headlab 0.6376 held out, SAELens 0.6165, 4.20x; seed 1 0.6378
and 0.6128, 4.44x. On data/alice.txt (--smollm2-text data/alice.txt: 4,800 training tokens fed ~43 times
to 9,216 latents) the held-out EV measures memorisation instead: headlab 0.948 on its training tokens and
0.613 held out, SAELens 0.861 and 0.628 (83% of its latents dead on them: fewer live latents memorise
less). The smollm2_train_explained_variance lines print the training-token EV of both.

Run from the repo root: .venv/bin/python benchmarks/sae_speed.py [--quick] [--steps N] [--batch B] [--k K]
[--data both|random|smollm2]. The last line is `throughput_ratio_vs_saelens: X.XX` (TopK pair on the random
GPT-2 z, headlab tokens/s / SAELens tokens/s; goal >= 3 at equal or better explained variance).
"""

from __future__ import annotations

import argparse
import math
import os
import resource
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing here needs the hub
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("TQDM_DISABLE", "1")  # SAELens's progress bar

import torch
from safetensors.torch import load_file, save_file

from headlab.models.hf import load_hf
from headlab.runtime import tune_allocator
from headlab.sae.activations import layer_z
from headlab.sae.fit import fit
from headlab.sae.metrics import reconstruction_metrics
from headlab.sae.relu_l1 import ReluL1SAE
from headlab.sae.topk import TopKSAE

# the repository's own copy (tests/data/README.md), so that the benchmark runs wherever the tests do
TOKENIZER = str(Path(__file__).resolve().parents[1] / "tests" / "data" / "gpt2-tokenizer")
N_LAYERS, N_HEADS, D_MODEL = 2, 12, 768
LAYER = 1
D_IN = D_MODEL  # z flattened over heads: 12 x 64
CONTEXT = 64
EXPANSION = 16
MODEL_BATCH = 64  # sequences per forward pass while collecting z


# ---------------------------------------------------------------------------- stored activations


def collect_activations(n_sequences: int, seed: int, where: Path, init_range: float) -> tuple[Path, dict]:
    """Run the random GPT-2-shaped model once, store layer-1 z of every token: [n_sequences * CONTEXT, D_IN].
    Also returns how its layer-1 heads attend (at the last position of the first windows) and how
    spread z's variance is."""
    from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel

    tok = AutoTokenizer.from_pretrained(TOKENIZER)
    torch.manual_seed(seed)
    config = GPT2Config(
        n_layer=N_LAYERS,
        n_head=N_HEADS,
        n_embd=D_MODEL,
        vocab_size=len(tok),
        initializer_range=init_range,
        n_positions=max(CONTEXT, 128),
        bos_token_id=tok.eos_token_id,
        eos_token_id=tok.eos_token_id,
        attn_implementation="eager",
    )
    model_dir = where / "gpt2-random"
    hf_model = GPT2LMHeadModel(config).eval()
    hf_model.save_pretrained(model_dir)
    hm = load_hf(str(model_dir), name="gpt2-small-shape-random-2L", tokenizer=TOKENIZER)
    # token ids: a Zipf-like law over the vocabulary (BPE ids roughly follow merge order, so low ids are
    # the common pieces); gives repeated tokens within and across windows, as text does
    gen = torch.Generator().manual_seed(seed + 1)
    weights = 1.0 / (torch.arange(len(tok), dtype=torch.float64) + 50.0)
    ids = torch.multinomial(weights, n_sequences * CONTEXT, replacement=True, generator=gen).view(n_sequences, CONTEXT)
    pattern = hf_model(ids[:MODEL_BATCH], output_attentions=True).attentions[LAYER][:, :, -1]  # [b, head, key]
    stats = {
        "attention_entropy_nats": float(-(pattern * pattern.clamp_min(1e-12).log()).sum(-1).mean()),
        "attention_max_weight": float(pattern.max(-1).values.mean()),
    }
    del hf_model
    parts = [layer_z(hm, LAYER, ids[i : i + MODEL_BATCH]).reshape(-1, D_IN) for i in range(0, n_sequences, MODEL_BATCH)]
    z = torch.cat(parts).float().contiguous()
    path = where / "z_layer1.safetensors"
    save_file({"z": z}, str(path))
    sample = z[:: max(1, z.shape[0] // 20_000)]
    spectrum = torch.linalg.svdvals(sample - sample.mean(0)).pow(2)
    stats["variance_in_top_200_directions"] = float(spectrum[:200].sum() / spectrum.sum())
    return path, stats


class Feed:
    """Batches of the stored activations in one fixed order; records when each batch is handed out."""

    def __init__(self, x: torch.Tensor, order: torch.Tensor, batch: int, steps: int):
        self.x, self.order, self.batch, self.steps = x, order, batch, steps
        self.stamps: list[float] = []

    def __iter__(self):
        return self

    def __next__(self) -> torch.Tensor:
        i = len(self.stamps)
        if i >= self.steps:
            raise StopIteration
        out = self.x[self.order[i * self.batch : (i + 1) * self.batch]]
        self.stamps.append(time.perf_counter())
        return out


@dataclass
class Timing:
    seconds: float  # steps warm.. to the end of the fit call
    tokens: int  # tokens in those steps
    median_step: float  # seconds: the median of those steps' durations (robust to bursts of CPU contention)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds

    def median_tokens_per_s(self, batch: int) -> float:
        return batch / self.median_step


def timed(run, feed: Feed, warm: int) -> Timing:
    """Time steps warm.. of run() (which consumes feed): from the moment batch `warm` is handed out to
    the return of run()."""
    run()
    end = time.perf_counter()
    if len(feed.stamps) != feed.steps:
        raise RuntimeError(f"the fitter took {len(feed.stamps)} batches, expected {feed.steps}")
    bounds = feed.stamps[warm:] + [end]
    steps = sorted(b - a for a, b in zip(bounds, bounds[1:]))
    return Timing(end - feed.stamps[warm], (feed.steps - warm) * feed.batch, steps[len(steps) // 2])


# ---------------------------------------------------------------------------- the fitters


def fit_headlab(sae, feed: Feed, args, workdir: Path, warm: int) -> Timing:
    sc = SimpleNamespace(
        steps=feed.steps,
        lr=args.lr,
        warmup_steps=args.lr_warmup,
        beta1=0.9,
        beta2=0.999,
        dead_window=100_000,
        resample_every=0,
        checkpoint_every=10**9,
    )
    directory = Path(tempfile.mkdtemp(dir=workdir, prefix=f"headlab-{sae.architecture}-"))
    return timed(lambda: fit(sae, lambda step: feed, sc, directory, show_progress=False), feed, warm)


def saelens_trainer_config(feed: Feed, args):
    from sae_lens.config import LoggingConfig, SAETrainerConfig

    return SAETrainerConfig(
        total_training_samples=feed.steps * feed.batch,
        train_batch_size_samples=feed.batch,
        lr=args.lr,
        lr_end=args.lr / 10,
        lr_scheduler_name="constant",
        lr_warm_up_steps=args.lr_warmup,
        adam_beta1=0.9,
        adam_beta2=0.999,
        device="cpu",
        autocast=False,
        n_checkpoints=0,
        checkpoint_path=None,
        save_final_checkpoint=False,
        logger=LoggingConfig(log_to_wandb=False),
    )


def fit_saelens(sae, feed: Feed, args, warm: int) -> Timing:
    from sae_lens.training.sae_trainer import SAETrainer

    trainer = SAETrainer(cfg=saelens_trainer_config(feed, args), sae=sae, data_provider=feed, evaluator=None)
    return timed(trainer.fit, feed, warm)


def saelens_topk(args, d_in: int = D_IN):
    from sae_lens.saes.topk_sae import TopKTrainingSAE, TopKTrainingSAEConfig

    torch.manual_seed(args.seed)
    return TopKTrainingSAE(
        TopKTrainingSAEConfig(d_in=d_in, d_sae=EXPANSION * d_in, k=args.k, dtype="float32", device="cpu")
    )


def saelens_standard(args):
    from sae_lens.saes.standard_sae import StandardTrainingSAE, StandardTrainingSAEConfig

    torch.manual_seed(args.seed)
    cfg = StandardTrainingSAEConfig(
        d_in=D_IN,
        d_sae=EXPANSION * D_IN,
        l1_coefficient=args.l1_coeff,
        l1_warm_up_steps=0,
        dtype="float32",
        device="cpu",
    )
    return StandardTrainingSAE(cfg)


@torch.no_grad()
def as_headlab(saelens_sae, cls, **kwargs):
    """SAELens's trained weights in a headlab SAE of the same architecture (SAELens's own inference fold)."""
    state = {k: v.detach().clone() for k, v in saelens_sae.state_dict().items()}
    saelens_sae.process_state_dict_for_saving_inference(state)
    sae = cls(saelens_sae.cfg.d_in, saelens_sae.cfg.d_sae, **kwargs)
    sae.load_state_dict({k: state[k] for k in ("W_enc", "b_enc", "W_dec", "b_dec")})
    return sae.eval()


@torch.no_grad()
def forward_diff(saelens_sae, headlab_sae, x: torch.Tensor) -> tuple[float, float]:
    """(max |difference|, fraction of tokens whose reconstructions differ by more than 1e-4). A TopK
    token can differ where its k-th and (k+1)-th pre-activations tie to float rounding: the two
    computations round differently and pick different latents."""
    saelens_sae.eval()
    per_token = (saelens_sae(x) - headlab_sae(x)[0]).abs().amax(-1)
    return float(per_token.max()), float((per_token > 1e-4).float().mean())


# ---------------------------------------------------------------------------- smollm2 over real text


def smollm2_z(layer: int, text: str) -> tuple[torch.Tensor, torch.Tensor, int]:
    """z of smollm2-135m's `layer` (9 heads x 64: d_in 576) at every token of `text`, windows of 64 tokens
    as `headlab sae` cuts them: (train tokens, held-out tokens of the last tenth of windows, windows)."""
    from headlab import load_model
    from headlab.sae.activations import corpus_z, text_corpus

    model = load_model("smollm2-135m")
    corpus = text_corpus(text, model, CONTEXT)
    n = corpus.ids.shape[0]
    split = n - max(1, n // 10)
    with torch.inference_mode():
        train = corpus_z(model, layer, corpus.rows(torch.arange(split)), MODEL_BATCH)
        held_out = corpus_z(model, layer, corpus.rows(torch.arange(split, n)), MODEL_BATCH)
    return train.float().contiguous(), held_out.float().contiguous(), n


def smollm2_pair(args, workdir: Path, warm: int) -> list[str]:
    """The TopK pair on smollm2's z over real text: steps x batch tokens are fed as passes over the training
    tokens, each pass in a fresh (seeded) order, the same for both fitters."""
    start = time.perf_counter()
    train, held_out, windows = smollm2_z(args.smollm2_layer, args.smollm2_text)
    collect_s = time.perf_counter() - start
    d_in = train.shape[1]
    gen = torch.Generator().manual_seed(args.seed + 3)
    passes = -(-args.steps * args.batch // train.shape[0])
    order = torch.cat([torch.randperm(train.shape[0], generator=gen) for _ in range(passes)])
    headlab_sae = TopKSAE(d_in, EXPANSION * d_in, seed=args.seed, k=args.k)
    th = fit_headlab(headlab_sae, Feed(train, order, args.batch, args.steps), args, workdir, warm)
    mh = reconstruction_metrics(headlab_sae.eval(), held_out)
    theirs = saelens_topk(args, d_in)
    ts = fit_saelens(theirs, Feed(train, order, args.batch, args.steps), args, warm)
    copy = as_headlab(theirs, TopKSAE, k=args.k)
    biggest, share = forward_diff(theirs, copy, held_out)
    ms = reconstruction_metrics(copy, held_out)
    # on the training tokens too: on a short text (alice.txt: 4,800 tokens fed ~43 times to 9,216 latents)
    # an SAE fits them far better than it generalises, the more so the more latents it keeps alive
    fit_h, fit_s = reconstruction_metrics(headlab_sae, train), reconstruction_metrics(copy, train)
    ratio = th.tokens_per_s / ts.tokens_per_s
    met = ratio >= 3 and mh["explained_variance"] >= ms["explained_variance"]
    return [
        f"smollm2_data: smollm2-135m layer {args.smollm2_layer} z (9 x 64) over {args.smollm2_text}, {windows} windows "
        f"of {CONTEXT}: {train.shape[0]} training tokens fed {passes} times over, {held_out.shape[0]} held out",
        f"smollm2_collect_seconds: {collect_s:.1f}",
        f"smollm2_d_in: {d_in}  d_sae: {EXPANSION * d_in}  k: {args.k}  batch: {args.batch}  steps: {args.steps}",
        f"smollm2_saelens_forward_vs_headlab_copy_max_abs_diff: {biggest:.3g} (tokens differing > 1e-4: {share:.4f})",
        f"smollm2_tokens_per_s_headlab: {th.tokens_per_s:.0f}",
        f"smollm2_tokens_per_s_saelens: {ts.tokens_per_s:.0f}",
        f"smollm2_l0_headlab: {mh['l0']:.2f}  smollm2_l0_saelens: {ms['l0']:.2f}",
        f"smollm2_explained_variance_headlab: {mh['explained_variance']:.4f}",
        f"smollm2_explained_variance_saelens: {ms['explained_variance']:.4f}",
        f"smollm2_train_explained_variance_headlab: {fit_h['explained_variance']:.4f}",
        f"smollm2_train_explained_variance_saelens: {fit_s['explained_variance']:.4f}",
        f"smollm2_dead_fraction_headlab: {mh['dead_fraction']:.3f}",
        f"smollm2_dead_fraction_saelens: {ms['dead_fraction']:.3f}",
        f"smollm2_throughput_ratio_median_step: "
        f"{th.median_tokens_per_s(args.batch) / ts.median_tokens_per_s(args.batch):.2f}",
        f"smollm2_throughput_ratio_vs_saelens: {ratio:.2f}",
        f"smollm2_goal: >= 3x SAELens tokens/s at equal or better explained variance: {'met' if met else 'NOT met'}",
    ]


def random_gpt2_pairs(args, warm: int, tuned: bool) -> str:
    """The pairs on the random GPT-2-shaped model's z; prints their table, returns the ratio line."""
    rows: dict[tuple[str, str], tuple[Timing, dict]] = {}
    diffs: dict[str, tuple[float, float]] = {}
    with tempfile.TemporaryDirectory(prefix="sae_speed-") as tmp:
        workdir = Path(tmp)
        start = time.perf_counter()
        with torch.inference_mode():
            path, data_stats = collect_activations(args.sequences, args.seed, workdir, args.init_range)
        collect_s = time.perf_counter() - start
        z = load_file(str(path))["z"]  # the stored activations, read back: what every fitter sees
        n_eval = args.eval_sequences * CONTEXT
        train, held_out = z[:-n_eval], z[-n_eval:]
        order = torch.randperm(train.shape[0], generator=torch.Generator().manual_seed(args.seed + 2))

        def run_pair(pair: str, headlab_sae, saelens_sae, cls, **kwargs) -> None:
            timing = fit_headlab(headlab_sae, Feed(train, order, args.batch, args.steps), args, workdir, warm)
            rows[(pair, "headlab")] = (timing, reconstruction_metrics(headlab_sae.eval(), held_out))
            timing = fit_saelens(saelens_sae, Feed(train, order, args.batch, args.steps), args, warm)
            copy = as_headlab(saelens_sae, cls, **kwargs)
            diffs[pair] = forward_diff(saelens_sae, copy, held_out[:2048])
            rows[(pair, "saelens")] = (timing, reconstruction_metrics(copy, held_out))

        d_sae = EXPANSION * D_IN
        run_pair("topk", TopKSAE(D_IN, d_sae, seed=args.seed, k=args.k), saelens_topk(args), TopKSAE, k=args.k)
        if args.relu:
            run_pair(
                "relu_l1",
                ReluL1SAE(D_IN, d_sae, seed=args.seed, l1_coeff=args.l1_coeff, l1_warmup_steps=0),
                saelens_standard(args),
                ReluL1SAE,
            )

    print(
        f"model: gpt2-small-shape RANDOM weights N(0, {args.init_range:g}^2) ({N_LAYERS} layers x {N_HEADS} heads, "
        f"d_model {D_MODEL}), z of layer {LAYER} (hook_z, {N_HEADS} x {D_IN // N_HEADS})"
    )
    print(
        f"layer-{LAYER} attention at the last position: entropy {data_stats['attention_entropy_nats']:.2f} nats "
        f"(uniform: {math.log(CONTEXT):.2f}), largest weight {data_stats['attention_max_weight']:.3f} on average; "
        f"z variance in its top 200 directions: {data_stats['variance_in_top_200_directions']:.3f}"
    )
    print(
        f"stored_tokens: {z.shape[0]} ({args.sequences} x {CONTEXT}); fed {train.shape[0]}, "
        f"held-out {held_out.shape[0]} ({args.eval_sequences} sequences)"
    )
    print(f"collect_seconds: {collect_s:.1f}")
    print(
        f"d_in: {D_IN}  d_sae: {EXPANSION * D_IN}  batch: {args.batch}  steps: {args.steps} (first {warm} not timed)  "
        f"lr: {args.lr:g}  lr_warmup: {args.lr_warmup}  k: {args.k}  l1_coeff: {args.l1_coeff:g}"
    )
    print(
        f"torch_threads: {torch.get_num_threads()}  torch: {torch.__version__}  sae_lens: {_version('sae-lens')}  "
        f"load_avg_1min: {os.getloadavg()[0]:.2f}  glibc_large_buffers_kept: {tuned}"
    )
    print()
    print("held-out metrics: headlab's reconstruction_metrics for both (SAELens weights in a headlab SAE)")
    print(
        f"{'pair':<8} {'fitter':<8} {'tokens/s':>9} {'med_tok/s':>9} {'fit_s':>7} {'L0':>8} {'EV':>8} "
        f"{'MSE':>9} {'dead':>6}"
    )
    for (pair, who), (t, m) in rows.items():
        print(
            f"{pair:<8} {who:<8} {t.tokens_per_s:>9.0f} {t.median_tokens_per_s(args.batch):>9.0f} {t.seconds:>7.2f} "
            f"{m['l0']:>8.2f} {m['explained_variance']:>8.4f} {m['mse']:>9.4g} {m['dead_fraction']:>6.3f}"
        )
    print(
        "(tokens/s: timed steps / their total time; med_tok/s: batch / median step time; dead: latents that fire "
        "on no held-out token)"
    )
    print()
    for pair, (biggest, share) in diffs.items():
        print(
            f"{pair}_saelens_forward_vs_headlab_copy_max_abs_diff: {biggest:.3g} (tokens differing > 1e-4: {share:.4f})"
        )
    for pair in ("relu_l1", "topk"):
        if (pair, "headlab") not in rows:
            continue
        (th, mh), (ts, ms) = rows[(pair, "headlab")], rows[(pair, "saelens")]
        note = "matched by construction" if pair == "topk" else "NOT matched: the two L1 penalties differ"
        print(f"{pair}_tokens_per_s_headlab: {th.tokens_per_s:.0f}")
        print(f"{pair}_tokens_per_s_saelens: {ts.tokens_per_s:.0f}")
        print(f"{pair}_l0_headlab: {mh['l0']:.2f}  {pair}_l0_saelens: {ms['l0']:.2f}  ({note})")
        print(f"{pair}_explained_variance_headlab: {mh['explained_variance']:.4f}")
        print(f"{pair}_explained_variance_saelens: {ms['explained_variance']:.4f}")
        print(
            f"{pair}_throughput_ratio_median_step: "
            f"{th.median_tokens_per_s(args.batch) / ts.median_tokens_per_s(args.batch):.2f}"
        )
    (th, _), (ts, _) = rows[("topk", "headlab")], rows[("topk", "saelens")]
    return f"throughput_ratio_vs_saelens: {th.tokens_per_s / ts.tokens_per_s:.2f}"


# ---------------------------------------------------------------------------- main


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small run (well under a minute)")
    parser.add_argument("--steps", type=int, default=None, help="fitting steps per SAE (default 200; quick 8)")
    parser.add_argument("--batch", type=int, default=None, help="tokens per step (default 1024; quick 256)")
    parser.add_argument("--k", type=int, default=32, help="TopK: active latents per token")
    parser.add_argument("--l1-coeff", type=float, default=0.5, help="ReLU-L1 pair: l1 coefficient (both sides)")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument(
        "--lr-warmup", type=int, default=None, help="linear LR warm-up steps, both sides (default steps/10)"
    )
    parser.add_argument("--warmup-timing", type=int, default=2, help="first steps of every fit not timed")
    parser.add_argument(
        "--eval-sequences", type=int, default=None, help="held-out sequences of 64 tokens (default 256; quick 32)"
    )
    parser.add_argument(
        "--init-range", type=float, default=0.1, help="std of the random GPT-2 weights (GPT-2's own init: 0.02)"
    )
    parser.add_argument("--threads", type=int, default=2, help="torch threads, both fitters")
    parser.add_argument("--relu", action="store_true", help="also the ReLU-L1 pair (L0 not matched)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--data",
        choices=("both", "random", "smollm2"),
        default="both",
        help="random: the random GPT-2-shaped model's z; smollm2: smollm2-135m's z over --smollm2-text",
    )
    parser.add_argument("--smollm2-layer", type=int, default=5, help="smollm2-135m's layer whose z is fitted")
    parser.add_argument(
        "--smollm2-text",
        default="data/devil.txt",
        help="the real text smollm2's z is taken over (a shipped one: src/headlab/data/README.md)",
    )
    args = parser.parse_args()
    quick = args.quick
    args.steps = args.steps or (8 if quick else 200)
    args.batch = args.batch or (256 if quick else 1024)
    args.eval_sequences = args.eval_sequences or (32 if quick else 256)
    args.sequences = -(-args.steps * args.batch // CONTEXT) + args.eval_sequences  # every token fed once
    args.lr_warmup = args.lr_warmup if args.lr_warmup is not None else max(1, args.steps // 10)
    warm = args.warmup_timing
    if not 0 <= warm < args.steps:
        parser.error("--warmup-timing must be below --steps")
    if args.eval_sequences <= 0:
        parser.error("--eval-sequences must be positive")
    torch.set_num_threads(args.threads)
    tuned = tune_allocator()  # what headlab's CLI does in every process; this process runs both fitters
    wall = time.perf_counter()

    last = []
    if args.data != "smollm2":
        last.append(random_gpt2_pairs(args, warm, tuned))
    if args.data != "random":
        print()
        with tempfile.TemporaryDirectory(prefix="sae_speed-") as tmp:
            for line in smollm2_pair(args, Path(tmp), warm):
                print(line)
    print(f"peak_rss_mb: {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f}")
    print(f"wall_seconds: {time.perf_counter() - wall:.1f}")
    for line in last:
        print(line)
    return 0


def _version(dist: str) -> str:
    from importlib.metadata import version

    return version(dist)


if __name__ == "__main__":
    sys.exit(main())
