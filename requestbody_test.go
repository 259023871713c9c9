package idempotency

import (
	"bytes"
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"runtime"
	"strings"
	"testing"
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
	h := &Handler{MaxRequestBody: 2 << 20}
	r := httptest.NewRequest(http.MethodPost, "/pay", nil)
	r.Body = &stallingBody{}
	r.ContentLength = 1 << 20
	var before, after runtime.MemStats
	runtime.ReadMemStats(&before)
	body, prob := h.readBody(r)
	runtime.ReadMemStats(&after)
	if prob == nil || string(body) != "0123456789" {
		t.Fatalf("a stalled body read as %q, %v", body, prob)
	}
	if c := cap(body); c > initialBodyBuffer {
		t.Errorf("reading 10 bytes of a declared 1 MiB holds a %d-byte buffer", c)
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
