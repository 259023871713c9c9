package idempotency

// End-to-end tests of the core behaviour (docs/how-it-works.md) through a real
// Caddy and a real Postgres: a retry is answered with the first response,
// another request under its key is refused, and what makes two requests
// the same. Store-neutral tests run once per store, as the subtests
// "memory" and "postgres". The harness is in harness*_test.go; the other
// subjects have files of their own (concurrency, detached, protect,
// response, reload, expiry, release, credential, caddyfile, config).

import (
	"bytes"
	"net/http"
	"strings"
	"testing"
)

func TestReplayIsByteForByte(t *testing.T) {
	eachStore(t, func(t *testing.T, sb storeBackend) {
		up := newUpstream(t)
		s := protectedSite(t, sb, up.Addr())
		c := call{Key: newKey(), Body: payBody(), Header: map[string]string{"X-Test-Extra": "1"}}

		first := s.Do(t, c)
		wantExecuted(t, first, http.StatusCreated)
		if len(first.Header.Values("Set-Cookie")) != 2 {
			t.Errorf("the first caller must get the upstream's Set-Cookie: %v", first.Header)
		}
		for i := range 2 {
			replay := s.Do(t, c)
			wantReplayOf(t, replay, first)
			if i == 1 {
				// A wrong implementation that stores the replay markers would send them twice.
				wantReplayOf(t, replay, first)
			}
		}
		wantCount(t, up, 1)
	})
}

func TestSameKeyDifferentRequestConflicts(t *testing.T) {
	eachStore(t, func(t *testing.T, sb storeBackend) {
		up := newUpstream(t)
		s := protectedSite(t, sb, up.Addr())
		for _, tc := range []struct {
			name   string
			change func(c call) call
		}{
			{"other body", func(c call) call { c.Body = []byte(`{"amount":2000,"currency":"eur"}`); return c }},
			{"other path", func(c call) call { c.Path = "/refund"; return c }},
			{"other query", func(c call) call { c.Path = "/pay?x=1"; return c }},
			{"other method", func(c call) call { c.Method = http.MethodPatch; return c }},
		} {
			t.Run(tc.name, func(t *testing.T) {
				before := up.Count()
				orig := call{Key: newKey(), Body: []byte(`{"amount":1000,"currency":"eur"}`)}
				first := s.Do(t, orig)
				wantExecuted(t, first, http.StatusCreated)
				p := wantProblem(t, s.Do(t, tc.change(orig)), http.StatusConflict)
				if !strings.Contains(strings.ToLower(p.Detail), "key") {
					t.Errorf("detail should tell the caller to use a new key: %q", p.Detail)
				}
				// The conflict must not disturb the stored record.
				wantReplayOf(t, s.Do(t, orig), first)
				wantCount(t, up, before+1)
			})
		}
	})
}

func TestJSONFingerprintIsCanonical(t *testing.T) {
	eachStore(t, func(t *testing.T, sb storeBackend) {
		up := newUpstream(t)
		s := protectedSite(t, sb, up.Addr())
		for _, tc := range []struct {
			name        string
			ctype       string
			first, then string
			replay      bool // else 409
		}{
			{"key order", "application/json", `{"a":1,"b":2}`, `{ "b": 2, "a": 1 }`, true},
			{"whitespace", "application/json", `{"a":[1,2],"b":{"c":"d"}}`, "{\n\t\"a\" : [ 1 , 2 ],\r\n \"b\":{ \"c\" :\"d\"}\n}\n", true},
			{"nested key order", "application/json; charset=utf-8", `{"o":{"x":1,"y":{"q":1,"p":2}}}`, `{"o":{"y":{"p":2,"q":1},"x":1}}`, true},
			{"+json media type", "application/merge-patch+json", `{"a":1,"b":2}`, `{"b":2,"a":1}`, true},
			// Catches parsing numbers into float64: these are equal as floats.
			{"numbers kept exactly (1 vs 1.0)", "application/json", `{"a":1}`, `{"a":1.0}`, false},
			{"numbers kept exactly (big ints)", "application/json", `{"a":100000000000000001}`, `{"a":100000000000000000}`, false},
			{"array order matters", "application/json", `{"a":[1,2]}`, `{"a":[2,1]}`, false},
			{"string whitespace kept", "application/json", `{"a":"x y"}`, `{"a":"x  y"}`, false},
			// Catches canonicalising every body: only JSON media types are.
			{"non-JSON media type is raw", "text/plain", `{"a":1,"b":2}`, `{"b":2,"a":1}`, false},
			{"invalid JSON is raw", "application/json", `{"a":1,`, `{"a": 1,`, false},
		} {
			t.Run(tc.name, func(t *testing.T) {
				key := newKey()
				first := s.Do(t, call{Key: key, Body: []byte(tc.first), ContentType: tc.ctype})
				wantExecuted(t, first, http.StatusCreated)
				second := s.Do(t, call{Key: key, Body: []byte(tc.then), ContentType: tc.ctype})
				if tc.replay {
					wantReplayOf(t, second, first)
				} else {
					wantProblem(t, second, http.StatusConflict)
				}
			})
		}
	})
}

func TestQuotedKeyIsTheSameKey(t *testing.T) {
	eachStore(t, func(t *testing.T, sb storeBackend) {
		up := newUpstream(t)
		s := protectedSite(t, sb, up.Addr())
		for _, tc := range []struct{ name, first, then string }{
			{"bare then quoted", "abcdefgh-1234", `"abcdefgh-1234"`},
			{"quoted then bare", `"ijklmnop-5678"`, "ijklmnop-5678"},
		} {
			t.Run(tc.name, func(t *testing.T) {
				before := up.Count()
				body := payBody()
				first := s.Do(t, call{Key: tc.first, Body: body})
				wantExecuted(t, first, http.StatusCreated)
				wantReplayOf(t, s.Do(t, call{Key: tc.then, Body: body}), first)
				wantProblem(t, s.Do(t, call{Key: tc.then, Body: payBody()}), http.StatusConflict)
				wantCount(t, up, before+1)
			})
		}
	})
}

// Records are scoped by (credential, key). Catches scoping by key alone.
func TestTenantsAreIsolated(t *testing.T) {
	eachStore(t, func(t *testing.T, sb storeBackend) {
		for _, tc := range []struct {
			name       string
			directives []string
			credHeader string
			credA      string
			credB      string
		}{
			{"Authorization", nil, "", "Bearer tenant-a", "Bearer tenant-b"},
			{"credential_header", []string{"credential_header X-Api-Key"}, "X-Api-Key", "key-a", "key-b"},
			{"credential placeholder", []string{"credential {http.request.header.X-User}"}, "X-User", "user-a", "user-b"},
		} {
			t.Run(tc.name, func(t *testing.T) {
				up := newUpstream(t)
				s := protectedSite(t, sb, up.Addr(), tc.directives...)
				key := newKey()
				a := call{Key: key, Cred: tc.credA, CredHeader: tc.credHeader, Body: []byte(`{"amount":1}`)}
				b := call{Key: key, Cred: tc.credB, CredHeader: tc.credHeader, Body: []byte(`{"amount":2}`)}

				ra := s.Do(t, a)
				wantExecuted(t, ra, http.StatusCreated)
				rb := s.Do(t, b) // another body under the same key: another tenant's request, not a 409
				wantExecuted(t, rb, http.StatusCreated)
				if ra.Header.Get("X-Execution-Id") == rb.Header.Get("X-Execution-Id") {
					t.Fatalf("tenant B got tenant A's response")
				}
				wantReplayOf(t, s.Do(t, a), ra)
				wantReplayOf(t, s.Do(t, b), rb)
				wantCount(t, up, 2)

				if tc.credHeader != "" {
					// The configured source is the only credential: Authorization alone is not one.
					missing := s.Do(t, call{Key: newKey(), Body: payBody(), Cred: "Bearer x"})
					wantProblem(t, missing, http.StatusUnauthorized)
				}
			})
		}
	})
}

// The upstream must see exactly the bytes the client sent, not the
// canonical form the fingerprint used.
func TestUpstreamGetsExactBody(t *testing.T) {
	eachStore(t, func(t *testing.T, sb storeBackend) {
		up := newUpstream(t)
		s := protectedSite(t, sb, up.Addr())
		binary := make([]byte, 512)
		for i := range binary {
			binary[i] = byte(i)
		}
		for _, tc := range []struct {
			name    string
			body    []byte
			ctype   string
			chunked bool
		}{
			{"binary", binary, "application/octet-stream", false},
			{"binary chunked", binary, "application/octet-stream", true},
			{"JSON with odd whitespace", []byte("{ \"b\" :2,\n\t\"a\":\"\\u00e9\" ,\"n\":1.50 }\r\n"), "application/json", false},
			{"JSON chunked", []byte("{ \"z\":1 ,  \"y\":2 }"), "application/json", true},
			{"form", []byte("amount=1000&currency=eur&z=%20"), "application/x-www-form-urlencoded", false},
			{"empty", nil, "application/json", false},
		} {
			t.Run(tc.name, func(t *testing.T) {
				n := up.Count()
				c := call{Key: newKey(), Body: tc.body, ContentType: tc.ctype, Chunked: tc.chunked}
				first := s.Do(t, c)
				wantExecuted(t, first, http.StatusCreated)
				got := up.Executions()[n].Body
				if !bytes.Equal(got, tc.body) {
					t.Errorf("upstream got %q, client sent %q", got, tc.body)
				}
				wantReplayOf(t, s.Do(t, c), first)
			})
		}
	})
}
