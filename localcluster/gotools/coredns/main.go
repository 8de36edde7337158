// Command coredns is CoreDNS (github.com/coredns/coredns, pinned in go.mod) with the plugin set
// the local test cluster's Corefile uses, as CoreDNS documents for custom builds
// (coredns.go imports core/plugin for all of them; this imports a subset). The directive order
// stays upstream's (core/dnsserver/zdirectives.go). Built by localcluster/build-go-tools.sh;
// regenerate go.sum with 'go mod tidy'.
package main

import (
	_ "github.com/coredns/coredns/plugin/bind"
	_ "github.com/coredns/coredns/plugin/cache"
	_ "github.com/coredns/coredns/plugin/errors"
	_ "github.com/coredns/coredns/plugin/forward"
	_ "github.com/coredns/coredns/plugin/health"
	_ "github.com/coredns/coredns/plugin/kubernetes"
	_ "github.com/coredns/coredns/plugin/loadbalance"
	_ "github.com/coredns/coredns/plugin/log"
	_ "github.com/coredns/coredns/plugin/loop"
	_ "github.com/coredns/coredns/plugin/ready"
	_ "github.com/coredns/coredns/plugin/reload"
	_ "github.com/coredns/coredns/plugin/whoami"

	"github.com/coredns/coredns/coremain"
)

func main() {
	coremain.Run()
}
