package load

import (
	"context"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"
)

func TestKeyAndBodies(t *testing.T) {
	k := Key("run1", 42)
	if len(k) != KeyLen || !strings.HasPrefix(k, "bench-run1") || !strings.HasSuffix(k, "-000000000042") {
		t.Errorf("Key = %q (%d bytes, want %d)", k, len(k), KeyLen)
	}
	if len(Key("abcdefghij", 1)) != KeyLen {
		t.Error("a long run name changes the key length")
	}
	if b := ChargeBody(k, RequestBodySize); len(b) != RequestBodySize || !strings.Contains(string(b), k) {
		t.Errorf("ChargeBody: %d bytes, want %d with the key", len(b), RequestBodySize)
	}
	if b := ResponseBody(ResponseBodySize); len(b) != ResponseBodySize || strings.Count(string(b), "{") != 1 {
		t.Errorf("ResponseBody: %d bytes, want %d, one flat object", len(b), ResponseBodySize)
	}
}

// TestHTTPLoad drives a test server through the minimal client: keys are
// unique (or cycle with Keys), answers are checked, and Content-Length,
// chunked and closing responses all parse.
func TestHTTPLoad(t *testing.T) {
	var mu sync.Mutex
	seen := map[string]int{}
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		key := r.Header.Get("Idempotency-Key")
		mu.Lock()
		seen[key]++
		n := seen[key]
		mu.Unlock()
		if key != "" && !strings.Contains(string(body), key) {
			http.Error(w, "body without its key", http.StatusBadRequest)
			return
		}
		if n > 1 {
			w.Header().Set("Idempotent-Replay", "true")
		}
		switch len(key) % 3 {
		case 0: // chunked
			w.WriteHeader(http.StatusOK)
			for range 3 {
				_, _ = w.Write(ResponseBody(300))
				w.(http.Flusher).Flush()
			}
		case 1: // closes the connection
			w.Header().Set("Connection", "close")
			_, _ = w.Write(ResponseBody(ResponseBodySize))
		default:
			_, _ = w.Write(ResponseBody(ResponseBodySize))
		}
	}))
	defer srv.Close()
	addr := strings.TrimPrefix(srv.URL, "http://")
	run := func(t HTTPTarget, cfg Config) Result {
		res, err := Run(context.Background(), cfg, func(int) (Op, error) { return t.NewHTTPOp() })
		if err != nil {
			panic(err)
		}
		return res
	}
	no, yes := false, true

	first := run(HTTPTarget{Addr: addr, Path: "/p", Credential: "c", Run: "t1", BodySize: RequestBodySize, Expect: 200, Replay: &no},
		Config{Concurrency: 4, Count: 60})
	if first.Requests != 60 || first.Errors != 0 {
		t.Fatalf("first executions: %+v", first)
	}
	if len(seen) != 60 {
		t.Errorf("%d distinct keys, want 60", len(seen))
	}
	replays := run(HTTPTarget{Addr: addr, Path: "/p", Credential: "c", Run: "t1", Keys: 60, BodySize: RequestBodySize, Expect: 200, Replay: &yes},
		Config{Concurrency: 4, Warmup: 20 * time.Millisecond, Duration: 150 * time.Millisecond})
	if replays.Requests == 0 || replays.Errors != 0 || replays.P99 < replays.P50 {
		t.Fatalf("replays: %+v", replays)
	}
	if len(seen) != 60 {
		t.Errorf("replays sent new keys: %d distinct", len(seen))
	}
	// A failed check is an error, not a request.
	wrong := run(HTTPTarget{Addr: addr, Path: "/p", Credential: "c", Run: "t2", BodySize: 100, Expect: 201},
		Config{Concurrency: 2, Count: 5})
	if wrong.Errors != 5 || wrong.Requests != 0 || !strings.Contains(wrong.FirstError, "status 200") {
		t.Errorf("unexpected statuses: %+v", wrong)
	}
}

// TestRunStopsEarly: cancelling during the measured window ends it with a
// result, as the scale benchmark does when pruning ends.
func TestRunStopsEarly(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 150*time.Millisecond)
	defer cancel()
	res, err := Run(ctx, Config{Concurrency: 2, Warmup: 50 * time.Millisecond, Duration: time.Hour},
		func(int) (Op, error) {
			return func(ctx context.Context, _ int64) error { time.Sleep(time.Millisecond); return nil }, nil
		})
	if err != nil || res.Requests == 0 || res.Seconds > 1 {
		t.Errorf("Run = %+v, %v; want a short window with requests", res, err)
	}
}
