package idempotency

import (
	"bufio"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"sync"
	"testing"
)

// dropUpstream is an HTTP/1 upstream that answers /warm and, for any
// other path, reads the request, counts it by its Idempotency-Key, and
// closes the connection without answering: the moment at which Go's
// transport re-sends a request it takes for idempotent.
type dropUpstream struct {
	ln     net.Listener
	mu     sync.Mutex
	counts map[string]int
}

func newDropUpstream(t *testing.T) *dropUpstream {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	u := &dropUpstream{ln: ln, counts: make(map[string]int)}
	t.Cleanup(func() { _ = ln.Close() })
	go func() {
		for {
			conn, err := ln.Accept()
			if err != nil {
				return
			}
			go u.serve(conn)
		}
	}()
	return u
}

func (u *dropUpstream) serve(conn net.Conn) {
	defer conn.Close()
	br := bufio.NewReader(conn)
	for {
		req, err := http.ReadRequest(br)
		if err != nil {
			return
		}
		_, _ = io.Copy(io.Discard, req.Body)
		if req.URL.Path == "/warm" {
			_, _ = io.WriteString(conn, "HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
			continue
		}
		u.mu.Lock()
		u.counts[req.Header.Get("Idempotency-Key")]++
		u.mu.Unlock()
		return
	}
}

func (u *dropUpstream) count(key string) int {
	u.mu.Lock()
	defer u.mu.Unlock()
	return u.counts[key]
}

// A header_up that puts the key back in its canonical spelling makes a
// bodiless POST one that Go's transport re-sends when its reused
// connection breaks after the request was written; so does an
// lb_retry_match that allows POST, to the next upstream. The upstream
// may have acted on the first sending: the request must reach it once,
// and end as outcome-unknown.
func TestWrittenRequestIsNotSentAgain(t *testing.T) {
	for _, tc := range []struct {
		name, proxy string
	}{
		{"header_up", "reverse_proxy %[1]s {\n\t\theader_up Idempotency-Key {http.idempotency.key}\n\t}"},
		{"lb_retry_match", "reverse_proxy %[1]s %[1]s {\n\t\tlb_policy first\n\t\tlb_retries 2\n\t\tlb_retry_match {\n\t\t\tmethod POST\n\t\t}\n\t}"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			eachStore(t, func(t *testing.T, sb storeBackend) {
				up := newDropUpstream(t)
				port := freeTCPPort(t)
				s := siteFromCaddyfile(t, port, fmt.Sprintf(`http://127.0.0.1:%d {
	idempotency {
		%s
	}
	%s
}
`, port, sb.Block(), fmt.Sprintf(tc.proxy, up.ln.Addr().String())))
				// A first request leaves Caddy a warm connection to reuse.
				if r := s.Do(t, call{Key: newKey(), Path: "/warm", Body: payBody()}); r.Status != http.StatusOK {
					t.Fatalf("warm-up: %s", r)
				}
				c := call{Key: newKey(), Path: "/drop", ContentType: "-"}
				first := s.Do(t, c)
				if got := up.count(c.Key); got != 1 {
					t.Fatalf("the upstream received the request %d times, want 1 (first answer: %s)", got, first)
				}
				wantProblem(t, first, http.StatusBadGateway)
				if !strings.Contains(string(first.Body), "outcome-unknown") {
					t.Fatalf("first answer %s, want the outcome-unknown problem", first)
				}
				wantReplayedProblem(t, s.Do(t, c), http.StatusBadGateway, "outcome-unknown")
				if got := up.count(c.Key); got != 1 {
					t.Fatalf("after the retry, the upstream received the request %d times, want 1", got)
				}
			})
		})
	}
}
