package idempotency

import (
	"bytes"
	"encoding/binary"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"mime"
	"net/http"
	"reflect"
	"slices"
	"strings"
	"testing"
	"time"
	"unicode/utf8"
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

func TestCanonicalJSON(t *testing.T) {
	for _, tc := range []struct {
		name, in, want string // want "" means not canonicalisable
	}{
		{name: "sorted", in: `{"a":1,"b":2}`, want: `{"a":1,"b":2}`},
		{name: "reordered with whitespace", in: " { \"b\" : 2 ,\n\t\"a\" : 1 }\r\n", want: `{"a":1,"b":2}`},
		{name: "nested objects sorted, arrays kept", in: `{"z":[3,1,{"y":1,"x":2}],"a":{"d":null,"c":true}}`, want: `{"a":{"c":true,"d":null},"z":[3,1,{"x":2,"y":1}]}`},
		{name: "numbers kept", in: `[1.0, 1, -0, 1e3, 1E+3, 0.10, -12.5e-7]`, want: `[1.0,1,-0,1e3,1E+3,0.10,-12.5e-7]`},
		{name: "big numbers kept", in: `[123456789012345678901234567890, 1e999]`, want: `[123456789012345678901234567890,1e999]`},
		{name: "strings kept", in: `["\u00e9", "é", "\/", "/", "a\tb\n"]`, want: `["\u00e9","é","\/","/","a\tb\n"]`},
		{name: "scalars", in: ` "x" `, want: `"x"`},
		{name: "literal", in: "true", want: "true"},
		{name: "number", in: "\n-1.5\n", want: "-1.5"},
		{name: "empty containers", in: `{ "a" : [ ] , "b" : { } }`, want: `{"a":[],"b":{}}`},
		{name: "empty object", in: `{}`, want: `{}`},
		{name: "duplicates keep their order", in: `{"b":0,"a":1,"a":2}`, want: `{"a":1,"a":2,"b":0}`},
		{name: "duplicates other order", in: `{"a":2,"b":0,"a":1}`, want: `{"a":2,"a":1,"b":0}`},
		{name: "escaped names sort by their decoded value", in: `{"b":1,"\u0061":2,"\u0063":3}`, want: `{"\u0061":2,"b":1,"\u0063":3}`},
		{name: "decoded-equal names are duplicates", in: `{"\u0061":1,"a":2}`, want: `{"\u0061":1,"a":2}`},
		{name: "decoded-equal names other order", in: `{"a":2,"\u0061":1}`, want: `{"a":2,"\u0061":1}`},
		{name: "names by folded code point", in: `{"é":1,"z":2,"Y":3,"":4,"aa":5,"a":6}`, want: `{"":4,"a":6,"aa":5,"Y":3,"z":2,"é":1}`},
		{name: "names equal but for case keep their order", in: `{"amount":100,"AMOUNT":1000000}`, want: `{"amount":100,"AMOUNT":1000000}`},
		{name: "names equal but for case, other order", in: `{"AMOUNT":1000000,"amount":100}`, want: `{"AMOUNT":1000000,"amount":100}`},
		{name: "case-equal names among others", in: `{"b":1,"Amount":2,"a":3,"amount":4,"AMOUNT":5}`, want: `{"a":3,"Amount":2,"amount":4,"AMOUNT":5,"b":1}`},
		{name: "Kelvin sign folds to k", in: `{"\u212a":1,"b":0,"k":2}`, want: `{"b":0,"\u212a":1,"k":2}`},
		{name: "Kelvin sign unescaped", in: `{"k":2,"b":0,"K":1}`, want: `{"b":0,"k":2,"K":1}`},
		{name: "long s folds to s", in: `{"ſ":1,"S":2,"r":0}`, want: `{"r":0,"ſ":1,"S":2}`},
		{name: "non-ASCII case", in: `{"É":1,"é":2,"e":0}`, want: `{"e":0,"É":1,"é":2}`},
		{name: "underscores and dashes are ignored by some binders", in: `{"user_id":1,"a":0,"userid":2,"USER-ID":3}`, want: `{"a":0,"user_id":1,"userid":2,"USER-ID":3}`},
		{name: "escaped case-equal names", in: `{"\u0041":1,"a":2}`, want: `{"\u0041":1,"a":2}`},
		{name: "surrogate pair name", in: `{"\ud83d\ude00":1,"\uffff":2}`, want: `{"\uffff":2,"\ud83d\ude00":1}`},
		{name: "lone surrogates decode to U+FFFD as in encoding/json", in: `{"\ud800":1,"\uFFFD":2,"\udc00":3}`, want: `{"\ud800":1,"\uFFFD":2,"\udc00":3}`},
		{name: "deep but within the limit", in: strings.Repeat("[", canonMaxDepth) + strings.Repeat("]", canonMaxDepth), want: strings.Repeat("[", canonMaxDepth) + strings.Repeat("]", canonMaxDepth)},

		{name: "empty body", in: ""},
		{name: "only whitespace", in: " \n"},
		{name: "trailing garbage", in: `{"a":1}x`},
		{name: "two values", in: `{} {}`},
		{name: "trailing comma", in: `[1,]`},
		{name: "trailing comma in object", in: `{"a":1,}`},
		{name: "leading comma", in: `[,1]`},
		{name: "comma in empty object", in: `{,}`},
		{name: "missing colon", in: `{"a" 1}`},
		{name: "missing value", in: `{"a":}`},
		{name: "name not a string", in: `{a:1}`},
		{name: "mismatched brackets", in: `[1}`},
		{name: "unclosed", in: `{"a":[1,2`},
		{name: "extra closer", in: `[1]]`},
		{name: "leading zero", in: `01`},
		{name: "bare minus", in: `-`},
		{name: "dot without digits", in: `1.`},
		{name: "exponent without digits", in: `1e+`},
		{name: "plus sign", in: `+1`},
		{name: "hex", in: `0x10`},
		{name: "NaN", in: `NaN`},
		{name: "truncated literal", in: `tru`},
		{name: "literal with suffix", in: `nullx`},
		{name: "single quotes", in: `'a'`},
		{name: "control character in string", in: "\"a\nb\""},
		{name: "bad escape", in: `"\x41"`},
		{name: "short unicode escape", in: `"\u12"`},
		{name: "non-hex unicode escape", in: `"\u12G4"`},
		{name: "unterminated string", in: `"abc`},
		{name: "invalid UTF-8", in: "\"\xff\""},
		{name: "encoded surrogate", in: "\"\xed\xa0\x80\""},
		{name: "byte order mark", in: "\ufeff{}"},
		{name: "one level too deep", in: strings.Repeat("[", canonMaxDepth+1) + strings.Repeat("]", canonMaxDepth+1)},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, ok := canonicalJSON([]byte("prefix"), []byte(tc.in))
			if tc.want == "" {
				if ok || string(got) != "prefix" {
					t.Fatalf("canonicalJSON(%q) = %q, %v; want dst unchanged, false", tc.in, got, ok)
				}
				return
			}
			if !ok || string(got) != "prefix"+tc.want {
				t.Fatalf("canonicalJSON(%q) = %q, %v; want %q, true", tc.in, got, ok, "prefix"+tc.want)
			}
		})
	}
}

// TestCanonicalJSONHostileNesting checks that nesting far past the limit
// is refused without exhausting the stack or taking long.
func TestCanonicalJSONHostileNesting(t *testing.T) {
	const depth = 100_000
	for name, body := range map[string]string{
		"arrays":   strings.Repeat("[", depth) + strings.Repeat("]", depth),
		"objects":  strings.Repeat(`{"a":`, depth) + "1" + strings.Repeat("}", depth),
		"unclosed": strings.Repeat("[", depth),
	} {
		t.Run(name, func(t *testing.T) {
			start := time.Now()
			if _, ok := canonicalJSON(nil, []byte(body)); ok {
				t.Fatal("canonicalised a body nested 100,000 levels deep")
			}
			// The fingerprint falls back to the raw body.
			h := head("/", "", "application/json")
			if fingerprint(h, []byte(body)) != referenceFingerprint(h, []byte(body)) {
				t.Fatal("a body that cannot be canonicalised is not hashed raw")
			}
			// Bounded work takes milliseconds; a loaded machine with the
			// race detector may take a hundred times that, quadratic
			// work on 200kB minutes.
			if d := time.Since(start); d > 5*time.Second {
				t.Fatalf("took %v", d)
			}
		})
	}
}

func TestCanonicalJSONManyMembers(t *testing.T) {
	var b strings.Builder
	b.WriteString("{")
	const n = 50_000
	for i := n - 1; i >= 0; i-- {
		fmt.Fprintf(&b, `"k%06d":[%d,{"z":0,"a":0}],`, i, i)
	}
	b.WriteString(`"k":0}`)
	got, ok := canonicalJSON(nil, []byte(b.String()))
	if !ok {
		t.Fatal("not canonicalised")
	}
	if !bytes.HasPrefix(got, []byte(`{"k":0,"k000000":[0,{"a":0,"z":0}],"k000001":`)) ||
		!bytes.HasSuffix(got, []byte(`"k049999":[49999,{"a":0,"z":0}]}`)) {
		t.Fatalf("unexpected output %.80s...%s", got, got[len(got)-40:])
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

// FuzzCanonicalJSON checks canonicalJSON against encoding/json: it only
// accepts JSON texts, refuses a valid one only for its depth, and its
// output is a fixed point that decodes to the same value, whatever the
// order of the input's object members.
func FuzzCanonicalJSON(f *testing.F) {
	for _, seed := range []string{
		`{"a":1,"b":2}`, `{ "b": 2, "a": 1 }`, `[1.0, -0, 1e-7, "\u00e9", "é", null, true, false]`,
		`{"a":{"d":[{"y":1,"x":2}],"c":{}},"a":[]}`, `{"\ud83d\ude00":1,"\ud800":2,"\u0061":3,"a":4}`,
		`{"a":1}x`, `[1,]`, "\"\xff\"", strings.Repeat("[", canonMaxDepth+1),
		`{"amount":1,"b":0,"AMOUNT":2}`, `{"\u212a":1,"k":2,"s":3,"\u017f":4}`, `{"user_id":1,"userid":2}`,
	} {
		f.Add([]byte(seed))
	}
	f.Fuzz(func(t *testing.T, in []byte) {
		out, ok := canonicalJSON(nil, in)
		if got, want := fingerprint(head("/", "", "application/json"), in), referenceFingerprint(head("/", "", "application/json"), in); got != want {
			t.Fatalf("the streamed fingerprint of %q differs from the whole-input one", in)
		}
		if !ok {
			if out != nil {
				t.Fatalf("not ok but wrote %q", out)
			}
			if json.Valid(in) && utf8.Valid(in) && bytes.Count(in, []byte("["))+bytes.Count(in, []byte("{")) <= canonMaxDepth {
				t.Fatalf("refused a valid JSON text %q", in)
			}
			return
		}
		if !json.Valid(in) {
			t.Fatalf("accepted %q, which encoding/json rejects", in)
		}
		if !json.Valid(out) {
			t.Fatalf("canonical form %q of %q is not valid JSON", out, in)
		}
		again, ok := canonicalJSON(nil, out)
		if !ok || !bytes.Equal(again, out) {
			t.Fatalf("canonical form %q of %q is not a fixed point: %q, %v", out, in, again, ok)
		}
		if a, b := decodeJSON(t, in), decodeJSON(t, out); !reflect.DeepEqual(a, b) {
			t.Fatalf("%q decodes to %#v, its canonical form %q to %#v", in, a, out, b)
		}
		// A binder matching names case-insensitively reads the same.
		var a, b struct {
			Amount any `json:"amount"`
			K      any `json:"k"`
			S      any `json:"s"`
		}
		if json.Unmarshal(in, &a) == nil && (json.Unmarshal(out, &b) != nil || !reflect.DeepEqual(a, b)) {
			t.Fatalf("%q binds to %+v, its canonical form %q to %+v", in, a, out, b)
		}
		p := reverser{b: out, distinct: true}
		reversed := p.value()
		if !p.distinct {
			return // reordering such names is meant to change the output
		}
		if got, ok := canonicalJSON(nil, reversed); !ok || !bytes.Equal(got, out) {
			t.Fatalf("%q with its members reversed, %q, canonicalises to %q, %v; want %q", in, reversed, got, ok, out)
		}
	})
}

func decodeJSON(t *testing.T, b []byte) any {
	t.Helper()
	d := json.NewDecoder(bytes.NewReader(b))
	d.UseNumber()
	var v any
	if err := d.Decode(&v); err != nil {
		t.Fatalf("decode %q: %v", b, err)
	}
	return v
}

// reverser rewrites a compact JSON text with the members of every object
// in reverse order; it is a separate, recursive parser so as not to test
// canonicalJSON with itself.
type reverser struct {
	b        []byte
	i        int
	distinct bool // no object has two names that a binder could match alike
}

// bindsAlike reports whether a binder that matches names ignoring case
// (and, as encoding/json/v2 can, '_' and '-') could take names a and b
// for the same one.
func bindsAlike(a, b string) bool {
	strip := strings.NewReplacer("_", "", "-", "")
	return strings.EqualFold(strip.Replace(a), strip.Replace(b))
}

func (p *reverser) value() []byte {
	switch p.b[p.i] {
	case '{', '[':
		object := p.b[p.i] == '{'
		p.i++
		var items [][]byte
		var names []string
		for p.b[p.i] != '}' && p.b[p.i] != ']' {
			if p.b[p.i] == ',' {
				p.i++
			}
			var item []byte
			if object {
				raw := p.value()
				var name string
				if err := json.Unmarshal(raw, &name); err != nil {
					panic(err)
				}
				if slices.ContainsFunc(names, func(n string) bool { return bindsAlike(n, name) }) {
					p.distinct = false
				}
				names = append(names, name)
				p.i++ // the colon
				item = append(append(raw, ':'), p.value()...)
			} else {
				item = p.value()
			}
			items = append(items, item)
		}
		p.i++
		open, close := "[", "]"
		if object {
			open, close = "{", "}"
			for l, r := 0, len(items)-1; l < r; l, r = l+1, r-1 {
				items[l], items[r] = items[r], items[l]
			}
		}
		return []byte(open + string(bytes.Join(items, []byte(","))) + close)
	case '"':
		start := p.i
		for p.i++; p.b[p.i] != '"'; p.i++ {
			if p.b[p.i] == '\\' {
				p.i++
			}
		}
		p.i++
		return append([]byte(nil), p.b[start:p.i]...)
	default:
		start := p.i
		for p.i < len(p.b) && !strings.ContainsRune(",:]}", rune(p.b[p.i])) {
			p.i++
		}
		return append([]byte(nil), p.b[start:p.i]...)
	}
}

// body2KiB is a request body of the usual shape: a few levels of objects
// and arrays, numbers and strings, some escaped.
var body2KiB = func() []byte {
	var b bytes.Buffer
	b.WriteString(`{"type":"payment_intent","currency":"eur","amount":129900,"confirm":true,` +
		`"description":"Order #1001 \u2014 \"express\"","metadata":{"order_id":"1001","source":"web","campaign":null},` +
		`"customer":{"name":"Zoë Müller","email":"zoe@example.com","address":{"line1":"Hauptstraße 5","city":"Berlin","postal_code":"10115","country":"DE"}},` +
		`"items":[`)
	for i := 0; b.Len() < 2000; i++ {
		if i > 0 {
			b.WriteString(",")
		}
		fmt.Fprintf(&b, `{"sku":"SKU-%04d","quantity":%d,"unit_price":%d.99,"tags":["gift","fragile"],"options":{"wrap":false,"note":""}}`, i, i%3+1, 10+i)
	}
	b.WriteString(`]}`)
	return b.Bytes()
}()

func BenchmarkFingerprintJSON2KiB(b *testing.B) {
	b.ReportAllocs()
	b.SetBytes(int64(len(body2KiB)))
	for b.Loop() {
		fingerprint(head("/v1/payment_intents", "expand=customer", "application/json; charset=utf-8"), body2KiB)
	}
}

func BenchmarkCanonicalJSON(b *testing.B) {
	b.ReportAllocs()
	b.SetBytes(int64(len(body2KiB)))
	dst := make([]byte, 0, len(body2KiB))
	for b.Loop() {
		var ok bool
		if dst, ok = canonicalJSON(dst[:0], body2KiB); !ok {
			b.Fatal("not canonicalised")
		}
	}
}

// canonicalJSON is the canonical form of body from a pooled state, as
// fingerprint computes it.
func canonicalJSON(dst, body []byte) ([]byte, bool) {
	s := canonStatePool.Get().(*canonState)
	defer s.release()
	return s.canonicalJSON(dst, body)
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
