package store

import (
	"encoding/json"
	"fmt"
	"net/http"
	"reflect"
	"strconv"
	"testing"
)

var headerJSONCases = []string{
	`{}`,
	` { } `,
	`{"Content-Type": ["application/json"], "X-Multi": ["one", "two"]}`,
	`{"Content-Type":["application/json"],"X-Multi":["one","two"]}`,
	`{"Empty": [], "Null": null}`,
	`{"X-Quote": ["a \"quoted\" \\ value\u0001\t"], "X-Utf8": ["Zoë \u00e9 \ud83d\ude00 \ud800"]}`,
	`{"Dup": ["a"], "Dup": ["b"]}`,
	`{"lower-case": ["kept as is"]}`,
	"{\n\t\"A\" : [ \"x\" , \"y\" ]\n}",
	// Not the shape: left to encoding/json, which errors or accepts.
	`null`,
	`[]`,
	`{"A": "x"}`,
	`{"A": [1]}`,
	`{"A": ["x"]} trailing`,
	`{"A": ["x"],}`,
	`{"A": ["x"]`,
	`{"A": ["\xff"]}`,
	`{"A": nul}`,
	``,
}

// TestDecodeHeaderJSON: the stored headers decode exactly as
// json.Unmarshal decodes them into an http.Header.
func TestDecodeHeaderJSON(t *testing.T) {
	for _, in := range headerJSONCases {
		checkHeaderJSON(t, []byte(in))
	}
	// What Postgres gives back for what Complete stored.
	h := http.Header{"Content-Type": {"application/json"}, "X-Multi": {"one", "two"}, "X-Nil": nil}
	b, _ := json.Marshal(h)
	got, err := decodeHeaderJSON(b)
	if err != nil || !reflect.DeepEqual(got, h) {
		t.Errorf("round trip: %v, %v; want %v", got, err, h)
	}
	if _, ok := parseHeaderJSON(b); !ok {
		t.Error("json.Marshal's output took the slow path")
	}
}

func checkHeaderJSON(t *testing.T, b []byte) {
	t.Helper()
	var want http.Header
	wantErr := json.Unmarshal(b, &want)
	got, err := decodeHeaderJSON(b)
	if (err != nil) != (wantErr != nil) {
		t.Fatalf("%q: error %v, encoding/json says %v", b, err, wantErr)
	}
	if err == nil && !reflect.DeepEqual(got, want) {
		t.Fatalf("%q: decoded %#v, encoding/json decodes %#v", b, got, want)
	}
}

func FuzzDecodeHeaderJSON(f *testing.F) {
	for _, in := range headerJSONCases {
		f.Add([]byte(in))
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		checkHeaderJSON(t, b)
	})
}

func BenchmarkDecodeHeaderJSON(b *testing.B) {
	in := []byte(`{"Date": ["Mon, 30 Nov 2026 12:00:00 GMT"], "Content-Type": ["application/json"], "Cache-Control": ["no-store"], "Content-Length": ["1024"], "X-Request-Id": ["f3a9c2e1"]}`)
	b.Run("custom", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			if _, err := decodeHeaderJSON(in); err != nil {
				b.Fatal(err)
			}
		}
	})
	b.Run("encoding/json", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			var h http.Header
			if err := json.Unmarshal(in, &h); err != nil {
				b.Fatal(err)
			}
		}
	})
}

// The binary encoding keeps every byte of names and values, and refuses
// truncated or corrupt input instead of inventing headers.
func TestHeaderBinaryEncoding(t *testing.T) {
	h := http.Header{
		"X-Ref":               {"a\x00b\xff", ""},
		"Trailer:Grpc-Status": {"0"},
		"\x80":                {},
	}
	b := EncodeHeaders(h)
	if b[0] != headerFormatBinary {
		t.Fatalf("first byte %#x", b[0])
	}
	got, err := DecodeHeaders(b)
	if err != nil || !reflect.DeepEqual(got, h) {
		t.Fatalf("decoded %q, %v; want %q", got, err, h)
	}
	for n := 1; n < len(b); n++ {
		if got, err := DecodeHeaders(b[:n]); err == nil && len(got) == len(h) {
			t.Errorf("truncated to %d bytes: %q, want an error or fewer headers", n, got)
		}
	}
	if _, err := DecodeHeaders([]byte{headerFormatBinary, 1, 'X', 0xff, 0xff, 0xff, 0xff, 0x0f}); err == nil {
		t.Errorf("a value count beyond the input: no error")
	}
	if got, err := DecodeHeaders([]byte(`{"X-A":["1"]}`)); err != nil || got.Get("X-A") != "1" {
		t.Errorf("JSON of older rows: %q, %v", got, err)
	}
}

// Decoding stored headers costs as many allocations for 40 headers as
// for 2 (the map, the value slices, and one string that every name and
// value slices): a replay's cost should not grow with them. Catches a
// decoder that allocates per header or per value.
func TestHeaderDecodingAllocations(t *testing.T) {
	allocs := func(n int) (float64, []byte) {
		h := http.Header{}
		for i := range n {
			h[fmt.Sprintf("X-H%d", i)] = []string{"a", strconv.Itoa(i)}
		}
		b := EncodeHeaders(h)
		return testing.AllocsPerRun(100, func() { _, _ = DecodeHeaders(b) }), b
	}
	few, _ := allocs(2)
	many, _ := allocs(40)
	// A map of 40 takes a few allocations more than a map of 2 (its
	// groups); a decoder that allocates per header takes 80 more.
	if many > few+4 {
		t.Errorf("decoding 40 headers: %v allocations, 2 headers: %v", many, few)
	}
}

// A sealed response's mark round-trips, and is what a version before
// sealing refuses: its decoder was DecodeHeaders, which must fail on
// the mark rather than read it as headers (and the sealed body as the
// body to replay).
func TestSealedMarkFailsClosedBeforeSealing(t *testing.T) {
	mark := EncodeResponseHeaders(&Response{Sealed: true, Header: http.Header{"X-A": {"1"}}})
	if _, err := DecodeHeaders(mark); err == nil {
		t.Fatalf("DecodeHeaders(%x) decoded the sealed mark", mark)
	}
	var r Response
	if err := DecodeResponseHeaders(mark, &r); err != nil || !r.Sealed || r.Header != nil {
		t.Fatalf("DecodeResponseHeaders(%x) = %+v, %v", mark, r, err)
	}
	plain := EncodeResponseHeaders(&Response{Header: http.Header{"X-A": {"1"}}})
	r = Response{}
	if err := DecodeResponseHeaders(plain, &r); err != nil || r.Sealed || r.Header.Get("X-A") != "1" {
		t.Fatalf("DecodeResponseHeaders(%x) = %+v, %v", plain, r, err)
	}
}
