#!/usr/bin/env bash
# `make test`'s stages (the Makefile's `test` target sets the variables below). .venv builds first; the other venvs
# build in the background while the unit suite runs (the pip -e steps take turns, the Makefile's EDITABLE; log in
# build/venvs.log): built beside .venv instead, all five took 168-205 s together before the unit suite could start,
# against 100 s for .venv alone. After the unit suite, three lanes run at once, each its stages in order, each line
# of output prefixed with its lane's name:
#   kernels     the interpreter smoke (.venv's triton), the kernel compile test and the interpreter suite (triton 3.6)
#   vllm        verl's tests (.venv-verl), then vLLM's ludic-fast runs (vllm-runs: VLLM_RUNS, in .venv-vllm)
#   services    verifiers 0.4's tests (.venv-verifiers; uv prepares its harness program from the venv's local wheels,
#               tools/harness_wheels.py), then the other vLLM tests (vllm-engine: engine, servers)
# The vLLM and verifiers tests keep about one core busy (process starts, served models), the kernels lane two: one
# after another they left a core idle for most of their ~370 s, and the vLLM tests alone were the longest lane.
# Every stage runs even after one fails, each prints its time, and the exit status is 1 if any failed; the last lines
# of each failed stage are printed again at the end (a CI log shows its tail).
set -u
: "${PY:?} ${XDIST:?} ${INTERPRET_SMOKE:?} ${SUBMAKE:?} ${STAMP:?}"
: "${TRITON36_PY:?} ${TRITON36_STAMP:?} ${VERL_PY:?} ${VERL_STAMP:?} ${VLLM_PY:?} ${VLLM_VENV:?} ${VLLM_STAMP:?}"
: "${VERIFIERS_PY:?} ${VERIFIERS_VENV:?} ${VERIFIERS_STAMP:?}"

status=0 failed=""
mkdir -p build
: > build/venvs.log
rm -f build/built-* build/lane-*.failed build/stage-*.log

stage() {  # stage NAME COMMAND...: runs it, prints its time, records a failure; its output also in build/stage-NAME.log
    local name=$1 t=$SECONDS rc=0
    shift
    echo "== make test: $name"
    { "$@"; } > >(tee "build/stage-$name.log") 2>&1 || rc=$?
    wait $!  # tee's last lines before the stage's time
    [ $rc = 0 ] || { status=1; failed="$failed $name"; }
    echo "== make test: $name took $((SECONDS - t)) s"
    return $rc
}

build_in_background() {  # build_in_background NAME STAMP...: builds the venvs, then leaves build/built-NAME
    # written aside and renamed: `built` must never read the file between its creation and its content
    { $SUBMAKE "${@:2}" >> build/venvs.log 2>&1; echo $? > "build/built-$1.part"
      mv "build/built-$1.part" "build/built-$1"; } &
}

built() {  # built NAME: waits for the background build NAME; fails, with the build's log, if it failed
    while [ ! -e "build/built-$1" ]; do sleep 1; done
    [ "$(cat "build/built-$1")" = 0 ] && return 0
    echo "== make test: building $1 failed (build/venvs.log):"
    cat build/venvs.log
    return 1
}

kernels_lane() {
    stage interpreter-smoke env TRITON_INTERPRET=1 "$PY" -m pytest -q -rfEs $INTERPRET_SMOKE
    if stage venv-triton36 built triton36; then
        stage compile-triton36 "$TRITON36_PY" -m pytest -q -rfEs tests/test_kernel_compile.py
        stage interpreter-triton36 env TRITON_INTERPRET=1 "$TRITON36_PY" -m pytest $XDIST -q -rfEs \
            --junitxml=build/junit-interpreter.xml tests/interpret
    fi
}

vllm_stage() {  # vllm_stage NAME TEST_FILES...: vLLM's tests in .venv-vllm, a JUnit file per stage
    local name=$1
    shift
    stage "$name" env LUDIC_FAST_REQUIRE_VLLM="$(test -e "$VLLM_VENV/no-vllm" && echo 0 || echo 1)" \
        "$VLLM_PY" -m pytest -q -rfEs --junitxml="build/junit-$name.xml" "$@"
}

VLLM_RUNS="tests/test_vllm_agents.py tests/test_vllm_train.py tests/test_vllm_pipeline.py"  # the ludic-fast runs

vllm_lane() {
    stage venvs-verl-vllm built verl-vllm || return
    stage verl env LUDIC_FAST_REQUIRE_VERL=1 "$VERL_PY" -m pytest -q -rfEs tests/test_integration_verl.py
    vllm_stage vllm-runs $VLLM_RUNS
}

services_lane() {
    if stage venv-verifiers built verifiers; then
        stage verifiers-0.4 env PATH="$PWD/$VERIFIERS_VENV/bin:$PATH" UV_FIND_LINKS="$PWD/$VERIFIERS_VENV/harness/wheels" \
            UV_DEFAULT_INDEX="file://$PWD/$VERIFIERS_VENV/harness/empty-index" \
            LUDIC_FAST_REQUIRE_VERIFIERS="$(test -e "$VERIFIERS_VENV/no-verifiers" && echo 0 || echo 1)" \
            "$VERIFIERS_PY" -m pytest -q -rfEs tests/test_verifiers_v04.py
    fi
    built verl-vllm > /dev/null || return  # the vllm lane names a failed build
    local file rest=()
    for file in tests/test_vllm*.py; do [[ " $VLLM_RUNS " = *" $file "* ]] || rest+=("$file"); done
    vllm_stage vllm-engine "${rest[@]}"
}

start_lane() {  # start_lane NAME: runs NAME_lane in the background, its lines prefixed, its failures kept in a file
    { status=0 failed=""; "$1_lane"; echo "$failed" > "build/lane-$1.failed"; } 2>&1 | sed -u "s/^/[$1] /" &
}

# a full disk fails builds and tests with errors far from the cause (a CI run failed so, the disk 97 % full)
free_gib=$(df -Pk . | awk 'NR == 2 { print int($4 / 1048576) }')
echo "== make test: $free_gib GiB free here; a fresh clone's venvs and caches take about 13 GiB"
[ "$free_gib" -ge 15 ] || echo "== make test: WARNING: under 15 GiB free: expect 'No space left on device' failures" >&2
stage venv $SUBMAKE "$STAMP"
build_in_background triton36 "$TRITON36_STAMP"
build_in_background verl-vllm "$VERL_STAMP" "$VLLM_STAMP"
build_in_background verifiers "$VERIFIERS_STAMP"
lanes="vllm services"
if [ $status = 0 ]; then
    stage unit "$PY" -m pytest $XDIST -q -rfEs --junitxml=build/junit-unit.xml tests --ignore=tests/interpret
    lanes="kernels $lanes"
fi
for lane in $lanes; do start_lane "$lane"; done
wait
for lane in $lanes; do  # a lane that left no file ended abnormally
    failed="$failed$(cat "build/lane-$lane.failed" 2>/dev/null || echo " $lane")"
done
[ -z "$failed" ] || status=1
for name in $failed; do  # each failure's own summary again at the end, where a log's tail shows it
    [ -e "build/stage-$name.log" ] || continue
    echo "== make test: the last lines of $name (build/stage-$name.log):"
    grep -v '^SKIPPED ' "build/stage-$name.log" | tail -n 40 | sed "s/^/[$name] /"  # pytest lists skips after failures
done
echo "== make test: $SECONDS s in all; failed:${failed:- none}"
exit $status
