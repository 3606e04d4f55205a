// Command kubelet is the upstream kubelet, built from the same pinned module as the control plane
// (infra/k8s/cluster/go.mod). Not part of the default build: `infra/k8s/build.sh --kubelet` builds it for
// the experiment of running the chart's pods in real containers (infra/k8s/README.md).
package main

import (
	"context"
	"os"

	"k8s.io/component-base/cli"
	_ "k8s.io/component-base/logs/json/register"
	_ "k8s.io/component-base/metrics/prometheus/clientgo"
	_ "k8s.io/component-base/metrics/prometheus/version"
	"k8s.io/kubernetes/cmd/kubelet/app"
)

func main() {
	os.Exit(cli.Run(app.NewKubeletCommand(context.Background())))
}
