package idempotency

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/caddy-idempotency/idempotency/store/storetest"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
)

// A chunked body over a request_body limit around the directive is a
// body too large (413), not an unreadable one (400). The body is read
// before the store is used, the same code for both stores.
func TestRequestBodyLimitAroundIs413(t *testing.T) {
	up := newUpstream(t)
	port := freeTCPPort(t)
	s := siteFromCaddyfile(t, port, fmt.Sprintf(`http://127.0.0.1:%d {
	request_body {
		max_size 1KB
	}
	idempotency {
		store memory
	}
	reverse_proxy %s
}
`, port, up.Addr()))
	big := bytes.Repeat([]byte("x"), 4096)
	wantProblem(t, s.Do(t, call{Key: newKey(), Body: big, ContentType: "text/plain", Chunked: true}), http.StatusRequestEntityTooLarge)
	// With a Content-Length, request_body refuses it itself.
	if r := s.Do(t, call{Key: newKey(), Body: big, ContentType: "text/plain"}); r.Status != http.StatusRequestEntityTooLarge {
		t.Errorf("declared body over request_body's limit: %s", r)
	}
	wantCount(t, up, 0)
}

// stallingBody sends a few bytes, then fails as a read deadline would.
type stallingBody struct{ sent bool }

func (b *stallingBody) Read(p []byte) (int, error) {
	if !b.sent {
		b.sent = true
		return copy(p, "0123456789"), nil
	}
	return 0, context.DeadlineExceeded
}
func (b *stallingBody) Close() error { return nil }

// A declared Content-Length allocates nothing until its bytes arrive.
func TestReadBodyAllocatesWithArrivals(t *testing.T) {
	h := &Handler{MaxRequestBody: 2 << 20, bodyBudget: &bodyBudget{limit: defaultBodyBudget}, metrics: newHandlerMetrics("unit")}
	r := httptest.NewRequest(http.MethodPost, "/pay", nil)
	r.Body = &stallingBody{}
	r.ContentLength = 1 << 20
	var before, after runtime.MemStats
	runtime.ReadMemStats(&before)
	body, held, prob := h.readBody(r)
	runtime.ReadMemStats(&after)
	if prob == nil || string(body) != "0123456789" {
		t.Fatalf("a stalled body read as %q, %v", body, prob)
	}
	if c := cap(body); c > initialBodyBuffer || held != int64(c) || h.bodyBudget.used.Load() != held {
		t.Errorf("reading 10 bytes of a declared 1 MiB holds a %d-byte buffer, %d bytes of the budget (%d reserved)", c, held, h.bodyBudget.used.Load())
	}
	// Counts every goroutine's allocations: the margin is for the
	// runtime's and earlier tests' own.
	if n := after.TotalAlloc - before.TotalAlloc; n > 512<<10 {
		t.Errorf("reading 10 bytes of a declared 1 MiB allocated %d bytes", n)
	}

	rec := newRecorder(httptest.NewRecorder(), 2<<20)
	rec.Header().Set("Content-Length", fmt.Sprint(1<<20))
	rec.WriteHeader(http.StatusOK)
	if c := cap(rec.body); c > initialBodyBuffer {
		t.Errorf("a declared 1 MiB response preallocated %d bytes", c)
	}
}

// The JSON config is bounded as the Caddyfile is: a huge max_request_body
// is refused at load, not met by a request that declares 100 GB.
func TestValidateBoundsBodyLimits(t *testing.T) {
	if err := loadHandlerJSON(t, `{"handler": "idempotency", "max_request_body": 2147483647, "max_response_body": 2147483647}`); err != nil {
		t.Errorf("the largest limits refused: %v", err)
	}
	for _, field := range []string{"max_request_body", "max_response_body"} {
		err := loadHandlerJSON(t, fmt.Sprintf(`{"handler": "idempotency", %q: 107374182400}`, field))
		if err == nil || !strings.Contains(err.Error(), field) || !strings.Contains(err.Error(), "2GiB") {
			t.Errorf("%s of 100 GB: %v, want a refusal", field, err)
		}
	}
}

// slowUpload is a protected POST whose body is sent in two parts, with
// as long as the test likes in between.
type slowUpload struct {
	conn net.Conn
	rest []byte
}

// startSlowUpload sends the head of a POST with a body of size bytes,
// and sent of them.
func startSlowUpload(t *testing.T, s *site, key string, size, sent int) *slowUpload {
	t.Helper()
	conn, err := net.Dial("tcp", strings.TrimPrefix(s.URL, "http://"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	_ = conn.SetDeadline(time.Now().Add(30 * time.Second))
	body := bytes.Repeat([]byte("s"), size)
	fmt.Fprintf(conn, "POST /pay HTTP/1.1\r\nHost: 127.0.0.1\r\nIdempotency-Key: %s\r\nAuthorization: %s\r\n"+
		"Content-Type: text/plain\r\nContent-Length: %d\r\n\r\n", key, defaultCred, size)
	if _, err := conn.Write(body[:sent]); err != nil {
		t.Fatal(err)
	}
	return &slowUpload{conn: conn, rest: body[sent:]}
}

// finish sends the rest of the body and reads the answer.
func (u *slowUpload) finish(t *testing.T) reply {
	t.Helper()
	if _, err := u.conn.Write(u.rest); err != nil {
		t.Fatal(err)
	}
	resp, err := http.ReadResponse(bufio.NewReader(u.conn), nil)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return reply{Status: resp.StatusCode, Header: resp.Header, Body: b}
}

// Slow uploads hold only what they sent of the body budget, which every
// protected request shares: once they hold most of it, a small body
// still fits, a larger one gets 503 with Retry-After as its bytes
// arrive, and the budget is whole again once they are done.
func TestRequestBodyBudget(t *testing.T) {
	const (
		chunk  = initialBodyBuffer
		budget = 16*chunk + 100 // a size no other test uses: budgets of a size are shared
		slow   = 5
		size   = 200_000
		sent   = 150_000 // the first buffer, a chunk and part of another: 3 chunks
	)
	up := newUpstream(t)
	port, adminPort := freeTCPPort(t), freeTCPPort(t)
	srv := startCaddyfileAdmin(t, fmt.Sprintf(`http://127.0.0.1:%d {
	idempotency {
		store memory
		max_request_body 256KiB
		request_body_budget %d
	}
	reverse_proxy %s
}
`, port, budget, up.Addr()), fmt.Sprintf("127.0.0.1:%d", adminPort))
	s := newSiteClient(t, srv, port)
	b := bodyBudgetOf(budget)
	admin := fmt.Sprintf("127.0.0.1:%d", adminPort)
	metric := func(name string) float64 { return scrapeMetrics(t, admin).of(srv.Servers).value(name) }
	refusals := metric("caddy_idempotency_request_body_budget_refusals_total")
	var uploads []*slowUpload
	for range slow {
		uploads = append(uploads, startSlowUpload(t, s, newKey(), size, sent))
	}
	storetest.WaitFor(t, 10*time.Second, "the slow uploads to reserve what they sent", func() bool {
		return b.used.Load() == slow*3*chunk
	})
	// The gauge is the process's, every budget's: what other budgets
	// hold, bodies that an earlier test's handlers are still reading,
	// counts too.
	othersHold := func() (n int64) {
		bodyBudgets.Range(func(_, other any) bool {
			if other != b {
				n += other.(*bodyBudget).used.Load()
			}
			return true
		})
		return n
	}
	storetest.WaitFor(t, 10*time.Second, "the buffered bytes metric to show what the slow uploads hold", func() bool {
		return metric("caddy_idempotency_request_body_buffered_bytes") == float64(othersHold()+slow*3*chunk)
	})

	wantExecuted(t, s.Do(t, call{Key: newKey(), Body: payBody()}), http.StatusCreated)
	big := call{Key: newKey(), Body: bytes.Repeat([]byte("b"), 100_000), ContentType: "text/plain"}
	r := s.Do(t, big)
	if p := wantProblem(t, r, http.StatusServiceUnavailable); p.Type != problemTypeBase+"body-budget" {
		t.Errorf("problem type %q, want #body-budget", p.Type)
	}
	wantRetryAfter(t, r)
	if got := metric("caddy_idempotency_request_body_budget_refusals_total"); got != refusals+1 {
		t.Errorf("refusals metric = %v, want %v", got, refusals+1)
	}
	wantCount(t, up, 1)

	for _, u := range uploads {
		wantExecuted(t, u.finish(t), http.StatusCreated)
	}
	storetest.WaitFor(t, 10*time.Second, "the budget to be released", func() bool { return b.used.Load() == 0 })
	wantExecuted(t, s.Do(t, big), http.StatusCreated)
	if e := up.Executions(); !bytes.Equal(e[len(e)-1].Body, big.Body) {
		t.Errorf("the upstream got %d bytes, want the %d sent", len(e[len(e)-1].Body), len(big.Body))
	}
	wantCount(t, up, slow+2)
	storetest.WaitFor(t, 10*time.Second, "the budget to be released", func() bool { return b.used.Load() == 0 })
}

// Bodies read in chunks reach the upstream byte for byte, and hold the
// budget for their size only once whole.
func TestReadBodyChunks(t *testing.T) {
	h := &Handler{MaxRequestBody: 1 << 20, bodyBudget: &bodyBudget{limit: defaultBodyBudget}, metrics: newHandlerMetrics("unit")}
	for _, n := range []int{0, 1, initialBodyBuffer - 1, initialBodyBuffer, initialBodyBuffer + 1, 3*initialBodyBuffer + 5, 1 << 20} {
		for _, declared := range []bool{true, false} {
			want := sizedBody("chunks", n)
			r := httptest.NewRequest(http.MethodPost, "/pay", io.MultiReader(bytes.NewReader(want)))
			r.ContentLength = -1
			if declared {
				r.ContentLength = int64(n)
			}
			body, held, prob := h.readBody(r)
			if prob != nil || !bytes.Equal(body, want) {
				t.Fatalf("%d bytes (declared %v): read %d bytes, %v", n, declared, len(body), prob)
			}
			if held != int64(cap(body)) || h.bodyBudget.used.Load() != held || held > int64(max(n+1, 512)) {
				t.Errorf("%d bytes (declared %v): holds %d of the budget (%d reserved) for a %d-byte buffer", n, declared, held, h.bodyBudget.used.Load(), cap(body))
			}
			h.bodyBudget.release(held)
		}
	}
	r := httptest.NewRequest(http.MethodPost, "/pay", bytes.NewReader(make([]byte, 1<<20+1)))
	r.ContentLength = -1
	if _, held, prob := h.readBody(r); prob == nil || prob.Status != http.StatusRequestEntityTooLarge {
		t.Errorf("a body over the limit: %v", prob)
	} else {
		h.bodyBudget.release(held)
	}
	if used := h.bodyBudget.used.Load(); used != 0 {
		t.Errorf("%d bytes of the budget still reserved", used)
	}
}

// request_body_budget: a size, refused with its line when it is not one,
// and at least what one body of max_request_body needs.
func TestRequestBodyBudgetConfig(t *testing.T) {
	for _, in := range []string{"request_body_budget", "request_body_budget 0", "request_body_budget lots", "request_body_budget 1MiB 2MiB", "request_body_budget -1"} {
		err := new(Handler).UnmarshalCaddyfile(caddyfile.NewTestDispenser("idempotency {\n" + in + "\n}"))
		if err == nil || !strings.Contains(err.Error(), ":2") {
			t.Errorf("%q: %v, want an error naming line 2", in, err)
		}
	}
	h := new(Handler)
	if err := h.UnmarshalCaddyfile(caddyfile.NewTestDispenser("idempotency {\nrequest_body_budget 8GiB\n}")); err != nil || h.RequestBodyBudget != 8<<30 {
		t.Errorf("8GiB: %v, %d", err, h.RequestBodyBudget)
	}
	if err := loadHandlerJSON(t, `{"handler": "idempotency", "max_request_body": 1048576, "request_body_budget": 1048576}`); err == nil || !strings.Contains(err.Error(), "request_body_budget") {
		t.Errorf("a budget that no body of the largest size fits: %v, want a refusal", err)
	}
	if err := loadHandlerJSON(t, `{"handler": "idempotency", "max_request_body": 1048576, "request_body_budget": 1179648}`); err != nil {
		t.Errorf("the smallest budget refused: %v", err)
	}
}

// A large body costs one buffer of its size, not the buffers it was
// grown through: doubling up to 1 MiB allocated twice the body, garbage
// that the heap grew by before a collection.
func TestReadBodyAllocatesItsSizeOnce(t *testing.T) {
	h := &Handler{MaxRequestBody: 1 << 20, bodyBudget: &bodyBudget{limit: defaultBodyBudget}, metrics: newHandlerMetrics("unit")}
	want := sizedBody("once", 1<<20-100)
	read := func() {
		r := httptest.NewRequest(http.MethodPost, "/pay", bytes.NewReader(want))
		body, held, prob := h.readBody(r)
		if prob != nil || len(body) != len(want) {
			t.Fatalf("read %d bytes, %v", len(body), prob)
		}
		h.bodyBudget.release(held)
	}
	read() // fills the chunk pool
	const n = 20
	var before, after runtime.MemStats
	runtime.ReadMemStats(&before)
	for range n {
		read()
	}
	runtime.ReadMemStats(&after)
	// The body and the first 64 KiB buffer; the margin is for chunks
	// that a collection (or the race detector) took from the pool.
	if per := (after.TotalAlloc - before.TotalAlloc) / n; per > uint64(len(want))*3/2 {
		t.Errorf("reading a %d-byte body allocated %d bytes", len(want), per)
	}
}

// Concurrent reservations never take more than the budget, and give
// back all they took.
func TestBodyBudgetConcurrent(t *testing.T) {
	b := &bodyBudget{limit: 10 * initialBodyBuffer}
	var wg sync.WaitGroup
	var over atomic.Bool
	for range 16 {
		wg.Go(func() {
			for range 2000 {
				if b.reserve(initialBodyBuffer) {
					if b.used.Load() > b.limit {
						over.Store(true)
					}
					b.release(initialBodyBuffer)
				}
			}
		})
	}
	wg.Wait()
	if over.Load() {
		t.Error("reservations exceeded the budget")
	}
	if used := b.used.Load(); used != 0 {
		t.Errorf("%d bytes still reserved", used)
	}
}

// waitingBody is a body none of whose bytes have arrived: Read blocks
// until arrive is closed, then reads r.
type waitingBody struct {
	entered func()
	once    sync.Once
	arrive  <-chan struct{}
	r       io.Reader
}

func (b *waitingBody) Read(p []byte) (int, error) {
	b.once.Do(b.entered)
	<-b.arrive
	return b.r.Read(p)
}
func (b *waitingBody) Close() error { return nil }

// Requests that declare a large body and send none of it hold none of
// the budget. 1,030 connections that sent only their headers, with
// Content-Length: 1048576, made every protected request get 503 while
// they waited: each reserved (and allocated) its first 64 KiB before a
// byte arrived.
func TestDeclaredBodiesHoldNoBudgetUntilTheyArrive(t *testing.T) {
	h := &Handler{MaxRequestBody: 1 << 20, bodyBudget: &bodyBudget{limit: defaultBodyBudget}, metrics: newHandlerMetrics("unit")}
	const waiting = 1030
	arrive := make(chan struct{})
	var entered sync.WaitGroup
	entered.Add(waiting)
	allEntered := make(chan struct{})
	go func() { entered.Wait(); close(allEntered) }()
	type read struct {
		held int64
		prob *problem
	}
	reads := make(chan read, waiting)
	for range waiting {
		r := httptest.NewRequest(http.MethodPost, "/pay", nil)
		r.Body = &waitingBody{entered: entered.Done, arrive: arrive, r: bytes.NewReader(sizedBody("late", 1000))}
		r.ContentLength = 1 << 20
		go func() {
			_, held, prob := h.readBody(r)
			reads <- read{held, prob}
		}()
	}
	var early []read
	select {
	case <-allEntered:
	case rd := <-reads:
		early = append(early, rd)
		for more := true; more; {
			select {
			case rd := <-reads:
				early = append(early, rd)
			case <-time.After(time.Second):
				more = false
			}
		}
	}
	if len(early) > 0 {
		t.Errorf("%d requests whose bodies had not arrived were answered before they did: %+v", len(early), early[0].prob)
	}
	if used := h.bodyBudget.used.Load(); used != 0 {
		t.Errorf("%d requests that sent no body byte hold %d bytes of the budget", waiting, used)
	}
	want := sizedBody("arrived", 100_000)
	body, held, prob := h.readBody(httptest.NewRequest(http.MethodPost, "/pay", bytes.NewReader(want)))
	if prob != nil || !bytes.Equal(body, want) {
		t.Errorf("a body that arrived, beside them: %d bytes, %+v", len(body), prob)
	}
	h.bodyBudget.release(held)

	close(arrive)
	for _, rd := range early {
		h.bodyBudget.release(rd.held)
	}
	for range waiting - len(early) {
		h.bodyBudget.release((<-reads).held)
	}
	if used := h.bodyBudget.used.Load(); used != 0 {
		t.Errorf("%d bytes of the budget still reserved", used)
	}
}
