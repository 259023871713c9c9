package idempotency

import (
	"bytes"
	"encoding/binary"
	"encoding/hex"
	"fmt"
	"mime"
	"net/http"
	"os"
	"strings"
	"testing"
)

func TestIsJSONContentType(t *testing.T) {
	for ct, want := range map[string]bool{
		"application/json":                        true,
		"application/json; charset=utf-8":         true,
		"Application/JSON;charset=UTF-8":          true,
		" application/json ; charset=utf-8":       true,
		"application/problem+json":                true,
		"application/vnd.api+json; ext=bulk":      true,
		"application/merge-patch+JSON":            true,
		"text/plain":                              false,
		"application/json-seq":                    false,
		"application/jsonx":                       false,
		"application/x-www-form-urlencoded":       false,
		"application/+json":                       false,
		"+json":                                   false,
		"/json":                                   false,
		"json":                                    false,
		"":                                        false,
		"multipart/form-data; boundary=x+json":    false,
		"application/xml; profile=something+json": false,
	} {
		if got := isJSONContentType(ct); got != want {
			t.Errorf("isJSONContentType(%q) = %v, want %v", ct, got, want)
		}
	}
}

func TestFingerprint(t *testing.T) {
	const js = "application/json"
	h := func(method, host, path, query string, ct ...string) requestHead {
		return requestHead{Method: method, Host: host, Path: path, RawQuery: query, ContentType: ct}
	}
	base := fingerprint(h("POST", "api.example", "/charges", "a=1", js), []byte(`{"a":1,"b":2}`))
	for _, tc := range []struct {
		name string
		head requestHead
		body string
		same bool
	}{
		{name: "identical", head: h("POST", "api.example", "/charges", "a=1", js), body: `{"a":1,"b":2}`, same: true},
		{name: "reordered, spaced JSON", head: h("POST", "api.example", "/charges", "a=1", js), body: "{ \"b\": 2, \"a\": 1 }\n", same: true},
		{name: "media type in capitals", head: h("POST", "api.example", "/charges", "a=1", "Application/JSON"), body: `{"b":2,"a":1}`, same: true},
		{name: "number spelled differently", head: h("POST", "api.example", "/charges", "a=1", js), body: `{"a":1.0,"b":2}`},
		{name: "other value", head: h("POST", "api.example", "/charges", "a=1", js), body: `{"a":1,"b":3}`},
		{name: "same bytes as text", head: h("POST", "api.example", "/charges", "a=1", "text/plain"), body: `{"a":1,"b":2}`},
		{name: "reordered but not JSON", head: h("POST", "api.example", "/charges", "a=1", "text/plain"), body: `{"b":2,"a":1}`},
		{name: "another +json type", head: h("POST", "api.example", "/charges", "a=1", "application/vnd.x+json"), body: `{"a":1,"b":2}`},
		{name: "with a charset", head: h("POST", "api.example", "/charges", "a=1", "application/json; charset=utf-8"), body: `{"a":1,"b":2}`},
		{name: "no Content-Type", head: h("POST", "api.example", "/charges", "a=1"), body: `{"a":1,"b":2}`},
		{name: "two Content-Type fields", head: h("POST", "api.example", "/charges", "a=1", js, js), body: `{"a":1,"b":2}`},
		{name: "other method", head: h("PATCH", "api.example", "/charges", "a=1", js), body: `{"a":1,"b":2}`},
		{name: "other host", head: h("POST", "shop.example", "/charges", "a=1", js), body: `{"a":1,"b":2}`},
		{name: "other port", head: h("POST", "api.example:8443", "/charges", "a=1", js), body: `{"a":1,"b":2}`},
		{name: "other path", head: h("POST", "api.example", "/charges/", "a=1", js), body: `{"a":1,"b":2}`},
		{name: "other query", head: h("POST", "api.example", "/charges", "a=2", js), body: `{"a":1,"b":2}`},
		{name: "no query", head: h("POST", "api.example", "/charges", "", js), body: `{"a":1,"b":2}`},
		{name: "query moved into the path", head: h("POST", "api.example", "/chargesa=1", "", js), body: `{"a":1,"b":2}`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got := fingerprint(tc.head, []byte(tc.body))
			if (got == base) != tc.same {
				t.Fatalf("fingerprint equal to the base: %v, want %v", got == base, tc.same)
			}
		})
	}
}

// TestFingerprintFraming checks that distinct requests fingerprint
// differently, in particular when bytes move from one field to the next.
func TestFingerprintFraming(t *testing.T) {
	type req struct {
		method, host, path, query string
		ct                        []string
		body                      string
	}
	plain := []string{"text/plain"}
	seen := map[[32]byte]req{}
	for _, r := range []req{
		{"POST", "h", "/ab", "", nil, ""},
		{"POSTh", "", "/ab", "", nil, ""},
		{"POST", "h/ab", "", "", nil, ""},
		{"POST", "h", "/a", "b", nil, ""},
		{"POST", "h", "/", "ab", nil, ""},
		{"POST", "h", "/", "a", nil, "b"},
		{"POST", "h", "/", "", nil, "ab"},
		{"POST", "h", "/", "", []string{""}, "ab"},
		{"POST", "h", "/", "", []string{"a"}, "b"},
		{"POST", "h", "/", "", []string{"ab"}, ""},
		{"POST", "h", "/", "", []string{"a", "b"}, ""},
		{"POST", "h", "/", "", []string{"a", ""}, "b"},
		{"POST", "h", "/", "", []string{"a, b"}, ""},
		{"POST", "h", "/", "", []string{"text/plain; charset=a"}, "b"},
		{"POST", "h", "/", "", []string{"text/plain; charset=ab"}, ""},
		{"POST", "h", "/", "", []string{"text/plain; a=b"}, ""},
		{"POST", "h", "/", "", []string{"text/plain; a=b; c=d"}, ""},
		{"POST", "h", "/", "", []string{`text/plain; a="b; c=d"`}, ""},
		{"POST", "h", "/", "", plain, "; charset=ab"},
		{"POST", "h", "/", "", plain, ""},
		{"POST", "h", "/", "", []string{"application/json"}, `{"a":1}`},
		{"POST", "h", "/", "", plain, `{"a":1}`},
		{"POST", "h", "/", "", []string{"application/json-patch+json"}, `[{"op":"remove","path":"/a"}]`},
		{"POST", "h", "/", "", []string{"application/merge-patch+json"}, `[{"op":"remove","path":"/a"}]`},
		{"POST", "", "", "", nil, "h/ab"},
		{"", "POST", "h", "/", nil, "ab"},
	} {
		fp := fingerprint(requestHead{Method: r.method, Host: r.host, Path: r.path, RawQuery: r.query, ContentType: r.ct}, []byte(r.body))
		if prev, dup := seen[fp]; dup {
			t.Fatalf("%+v and %+v fingerprint alike", prev, r)
		}
		seen[fp] = r
	}
}

// TestFingerprintMediaTypeNormalised: a media type's spelling is not part
// of the request, its meaning is.
func TestFingerprintMediaTypeNormalised(t *testing.T) {
	body := []byte(`{"a":1}`)
	for _, pair := range [][2]string{
		{"application/json; charset=utf-8", "Application/JSON;Charset=UTF-8"},
		{"text/plain; a=1; b=2", `text/plain;b="2";  a=1`},
	} {
		if fingerprint(head("/", "", pair[0]), body) != fingerprint(head("/", "", pair[1]), body) {
			t.Errorf("%q and %q fingerprint differently", pair[0], pair[1])
		}
	}
}

func TestFingerprintEscapesKept(t *testing.T) {
	a := fingerprint(head("/", "", "application/json"), []byte(`{"name":"\u00e9"}`))
	b := fingerprint(head("/", "", "application/json"), []byte(`{"name":"é"}`))
	if a == b {
		t.Fatal(`"\u00e9" and "é" fingerprint alike: strings are meant to be kept exactly as sent`)
	}
}

// sfQuote serialises s as an RFC 8941 sf-string.
func sfQuote(s string) string {
	return `"` + strings.NewReplacer(`\`, `\\`, `"`, `\"`).Replace(s) + `"`
}

func BenchmarkFingerprintJSON2KiB(b *testing.B) {
	body2KiB, err := os.ReadFile("internal/canonjson/testdata/body2KiB.json")
	if err != nil {
		b.Fatal(err)
	}
	b.ReportAllocs()
	b.SetBytes(int64(len(body2KiB)))
	for b.Loop() {
		fingerprint(head("/v1/payment_intents", "expand=customer", "application/json; charset=utf-8"), body2KiB)
	}
}

// The shortcut for plain media types frames them exactly as
// mime.ParseMediaType's reading does, and takes nothing else.
func TestPlainMediaTypeFramesAsParsed(t *testing.T) {
	parsed := func(v string) []byte {
		mt, params, err := mime.ParseMediaType(v)
		if err != nil || len(params) != 0 {
			return nil
		}
		return binary.BigEndian.AppendUint64(appendField([]byte{mediaParsed}, mt), 0)
	}
	for _, v := range []string{"application/json", "application/merge-patch+json", "text/plain", "a/b", "x-y/z.1"} {
		if !plainMediaType(v) {
			t.Errorf("%q: not taken for plain", v)
		}
		if got, want := appendMediaType(nil, []string{v}), parsed(v); !bytes.Equal(got, want) {
			t.Errorf("%q: framed %q, ParseMediaType's reading %q", v, got, want)
		}
	}
	for _, v := range []string{"Application/JSON", "application/json; charset=utf-8", "application/", "/json", "application", "a/b/c", "a /b", "a/b ", ""} {
		if plainMediaType(v) {
			t.Errorf("%q: taken for plain", v)
		}
	}
}

// TestFingerprintTrailers: trailers take part, framed so that no two
// distinct sets of trailers, nor trailers and body, frame alike; and a
// request without any keeps the fingerprint it had before trailers took
// part, so that stored records still match their retries.
func TestFingerprintTrailers(t *testing.T) {
	js := requestHead{Method: "POST", Host: "api.example", Path: "/v1/charges", RawQuery: "a=1", ContentType: []string{"application/json"}}
	plain := requestHead{Method: "POST", Host: "api.example", Path: "/v1/charges"}
	for _, c := range []struct {
		head requestHead
		body string
		want string
	}{
		// As computed before trailers took part.
		{js, `{ "b": 2, "a": 1 }`, "355c9777ccde30a258086298825a508642a17b483c9dac638e534f612c187fb6"},
		{plain, "amount=1", "e874d410d8e03708f696b1fa6b03ec112cf2ade9b220912cd67ba7f3b713dbe3"},
	} {
		for _, trailer := range []http.Header{nil, {}, {"X-Amount": nil}} {
			c.head.Trailer = trailer
			if got := fingerprint(c.head, []byte(c.body)); hex.EncodeToString(got[:]) != c.want {
				t.Errorf("%+v without trailer values fingerprints %x, want %s as before", c.head, got, c.want)
			}
		}
	}

	with := func(trailer http.Header, body string) [32]byte {
		h := plain
		h.Trailer = trailer
		return fingerprint(h, []byte(body))
	}
	seen := map[[32]byte]string{}
	for _, tc := range []struct {
		trailer http.Header
		body    string
	}{
		{nil, "ab"},
		{http.Header{"A": {""}}, "ab"},
		{http.Header{"A": {"b"}}, "a"},
		{http.Header{"A": {"b"}}, ""},
		{http.Header{"A": {"", "b"}}, ""},
		{http.Header{"A": {"b", ""}}, ""},
		{http.Header{"A": {"b, c"}}, ""},
		{http.Header{"A": {"b", "c"}}, ""},
		{http.Header{"A": {"c", "b"}}, ""},
		{http.Header{"A": {"b"}, "C": {""}}, ""},
		{http.Header{"Ab": {""}}, ""},
		{http.Header{"A": {"1"}}, "t"},
		{http.Header{"A": {"999"}}, "t"},
	} {
		fp := with(tc.trailer, tc.body)
		desc := fmt.Sprintf("%v %q", tc.trailer, tc.body)
		if prev, dup := seen[fp]; dup {
			t.Fatalf("%s and %s fingerprint alike", prev, desc)
		}
		seen[fp] = desc
	}
	if with(http.Header{"x-amount": {"1"}, "B": {"2"}}, "") != with(http.Header{"B": {"2"}, "X-Amount": {"1"}}, "") {
		t.Error("trailer names are case-insensitive and unordered, but fingerprint apart")
	}
}

// TestFingerprintContentCodingAndOverride: the request's Content-Encoding
// and the method override headers change what the upstream does with
// the request, so a retry that differs in them is another request; one
// without them fingerprints as before they took part.
func TestFingerprintContentCodingAndOverride(t *testing.T) {
	fp := func(header http.Header) [32]byte {
		r, err := http.NewRequest("POST", "http://api.example/v1/charges", nil)
		if err != nil {
			t.Fatal(err)
		}
		r.Header = header
		return fingerprint(headOf(r), []byte("\x1f\x8b opaque bytes"))
	}
	none := fp(http.Header{"Content-Type": {"application/octet-stream"}})
	plain := requestHead{Method: "POST", Host: "api.example", Path: "/v1/charges", ContentType: []string{"application/octet-stream"}}
	if none != fingerprint(plain, []byte("\x1f\x8b opaque bytes")) {
		t.Fatal("a request without Content-Encoding or an override fingerprints otherwise than before they took part")
	}
	seen := map[[32]byte]string{none: "none"}
	for _, c := range []struct {
		name   string
		header http.Header
	}{
		{"gzip", http.Header{"Content-Encoding": {"gzip"}}},
		{"br", http.Header{"Content-Encoding": {"br"}}},
		{"gzip, br in one field", http.Header{"Content-Encoding": {"gzip, br"}}},
		{"gzip and br in two", http.Header{"Content-Encoding": {"gzip", "br"}}},
		{"X-HTTP-Method-Override", http.Header{"X-Http-Method-Override": {"DELETE"}}},
		{"X-HTTP-Method", http.Header{"X-Http-Method": {"DELETE"}}},
		{"X-Method-Override", http.Header{"X-Method-Override": {"DELETE"}}},
		{"X-HTTP-Method-Override PUT", http.Header{"X-Http-Method-Override": {"PUT"}}},
		{"two overrides", http.Header{"X-Http-Method-Override": {"DELETE"}, "X-Method-Override": {"DELETE"}}},
		{"an empty override", http.Header{"X-Http-Method-Override": {""}}},
		{"gzip and an override", http.Header{"Content-Encoding": {"gzip"}, "X-Http-Method-Override": {"DELETE"}}},
	} {
		c.header.Set("Content-Type", "application/octet-stream")
		got := fp(c.header)
		if prev, dup := seen[got]; dup {
			t.Errorf("%s fingerprints like %s", c.name, prev)
		}
		seen[got] = c.name
	}
}
