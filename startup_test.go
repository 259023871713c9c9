package idempotency

import (
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/caddy-idempotency/idempotency/internal/pgtest"
	"github.com/caddy-idempotency/idempotency/migrations"
	"github.com/caddy-idempotency/idempotency/store"
	"github.com/caddy-idempotency/idempotency/store/storetest"
	"github.com/caddy-idempotency/idempotency/stores/postgres"
)

// `caddy validate` provisions a config without running it: it neither
// needs the store's database nor writes to it, so that CI can validate a
// config without one. Catches migrations (or the secret's creation) at
// provision.
func TestValidateWritesNothing(t *testing.T) {
	bin := buildCaddy(t)
	dsn := pgtest.DSN(t)
	table := pgtest.FreshTable(t)
	unreachable := fmt.Sprintf("postgres://postgres@127.0.0.1:%d/test?sslmode=disable&connect_timeout=2", freeTCPPort(t))
	for _, dsn := range []string{unreachable, dsn} {
		dir := t.TempDir()
		path := filepath.Join(dir, "Caddyfile")
		cfg := fmt.Sprintf(`{
	admin off
}
http://127.0.0.1:%d {
	idempotency {
		store postgres {
			dsn %q
			table %s
		}
	}
	reverse_proxy 127.0.0.1:9
}
`, freeTCPPort(t), dsn, table)
		if err := os.WriteFile(path, []byte(cfg), 0o644); err != nil {
			t.Fatal(err)
		}
		cmd := exec.Command(bin, "validate", "--config", path, "--adapter", "caddyfile")
		cmd.Env = append(os.Environ(), "HOME="+dir, "XDG_DATA_HOME="+dir, "XDG_CONFIG_HOME="+dir)
		if out, err := cmd.CombinedOutput(); err != nil {
			t.Errorf("caddy validate with dsn %s: %v\n%s", dsn, err, out)
		}
	}
	rows := pgtest.Query(t, dsn, `SELECT to_regclass($1) IS NOT NULL, to_regclass($2) IS NOT NULL,
	to_regclass($3) IS NOT NULL AND EXISTS (SELECT FROM `+postgres.MigrationsTable+` WHERE table_name = $4)`,
		table, table+"_secret", postgres.MigrationsTable, table)
	if got := strings.Join(rows[0], " "); got != "false false false" {
		t.Errorf("after caddy validate: table, secret table, migrations recorded = %s; want none", got)
	}
}

// Caddy starts with the store's database down, and serves its other
// sites; the protected routes answer 503 and execute nothing until the
// database is reachable, and then work, without a reload. Catches a
// config refused for its migrations, and a protected request executed
// before its table and secret are ready.
func TestStartsWithDatabaseDown(t *testing.T) {
	for _, migrate := range []string{"on", "off"} {
		t.Run("migrate "+migrate, func(t *testing.T) {
			sb := postgresBackend(t)
			if migrate == "off" {
				// The operator's migrations, run before: the secret
				// is still read, and created, at the store's start.
				wantCLI(t, runCLI(t, []string{"IDEMPOTENCY_DSN=" + sb.DSN}, "migrate", "--table", sb.Table), exitOK)
			}
			fwd := pgtest.NewForwarder(t, pgtest.Addr(t, sb.DSN))
			fwd.Cut()
			up := newUpstream(t)
			port, other := freeTCPPort(t), freeTCPPort(t)
			admin := fmt.Sprintf("127.0.0.1:%d", freeTCPPort(t))
			start := time.Now()
			srv := startCaddyfileAdmin(t, fmt.Sprintf(`http://127.0.0.1:%d {
	idempotency {
		store postgres {
			dsn %q
			table %s
			migrate %s
		}
		retry_after 1s
	}
	reverse_proxy %s
}
http://127.0.0.1:%d {
	respond "other site" 200
}
`, port, pgtest.ThroughForwarder(t, sb.DSN, fwd), sb.Table, migrate, up.Addr(), other), admin)
			if took := time.Since(start); took > store.CallTimeout+time.Second {
				t.Errorf("Caddy took %s to start", took)
			}
			s := newSiteClient(t, srv, port)
			o := newSiteClient(t, srv, other)
			if r := o.Do(t, call{Method: http.MethodGet, Path: "/"}); r.Status != http.StatusOK || string(r.Body) != "other site" {
				t.Errorf("the other site: %s", r)
			}
			c := call{Key: newKey(), Body: payBody()}
			for range 5 { // past a few attempts of the store's start
				r := s.Do(t, c)
				if r.Status != http.StatusServiceUnavailable {
					t.Fatalf("with the database down: %s, want 503", r)
				}
				wantRetryAfter(t, r)
				wantProblem(t, r, http.StatusServiceUnavailable)
				time.Sleep(200 * time.Millisecond)
			}
			wantCount(t, up, 0)
			if n := scrapeMetrics(t, admin).value("caddy_idempotency_store_errors_total", "operation", "startup"); n < 2 {
				t.Errorf("%v failed attempts to start counted, want several", n)
			}

			fwd.Restore()
			var first reply
			storetest.WaitFor(t, 10*time.Second, "the store's start", func() bool {
				first = s.Do(t, c)
				return first.Status != http.StatusServiceUnavailable
			})
			wantExecuted(t, first, http.StatusCreated)
			wantReplayOf(t, s.Do(t, c), first)
			wantCount(t, up, 1)
			rows := pgtest.Query(t, sb.DSN, `SELECT count(*) FROM `+pgtest.QuoteIdent(sb.Table+"_secret"))
			if rows[0][0] != "1" {
				t.Errorf("%s secret rows, want 1", rows[0][0])
			}

			// One line for the outage and one for its end, not one per
			// attempt.
			var down, started int
			for _, l := range srv.moduleLogLines(t) {
				switch msg, _ := l["msg"].(string); {
				case strings.HasPrefix(msg, "postgres store cannot start"):
					down++
				case msg == "postgres store started":
					started++
				}
			}
			if down != 1 || started != 1 {
				t.Errorf("logged the outage %d times and its end %d times, want once each", down, started)
			}
		})
	}
}

// Fail closed: no store, no execution. Catches failing open.
func TestStoreUnreachableFailsClosed(t *testing.T) {
	up := newUpstream(t)
	dsn := fmt.Sprintf("postgres://postgres@127.0.0.1:%d/test?sslmode=disable&connect_timeout=2", freeTCPPort(t))
	s := protectedSite(t, storeBackend{Name: ""}, up.Addr(),
		fmt.Sprintf("store postgres {\n\t\t\tdsn %q\n\t\t\ttable idem_unreachable\n\t\t\tmigrate off\n\t\t}", dsn))
	r := s.Do(t, call{Key: newKey(), Body: payBody()})
	if r.Status != http.StatusServiceUnavailable {
		t.Fatalf("got %s, want 503", r)
	}
	wantRetryAfter(t, r)
	wantProblem(t, r, http.StatusServiceUnavailable)
	wantCount(t, up, 0)
	// Unprotected requests do not need the store.
	wantExecuted(t, s.Do(t, call{Method: http.MethodGet}), http.StatusCreated)
}

// Handlers that share a store log the store's start once, and their own
// lines once each: two routes and a second site on one memory store warn
// once that it is not durable; on one Postgres table whose database is
// down at start, they log the outage once and its end once. Catches a
// store's lines repeated per handler, and a follower that starts without
// the table's secret its leader reads.
func TestStoreStartLinesOncePerStore(t *testing.T) {
	sites := func(port, other int, store, upstream string) string {
		return fmt.Sprintf(`http://127.0.0.1:%d {
	idempotency /a* {
		%[3]s
	}
	idempotency /b* {
		%[3]s
		credential_header X-Api-Key
	}
	reverse_proxy %[4]s
}
http://127.0.0.1:%[2]d {
	idempotency {
		%[3]s
	}
	reverse_proxy %[4]s
}
`, port, other, store, upstream)
	}
	count := func(srv *caddyServer, match func(l map[string]any) bool) int {
		n := 0
		for _, l := range srv.moduleLogLines(t) {
			if match(l) {
				n++
			}
		}
		return n
	}
	msgPrefix := func(p string) func(map[string]any) bool {
		return func(l map[string]any) bool { msg, _ := l["msg"].(string); return strings.HasPrefix(msg, p) }
	}

	t.Run("memory", func(t *testing.T) {
		up := newUpstream(t)
		port, other := freeTCPPort(t), freeTCPPort(t)
		srv := startCaddyfile(t, sites(port, other, "store memory", up.Addr()))
		if n := count(srv, msgPrefix("the memory store is not durable")); n != 1 {
			t.Errorf("%d not-durable warnings, want 1", n)
		}
		if n := count(srv, msgPrefix("idempotency.provisioned")); n != 3 {
			t.Errorf("%d idempotency.provisioned lines, want 3: one per handler", n)
		}
	})

	t.Run("postgres down at start", func(t *testing.T) {
		sb := postgresBackend(t)
		fwd := pgtest.NewForwarder(t, pgtest.Addr(t, sb.DSN))
		fwd.Cut()
		up := newUpstream(t)
		port, other := freeTCPPort(t), freeTCPPort(t)
		store := fmt.Sprintf("store postgres {\n\t\t\tdsn %q\n\t\t\ttable %s\n\t\t}", pgtest.ThroughForwarder(t, sb.DSN, fwd), sb.Table)
		srv := startCaddyfile(t, sites(port, other, store, up.Addr()))
		s, o := newSiteClient(t, srv, port), newSiteClient(t, srv, other)
		c := call{Path: "/a", Key: newKey(), Body: payBody()}
		for range 3 { // past a few attempts of each store's start
			wantProblem(t, s.Do(t, c), http.StatusServiceUnavailable)
			time.Sleep(200 * time.Millisecond)
		}
		fwd.Restore()
		storetest.WaitFor(t, 10*time.Second, "the store's start", func() bool {
			return s.Do(t, c).Status != http.StatusServiceUnavailable
		})
		wantExecuted(t, s.Do(t, call{Path: "/b", Key: newKey(), Body: payBody(), Header: map[string]string{"X-Api-Key": "k-1234567"}}), http.StatusCreated)
		storetest.WaitFor(t, 10*time.Second, "the other site's store", func() bool {
			return o.Do(t, call{Key: newKey(), Body: payBody()}).Status == http.StatusCreated
		})
		if n := count(srv, msgPrefix("postgres store cannot start")); n != 1 {
			t.Errorf("%d lines for the outage, want 1", n)
		}
		if n := count(srv, msgPrefix("postgres store started")); n != 1 {
			t.Errorf("%d lines for its end, want 1", n)
		}
		// Each migration is applied once, by whichever store's start
		// holds the migrations' lock first: one line, or two whose counts
		// add up, never a migration counted twice.
		applied := 0.0
		for _, l := range srv.moduleLogLines(t) {
			if l["msg"] == "applied schema migrations" {
				applied += l["count"].(float64)
			}
		}
		files, _ := migrations.Files.ReadDir(".")
		if int(applied) != len(files) {
			t.Errorf("migration lines count %v migrations, want %d", applied, len(files))
		}
	})
}

// With the database down at start, requests fail on the credential
// secret, one line a second: that is an outage like any other, framed by
// store_unavailable and store_recovered, which counts the lines left out
// once the store starts and answers. Catches lines left out at boot that
// nothing ever counted.
func TestBootOutageCountsCredentialSecretLines(t *testing.T) {
	sb := postgresBackend(t)
	fwd := pgtest.NewForwarder(t, pgtest.Addr(t, sb.DSN))
	fwd.Cut()
	up := newUpstream(t)
	s := protectedSite(t, storeBackend{Name: "postgres", DSN: pgtest.ThroughForwarder(t, sb.DSN, fwd), Table: sb.Table},
		up.Addr(), "retry_after 1s")
	refused := 0
	for start := time.Now(); time.Since(start) < 1500*time.Millisecond; {
		r := s.Do(t, call{Key: newKey(), Body: payBody()})
		if r.Status != http.StatusServiceUnavailable {
			t.Fatalf("with the database down: %s, want 503", r)
		}
		refused++
		time.Sleep(20 * time.Millisecond)
	}
	fwd.Restore()
	storetest.WaitFor(t, 15*time.Second, "the store's start", func() bool {
		r := s.Do(t, call{Key: newKey(), Body: payBody()})
		if r.Status == http.StatusServiceUnavailable {
			refused++
		}
		return r.Status == http.StatusCreated
	})

	var unavailable, recovered []map[string]any
	accounted := int64(0)
	for _, l := range s.moduleLogLines(t) {
		switch l["msg"] {
		case "idempotency.store_unavailable":
			unavailable = append(unavailable, l)
		case "idempotency.store_recovered":
			recovered = append(recovered, l)
		case "idempotency.store_error":
			if l["operation"] == opCredentialSecret {
				n, _ := l["suppressed"].(float64)
				accounted += 1 + int64(n)
			}
		}
	}
	if len(unavailable) != 1 || len(recovered) != 1 {
		t.Fatalf("%d store_unavailable and %d store_recovered lines for the boot outage, want one each", len(unavailable), len(recovered))
	}
	if unavailable[0]["operation"] != opCredentialSecret {
		t.Errorf("the outage began with %v, want %s", unavailable[0]["operation"], opCredentialSecret)
	}
	left, _ := recovered[0]["suppressed_store_errors"].(map[string]any)
	n, _ := left[opCredentialSecret].(float64)
	accounted += int64(n)
	if accounted != int64(refused) {
		t.Errorf("the credential_secret lines and those counted as left out account for %d failures, want the %d refused: %v",
			accounted, refused, recovered[0])
	}
}
