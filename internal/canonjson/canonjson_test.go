package canonjson

import (
	"bytes"
	"encoding/json"
	"fmt"
	"os"
	"reflect"
	"slices"
	"strings"
	"testing"
	"time"
	"unicode/utf8"
)

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
		{name: "deep but within the limit", in: strings.Repeat("[", MaxDepth) + strings.Repeat("]", MaxDepth), want: strings.Repeat("[", MaxDepth) + strings.Repeat("]", MaxDepth)},

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
		{name: "one level too deep", in: strings.Repeat("[", MaxDepth+1) + strings.Repeat("]", MaxDepth+1)},
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

// FuzzCanonicalJSON checks canonicalJSON against encoding/json: it only
// accepts JSON texts, refuses a valid one only for its depth, and its
// output is a fixed point that decodes to the same value, whatever the
// order of the input's object members.
func FuzzCanonicalJSON(f *testing.F) {
	for _, seed := range []string{
		`{"a":1,"b":2}`, `{ "b": 2, "a": 1 }`, `[1.0, -0, 1e-7, "\u00e9", "é", null, true, false]`,
		`{"a":{"d":[{"y":1,"x":2}],"c":{}},"a":[]}`, `{"\ud83d\ude00":1,"\ud800":2,"\u0061":3,"a":4}`,
		`{"a":1}x`, `[1,]`, "\"\xff\"", strings.Repeat("[", MaxDepth+1),
		`{"amount":1,"b":0,"AMOUNT":2}`, `{"\u212a":1,"k":2,"s":3,"\u017f":4}`, `{"user_id":1,"userid":2}`,
	} {
		f.Add([]byte(seed))
	}
	f.Fuzz(func(t *testing.T, in []byte) {
		out, ok := canonicalJSON(nil, in)
		if !ok {
			if out != nil {
				t.Fatalf("not ok but wrote %q", out)
			}
			if json.Valid(in) && utf8.Valid(in) && bytes.Count(in, []byte("["))+bytes.Count(in, []byte("{")) <= MaxDepth {
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

// readBody2KiB reads a request body of the usual shape: a few levels of
// objects and arrays, numbers and strings, some escaped. The fingerprint's
// benchmark reads it too.
func readBody2KiB(b *testing.B) []byte {
	b.Helper()
	body, err := os.ReadFile("testdata/body2KiB.json")
	if err != nil {
		b.Fatal(err)
	}
	return body
}

func BenchmarkCanonicalJSON(b *testing.B) {
	body2KiB := readBody2KiB(b)
	b.ReportAllocs()
	b.SetBytes(int64(len(body2KiB)))
	dst := make([]byte, 0, len(body2KiB))
	var s State
	for b.Loop() {
		var ok bool
		if dst, ok = s.Append(dst[:0], body2KiB, nil); !ok {
			b.Fatal("not canonicalised")
		}
	}
}

// canonicalJSON is the canonical form of body, written without a sink.
func canonicalJSON(dst, body []byte) ([]byte, bool) {
	return new(State).Append(dst, body, nil)
}
