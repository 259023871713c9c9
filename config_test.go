package idempotency

// Settings that cannot work are refused at load.

import (
	"bytes"
	"fmt"
	"net/http"
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

// A JSON config, as through the admin API, with a DSN from an {env.*}
// placeholder resolved at provision time.
func TestJSONConfig(t *testing.T) {
	sb := postgresBackend(t)
	t.Setenv("IDEMPOTENCY_E2E_DSN", sb.DSN)
	up := newUpstream(t)
	port := freeTCPPort(t)
	cfg := fmt.Sprintf(`{
	"admin": {"disabled": true},
	"logging": {"logs": {"default": {"writer": {"output": "discard"}}}},
	"apps": {"http": {"servers": {"srv0": {
		"listen": ["127.0.0.1:%d"],
		"automatic_https": {"disable": true},
		"routes": [{"handle": [
			{
				"handler": "idempotency",
				"store": {"backend": "postgres", "dsn": "{env.IDEMPOTENCY_E2E_DSN}", "table": %q},
				"lock_timeout": "5s",
				"max_request_body": 4096
			},
			{"handler": "reverse_proxy", "upstreams": [{"dial": %q}]}
		]}]
	}}}}
}`, port, sb.Table, up.Addr())
	srv := startCaddyJSON(t, []byte(cfg), "")
	s := newSiteClient(t, srv, port)
	c := call{Key: newKey(), Body: payBody()}
	first := s.Do(t, c)
	wantExecuted(t, first, http.StatusCreated)
	wantReplayOf(t, s.Do(t, c), first)
	wantProblem(t, s.Do(t, call{Key: newKey(), Body: bytes.Repeat([]byte("z"), 5000), ContentType: "text/plain"}), http.StatusRequestEntityTooLarge)
	if n := pgCount(t, sb); n != 1 {
		t.Errorf("%d rows in the table, want 1", n)
	}
}

// {http.idempotency.result} and {http.idempotency.key} are set for other
// handlers; a deferred header op reads them at write time.
func TestPlaceholders(t *testing.T) {
	eachStore(t, func(t *testing.T, sb storeBackend) {
		up := newUpstream(t)
		port := freeTCPPort(t)
		s := siteFromCaddyfile(t, port, fmt.Sprintf(`http://127.0.0.1:%d {
	header >X-Idem-Result {http.idempotency.result}
	header >X-Idem-Key {http.idempotency.key}
	idempotency {
		%s
	}
	reverse_proxy %s
}
`, port, sb.Block(), up.Addr()))
		key := newKey()
		body := payBody()
		inflight := call{Key: newKey(), Body: payBody(), Header: sleepFor(500 * time.Millisecond)}
		ch := runBackground(t, s, inflight)
		up.WaitStarted(t, 1)
		for _, tc := range []struct {
			name    string
			c       call
			result  string
			wantKey string
		}{
			{"executed", call{Key: key, Body: body}, "executed", key},
			{"replayed", call{Key: key, Body: body}, "replayed", key},
			{"mismatch", call{Key: key, Body: payBody()}, "mismatch", key},
			{"in_progress", call{Key: inflight.Key, Body: inflight.Body}, "in_progress", inflight.Key},
			{"rejected", call{Body: body}, "rejected", ""},
		} {
			r := s.Do(t, tc.c)
			if got := r.Header.Get("X-Idem-Result"); got != tc.result {
				t.Errorf("%s: {http.idempotency.result} = %q, want %q (status %d)", tc.name, got, tc.result, r.Status)
			}
			if tc.wantKey != "" && r.Header.Get("X-Idem-Key") != tc.wantKey {
				t.Errorf("%s: {http.idempotency.key} = %q, want %q", tc.name, r.Header.Get("X-Idem-Key"), tc.wantKey)
			}
		}
		<-ch
	})
}
