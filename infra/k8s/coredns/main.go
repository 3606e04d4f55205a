// Command coredns is CoreDNS (github.com/coredns/coredns, pinned in go.mod) with only the plugins a
// cluster DNS needs, for the end-to-end cluster of infra/k8s (`infra/k8s/build.sh --e2e`): the stock
// main links every plugin (clouds' SDKs among them), this one the kubeadm Corefile's and a few more
// (bind: the local cluster serves on the node's address only).
// Equivalent to CoreDNS's own coredns.go with core/plugin/zplugin.go cut down; the execution order is
// core/dnsserver/zdirectives.go's, kept to the plugins registered here.
package main

import (
	"fmt"
	"os"
	"slices"

	"github.com/coredns/caddy"
	"github.com/coredns/coredns/core/dnsserver"
	"github.com/coredns/coredns/coremain"

	_ "github.com/coredns/coredns/plugin/bind"
	_ "github.com/coredns/coredns/plugin/cache"
	_ "github.com/coredns/coredns/plugin/errors"
	_ "github.com/coredns/coredns/plugin/forward"
	_ "github.com/coredns/coredns/plugin/health"
	_ "github.com/coredns/coredns/plugin/kubernetes"
	_ "github.com/coredns/coredns/plugin/loadbalance"
	_ "github.com/coredns/coredns/plugin/log"
	_ "github.com/coredns/coredns/plugin/loop"
	_ "github.com/coredns/coredns/plugin/metrics"
	_ "github.com/coredns/coredns/plugin/ready"
	_ "github.com/coredns/coredns/plugin/reload"
	_ "github.com/coredns/coredns/plugin/whoami"
)

func main() {
	// dnsserver.Directives starts as the stock list (all plugins, in execution order); keep the ones
	// linked in (those above, and the few they import themselves, such as metadata), in that order.
	registered := caddy.ListPlugins()["others"] // "dns.<name>", for the DNS server type's plugins
	var directives []string
	for _, name := range dnsserver.Directives {
		if slices.Contains(registered, "dns."+name) {
			directives = append(directives, name)
		}
	}
	if err := dnsserver.SetDirectives(directives); err != nil {
		fmt.Fprintln(os.Stderr, "coredns:", err)
		os.Exit(1)
	}
	coremain.Run()
}
