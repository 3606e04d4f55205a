#!/usr/bin/env bash
# Builds the local Kubernetes control plane (infra/k8s) from the Go module proxy into infra/k8s/bin:
#   bin/cluster  etcd, kube-apiserver, kube-controller-manager and kube-scheduler (one multi-call binary);
#   bin/kwok     kwok, which plays the nodes and the kubelet's part (pods Ready, Jobs completing).
#   bin/kubelet  only with --kubelet or --e2e: the upstream kubelet, for running pods in real containers (README.md).
# With --e2e, besides all of the above, the end-to-end cluster's add-ons:
#   bin/kube-proxy  the upstream kube-proxy, from the same pinned module as the control plane (cluster/kube-proxy);
#   bin/coredns     CoreDNS with only the plugins a cluster DNS needs (coredns/, a module of its own);
#   bin/prometheus  the Prometheus server with Kubernetes service discovery only and no web UI assets
#                   (its HTTP API, /api/v1/query and /api/v1/targets among it, is all there).
# Versions are pinned in cluster/go.mod, coredns/go.mod and below. A stamp of the inputs skips a build already
# done (bin/.built, bin/.kubelet, bin/.kube-proxy, bin/.coredns, bin/.prometheus); Go's own module and build
# caches make a rebuild after a change incremental.
set -euo pipefail
cd "$(dirname "$0")"
WITH_KUBELET=false
WITH_E2E=false
case "${1:-}" in
--kubelet) WITH_KUBELET=true ;;
--e2e) WITH_KUBELET=true WITH_E2E=true ;;
esac
# Where the Go tarball installs itself, in case the shell's PATH does not name it.
[[ -x /usr/local/go/bin/go ]] && PATH="$PATH:/usr/local/go/bin"

KUBERNETES_VERSION=v1.37.2
KWOK_VERSION=v0.8.0
# Prometheus' Go module numbers its releases v0.<major><minor, 2 digits>.<patch>: v0.316.0 is Prometheus 3.16.0.
PROMETHEUS_VERSION=v0.316.0
# Every service discovery but Kubernetes' left out (plugins/ in the module); the UI is served from the disk
# without `builtinassets`, so its pages are missing but the API is not.
PROMETHEUS_TAGS=remove_all_sd,enable_kubernetes_sd
BIN=bin
STAMP="$BIN/.built"

if ! command -v go >/dev/null 2>&1; then
	echo "infra/k8s: the Go toolchain (go >= 1.26) is needed to build the local control plane" >&2
	exit 1
fi

minor=${KUBERNETES_VERSION#v1.}; minor=${minor%%.*}
# Without these the server reports v0.0.0, and clients (helm among them) refuse or misjudge it.
version_flags=""
for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
	version_flags+=" -X $pkg.gitVersion=$KUBERNETES_VERSION -X $pkg.gitMajor=1 -X $pkg.gitMinor=$minor"
	version_flags+=" -X $pkg.gitTreeState=clean -X $pkg.buildDate=1970-01-01T00:00:00Z"
done

inputs=$( (cat cluster/go.mod cluster/go.sum cluster/main.go; echo "$KUBERNETES_VERSION $KWOK_VERSION"; go version) | sha256sum | cut -d' ' -f1)
kubelet_ok=true
if $WITH_KUBELET && [[ ! -x "$BIN/kubelet" || "$(cat "$BIN/.kubelet" 2>/dev/null)" != "$inputs" ]]; then kubelet_ok=false; fi

if $WITH_E2E; then
	COREDNS_VERSION=$(awk '$1 == "github.com/coredns/coredns" { print $2 }' coredns/go.mod)
	prometheus_release=${PROMETHEUS_VERSION#v0.}
	prometheus_release="${prometheus_release:0:1}.$((10#${prometheus_release:1:2})).${prometheus_release#*.}"
	coredns_flags="-s -w -X github.com/coredns/coredns/coremain.gitTag=$COREDNS_VERSION"
	prometheus_flags="-s -w"
	for var in Version=$prometheus_release Revision=$PROMETHEUS_VERSION Branch=HEAD BuildUser=infra/k8s \
		BuildDate=19700101-00:00:00; do
		prometheus_flags+=" -X github.com/prometheus/common/version.$var"
	done
	# One stamp per add-on, of what goes into it: bin/.<name> holds it once bin/<name> is built.
	declare -A e2e_inputs=(
		[kube-proxy]=$( (cat cluster/go.mod cluster/go.sum cluster/kube-proxy/main.go
			echo "$KUBERNETES_VERSION $version_flags"; go version) | sha256sum | cut -d' ' -f1)
		[coredns]=$( (cat coredns/go.mod coredns/go.sum coredns/main.go; echo "$COREDNS_VERSION $coredns_flags"
			go version) | sha256sum | cut -d' ' -f1)
		[prometheus]=$( (echo "$PROMETHEUS_VERSION $PROMETHEUS_TAGS $prometheus_flags"; go version) |
			sha256sum | cut -d' ' -f1)
	)
	e2e_todo=()
	for name in kube-proxy coredns prometheus; do
		if [[ ! -x "$BIN/$name" || "$(cat "$BIN/.$name" 2>/dev/null)" != "${e2e_inputs[$name]}" ]]; then
			e2e_todo+=("$name")
		fi
	done
fi

control_plane_built=false
if $kubelet_ok && [[ -x "$BIN/cluster" && -x "$BIN/kwok" && -f "$STAMP" && "$(cat "$STAMP")" == "$inputs" ]]; then
	echo "infra/k8s: control plane already built ($KUBERNETES_VERSION, kwok $KWOK_VERSION)"
	$WITH_E2E || exit 0
	if [[ ${#e2e_todo[@]} -eq 0 ]]; then
		echo "infra/k8s: kube-proxy, CoreDNS and Prometheus already built ($KUBERNETES_VERSION, CoreDNS" \
			"$COREDNS_VERSION, Prometheus $prometheus_release)"
		exit 0
	fi
	control_plane_built=true
fi
mkdir -p "$BIN"
export CGO_ENABLED=0 GOFLAGS=-buildvcs=false

start=$(date +%s)
part=$start
# Says how long the part just built took, and starts the clock for the next.
took() {
	local now
	now=$(date +%s)
	echo "infra/k8s:   $1 in $((now - part)) s"
	part=$now
}
if ! $control_plane_built; then
	echo "infra/k8s: building etcd + kube-apiserver/controller-manager/scheduler $KUBERNETES_VERSION (cold: several minutes)"
	(cd cluster && go build -trimpath -ldflags "-s -w$version_flags" -o "../$BIN/cluster" .)
	took "bin/cluster"
	echo "infra/k8s: building kwok $KWOK_VERSION"
	GOBIN="$PWD/$BIN" go install -trimpath -ldflags "-s -w -X sigs.k8s.io/kwok/pkg/consts.Version=$KWOK_VERSION" \
		"sigs.k8s.io/kwok/cmd/kwok@$KWOK_VERSION"
	took "bin/kwok"
	if $WITH_KUBELET; then
		echo "infra/k8s: building the kubelet $KUBERNETES_VERSION"
		(cd cluster && go build -trimpath -ldflags "-s -w$version_flags" -o "../$BIN/kubelet" ./kubelet)
		echo "$inputs" > "$BIN/.kubelet"
		took "bin/kubelet"
	fi
	echo "$inputs" > "$STAMP"
fi
if $WITH_E2E; then
	for name in "${e2e_todo[@]}"; do
		case $name in
		kube-proxy)
			echo "infra/k8s: building kube-proxy $KUBERNETES_VERSION"
			(cd cluster && go build -trimpath -ldflags "-s -w$version_flags" -o "../$BIN/kube-proxy" ./kube-proxy)
			;;
		coredns)
			echo "infra/k8s: building CoreDNS $COREDNS_VERSION (cold: a few minutes)"
			(cd coredns && go build -trimpath -ldflags "$coredns_flags" -o "../$BIN/coredns" .)
			;;
		prometheus)
			echo "infra/k8s: building Prometheus $prometheus_release (cold: several minutes)"
			GOBIN="$PWD/$BIN" go install -trimpath -tags "$PROMETHEUS_TAGS" -ldflags "$prometheus_flags" \
				"github.com/prometheus/prometheus/cmd/prometheus@$PROMETHEUS_VERSION"
			;;
		esac
		echo "${e2e_inputs[$name]}" > "$BIN/.$name"
		took "bin/$name"
	done
fi
echo "infra/k8s: built in $(( $(date +%s) - start )) s"
