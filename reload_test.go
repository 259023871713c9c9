package idempotency

// A Postgres store shared by instances, and the records of requests in
// flight across config reloads.

import (
	"context"
	"fmt"
	"net/http"
	"testing"
	"time"

	"github.com/caddy-idempotency/idempotency/internal/pgtest"
	"github.com/caddy-idempotency/idempotency/store/storetest"
	"github.com/caddyserver/caddy/v2"
)

// Several Caddy instances share one table: a retry that lands on another
// instance is replayed, and a concurrent one gets 409.
func TestPostgresSharedBetweenInstances(t *testing.T) {
	sb := postgresBackend(t)
	up := newUpstream(t)
	portA, portB := freeTCPPort(t), freeTCPPort(t)
	siteBlock := func(port int) string {
		return fmt.Sprintf(`http://127.0.0.1:%d {
	idempotency {
		%s
		lock_timeout 5s
	}
	reverse_proxy %s
}
`, port, sb.Block(), up.Addr())
	}
	srv := startCaddyfile(t, siteBlock(portA)+siteBlock(portB))
	a, b := newSiteClient(t, srv, portA), newSiteClient(t, srv, portB)

	c := call{Key: newKey(), Body: payBody(), Header: sleepFor(500 * time.Millisecond)}
	ch := runBackground(t, a, c)
	up.WaitStarted(t, 1)
	wantProblem(t, b.Do(t, call{Key: c.Key, Body: c.Body}), http.StatusConflict)
	first := <-ch
	wantExecuted(t, first, http.StatusCreated)
	wantReplayOf(t, b.Do(t, call{Key: c.Key, Body: c.Body}), first)
	wantCount(t, up, 1)
}

// A config reload keeps the store working. Catches a pool created with the
// context of the config that unloads.
func TestPostgresSurvivesReload(t *testing.T) {
	sb := postgresBackend(t)
	up := newUpstream(t)
	port := freeTCPPort(t)
	cfg := func(extra string) []byte {
		logPath := t.TempDir() + "/caddy.log"
		js, _, err := adaptCaddyfile(globalOptions(logPath, "") + fmt.Sprintf(`http://127.0.0.1:%d {
	idempotency {
		%s
		%s
	}
	reverse_proxy %s
}
`, port, sb.Block(), extra, up.Addr()))
		if err != nil {
			t.Fatal(err)
		}
		return js
	}
	srv := startCaddyJSON(t, cfg(""), "")
	s := newSiteClient(t, srv, port)
	c := call{Key: newKey(), Body: payBody()}
	first := s.Do(t, c)
	wantExecuted(t, first, http.StatusCreated)

	if err := caddy.Load(cfg("retry_after 3s"), true); err != nil { // caddyMu is held by this test
		t.Fatalf("reload: %v", err)
	}
	s.reloaded(t)
	wantReplayOf(t, s.Do(t, c), first)
	wantExecuted(t, s.Do(t, call{Key: newKey(), Body: payBody()}), http.StatusCreated)
	wantCount(t, up, 2)
}

// A reload that moves the store to another table leaves the requests in
// flight on the store they acquired on: the one running completes its
// record in the old table; its retry, after the reload, finds nothing in
// the new table and executes again (README, "Credential secret").
func TestReloadToAnotherTableInFlight(t *testing.T) {
	dsn := pgtest.DSN(t)
	before, after := pgtest.FreshTable(t), pgtest.FreshTable(t)
	up := newUpstream(t)
	block := func(table string) string {
		return fmt.Sprintf("store postgres {\n\t\t\tdsn %q\n\t\t\ttable %s\n\t\t}", dsn, table)
	}
	s := protectedSite(t, storeBackend{Name: "postgres", DSN: dsn, Table: before}, up.Addr())
	gate := "g-" + pgtest.RandomHex(4)
	c := call{Key: newKey(), Body: payBody(), Header: map[string]string{"X-Test-Gate": gate}}
	done := make(chan struct{})
	go func() {
		defer close(done)
		// The reload may close the connection: the request runs on.
		_, _ = s.DoCtx(context.Background(), c)
	}()
	up.WaitStarted(t, 1)
	reloadSite(t, s, up.Addr(), block(after))
	up.Open(gate)
	<-done
	up.WaitEnded(t, 1)
	storetest.WaitFor(t, 5*time.Second, "the completion in the old table", func() bool {
		rows := pgtest.Query(t, dsn, `SELECT count(*) FROM `+pgtest.QuoteIdent(before)+` WHERE key = $1 AND status = 'completed'`, c.Key)
		return rows[0][0] == "1"
	})
	wantExecuted(t, s.Do(t, c), http.StatusCreated)
	wantCount(t, up, 2)
}

// A reload that changes the memory store's max_entries keeps its
// records: a completed key replays. Catches records pooled by
// max_entries (the reload started an empty store, and the key executed
// again).
func TestMemoryReloadWithOtherMaxEntriesKeepsRecords(t *testing.T) {
	up := newUpstream(t)
	port := freeTCPPort(t)
	logPath := t.TempDir() + "/caddy.log"
	cfg := func(maxEntries int) []byte {
		js, _, err := adaptCaddyfile(globalOptions(logPath, "") + fmt.Sprintf(`http://127.0.0.1:%d {
	idempotency {
		store memory {
			max_entries %d
		}
	}
	reverse_proxy %s
}
`, port, maxEntries, up.Addr()))
		if err != nil {
			t.Fatal(err)
		}
		return js
	}
	srv := startCaddyJSON(t, cfg(1000), logPath)
	s := newSiteClient(t, srv, port)
	c := call{Key: newKey(), Body: payBody()}
	first := s.Do(t, c)
	wantExecuted(t, first, 201)
	if err := caddy.Load(cfg(2000), true); err != nil { // caddyMu is held by this test
		t.Fatalf("reload: %v", err)
	}
	s.reloaded(t)
	wantReplayOf(t, s.Do(t, c), first)
	wantCount(t, up, 1)
}
