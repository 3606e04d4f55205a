// Command kube-proxy is the upstream kube-proxy, built from the same pinned module as the control plane
// (infra/k8s/cluster/go.mod). Not part of the default build: `infra/k8s/build.sh --e2e` builds it, with
// CoreDNS and Prometheus, for the end-to-end cluster whose pods run in real containers.
package main

import (
	"os"

	"k8s.io/component-base/cli"
	_ "k8s.io/component-base/logs/json/register"
	_ "k8s.io/component-base/metrics/prometheus/clientgo"
	_ "k8s.io/component-base/metrics/prometheus/version"
	"k8s.io/kubernetes/cmd/kube-proxy/app"
)

func main() {
	os.Exit(cli.Run(app.NewProxyCommand()))
}
