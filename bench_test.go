package idempotency

// Micro-benchmarks of the hot path (go test -bench . -benchmem; `make
// bench` runs them), besides those of fingerprint_test.go
// (BenchmarkFingerprintJSON2KiB, BenchmarkCanonicalJSON), and the test
// that a replay's allocations do not grow with the body beyond one copy.

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"net/url"
	"runtime"
	"strconv"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/caddy-idempotency/idempotency/internal/pgtest"
	"github.com/caddy-idempotency/idempotency/store"
	"github.com/caddy-idempotency/idempotency/stores/memory"
	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
)

// discardWriter is a ResponseWriter that keeps nothing but its header map
// (reused from request to request, as the handler clears it on replay).
type discardWriter struct {
	header http.Header
	status int
	n      int
	keep   bool
	kept   []byte
}

func (w *discardWriter) Header() http.Header    { return w.header }
func (w *discardWriter) WriteHeader(status int) { w.status = status }
func (w *discardWriter) Write(p []byte) (int, error) {
	if w.keep {
		w.kept = append(w.kept, p...)
	}
	w.n += len(p)
	return len(p), nil
}

// rewindBody is a request body that is reset before each request, so
// that the benchmark itself allocates nothing per request.
type rewindBody struct{ *bytes.Reader }

func (rewindBody) Close() error { return nil }

// replayBench is a provisioned handler, with the memory store, and a
// request that replays a key completed with a body of the given size.
type replayBench struct {
	h    *Handler
	r    *http.Request
	body *bytes.Reader
	req  []byte
	w    *discardWriter
}

func newReplayBench(tb testing.TB, respSize int, cache bool) *replayBench {
	tb.Helper()
	// The memory store, without the warning its Provision logs (with a
	// stack trace, through Caddy's default logger) at every benchmark.
	h := &Handler{PruneInterval: new(caddy.Duration), StoreRaw: []byte(`{"backend":"bench_memory"}`)}
	if !cache {
		h.ReplayCache = new(int64)
	}
	if err := provisionHandler(tb, h); err != nil {
		tb.Fatal(err)
	}
	if rc, ok := h.store.(*replayCache); ok {
		rc.learnOnComplete = false // as in front of the memory store
	}
	// Replays log a line each: encode it as production does, to nowhere.
	h.logger = zap.New(zapcore.NewCore(
		zapcore.NewJSONEncoder(zap.NewProductionEncoderConfig()), zapcore.AddSync(io.Discard), zapcore.InfoLevel))

	reqBody := []byte(`{"amount":129900,"currency":"eur","customer":"cus_Q4mYf3kLx2","description":"Order 1001"}`)
	b := &replayBench{
		h:    h,
		body: bytes.NewReader(reqBody),
		req:  reqBody,
		w:    &discardWriter{header: make(http.Header)},
	}
	repl := caddy.NewReplacer()
	b.r = (&http.Request{
		Method:        http.MethodPost,
		URL:           &url.URL{Path: "/v1/charges"},
		Proto:         "HTTP/1.1",
		ProtoMajor:    1,
		ProtoMinor:    1,
		Header:        http.Header{},
		Body:          rewindBody{b.body},
		ContentLength: int64(len(reqBody)),
	}).WithContext(context.WithValue(context.Background(), caddy.ReplacerCtxKey, repl))
	key := "bench-" + pgtest.RandomHex(8)
	setHeader := func() {
		// Executing re-files the key header (hideKeyFromTransport).
		b.r.Header = http.Header{
			"Idempotency-Key": {key},
			"Authorization":   {"Bearer sk_test_bench"},
			"Content-Type":    {"application/json"},
		}
	}
	setHeader()

	// The first request executes and stores a response of respSize bytes.
	respBody := bytes.Repeat([]byte("x"), respSize)
	upstream := caddyhttp.HandlerFunc(func(w http.ResponseWriter, r *http.Request) error {
		if _, err := io.Copy(io.Discard, r.Body); err != nil {
			return err
		}
		w.Header().Set("Content-Type", "application/json")
		w.Header().Set("Content-Length", strconv.Itoa(len(respBody)))
		w.WriteHeader(http.StatusCreated)
		_, err := w.Write(respBody)
		return err
	})
	if err := h.ServeHTTP(b.w, b.r, upstream); err != nil {
		tb.Fatal(err)
	}
	if b.w.status != http.StatusCreated {
		tb.Fatalf("first request: status %d", b.w.status)
	}
	b.r.Body = rewindBody{b.body}
	setHeader()
	return b
}

var errNextCalled = errors.New("a replay called the next handler")

// replay serves one replay of the completed key.
func (b *replayBench) replay() error {
	b.body.Reset(b.req)
	b.w.n, b.w.keep, b.w.kept = 0, true, b.w.kept[:0]
	err := b.h.ServeHTTP(b.w, b.r, caddyhttp.HandlerFunc(func(http.ResponseWriter, *http.Request) error {
		return errNextCalled
	}))
	if err != nil {
		return err
	}
	if b.w.status != http.StatusCreated || b.w.header.Get("Idempotent-Replay") != "true" {
		return fmt.Errorf("not a replay: status %d, header %v, body %q", b.w.status, b.w.header, b.w.kept)
	}
	return nil
}

// BenchmarkReplay replays a completed key from the replay cache (the
// default) and from the memory store itself (replay_cache off).
func BenchmarkReplay(b *testing.B) {
	for _, from := range []string{"cache", "store"} {
		for _, size := range []int{1 << 10, 64 << 10} {
			b.Run(fmt.Sprintf("%s/%dKiB", from, size>>10), func(b *testing.B) {
				rb := newReplayBench(b, size, from == "cache")
				b.ReportAllocs()
				b.SetBytes(int64(size))
				for b.Loop() {
					if err := rb.replay(); err != nil {
						b.Fatal(err)
					}
				}
			})
		}
	}
}

// TestReplayAllocationsIndependentOfBodySize: a replay allocates as many
// times for a 64 KiB body as for a 1 KiB one, and at most one more copy of
// the body in bytes.
func TestReplayAllocationsIndependentOfBodySize(t *testing.T) {
	for _, from := range []string{"cache", "store"} {
		t.Run(from, func(t *testing.T) { testReplayAllocations(t, from == "cache") })
	}
}

func testReplayAllocations(t *testing.T, cache bool) {
	measure := func(size int) (allocs float64, bytesPerRun uint64) {
		rb := newReplayBench(t, size, cache)
		run := func() {
			if err := rb.replay(); err != nil {
				t.Fatal(err)
			}
		}
		allocs = testing.AllocsPerRun(200, run)
		var before, after runtime.MemStats
		runtime.ReadMemStats(&before)
		const n = 200
		for range n {
			run()
		}
		runtime.ReadMemStats(&after)
		return allocs, (after.TotalAlloc - before.TotalAlloc) / n
	}
	smallAllocs, smallBytes := measure(1 << 10)
	bigAllocs, bigBytes := measure(64 << 10)
	t.Logf("replay of 1 KiB: %.0f allocs, %d B; of 64 KiB: %.0f allocs, %d B", smallAllocs, smallBytes, bigAllocs, bigBytes)
	slack := 0.0
	if raceEnabled {
		slack = 2 // pooled buffers the race detector dropped, in either run
	}
	if bigAllocs > smallAllocs+slack {
		t.Errorf("a 64 KiB replay allocates %.0f times, a 1 KiB one %.0f: allocations grow with the body", bigAllocs, smallAllocs)
	}
	// No copy of the body at all: the cache and the memory store share
	// theirs, read-only. A copy of the extra 63 KiB would show here.
	if extra := int64(bigBytes) - int64(smallBytes); extra > 8<<10 {
		t.Errorf("a 64 KiB replay allocates %d bytes more than a 1 KiB one: it copies the body", extra)
	}
}

// BenchmarkRecorder records a 1 KiB response written in one piece, as
// reverse_proxy writes a small upstream response, and builds the Response
// that the store keeps.
func BenchmarkRecorder(b *testing.B) {
	body := bytes.Repeat([]byte("r"), 1<<10)
	excluded := map[string]struct{}{}
	for _, name := range alwaysExcluded {
		excluded[http.CanonicalHeaderKey(name)] = struct{}{}
	}
	w := &discardWriter{header: make(http.Header)}
	b.ReportAllocs()
	b.SetBytes(int64(len(body)))
	for b.Loop() {
		clear(w.header)
		h := w.header
		h["Content-Type"] = []string{"application/json"}
		h["Content-Length"] = []string{"1024"}
		h["Date"] = []string{"Mon, 30 Nov 2026 12:00:00 GMT"}
		rec := newRecorder(w, defaultMaxBody)
		rec.WriteHeader(http.StatusOK)
		_, _ = rec.Write(body)
		if resp := rec.response(excluded); len(resp.Body) != len(body) {
			b.Fatal("body not recorded")
		}
	}
}

// BenchmarkFirstExecution runs the first execution of a new key each time,
// with the memory store, in front of a handler that answers 1 KiB: the
// handler's own cost of executing and recording, without the network.
func BenchmarkFirstExecution(b *testing.B) {
	fe := newFirstExecutionBench(b, 1<<10)
	b.ReportAllocs()
	for b.Loop() {
		fe.run(b)
	}
}

// firstExecutionBench executes a new key each run, with the memory store,
// in front of a handler that answers respSize bytes with their length.
type firstExecutionBench struct {
	rb   *replayBench
	next caddyhttp.Handler
	keys []string
	i    int
}

func newFirstExecutionBench(tb testing.TB, respSize int) *firstExecutionBench {
	respBody := bytes.Repeat([]byte("x"), respSize)
	length := strconv.Itoa(respSize)
	next := caddyhttp.HandlerFunc(func(w http.ResponseWriter, r *http.Request) error {
		if _, err := io.Copy(io.Discard, r.Body); err != nil {
			return err
		}
		h := w.Header()
		h["Content-Type"] = []string{"application/json"}
		h["Content-Length"] = []string{length}
		w.WriteHeader(http.StatusCreated)
		_, err := w.Write(respBody)
		return err
	})
	return &firstExecutionBench{rb: newReplayBench(tb, respSize, true), next: next}
}

func (fe *firstExecutionBench) run(tb testing.TB) {
	rb := fe.rb
	if fe.i == len(fe.keys) {
		if b, ok := tb.(*testing.B); ok {
			b.StopTimer()
			defer b.StartTimer()
		}
		fe.keys, fe.i = make([]string, 0, 1<<12), 0
		for range 1 << 12 {
			fe.keys = append(fe.keys, "first-"+pgtest.RandomHex(8))
		}
	}
	rb.body.Reset(rb.req)
	clear(rb.w.header)
	rb.r.Header["Idempotency-Key"] = fe.keys[fe.i : fe.i+1 : fe.i+1]
	delete(rb.r.Header, "idempotency-key")
	fe.i++
	if err := rb.h.ServeHTTP(rb.w, rb.r, fe.next); err != nil {
		tb.Fatal(err)
	}
	if rb.w.status != http.StatusCreated {
		tb.Fatalf("status %d", rb.w.status)
	}
}

// A first execution copies the response body once, into the recorder,
// whose copy the memory store keeps: a store that copied it again would
// allocate a second body per first execution.
func TestFirstExecutionCopiesTheBodyOnce(t *testing.T) {
	measure := func(size int) uint64 {
		fe := newFirstExecutionBench(t, size)
		for range 100 {
			fe.run(t) // the keys, the store's map and the pools
		}
		var before, after runtime.MemStats
		const n = 200
		runtime.ReadMemStats(&before)
		for range n {
			fe.run(t)
		}
		runtime.ReadMemStats(&after)
		return (after.TotalAlloc - before.TotalAlloc) / n
	}
	small, big := measure(1<<10), measure(64<<10)
	extra := int64(big) - int64(small)
	t.Logf("first execution answering 1 KiB: %d B; 64 KiB: %d B (%d more)", small, big, extra)
	if extra > (63+8)<<10 {
		t.Errorf("a first execution of a 64 KiB response allocates %d bytes more than one of 1 KiB: the body is copied more than once", extra)
	}
}

// benchMemoryStore is the memory store, unprovisioned: see newReplayBench.
type benchMemoryStore struct{ store.Store }

// The memory store, as production provisions it (storeCall).
func (benchMemoryStore) InProcess() {}

func (benchMemoryStore) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{
		ID: "http.handlers.idempotency.stores.bench_memory",
		New: func() caddy.Module {
			return &benchMemoryStore{memory.New(1<<24, time.Now)}
		},
	}
}

func init() { caddy.RegisterModule(benchMemoryStore{}) }

// BenchmarkFirstExecutionPostgres compares, side by side in one run, the
// handler's own CPU per first execution on the memory store and on the
// Postgres store (records sealed, its default): b.N new keys each, from
// 32 goroutines at once, as `make bench`'s 32 connections send them, in
// front of a handler that answers 1 KiB. The CPU is this process's, user
// and system, garbage collection and scheduling included; the Postgres
// server's is another process's. pg-mem_us/op is what the Postgres path
// adds to a request in Caddy: `make bench`'s row 2 less row 5a, without
// the HTTP and its noise.
func BenchmarkFirstExecutionPostgres(b *testing.B) {
	pg := &Handler{PruneInterval: new(caddy.Duration), StoreRaw: fmt.Appendf(nil,
		`{"backend":"postgres","dsn":%q,"table":%q}`, pgtest.DSN(b), pgtest.FreshTable(b))}
	mem := &Handler{PruneInterval: new(caddy.Duration), StoreRaw: []byte(`{"backend":"bench_memory"}`)}
	for _, h := range []*Handler{mem, pg} {
		if err := provisionHandler(b, h); err != nil {
			b.Fatal(err)
		}
		h.logger = zap.NewNop()
	}
	reqBody := []byte(`{"amount":129900,"currency":"eur","customer":"cus_Q4mYf3kLx2","description":"Order 1001"}`)
	respBody := bytes.Repeat([]byte("x"), 1<<10)
	next := caddyhttp.HandlerFunc(func(w http.ResponseWriter, r *http.Request) error {
		if _, err := io.Copy(io.Discard, r.Body); err != nil {
			return err
		}
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusCreated)
		_, err := w.Write(respBody)
		return err
	})
	prefix := "pgbench-" + pgtest.RandomHex(8) + "-"
	run := func(h *Handler, tag string, n int) (cpuPerOp time.Duration, allocsPerOp, bytesPerOp float64) {
		var (
			i        atomic.Int64
			failed   atomic.Pointer[error]
			wg       sync.WaitGroup
			m0, m1   runtime.MemStats
			ru0, ru1 syscall.Rusage
		)
		runtime.GC()
		runtime.ReadMemStats(&m0)
		_ = syscall.Getrusage(syscall.RUSAGE_SELF, &ru0)
		for range 32 {
			wg.Go(func() {
				for k := i.Add(1); k <= int64(n); k = i.Add(1) {
					r := httptest.NewRequest(http.MethodPost, "/v1/charges", bytes.NewReader(reqBody))
					r.Header.Set("Idempotency-Key", prefix+tag+strconv.FormatInt(k, 10))
					r.Header.Set("Authorization", "Bearer sk_test_bench")
					r.Header.Set("Content-Type", "application/json")
					r = r.WithContext(context.WithValue(r.Context(), caddy.ReplacerCtxKey, caddy.NewReplacer()))
					w := &discardWriter{header: make(http.Header)}
					if err := h.ServeHTTP(w, r, next); err != nil || w.status != http.StatusCreated {
						err = fmt.Errorf("status %d, error %v", w.status, err)
						failed.Store(&err)
						return
					}
				}
			})
		}
		wg.Wait()
		_ = syscall.Getrusage(syscall.RUSAGE_SELF, &ru1)
		runtime.ReadMemStats(&m1)
		if err := failed.Load(); err != nil {
			b.Fatal(*err)
		}
		cpu := time.Duration(ru1.Utime.Nano()-ru0.Utime.Nano()) + time.Duration(ru1.Stime.Nano()-ru0.Stime.Nano())
		return cpu / time.Duration(n), float64(m1.Mallocs-m0.Mallocs) / float64(n), float64(m1.TotalAlloc-m0.TotalAlloc) / float64(n)
	}
	run(mem, "warm-", 200) // connections, pools, the memory store's map
	run(pg, "warm-", 200)
	b.ResetTimer()
	memCPU, memAllocs, memBytes := run(mem, "", b.N)
	pgCPU, pgAllocs, pgBytes := run(pg, "", b.N)
	b.ReportMetric(float64(memCPU.Nanoseconds())/1e3, "mem_us/op")
	b.ReportMetric(float64(pgCPU.Nanoseconds())/1e3, "pg_us/op")
	b.ReportMetric(float64((pgCPU-memCPU).Nanoseconds())/1e3, "pg-mem_us/op")
	b.ReportMetric(float64(pgCPU)/float64(memCPU), "pg/mem")
	b.ReportMetric(memAllocs, "mem_allocs/op")
	b.ReportMetric(pgAllocs, "pg_allocs/op")
	b.ReportMetric(memBytes, "mem_B/op")
	b.ReportMetric(pgBytes, "pg_B/op")
}
