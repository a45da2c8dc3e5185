"""Posterior sampling for model=pathnet: collapsed HMC (V0 integrated out) against HMC on every weight.

Both target the same posterior; the collapsed sampler only needs the other weights and draws them with
large steps. This prints, per width: seconds, step size, acceptance, test accuracy of the posterior mean
predictor, and the relative Frobenius distance of each sampler's order parameter U from the theory's
and from the other sampler's.

    python benchmarks/markov_sampler.py [--widths 10 30] [--samples 300]
"""

from __future__ import annotations

import argparse
import time

import torch
from hydra import compose, initialize_config_dir

from headlab.analysis import paths as theory
from headlab.config import config_dir
from headlab.studies.pathnet import PathNetRun as Study


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.linalg.norm(a - b) / torch.linalg.norm(b))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--widths", type=int, nargs="+", default=[10, 30])
    parser.add_argument("--samples", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=200)
    args = parser.parse_args()
    torch.set_num_threads(2)
    for width in args.widths:
        runs = {}
        for collapsed in (True, False):
            overrides = [
                "experiment=markov_paths",
                f"model.width={width}",
                f"model.samples={args.samples}",
                f"model.warmup={args.warmup}",
                f"model.collapse_input={collapsed}",
                "model.sample_dtype=float64",
                "train.steps=0",
            ]
            with initialize_config_dir(str(config_dir()), version_base="1.3"):
                cfg = compose("config", overrides=overrides)
            study = Study(cfg)
            study.run_theory()
            start = time.perf_counter()
            study.run_samples()
            runs[collapsed] = (study, time.perf_counter() - start)
        theory_u = runs[True][0].u["theory"]
        print(
            f"width {width}: theory accuracy "
            f"{theory.accuracy(runs[True][0].predictions('theory'), runs[True][0].y_test):.3f}"
        )
        for collapsed, (study, seconds) in runs.items():
            info = study.info["sample"]
            name = "collapsed (V0 integrated)" if collapsed else "all weights"
            print(
                f"  {name:26s} {seconds:7.1f} s  step {info['step_size']:.4f}  accept {info['accept_rate']:.2f}  "
                f"accuracy {theory.accuracy(study.predictions('sample'), study.y_test):.3f}  "
                f"|U - U_theory|/|U_theory| {rel(study.u['sample'], theory_u):.3f}"
            )
        print(f"  |U_collapsed - U_all|/|U_all| {rel(runs[True][0].u['sample'], runs[False][0].u['sample']):.3f}")


if __name__ == "__main__":
    main()
