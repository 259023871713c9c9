package idempotency

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
)

// A store option given outside the store's block is refused with where it
// belongs.
func TestStoreOptionOutsideItsBlock(t *testing.T) {
	for opt, store := range map[string]string{"dsn": "postgres", "table": "postgres", "max_conns": "postgres", "migrate": "postgres", "max_entries": "memory"} {
		_, _, err := adaptCaddyfile(fmt.Sprintf("http://127.0.0.1:8080 {\n\tidempotency {\n\t\t%s x\n\t}\n\treverse_proxy 127.0.0.1:9\n}\n", opt))
		if err == nil || !strings.Contains(err.Error(), opt+" belongs inside store "+store+" { }") || !strings.Contains(err.Error(), ":3") {
			t.Errorf("%s outside its block: %v, want where it belongs, on line 3", opt, err)
		}
	}
}

// Each testdata/adapt/*.caddyfiletest is a Caddyfile, a line of dashes, and
// the JSON it must adapt to (as Caddy's own adapt tests).
func TestCaddyfileAdapt(t *testing.T) {
	files, err := filepath.Glob("testdata/adapt/*.caddyfiletest")
	if err != nil || len(files) == 0 {
		t.Fatalf("no golden files: %v", err)
	}
	for _, f := range files {
		t.Run(strings.TrimSuffix(f[len("testdata/adapt/"):], ".caddyfiletest"), func(t *testing.T) {
			data, err := os.ReadFile(f)
			if err != nil {
				t.Fatal(err)
			}
			caddyfile, wantJSON, ok := strings.Cut(string(data), "\n----------\n")
			if !ok {
				t.Fatalf("%s: no ---------- separator", f)
			}
			got, warnings, err := adaptCaddyfile(caddyfile + "\n")
			if err != nil {
				t.Fatalf("adapting: %v", err)
			}
			for _, w := range warnings {
				t.Errorf("warning: %s", w.String())
			}
			if g, w := normJSON(t, got), normJSON(t, []byte(wantJSON)); g != w {
				t.Errorf("adapted JSON differs.\n got: %s\nwant: %s", g, w)
			}
		})
	}
}

func normJSON(t *testing.T, b []byte) string {
	t.Helper()
	var v any
	if err := json.Unmarshal(b, &v); err != nil {
		t.Fatalf("bad JSON: %v\n%s", err, b)
	}
	out, _ := json.MarshalIndent(v, "", "  ")
	return string(out)
}

func TestCaddyfileErrors(t *testing.T) {
	for _, tc := range []struct {
		name  string
		block string // the body of idempotency { }; its first line is Caddyfile line 3
		lines []int  // the lines the error may name
	}{
		{"unknown subdirective", "store memory\n\t\tfrobnicate on", []int{4}},
		{"bad duration", "store memory\n\t\tlock_timeout soon", []int{4}},
		{"negative duration", "store memory\n\t\tretention -1h", []int{4}},
		{"bad size", "store memory\n\t\tmax_request_body lots", []int{4}},
		{"bad table name", "store postgres {\n\t\t\tdsn postgres://x@127.0.0.1/db\n\t\t\ttable \"x; DROP TABLE y\"\n\t\t}", []int{5}},
		{"two stores", "store memory\n\t\tstore postgres {\n\t\t\tdsn postgres://x@127.0.0.1/db\n\t\t}", []int{4}},
		{"missing dsn", "store postgres {\n\t\t\ttable t\n\t\t}", []int{3, 4, 5}},
		{"unknown store", "store redis", []int{3}},
		{"bad migrate value", "store postgres {\n\t\t\tdsn postgres://x@127.0.0.1/db\n\t\t\tmigrate maybe\n\t\t}", []int{5}},
		{"bad max_conns", "store postgres {\n\t\t\tdsn postgres://x@127.0.0.1/db\n\t\t\tmax_conns many\n\t\t}", []int{5}},
		{"key_header without argument", "store memory\n\t\tkey_header", []int{4}},
		{"credential_header without argument", "credential_header", []int{3}},
		{"methods without argument", "methods", []int{3}},
		{"optional with an argument", "optional yes", []int{3}},
		{"retention with two arguments", "retention 1h 2h", []int{3}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg := fmt.Sprintf("http://127.0.0.1:8080 {\n\tidempotency {\n\t\t%s\n\t}\n\treverse_proxy 127.0.0.1:9\n}\n", tc.block)
			_, _, err := adaptCaddyfile(cfg)
			if err == nil {
				t.Fatalf("adapting succeeded, want an error for:\n%s", cfg)
			}
			named := false
			for _, l := range tc.lines {
				if strings.Contains(err.Error(), fmt.Sprintf("Caddyfile:%d", l)) {
					named = true
				}
			}
			if !named {
				t.Errorf("error does not name line %v: %v", tc.lines, err)
			}
		})
	}
}

// Each rule of a config is defined once: the Caddyfile parser and
// Validate (JSON) refuse a value in the same words, the parser adding
// the file and line. Catches a rule copied into the parser that drifts
// from Validate's, and a rule that only JSON keeps.
func TestRulesSayTheSameInCaddyfileAndJSON(t *testing.T) {
	for _, tc := range []struct {
		line  string
		field string
		value any
	}{
		{"mismatch_status 418", "mismatch_status", 418},
		{"on_store_error maybe", "on_store_error", "maybe"},
		{"max_request_body 3GiB", "max_request_body", int64(3 << 30)},
		{"max_response_body 3GiB", "max_response_body", int64(3 << 30)},
		{"methods GET", "methods", []string{"GET"}},
		{"methods PO(ST", "methods", []string{"PO(ST"}},
		{"exclude_headers X:Y", "exclude_headers", []string{"X:Y"}},
		{"key_header X:Y", "key_header", "X:Y"},
		{"credential_header X:Y", "credential_header", "X:Y"},
		{"lock_timeout 10ms", "lock_timeout", "10ms"},
		{"wait 1ms", "wait", "1ms"},
		{"key_json id", "key_json", "id"},
		{"store_status 99", "store_status", []string{"99"}},
	} {
		t.Run(tc.line, func(t *testing.T) {
			_, _, cfErr := adaptCaddyfile(fmt.Sprintf("http://127.0.0.1:8080 {\n\tidempotency {\n\t\t%s\n\t}\n\trespond 201\n}\n", tc.line))
			if cfErr == nil || !strings.Contains(cfErr.Error(), "Caddyfile:3") {
				t.Fatalf("Caddyfile: %v; want an error naming line 3", cfErr)
			}
			handler := map[string]any{"handler": "idempotency", tc.field: tc.value}
			if tc.field == "wait" || tc.field == "lock_timeout" {
				d, _ := time.ParseDuration(tc.value.(string))
				handler[tc.field] = d
			}
			cfg, _ := json.Marshal(map[string]any{"apps": map[string]any{"http": map[string]any{"servers": map[string]any{"srv_rules": map[string]any{
				"listen": []string{"127.0.0.1:0"},
				"routes": []any{map[string]any{"handle": []any{handler, map[string]any{"handler": "static_response", "status_code": 201}}}},
			}}}}})
			var c caddy.Config
			if err := json.Unmarshal(cfg, &c); err != nil {
				t.Fatal(err)
			}
			jsErr := caddy.Validate(&c)
			if jsErr == nil {
				t.Fatalf("JSON %s: valid; want the Caddyfile's refusal: %v", cfg, cfErr)
			}
			// Validate's own words, after the module path that Caddy
			// puts before them.
			words := jsErr.Error()
			const module = "http.handlers.idempotency: "
			if i := strings.LastIndex(words, module); i >= 0 {
				words = words[i+len(module):]
			}
			words = strings.TrimPrefix(words, "invalid configuration: ")
			words = strings.TrimPrefix(words, "idempotency: ")
			if !strings.Contains(cfErr.Error(), words) {
				t.Errorf("the Caddyfile says %q,\nJSON says %q", cfErr, jsErr)
			}
		})
	}
}
