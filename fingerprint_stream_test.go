package idempotency

import (
	"bytes"
	"crypto/sha256"
	"encoding/binary"
	"fmt"
	"strings"
	"testing"
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
