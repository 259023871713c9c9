package idempotency

import (
	"context"
	"fmt"
	"net/http"
	"sync"
	"sync/atomic"
	"testing"
	"time"
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
		s := &MemoryStore{records: newMemoryRecords(1000, time.Now)}
		testNeverAnswersExpired(t, []Store{s, s})
	})
	t.Run("postgres", func(t *testing.T) {
		t.Parallel()
		table := freshTable(t)
		a, b := newTestPostgresStore(t, table, 6), newTestPostgresStore(t, table, 7)
		testNeverAnswersExpired(t, []Store{a, b})
	})
}

func testNeverAnswersExpired(t *testing.T, stores []Store) {
	const (
		keys    = 40
		retries = 4 // per key and instance
	)
	ctx := context.Background()
	reqs := make([]AcquireRequest, keys)
	expiries := make([]time.Time, keys)
	for i := range reqs {
		req := testAcquireRequest("cred", fmt.Sprintf("expiry-key-%03d", i), "body")
		req.LockTimeout, req.Retention = 300*time.Millisecond, 600*time.Millisecond
		if res, err := stores[0].Acquire(ctx, req); err != nil || res.Outcome != OutcomeCreated {
			t.Fatalf("acquire: %+v, %v", res, err)
		}
		// Timed from before the completion is sent: the record expires
		// no earlier.
		expiries[i] = time.Now().Add(req.Retention)
		if err := stores[0].Complete(ctx, req.Key, req.Token, &Response{Status: 201, Replayable: true}, req.Retention); err != nil {
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
					for end := expiry.Add(300 * time.Millisecond); time.Now().Before(end); {
						retry := retryRequest(req)
						sent := time.Now()
						res, err := s.Acquire(ctx, retry)
						if err != nil {
							t.Errorf("acquire: %v", err)
							return
						}
						answered.Add(1)
						switch res.Outcome {
						case OutcomeCreated, OutcomeTakenOver:
							executed.Add(1)
							now := time.Now()
							reexecuted.CompareAndSwap(nil, &now)
							// The new answer, which its retries may
							// replay.
							if err := s.Complete(ctx, retry.Key, retry.Token, &Response{Status: 202, Replayable: true}, retry.Retention); err != nil {
								t.Errorf("complete: %v", err)
							}
							return
						case OutcomeExisting:
							rec := res.Record
							if rec.Status != StatusCompleted || rec.Response.Status != 201 {
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
type staleStore struct{ Store }

func (s staleStore) Acquire(ctx context.Context, req AcquireRequest) (AcquireResult, error) {
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
