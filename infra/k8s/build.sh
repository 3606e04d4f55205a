#!/usr/bin/env bash
# Builds the local Kubernetes control plane (infra/k8s) from the Go module proxy into infra/k8s/bin:
#   bin/cluster  etcd, kube-apiserver, kube-controller-manager and kube-scheduler (one multi-call binary);
#   bin/kwok     kwok, which plays the nodes and the kubelet's part (pods Ready, Jobs completing).
#   bin/kubelet  only with --kubelet: the upstream kubelet, for running pods in real containers (README.md).
# Versions are pinned in cluster/go.mod and below. A stamp of the inputs skips a build already done;
# Go's own module and build caches make a rebuild after a change incremental.
set -euo pipefail
cd "$(dirname "$0")"
WITH_KUBELET=false
[[ "${1:-}" == "--kubelet" ]] && WITH_KUBELET=true
# Where the Go tarball installs itself, in case the shell's PATH does not name it.
[[ -x /usr/local/go/bin/go ]] && PATH="$PATH:/usr/local/go/bin"

KUBERNETES_VERSION=v1.37.2
KWOK_VERSION=v0.8.0
BIN=bin
STAMP="$BIN/.built"

if ! command -v go >/dev/null 2>&1; then
	echo "infra/k8s: the Go toolchain (go >= 1.26) is needed to build the local control plane" >&2
	exit 1
fi

inputs=$( (cat cluster/go.mod cluster/go.sum cluster/main.go; echo "$KUBERNETES_VERSION $KWOK_VERSION"; go version) | sha256sum | cut -d' ' -f1)
kubelet_ok=true
if $WITH_KUBELET && [[ ! -x "$BIN/kubelet" || "$(cat "$BIN/.kubelet" 2>/dev/null)" != "$inputs" ]]; then kubelet_ok=false; fi
if $kubelet_ok && [[ -x "$BIN/cluster" && -x "$BIN/kwok" && -f "$STAMP" && "$(cat "$STAMP")" == "$inputs" ]]; then
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
if $WITH_KUBELET; then
	echo "infra/k8s: building the kubelet $KUBERNETES_VERSION"
	(cd cluster && go build -trimpath -ldflags "-s -w$version_flags" -o "../$BIN/kubelet" ./kubelet)
	echo "$inputs" > "$BIN/.kubelet"
fi
echo "$inputs" > "$STAMP"
echo "infra/k8s: built in $(( $(date +%s) - start )) s"
