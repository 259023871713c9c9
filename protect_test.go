package idempotency

// Which requests a handler protects: the method, whatever its case, and
// a request that an outer handler already protects.

import (
	"context"
	"fmt"
	"net/http"
	"strings"
	"testing"

	"github.com/caddyserver/caddy/v2"
)

// Django, Flask and Laravel upper-case the method and run `post` as
// POST: a lower-case method is protected like its upper-case spelling,
// and is the same request. Catches a case-sensitive method lookup (a
// `post` passed through unrecorded and executed on every retry).
func TestLowerCaseMethodIsProtected(t *testing.T) {
	eachStore(t, func(t *testing.T, sb storeBackend) {
		up := newUpstream(t)
		s := protectedSite(t, sb, up.Addr(), "methods post PUT")
		wantProblem(t, s.Do(t, call{Method: "post", Body: payBody()}), http.StatusBadRequest)
		c := call{Method: "post", Key: newKey(), Body: payBody()}
		first := s.Do(t, c)
		wantExecuted(t, first, http.StatusCreated)
		wantReplayOf(t, s.Do(t, c), first)
		c.Method = http.MethodPost
		wantReplayOf(t, s.Do(t, c), first)
		put := call{Method: "pUt", Key: newKey(), Body: payBody()}
		firstPut := s.Do(t, put)
		wantExecuted(t, firstPut, http.StatusCreated)
		wantReplayOf(t, s.Do(t, put), firstPut)
		wantCount(t, up, 2)
	})
}

// Go's transport re-sends GET, HEAD, OPTIONS and TRACE on a dropped
// keep-alive connection by method alone, so they cannot be protected:
// the config is refused, saying why.
func TestSafeMethodsAreRefused(t *testing.T) {
	for _, m := range []string{"GET", "get", "HEAD", "Options", "TRACE"} {
		t.Run("Caddyfile "+m, func(t *testing.T) {
			cfg := fmt.Sprintf("http://127.0.0.1:8080 {\n\tidempotency {\n\t\tmethods POST %s\n\t}\n\treverse_proxy 127.0.0.1:9\n}\n", m)
			_, _, err := adaptCaddyfile(cfg)
			if err == nil {
				t.Fatalf("methods POST %s accepted", m)
			}
			if !strings.Contains(err.Error(), "Caddyfile:3") || !strings.Contains(err.Error(), "re-sends") {
				t.Errorf("error does not name line 3 and say why: %v", err)
			}
		})
		t.Run("JSON "+m, func(t *testing.T) {
			err := provisionAndValidate(t, &Handler{Methods: []string{"POST", m}})
			if err == nil || !strings.Contains(err.Error(), "re-sends") {
				t.Errorf("methods [POST %s]: %v, want a refusal that says why", m, err)
			}
		})
	}
}

// provisionAndValidate does what Caddy does with a handler's JSON config.
func provisionAndValidate(t *testing.T, h *Handler) error {
	t.Helper()
	ctx, cancel := caddy.NewContext(caddy.Context{Context: context.Background()})
	t.Cleanup(cancel)
	if err := h.Provision(ctx); err != nil {
		return err
	}
	return h.Validate()
}

// An idempotency handler inside a route of a site that has one already:
// the outer one re-files the key header, so the inner one, protecting
// too, answered 400 (key missing), which the outer one stored and
// replayed for good; the upstream never ran. The inner one reads the
// re-filed header: with the same settings it finds the record the outer
// one executes under and passes the request through; with a key header
// of its own it enforces by that key too (nesting_test.go), and a
// request without it gets its 400, which the outer one does not store.
func TestNestedHandlerPassesThrough(t *testing.T) {
	eachStore(t, func(t *testing.T, sb storeBackend) {
		for _, inner := range []string{"", "key_header X-Request-Key"} {
			t.Run("inner "+inner, func(t *testing.T) {
				up := newUpstream(t)
				port := freeTCPPort(t)
				s := siteFromCaddyfile(t, port, fmt.Sprintf(`http://127.0.0.1:%d {
	idempotency {
		%[2]s
	}
	handle /pay {
		idempotency {
			%[2]s
			%[3]s
		}
		reverse_proxy %[4]s
	}
}
`, port, sb.Block(), inner, up.Addr()))
				c := call{Key: newKey(), Body: payBody()}
				if inner != "" {
					wantProblem(t, s.Do(t, c), http.StatusBadRequest)
					c.Header = map[string]string{"X-Request-Key": newKey()}
				}
				first := s.Do(t, c)
				wantExecuted(t, first, http.StatusCreated)
				wantReplayOf(t, s.Do(t, c), first)
				wantCount(t, up, 1)
				if got := up.Executions()[0].Key; got != c.Key {
					t.Errorf("upstream got key %q, want %q", got, c.Key)
				}
			})
		}
	})
}
