package idempotency

import (
	"context"
	"fmt"
	"io"

	"github.com/caddyserver/caddy/v2"
	caddycmd "github.com/caddyserver/caddy/v2/cmd"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/spf13/cobra"
)

// Version is this module's release (CHANGELOG.md). Caddy has no field
// for a module's version: `caddy list-modules --versions` shows the one
// the Go build recorded, which is this one only for a build from the
// tagged module or from a directory replaced at this version (make
// xcaddy). So the module reports it itself: `caddy idempotency version`,
// the handler's provision log line and caddy_idempotency_build_info.
const Version = "v0.2.0"

// buildInfo is 1, labelled with the versions, in the style of Go's and
// Prometheus's own build_info: a dashboard joins on it, an alert can ask
// which instances run what, and it is a series that exists as long as a
// config with the handler is loaded.
var buildInfo = prometheus.NewGaugeVec(prometheus.GaugeOpts{
	Namespace: metricsNamespace,
	Subsystem: metricsSubsystem,
	Name:      "build_info",
	Help:      "Always 1: the versions of this module and of Caddy that the process runs.",
}, []string{"version", "caddy_version"})

func init() {
	buildInfo.WithLabelValues(Version, caddyVersion()).Set(1)
}

// caddyVersion is the Caddy release this binary was built with.
func caddyVersion() string {
	simple, _ := caddy.Version()
	return simple
}

func cliVersionCmd() *cobra.Command {
	return &cobra.Command{
		Use:   "version",
		Short: "Prints the versions of the idempotency module and of Caddy",
		RunE: cliRunE(func(_ context.Context, _ caddycmd.Flags, _ io.Reader, out io.Writer) (int, error) {
			fmt.Fprintf(out, "caddy-idempotency %s (Caddy %s)\n", Version, caddyVersion())
			return exitOK, nil
		}),
	}
}
