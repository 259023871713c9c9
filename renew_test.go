package idempotency

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/caddy-idempotency/idempotency/internal/pgtest"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
)

// The locks of the requests in flight are renewed together: with 24
// requests held past their lock_timeout, the handler sends one renewal
// statement per tick for all of them, not one per request per interval.
// Catches a renewal per lock (each request's own timer), which sent 120
// statements here, and a tick that renews nothing: each request's lock
// would go stale, and its record be taken over, before it completes.
func TestRenewalsShareOneStatementPerTick(t *testing.T) {
	dsn := pgtest.DSN(t)
	table := pgtest.FreshTable(t)
	statementCounter.Watch(t, table)
	up := newUpstream(t)
	port := freeTCPPort(t)
	s := siteFromCaddyfile(t, port, fmt.Sprintf(`http://127.0.0.1:%d {
	idempotency {
		store postgres {
			dsn %q
			table %s
		}
		lock_timeout 1s
		prune_interval 0
	}
	reverse_proxy %s
}`, port, dsn, table, up.Addr()))

	const requests = 24
	const hold = 2200 * time.Millisecond // over two lock timeouts
	var wg sync.WaitGroup
	for i := range requests {
		wg.Go(func() {
			r, err := s.DoCtx(t.Context(), call{Key: fmt.Sprintf("held-key-%02d", i),
				Header: map[string]string{"X-Test-Sleep": hold.String()}})
			if err != nil {
				t.Errorf("request %d: %v", i, err)
				return
			}
			if r.Status != http.StatusCreated {
				t.Errorf("request %d: %s", i, r)
			}
		})
	}
	wg.Wait()

	executed := make(map[string]int)
	for _, e := range up.Executions() {
		executed[e.Key]++
	}
	for i := range requests {
		if k := fmt.Sprintf("held-key-%02d", i); executed[k] != 1 {
			t.Errorf("%s executed %d times", k, executed[k])
		}
	}
	statements, _ := statementCounter.Take(table)
	renewals := 0
	for _, st := range statements {
		if st == "renew" {
			renewals++
		}
	}
	// A tick every half interval (167ms) over the 2.2s: at most 14, and
	// the first comes half an interval after the locks are taken.
	t.Logf("%d renewal statements for %d requests held %v", renewals, requests, hold)
	if renewals == 0 || renewals > 16 {
		t.Errorf("%d renewal statements, want one per tick (at most 16)", renewals)
	}
	for _, line := range s.moduleLogLines(t) {
		if line["msg"] == "idempotency.lock_lost" || line["msg"] == "idempotency.takeover" {
			t.Errorf("log: %v", line)
		}
	}
}

// A renewal stuck in the store (a dead connection, a lock wait) holds up
// neither the renewals after it nor its own lock's: the next ticks send
// them again beside it. Catches ticks that wait for the renewal they
// sent: the lease ran out while the first renewal hung, and a retry took
// the record over and executed the request a second time.
func TestStuckRenewalDoesNotStopRenewals(t *testing.T) {
	h, s, logs := lockHandler(t, time.Second)
	stuck := make(chan struct{})
	t.Cleanup(func() { close(stuck) })
	var renewals atomic.Int32
	s.beforeRenew = func() error {
		if renewals.Add(1) == 1 {
			<-stuck
			return errors.New("connection reset")
		}
		return nil
	}
	var calls atomic.Int32
	// The owner executes until the retry has its answer, however long
	// the retry takes on a loaded machine; a retry that executes does
	// not wait.
	retried := make(chan struct{})
	next := caddyhttp.HandlerFunc(func(w http.ResponseWriter, r *http.Request) error {
		<-retried
		return created(&calls).ServeHTTP(w, r)
	})
	var wg sync.WaitGroup
	wg.Go(func() {
		if got := serve(context.Background(), h, "stuck-renewal", next); got != http.StatusCreated {
			t.Errorf("owner: status %d", got)
		}
	})
	time.Sleep(1300 * time.Millisecond) // past the lease, had nothing renewed it
	if got := serve(context.Background(), h, "stuck-renewal", created(&calls)); got != http.StatusConflict {
		t.Errorf("retry during the execution: status %d, want 409", got)
	}
	close(retried)
	wg.Wait()
	if n := calls.Load(); n != 1 {
		t.Errorf("executed %d times", n)
	}
	if n := logs.FilterMessage("idempotency.takeover").Len(); n != 0 {
		t.Errorf("%d takeovers", n)
	}
}
