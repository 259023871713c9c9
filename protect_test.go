package idempotency

// Which requests a handler protects: the method, whatever its case, and
// a request that an outer handler already protects.

import (
	"bytes"
	"fmt"
	"net/http"
	"strings"
	"testing"

	"github.com/caddy-idempotency/idempotency/internal/pgtest"
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
	if err := provisionHandler(t, h); err != nil {
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

func TestRejectedRequestsReachNothing(t *testing.T) {
	eachStore(t, func(t *testing.T, sb storeBackend) {
		up := newUpstream(t)
		s := protectedSite(t, sb, up.Addr(), "max_request_body 1024")
		big := bytes.Repeat([]byte("x"), 1025)
		for _, tc := range []struct {
			name   string
			c      call
			status int
		}{
			{"missing key", call{Body: payBody()}, http.StatusBadRequest},
			{"missing key, upgrade headers", call{Body: payBody(), Header: map[string]string{"Connection": "Upgrade", "Upgrade": "websocket"}}, http.StatusBadRequest},
			{"key of 7 bytes", call{Key: "abcdefg", Body: payBody()}, http.StatusBadRequest},
			{"key of 256 bytes", call{Key: strings.Repeat("k", 256), Body: payBody()}, http.StatusBadRequest},
			{"key with a tab", call{Key: "abcd\tefgh", Body: payBody()}, http.StatusBadRequest},
			{"key with a non-ASCII byte", call{Key: "abcdefgh\xe9", Body: payBody()}, http.StatusBadRequest},
			{"quoted key of 7 bytes", call{Key: `"abcdefg"`, Body: payBody()}, http.StatusBadRequest},
			{"missing credential", call{Key: newKey(), Cred: noCred, Body: payBody()}, http.StatusUnauthorized},
			{"empty credential", call{Key: newKey(), Cred: " ", Body: payBody()}, http.StatusUnauthorized},
			{"body over max_request_body", call{Key: newKey(), Body: big, ContentType: "text/plain"}, http.StatusRequestEntityTooLarge},
			{"chunked body over max_request_body", call{Key: newKey(), Body: big, ContentType: "text/plain", Chunked: true}, http.StatusRequestEntityTooLarge},
		} {
			t.Run(tc.name, func(t *testing.T) {
				wantProblem(t, s.Do(t, tc.c), tc.status)
			})
		}
		wantCount(t, up, 0)
	})
}

// Catches off-by-one limits: the boundaries themselves are valid.
func TestLimitsAreInclusive(t *testing.T) {
	eachStore(t, func(t *testing.T, sb storeBackend) {
		up := newUpstream(t)
		s := protectedSite(t, sb, up.Addr(), "max_request_body 1024")
		exact := bytes.Repeat([]byte("y"), 1024)
		for _, tc := range []struct {
			name string
			c    call
		}{
			{"key of 8 bytes", call{Key: "k" + pgtest.RandomHex(3) + "z", Body: payBody()}},
			{"key of 255 bytes", call{Key: pgtest.RandomHex(4) + strings.Repeat("k", 247), Body: payBody()}},
			{"key with spaces and punctuation", call{Key: "pay ~!@#$%^&*()_+ " + pgtest.RandomHex(4), Body: payBody()}},
			{"body of exactly max_request_body", call{Key: newKey(), Body: exact, ContentType: "text/plain"}},
			{"chunked body of exactly max_request_body", call{Key: newKey(), Body: exact, ContentType: "text/plain", Chunked: true}},
		} {
			t.Run(tc.name, func(t *testing.T) {
				first := s.Do(t, tc.c)
				wantExecuted(t, first, http.StatusCreated)
				wantReplayOf(t, s.Do(t, tc.c), first)
			})
		}
		wantCount(t, up, 5)
		for _, e := range up.Executions()[3:] {
			if !bytes.Equal(e.Body, exact) {
				t.Errorf("upstream got %d bytes, want the 1024 sent", len(e.Body))
			}
		}
	})
}

func TestOptionalLetsKeylessRequestsThrough(t *testing.T) {
	eachStore(t, func(t *testing.T, sb storeBackend) {
		up := newUpstream(t)
		s := protectedSite(t, sb, up.Addr(), "optional")
		body := payBody()
		for range 2 {
			wantExecuted(t, s.Do(t, call{Body: body}), http.StatusCreated)
		}
		wantCount(t, up, 2)
		// Unprotected means untouched: no credential is demanded either.
		wantExecuted(t, s.Do(t, call{Body: body, Cred: noCred}), http.StatusCreated)
		// A request that does carry a key is still protected.
		c := call{Key: newKey(), Body: body}
		first := s.Do(t, c)
		wantReplayOf(t, s.Do(t, c), first)
		wantProblem(t, s.Do(t, call{Key: "short"}), http.StatusBadRequest)
		wantCount(t, up, 4)
	})
}

func TestUnprotectedMethodsPassThrough(t *testing.T) {
	eachStore(t, func(t *testing.T, sb storeBackend) {
		t.Run("defaults", func(t *testing.T) {
			up := newUpstream(t)
			s := protectedSite(t, sb, up.Addr())
			for _, m := range []string{http.MethodGet, http.MethodPut, http.MethodDelete} {
				for _, c := range []call{
					{Method: m, Cred: noCred},
					{Method: m, Key: "fixed-key-1234"}, // a key on an unprotected method is not recorded
				} {
					for range 2 {
						wantExecuted(t, s.Do(t, c), http.StatusCreated)
					}
				}
			}
			wantCount(t, up, 12)
		})
		t.Run("methods PUT", func(t *testing.T) {
			up := newUpstream(t)
			s := protectedSite(t, sb, up.Addr(), "methods PUT")
			wantExecuted(t, s.Do(t, call{Method: http.MethodPost, Body: payBody()}), http.StatusCreated)
			wantProblem(t, s.Do(t, call{Method: http.MethodPut, Body: payBody()}), http.StatusBadRequest)
			c := call{Method: http.MethodPut, Key: newKey(), Body: payBody()}
			first := s.Do(t, c)
			wantReplayOf(t, s.Do(t, c), first)
			wantCount(t, up, 2)
		})
	})
}

func TestMatcherScopesProtection(t *testing.T) {
	eachStore(t, func(t *testing.T, sb storeBackend) {
		up := newUpstream(t)
		s := protectedSiteMatcher(t, sb, up.Addr(), "/payments/* ")
		wantExecuted(t, s.Do(t, call{Path: "/other"}), http.StatusCreated)
		wantProblem(t, s.Do(t, call{Path: "/payments/1"}), http.StatusBadRequest)
		c := call{Path: "/payments/2", Key: newKey(), Body: payBody()}
		first := s.Do(t, c)
		wantReplayOf(t, s.Do(t, c), first)
		wantCount(t, up, 2)
	})
}

func TestCustomKeyHeader(t *testing.T) {
	eachStore(t, func(t *testing.T, sb storeBackend) {
		up := newUpstream(t)
		s := protectedSite(t, sb, up.Addr(), "key_header X-Request-Key")
		body := payBody()
		wantProblem(t, s.Do(t, call{Key: newKey(), Body: body}), http.StatusBadRequest) // Idempotency-Key is not it
		c := call{Key: newKey(), KeyHeader: "X-Request-Key", Body: body}
		first := s.Do(t, c)
		wantExecuted(t, first, http.StatusCreated)
		wantReplayOf(t, s.Do(t, c), first)
		wantCount(t, up, 1)
	})
}
