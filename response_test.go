package idempotency

import (
	"bytes"
	"compress/gzip"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/caddy-idempotency/idempotency/internal/pgtest"
)

// handlerUpstream is an upstream that answers with fn.
func handlerUpstream(t *testing.T, fn http.HandlerFunc) string {
	t.Helper()
	srv := httptest.NewServer(fn)
	t.Cleanup(func() {
		srv.CloseClientConnections()
		srv.Close()
	})
	return strings.TrimPrefix(srv.URL, "http://")
}

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

// Trailers (gRPC's status lives there) are stored and replayed as
// trailers: declared ones and those set with http.TrailerPrefix.
func TestTrailersReplayed(t *testing.T) {
	eachStore(t, func(t *testing.T, sb storeBackend) {
		addr := handlerUpstream(t, func(w http.ResponseWriter, r *http.Request) {
			_, _ = io.Copy(io.Discard, r.Body)
			w.Header().Set("Trailer", "Grpc-Status, Grpc-Message")
			w.Header().Set("Content-Type", "application/grpc")
			w.WriteHeader(http.StatusOK)
			_, _ = io.WriteString(w, "payload")
			w.Header().Set("Grpc-Status", "0")
			w.Header().Set("Grpc-Message", "ok")
			w.Header().Set(http.TrailerPrefix+"X-Undeclared", "late")
		})
		s := protectedSite(t, sb, addr)
		c := call{Key: newKey(), Body: payBody()}
		do := func() (*http.Response, []byte) {
			req, err := s.request(context.Background(), c)
			if err != nil {
				t.Fatal(err)
			}
			resp, err := s.client.Do(req)
			if err != nil {
				t.Fatal(err)
			}
			defer resp.Body.Close()
			b, err := io.ReadAll(resp.Body)
			if err != nil {
				t.Fatal(err)
			}
			return resp, b
		}
		want := http.Header{"Grpc-Status": {"0"}, "Grpc-Message": {"ok"}, "X-Undeclared": {"late"}}
		for i, name := range []string{"first", "replay"} {
			resp, body := do()
			if string(body) != "payload" || (i == 1) != (resp.Header.Get("Idempotent-Replay") == "true") {
				t.Fatalf("%s: %d %v %q", name, resp.StatusCode, resp.Header, body)
			}
			for k, v := range want {
				if got := resp.Trailer.Values(k); !equalStrings(got, v) {
					t.Errorf("%s: trailer %s = %q, want %q (trailers %v)", name, k, got, v, resp.Trailer)
				}
				if got := resp.Header.Values(k); len(got) != 0 {
					t.Errorf("%s: %s sent as a header too: %q", name, k, got)
				}
			}
		}
	})
}

// A POST that the upstream upgrades (101) hands the connection to another
// protocol: its record is not replayable, never a bare 101.
func TestUpgradedResponseNotReplayable(t *testing.T) {
	eachStore(t, func(t *testing.T, sb storeBackend) {
		addr := handlerUpstream(t, func(w http.ResponseWriter, r *http.Request) {
			_, _ = io.Copy(io.Discard, r.Body)
			conn, brw, err := http.NewResponseController(w).Hijack()
			if err != nil {
				return
			}
			defer conn.Close()
			_, _ = brw.WriteString("HTTP/1.1 101 Switching Protocols\r\nUpgrade: tunnel\r\nConnection: Upgrade\r\n\r\nhello")
			_ = brw.Flush()
			time.Sleep(50 * time.Millisecond)
		})
		s := protectedSite(t, sb, addr)
		c := call{Key: newKey(), Body: payBody(), Header: map[string]string{"Upgrade": "tunnel", "Connection": "Upgrade"}}
		req, err := s.request(context.Background(), c)
		if err != nil {
			t.Fatal(err)
		}
		resp, err := s.client.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		if resp.StatusCode != http.StatusSwitchingProtocols {
			t.Fatalf("first: %d, want 101", resp.StatusCode)
		}
		_, _ = io.ReadAll(resp.Body)
		resp.Body.Close()
		r := pollPastInProgress(t, s, call{Key: c.Key, Body: c.Body})
		wantProblem(t, r, http.StatusConflict)
		var p problemDoc
		_ = json.Unmarshal(r.Body, &p)
		if !strings.HasSuffix(p.Type, "#not-replayable") {
			t.Errorf("problem type %q, want #not-replayable", p.Type)
		}
	})
}

// A stored gzip body is never replayed to a client that does not accept
// gzip: it is decoded for it; another coding it does not accept is 406.
func TestReplayHonoursAcceptEncoding(t *testing.T) {
	plain := bytes.Repeat([]byte("the stored body "), 100)
	var gz bytes.Buffer
	zw := gzip.NewWriter(&gz)
	_, _ = zw.Write(plain)
	_ = zw.Close()
	eachStore(t, func(t *testing.T, sb storeBackend) {
		addr := handlerUpstream(t, func(w http.ResponseWriter, r *http.Request) {
			_, _ = io.Copy(io.Discard, r.Body)
			w.Header().Set("Content-Type", "text/plain")
			w.Header().Set("X-Kept", "yes")
			if r.URL.Path == "/br" {
				w.Header().Set("Content-Encoding", "br")
				_, _ = w.Write([]byte("not really brotli"))
				return
			}
			w.Header().Set("Content-Encoding", "gzip")
			w.Header().Set("Content-Length", fmt.Sprint(gz.Len()))
			_, _ = w.Write(gz.Bytes())
		})
		s := protectedSite(t, sb, addr)
		ae := func(v string) map[string]string { return map[string]string{"Accept-Encoding": v} }
		c := call{Key: newKey(), Body: payBody(), Header: ae("gzip")}
		first := s.Do(t, c)
		if first.Header.Get("Content-Encoding") != "gzip" || !bytes.Equal(first.Body, gz.Bytes()) {
			t.Fatalf("first answer is not the upstream's gzip body: %s", first)
		}
		for _, v := range []string{"identity", "br", "gzip;q=0", "gzip;q=0, identity;q=0.5", ""} {
			r := s.Do(t, call{Key: c.Key, Body: c.Body, Header: ae(v)})
			if !r.replayed() || r.Header.Get("Content-Encoding") != "" || !bytes.Equal(r.Body, plain) {
				t.Errorf("Accept-Encoding %q: want the decoded body, got %d %v %d bytes", v, r.Status, r.Header, len(r.Body))
			}
			if r.Header.Get("X-Kept") != "yes" || r.Header.Get("Content-Type") != "text/plain" {
				t.Errorf("Accept-Encoding %q: decoding dropped other headers: %v", v, r.Header)
			}
		}
		for _, v := range []string{"gzip", "x-gzip", "GZIP;q=0.5", "*", "br;q=1, *;q=0.1"} {
			r := s.Do(t, call{Key: c.Key, Body: c.Body, Header: ae(v)})
			if !r.replayed() || r.Header.Get("Content-Encoding") != "gzip" || !bytes.Equal(r.Body, gz.Bytes()) {
				t.Errorf("Accept-Encoding %q: want the stored gzip body, got %d %v", v, r.Status, r.Header)
			}
		}
		for _, v := range []string{"identity;q=0", "*;q=0", "br, *;q=0"} {
			r := s.Do(t, call{Key: c.Key, Body: c.Body, Header: ae(v)})
			wantProblem(t, r, http.StatusNotAcceptable)
		}
		br := call{Path: "/br", Key: newKey(), Body: payBody(), Header: ae("br")}
		if first := s.Do(t, br); first.Header.Get("Content-Encoding") != "br" {
			t.Fatalf("first /br answer: %s", first)
		}
		wantProblem(t, s.Do(t, call{Path: br.Path, Key: br.Key, Body: br.Body, Header: ae("gzip")}), http.StatusNotAcceptable)
	})
}

// In shadow mode, a retry that enforcement would answer 406 (the stored
// gzip body, to a client that accepts neither gzip nor identity) is
// executed and logged as rejected. Catches shadow mode deciding on its
// own copy of enforcement's rules, which lacked the 406 and said
// shadow_replayed.
func TestShadowWouldNotAcceptEncoding(t *testing.T) {
	var gz bytes.Buffer
	zw := gzip.NewWriter(&gz)
	_, _ = zw.Write([]byte("the stored body"))
	_ = zw.Close()
	eachStore(t, func(t *testing.T, sb storeBackend) {
		var calls atomic.Int32
		addr := handlerUpstream(t, func(w http.ResponseWriter, r *http.Request) {
			_, _ = io.Copy(io.Discard, r.Body)
			calls.Add(1)
			w.Header().Set("Content-Encoding", "gzip")
			_, _ = w.Write(gz.Bytes())
		})
		port := freeTCPPort(t)
		s := siteFromCaddyfile(t, port, fmt.Sprintf(`http://127.0.0.1:%d {
	header >X-Idem-Result {http.idempotency.result}
	idempotency {
		%s
		shadow
	}
	reverse_proxy %s
}
`, port, sb.Block(), addr))
		ae := func(v string) map[string]string { return map[string]string{"Accept-Encoding": v} }
		c := call{Key: newKey(), Body: payBody(), Header: ae("gzip")}
		if got := s.Do(t, c).Header.Get("X-Idem-Result"); got != "shadow_executed" {
			t.Fatalf("first: result %q, want shadow_executed", got)
		}
		r := s.Do(t, call{Key: c.Key, Body: c.Body, Header: ae("identity;q=0")})
		if got := r.Header.Get("X-Idem-Result"); got != "shadow_rejected" {
			t.Errorf("retry refusing the stored coding: result %q, want shadow_rejected", got)
		}
		if r.Status != http.StatusOK || calls.Load() != 2 {
			t.Errorf("retry: status %d after %d executions, want the upstream's 200 after 2", r.Status, calls.Load())
		}
		var lines int
		for _, l := range s.moduleLogLines(t) {
			if l["msg"] == "idempotency.shadow" {
				lines++
				if l["would"] != resultRejected || l["content_encoding"] == nil {
					t.Errorf("idempotency.shadow line %v, want would=rejected with the stored content_encoding", l)
				}
			}
		}
		if lines != 1 {
			t.Errorf("%d idempotency.shadow lines, want 1", lines)
		}
	})
}

func TestAcceptsEncoding(t *testing.T) {
	for _, tc := range []struct {
		accept []string // nil: no Accept-Encoding at all
		coding string
		want   bool
	}{
		{nil, "gzip", true},
		{nil, "br", true},
		{[]string{""}, "gzip", false},
		{[]string{""}, "identity", true},
		{[]string{"gzip"}, "gzip", true},
		{[]string{"deflate", "gzip;q=0.1"}, "gzip", true},
		{[]string{"x-gzip"}, "gzip", true},
		{[]string{"gzip"}, "x-gzip", true},
		{[]string{"gzip; q=0"}, "gzip", false},
		{[]string{"gzip;q=0.000"}, "gzip", false},
		{[]string{"gzip;q=bogus"}, "gzip", false},
		{[]string{"*"}, "br", true},
		{[]string{"*;q=0"}, "br", false},
		{[]string{"*;q=0"}, "identity", false},
		{[]string{"identity;q=1, *;q=0"}, "identity", true},
		{[]string{"identity;q=0"}, "identity", false},
		{[]string{"br"}, "identity", true},
		{[]string{"gzip, br"}, "gzip, br", true},
		{[]string{"gzip"}, "gzip, br", false},
	} {
		h := http.Header{}
		if tc.accept != nil {
			h["Accept-Encoding"] = tc.accept
		}
		if got := acceptsEncoding(h, tc.coding); got != tc.want {
			t.Errorf("Accept-Encoding %q, coding %q: %v, want %v", tc.accept, tc.coding, got, tc.want)
		}
	}
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

// A replay keeps the headers that handlers around the directive set on
// this request and that the record does not hold (a Set-Cookie from a
// `header` directive), without doubling those it does hold.
func TestReplayKeepsOuterHeaders(t *testing.T) {
	eachStore(t, func(t *testing.T, sb storeBackend) {
		up := newUpstream(t)
		port := freeTCPPort(t)
		s := siteFromCaddyfile(t, port, fmt.Sprintf(`http://127.0.0.1:%d {
	header Set-Cookie "outer=1; Path=/"
	header X-Frame-Options DENY
	header X-Request-Id {http.request.uuid}
	idempotency {
		%s
	}
	reverse_proxy %s
}
`, port, sb.Block(), up.Addr()))
		c := call{Key: newKey(), Body: payBody(), Header: map[string]string{"X-Test-Extra": "1"}}
		first := s.Do(t, c)
		wantExecuted(t, first, http.StatusCreated)
		r := s.Do(t, c)
		if !r.replayed() || r.Header.Get("X-Execution-Id") != first.Header.Get("X-Execution-Id") {
			t.Fatalf("not a replay: %s", r)
		}
		if got := r.Header.Values("Set-Cookie"); !equalStrings(got, []string{"outer=1; Path=/"}) {
			t.Errorf("replay Set-Cookie = %q, want only the outer handler's", got)
		}
		if got := r.Header.Values("X-Frame-Options"); !equalStrings(got, []string{"DENY"}) {
			t.Errorf("replay X-Frame-Options = %q, want [DENY] once", got)
		}
		if got, want := r.Header.Values("X-Request-Id"), first.Header.Values("X-Request-Id"); !equalStrings(got, want) {
			t.Errorf("replay X-Request-Id = %q, want the stored %q", got, want)
		}
	})
}

// Stored headers count toward max_response_body, trailers too: a
// response whose headers outgrow it is not replayable.
func TestHeadersCountTowardResponseLimit(t *testing.T) {
	eachStore(t, func(t *testing.T, sb storeBackend) {
		// Each part alone fits max_response_body; together they do not.
		// (Go's client refuses trailers much over 4KiB.)
		big := strings.Repeat("h", 3<<10)
		body := strings.Repeat("b", 3<<10)
		addr := handlerUpstream(t, func(w http.ResponseWriter, r *http.Request) {
			_, _ = io.Copy(io.Discard, r.Body)
			if r.URL.Path == "/trailer" {
				w.Header().Set("Trailer", "X-Big")
				_, _ = io.WriteString(w, body)
				w.Header().Set("X-Big", big)
				return
			}
			w.Header().Set("X-Big", big)
			_, _ = io.WriteString(w, body)
		})
		s := protectedSite(t, sb, addr, "max_response_body 4KiB")
		for _, path := range []string{"/header", "/trailer"} {
			c := call{Path: path, Key: newKey(), Body: payBody()}
			if first := s.Do(t, c); first.Status != http.StatusOK || string(first.Body) != body {
				t.Fatalf("%s: first answer %s", path, first)
			}
			p := wantProblem(t, s.Do(t, c), http.StatusConflict)
			if !strings.HasSuffix(p.Type, "#not-replayable") {
				t.Errorf("%s: problem %q, want #not-replayable", path, p.Type)
			}
		}
	})
}

// Headers count toward max_response_body as they are sent, a line per
// value: counted by their names and values alone, thousands of empty
// values were one name against the limit, however much keeping and
// replaying them cost.
func TestEmptyHeaderValuesCountTowardResponseLimit(t *testing.T) {
	eachStore(t, func(t *testing.T, sb storeBackend) {
		addr := handlerUpstream(t, func(w http.ResponseWriter, r *http.Request) {
			_, _ = io.Copy(io.Discard, r.Body)
			w.Header()["X-Empty"] = make([]string, 4000) // 4000 lines "X-Empty: ", 44,000 bytes
			_, _ = io.WriteString(w, "ok")
		})
		s := protectedSite(t, sb, addr, "max_response_body 32KiB")
		c := call{Key: newKey(), Body: payBody()}
		if first := s.Do(t, c); first.Status != http.StatusOK || string(first.Body) != "ok" {
			t.Fatalf("first answer %s", first)
		}
		p := wantProblem(t, s.Do(t, c), http.StatusConflict)
		if !strings.HasSuffix(p.Type, "#not-replayable") {
			t.Errorf("problem %q, want #not-replayable", p.Type)
		}
	})
}

func TestErrorResponsesAreStoredAndReplayed(t *testing.T) {
	eachStore(t, func(t *testing.T, sb storeBackend) {
		up := newUpstream(t)
		s := protectedSite(t, sb, up.Addr())
		for _, status := range []int{http.StatusInternalServerError, http.StatusUnprocessableEntity} {
			t.Run(strconv.Itoa(status), func(t *testing.T) {
				n := up.Count()
				c := call{Key: newKey(), Body: payBody(), Header: map[string]string{"X-Test-Status": strconv.Itoa(status)}}
				first := s.Do(t, c)
				wantExecuted(t, first, status)
				wantReplayOf(t, s.Do(t, c), first)
				wantCount(t, up, n+1)
			})
		}
	})
}

func TestLargeResponseIsNotReplayed(t *testing.T) {
	eachStore(t, func(t *testing.T, sb storeBackend) {
		up := newUpstream(t)
		s := protectedSite(t, sb, up.Addr(), "max_response_body 1024")
		for _, tc := range []struct {
			name       string
			size       int
			chunked    bool
			replayable bool
		}{
			{"with Content-Length", 5000, false, false},
			{"streamed", 5000, true, false},
			// Headers count toward the limit too, as they are sent
			// (about 300 bytes here).
			{"body and headers under max_response_body", 400, false, true},
			{"body and headers under max_response_body streamed", 400, true, true},
			{"body of exactly max_response_body, with headers", 1024, false, false},
		} {
			t.Run(tc.name, func(t *testing.T) {
				n := up.Count()
				h := map[string]string{"X-Test-Size": strconv.Itoa(tc.size)}
				if tc.chunked {
					h["X-Test-Chunked"] = "1"
				}
				c := call{Key: newKey(), Body: payBody(), Header: h}
				first := s.Do(t, c)
				wantExecuted(t, first, http.StatusCreated)
				if want := sizedBody(first.Header.Get("X-Execution-Id"), tc.size); !bytes.Equal(first.Body, want) {
					t.Errorf("the first caller got %d bytes, want the whole %d", len(first.Body), tc.size)
				}
				second := s.Do(t, c)
				if tc.replayable {
					wantReplayOf(t, second, first)
				} else {
					p := wantProblem(t, second, http.StatusConflict)
					if text := strings.ToLower(p.Title + " " + p.Detail); !strings.Contains(text, "large") &&
						!strings.Contains(text, "size") && !strings.Contains(text, "big") {
						t.Errorf("the 409 should say the response was too large: %+v", p)
					}
					if second.Header.Get("Retry-After") != "" {
						t.Errorf("a too-large response will never be replayable; Retry-After invites a retry")
					}
				}
				wantCount(t, up, n+1)
			})
		}
	})
}

// The response streams through as it is produced. Catches a recorder that
// buffers the whole response before writing it.
func TestStreamingPassesThrough(t *testing.T) {
	eachStore(t, func(t *testing.T, sb storeBackend) {
		up := newUpstream(t)
		s := protectedSite(t, sb, up.Addr())
		gate := "g-" + pgtest.RandomHex(4)
		c := call{Key: newKey(), Body: payBody(), Header: map[string]string{"X-Test-Gate": gate}}
		req, err := s.request(context.Background(), c)
		if err != nil {
			t.Fatal(err)
		}
		type result struct {
			first string
			rest  []byte
			err   error
			resp  *http.Response
		}
		got := make(chan result, 1)
		go func() {
			resp, err := s.client.Do(req)
			if err != nil {
				got <- result{err: err}
				return
			}
			defer resp.Body.Close()
			buf := make([]byte, 64)
			n, err := resp.Body.Read(buf)
			first := string(buf[:n])
			if err != nil && err != io.EOF {
				got <- result{err: err}
				return
			}
			got <- result{first: first, resp: resp}
			up.Open(gate)
			rest, err := io.ReadAll(resp.Body)
			got <- result{rest: rest, err: err}
		}()
		var r1 result
		select {
		case r1 = <-got:
		case <-time.After(3 * time.Second):
			up.Open(gate)
			t.Fatalf("the first flushed chunk did not reach the client while the upstream was still running")
		}
		if r1.err != nil {
			t.Fatal(r1.err)
		}
		r2 := <-got
		if r2.err != nil {
			t.Fatal(r2.err)
		}
		id := r1.resp.Header.Get("X-Execution-Id")
		whole := r1.first + string(r2.rest)
		if want := "first-" + id + "\nsecond\n"; whole != want {
			t.Fatalf("streamed body = %q, want %q", whole, want)
		}
		replay := s.Do(t, call{Key: c.Key, Body: c.Body})
		if !replay.replayed() || string(replay.Body) != whole {
			t.Errorf("replay of a streamed response: got %s, want body %q", replay, whole)
		}
		wantCount(t, up, 1)
	})
}

// The module sits inside encode: it stores the identity body and encode
// compresses each answer for its own client. Catches a recorder that
// stores compressed bytes or encode's Content-Encoding header.
func TestEncodeCompressesReplays(t *testing.T) {
	eachStore(t, func(t *testing.T, sb storeBackend) {
		up := newUpstream(t)
		port := freeTCPPort(t)
		s := siteFromCaddyfile(t, port, fmt.Sprintf(`http://127.0.0.1:%d {
	encode gzip
	idempotency {
		%s
	}
	reverse_proxy %s
}
`, port, sb.Block(), up.Addr()))
		gz := map[string]string{"X-Test-Size": "4000", "Accept-Encoding": "gzip"}
		c := call{Key: newKey(), Body: payBody(), Header: gz}
		first := s.Do(t, c)
		wantExecuted(t, first, http.StatusCreated)
		want := sizedBody(first.Header.Get("X-Execution-Id"), 4000)
		if first.Header.Get("Content-Encoding") != "gzip" || !bytes.Equal(gunzip(t, first.Body), want) {
			t.Fatalf("the first answer is not the gzipped upstream body: %v", first.Header)
		}
		plain := s.Do(t, call{Key: c.Key, Body: c.Body, Header: map[string]string{"Accept-Encoding": "identity"}})
		if !plain.replayed() || plain.Header.Get("Content-Encoding") != "" || !bytes.Equal(plain.Body, want) {
			t.Errorf("a replay to a client without gzip must be the identity body: %v, %d bytes", plain.Header, len(plain.Body))
		}
		again := s.Do(t, c)
		if !again.replayed() || again.Header.Get("Content-Encoding") != "gzip" || !bytes.Equal(gunzip(t, again.Body), want) {
			t.Errorf("a replay to a gzip client must be gzipped once: %v", again.Header)
		}
		wantCount(t, up, 1)
	})
}

func gunzip(t *testing.T, b []byte) []byte {
	t.Helper()
	zr, err := gzip.NewReader(bytes.NewReader(b))
	if err != nil {
		t.Fatalf("not gzip: %v", err)
	}
	out, err := io.ReadAll(zr)
	if err != nil {
		t.Fatalf("bad gzip: %v", err)
	}
	return out
}

func TestExcludedHeadersAreNotReplayed(t *testing.T) {
	eachStore(t, func(t *testing.T, sb storeBackend) {
		up := newUpstream(t)
		s := protectedSite(t, sb, up.Addr(), "exclude_headers x-secret Location") // names are case-insensitive
		c := call{Key: newKey(), Body: payBody(), Header: map[string]string{"X-Test-Extra": "1"}}
		first := s.Do(t, c)
		wantExecuted(t, first, http.StatusCreated)
		for _, h := range []string{"X-Secret", "Authorization", "Set-Cookie", "Location"} {
			if first.Header.Get(h) == "" {
				t.Errorf("the first caller must get the upstream's %s", h)
			}
		}
		replay := s.Do(t, c)
		if !replay.replayed() || !bytes.Equal(replay.Body, first.Body) {
			t.Fatalf("want a replay, got %s", replay)
		}
		for _, h := range []string{"X-Secret", "Authorization", "Set-Cookie", "Location"} {
			if v := replay.Header.Values(h); len(v) != 0 {
				t.Errorf("replay carries %s: %q", h, v)
			}
		}
		// The defaults stay excluded, the rest is kept.
		if got := replay.Header.Values("X-Multi"); !equalStrings(got, []string{"one", "two"}) {
			t.Errorf("replay X-Multi = %q, want [one two]", got)
		}
	})
}

// The headers that a response's Connection field names are hop-by-hop
// (RFC 9110 7.6.1), like Connection itself: never stored nor replayed.
func TestConnectionNamedHeadersAreNotReplayed(t *testing.T) {
	eachStore(t, func(t *testing.T, sb storeBackend) {
		port := freeTCPPort(t)
		s := siteFromCaddyfile(t, port, fmt.Sprintf(`http://127.0.0.1:%d {
	route {
		idempotency {
			%s
		}
		header Connection "X-Conn-Secret, x-other-hop"
		header X-Conn-Secret s
		header X-Other-Hop o
		header X-Kept k
		respond "paid" 201
	}
}
`, port, sb.Block()))
		c := call{Key: newKey(), Body: payBody()}
		first := s.Do(t, c)
		if first.Status != http.StatusCreated || first.replayed() {
			t.Fatalf("want the first answer, got %s", first)
		}
		replay := s.Do(t, c)
		if !replay.replayed() || !bytes.Equal(replay.Body, first.Body) {
			t.Fatalf("want a replay, got %s", replay)
		}
		for _, h := range []string{"X-Conn-Secret", "X-Other-Hop"} {
			if v := replay.Header.Values(h); len(v) != 0 {
				t.Errorf("replay carries %s, which Connection names: %q", h, v)
			}
		}
		if got := replay.Header.Get("X-Kept"); got != "k" {
			t.Errorf("replay X-Kept = %q, want k", got)
		}
	})
}

func TestConnectionNamed(t *testing.T) {
	if got := connectionNamed(http.Header{"Content-Type": {"text/plain"}}); got != nil {
		t.Errorf("no Connection field: %v, want nil", got)
	}
	got := connectionNamed(http.Header{"Connection": {"close, x-a ,X-B", "", "keep-alive"}})
	for _, name := range []string{"Close", "X-A", "X-B", "Keep-Alive"} {
		if !got[name] {
			t.Errorf("%s not taken for named: %v", name, got)
		}
	}
	if len(got) != 4 {
		t.Errorf("named %v, want 4 names", got)
	}
}

// A trailer counts as its line is sent, without the prefix it is stored
// under: a response that fits max_response_body on the wire exactly is
// replayable, one byte more is not.
func TestTrailersCountAsSent(t *testing.T) {
	body := []byte("0123456789")
	// "Trailer: X-T" (7+4+3) and "X-T: v" (3+4+1) and the body.
	fits := int64(14 + 8 + len(body))
	for limit, want := range map[int64]bool{fits: true, fits - 1: false} {
		w := &discardWriter{header: http.Header{"Trailer": {"X-T"}}}
		rec := newRecorder(w, limit)
		rec.WriteHeader(http.StatusOK)
		_, _ = rec.Write(body)
		w.header.Set("X-T", "v")
		if got := rec.response(map[string]struct{}{}).Replayable; got != want {
			t.Errorf("limit %d: replayable %v, want %v", limit, got, want)
		}
	}
}
