// Command cluster is the local control plane of infra/k8s as one multi-call binary, so the
// four components share one build and one link: `cluster etcd|kube-apiserver|
// kube-controller-manager|kube-scheduler [flags]` runs that component with its own flags.
package main

import (
	"fmt"
	"os"
	_ "time/tzdata" // CronJob time zones, as the upstream kube-apiserver main imports

	"github.com/spf13/cobra"
	"go.etcd.io/etcd/server/v3/etcdmain"
	"k8s.io/component-base/cli"
	_ "k8s.io/component-base/logs/json/register"
	_ "k8s.io/component-base/metrics/prometheus/clientgo"
	_ "k8s.io/component-base/metrics/prometheus/version"
	apiserver "k8s.io/kubernetes/cmd/kube-apiserver/app"
	controllermanager "k8s.io/kubernetes/cmd/kube-controller-manager/app"
	scheduler "k8s.io/kubernetes/cmd/kube-scheduler/app"
)

func runCobra(command *cobra.Command, args []string) {
	command.SetArgs(args)
	os.Exit(cli.Run(command))
}

func main() {
	if len(os.Args) < 2 {
		fmt.Fprintln(os.Stderr, "usage: cluster etcd|kube-apiserver|kube-controller-manager|kube-scheduler [flags]")
		os.Exit(2)
	}
	component, args := os.Args[1], os.Args[2:]
	switch component {
	case "etcd":
		etcdmain.Main(append([]string{"etcd"}, args...))
	case "kube-apiserver":
		runCobra(apiserver.NewAPIServerCommand(), args)
	case "kube-controller-manager":
		runCobra(controllermanager.NewControllerManagerCommand(), args)
	case "kube-scheduler":
		runCobra(scheduler.NewSchedulerCommand(), args)
	default:
		fmt.Fprintf(os.Stderr, "cluster: unknown component %q\n", component)
		os.Exit(2)
	}
}
