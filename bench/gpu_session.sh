#!/usr/bin/env bash
# One-shot GPU session: prove every CUDA path and measure the GPU benchmark on a machine with a CUDA GPU and
# no package registry (the peers travel as wheels). Each stage fits in one 10-minute command.
#
#   bash bench/gpu_session.sh wheels        # HERE (a machine with PyPI): download the peers' wheels into .whl/
#   bash bench/gpu_session.sh test          # THERE: make test-gpu (GPU suite + key table; untimed)
#   bash bench/gpu_session.sh bench-large   # THERE: ludic-fast bench --preset gpu, the 3 large shapes
#   bash bench/gpu_session.sh bench-small   # THERE: the same at N = 64, 512, 2048
#   bash bench/gpu_session.sh suite         # THERE: the whole unit suite with CUDA visible
#   bash bench/gpu_session.sh e2e           # THERE: make bench-e2e-gpu (the trainer end to end)
#
# Several stages may share one call (`e2e bench-small`): together they get CALL_SECONDS (560, a device call's
# 600 s minus collection) from the script's start; each stage stops when that time is up, keeping its logs and
# the tables saved so far, and a stage that would get under 30 s is skipped. A device lease is 30 minutes with
# the machine's start: in priority order, `test`, `bench-large`, `e2e bench-small`, then `suite` if time is left.
# Every stage on the GPU machine first installs the carried wheels (from $WHEELS, default .whl) into /tmp/site
# and the project with --no-deps, so the machine's torch and triton are used as they are. Logs and results go
# to bench/results/gpu/ and are copied flat into $OUT (at most 8 files come back). DRY_RUN=1 prints the
# commands instead of running them.
set -euo pipefail

cd "$(dirname "$0")/.."
PY=${PY:-python3}
WHEELS=${WHEELS:-.whl}
SITE=${SITE:-/tmp/site}
RESULTS=bench/results/gpu
OUT=${OUT:-$RESULTS/out}
# all the stages of one call stop within this many seconds of its start (the device call's 600 s minus
# collection), so their logs and the tables the bench saves after each case still come back
CALL_SECONDS=${CALL_SECONDS:-560}
MIN_STAGE_SECONDS=30
# the peers and the packages they need that the GPU image lacks (versions as exercised on CPU)
PEER_WHEELS=(liger-kernel==0.8.5 trl==1.16.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19
             cut-cross-entropy==25.1.1)
LARGE=8192x4096x151936,16384x896x151936,32768x4096x128256
SMALL=64x4096x151936,512x4096x151936,2048x4096x151936

run() {
    if [[ ${DRY_RUN:-0} == 1 ]]; then
        printf '+ %s\n' "$*"
    else
        "$@"
    fi
}

logged() {  # logged NAME CMD...: run CMD, its output also in $RESULTS/NAME.log; the status is CMD's
    local name=$1
    shift
    mkdir -p "$RESULTS"
    if [[ ${DRY_RUN:-0} == 1 ]]; then
        printf '+ %s 2>&1 | tee %s\n' "$*" "$RESULTS/$name.log"
        return 0
    fi
    set +e
    PYTHONUNBUFFERED=1 "$@" 2>&1 | tee "$RESULTS/$name.log"
    local rc=${PIPESTATUS[0]}
    set -e
    return "$rc"
}

collect() {  # collect SRC NAME: copy SRC to $OUT/NAME when it exists
    if [[ -f $1 ]]; then
        run mkdir -p "$OUT"
        run cp "$1" "$OUT/$2"
    fi
}

download_wheels() {
    run "$PY" -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$WHEELS" "${PEER_WHEELS[@]}"
}

setup() {
    if compgen -G "$WHEELS/*.whl" >/dev/null; then
        run "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
            "$WHEELS"/*.whl
        export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
    else
        echo "no wheels in $WHEELS: the peers that are not installed will be reported as missing" >&2
    fi
    run "$PY" -m pip install -q --no-index --no-deps --no-build-isolation -e .
    mkdir -p "$RESULTS"
    if [[ ${DRY_RUN:-0} != 1 ]]; then
        {
            nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
            "$PY" -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'triton', triton.__version__, 'gpu', torch.cuda.is_available())"
            "$PY" -m pip list 2>/dev/null | grep -iE '^(torch|triton|transformers|liger|trl|datasets|cut|numpy) ' || true
        } | tee "$RESULTS/env.txt"
        collect "$RESULTS/env.txt" env.txt
    fi
}

limit=()
set_limit() {  # limit=(timeout ... SECONDS-LEFT-IN-THIS-CALL); status 1 when under MIN_STAGE_SECONDS are left
    local left=$((CALL_SECONDS - SECONDS))
    if ((left < MIN_STAGE_SECONDS)); then
        echo "stage '$1' skipped: ${left}s of the call's ${CALL_SECONDS}s left" >&2
        return 1
    fi
    limit=(timeout --kill-after=10 "$left")
}

bench() {  # bench NAME SHAPES
    local rc=0
    logged "bench-$1" "${limit[@]}" "$PY" -m ludic_fast.cli bench --preset gpu --shapes "$2" --out "$RESULTS/$1" || rc=$?
    collect "$RESULTS/$1/results.md" "$1-results.md"
    collect "$RESULTS/$1/results.json" "$1-results.json"
    if [[ -f $RESULTS/$1/results.json ]]; then  # our cases beside the cost model's predictions for this card
        run "$PY" bench/plan_table.py --device cuda --measured "$RESULTS/$1/results.json" \
            >"$RESULTS/$1/vs-model.md" || rc=$?
        collect "$RESULTS/$1/vs-model.md" "$1-vs-model.md"
    fi
    return "$rc"
}

stage() {
    set_limit "$1" || return 0
    case $1 in
        test)
            local rc=0
            logged test-gpu "${limit[@]}" make test-gpu GPU_PY="$PY" || rc=$?
            collect "$RESULTS/test-gpu.log" test-gpu.log
            collect "$RESULTS/key/results.md" key-results.md
            collect "$RESULTS/key/results.json" key-results.json
            return "$rc"
            ;;
        bench-large) bench large "$LARGE" ;;
        e2e)
            local rc=0
            run "${limit[@]}" make bench-e2e-gpu GPU_PY="$PY" || rc=$?
            collect "$RESULTS/trainer_e2e.md" trainer_e2e.md
            collect "$RESULTS/trainer_e2e.json" trainer_e2e.json
            return "$rc"
            ;;
        bench-small) bench small "$SMALL" ;;
        suite)
            local rc=0
            # the gpu-marked tests ran in `test`: here the CPU tests, to show no device default leaks into them
            # (12 workers when pytest-xdist is installed; it is not a requirement of the project)
            local workers=()
            if "$PY" -c "import xdist" 2>/dev/null; then workers=(-n 12); fi
            logged suite "${limit[@]}" "$PY" -m pytest -q -rs ${workers[@]+"${workers[@]}"} -p no:cacheprovider -m "not gpu" tests \
                --ignore=tests/interpret || rc=$?
            collect "$RESULTS/suite.log" suite.log
            return "$rc"
            ;;
    esac
}

if [[ $# -eq 0 ]]; then
    awk 'NR > 1 && /^#/ { print; next } NR > 1 { exit }' "$0"  # this header
    exit 2
fi
if [[ $1 == wheels ]]; then
    download_wheels
    exit 0
fi
for name in "$@"; do
    case $name in
        test | bench-large | bench-small | suite | e2e) ;;
        *)
            echo "unknown stage '$name' (wheels | test | bench-large | bench-small | suite | e2e)" >&2
            exit 2
            ;;
    esac
done
setup
status=0
for name in "$@"; do
    stage "$name" || status=$?
done
exit "$status"
