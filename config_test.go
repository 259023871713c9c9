package idempotency

// Settings that cannot work are refused at load.

import (
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
)

// Durations so short that they spin: lock_timeout 2ns renewed in a hot
// loop (thousands of UPDATEs for one request), prune_interval 1ns ran
// tens of thousands of transactions a second while idle. Refused, with
// the line in a Caddyfile, and in JSON by Validate.
func TestTooShortDurationsAreRefused(t *testing.T) {
	for _, tc := range []struct {
		line string
		set  func(*Handler)
	}{
		{"lock_timeout 2ns", func(h *Handler) { h.LockTimeout = 2 }},
		{"lock_timeout 999ms", func(h *Handler) { h.LockTimeout = caddy.Duration(999 * time.Millisecond) }},
		{"prune_interval 1ns", func(h *Handler) { d := caddy.Duration(1); h.PruneInterval = &d }},
		{"retry_after 100ms", func(h *Handler) { h.RetryAfter = caddy.Duration(100 * time.Millisecond) }},
		{"execution_timeout 10ms", func(h *Handler) { h.ExecutionTimeout = caddy.Duration(10 * time.Millisecond) }},
		{"wait 1ms", func(h *Handler) { h.Wait = caddy.Duration(time.Millisecond) }},
	} {
		name := strings.Fields(tc.line)[0]
		t.Run("Caddyfile "+tc.line, func(t *testing.T) {
			cfg := fmt.Sprintf("http://127.0.0.1:8080 {\n\tidempotency {\n\t\t%s\n\t}\n\treverse_proxy 127.0.0.1:9\n}\n", tc.line)
			_, _, err := adaptCaddyfile(cfg)
			if err == nil {
				t.Fatalf("%s accepted", tc.line)
			}
			if !strings.Contains(err.Error(), "Caddyfile:3") || !strings.Contains(err.Error(), name+" ") || !strings.Contains(err.Error(), "at least") {
				t.Errorf("error does not name line 3, the setting and its least value: %v", err)
			}
		})
		t.Run("JSON "+tc.line, func(t *testing.T) {
			h := &Handler{}
			tc.set(h)
			if err := provisionAndValidate(t, h); err == nil || !strings.Contains(err.Error(), name+" ") || !strings.Contains(err.Error(), "at least") {
				t.Errorf("%s: %v, want a refusal naming it and its least value", tc.line, err)
			}
		})
	}
	for _, ok := range []string{"prune_interval 0", "wait 0", "wait 10ms", "lock_timeout 1s\n\t\tretry_after 1s\n\t\texecution_timeout 1s\n\t\tprune_interval 1s"} {
		t.Run("Caddyfile "+ok, func(t *testing.T) {
			cfg := fmt.Sprintf("http://127.0.0.1:8080 {\n\tidempotency {\n\t\t%s\n\t}\n\treverse_proxy 127.0.0.1:9\n}\n", ok)
			if _, _, err := adaptCaddyfile(cfg); err != nil {
				t.Errorf("%s refused: %v", ok, err)
			}
		})
	}
}
