#!/usr/bin/env bash
# Build the MARS service image (infra/image/Containerfile) with podman, offline: `make image` runs this.
#
#   1. podman, buildah, mmdebstrap and runc from Debian's packages, when missing (as root, like CI).
#   2. The base image: a Debian bookworm root filesystem (python3 = 3.11) made by mmdebstrap, imported as
#      localhost/mars-base:bookworm-<recipe hash>. Skipped while that image exists; the tarball is cached.
#   3. The wheelhouse: every run-time dependency of `mars` (not the `local` or `dev` extras) at the version the
#      project's venv holds (pins.py), as wheels fetched by `pip download`, plus pip itself; the cpu variant
#      without torch. Rebuilt only when the pins change. Then the embedding model, exported to ONNX here.
#   4. The app wheel, built from the working tree (generated protobuf code included: `make proto` first).
#   5. `podman build --network none --layers`: layers are cached, so a code change rebuilds the app layer.
#
# Settings (environment): MARS_IMAGE (default localhost/mars:<version> and :latest, "-cuda" after both for
# the CUDA variant), VARIANT (cpu | cuda), PYTHON (the project's venv, `make install`: its versions are
# pinned and its torch exports the embedder; default .venv), MARS_IMAGE_CACHE (default infra/image/.cache).
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
# The pins are what `mars` needs at run time as installed in the project's venv (infra/image/pins.py: the
# versions the tests ran), without torch and what only torch needs on the cpu variant; the wheelhouse is
# keyed by them and changes only with them.
mkdir -p "$CONTEXT"
"$PYTHON" "$HERE/pins.py" "$VARIANT" "$CONTEXT/requirements.new" >/dev/null
deps_key="$(sha256sum < "$CONTEXT/requirements.new" | cut -c1-16)"
if [ "$(cat "$CONTEXT/wheels/.key" 2>/dev/null)" != "$deps_key" ]; then
    step "wheelhouse ($VARIANT): $(wc -l < "$CONTEXT/requirements.new") pinned wheels"
    rm -rf "$CONTEXT/wheels" "$CONTEXT/wheels.tmp"  # the old set first: disk is not always plentiful
    "$PYTHON" -m pip download --quiet --no-deps --only-binary=:all: --dest "$CONTEXT/wheels.tmp" \
        -r "$CONTEXT/requirements.new"
    rm -rf "$CONTEXT/tools" && mkdir -p "$CONTEXT/tools"
    "$PYTHON" -m pip download --quiet --no-deps --only-binary=:all: --dest "$CONTEXT/tools" pip
    mv "$CONTEXT"/tools/pip-*.whl "$CONTEXT/tools/pip.whl"  # a fixed name, run as tools/pip.whl/pip
    if [ "$VARIANT" = cuda ]; then
        # The GPU FAISS build and its CUDA 12 libraries; torch's CUDA libraries are already in the set;
        # installed by the Containerfile's VARIANT step, so not pinned above.
        "$PYTHON" -m pip download --quiet --only-binary=:all: --dest "$CONTEXT/wheels.tmp" faiss-gpu-cu12
    fi
    echo "$deps_key" > "$CONTEXT/wheels.tmp/.key"
    mv "$CONTEXT/wheels.tmp" "$CONTEXT/wheels"
else
    step "wheelhouse ($VARIANT) up to date"
fi
# Rewritten only when the pins change: the dependency layer is cached by this file (times included).
if cmp -s "$CONTEXT/requirements.new" "$CONTEXT/requirements.txt"; then
    rm -f "$CONTEXT/requirements.new"
else
    mv "$CONTEXT/requirements.new" "$CONTEXT/requirements.txt"
fi

# --- 3b. the embedding model in ONNX --------------------------------------------------------------------
# Exported here, by the project's venv (it has torch), under the names the memory service looks for inside
# the image; redone only when the embedder's code or the pins change.
onnx_key="$( (cat "$REPO/services/mars/retrieval/embedder.py" "$HERE/export_embedder.py"; echo "$deps_key") \
    | sha256sum | cut -c1-16)"
if [ "$(cat "$CONTEXT/onnx.key" 2>/dev/null)" != "$onnx_key" ]; then
    step "embedding model to ONNX (fp32, int8)"
    rm -rf "$CONTEXT/onnx" "$CONTEXT/onnx.tmp"
    "$PYTHON" "$HERE/export_embedder.py" export "$CONTEXT/onnx.tmp" /opt/mars/venv/lib/python3.11/site-packages
    mv "$CONTEXT/onnx.tmp" "$CONTEXT/onnx"
    echo "$onnx_key" > "$CONTEXT/onnx.key"
else
    step "embedding model in ONNX up to date"
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
cp -a "$HERE/export_embedder.py" "$HERE/entrypoint.sh" "$CONTEXT/"
cp -a "$REPO/config" "$CONTEXT/config"

# --- 5. podman build ------------------------------------------------------------------------------------
step "podman build $IMAGE (VARIANT=$VARIANT)"
podman build --network none --layers --pull=never \
    --build-arg BASE="$BASE" --build-arg VARIANT="$VARIANT" \
    --tag "$IMAGE" --tag "$LATEST" --file "$HERE/Containerfile" "$CONTEXT"
step "built $IMAGE: $(podman image inspect --format '{{.Size}}' "$IMAGE" | awk '{printf "%.0f MB", $1 / 1e6}')"
