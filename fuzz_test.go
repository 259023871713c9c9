package idempotency

// Fuzz targets for the parsers and the recorder (key parsing is fuzzed
// in key_test.go, the fingerprint in fingerprint_stream_test.go, JSON
// canonicalisation in internal/canonjson). `go test` runs their seed
// corpora, testdata/fuzz/<name>; `make fuzz` fuzzes each.

import (
	"bytes"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"testing/iotest"

	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
)

var caddyfileLine = regexp.MustCompile(`Caddyfile:(\d+)\b`)

// FuzzCaddyfile feeds arbitrary blocks to the directive's parser (the
// store's included): it never panics, each error names a line of the
// input, and what it accepts survives a JSON round trip, as the config
// Caddy loads.
func FuzzCaddyfile(f *testing.F) {
	f.Fuzz(func(t *testing.T, block string) {
		input := "idempotency {\n" + block + "\n}\n"
		tokens, err := caddyfile.Tokenize([]byte(input), "Caddyfile")
		if err != nil {
			return // the lexer's error, before the directive sees anything
		}
		h := new(Handler)
		err = h.UnmarshalCaddyfile(caddyfile.NewDispenser(tokens))
		if err != nil {
			m := caddyfileLine.FindStringSubmatch(err.Error())
			if m == nil {
				t.Fatalf("error names no line: %v\ninput:\n%s", err, input)
			}
			if n, _ := strconv.Atoi(m[1]); n < 1 || n > strings.Count(input, "\n") {
				t.Fatalf("error names line %d of a %d-line input: %v", n, strings.Count(input, "\n"), err)
			}
			return
		}
		js, err := json.Marshal(h)
		if err != nil {
			t.Fatalf("accepted, but not JSON: %v\ninput:\n%s", err, input)
		}
		var back Handler
		if err := json.Unmarshal(js, &back); err != nil {
			t.Fatalf("accepted, but its JSON %s does not load: %v", js, err)
		}
		if again, _ := json.Marshal(&back); !bytes.Equal(again, js) {
			t.Fatalf("JSON round trip changed the config:\n%s\n%s", js, again)
		}
	})
}

// fuzzClient is the client's end of a response, as the recorder writes
// to it: it can fail after failAfter body bytes (-1: never), as a client
// that hung up does.
type fuzzClient struct {
	header        http.Header
	status        int
	headerAtFinal http.Header
	informational []int
	body          []byte
	failAfter     int
	failed        bool
}

var errHungUp = errors.New("client hung up")

func (c *fuzzClient) Header() http.Header { return c.header }

func (c *fuzzClient) WriteHeader(code int) {
	if code >= 100 && code < 200 && code != http.StatusSwitchingProtocols {
		c.informational = append(c.informational, code)
		return
	}
	if c.status == 0 {
		c.status, c.headerAtFinal = code, c.header.Clone()
	}
}

func (c *fuzzClient) Write(p []byte) (int, error) {
	c.WriteHeader(http.StatusOK)
	if c.failed || c.failAfter >= 0 && len(c.body)+len(p) > c.failAfter {
		c.failed = true
		return 0, errHungUp
	}
	c.body = append(c.body, p...)
	return len(p), nil
}

func (c *fuzzClient) Flush() { c.WriteHeader(http.StatusOK) }

// FuzzRecorder runs the recorder through arbitrary sequences of what a
// handler does to a response (set headers, WriteHeader, Write, Flush,
// ReadFrom through readers that chunk or fail) and checks the contract:
// the client receives exactly what was written (or a prefix of it, if it
// hung up), every write reports success so the handler reads its
// upstream to the end, and the stored copy is the whole body when it
// fits in the limit, nothing when it does not, and never more.
func FuzzRecorder(f *testing.F) {
	f.Fuzz(func(t *testing.T, limit uint16, failAfter int16, script []byte) {
		client := &fuzzClient{header: make(http.Header), failAfter: int(failAfter)}
		if failAfter < 0 {
			client.failAfter = -1
		}
		rec := newRecorder(client, int64(limit))
		var written []byte
		next := func() byte {
			if len(script) == 0 {
				return 0
			}
			b := script[0]
			script = script[1:]
			return b
		}
		payload := func(n int) []byte {
			p := make([]byte, n)
			for i := range p {
				p[i] = byte(len(written) + i)
			}
			return p
		}
		for len(script) > 0 {
			switch op := next(); op % 7 {
			case 0: // a final or informational status, 100–599
				rec.WriteHeader(100 + (int(next())<<8|int(next()))%500)
			case 1:
				p := payload(int(next()) * (1 + int(op>>4)))
				if n, err := rec.Write(p); n != len(p) || err != nil {
					t.Fatalf("Write(%d bytes) = %d, %v: a failure would stop the handler", len(p), n, err)
				}
				written = append(written, p...)
			case 2:
				rec.Flush()
			case 3:
				p := payload(int(next()) * (1 + int(op>>4)))
				var r io.Reader = bytes.NewReader(p)
				switch next() % 4 {
				case 1:
					r = iotest.OneByteReader(r)
				case 2:
					r = iotest.HalfReader(r)
				case 3:
					r = iotest.TimeoutReader(r) // fails on its second read
				}
				n, err := rec.ReadFrom(r)
				if err != nil && !errors.Is(err, iotest.ErrTimeout) {
					t.Fatalf("ReadFrom: %v", err)
				}
				written = append(written, p[:n]...)
			case 4:
				name := []string{"X-Fuzz", "Set-Cookie", "Authorization", "Content-Type", "Connection"}[next()%5]
				rec.Header().Add(name, strconv.Itoa(int(next())))
			case 5:
				// A declared length, true or not: the recorder sizes its
				// copy from it.
				rec.Header().Set("Content-Length", strconv.Itoa(int(next())*int(next())))
			case 6:
				_ = rec.FlushError()
			}
			if int64(len(rec.body)) > int64(limit) {
				t.Fatalf("the copy holds %d bytes, the limit is %d", len(rec.body), limit)
			}
		}

		if !client.failed && !bytes.Equal(client.body, written) {
			t.Fatalf("the client got %d bytes, the handler wrote %d", len(client.body), len(written))
		}
		if !bytes.HasPrefix(written, client.body) {
			t.Fatalf("the client got bytes the handler did not write")
		}
		for _, code := range client.informational {
			if code == rec.status {
				t.Fatalf("informational status %d recorded as the response's", code)
			}
		}

		resp := rec.response(newTestExcluded())
		wantStatus, wantHeader := client.status, client.headerAtFinal
		if wantStatus == 0 {
			wantStatus, wantHeader = http.StatusOK, client.header
		}
		if resp.Status != wantStatus {
			t.Fatalf("stored status %d, the client got %d", resp.Status, wantStatus)
		}
		for _, name := range []string{"Set-Cookie", "Authorization", "Connection"} {
			if v, ok := resp.Header[name]; ok {
				t.Fatalf("stored %s: %q", name, v)
			}
		}
		for _, name := range []string{"X-Fuzz", "Content-Type", "Content-Length"} {
			if got, want := resp.Header.Values(name), wantHeader.Values(name); !equalStrings(got, want) {
				t.Fatalf("stored %s %q, the client got %q at its status", name, got, want)
			}
		}
		if resp.BodySize != int64(len(written)) {
			t.Fatalf("BodySize %d, %d bytes were written", resp.BodySize, len(written))
		}
		// The limit bounds what is stored: the body, and the names and
		// values of the stored headers. A 101 is never replayable.
		size := int64(len(written))
		for name, values := range resp.Header {
			size += int64(len(name))
			for _, v := range values {
				size += int64(len(v))
			}
		}
		fits := size <= int64(limit) && resp.Status != http.StatusSwitchingProtocols
		if resp.Replayable != fits {
			t.Fatalf("replayable %v for %d bytes (status %d) under a limit of %d", resp.Replayable, size, resp.Status, limit)
		}
		if fits && !bytes.Equal(resp.Body, written) || !fits && resp.Body != nil {
			t.Fatalf("stored %d bytes of a %d-byte body, limit %d", len(resp.Body), len(written), limit)
		}
	})
}

// newTestExcluded is the set of headers a Handler with default settings
// never stores.
func newTestExcluded() map[string]struct{} {
	excluded := make(map[string]struct{}, len(alwaysExcluded))
	for _, name := range alwaysExcluded {
		excluded[http.CanonicalHeaderKey(name)] = struct{}{}
	}
	return excluded
}

// FuzzKeyJSON: whatever key key_json reads from a body, a last-wins
// parser that matches names case-insensitively (encoding/json decoding
// into a struct) reads too, so that one body is never processed under two
// keys. A key read where such a parser would find another member is the
// bug this catches: the reader stopping early in a nested value, or
// missing a name that differs only in case.
func FuzzKeyJSON(f *testing.F) {
	for _, seed := range [][2]string{
		{"/id", `{"id":"evt_123456789"}`},
		{"/data/object/id", `{"data":{"object":{"id":"evt_A"},"object":{"id":"evt_B"}}}`},
		{"/data/object/id", `{"data":{"object":{"id":"evt_A","x":[{"id":1}]}},"Data":{}}`},
		{"/a/0", `{"a":["x",{"k":[1]}],"b":1,"a":1}`},
		{"/id", `{"id":"A","ID":"B"}`},
	} {
		f.Add(seed[0], seed[1])
	}
	f.Fuzz(func(t *testing.T, pointer, body string) {
		ptr, err := parseJSONPointer(pointer)
		if err != nil || len(ptr) > 4 {
			return
		}
		got, err := jsonPointerValue([]byte(body), ptr)
		if err != nil {
			return
		}
		want, ok := lastWinsFolded([]byte(body), ptr)
		if !ok || want != got {
			t.Fatalf("key_json %s in %s read %q; a last-wins, case-folding parser reads %q (found: %v)", pointer, body, got, want, ok)
		}
	})
}

// lastWinsFolded walks ptr as encoding/json resolves a struct field:
// the last member whose name equals the token ignoring case.
func lastWinsFolded(body []byte, ptr []string) (string, bool) {
	for _, tok := range ptr {
		dec := json.NewDecoder(bytes.NewReader(body))
		open, err := dec.Token()
		if err != nil {
			return "", false
		}
		var last json.RawMessage
		found := false
		for i := 0; dec.More(); i++ {
			var name any = i
			if open == json.Delim('{') {
				if name, err = dec.Token(); err != nil {
					return "", false
				}
			}
			var raw json.RawMessage
			if dec.Decode(&raw) != nil {
				return "", false
			}
			n, isName := name.(string)
			idx, isIndex := arrayIndex(tok)
			if isName && strings.EqualFold(n, tok) || !isName && isIndex && name == idx {
				last, found = raw, true
			}
		}
		if !found {
			return "", false
		}
		body = last
	}
	var v any
	dec := json.NewDecoder(bytes.NewReader(body))
	dec.UseNumber()
	if dec.Decode(&v) != nil {
		return "", false
	}
	switch s := v.(type) {
	case string:
		return s, true
	case json.Number:
		return s.String(), true
	}
	return "", false
}
