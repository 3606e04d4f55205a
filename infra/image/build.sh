#!/usr/bin/env bash
# Build the MARS service image (infra/image/Containerfile) with podman, offline: `make image` runs this.
#
#   1. podman, buildah, mmdebstrap and runc from Debian's packages, when missing (as root, like CI).
#   2. The base image: a Debian bookworm root filesystem (python3 = 3.11) made by mmdebstrap, imported as
#      localhost/mars-base:bookworm-<recipe hash>. Skipped while that image exists; the tarball is cached.
#   3. The wheelhouse: every dependency of `mars` (not the `local` or `dev` extras) as wheels, fetched with
#      `pip wheel` by the host's Python 3.11, plus pip itself. Rebuilt only when pyproject.toml changes.
#   4. The app wheel, built from the working tree (generated protobuf code included: `make proto` first).
#   5. `podman build --network none --layers`: layers are cached, so a code change rebuilds the app layer.
#
# Settings (environment): MARS_IMAGE (default localhost/mars:<version> and :latest, "-cuda" after both for
# the CUDA variant), VARIANT (cpu | cuda), PYTHON (a Python
# 3.11 with pip; default the project's .venv), MARS_IMAGE_CACHE (default infra/image/.cache).
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/../.." && pwd)"
VARIANT="${VARIANT:-cpu}"
# Tagged as the chart names it: <repository>:<appVersion = the project's version>, with "-cuda" for the
# CUDA variant (values.yaml image.cudaTagSuffix); also :latest (or :latest-cuda). MARS_IMAGE: one name.
suffix="$([ "$VARIANT" = cuda ] && echo -cuda || true)"
version="$(sed -n 's/^version = "\(.*\)"$/\1/p' "$REPO/pyproject.toml" | head -1)"
IMAGE="${MARS_IMAGE:-localhost/mars:$version$suffix}"
LATEST="${MARS_IMAGE:-localhost/mars:latest$suffix}"
PYTHON="${PYTHON:-$REPO/.venv/bin/python}"
CACHE="${MARS_IMAGE_CACHE:-$HERE/.cache}"
CONTEXT="$CACHE/context-$VARIANT"
export CONTAINERS_CONF="${CONTAINERS_CONF:-$HERE/containers.conf}"
export CONTAINERS_STORAGE_CONF="${CONTAINERS_STORAGE_CONF:-$HERE/storage.conf}"

SUITE=bookworm
MIRRORS=(
    "deb http://deb.debian.org/debian $SUITE main"
    "deb http://deb.debian.org/debian $SUITE-updates main"
    "deb http://deb.debian.org/debian-security $SUITE-security main"
)
# essential: dpkg's Essential set plus these, so no apt in the image. Python 3.11 is bookworm's python3.
BASE_PACKAGES="python3,ca-certificates,libstdc++6,libgomp1,tzdata"

case "$VARIANT" in cpu | cuda) ;; *) echo "VARIANT must be cpu or cuda, not $VARIANT" >&2; exit 2 ;; esac
[ -f "$REPO/services/mars/v1/__init__.py" ] || { echo "no generated protobuf code: run make proto" >&2; exit 2; }

step_start=$SECONDS
step() { echo "== [$((SECONDS - step_start))s] $*"; }

# --- 1. tools -------------------------------------------------------------------------------------------
missing=()
for tool in podman buildah mmdebstrap runc; do command -v "$tool" >/dev/null || missing+=("$tool"); done
if [ ${#missing[@]} -gt 0 ]; then
    step "installing ${missing[*]} (apt)"
    [ "$(id -u)" = 0 ] || { echo "need root to apt-get install ${missing[*]}" >&2; exit 2; }
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq podman buildah mmdebstrap runc >/dev/null
fi
mkdir -p "$CACHE"

# --- 2. base image --------------------------------------------------------------------------------------
recipe_hash="$(printf '%s\n' "$SUITE" "$BASE_PACKAGES" "${MIRRORS[@]}" | sha256sum | cut -c1-12)"
BASE="localhost/mars-base:$SUITE-$recipe_hash"
base_tar="$CACHE/base-$SUITE-$recipe_hash.tar"
if podman image exists "$BASE"; then
    step "base image $BASE exists"
else
    if [ ! -f "$base_tar" ]; then
        step "mmdebstrap $SUITE ($BASE_PACKAGES)"
        mmdebstrap --quiet --variant=essential --format=tar --include="$BASE_PACKAGES" \
            --aptopt='Acquire::Languages "none"' \
            --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-include=/usr/share/doc/*/copyright' \
            --dpkgopt='path-exclude=/usr/share/man/*' --dpkgopt='path-exclude=/usr/share/locale/*' \
            "$SUITE" "$base_tar.tmp" "${MIRRORS[@]}"
        mv "$base_tar.tmp" "$base_tar"
    fi
    step "importing $base_tar as $BASE"
    podman import --quiet --change 'CMD ["/usr/bin/python3"]' "$base_tar" "$BASE" >/dev/null
fi

# --- 3. wheelhouse --------------------------------------------------------------------------------------
# Keyed by pyproject.toml: the dependency set (and so requirements.txt, and the image's dependency layer)
# changes only with it. Versions are whatever the registry served when the wheelhouse was made.
mkdir -p "$CONTEXT"
deps_key="$( (cat "$REPO/pyproject.toml"; echo "$VARIANT") | sha256sum | cut -c1-16)"
if [ "$(cat "$CONTEXT/wheels/.key" 2>/dev/null)" != "$deps_key" ]; then
    step "wheelhouse ($VARIANT): pip wheel of mars's dependencies"
    rm -rf "$CONTEXT/wheels.tmp"
    "$PYTHON" -m pip wheel --quiet --wheel-dir "$CONTEXT/wheels.tmp" "$REPO"
    rm -rf "$CONTEXT/tools" && mkdir -p "$CONTEXT/tools"
    "$PYTHON" -m pip download --quiet --no-deps --only-binary=:all: --dest "$CONTEXT/tools" pip
    mv "$CONTEXT"/tools/pip-*.whl "$CONTEXT/tools/pip.whl"  # a fixed name, run as tools/pip.whl/pip
    rm -f "$CONTEXT"/wheels.tmp/mars-*.whl
    # Pin the exact set `pip wheel` resolved for mars (name==version from each wheel's file name).
    # Rewritten only when the pins change: the dependency layer is cached by this file (times included).
    "$PYTHON" - "$CONTEXT/wheels.tmp" "$CONTEXT/requirements.txt" <<'EOF'
import sys
from pathlib import Path

wheels, out = Path(sys.argv[1]), Path(sys.argv[2])
pins = sorted(
    f"{name.lower().replace('_', '-')}=={version}"
    for name, version, *_ in (w.name.split("-") for w in wheels.glob("*.whl"))
)
text = "\n".join(pins) + "\n"
if not out.exists() or out.read_text() != text:
    out.write_text(text)
EOF
    if [ "$VARIANT" = cuda ]; then
        # The GPU FAISS build and its CUDA 12 libraries; torch's CUDA libraries are already in the set;
        # installed by the Containerfile's VARIANT step, so not pinned above.
        "$PYTHON" -m pip download --quiet --only-binary=:all: --dest "$CONTEXT/wheels.tmp" faiss-gpu-cu12
    fi
    echo "$deps_key" > "$CONTEXT/wheels.tmp/.key"
    rm -rf "$CONTEXT/wheels"
    mv "$CONTEXT/wheels.tmp" "$CONTEXT/wheels"
else
    step "wheelhouse ($VARIANT) up to date"
fi

# --- 4. app wheel and the rest of the build context -----------------------------------------------------
step "app wheel"
# buildah's layer cache compares what a COPY copies including file times: files keep their times (cp -a),
# and the app wheel (byte-identical while the code is, thanks to the fixed timestamp) replaces the old one
# only when it differs, so unchanged code keeps the cached app layers.
# setuptools stages the wheel in build/ and keeps what it staged before (a deleted module would linger).
rm -rf "$CONTEXT/app.tmp" "$REPO/build"
SOURCE_DATE_EPOCH=315532800 "$PYTHON" -m pip wheel --quiet --no-deps --wheel-dir "$CONTEXT/app.tmp" "$REPO"
if diff -rq "$CONTEXT/app.tmp" "$CONTEXT/app" >/dev/null 2>&1; then
    rm -rf "$CONTEXT/app.tmp"
else
    rm -rf "$CONTEXT/app" && mv "$CONTEXT/app.tmp" "$CONTEXT/app"
fi
rm -rf "$CONTEXT/config"
cp -a "$REPO/services/mars/retrieval/embedder.py" "$HERE/export_embedder.py" "$HERE/entrypoint.sh" "$CONTEXT/"
cp -a "$REPO/config" "$CONTEXT/config"

# --- 5. podman build ------------------------------------------------------------------------------------
step "podman build $IMAGE (VARIANT=$VARIANT)"
podman build --network none --layers --pull=never \
    --build-arg BASE="$BASE" --build-arg VARIANT="$VARIANT" \
    --tag "$IMAGE" --tag "$LATEST" --file "$HERE/Containerfile" "$CONTEXT"
step "built $IMAGE: $(podman image inspect --format '{{.Size}}' "$IMAGE" | awk '{printf "%.0f MB", $1 / 1e6}')"
