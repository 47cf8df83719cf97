#!/usr/bin/env bash
# `make test`: every test tier on the first ComfyUI version given, t1-t3 on the others (t0 imports no
# ComfyUI, so it runs once, as do the tests marked ``once``, which say why):
#
#   1. setup: each version's environment (devtools/env.sh; side by side), ruff once, the tiny
#      models (.cache/models: hard-linked from the machine's store, ~/.cache/patchbay/models, else
#      generated once and stored; then reused by every version)
#   2. one lane per version: its T1 (in process), then its T2 + T3 (a live server, Chromium); the lane
#      done first then runs t0 (pure, one torch thread; in the first version's environment). The lanes
#      run side by side on a machine with a core and 10 GB of RAM per version (each with cores /
#      versions torch threads, its server too; PATCHBAY_TEST_JOBS=1 or N forces in turn or side by
#      side), else in turn with every core.
#      Measured on a 2-core 23 GB machine: the two T1s side by side took 954 s of wall time, where
#      in turn they had taken 1644 + 986 s (one torch thread per process loses little on tiny
#      models); a whole run peaked at 8.9-10.2 GB of private memory (d17f124 to acd42fd: the two T1s, heavy tests
#      taking turns across the lanes: PATCHBAY_HEAVY_LOCK; the server restarted between T2 and T3,
#      tests/conftest.py). A server phase keeps about one core busy,
#      so beside the other lane's T1 it costs little. The first lane's output is shown live, the others' after it
#      (.cache/test-logs/<version>.log). Inductor runs on the last version only (tests/conftest.py
#      ``compile_backend``), which balances the lanes: the first carries the tests marked once.
#      Inductor's compiled kernels are cached beside the environments (~/.cache/patchbay/inductor).
#   3. a summary line per version, then a table of each tier's seconds and peak memory and the whole
#      run's (devtools/memwatch.py samples every process the run starts; tests/conftest.py names the
#      running tier); the exit status is 1 if any version failed, naming it.
#
# Usage: devtools/test_versions.sh VERSION [VERSION ...]   (PYTEST_ARGS: more pytest arguments)
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
unset PYTHONDONTWRITEBYTECODE  # cache bytecode, as the Makefile says (also when run without make)
[ $# -ge 1 ] || { echo "usage: devtools/test_versions.sh VERSION [VERSION ...]" >&2; exit 2; }
versions=("$@")
cores=$(nproc)
mem_gb=$(awk '/^MemTotal:/ { print int($2 / 1048576) }' /proc/meminfo 2>/dev/null || echo 0)
by_mem=$(( mem_gb / 10 )); by_cores=$cores
fit=$(( by_cores < by_mem ? by_cores : by_mem )); [ "$fit" -ge 1 ] || fit=1
jobs=${PATCHBAY_TEST_JOBS:-$fit}
[[ "$jobs" =~ ^[1-9][0-9]*$ ]] || { echo "PATCHBAY_TEST_JOBS=$jobs: give a positive integer" >&2; exit 2; }
read -r -a pytest_args <<< "${PYTEST_ARGS:-}"

declare -A env_dir env_pid
env_out="$(mktemp -d)"
for version in "${versions[@]}"; do  # side by side: unpacking wheels keeps one core busy each
    browser=""; [ "$version" = "${versions[0]}" ] && browser=--browser  # one apt-get at a time
    devtools/env.sh --comfyui "$version" $browser > "$env_out/$version" &
    env_pid[$version]=$!
done
for version in "${versions[@]}"; do
    wait "${env_pid[$version]}" && env_dir[$version]="$(cat "$env_out/$version")" \
        || { echo "make test: no environment for ComfyUI $version (see above)"; exit 1; }
done
rm -rf "$env_out"
first="${versions[0]}"
logs=".cache/test-logs"
labels="$logs/memory-labels"
rm -rf "$labels" "$logs"/report-*.json "$logs/memory.json"
mkdir -p "$labels"
start_all=$SECONDS
"${env_dir[$first]}/venv/bin/python" devtools/memwatch.py --pid $$ --labels "$labels" --out "$logs/memory.json" &
watcher=$!
"${env_dir[$first]}/venv/bin/python" -m ruff check . || { echo "make test: ruff found problems"; exit 1; }
for version in "${versions[@]}"; do
    echo "models $version" > "$labels/models"
    PATCHBAY_COMFYUI="${env_dir[$version]}/comfyui" "${env_dir[$version]}/venv/bin/python" \
        devtools/tiny_models.py || { echo "make test: tiny models failed on ComfyUI $version"; exit 1; }
done
rm -f "$labels/models"

declare -A status seconds
last="${versions[-1]}"
run_pytest() {  # $1 version, $2 phase name, $3 tiers; records status and seconds, returns the status
    local dir="${env_dir[$1]}" began=$SECONDS
    local once=""; [ "$1" = "$first" ] || once=1  # tests marked once: the first version only
    local backend=eager; [ "$1" = "$last" ] && backend=inductor  # compile tests: tests/conftest.py
    PATCHBAY_ONCE_DONE="$once" PATCHBAY_COMPILE_BACKEND="$backend" PATCHBAY_TIERS="$3" \
        PATCHBAY_HEAVY_LOCK="$logs/heavy-tests.lock" \
        PATCHBAY_COMFYUI="$dir/comfyui" \
        PATCHBAY_MEM_LABEL="$labels/$1-$2" PATCHBAY_TEST_REPORT="$logs/report-$1-$2.json" \
        "$dir/venv/bin/python" -m pytest "${pytest_args[@]}"
    local rc=$?
    [ "$rc" = 5 ] && { echo "(no test of tiers $3 selected on ComfyUI $1)"; rc=0; }  # PYTEST_ARGS chose others
    rm -f "$labels/$1-$2"
    echo "$rc $(( SECONDS - began ))" > "$logs/result-$1-$2"
    return $rc
}
record() {  # $1 version, $2 phase: fold the phase's result into the version's
    local rc secs
    read -r rc secs < "$logs/result-$1-$2" 2>/dev/null || { rc=1; secs="?"; }
    [ "$rc" = 0 ] || status[$1]=$rc
    seconds[$1]=$(( ${seconds[$1]:-0} + ${secs//\?/0} ))
}
lane() {  # $1 version: its T1, then its T2 + T3 (a live server and the frontend); then t0, if no
    local version=$1  # other lane has taken it (mkdir is atomic: the first lane to get there runs it)
    echo "=== ComfyUI $version: tier t1 (in process; $OMP_NUM_THREADS torch thread(s)) ==="
    run_pytest "$version" t1 t1
    echo "=== ComfyUI $version: tiers t2 t3 (a live server and the frontend) ==="
    run_pytest "$version" t2 "t2 t3"
    if mkdir "$logs/t0-taken" 2>/dev/null; then
        echo "=== tier t0 (ComfyUI $first's environment, 1 torch thread; in this lane, done first) ==="
        OMP_NUM_THREADS=1 run_pytest "$first" t0 t0
    fi
    return 0
}

rm -rf "$logs"/result-* "$logs/t0-taken"
export TORCHINDUCTOR_CACHE_DIR="${TORCHINDUCTOR_CACHE_DIR:-${PATCHBAY_CACHE:-$HOME/.cache/patchbay}/inductor}"
if [ "$jobs" -gt 1 ] && [ "${#versions[@]}" -gt 1 ]; then
    threads=$(( cores / ${#versions[@]} )); [ "$threads" -ge 1 ] || threads=1
    declare -A pid
    for version in "${versions[@]:1}"; do
        echo "=== ComfyUI $version: every tier in the background, output in $logs/$version.log ==="
        ( OMP_NUM_THREADS=$threads lane "$version" > "$logs/$version.log" 2>&1 ) &
        pid[$version]=$!
    done
    OMP_NUM_THREADS=$threads lane "$first"
    for version in "${versions[@]:1}"; do
        wait "${pid[$version]}"
        echo "=== ComfyUI $version: its output, run alongside ==="
        cat "$logs/$version.log"
    done
else
    for version in "${versions[@]}"; do OMP_NUM_THREADS=$cores lane "$version"; done
fi
for version in "${versions[@]}"; do
    for phase in t1 t2; do record "$version" "$phase"; done
done
record "$first" t0

failed=""
for version in "${versions[@]}"; do
    result=passed; [ -z "${status[$version]:-}" ] || { result="FAILED (pytest exit ${status[$version]})"; failed="$failed $version"; }
    echo "=== ComfyUI $version: $result in ${seconds[$version]} s of pytest ==="
done
echo "=== make test took $(( SECONDS - start_all )) s (tiny models included)$([ "$jobs" -gt 1 ] \
    && echo "; the versions' lanes side by side") ==="
kill -TERM "$watcher" 2>/dev/null; wait "$watcher"
echo "=== time and peak memory of each tier and of the whole run ==="
"${env_dir[$first]}/venv/bin/python" devtools/memwatch.py --seconds $(( SECONDS - start_all )) \
    --summarize "$logs/memory.json" "$logs"/report-*.json || echo "(no memory report: see $logs)"
if [ -n "$failed" ]; then echo "make test: FAILED on ComfyUI$failed (see above)"; exit 1; fi
echo "make test: passed on ComfyUI ${versions[*]}"
