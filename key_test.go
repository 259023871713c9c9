package idempotency

import (
	"strings"
	"testing"
)

func TestParseKey(t *testing.T) {
	long := strings.Repeat("k", maxKeyLen)
	var printable []byte // every printable byte, the space inside
	for c := byte('!'); c <= '~'; c++ {
		printable = append(printable, c)
		if c == 'O' {
			printable = append(printable, ' ')
		}
	}
	for _, tc := range []struct {
		name, raw, want string
		errHas          string // a fragment of the error, when one is expected
	}{
		{name: "uuid", raw: "8e03978e-40d5-43e8-bc93-6894a57f9324", want: "8e03978e-40d5-43e8-bc93-6894a57f9324"},
		{name: "shortest", raw: "abcdefgh", want: "abcdefgh"},
		{name: "longest", raw: long, want: long},
		{name: "every printable byte", raw: string(printable), want: string(printable)},
		{name: "inner spaces and quotes kept", raw: `a b"c\d e`, want: `a b"c\d e`},
		{name: "ends with a quote", raw: `abcdefgh"`, want: `abcdefgh"`},
		{name: "empty", raw: "", errHas: "got 0 bytes"},
		{name: "too short", raw: "abcdefg", errHas: "got 7 bytes"},
		{name: "too long", raw: long + "k", errHas: "got 256 bytes"},
		{name: "non-ASCII", raw: "clé-abcdefgh", errHas: "byte 3 is 0xC3"},
		{name: "tab", raw: "abcd\tefgh", errHas: "byte 5 is 0x09"},
		{name: "DEL", raw: "abcdefgh\x7f", errHas: "byte 9 is 0x7F"},
		{name: "leading space", raw: " abcdefgh", errHas: "begin or end with a space"},
		{name: "trailing space", raw: "abcdefgh ", errHas: "begin or end with a space"},

		{name: "quoted means the bare key", raw: `"abcdefgh"`, want: "abcdefgh"},
		{name: "quoted uuid", raw: `"8e03978e-40d5-43e8-bc93-6894a57f9324"`, want: "8e03978e-40d5-43e8-bc93-6894a57f9324"},
		{name: "quoted escapes", raw: `"abc\"def\\gh"`, want: `abc"def\gh`},
		{name: "quoted escape first", raw: `"\\abcdefgh"`, want: `\abcdefgh`},
		{name: "quoted spaces kept", raw: `" abcdefg "`, want: " abcdefg "},
		{name: "quoted longest", raw: `"` + long + `"`, want: long},
		{name: "quoted escaped longest", raw: `"` + strings.Repeat(`\\`, maxKeyLen) + `"`, want: strings.Repeat(`\`, maxKeyLen)},
		{name: "quoted too short", raw: `"abcdefg"`, errHas: "got 7 between the quotes"},
		{name: "quoted too short once unescaped", raw: `"ab\"\"\"cd"`, errHas: "got 7 between the quotes"},
		{name: "quoted too long", raw: `"` + long + `k"`, errHas: "got 256 between the quotes"},
		{name: "quoted far too long", raw: `"` + strings.Repeat("k", 600) + `"`, errHas: "got a 602-byte value"},
		{name: "quoted empty", raw: `""`, errHas: "got 0 between the quotes"},
		{name: "lone quote", raw: `"`, errHas: "no closing quote"},
		{name: "unterminated", raw: `"abcdefgh`, errHas: "no closing quote"},
		{name: "escaped closing quote", raw: `"abcdefgh\"`, errHas: "no closing quote"},
		{name: "bad escape", raw: `"abcd\nefgh"`, errHas: "invalid escape"},
		{name: "backslash at end", raw: `"abcdefgh\`, errHas: "invalid escape"},
		{name: "parameters", raw: `"abcdefgh";a=1`, errHas: "after its closing quote"},
		{name: "space after", raw: `"abcdefgh" `, errHas: "after its closing quote"},
		{name: "quoted non-ASCII", raw: `"abcdéfgh"`, errHas: "byte 6 is 0xC3"},
		{name: "quoted tab", raw: "\"abcd\tefgh\"", errHas: "byte 6 is 0x09"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, err := parseKey(tc.raw)
			if tc.errHas != "" {
				if err == nil {
					t.Fatalf("parseKey(%q) = %q, want an error", tc.raw, got)
				}
				if !strings.Contains(err.Error(), tc.errHas) {
					t.Fatalf("parseKey(%q) error %q does not say %q", tc.raw, err, tc.errHas)
				}
				return
			}
			if err != nil {
				t.Fatalf("parseKey(%q): %v", tc.raw, err)
			}
			if got != tc.want {
				t.Fatalf("parseKey(%q) = %q, want %q", tc.raw, got, tc.want)
			}
		})
	}
}

func TestParseKeyErrorsTellTheRule(t *testing.T) {
	_, err := parseKey("short")
	if err == nil || !strings.Contains(err.Error(), "8 to 255 printable ASCII characters") {
		t.Fatalf("error %v does not state the rule", err)
	}
}

// FuzzParseKey checks parseKey against the rules stated independently:
// a bare key is accepted as is exactly when it follows them, and a key
// sent quoted is the same key as sent bare.
func FuzzParseKey(f *testing.F) {
	for _, seed := range []string{
		"8e03978e-40d5-43e8-bc93-6894a57f9324", "abcdefgh", `"abcdefgh"`, `"a\"b\\cdefgh"`,
		`"abc`, `"abcdefgh";x=1`, " abcdefgh", "abc\x00defgh", "",
	} {
		f.Add(seed)
	}
	f.Fuzz(func(t *testing.T, raw string) {
		key, err := parseKey(raw)
		if err != nil {
			if err.Error() == "" {
				t.Fatal("empty error message")
			}
		} else {
			if len(key) < minKeyLen || len(key) > maxKeyLen {
				t.Fatalf("parseKey(%q) = %q: length %d", raw, key, len(key))
			}
			for i := 0; i < len(key); i++ {
				if key[i] < 0x20 || key[i] > 0x7e {
					t.Fatalf("parseKey(%q) = %q: byte 0x%02x", raw, key, key[i])
				}
			}
			if q, err := parseKey(sfQuote(key)); err != nil || q != key {
				t.Fatalf("quoted %q parses to %q, %v", key, q, err)
			}
		}
		if strings.HasPrefix(raw, `"`) {
			return
		}
		valid := len(raw) >= minKeyLen && len(raw) <= maxKeyLen &&
			strings.Trim(raw, " ") == raw && !strings.ContainsFunc(raw, func(r rune) bool { return r < 0x20 || r > 0x7e })
		if valid != (err == nil) || valid && key != raw {
			t.Fatalf("parseKey(%q) = %q, %v; the key is valid: %v", raw, key, err, valid)
		}
	})
}
