package idempotency

import (
	"bytes"
	"crypto/sha256"
	"encoding/binary"
	"fmt"
	"strings"
	"testing"

	"github.com/caddy-idempotency/idempotency/internal/canonjson"
)

// referenceFingerprint is fingerprint computed the plain way: the whole
// hash input built in memory, then hashed.
func referenceFingerprint(h requestHead, body []byte) [32]byte {
	buf := []byte(fingerprintDomain)
	for _, field := range [...]string{h.Method, h.Host, h.Path, h.RawQuery} {
		buf = binary.BigEndian.AppendUint64(buf, uint64(len(field)))
		buf = append(buf, field...)
	}
	buf = appendMediaType(buf, h.ContentType)
	if len(h.ContentType) == 1 && isJSONContentType(h.ContentType[0]) {
		if out, ok := canonicalJSON(nil, body); ok {
			return sha256.Sum256(append(append(buf, bodyCanon), out...))
		}
	}
	return sha256.Sum256(append(append(buf, bodyRaw), body...))
}

// canonicalJSON is the canonical form of body, as fingerprint hashes it.
func canonicalJSON(dst, body []byte) ([]byte, bool) {
	return new(canonjson.State).Append(dst, body, nil)
}

// TestFingerprintHostileNestingHashedRaw: a body nested far past the
// canonicaliser's limit is hashed raw.
func TestFingerprintHostileNestingHashedRaw(t *testing.T) {
	const depth = 100_000
	for name, body := range map[string]string{
		"arrays":   strings.Repeat("[", depth) + strings.Repeat("]", depth),
		"objects":  strings.Repeat(`{"a":`, depth) + "1" + strings.Repeat("}", depth),
		"unclosed": strings.Repeat("[", depth),
	} {
		h := head("/", "", "application/json")
		if fingerprint(h, []byte(body)) != referenceFingerprint(h, []byte(body)) {
			t.Fatalf("%s: a body that cannot be canonicalised is not hashed raw", name)
		}
	}
}

// FuzzFingerprintStreams: the fingerprint streamed through the hash is
// that of the whole input built in memory, whatever the body.
func FuzzFingerprintStreams(f *testing.F) {
	for _, seed := range []string{
		`{"a":1,"b":2}`, `{ "b": 2, "a": 1 }`, `[1.0, -0, 1e-7, "\u00e9", "é", null, true, false]`,
		`{"a":{"d":[{"y":1,"x":2}],"c":{}},"a":[]}`, `{"\ud83d\ude00":1,"\ud800":2,"\u0061":3,"a":4}`,
		`{"a":1}x`, `[1,]`, "\"\xff\"", strings.Repeat("[", canonjson.MaxDepth+1),
		`{"amount":1,"b":0,"AMOUNT":2}`, `{"\u212a":1,"k":2,"s":3,"\u017f":4}`, `{"user_id":1,"userid":2}`,
	} {
		f.Add([]byte(seed))
	}
	f.Fuzz(func(t *testing.T, in []byte) {
		if got, want := fingerprint(head("/", "", "application/json"), in), referenceFingerprint(head("/", "", "application/json"), in); got != want {
			t.Fatalf("the streamed fingerprint of %q differs from the whole-input one", in)
		}
	})
}

// head is the requestHead of a POST to example.com with one Content-Type
// field, or none if contentType is "".
func head(path, rawQuery, contentType string) requestHead {
	h := requestHead{Method: "POST", Host: "example.com", Path: path, RawQuery: rawQuery}
	if contentType != "" {
		h.ContentType = []string{contentType}
	}
	return h
}

// TestFingerprintStreamsLargeBodies: hashing the input as it is produced,
// a few KiB at a time, gives the fingerprint of the whole input.
func TestFingerprintStreamsLargeBodies(t *testing.T) {
	var members bytes.Buffer
	members.WriteString("{")
	for i := range 5000 {
		if i > 0 {
			members.WriteString(" , ")
		}
		fmt.Fprintf(&members, `"k%05d" : [%d, "v", {"z": null, "a": true}]`, 4999-i, i)
	}
	members.WriteString("}")
	bigString := `{"note": "` + strings.Repeat("x", 100<<10) + `", "amount": 1}`
	bigKey := `{"` + strings.Repeat("k", 40<<10) + `": 1, "a": 2}`
	cases := map[string]struct {
		contentType string
		body        []byte
	}{
		"many members":       {"application/json", members.Bytes()},
		"a long string":      {"application/json", []byte(bigString)},
		"a long member name": {"application/json", []byte(bigKey)},
		"invalid JSON":       {"application/json", append(members.Bytes(), '}')},
		"not JSON":           {"text/plain", members.Bytes()},
		"small":              {"application/json", []byte(`{"b":2,"a":1}`)},
		"empty":              {"application/json", nil},
	}
	for name, c := range cases {
		got := fingerprint(head("/v1/charges", "x=1", c.contentType), c.body)
		if want := referenceFingerprint(head("/v1/charges", "x=1", c.contentType), c.body); got != want {
			t.Errorf("%s: streamed fingerprint %x, whole-input fingerprint %x", name, got, want)
		}
		// And again, from a pooled state that held a large input.
		if again := fingerprint(head("/v1/charges", "x=1", c.contentType), c.body); again != got {
			t.Errorf("%s: a second fingerprint differs", name)
		}
	}
}

func BenchmarkFingerprint1MiB(b *testing.B) {
	body := []byte(`{"note": "` + strings.Repeat("x", 1<<20-32) + `", "amount": 1}`)
	b.ReportAllocs()
	b.SetBytes(int64(len(body)))
	for b.Loop() {
		fingerprint(head("/v1/charges", "", "application/json"), body)
	}
}
