package idempotency

import (
	"context"
	"fmt"
	"net/http"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/caddy-idempotency/idempotency/internal/pgtest"
	"github.com/caddy-idempotency/idempotency/store"
	"github.com/caddy-idempotency/idempotency/store/storetest"
	"github.com/caddy-idempotency/idempotency/stores/memory"
	"github.com/caddy-idempotency/idempotency/stores/postgres"
	"go.uber.org/zap"
)

// Retries of many keys hammer their records from just before they expire
// until just after, from two instances of a shared store: one retry per
// key executes again, and none of the others is given the expired
// answer, not even one that races that re-execution. The race is at the
// expiry itself: in Postgres, an acquire whose snapshot saw the expired
// record waited for another's takeover of it, claimed nothing, and went
// back to its snapshot's record.
func TestStoreNeverAnswersAnExpiredRecord(t *testing.T) {
	t.Run("memory", func(t *testing.T) {
		t.Parallel()
		s := memory.New(1000, time.Now)
		testNeverAnswersExpired(t, []store.Store{s, s})
	})
	t.Run("postgres", func(t *testing.T) {
		t.Parallel()
		table := pgtest.FreshTable(t)
		a, b := newTestPostgresStore(t, table, 6), newTestPostgresStore(t, table, 7)
		testNeverAnswersExpired(t, []store.Store{a, b})
	})
}

func testNeverAnswersExpired(t *testing.T, stores []store.Store) {
	const (
		keys    = 40
		retries = 4 // per key and instance
	)
	ctx := context.Background()
	reqs := make([]store.AcquireRequest, keys)
	expiries := make([]time.Time, keys)
	for i := range reqs {
		req := storetest.Request("cred", fmt.Sprintf("expiry-key-%03d", i), "body")
		// The lease outlasts any stall of a loaded machine between a
		// re-execution's acquire and its completion: a takeover of a
		// lease that ran out would be a second execution this test
		// does not count on.
		req.LockTimeout, req.Retention = 30*time.Second, 600*time.Millisecond
		if res, err := stores[0].Acquire(ctx, req); err != nil || res.Outcome != store.OutcomeCreated {
			t.Fatalf("acquire: %+v, %v", res, err)
		}
		// Timed from before the completion is sent: the record expires
		// no earlier.
		expiries[i] = time.Now().Add(req.Retention)
		if err := stores[0].Complete(ctx, req.Key, req.Token, &store.Response{Status: 201, Replayable: true}, req.Retention); err != nil {
			t.Fatalf("complete: %v", err)
		}
		reqs[i] = req
	}
	var (
		wg       sync.WaitGroup
		answered atomic.Int64
		expired  atomic.Int64
		executed atomic.Int64
	)
	for i, req := range reqs {
		expiry := expiries[i]
		// reexecuted is when a retry of the key was first told to
		// execute: a retry sent after that must not replay the record
		// that expired.
		var reexecuted atomic.Pointer[time.Time]
		for _, s := range stores {
			for range retries {
				wg.Go(func() {
					time.Sleep(time.Until(expiry.Add(-100 * time.Millisecond)))
					// On through a while after the expiry and, on a loaded
					// machine that started the retries late, until one of
					// them has executed the key again.
					end, giveUp := expiry.Add(300*time.Millisecond), expiry.Add(15*time.Second)
					for time.Now().Before(end) || reexecuted.Load() == nil && time.Now().Before(giveUp) {
						retry := storetest.Retry(req)
						sent := time.Now()
						res, err := s.Acquire(ctx, retry)
						if err != nil {
							t.Errorf("acquire: %v", err)
							return
						}
						answered.Add(1)
						switch res.Outcome {
						case store.OutcomeCreated, store.OutcomeTakenOver:
							executed.Add(1)
							now := time.Now()
							reexecuted.CompareAndSwap(nil, &now)
							// The new answer, which its retries may
							// replay.
							if err := s.Complete(ctx, retry.Key, retry.Token, &store.Response{Status: 202, Replayable: true}, retry.Retention); err != nil {
								t.Errorf("complete: %v", err)
							}
							return
						case store.OutcomeExisting:
							rec := res.Record
							if rec.Status != store.StatusCompleted || rec.Response.Status != 201 {
								continue
							}
							if first := reexecuted.Load(); rec.TTL <= 0 || first != nil && sent.After(*first) {
								if expired.Add(1) <= 5 {
									t.Logf("%s: the expired record (ttl %v), sent %v after expiry", req.Key.Key, rec.TTL, sent.Sub(expiry))
								}
							}
						}
					}
				})
			}
		}
	}
	wg.Wait()
	if n := expired.Load(); n > 0 {
		t.Errorf("%d of %d answers were the expired record", n, answered.Load())
	}
	if n := executed.Load(); n != keys {
		t.Errorf("%d re-executions of %d expired keys, want one each", n, keys)
	}
}

// staleStore answers every live record as it was a moment after its
// expiry, as a store that lost the race above would.
type staleStore struct{ store.Store }

func (s staleStore) Acquire(ctx context.Context, req store.AcquireRequest) (store.AcquireResult, error) {
	res, err := s.Store.Acquire(ctx, req)
	if res.Record != nil {
		res.Record.TTL = -time.Millisecond
	}
	return res, err
}

// Whatever the store answers, the handler never replays an expired
// record: the retry gets the in-progress answer, and executes nothing.
func TestHandlerNeverReplaysAnExpiredRecord(t *testing.T) {
	h, _, logs := lockHandler(t, 30*time.Second)
	var calls atomic.Int32
	if got := serve(context.Background(), h, "replay-expired", created(&calls)); got != http.StatusCreated {
		t.Fatalf("first request: %d", got)
	}
	h.store = staleStore{h.store}
	if got := serve(context.Background(), h, "replay-expired", created(&calls)); got != http.StatusConflict || calls.Load() != 1 {
		t.Errorf("retry of the expired record: status %d after %d executions, want 409 after 1", got, calls.Load())
	}
	if n := logs.FilterMessage("idempotency.replay").Len(); n != 0 {
		t.Errorf("%d replays logged", n)
	}
}

// Shadow mode takes an expired record for one in progress, as
// enforcement does: it logs would=in_progress, never a replay. Catches
// shadow mode deciding without enforcement's expiry check.
func TestShadowNeverReplaysAnExpiredRecord(t *testing.T) {
	h, _, logs := lockHandler(t, 30*time.Second)
	h.Shadow = true
	var calls atomic.Int32
	if status, result := serveResult(context.Background(), h, "shadow-replay-expired", created(&calls)); status != http.StatusCreated || result != "shadow_executed" {
		t.Fatalf("first request: %d, %q", status, result)
	}
	h.store = staleStore{h.store}
	status, result := serveResult(context.Background(), h, "shadow-replay-expired", created(&calls))
	if status != http.StatusCreated || calls.Load() != 2 || result != "shadow_in_progress" {
		t.Errorf("retry of the expired record: status %d, result %q after %d executions, want 201, shadow_in_progress after 2", status, result, calls.Load())
	}
	if n := logs.FilterMessage("idempotency.shadow").FilterField(zap.String("would", resultInProgress)).Len(); n != 1 {
		t.Errorf("%d idempotency.shadow lines with would=in_progress, want 1: %v", n, logs.All())
	}
}

// A completion whose reply is lost is repeated, and the repeat finds the
// record completed by the first attempt. The replay cache must not keep
// the response past the record's expiry, which the first attempt's
// commit set: once the database has expired the record, a retry through
// the cache executes again instead of getting the expired answer.
func TestReplayCacheEndsWithItsRecordAfterALostCompletionReply(t *testing.T) {
	t.Parallel()
	dsn := pgtest.DSN(t)
	f := pgtest.NewForwarder(t, pgtest.Addr(t, dsn))
	table := pgtest.FreshTable(t)
	// One connection, on which a first completion prepares the
	// statement: a muted connection cannot prepare, only execute.
	s := provisionTestStore(t, &postgres.Store{DSN: pgtest.ThroughForwarder(t, dsn, f), Table: table, MaxConns: 1})
	c := newReplayCache(s, 1<<20)
	prime := storetest.Request("cred", "prepares-the-statement", "body")
	storetest.MustAcquire(t, c, prime, store.OutcomeCreated)
	if err := c.Complete(context.Background(), prime.Key, prime.Token, &store.Response{Status: 201, Replayable: true}, prime.Retention); err != nil {
		t.Fatal(err)
	}
	req := storetest.Request("cred", "lost-completion-reply", "body")
	req.LockTimeout, req.Retention = 2*time.Second, 3*time.Second
	storetest.MustAcquire(t, c, req, store.OutcomeCreated)

	ctx, db, done := pgtest.Open(t, dsn)
	defer done()
	query := func(sql string) (v bool) {
		t.Helper()
		if err := db.QueryRow(ctx, sql, req.Key.Key).Scan(&v); err != nil {
			t.Fatalf("%s: %v", sql, err)
		}
		return v
	}
	completed := "SELECT status = 'completed' FROM " + table + " WHERE key = $1"

	// The first attempt commits; its reply never comes back.
	f.Mute()
	attempt, cancel := context.WithTimeout(context.Background(), time.Second)
	resp := &store.Response{Status: 201, Body: []byte("the first answer"), Replayable: true}
	err := c.Complete(attempt, req.Key, req.Token, resp, req.Retention)
	cancel()
	f.Unmute()
	if err == nil {
		t.Fatal("the first completion succeeded with its reply lost")
	}
	if !query(completed) {
		t.Fatal("the first completion did not commit")
	}
	// The handler tries again: the second attempt finds it done.
	if err := c.Complete(context.Background(), req.Key, req.Token, resp, req.Retention); err != nil {
		t.Fatalf("second completion: %v", err)
	}

	storetest.WaitFor(t, 2*req.Retention, "the record to expire", func() bool {
		return query("SELECT expires_at <= now() FROM " + table + " WHERE key = $1")
	})
	// The database dates the record by its wall clock, the cache by this
	// process's monotonic one: a wall clock stepped forward meanwhile (a
	// virtual machine's, adjusted) ends the record that much earlier by
	// the first. A step of 7 ms failed this test once; the cache must end
	// with the record, within such steps.
	time.Sleep(100 * time.Millisecond)
	res, err := c.Acquire(context.Background(), storetest.Retry(req))
	if err != nil {
		t.Fatal(err)
	}
	if res.Outcome != store.OutcomeCreated {
		t.Errorf("retry after the record expired: outcome %d, record %+v; want it to execute again", res.Outcome, res.Record)
	}
}

// Catches a store that ignores expires_at on acquire.
func TestExpiredRecordExecutesAnew(t *testing.T) {
	eachStore(t, func(t *testing.T, sb storeBackend) {
		up := newUpstream(t)
		s := protectedSite(t, sb, up.Addr(), "retention 2s", "lock_timeout 1s", "prune_interval 0")
		c := call{Key: newKey(), Body: payBody()}
		first := s.Do(t, c)
		wantExecuted(t, first, http.StatusCreated)
		wantReplayOf(t, s.Do(t, c), first)
		time.Sleep(2200 * time.Millisecond)
		second := s.Do(t, c)
		wantExecuted(t, second, http.StatusCreated)
		if second.Header.Get("X-Execution-Id") == first.Header.Get("X-Execution-Id") {
			t.Errorf("an expired record was replayed")
		}
		wantReplayOf(t, s.Do(t, c), second)
		// An expired record is absent: another body under the old key is no conflict.
		time.Sleep(2200 * time.Millisecond)
		wantExecuted(t, s.Do(t, call{Key: c.Key, Body: payBody()}), http.StatusCreated)
		wantCount(t, up, 3)
	})
}

// Pruning deletes expired rows and only those. Postgres only: the memory
// store's sweep is not observable from outside (memory_test.go covers it).
func TestPruneDeletesExpiredRows(t *testing.T) {
	t.Run("prune_interval 0 disables pruning", func(t *testing.T) {
		// Catches a pruner that treats 0 as "always" (a zero ticker, a busy loop).
		sb := postgresBackend(t)
		up := newUpstream(t)
		s := protectedSite(t, sb, up.Addr(), "retention 2s", "lock_timeout 1s", "prune_interval 0")
		wantExecuted(t, s.Do(t, call{Key: newKey(), Body: payBody()}), http.StatusCreated)
		time.Sleep(2500 * time.Millisecond)
		if n := pgCount(t, sb); n != 1 {
			t.Errorf("%d rows with pruning disabled, want the 1 expired row kept", n)
		}
	})
	sb := postgresBackend(t)
	up := newUpstream(t)
	s := protectedSite(t, sb, up.Addr(), "retention 2s", "lock_timeout 1s", "prune_interval 1s")
	for range 3 {
		wantExecuted(t, s.Do(t, call{Key: newKey(), Body: payBody()}), http.StatusCreated)
	}
	if n := pgCount(t, sb); n != 3 {
		t.Fatalf("%d rows after 3 requests, want 3", n)
	}
	late := call{Key: newKey(), Body: payBody()}
	lateReply := s.Do(t, late)
	sb.waitCompleted(t, late.Key)
	// The live row lives on however slow the machine is, until the
	// pruner has taken the others.
	if n := pgtest.Exec(t, sb.DSN, "UPDATE "+pgtest.QuoteIdent(sb.Table)+" SET expires_at = now() + interval '1 hour' WHERE key = $1", late.Key); n != 1 {
		t.Fatalf("%d rows of the live key, want 1", n)
	}
	storetest.WaitFor(t, 10*time.Second, "expired rows to be pruned", func() bool { return pgCount(t, sb) <= 1 })
	if n := pgCount(t, sb); n != 1 {
		t.Fatalf("%d rows after pruning, want the 1 live row", n)
	}
	wantReplayOf(t, s.Do(t, late), lateReply)
}
