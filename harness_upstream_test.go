package idempotency

// The upstream that protected sites proxy to: it counts what it
// executes, and the tests script its answers (status, delay, gates).

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/caddy-idempotency/idempotency/internal/pgtest"
	"github.com/caddy-idempotency/idempotency/store/storetest"
	_ "github.com/caddyserver/caddy/v2/caddyconfig/httpcaddyfile"
	_ "github.com/caddyserver/caddy/v2/modules/standard"
)

// ---------------------------------------------------------------------------
// The upstream

// execution is one request the upstream executed.
type execution struct {
	ID        string
	Seq       int
	Method    string
	Path      string // with query
	Key       string // Idempotency-Key as received ("" if none)
	Body      []byte // exactly the bytes received
	Header    http.Header
	Trailer   http.Header // the request's trailers, once its body was read
	Started   time.Time
	Finished  bool // wrote its whole response
	Cancelled bool // its request context was cancelled before it finished
	Ended     time.Time
}

// upstream is an httptest.Server that records every request it executes.
// Its behaviour is chosen per request with X-Test-* request headers, so
// concurrent requests need no shared setup:
//
//	X-Test-Sleep: <duration>  wait before answering (ends early, Cancelled, if the request context ends)
//	X-Test-Status: <code>     answer with this status (default 201)
//	X-Test-Extra: 1           also send Set-Cookie (twice), Authorization and X-Secret
//	X-Test-Credentials: 1     also send Cookie, Set-Cookie2, Authentication-Info,
//	                          Proxy-Authentication-Info and X-Api-Key
//	X-Test-Size: <n>          answer with an n-byte body (text) instead of the JSON echo
//	X-Test-Chunked: 1         do not send Content-Length (stream the body)
//	X-Test-Gate: <name>       stream: send "first\n", flush, wait for Open(name), send "second\n"
//	X-Test-Crash: 1           read the body, then drop the connection without answering
//
// Every answer carries X-Execution-Id, unique per execution, so a replay
// is visibly the first response.
type upstream struct {
	*httptest.Server

	mu    sync.Mutex
	execs []*execution
	gates map[string]chan struct{}
}

func newUpstream(t testing.TB) *upstream {
	t.Helper()
	return newUpstreamAt(t, "")
}

// newUpstreamAt is newUpstream listening on addr ("" for a free port):
// a test that found addr dead brings its upstream up there.
func newUpstreamAt(t testing.TB, addr string) *upstream {
	t.Helper()
	u := &upstream{gates: make(map[string]chan struct{})}
	u.Server = httptest.NewUnstartedServer(http.HandlerFunc(u.serve))
	if addr != "" {
		ln, err := net.Listen("tcp", addr)
		if err != nil {
			t.Fatal(err)
		}
		u.Server.Listener.Close()
		u.Server.Listener = ln
	}
	u.Server.Start()
	t.Cleanup(func() {
		u.mu.Lock()
		for name, ch := range u.gates {
			select {
			case <-ch:
			default:
				close(ch)
			}
			delete(u.gates, name)
		}
		u.mu.Unlock()
		u.Server.CloseClientConnections()
		u.Server.Close()
	})
	return u
}

// Addr is host:port for reverse_proxy.
func (u *upstream) Addr() string { return strings.TrimPrefix(u.URL, "http://") }

func (u *upstream) gate(name string) chan struct{} {
	u.mu.Lock()
	defer u.mu.Unlock()
	ch, ok := u.gates[name]
	if !ok {
		ch = make(chan struct{})
		u.gates[name] = ch
	}
	return ch
}

// Open releases the requests waiting at gate name.
func (u *upstream) Open(name string) {
	ch := u.gate(name)
	u.mu.Lock()
	defer u.mu.Unlock()
	select {
	case <-ch:
	default:
		close(ch)
	}
}

func (u *upstream) serve(w http.ResponseWriter, r *http.Request) {
	body, err := io.ReadAll(r.Body)
	if err != nil {
		http.Error(w, "reading body: "+err.Error(), http.StatusBadRequest)
		return
	}
	u.mu.Lock()
	e := &execution{
		ID:      pgtest.RandomHex(8),
		Seq:     len(u.execs) + 1,
		Method:  r.Method,
		Path:    r.URL.RequestURI(),
		Key:     r.Header.Get("Idempotency-Key"),
		Body:    body,
		Header:  r.Header.Clone(),
		Trailer: r.Trailer.Clone(),
		Started: time.Now(),
	}
	u.execs = append(u.execs, e)
	u.mu.Unlock()

	end := func(finished, cancelled bool) {
		u.mu.Lock()
		e.Finished, e.Cancelled, e.Ended = finished, cancelled, time.Now()
		u.mu.Unlock()
	}

	if r.Header.Get("X-Test-Crash") != "" {
		end(true, false)
		hj, ok := w.(http.Hijacker)
		if !ok {
			panic("upstream: cannot hijack")
		}
		conn, _, err := hj.Hijack()
		if err == nil {
			_ = conn.Close()
		}
		return
	}

	if d, err := time.ParseDuration(r.Header.Get("X-Test-Sleep")); err == nil && d > 0 {
		select {
		case <-time.After(d):
		case <-r.Context().Done():
			end(false, true)
			return
		}
	}

	status := http.StatusCreated
	if s := r.Header.Get("X-Test-Status"); s != "" {
		status, _ = strconv.Atoi(s)
	}
	h := w.Header()
	h.Set("X-Execution-Id", e.ID)
	h["X-Multi"] = []string{"one", "two"}
	h.Set("Cache-Control", "no-store")
	h.Set("Location", "/pay/"+e.ID)
	if r.Header.Get("X-Test-Extra") != "" {
		h["Set-Cookie"] = []string{"session=abc; Path=/", "tracker=xyz; Path=/"}
		h.Set("Authorization", "Bearer upstream-token")
		h.Set("X-Secret", "s3cr3t")
	}
	if r.Header.Get("X-Test-Credentials") != "" {
		h.Set("Cookie", "session=echoed")
		h.Set("Set-Cookie2", "legacy=1")
		h.Set("Authentication-Info", `nextnonce="upstream-nonce"`)
		h.Set("Proxy-Authentication-Info", `nextnonce="proxy-nonce"`)
		h.Set("X-Api-Key", "echoed-api-key")
	}

	if gate := r.Header.Get("X-Test-Gate"); gate != "" {
		h.Set("Content-Type", "text/plain")
		w.WriteHeader(status)
		_, _ = io.WriteString(w, "first-"+e.ID+"\n")
		w.(http.Flusher).Flush()
		select {
		case <-u.gate(gate):
		case <-time.After(5 * time.Second):
		case <-r.Context().Done():
			end(false, true)
			return
		}
		_, _ = io.WriteString(w, "second\n")
		end(true, false)
		return
	}

	var out []byte
	if n, err := strconv.Atoi(r.Header.Get("X-Test-Size")); err == nil {
		out = sizedBody(e.ID, n)
		h.Set("Content-Type", "text/plain")
	} else {
		out, _ = json.Marshal(map[string]any{
			"execution": e.ID,
			"seq":       e.Seq,
			"method":    r.Method,
			"path":      r.URL.RequestURI(),
			"body_len":  len(body),
		})
		h.Set("Content-Type", "application/json")
	}
	if r.Header.Get("X-Test-Chunked") != "" {
		w.WriteHeader(status)
		for len(out) > 0 {
			n := min(len(out), 512)
			_, _ = w.Write(out[:n])
			w.(http.Flusher).Flush()
			out = out[n:]
		}
	} else {
		h.Set("Content-Length", strconv.Itoa(len(out)))
		w.WriteHeader(status)
		_, _ = w.Write(out)
	}
	end(true, false)
}

// sizedBody is the deterministic n-byte body an X-Test-Size answer has.
func sizedBody(id string, n int) []byte {
	var b bytes.Buffer
	for b.Len() < n {
		fmt.Fprintf(&b, "%s:%08d\n", id, b.Len())
	}
	return b.Bytes()[:n]
}

// Executions returns a snapshot of the ledger.
func (u *upstream) Executions() []execution {
	u.mu.Lock()
	defer u.mu.Unlock()
	out := make([]execution, len(u.execs))
	for i, e := range u.execs {
		out[i] = *e
	}
	return out
}

// Count is how many requests the upstream executed.
func (u *upstream) Count() int {
	u.mu.Lock()
	defer u.mu.Unlock()
	return len(u.execs)
}

// WaitStarted waits until at least n executions have started.
func (u *upstream) WaitStarted(t testing.TB, n int) {
	t.Helper()
	storetest.WaitFor(t, 15*time.Second, fmt.Sprintf("%d upstream executions to start", n), func() bool { return u.Count() >= n })
}

// WaitEnded waits until at least n executions have ended (finished or
// were cancelled).
func (u *upstream) WaitEnded(t testing.TB, n int) {
	t.Helper()
	storetest.WaitFor(t, 15*time.Second, fmt.Sprintf("%d upstream executions to end", n), func() bool {
		ended := 0
		for _, e := range u.Executions() {
			if !e.Ended.IsZero() {
				ended++
			}
		}
		return ended >= n
	})
}
