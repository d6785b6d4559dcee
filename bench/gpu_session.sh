#!/usr/bin/env bash
# The GPU session in calls on a machine with one CUDA GPU and no package registry (the peers travel as
# wheels), rehearsed on the CPU. Plain bash and python: no make needed there.
#
#   bash bench/gpu_session.sh wheels     # HERE (a machine with PyPI): the peers' wheels into .whl/
#   bash bench/gpu_session.sh run1       # THERE, call 1 (<= 480 s): the whole core suite's verdict, decisive numbers
#   bash bench/gpu_session.sh run2       # THERE, call 2 (<= 230 s): the trainer race, then its profile
#   bash bench/gpu_session.sh run3       # THERE, only with device time left: DPO / JSD vs Liger, D=896 strategies, TMA
#   bash bench/gpu_session.sh run4       # THERE, likewise: the memory race (the largest batch each trainer fits)
#   bash bench/gpu_session.sh rehearse   # HERE, on the CPU: run1 to run4 at tiny shapes (see below)
#   bash bench/gpu_session.sh rehearse run1   # ... one call only
#   STAGES="decisive" bash bench/gpu_session.sh run1   # only these stages of the call (a rerun), still in order
#
# Stages, their seconds and the bench cases of each come from bench/gpu_plan.py (its budget table sizes them
# from the last GPU run's times). Each stage runs under `timeout` for its seconds or what is left of the call's,
# whichever is less (the call's last stage: all that is left, for its LEFTOVER_IMPLS), and keeps what it
# measured when cut: the suite rewrites its verdict after every test (and
# on SIGTERM) and stops itself 10 s inside the stage, each bench implementation writes its tables after every
# case, the trainer end to end its rows after every path, the profile its tables after every run. A stage that
# would get under 15 s is skipped, and says so. The suite runs each group as SUITE_SHARDS (3) pytest processes
# at once: its tests mostly compile kernels and run Python, which the machine's 16 cores do side by side, so a
# stage that ends early leaves its seconds to the session's later calls. A failing test is a section of the
# verdict with its message and traceback; a hanging test or bench case costs its own limit (TEST_SECONDS, CASE_SECONDS) and the stage goes on.
# Everything lands in $RESULTS (default bench/results/gpu; the rehearsal: bench/results/gpu-rehearsal) and, at
# most 8 files per call, flat in $OUT (default $RESULTS/out-CALL): session-CALL.log, results-CALL.tar.gz (the
# whole folder so far, after every stage and every bench implementation), the suite verdicts and the main
# tables (the trainer race's and the profile's written there as they grow): a call the machine cuts still
# brings back what it measured, but for the bench implementation or the trainer path it was in.
# Rehearsal: the same stages, orderings and time limits on the CPU at tiny shapes; stubbed, and said so in the
# logs: no wheels or installs (the project is used in place), no nvidia-smi; the gpu-marked tests skip (needs
# CUDA), the CUDA-only implementations are reported as skipped, the trainer runs a 1-layer model.
set -euo pipefail

cd "$(dirname "$0")/.."
PY_SET=${PY:+1}
PY=${PY:-python3}
WHEELS=${WHEELS:-.whl}
SITE=${SITE:-/tmp/site}
TEST_SECONDS=${TEST_SECONDS:-60}
SUITE_SHARDS=${SUITE_SHARDS:-3}  # pytest processes per suite group at once (bench/gpu_suite.py --shards)
CASE_SECONDS=${CASE_SECONDS:-60}
TIME_SCALE=${TIME_SCALE:-1}  # an integer factor on every call's and stage's seconds (a slow rehearsal machine)
MIN_STAGE_SECONDS=15
PEER_WHEELS=(liger-kernel==0.8.5 trl==1.16.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19
             cut-cross-entropy==25.1.1)

usage() { awk 'NR > 1 && /^#/ { print; next } NR > 1 { exit }' "$0"; }

if [[ $# -lt 1 || $# -gt 2 || ($# -eq 2 && $1 != rehearse) ]]; then
    usage
    exit 2
fi
case $1 in
    wheels)
        exec "$PY" -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
            --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
            --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$WHEELS" "${PEER_WHEELS[@]}" ;;
    run1 | run2 | run3 | run4) CALLS=("$1") TINY=0 ;;
    rehearse)
        CALLS=("${2:-run1}") TINY=1
        [[ $# -eq 1 ]] && CALLS=(run1 run2 run3 run4)
        if [[ ! ${CALLS[0]} =~ ^run[1234]$ ]]; then
            echo "unknown call '${CALLS[0]}' (run1 | run2 | run3 | run4)" >&2
            exit 2
        fi ;;
    *)
        echo "unknown command '$1' (wheels | run1 | run2 | run3 | run4 | rehearse)" >&2
        exit 2 ;;
esac
if ((TINY)); then
    [[ -z $PY_SET && -x .venv/bin/python ]] && PY=.venv/bin/python  # here: the project's venv, unless PY is set
    RESULTS=${RESULTS:-bench/results/gpu-rehearsal}
else
    RESULTS=${RESULTS:-bench/results/gpu}
fi
OUT_SET=${OUT:-}
mkdir -p "$RESULTS"
export PYTHONUNBUFFERED=1

say() { echo "[session] $*" | tee -a "$LOG" >&2; }

logged() {  # logged NAME SECONDS CMD...: CMD under `timeout SECONDS`, its output also in $RESULTS/NAME.log
    local name=$1 secs=$2 rc=0
    shift 2
    say "$name: $* (limit ${secs}s)"
    timeout --kill-after=5 "$secs" "$@" > >(tee "$RESULTS/$name.log") 2>&1 || rc=$?
    wait
    ((rc == 124 || rc == 137)) && say "$name: cut at its ${secs}s limit"
    ((rc != 0 && rc != 124 && rc != 137)) && say "$name: exit status $rc"
    return "$rc"
}

stage_setup() {
    if ((TINY)); then
        say "setup (rehearsal, stubbed): no wheels, no installs, the project is used in place; no GPU"
        {
            echo "REHEARSAL on the CPU: $(uname -m), $(nproc) CPUs, no GPU"
            "$PY" -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
        } >"$RESULTS/env.txt" 2>&1
        return 0
    fi
    if compgen -G "$WHEELS/*.whl" >/dev/null; then
        logged setup-wheels "$1" "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
            --upgrade --target "$SITE" "$WHEELS"/*.whl
        export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
    else
        say "no wheels in $WHEELS: the peers that are not installed are reported as missing"
    fi
    logged setup-project "$1" "$PY" -m pip install -q --no-index --no-deps --no-build-isolation -e .
    {
        nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || echo "no nvidia-smi"
        "$PY" -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', \
triton.__version__, 'gpu', torch.cuda.is_available())"
        "$PY" -m pip list 2>/dev/null | grep -iE '^(torch|triton|transformers|liger|trl|datasets|cut|numpy|pytest) ' || true
    } >"$RESULTS/env.txt" 2>&1
}

suite() {  # suite GROUP SECONDS: the suite stops itself 10 s inside the stage's limit, verdict written
    local prior=() dup=() prior_file
    for prior_file in $("$PY" bench/gpu_plan.py value suite-prior); do  # the last GPU run's jsonl (one per shard)
        [[ $1 == core && -f $prior_file ]] && prior+=(--prior "$prior_file")
    done
    [[ $1 == core ]] && dup=(--drop-duplicates)
    logged "suite-$1-run" "$2" "$PY" bench/gpu_suite.py --out "$RESULTS" --group "$1" --seconds "$(($2 - 10))" \
        --test-seconds "$TEST_SECONDS" --shards "$SUITE_SHARDS" --verdict-copy "$OUT" "${prior[@]}" "${dup[@]}"
}

bench_stage() {  # bench_stage STAGE SECONDS: each implementation in its own process, then the stage's tables
    local stage=$1 end=$((SECONDS + $2 - 10)) rc=0 impl left tiny=()  # 10 s kept for the tables
    ((TINY)) && tiny=(--tiny)
    rm -rf "${RESULTS:?}/$stage"  # another run's tables in it would be merged into this one's
    for impl in $("$PY" bench/gpu_plan.py impls "$stage"); do
        left=$((end - SECONDS))
        if ((left < 5)); then
            say "$stage: no time left for $impl"
            rc=1
            continue
        fi
        # shellcheck disable=SC2046  # the arguments are words
        logged "$stage-$impl" "$left" "$PY" -m ludic_fast.cli bench $("$PY" bench/gpu_plan.py args "$stage" "$impl" \
            "${tiny[@]}") --timeout "$CASE_SECONDS" --out "$RESULTS/$stage/$impl" || rc=1
        snapshot  # each implementation's tables reach $OUT at once: a call cut by the machine keeps them
    done
    "$PY" bench/gpu_plan.py merge "$RESULTS/$stage" >>"$LOG" 2>&1 || rc=1
    if [[ -f $RESULTS/$stage/results.json ]]; then
        cp "$RESULTS/$stage/results.md" "$OUT/$stage-results.md"
        if ((end + 10 - SECONDS >= 20)); then  # our cases beside the cost model's predictions
            "$PY" bench/plan_table.py --device "$( ((TINY)) && echo cpu || echo cuda)" --measured \
                "$RESULTS/$stage/results.json" >"$RESULTS/$stage/vs-model.md" 2>>"$LOG" || rc=1
        else
            say "$stage: vs-model.md left for later (time): python bench/plan_table.py --device <card preset>" \
                "--measured $RESULTS/$stage/results.json"
        fi
    fi
    return "$rc"
}

tiny_trainer=(--device cpu --vocab 4099 --hidden 32 --layers 1 --seqs 2 --seq-len 24 --steps 1 --threads 1)

race() {  # race NAME SECONDS FILE ARGS...: bench/trainer_e2e.py on the plan's paths, FILE.json / .md
    # the table is rewritten in $OUT after every path, so that a call cut by the machine still brings it back
    local name=$1 secs=$2 file=$3 args=(--device cuda)
    shift 3
    ((TINY)) && args=("${tiny_trainer[@]}")
    logged "$name" "$secs" "$PY" bench/trainer_e2e.py "${args[@]}" \
        --paths "$("$PY" bench/gpu_plan.py value e2e-paths)" "$@" \
        --json "$RESULTS/$file.json" --markdown "$OUT/$file.md"
    local rc=$?
    [[ -f $OUT/$file.md ]] && cp "$OUT/$file.md" "$RESULTS/$file.md"
    return "$rc"
}

stage_e2e() { race e2e "$1" trainer_e2e; }

stage_find_max() {  # the race's first rows, then the search for what they leave (gpu_plan find-max-seconds)
    race find-max "$1" find_max --find-max --find-max-seconds "$("$PY" bench/gpu_plan.py find-max-seconds "$1")"
}

stage_profile() {  # the script bounds itself by --seconds; the stage's timeout is the backstop
    if [[ ! -f bench/trainer_profile.py ]]; then
        say "profile: skipped, bench/trainer_profile.py is not in this tree"
        return 1
    fi
    local args=(--device cuda)
    ((TINY)) && args=("${tiny_trainer[@]}")
    # written in $OUT (profile.md, profile.jsonl) after every run: a call cut by the machine still brings it back
    rm -rf "${RESULTS:?}/profile" "$OUT/profile.md" "$OUT/profile.jsonl"
    logged profile "$1" "$PY" bench/trainer_profile.py "${args[@]}" --seconds "$(($1 - 10))" --out "$OUT"
    local rc=$?
    mkdir -p "$RESULTS/profile"
    cp "$OUT"/profile.* "$RESULTS/profile/" 2>/dev/null || true
    return "$rc"
}

selected() {  # selected STAGE: whether STAGES (when set) names it
    [[ -z ${STAGES:-} || " $STAGES " == *" $1 "* ]]
}

snapshot() {  # the results folder so far into $OUT (this call's tarball)
    tar -czf "$OUT/results-$call.tar.gz" --exclude='./out*' -C "$RESULTS" . 2>/dev/null || true
}

run_stage() {  # run_stage NAME SECONDS
    case $1 in
        setup) stage_setup "$2" ;;
        suite) suite core "$2" ;;
        experimental)  # half for the TMA tests, the rest for the TMA bench cases
            local rc=0 start=$SECONDS
            suite experimental "$(($2 / 2))" || rc=1
            bench_stage experimental "$(($2 - (SECONDS - start)))" || rc=1
            return "$rc" ;;
        e2e) stage_e2e "$2" ;;
        find-max) stage_find_max "$2" ;;
        profile) stage_profile "$2" ;;
        *) bench_stage "$1" "$2" ;;
    esac
}

status=0
for call in "${CALLS[@]}"; do
    OUT=${OUT_SET:-$RESULTS/out-$call}  # a device call empties its $OUT: one per call here too
    mkdir -p "$OUT"
    LOG=$RESULTS/session-$call.log
    : >"$LOG"
    start=$SECONDS call_status=0  # this call's; $status: the whole session's (the exit status)
    mapfile -t plan < <("$PY" bench/gpu_plan.py seconds "$call")
    call_seconds=$((${CALL_SECONDS:-${plan[0]#call }} * TIME_SCALE))
    say "$call: ${call_seconds}s in all$( ((TINY)) && echo ', REHEARSAL on the CPU at tiny shapes')"
    last=
    for line in "${plan[@]:1}"; do  # the call's last selected stage
        selected "${line% *}" && last=${line% *}
    done
    for line in "${plan[@]:1}"; do
        stage=${line% *} given=$((${line#* } * TIME_SCALE))
        if ! selected "$stage"; then
            say "stage $stage not selected (STAGES=$STAGES)"
            continue
        fi
        left=$((call_seconds - (SECONDS - start)))
        if ((left < MIN_STAGE_SECONDS)); then
            say "stage $stage skipped: ${left}s of the call's ${call_seconds}s left"
            call_status=1
            continue
        fi
        secs=$((given < left ? given : left))
        [[ $stage == "$last" ]] && secs=$left  # the last stage takes what earlier ones left (LEFTOVER_IMPLS)
        t0=$SECONDS
        set +e
        run_stage "$stage" "$secs"
        rc=$?
        set -e
        say "stage $stage: ${secs}s given, $((SECONDS - t0))s taken, status $rc"
        ((rc == 0)) || call_status=1
        snapshot
    done
    say "$call done in $((SECONDS - start))s, status $call_status"
    ((call_status == 0)) || status=1
    cp "$LOG" "$OUT/"
done
exit "$status"
