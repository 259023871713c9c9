package idempotency

// End-to-end tests of `caddy idempotency ...`: the binary of ./cmd/caddy
// (built once, by buildCaddy in caddyproc_test.go) run against a real
// Postgres, next to an in-process Caddy whose records it operates on.

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"net/http"
	"strings"
	"testing"

	"github.com/caddy-idempotency/idempotency/internal/pgtest"
	"github.com/caddy-idempotency/idempotency/stores/postgres"
)

// version names this module's release and the Caddy it is built with,
// and needs no database.
func TestCLIVersion(t *testing.T) {
	wantCLI(t, runCLI(t, nil, "version"), exitOK, "caddy-idempotency "+Version+" (Caddy v2.")
}

// migrate creates the table of a store with `migrate off`, which then
// works; a second run applies nothing.
func TestCLIMigrate(t *testing.T) {
	dsn := pgtest.DSN(t)
	table := pgtest.FreshTable(t)
	env := []string{"IDEMPOTENCY_DSN=" + dsn}
	wantCLI(t, runCLI(t, env, "migrate", "--table", table), exitOK, fmt.Sprintf("applied %d migration", migrationCount(t)))
	wantCLI(t, runCLI(t, env, "migrate", "--table", table), exitOK, "applied 0 migration")
	// DATABASE_URL works too, and --dsn wins over both.
	wantCLI(t, runCLI(t, []string{"DATABASE_URL=" + dsn}, "migrate", "--table", table), exitOK, "up to date")
	wantCLI(t, runCLI(t, []string{"DATABASE_URL=postgres://nobody@127.0.0.1:1/x"}, "migrate", "--dsn", dsn, "--table", table), exitOK)

	up := newUpstream(t)
	sb := storeBackend{Name: "", DSN: dsn, Table: table}
	s := protectedSite(t, sb, up.Addr(),
		fmt.Sprintf("store postgres {\n\t\t\tdsn %q\n\t\t\ttable %s\n\t\t\tmigrate off\n\t\t}", dsn, table))
	c := call{Key: newKey(), Body: payBody()}
	first := s.Do(t, c)
	wantExecuted(t, first, http.StatusCreated)
	wantReplayOf(t, s.Do(t, c), first)
}

// prune deletes expired rows in batches, keeps live ones, and stands
// aside while another instance holds the prune lock.
func TestCLIPrune(t *testing.T) {
	dsn := pgtest.DSN(t)
	table := pgtest.FreshTable(t)
	env := []string{"IDEMPOTENCY_DSN=" + dsn}
	wantCLI(t, runCLI(t, env, "migrate", "--table", table), exitOK)
	insert := func(key, expires string) {
		pgtest.Exec(t, dsn, `INSERT INTO `+pgtest.QuoteIdent(table)+` (credential_hash, key, fingerprint, method, path,
			status, created_at, expires_at, response_status, response_headers, response_body, replayable, response_size)
			VALUES ($1, $2, $1, 'POST', '/pay', 'completed', now() - interval '2 days', now() + $3::interval, 201, '{}', '', true, 0)`,
			bytes.Repeat([]byte{7}, 32), key, expires)
	}
	for i := range 5 {
		insert(fmt.Sprintf("expired-%d", i), "-1 hour")
	}
	insert("live-key-1", "1 hour")

	// Another instance is pruning: the CLI must not wait nor delete.
	ctx := context.Background()
	conn := pgtest.Connect(t, dsn)
	tn, _ := postgres.ParseTable(table)
	if _, err := conn.Exec(ctx, "SELECT pg_advisory_lock($1)", tn.PruneLockKey()); err != nil {
		t.Fatal(err)
	}
	wantCLI(t, runCLI(t, env, "prune", "--table", table), exitOK, "another instance is pruning")
	if n := pgCount(t, storeBackend{DSN: dsn, Table: table}); n != 6 {
		t.Fatalf("%d rows after a prune that should have stood aside, want 6", n)
	}
	if _, err := conn.Exec(ctx, "SELECT pg_advisory_unlock($1)", tn.PruneLockKey()); err != nil {
		t.Fatal(err)
	}

	wantCLI(t, runCLI(t, env, "prune", "--table", table, "--batch", "2"), exitOK, "pruned 5 expired record(s)")
	rows := pgtest.Query(t, dsn, "SELECT key FROM "+pgtest.QuoteIdent(table))
	if len(rows) != 1 || rows[0][0] != "live-key-1" {
		t.Errorf("rows after pruning: %v, want only live-key-1", rows)
	}
	wantCLI(t, runCLI(t, env, "prune", "--table", table, "--batch", "0"), exitUsage, "--batch")
}

// The support case: a key stuck in progress (its request will never
// finish) is inspected and released by the credential id that the log
// lines print, and the client's retry then executes.
func TestCLIInspectAndRelease(t *testing.T) {
	dsn := pgtest.DSN(t)
	sb := postgresBackend(t)
	env := []string{"IDEMPOTENCY_DSN=" + dsn}
	up := newUpstream(t)
	// The replay cache is off: the test stages a stuck record in the
	// table behind the back of a handler that completed it.
	s := protectedSite(t, sb, up.Addr(), "lock_timeout 1h", "replay_cache off")
	c := call{Key: newKey(), Body: payBody(), Path: "/pay/stuck"}
	wantExecuted(t, s.Do(t, c), http.StatusCreated)
	sb.waitCompleted(t, c.Key)
	// Its instance died mid-request, and the lock is fresh.
	if n := pgtest.Exec(t, dsn, `UPDATE `+pgtest.QuoteIdent(sb.Table)+` SET status = 'in_progress',
		lock_token = $1, locked_at = now() - interval '5 minutes',
		response_status = NULL, response_headers = NULL, response_body = NULL,
		replayable = NULL, response_size = NULL
		WHERE key = $2`, bytes.Repeat([]byte{0xde}, 16), c.Key); n != 1 {
		t.Fatalf("updated %d rows, want 1", n)
	}
	primaryLongUp(t, dsn, sb.Table)
	wantProblem(t, s.Do(t, c), http.StatusConflict)

	// The operator finds the credential id in the in-progress log line.
	var credID string
	for _, l := range s.moduleLogLines(t) {
		if l["msg"] == "idempotency.in_progress" && l["key"] == c.Key {
			credID, _ = l["credential_id"].(string)
		}
	}
	if credID == "" {
		t.Fatalf("no idempotency.in_progress line with a credential_id")
	}
	target := []string{"--table", sb.Table, "--key", c.Key, "--credential-id", credID}

	res := runCLI(t, env, append([]string{"inspect"}, target...)...)
	wantCLI(t, res, exitOK, "in_progress, locked 5m", "POST /pay/stuck", credID, "response:         none yet")
	var recs []map[string]any
	res = runCLI(t, env, append([]string{"inspect", "--json"}, target...)...)
	wantCLI(t, res, exitOK)
	if err := json.Unmarshal([]byte(res.stdout), &recs); err != nil || len(recs) != 1 {
		t.Fatalf("inspect --json: %v: %s", err, res)
	}
	if recs[0]["status"] != "in_progress" || recs[0]["credential_id"] != credID || recs[0]["path"] != "/pay/stuck" {
		t.Errorf("inspect --json: %v", recs[0])
	}

	wantCLI(t, runCLI(t, env, append([]string{"release"}, target...)...), exitOK, "released key", "deleted its in_progress record")
	retry := s.Do(t, c)
	wantExecuted(t, retry, http.StatusCreated)
	wantCount(t, up, 2)

	// Now completed: inspect shows the response; release refuses without
	// --force (a replay is what retries should get).
	wantCLI(t, runCLI(t, env, append([]string{"inspect"}, target...)...), exitOK,
		"status:           completed", "response:         201; sealed; body ", "stored sealed with its headers: replayable")
	wantCLI(t, runCLI(t, env, append([]string{"release"}, target...)...), exitError, "not in progress", "--force")
	wantReplayOf(t, s.Do(t, c), retry)
	// The raw credential names the same record, hashed locally.
	wantCLI(t, runCLI(t, env, "release", "--force", "--table", sb.Table, "--key", c.Key, "--credential", defaultCred),
		exitOK, "deleted its completed record")
	wantExecuted(t, s.Do(t, c), http.StatusCreated)
	wantCount(t, up, 3)

	// The raw credential from stdin, out of the shell's history.
	wantCLI(t, runCLIInput(t, defaultCred+"\n", env, "inspect", "--table", sb.Table, "--key", c.Key, "--credential", "-"),
		exitOK, "credential id:    "+credID)

	// Not found: another key, another credential.
	wantCLI(t, runCLI(t, env, "inspect", "--table", sb.Table, "--key", newKey(), "--credential-id", credID), exitNotFound, "no record")
	wantCLI(t, runCLI(t, env, "release", "--table", sb.Table, "--key", c.Key, "--credential", "Bearer someone-else"), exitNotFound, "no record")
}

// A credential id is a prefix: when it matches several credentials,
// inspect shows them all and release refuses to choose.
func TestCLIAmbiguousCredentialID(t *testing.T) {
	dsn := pgtest.DSN(t)
	sb := postgresBackend(t)
	env := []string{"IDEMPOTENCY_DSN=" + dsn}
	wantCLI(t, runCLI(t, env, "migrate", "--table", sb.Table), exitOK)
	prefix := []byte{0xab, 0xcd, 0xef, 0x01, 0x23, 0x45}
	hashes := make([][]byte, 2)
	for i := range hashes {
		hashes[i] = append(append([]byte{}, prefix...), bytes.Repeat([]byte{byte(i + 1)}, 26)...)
		pgtest.Exec(t, dsn, `INSERT INTO `+pgtest.QuoteIdent(sb.Table)+` (credential_hash, key, fingerprint, method, path,
			status, lock_token, locked_at, locked_until, created_at, expires_at)
			VALUES ($1, 'shared-key', $1, 'POST', '/pay', 'in_progress', $2, now(), now(), now(), now() + interval '1 day')`,
			hashes[i], bytes.Repeat([]byte{1}, 16))
	}
	// A third credential outside the prefix, under the same key.
	other := bytes.Repeat([]byte{0xab}, 32)
	pgtest.Exec(t, dsn, `INSERT INTO `+pgtest.QuoteIdent(sb.Table)+` (credential_hash, key, fingerprint, method, path,
		status, lock_token, locked_at, created_at, expires_at)
		VALUES ($1, 'shared-key', $1, 'POST', '/pay', 'in_progress', $2, now(), now(), now() + interval '1 day')`,
		other, bytes.Repeat([]byte{1}, 16))

	id := hex.EncodeToString(prefix)
	target := []string{"--table", sb.Table, "--key", "shared-key"}
	res := runCLI(t, env, append([]string{"inspect", "--credential-id", id}, target...)...)
	wantCLI(t, res, exitOK, "2 credentials match", hex.EncodeToString(hashes[0]), hex.EncodeToString(hashes[1]))
	if strings.Contains(res.stdout, hex.EncodeToString(other)) {
		t.Errorf("inspect shows a credential outside the prefix: %s", res)
	}
	wantCLI(t, runCLI(t, env, append([]string{"release", "--credential-id", id}, target...)...), exitError, "matches several credentials")
	if n := pgCount(t, sb); n != 3 {
		t.Fatalf("%d rows after a refused release, want 3", n)
	}
	// A longer prefix chooses one.
	wantCLI(t, runCLI(t, env, append([]string{"release", "--credential-id", hex.EncodeToString(hashes[1][:8])}, target...)...), exitOK)
	if n := pgCount(t, sb); n != 2 {
		t.Fatalf("%d rows after releasing one, want 2", n)
	}
	// An all-0xff prefix has no upper bound; it must still work.
	wantCLI(t, runCLI(t, env, append([]string{"inspect", "--credential-id", strings.Repeat("ff", 6)}, target...)...), exitNotFound)
}

func TestCLIUsageAndErrors(t *testing.T) {
	dsn := pgtest.DSN(t)
	env := []string{"IDEMPOTENCY_DSN=" + dsn}
	sum := sha256.Sum256([]byte(defaultCred))
	id := hex.EncodeToString(sum[:6])
	for _, tc := range []struct {
		name     string
		env      []string
		args     []string
		code     int
		contains string
	}{
		{"no subcommand", env, nil, exitUsage, "subcommand is required"},
		{"unknown subcommand", env, []string{"frobnicate"}, exitUsage, "frobnicate"},
		{"unknown flag", env, []string{"inspect", "--frob"}, exitUsage, "unknown flag"},
		{"extra argument", env, []string{"migrate", "now"}, exitUsage, "unexpected argument"},
		{"no key", env, []string{"inspect", "--credential-id", id}, exitUsage, "--key is required"},
		{"malformed key", env, []string{"inspect", "--key", "short", "--credential-id", id}, exitUsage, "--key"},
		{"no credential", env, []string{"release", "--key", "abcdefgh"}, exitUsage, "--credential-id"},
		{"both credentials", env, []string{"inspect", "--key", "abcdefgh", "--credential-id", id, "--credential", "x"}, exitUsage, "one of --credential-id, --credential and --scope"},
		{"credential id not hex", env, []string{"inspect", "--key", "abcdefgh", "--credential-id", "xyzxyzxyzxyz"}, exitUsage, "hex digits"},
		{"credential id too short", env, []string{"inspect", "--key", "abcdefgh", "--credential-id", "abcd"}, exitUsage, "hex digits"},
		{"bad table", env, []string{"migrate", "--table", "x; DROP TABLE y"}, exitUsage, "--table"},
		{"no DSN", nil, []string{"migrate"}, exitUsage, "IDEMPOTENCY_DSN"},
		{"DSN unparsable, password not echoed", []string{"IDEMPOTENCY_DSN=postgres://u:hunter2@[::1"}, []string{"migrate"}, exitUsage, "not a valid"},
		{"database unreachable", []string{fmt.Sprintf("IDEMPOTENCY_DSN=postgres://postgres:hunter2@127.0.0.1:%d/x?connect_timeout=2", freeTCPPort(t))},
			[]string{"migrate"}, exitError, "connecting to Postgres"},
		{"table missing", env, []string{"inspect", "--table", "no_such_table_here", "--key", "abcdefgh", "--credential-id", id}, exitError, "caddy idempotency migrate"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel() // separate processes, nothing shared
			res := runCLI(t, tc.env, tc.args...)
			wantCLI(t, res, tc.code, tc.contains)
			if strings.Contains(res.stdout+res.stderr, "hunter2") {
				t.Errorf("the output shows the password: %s", res)
			}
		})
	}
}
