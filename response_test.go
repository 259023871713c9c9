package idempotency

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"strings"
	"testing"
	"time"
)

// wantReplayedProblem asserts that r is a replay of a problem the module
// stored, of the given type.
func wantReplayedProblem(t *testing.T, r reply, status int, typ string) {
	t.Helper()
	if r.Status != status || !strings.HasPrefix(r.Header.Get("Content-Type"), "application/problem+json") {
		t.Fatalf("got %s, want a %d problem", r, status)
	}
	var p problemDoc
	if err := json.Unmarshal(r.Body, &p); err != nil || !strings.HasSuffix(p.Type, "#"+typ) {
		t.Errorf("problem type %q (%v), want #%s", p.Type, err, typ)
	}
	if !r.replayed() {
		t.Errorf("the stored problem is not marked as a replay: %v", r.Header)
	}
}

// execution_timeout cancels the detached work; reverse_proxy then writes
// a bare 499. The retry must get the stored outcome-unknown problem, not
// an empty 499.
func TestExecutionTimeoutStoresOutcomeUnknown(t *testing.T) {
	eachStore(t, func(t *testing.T, sb storeBackend) {
		up := newUpstream(t)
		s := protectedSite(t, sb, up.Addr(), "execution_timeout 300ms")
		c := call{Key: newKey(), Body: payBody(), Header: sleepFor(4 * time.Second)}
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan struct{})
		go func() {
			defer close(done)
			_, _ = s.DoCtx(ctx, c)
		}()
		up.WaitStarted(t, 1)
		time.Sleep(50 * time.Millisecond)
		cancel()
		<-done
		up.WaitEnded(t, 1)
		r := pollPastInProgress(t, s, call{Key: c.Key, Body: c.Body})
		wantReplayedProblem(t, r, http.StatusBadGateway, "outcome-unknown")
		wantCount(t, up, 1)
	})
}

// Shadow mode changes no response: an upstream failure reaches the
// site's handle_errors, not the module's 502 problem.
func TestShadowKeepsErrorHandling(t *testing.T) {
	eachStore(t, func(t *testing.T, sb storeBackend) {
		up := newUpstream(t)
		for _, tc := range []struct{ name, upstream string }{
			{"upstream fails after the request", up.Addr()},
			{"upstream unreachable", fmt.Sprintf("127.0.0.1:%d", freeTCPPort(t))},
		} {
			t.Run(tc.name, func(t *testing.T) {
				port := freeTCPPort(t)
				s := siteFromCaddyfile(t, port, fmt.Sprintf(`http://127.0.0.1:%d {
	idempotency {
		%s
		shadow
	}
	reverse_proxy %s
	handle_errors {
		respond "custom error page" 502
	}
}
`, port, sb.Block(), tc.upstream))
				r := s.Do(t, call{Key: newKey(), Body: payBody(), Header: map[string]string{"X-Test-Crash": "1"}})
				if r.Status != http.StatusBadGateway || string(r.Body) != "custom error page" {
					t.Errorf("got %s, want the site's error page", r)
				}
			})
		}
	})
}
