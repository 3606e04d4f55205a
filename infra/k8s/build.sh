#!/usr/bin/env bash
# Builds the local Kubernetes control plane (infra/k8s) from the Go module proxy into infra/k8s/bin:
#   bin/cluster  etcd, kube-apiserver, kube-controller-manager and kube-scheduler (one multi-call binary);
#   bin/kwok     kwok, which plays the nodes and the kubelet's part (pods Ready, Jobs completing).
# Versions are pinned in cluster/go.mod and below. A stamp of the inputs skips a build already done;
# Go's own module and build caches make a rebuild after a change incremental.
set -euo pipefail
cd "$(dirname "$0")"

KUBERNETES_VERSION=v1.37.2
KWOK_VERSION=v0.8.0
BIN=bin
STAMP="$BIN/.built"

if ! command -v go >/dev/null 2>&1; then
	echo "infra/k8s: the Go toolchain (go >= 1.26) is needed to build the local control plane" >&2
	exit 1
fi

inputs=$( (cat cluster/go.mod cluster/go.sum cluster/main.go; echo "$KUBERNETES_VERSION $KWOK_VERSION"; go version) | sha256sum | cut -d' ' -f1)
if [[ -x "$BIN/cluster" && -x "$BIN/kwok" && -f "$STAMP" && "$(cat "$STAMP")" == "$inputs" ]]; then
	echo "infra/k8s: control plane already built ($KUBERNETES_VERSION, kwok $KWOK_VERSION)"
	exit 0
fi
mkdir -p "$BIN"
export CGO_ENABLED=0 GOFLAGS=-buildvcs=false

minor=${KUBERNETES_VERSION#v1.}; minor=${minor%%.*}
# Without these the server reports v0.0.0, and clients (helm among them) refuse or misjudge it.
version_flags=""
for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
	version_flags+=" -X $pkg.gitVersion=$KUBERNETES_VERSION -X $pkg.gitMajor=1 -X $pkg.gitMinor=$minor"
	version_flags+=" -X $pkg.gitTreeState=clean -X $pkg.buildDate=1970-01-01T00:00:00Z"
done

start=$(date +%s)
echo "infra/k8s: building etcd + kube-apiserver/controller-manager/scheduler $KUBERNETES_VERSION (cold: several minutes)"
(cd cluster && go build -trimpath -ldflags "-s -w$version_flags" -o "../$BIN/cluster" .)
echo "infra/k8s: building kwok $KWOK_VERSION"
GOBIN="$PWD/$BIN" go install -trimpath -ldflags "-s -w -X sigs.k8s.io/kwok/pkg/consts.Version=$KWOK_VERSION" \
	"sigs.k8s.io/kwok/cmd/kwok@$KWOK_VERSION"
echo "$inputs" > "$STAMP"
echo "infra/k8s: built in $(( $(date +%s) - start )) s"
