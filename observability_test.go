package idempotency

// The log lines and the placeholders, as an operator reads them.

import (
	"bytes"
	"context"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"net/http"
	"os"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/caddy-idempotency/idempotency/internal/pgtest"
	"github.com/caddy-idempotency/idempotency/store/storetest"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"
)

// One line per case, at the level an operator would choose, with the
// fields that make it actionable, and the credential only as its id.
func TestLogLines(t *testing.T) {
	sb := postgresBackend(t)
	up := newUpstream(t)
	pPG, pUndialable, pDown, pOpen, pShadow := freeTCPPort(t), freeTCPPort(t), freeTCPPort(t), freeTCPPort(t), freeTCPPort(t)
	down := fmt.Sprintf("postgres://postgres@127.0.0.1:%d/test?sslmode=disable&connect_timeout=2", freeTCPPort(t))
	// One secret for every site: a credential then has one id in all
	// their lines, whatever their store, and a store that is down still
	// lets the handler name the credential.
	logSecret := pgtest.RandomHex(32)
	t.Setenv("IDEMPOTENCY_TEST_LOG_SECRET", logSecret)
	srv := startCaddyfile(t, fmt.Sprintf(`http://127.0.0.1:%d {
	idempotency {
		credential_secret {env.IDEMPOTENCY_TEST_LOG_SECRET}
		%s
		replay_cache off
		prune_interval 1s
	}
	reverse_proxy %s
}
http://127.0.0.1:%d {
	idempotency {
		credential_secret {env.IDEMPOTENCY_TEST_LOG_SECRET}
	}
	reverse_proxy 127.0.0.1:%d
}
http://127.0.0.1:%d {
	idempotency {
		credential_secret {env.IDEMPOTENCY_TEST_LOG_SECRET}
		store postgres {
			dsn %q
			migrate off
		}
	}
	reverse_proxy %s
}
http://127.0.0.1:%d {
	idempotency {
		credential_secret {env.IDEMPOTENCY_TEST_LOG_SECRET}
		store postgres {
			dsn %q
			migrate off
		}
		on_store_error fail_open
	}
	reverse_proxy %s
}
http://127.0.0.1:%d {
	idempotency {
		credential_secret {env.IDEMPOTENCY_TEST_LOG_SECRET}
		shadow
	}
	reverse_proxy %s
}
`, pPG, sb.Block(), up.Addr(), pUndialable, freeTCPPort(t), pDown, down, up.Addr(),
		pOpen, down, up.Addr(), pShadow, up.Addr()))
	pg := newSiteClient(t, srv, pPG)
	secret := "Bearer sk_test_" + pgtest.RandomHex(12)
	sum := newCredentialHasher([]byte(logSecret)).hash(secret)
	credID := hex.EncodeToString(sum[:6])

	c := call{Key: newKey(), Body: payBody(), Cred: secret, Path: "/v1/charges"}
	pg.Do(t, c)
	pg.Do(t, c)                                                                    // replay
	pg.Do(t, call{Key: c.Key, Body: payBody(), Cred: secret, Path: "/v1/charges"}) // mismatch
	slow := call{Key: newKey(), Body: payBody(), Cred: secret, Path: "/v1/charges", Header: sleepFor(300 * time.Millisecond)}
	ch := runBackground(t, pg, slow)
	up.WaitStarted(t, 2)
	pg.Do(t, call{Key: slow.Key, Body: slow.Body, Cred: secret, Path: "/v1/charges"}) // in progress
	<-ch
	sb.waitCompleted(t, slow.Key)
	pgtest.Exec(t, sb.DSN, `UPDATE `+pgtest.QuoteIdent(sb.Table)+` SET status = 'in_progress',
		lock_token = $1, locked_at = now() - interval '1 hour',
		response_status = NULL, response_headers = NULL, response_body = NULL,
		replayable = NULL, response_size = NULL
		WHERE key = $2`, bytes.Repeat([]byte{0xde}, 16), c.Key)
	primaryLongUp(t, sb.DSN, sb.Table)
	pg.Do(t, c) // takeover
	pgtest.Exec(t, sb.DSN, `INSERT INTO `+pgtest.QuoteIdent(sb.Table)+` (credential_hash, key, fingerprint, method, path,
		status, created_at, expires_at, response_status, response_headers, response_body, replayable, response_size)
		VALUES ($1, 'expired-key', $1, 'POST', '/pay', 'completed', now() - interval '2 days', now() - interval '1 day', 201, '{}', '', true, 0)`,
		bytes.Repeat([]byte{9}, 32))
	newSiteClient(t, srv, pUndialable).Do(t, call{Key: newKey(), Body: payBody(), Cred: secret, Path: "/v1/charges"})
	newSiteClient(t, srv, pDown).Do(t, call{Key: newKey(), Body: payBody(), Cred: secret, Path: "/v1/charges"})
	newSiteClient(t, srv, pOpen).Do(t, call{Key: newKey(), Body: payBody(), Cred: secret, Path: "/v1/charges"})
	shadow := newSiteClient(t, srv, pShadow)
	sc := call{Key: newKey(), Body: payBody(), Cred: secret, Path: "/v1/charges"}
	shadow.Do(t, sc)
	shadow.Do(t, sc)
	storetest.WaitFor(t, 15*time.Second, "the pruner", func() bool { return pgCount(t, sb) == 2 })

	// One Caddy logs for several sites and servers: each line names its
	// HTTP server, and a request's lines the Host it was sent to.
	common := []string{"server", "host", "key", "credential_id", "method", "path"}
	want := []struct {
		msg, level string
		fields     []string
	}{
		{"idempotency.executed", "debug", append(common, "status")},
		{"idempotency.replay", "info", append(common, "original_status", "age_seconds")},
		{"idempotency.mismatch", "info", append(common, "original_method", "original_path")},
		{"idempotency.in_progress", "info", append(common, "lock_age_seconds")},
		{"idempotency.takeover", "warn", append(common, "lock_timeout")},
		{"idempotency.release", "info", append(common, "cause")},
		{"idempotency.store_error", "error", append(common, "operation", "error")},
		{"idempotency.fail_open", "warn", common},
		{"idempotency.shadow", "info", append(common, "would", "original_status", "age_seconds")},
		{"idempotency.prune", "info", []string{"server", "rows"}},
		{"idempotency.provisioned", "info", []string{"server", "version", "store"}},
	}
	lines := srv.moduleLogLines(t)
	for _, w := range want {
		var found map[string]any
		for _, l := range lines {
			if l["msg"] == w.msg {
				found = l
				break
			}
		}
		if found == nil {
			t.Errorf("no %s line", w.msg)
			continue
		}
		if found["level"] != w.level {
			t.Errorf("%s is logged at %v, want %s", w.msg, found["level"], w.level)
		}
		for _, f := range w.fields {
			if _, ok := found[f]; !ok {
				t.Errorf("%s lacks %q: %v", w.msg, f, found)
			}
		}
		if id, ok := found["credential_id"]; ok && id != credID {
			t.Errorf("%s credential_id = %v, want %s", w.msg, id, credID)
		}
		if found["path"] != nil && found["path"] != "/v1/charges" {
			t.Errorf("%s path = %v", w.msg, found["path"])
		}
		if srvName, _ := found["server"].(string); !strings.HasPrefix(srvName, "srv") {
			t.Errorf("%s server = %v, want the HTTP server's name", w.msg, found["server"])
		}
	}
	servers := map[string]any{}
	for _, l := range lines {
		switch l["msg"] {
		case "idempotency.replay", "idempotency.fail_open":
			if l["host"] != "127.0.0.1" { // the Host the site clients send
				t.Errorf("%s host = %v, want 127.0.0.1", l["msg"], l["host"])
			}
			servers[l["msg"].(string)] = l["server"]
		}
	}
	if servers["idempotency.replay"] == servers["idempotency.fail_open"] {
		t.Errorf("the lines of two sites on two servers name one server, %v", servers["idempotency.replay"])
	}
	// A sample of each line, as written, for docs/operations.md and the curious.
	data, err := os.ReadFile(srv.LogPath)
	if err != nil {
		t.Fatal(err)
	}
	for _, w := range want {
		for _, line := range bytes.Split(data, []byte("\n")) {
			if bytes.Contains(line, []byte(`"msg":"`+w.msg+`"`)) {
				t.Logf("%s", line)
				break
			}
		}
	}
	if bytes.Contains(data, []byte(strings.TrimPrefix(secret, "Bearer "))) {
		t.Errorf("the raw credential is in the log")
	}
	// A field written twice (the logger's own and the line's) is a JSON
	// object with a duplicate name: log pipelines keep either one.
	for _, line := range bytes.Split(data, []byte("\n")) {
		if !bytes.Contains(line, []byte(`"logger":"http.handlers.idempotency`)) {
			continue
		}
		if name := duplicateName(t, line); name != "" {
			t.Errorf("%q appears twice in %s", name, line)
		}
	}
}

// duplicateName returns a name that the JSON object line has twice at
// its top level, or "".
func duplicateName(t *testing.T, line []byte) string {
	t.Helper()
	dec := json.NewDecoder(bytes.NewReader(line))
	if tok, err := dec.Token(); err != nil || tok != json.Delim('{') {
		t.Fatalf("not a JSON object: %s", line)
	}
	seen := map[string]bool{}
	for dec.More() {
		tok, err := dec.Token()
		if err != nil {
			t.Fatalf("%v in %s", err, line)
		}
		name := tok.(string)
		if seen[name] {
			return name
		}
		seen[name] = true
		var v json.RawMessage
		if err := dec.Decode(&v); err != nil {
			t.Fatalf("%v in %s", err, line)
		}
	}
	return ""
}

// docs/operations.md's access log example: log_append puts both placeholders in
// every access log line of a protected request.
func TestAccessLogPlaceholders(t *testing.T) {
	up := newUpstream(t)
	port := freeTCPPort(t)
	s := siteFromCaddyfile(t, port, fmt.Sprintf(`http://127.0.0.1:%d {
	log
	log_append idempotency_result {http.idempotency.result}
	log_append idempotency_key {http.idempotency.key}
	idempotency {
		store memory
		optional
	}
	reverse_proxy %s
}
`, port, up.Addr()))
	c := call{Key: newKey(), Body: payBody()}
	inflight := call{Key: newKey(), Body: payBody(), Header: sleepFor(300 * time.Millisecond)}
	ch := runBackground(t, s, inflight)
	up.WaitStarted(t, 1)
	cases := []struct {
		c           call
		result, key string
	}{
		{c, "executed", c.Key},
		{c, "replayed", c.Key},
		{call{Key: c.Key, Body: payBody()}, "mismatch", c.Key},
		{call{Key: inflight.Key, Body: inflight.Body}, "in_progress", inflight.Key},
		{call{Key: "short", Body: payBody()}, "rejected", ""},
		{call{Body: payBody()}, "no_key", ""},
		{call{Key: c.Key, Body: payBody(), Cred: noCred}, "rejected", c.Key},
	}
	for _, tc := range cases {
		s.Do(t, tc.c)
	}
	<-ch
	s.Do(t, call{Method: http.MethodGet, Path: "/unprotected"})

	// The lines of the requests sent one after the other, in order: all
	// but the in-flight request's own.
	var access []map[string]any
	storetest.WaitFor(t, 10*time.Second, "the access log lines", func() bool {
		access = access[:0]
		for _, l := range s.logLines(t) {
			if name, _ := l["logger"].(string); !strings.HasPrefix(name, "http.log.access") {
				continue
			}
			if req, _ := l["request"].(map[string]any); req["headers"].(map[string]any)["X-Test-Sleep"] != nil {
				continue
			}
			access = append(access, l)
		}
		return len(access) == len(cases)+1
	})
	for i, tc := range cases {
		l := access[i]
		if l["idempotency_result"] != tc.result || l["idempotency_key"] != tc.key {
			t.Errorf("case %d: access log has result %v key %v, want %s %q", i, l["idempotency_result"], l["idempotency_key"], tc.result, tc.key)
		}
	}
	if l := access[len(cases)]; l["idempotency_result"] != nil {
		t.Errorf("an unprotected request's access log line: %v", l)
	}
}

func TestLogs(t *testing.T) {
	t.Run("memory store warns it is not durable", func(t *testing.T) {
		up := newUpstream(t)
		s := protectedSite(t, storeBackend{Name: "memory"}, up.Addr())
		found := false
		for _, l := range s.moduleLogLines(t) {
			if l["level"] == "warn" {
				found = true
			}
		}
		if !found {
			t.Errorf("no warning from the module at start with the memory store")
		}
	})
	t.Run("one line per replay", func(t *testing.T) {
		up := newUpstream(t)
		s := protectedSite(t, storeBackend{Name: "memory"}, up.Addr())
		c := call{Key: newKey(), Body: payBody(), Path: "/pay/x"}
		s.Do(t, c)
		s.Do(t, c)
		var replays []map[string]any
		for _, l := range s.moduleLogLines(t) {
			if msg, _ := l["msg"].(string); msg == "idempotency.replay" {
				replays = append(replays, l)
			}
		}
		if len(replays) != 1 {
			t.Fatalf("%d idempotency.replay lines, want 1", len(replays))
		}
		for _, field := range []string{"key", "method", "path", "original_status", "age_seconds"} {
			if _, ok := replays[0][field]; !ok {
				t.Errorf("idempotency.replay line lacks %q: %v", field, replays[0])
			}
		}
		if replays[0]["key"] != c.Key || replays[0]["path"] != "/pay/x" || replays[0]["method"] != "POST" {
			t.Errorf("idempotency.replay line: %v", replays[0])
		}
		// The credential id is a short prefix of the credential's keyed
		// hash, never the credential, nor anything its unkeyed hash gives.
		sum := handlerCredentialHash(t, storeBackend{Name: "memory"}, defaultCred)
		credID, _ := replays[0]["credential_id"].(string)
		if credID == "" || len(credID) >= 64 || !strings.HasPrefix(hex.EncodeToString(sum[:]), credID) {
			t.Errorf("idempotency.replay credential_id = %q, want a short prefix of the credential's keyed hash", credID)
		}
	})
}

// A routine execution is one debug line, with the request's fields and
// the status stored; nothing at info, where it would be a line per
// request.
func TestExecutedLine(t *testing.T) {
	h, _, infoLogs := lockHandler(t, 30*time.Second)
	var calls atomic.Int32
	if got := serve(context.Background(), h, "executed-at-info", created(&calls)); got != http.StatusCreated {
		t.Fatalf("status %d, want 201", got)
	}
	if n := infoLogs.FilterMessage("idempotency.executed").Len(); n != 0 {
		t.Errorf("%d idempotency.executed lines at info level, want none", n)
	}

	core, logs := observer.New(zap.DebugLevel)
	h.logger = zap.New(core)
	key := "executed-at-debug"
	if got := serve(context.Background(), h, key, created(&calls)); got != http.StatusCreated {
		t.Fatalf("status %d, want 201", got)
	}
	serve(context.Background(), h, key, created(&calls)) // a replay: no execution
	lines := logs.FilterMessage("idempotency.executed").All()
	if len(lines) != 1 {
		t.Fatalf("%d idempotency.executed lines for one execution and its replay, want 1", len(lines))
	}
	f := lines[0].ContextMap()
	if lines[0].Level != zapcore.DebugLevel || f["key"] != key+"-"+runID || f["status"] != int64(http.StatusCreated) ||
		f["method"] != http.MethodPost || f["path"] != "/pay" || f["host"] == nil || f["credential_id"] == "" {
		t.Errorf("the line: %v %v", lines[0].Level, f)
	}
}
