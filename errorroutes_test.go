package idempotency

// Error routes (handle_errors, a subroute's errors) run outside the
// handler: a request whose key was released must never reach them, or a
// fallback there executes every retry of the key.

import (
	"encoding/json"
	"fmt"
	"net/http"
	"path/filepath"
	"strings"
	"testing"
)

// A dead primary and a handle_errors fallback to a backup: each retry of
// one key was released and then executed on the backup, three POSTs
// three executions. The handler answers a released request itself, so
// the backup executes nothing; the key stays released.
func TestErrorRoutesDoNotExecuteReleasedRequests(t *testing.T) {
	eachStore(t, func(t *testing.T, sb storeBackend) {
		for _, tc := range []struct {
			name     string
			subroute bool // the error routes are the site subroute's, not the server's
		}{
			{"handle_errors", false},
			{"subroute errors", true},
		} {
			t.Run(tc.name, func(t *testing.T) {
				backup := newUpstream(t)
				dead := fmt.Sprintf("127.0.0.1:%d", freeTCPPort(t))
				port := freeTCPPort(t)
				logPath := filepath.Join(t.TempDir(), "caddy.log")
				cfg := globalOptions(logPath, "") + fmt.Sprintf(`http://127.0.0.1:%d {
	idempotency {
		%s
	}
	reverse_proxy %s
	handle_errors {
		reverse_proxy %s
	}
}
`, port, sb.Block(), dead, backup.Addr())
				cfgJSON, _, err := adaptCaddyfile(cfg)
				if err != nil {
					t.Fatalf("adapting Caddyfile: %v\n%s", err, cfg)
				}
				if tc.subroute {
					cfgJSON = errorsIntoSubroute(t, cfgJSON)
				}
				srv := startCaddyJSON(t, cfgJSON, logPath)
				s := newSiteClient(t, srv, port)
				// A bodiless POST (POST /orders/1/cancel) reaches the
				// backup whole; one with a body too, had the error route
				// been given the body.
				for _, c := range []call{{Key: newKey()}, {Key: newKey(), Body: payBody()}} {
					for i := range 3 {
						r := s.Do(t, c)
						if r.Status != http.StatusBadGateway {
							t.Errorf("attempt %d, %d-byte body: %s, want a 502", i+1, len(c.Body), r)
							continue
						}
						if p := wantProblem(t, r, http.StatusBadGateway); !strings.HasSuffix(p.Type, "#not-executed") {
							t.Errorf("attempt %d: problem type %q, want #not-executed", i+1, p.Type)
						}
					}
					wantCount(t, backup, 0)

					releases := 0
					for _, l := range srv.moduleLogLines(t) {
						if l["msg"] != "idempotency.release" || l["key"] != c.Key {
							continue
						}
						releases++
						if cause, _ := l["cause"].(string); !strings.Contains(cause, "dial tcp") || l["status"] != float64(http.StatusBadGateway) {
							t.Errorf("release line without the upstream's error and status: %v", l)
						}
					}
					if releases != 3 {
						t.Errorf("%d release lines for the key, want 3", releases)
					}
				}
			})
		}
	})
}

// errorsIntoSubroute moves the server's error routes into the site's
// subroute, where the handler's error reaches them first.
func errorsIntoSubroute(t *testing.T, cfgJSON []byte) []byte {
	t.Helper()
	var cfg map[string]any
	if err := json.Unmarshal(cfgJSON, &cfg); err != nil {
		t.Fatal(err)
	}
	servers := cfg["apps"].(map[string]any)["http"].(map[string]any)["servers"].(map[string]any)
	if len(servers) != 1 {
		t.Fatalf("%d servers, want 1", len(servers))
	}
	for _, s := range servers {
		srv := s.(map[string]any)
		errs := srv["errors"]
		if errs == nil {
			t.Fatal("no server error routes")
		}
		delete(srv, "errors")
		site := srv["routes"].([]any)[0].(map[string]any)["handle"].([]any)[0].(map[string]any)
		if site["handler"] != "subroute" {
			t.Fatalf("the site's first handler is %v, not a subroute", site["handler"])
		}
		site["errors"] = errs
	}
	out, err := json.Marshal(cfg)
	if err != nil {
		t.Fatal(err)
	}
	return out
}

// The failover that stays protected: the backup among reverse_proxy's
// upstreams. The dial error is retried on it within the handler, which
// sees the connection, so the request executes once and is replayed.
func TestFailoverWithinReverseProxyExecutesOnce(t *testing.T) {
	eachStore(t, func(t *testing.T, sb storeBackend) {
		backup := newUpstream(t)
		dead := fmt.Sprintf("127.0.0.1:%d", freeTCPPort(t))
		port := freeTCPPort(t)
		s := siteFromCaddyfile(t, port, fmt.Sprintf(`http://127.0.0.1:%d {
	idempotency {
		%s
	}
	reverse_proxy %s %s {
		lb_policy first
		lb_retries 1
		fail_duration 30s
	}
}
`, port, sb.Block(), dead, backup.Addr()))
		c := call{Key: newKey(), Body: payBody()}
		first := s.Do(t, c)
		wantExecuted(t, first, http.StatusCreated)
		for range 2 {
			wantReplayOf(t, s.Do(t, c), first)
		}
		wantCount(t, backup, 1)
	})
}

// A handler inside another answers the released request itself: the
// outer one, which sees an answer and no error, must release its record
// too rather than store that answer, so the retry executes once the
// upstream is up.
func TestNestedReleaseReleasesOuterRecord(t *testing.T) {
	eachStore(t, func(t *testing.T, sb storeBackend) {
		addr := fmt.Sprintf("127.0.0.1:%d", freeTCPPort(t))
		port := freeTCPPort(t)
		s := siteFromCaddyfile(t, port, fmt.Sprintf(`http://127.0.0.1:%d {
	idempotency {
		%[2]s
		key_header X-Request-Id
	}
	route /pay* {
		idempotency {
			%[2]s
		}
		reverse_proxy %[3]s
	}
}
`, port, sb.Block(), addr))
		c := call{Key: newKey(), Body: payBody(), Header: map[string]string{"X-Request-Id": newKey()}}
		wantProblem(t, s.Do(t, c), http.StatusBadGateway)
		up := newUpstreamAt(t, addr)
		first := s.Do(t, c)
		wantExecuted(t, first, http.StatusCreated)
		wantReplayOf(t, s.Do(t, c), first)
		wantCount(t, up, 1)
	})
}
