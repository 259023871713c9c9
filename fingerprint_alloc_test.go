package idempotency

import (
	"runtime"
	"strings"
	"testing"

	"github.com/caddy-idempotency/idempotency/internal/canonjson"
)

// TestFingerprintMemory: canonicalising a body costs memory of a small
// multiple of its size, whatever its shape: a value does not cost a node.
func TestFingerprintMemory(t *testing.T) {
	const size = 1 << 20
	// repeat fills a 1 MiB JSON array (or object) with item.
	repeat := func(open, item, close string) []byte {
		var b strings.Builder
		b.WriteString(open)
		for b.Len() < size-len(item)-len(close) {
			if b.Len() > len(open) {
				b.WriteString(",")
			}
			b.WriteString(item)
		}
		b.WriteString(close)
		return []byte(b.String())
	}
	var members strings.Builder
	members.WriteString("{")
	for i := 0; members.Len() < size-16; i++ {
		if i > 0 {
			members.WriteString(",")
		}
		members.WriteString(`"` + string(rune('a'+i%26)) + `":0`)
	}
	members.WriteString("}")
	nested := strings.Repeat(`{"a":`, canonjson.MaxDepth-1) + "0" + strings.Repeat("}", canonjson.MaxDepth-1)

	for _, c := range []struct {
		name  string
		body  []byte
		ratio float64 // bytes allocated per byte of body, at most
	}{
		{"an array of zeros", repeat("[", "0", "]"), 0.12},
		{"an object of tiny members", []byte(members.String()), 1},
		{"tiny objects", repeat("[", `{"a":0}`, "]"), 2},
		{"deep nesting", repeat("[", nested, "]"), 2.5},
		{"deep nesting, empty names", repeat("[", strings.ReplaceAll(nested, `"a"`, `""`), "]"), 2.6},
		{"nested arrays", repeat("[", strings.Repeat("[", canonjson.MaxDepth-1)+"0"+strings.Repeat("]", canonjson.MaxDepth-1), "]"), 0.12},
	} {
		if _, ok := canonicalJSON(nil, c.body); !ok {
			t.Fatalf("%s: not canonicalised", c.name)
		}
		h := head("/", "", "application/json")
		allocated := uint64(1 << 62)
		// The least of up to ten: the count is the process's, and other
		// tests allocate meanwhile. A count within the bound ends it (each
		// try is a second under the race detector).
		for range 10 {
			runtime.GC() // twice: empties the pool, as for a first request
			runtime.GC()
			var before, after runtime.MemStats
			runtime.ReadMemStats(&before)
			fingerprint(h, c.body)
			runtime.ReadMemStats(&after)
			if allocated = min(allocated, after.TotalAlloc-before.TotalAlloc); float64(allocated) <= c.ratio*float64(len(c.body)) {
				break
			}
		}
		ratio := float64(allocated) / float64(len(c.body))
		t.Logf("%s: %d bytes of body, %d allocated (%.2fx)", c.name, len(c.body), allocated, ratio)
		if ratio > c.ratio {
			t.Errorf("%s: fingerprinting %d bytes allocated %d (%.2fx), want at most %.1fx", c.name, len(c.body), allocated, ratio, c.ratio)
		}
	}
}
