package idempotency

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"testing"
)

// doHost is s.Do with the request's Host set to host.
func doHost(t *testing.T, s *site, c call, host string) reply {
	t.Helper()
	req, err := s.request(context.Background(), c)
	if err != nil {
		t.Fatal(err)
	}
	req.Host = host
	resp, err := s.client.Do(req)
	if err != nil {
		t.Fatalf("%s %s: %v", req.Method, req.URL, err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return reply{Status: resp.StatusCode, Header: resp.Header, Body: b}
}

// Two sites behind one store never answer with each other's responses:
// the same key, credential and body on another host is another request.
func TestFingerprintHostTakesPart(t *testing.T) {
	eachStore(t, func(t *testing.T, sb storeBackend) {
		up := newUpstream(t)
		port := freeTCPPort(t)
		s := siteFromCaddyfile(t, port, fmt.Sprintf(`http://a.example:%[1]d, http://b.example:%[1]d {
	idempotency {
		%[2]s
	}
	reverse_proxy %[3]s
}
`, port, sb.Block(), up.Addr()))
		c := call{Key: newKey(), Body: payBody()}
		a := fmt.Sprintf("a.example:%d", port)
		first := doHost(t, s, c, a)
		wantExecuted(t, first, http.StatusCreated)
		wantProblem(t, doHost(t, s, c, fmt.Sprintf("b.example:%d", port)), http.StatusConflict)
		wantReplayOf(t, doHost(t, s, c, fmt.Sprintf("A.Example:%d", port)), first)
		wantCount(t, up, 1)
	})
}

// The same bytes under another media type, and bodies that bind to
// other values, are other requests.
func TestFingerprintCollisionsThroughCaddy(t *testing.T) {
	eachStore(t, func(t *testing.T, sb storeBackend) {
		up := newUpstream(t)
		s := protectedSite(t, sb, up.Addr())
		for _, tc := range []struct {
			name               string
			firstCT, secondCT  string
			firstBody, another string
		}{
			{"JSON then text", "application/json", "text/plain", `{ "b": 1, "a": 2 }`, `{"a":2,"b":1}`},
			{"one patch format then another", "application/json-patch+json", "application/merge-patch+json", `{"a":null}`, `{"a":null}`},
			{"names equal but for case, swapped", "application/json", "application/json", `{"amount":100,"AMOUNT":1000000}`, `{"AMOUNT":1000000,"amount":100}`},
			{"Kelvin sign, swapped", "application/json", "application/json", `{"k":1,"\u212a":2}`, `{"\u212a":2,"k":1}`},
		} {
			t.Run(tc.name, func(t *testing.T) {
				key := newKey()
				n := up.Count()
				wantExecuted(t, s.Do(t, call{Key: key, ContentType: tc.firstCT, Body: []byte(tc.firstBody)}), http.StatusCreated)
				wantProblem(t, s.Do(t, call{Key: key, ContentType: tc.secondCT, Body: []byte(tc.another)}), http.StatusConflict)
				wantCount(t, up, n+1)
			})
		}
	})
}

// A path rewritten before the handler runs (handle_path, uri
// strip_prefix) is not the request: two prefixes that strip to the same
// path are two requests.
func TestFingerprintRewrittenPath(t *testing.T) {
	eachStore(t, func(t *testing.T, sb storeBackend) {
		up := newUpstream(t)
		port := freeTCPPort(t)
		s := siteFromCaddyfile(t, port, fmt.Sprintf(`http://127.0.0.1:%[1]d {
	handle_path /payments/* {
		idempotency {
			%[2]s
		}
		reverse_proxy %[3]s
	}
	handle_path /refunds/* {
		idempotency {
			%[2]s
		}
		reverse_proxy %[3]s
	}
	route /v2/* {
		uri strip_prefix /v2
		idempotency {
			%[2]s
		}
		reverse_proxy %[3]s
	}
}
`, port, sb.Block(), up.Addr()))
		c := call{Key: newKey(), Body: payBody(), Path: "/payments/create"}
		first := s.Do(t, c)
		wantExecuted(t, first, http.StatusCreated)
		if got := up.Executions()[0].Path; got != "/create" {
			t.Fatalf("upstream saw %q: the prefix was not stripped", got)
		}
		refund := c
		refund.Path = "/refunds/create"
		wantProblem(t, s.Do(t, refund), http.StatusConflict)
		stripped := c
		stripped.Path = "/v2/create"
		wantProblem(t, s.Do(t, stripped), http.StatusConflict)
		wantReplayOf(t, s.Do(t, c), first)
		wantCount(t, up, 1)

		// The record names the path the client sent.
		for _, l := range s.moduleLogLines(t) {
			if l["msg"] == "idempotency.mismatch" && l["original_path"] != "/payments/create" {
				t.Errorf("mismatch line names the original path %v, want /payments/create", l["original_path"])
			}
		}
	})
}

// A path whose decoded form is not valid UTF-8, or holds a NUL, is
// stored and logged escaped, as sent: it is protected like any other.
func TestFingerprintUndecodablePaths(t *testing.T) {
	eachStore(t, func(t *testing.T, sb storeBackend) {
		up := newUpstream(t)
		s := protectedSite(t, sb, up.Addr())
		for i, path := range []string{"/v1/charges%FF", "/v1/charges%00", "/v1/charges%E9", "/v1/caf%C3%A9%2Fx"} {
			t.Run(path, func(t *testing.T) {
				c := call{Key: newKey(), Body: payBody(), Path: path}
				first := s.Do(t, c)
				wantExecuted(t, first, http.StatusCreated)
				wantReplayOf(t, s.Do(t, c), first)
				wantCount(t, up, i+1)
				logged := false
				for _, l := range s.moduleLogLines(t) {
					if l["msg"] == "idempotency.replay" && l["key"] == c.Key {
						logged = true
						if l["path"] != path {
							t.Errorf("replay line path = %q, want %q", l["path"], path)
						}
					}
				}
				if !logged {
					t.Error("no idempotency.replay line")
				}
			})
		}
	})
}

// A retry that differs from the first request in its Content-Encoding or
// in a method override header would do something else upstream: 409.
func TestFingerprintContentCodingAndOverrideThroughCaddy(t *testing.T) {
	eachStore(t, func(t *testing.T, sb storeBackend) {
		up := newUpstream(t)
		s := protectedSite(t, sb, up.Addr())
		for _, tc := range []struct {
			name          string
			first, second map[string]string
		}{
			{"gzip, then identity", map[string]string{"Content-Encoding": "gzip"}, nil},
			{"identity, then gzip", nil, map[string]string{"Content-Encoding": "gzip"}},
			{"override to DELETE, then none", map[string]string{"X-HTTP-Method-Override": "DELETE"}, nil},
			{"X-HTTP-Method DELETE, then none", map[string]string{"X-HTTP-Method": "DELETE"}, nil},
			{"none, then X-Method-Override DELETE", nil, map[string]string{"X-Method-Override": "DELETE"}},
		} {
			t.Run(tc.name, func(t *testing.T) {
				key := newKey()
				n := up.Count()
				c := call{Key: key, ContentType: "application/octet-stream", Body: []byte("\x1f\x8b\x08 same bytes"), Header: tc.first}
				first := s.Do(t, c)
				wantExecuted(t, first, http.StatusCreated)
				wantReplayOf(t, s.Do(t, c), first)
				c.Header = tc.second
				wantProblem(t, s.Do(t, c), http.StatusConflict)
				wantCount(t, up, n+1)
			})
		}
	})
}
