package idempotency

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// doTrailers sends c with the request trailers given (declared, as Go's
// client always declares them), its body chunked.
func doTrailers(t *testing.T, s *site, c call, trailer http.Header) reply {
	t.Helper()
	c.Chunked = true
	req, err := s.request(context.Background(), c)
	if err != nil {
		t.Fatal(err)
	}
	req.Trailer = trailer
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

// wantTrailersFingerprinted checks that request trailers, which
// reverse_proxy forwards, tell requests apart: a retry with another
// trailer value is another request, and the upstream gets the trailers
// of the body that was buffered.
func wantTrailersFingerprinted(t *testing.T, s *site, up *upstream) {
	t.Helper()
	key := newKey()
	body := payBody()
	first := doTrailers(t, s, call{Key: key, Body: body}, http.Header{"X-Amount": {"1"}})
	wantExecuted(t, first, http.StatusCreated)
	wantCount(t, up, 1)
	if e := up.Executions()[0]; !equalStrings(e.Trailer.Values("X-Amount"), []string{"1"}) || !bytes.Equal(e.Body, body) {
		t.Errorf("upstream got trailers %v and body %q, want X-Amount: 1 and %q", e.Trailer, e.Body, body)
	}

	wantProblem(t, doTrailers(t, s, call{Key: key, Body: body}, http.Header{"X-Amount": {"999"}}), http.StatusConflict)
	wantProblem(t, doTrailers(t, s, call{Key: key, Body: body}, http.Header{"X-Amount": {"1"}, "X-Other": {""}}), http.StatusConflict)
	wantProblem(t, s.Do(t, call{Key: key, Body: body}), http.StatusConflict)
	// Names are case-insensitive; the same trailers are the same request.
	wantReplayOf(t, doTrailers(t, s, call{Key: key, Body: body}, http.Header{"x-amount": {"1"}}), first)
	wantCount(t, up, 1)

	// A trailer that is declared but not sent is no trailer: the request
	// is the one without.
	key = newKey()
	plain := s.Do(t, call{Key: key, Body: body})
	wantExecuted(t, plain, http.StatusCreated)
	wantReplayOf(t, doTrailers(t, s, call{Key: key, Body: body}, http.Header{"X-Amount": nil}), plain)
	wantCount(t, up, 2)
}

func TestRequestTrailersFingerprinted(t *testing.T) {
	eachStore(t, func(t *testing.T, sb storeBackend) {
		up := newUpstream(t)
		wantTrailersFingerprinted(t, trailerSite(t, sb, up, ""), up)
	})
}

// trailerSite proxies to up without flush_interval -1, so that an
// answer reaches the client once it is stored: the next request of a
// test is a retry, never one racing the first.
func trailerSite(t *testing.T, sb storeBackend, up *upstream, global string) *site {
	t.Helper()
	port := freeTCPPort(t)
	logPath := filepath.Join(t.TempDir(), "caddy.log")
	cfg := strings.Replace(globalOptions(logPath, ""), "\tauto_https off\n", "\tauto_https off\n"+global, 1) +
		fmt.Sprintf(`http://127.0.0.1:%d {
	idempotency {
		%s
	}
	reverse_proxy %s
}
`, port, sb.Block(), up.Addr())
	cfgJSON, _, err := adaptCaddyfile(cfg)
	if err != nil {
		t.Fatalf("adapting Caddyfile: %v\n%s", err, cfg)
	}
	return newSiteClient(t, startCaddyJSON(t, cfgJSON, logPath), port)
}

// The same over HTTP/2 (h2c), whose trailers arrive in a HEADERS frame.
func TestRequestTrailersFingerprintedH2C(t *testing.T) {
	up := newUpstream(t)
	s := trailerSite(t, storeBackend{Name: "memory"}, up, "\tservers {\n\t\tprotocols h1 h2c\n\t}\n")
	var protocols http.Protocols
	protocols.SetUnencryptedHTTP2(true)
	tr := &http.Transport{Protocols: &protocols}
	t.Cleanup(tr.CloseIdleConnections)
	s.client = &http.Client{Transport: tr, Timeout: 15 * time.Second}

	wantTrailersFingerprinted(t, s, up)
	if e := up.Executions()[0]; e.Header.Get("Via") != "2.0 Caddy" {
		t.Errorf("the request reached Caddy as %q, want HTTP/2", e.Header.Get("Via"))
	}
}

// rawChunked sends a POST whose chunked body ends with the trailer
// section given, written as is (Go's client declares every trailer it
// sends, so this one is written by hand), with the Trailer header
// declare unless it is empty, and reads the answer.
func rawChunked(t *testing.T, s *site, key, declare, body, trailerSection string) reply {
	t.Helper()
	conn, err := net.Dial("tcp", strings.TrimPrefix(s.URL, "http://"))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	_ = conn.SetDeadline(time.Now().Add(10 * time.Second))
	if declare != "" {
		declare = "Trailer: " + declare + "\r\n"
	}
	fmt.Fprintf(conn, "POST /pay HTTP/1.1\r\nHost: 127.0.0.1\r\nIdempotency-Key: %s\r\nAuthorization: %s\r\n"+
		"Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n%sConnection: close\r\n\r\n"+
		"%x\r\n%s\r\n0\r\n%s\r\n", key, defaultCred, declare, len(body), body, trailerSection)
	resp, err := http.ReadResponse(bufio.NewReader(conn), nil)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return reply{Status: resp.StatusCode, Header: resp.Header, Body: b}
}

// An HTTP/1 trailer that the request did not declare never reaches a
// handler (net/http files it on the server's own copy of the request,
// not on the one that handlers get), so reverse_proxy does not forward
// it: it is not part of the request the upstream executes, and a retry
// that differs only there is the same request. A declared one counts,
// however its values are split across fields.
func TestRequestTrailersUndeclaredHTTP1(t *testing.T) {
	up := newUpstream(t)
	s := trailerSite(t, storeBackend{Name: "memory"}, up, "")
	key := newKey()
	body := `{"amount":1}`
	first := rawChunked(t, s, key, "", body, "X-Amount: 1\r\n")
	wantExecuted(t, first, http.StatusCreated)
	if got := up.Executions()[0].Trailer; len(got) != 0 {
		t.Fatalf("an undeclared trailer reached the upstream (%v): it must then be fingerprinted", got)
	}
	wantReplayOf(t, rawChunked(t, s, key, "", body, "X-Amount: 999\r\n"), first)
	wantCount(t, up, 1)

	key = newKey()
	first = rawChunked(t, s, key, "x-amount", body, "X-Amount: 1\r\nx-amount: 2\r\n")
	wantExecuted(t, first, http.StatusCreated)
	if got := up.Executions()[1].Trailer.Values("X-Amount"); !equalStrings(got, []string{"1", "2"}) {
		t.Errorf("upstream got trailer X-Amount %q, want [1 2]", got)
	}
	wantProblem(t, rawChunked(t, s, key, "X-Amount", body, "X-Amount: 2\r\nX-Amount: 1\r\n"), http.StatusConflict)
	wantProblem(t, rawChunked(t, s, key, "X-Amount", body, "X-Amount: 1, 2\r\n"), http.StatusConflict)
	wantReplayOf(t, rawChunked(t, s, key, "X-Amount", body, "x-AMOUNT: 1\r\nX-Amount: 2\r\n"), first)
	wantCount(t, up, 2)
}
