#!/usr/bin/env bash
# `make test`: every test tier on the first ComfyUI version given, t1-t3 on the others (t0 imports no
# ComfyUI, so it runs once), side by side when the machine has a core and 16 GB of RAM for each.
#
#   1. serial setup: each version's environment (devtools/env.sh --browser), ruff once, the tiny
#      models (generated once into .cache/models, then reused by every version)
#   2. pytest per version: the first in the foreground (its output live); the others at the same time
#      into .cache/test-logs/pytest-<version>.log, printed whole when the first is done. With N
#      versions on C cores, each gets max(1, C / N) torch threads (OMP_NUM_THREADS), so they do not
#      oversubscribe the cores. On a smaller machine (or PATCHBAY_TEST_JOBS=1) they run one after
#      another; PATCHBAY_TEST_JOBS=2 forces them side by side.
#   3. a summary line per version; the exit status is 1 if any version failed, naming it.
#
# Usage: devtools/test_versions.sh VERSION [VERSION ...]   (PYTEST_ARGS: more pytest arguments)
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
[ $# -ge 1 ] || { echo "usage: devtools/test_versions.sh VERSION [VERSION ...]" >&2; exit 2; }
versions=("$@")
cores=$(nproc)
# One version's pytest peaks near 10 GB (in-process ComfyUI with every tiny model, next to a T2/T3
# server and Chromium): side by side needs 16 GB of RAM per version, or the two thrash the page cache.
mem_gb=$(awk '/^MemTotal:/ { print int($2 / 1048576) }' /proc/meminfo 2>/dev/null || echo 0)
by_mem=$(( mem_gb / 16 )); [ "$by_mem" -ge 1 ] || by_mem=1
jobs=${PATCHBAY_TEST_JOBS:-$(( cores < by_mem ? cores : by_mem ))}
[[ "$jobs" =~ ^[1-9][0-9]*$ ]] || { echo "PATCHBAY_TEST_JOBS=$jobs: give a positive integer" >&2; exit 2; }
read -r -a pytest_args <<< "${PYTEST_ARGS:-}"

declare -A env_dir
for version in "${versions[@]}"; do
    env_dir[$version]="$(devtools/env.sh --comfyui "$version" --browser)" \
        || { echo "make test: no environment for ComfyUI $version (see above)"; exit 1; }
done
first="${versions[0]}"
"${env_dir[$first]}/venv/bin/python" -m ruff check . || { echo "make test: ruff found problems"; exit 1; }
for version in "${versions[@]}"; do
    PATCHBAY_COMFYUI="${env_dir[$version]}/comfyui" "${env_dir[$version]}/venv/bin/python" \
        devtools/tiny_models.py || { echo "make test: tiny models failed on ComfyUI $version"; exit 1; }
done

run_pytest() {  # $1 version, $2 tiers ("" = all); pytest's exit status
    local dir="${env_dir[$1]}"
    PATCHBAY_TIERS="$2" PATCHBAY_COMFYUI="$dir/comfyui" "$dir/venv/bin/python" -m pytest "${pytest_args[@]}"
}

parallel=0
if [ "${#versions[@]}" -gt 1 ] && [ "$jobs" -gt 1 ]; then
    parallel=1
    threads=$(( cores / ${#versions[@]} )); [ "$threads" -ge 1 ] || threads=1
    export OMP_NUM_THREADS=$threads
fi
logs=".cache/test-logs"
mkdir -p "$logs"
declare -A pid status seconds
start_all=$SECONDS
for i in "${!versions[@]}"; do
    version="${versions[$i]}"
    tiers=""; [ "$i" -eq 0 ] || tiers="t1 t2 t3"
    if [ "$parallel" = 1 ] && [ "$i" -gt 0 ]; then
        echo "=== make test on ComfyUI $version: tiers $tiers, in the background ($OMP_NUM_THREADS torch" \
             "thread(s)), output in $logs/pytest-$version.log ==="
        rm -f "$logs/rc-$version" "$logs/seconds-$version"
        ( began=$SECONDS; run_pytest "$version" "$tiers" > "$logs/pytest-$version.log" 2>&1
          echo $? > "$logs/rc-$version"; echo $(( SECONDS - began )) > "$logs/seconds-$version" ) &
        pid[$version]=$!
    fi
done
for i in "${!versions[@]}"; do
    version="${versions[$i]}"
    tiers=""; [ "$i" -eq 0 ] || tiers="t1 t2 t3"
    if [ "$parallel" = 1 ] && [ "$i" -gt 0 ]; then
        wait "${pid[$version]}"
        echo "=== make test on ComfyUI $version: tiers $tiers (its output, run alongside) ==="
        cat "$logs/pytest-$version.log"
        status[$version]=$(cat "$logs/rc-$version" 2>/dev/null || echo 1)
        seconds[$version]=$(cat "$logs/seconds-$version" 2>/dev/null || echo "?")
    else
        echo "=== make test on ComfyUI $version: tiers ${tiers:-t0 t1 t2 t3}${OMP_NUM_THREADS:+ ($OMP_NUM_THREADS torch thread(s))} ==="
        began=$SECONDS
        run_pytest "$version" "$tiers"
        status[$version]=$?
        seconds[$version]=$(( SECONDS - began ))
    fi
done
failed=""
for version in "${versions[@]}"; do
    result=passed; [ "${status[$version]}" = 0 ] || { result="FAILED (pytest exit ${status[$version]})"; failed="$failed $version"; }
    echo "=== ComfyUI $version: $result in ${seconds[$version]} s ==="
done
echo "=== tests took $(( SECONDS - start_all )) s$([ "$parallel" = 1 ] && echo ", versions side by side") ==="
if [ -n "$failed" ]; then echo "make test: FAILED on ComfyUI$failed (see above)"; exit 1; fi
echo "make test: passed on ComfyUI ${versions[*]}"
