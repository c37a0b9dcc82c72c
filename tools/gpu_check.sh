#!/usr/bin/env bash
# tools/gpu_check.sh: the CUDA paths of p2pkv on a GPU machine, in one run of under 8
# minutes, results under $OUT. Without CUDA the same script is a dry run: the steps that
# apply run, the CUDA tests skip, pools are pageable, and the summary says so.
#
#   OUT=/tmp/gpucheck-out bash tools/gpu_check.sh                  # here: a dry run
#   GPU_CHECK_REQUIRE_CUDA=1 bash tools/gpu_check.sh               # on the GPU machine
#
# Steps, each under `timeout` (their sum stays inside GPU_CHECK_BUDGET_S, 450 s):
#   deps     import what p2pkv needs; where an import fails, install the wheels of .whl/
#            (`make gpu-wheels` downloads them) into $GPU_CHECK_SITE with pip --target
#            --no-index, put that on PYTHONPATH and check again
#   env      Python, torch, CUDA, the device, nvidia-smi
#   pytest   tests/test_engine.py (its CUDA tests skip without CUDA), tests/test_pool_store.py
#            and tests/test_shm.py (their pools are pinned, or registered, where CUDA is)
#   fetch    tools/gpu_check.py fetch: pools; a producer process and three consumer nodes on
#            127.0.0.1 (data stream, ZeroMQ frames, shared memory; a fourth, one-sided NIXL
#            reads, where NIXL is installed), every block fetched into
#            the consumer's pinned pool and again into a pinned staging buffer; the blocks
#            copied into CUDA tensors by EngineKVCopier (its copy stream) and back, and the
#            staging buffer to the device and back; every byte checked, GB/s of each
#   summary  tools/gpu_check.py summarize: gpu_check.json and summary.txt, printed last
#
# Files under $OUT (7): gpu_check.json, summary.txt, env.txt, install.log, pytest.log,
# pytest.xml, fetch.log.
#
# Runtime dependencies of p2pkv (what importing p2pkv.node and p2pkv.store.engine loads
# beyond the standard library): torch, pyzmq (imported as zmq), msgpack, xxhash, numpy;
# tomli only on Python < 3.11. The tests also need pytest, pytest-timeout and hypothesis.
# On the GPU machine (Python 3.12, torch with CUDA) everything but pyzmq is installed:
# pyzmq is the only wheel carried (.whl/, `make gpu-wheels`; see docs/gpu.md). p2pkv
# itself is not installed: the repository root goes on PYTHONPATH.
#
# Environment: OUT (default /tmp/gpu_check-out); PYTHON (default: python3 if it imports
# torch, else .venv/bin/python of this checkout or of the main checkout of its worktree);
# GPU_CHECK_REQUIRE_CUDA=1 (no CUDA is a failure, not a dry run); GPU_CHECK_FETCH_MIB
# (default 1024 with CUDA, 64 without); GPU_CHECK_BUDGET_S (450); GPU_CHECK_WHEELS (.whl);
# GPU_CHECK_SITE (/tmp/p2pkv-gpu-site); GPU_CHECK_INSTALL (auto: only when an import
# fails; always; never).
#
# Exit status: 0 when every check that applies passed, 1 otherwise.
set -u -o pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT" || exit 1
START=$SECONDS
BUDGET=${GPU_CHECK_BUDGET_S:-450}
RESERVE=40 # seconds kept for the summary
OUT=${OUT:-/tmp/gpu_check-out}
WHEELS=${GPU_CHECK_WHEELS:-$ROOT/.whl}
SITE=${GPU_CHECK_SITE:-/tmp/p2pkv-gpu-site}
INSTALL=${GPU_CHECK_INSTALL:-auto}
REQUIRE_CUDA=${GPU_CHECK_REQUIRE_CUDA:-0}
IMPORTS='import torch, zmq, msgpack, xxhash, numpy'
export PYTHONUNBUFFERED=1
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"

mkdir -p "$OUT" || exit 1
rm -f "$OUT"/gpu_check.json "$OUT"/summary.txt "$OUT"/env.txt "$OUT"/install.log \
    "$OUT"/pytest.log "$OUT"/pytest.xml "$OUT"/fetch.log
WORK=$(mktemp -d /tmp/gpu_check.XXXXXX) || exit 1
trap 'rm -rf "$WORK"' EXIT
STEPS=$WORK/steps.tsv
: >"$STEPS"

pick_python() {
    if [ -n "${PYTHON:-}" ]; then
        echo "$PYTHON"
        return
    fi
    if command -v python3 >/dev/null 2>&1 &&
        timeout -k 5 60 python3 -c 'import torch' >/dev/null 2>&1; then
        echo python3
        return
    fi
    local main
    main=$(timeout 10 git -C "$ROOT" rev-parse --git-common-dir 2>/dev/null) &&
        main=$(cd "$ROOT" && cd "$main/.." 2>/dev/null && pwd) || main=$ROOT
    for candidate in "$ROOT/.venv/bin/python" "$main/.venv/bin/python"; do
        if [ -x "$candidate" ]; then
            echo "$candidate"
            return
        fi
    done
    echo python3
}
PY=$(pick_python)

# run_step NAME CAP LOG CMD...: CMD under `timeout` (CAP seconds at most, less when the
# budget is short), its output shown and appended to LOG; NAME, rc, seconds and the limit
# go to steps.tsv for the summary.
run_step() {
    local name=$1 cap=$2 log=$3
    shift 3
    local left=$((BUDGET - RESERVE - (SECONDS - START)))
    local limit=$((cap < left ? cap : left))
    if ((limit < 5)); then
        echo "== $name: not run, the ${BUDGET} s budget is spent" | tee -a "$log"
        printf '%s\t%s\t%s\t%s\n' "$name" 124 0 0 >>"$STEPS"
        return 124
    fi
    echo "== $name (timeout ${limit} s): $*" | tee -a "$log"
    local t0=$SECONDS rc
    timeout -k 5 "$limit" "$@" 2>&1 | tee -a "$log"
    rc=${PIPESTATUS[0]}
    printf '%s\t%s\t%s\t%s\n' "$name" "$rc" $((SECONDS - t0)) "$limit" >>"$STEPS"
    echo "== $name: rc=$rc in $((SECONDS - t0)) s" | tee -a "$log"
    return "$rc"
}

echo "p2pkv GPU check: root $ROOT, results in $OUT, python $PY, budget ${BUDGET} s"

# -- deps: install the carried wheels only where an import fails (or when asked to).
LOG=$OUT/install.log
missing=0
timeout -k 5 90 "$PY" -c "$IMPORTS" >>"$LOG" 2>&1 || missing=1
if [ "$INSTALL" = always ] || { [ "$INSTALL" = auto ] && [ "$missing" = 1 ]; }; then
    shopt -s nullglob
    wheels=("$WHEELS"/*.whl)
    shopt -u nullglob
    if [ ${#wheels[@]} -eq 0 ]; then
        echo "an import fails and $WHEELS holds no wheel (make gpu-wheels downloads them)" |
            tee -a "$LOG" "$WORK/problems.txt"
    else
        run_step install 120 "$LOG" "$PY" -m pip install -q --no-index --no-deps \
            --no-compile --no-cache-dir --upgrade --target "$SITE" "${wheels[@]}"
        export PYTHONPATH="$ROOT:$SITE${PYTHONPATH#"$ROOT"}"
    fi
else
    echo "nothing installed: every import works (GPU_CHECK_INSTALL=$INSTALL)" >>"$LOG"
fi
run_step deps 90 "$LOG" "$PY" -c "$IMPORTS; import zmq; print('imports ok; pyzmq', \
zmq.__version__, 'from', zmq.__file__)"

# -- env
LOG=$OUT/env.txt
run_step env 90 "$LOG" "$PY" tools/gpu_check.py env --json "$WORK/env.json"
if command -v nvidia-smi >/dev/null 2>&1; then
    timeout -k 5 30 nvidia-smi >>"$LOG" 2>&1 || echo "nvidia-smi: rc=$?" >>"$LOG"
else
    echo "nvidia-smi: not found" >>"$LOG"
fi

# -- pytest: the CUDA tests, and the pool tests whose pools CUDA changes.
run_step pytest 180 "$OUT/pytest.log" "$PY" -m pytest tests/test_engine.py \
    tests/test_pool_store.py tests/test_shm.py -v -rA -p no:cacheprovider \
    --junitxml="$OUT/pytest.xml"

# -- fetch between two nodes into pinned memory, then into CUDA tensors.
run_step fetch 200 "$OUT/fetch.log" "$PY" tools/gpu_check.py fetch \
    --json "$WORK/fetch.json" --mib "${GPU_CHECK_FETCH_MIB:-0}"

# -- summary (standard library only: it reports even when torch or pyzmq does not import)
args=(--work "$WORK" --out "$OUT" --elapsed $((SECONDS - START)))
[ "$REQUIRE_CUDA" = 1 ] && args+=(--require-cuda)
echo
echo "== summary"
timeout -k 5 30 "$PY" tools/gpu_check.py summarize "${args[@]}"
rc=$?
if [ ! -s "$OUT/gpu_check.json" ]; then
    printf '{"ok": false, "cuda": null, "problems": ["the summary step failed: rc=%s"]}\n' \
        "$rc" >"$OUT/gpu_check.json"
    echo "RESULT: FAILED (the summary step failed: rc=$rc)" | tee "$OUT/summary.txt"
    rc=1
fi
echo "results: $OUT ($((SECONDS - START)) s)"
exit "$rc"
