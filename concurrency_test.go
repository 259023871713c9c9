package idempotency

// Concurrent and retried requests for one key: one executes, the others
// wait with Retry-After, and a lock whose owner died is taken over once.

import (
	"bytes"
	"context"
	"net/http"
	"sync"
	"testing"
	"time"

	"github.com/caddy-idempotency/idempotency/internal/pgtest"
)

func TestConcurrentSameKeyExecutesOnce(t *testing.T) {
	eachStore(t, func(t *testing.T, sb storeBackend) {
		up := newUpstream(t)
		s := protectedSite(t, sb, up.Addr())
		const n = 25
		c := call{Key: newKey(), Body: payBody(), Header: sleepFor(300 * time.Millisecond)}
		replies := make([]reply, n)
		errs := make([]error, n)
		start := make(chan struct{})
		var wg sync.WaitGroup
		for i := range n {
			wg.Add(1)
			go func() {
				defer wg.Done()
				<-start
				replies[i], errs[i] = s.DoCtx(context.Background(), c)
			}()
		}
		close(start)
		wg.Wait()

		var okBody []byte
		executed, replayed, inProgress := 0, 0, 0
		for i, r := range replies {
			if errs[i] != nil {
				t.Fatalf("request %d: %v", i, errs[i])
			}
			switch {
			case r.Status == http.StatusCreated:
				if r.replayed() {
					replayed++
				} else {
					executed++
				}
				if okBody == nil {
					okBody = r.Body
				} else if !bytes.Equal(r.Body, okBody) {
					t.Errorf("2xx bodies differ: %q vs %q", r.Body, okBody)
				}
			case r.Status == http.StatusConflict:
				inProgress++
				wantProblem(t, r, http.StatusConflict)
				wantRetryAfter(t, r)
			default:
				t.Errorf("request %d: unexpected reply %s", i, r)
			}
		}
		t.Logf("executed %d, replayed %d, in progress %d", executed, replayed, inProgress)
		if executed != 1 {
			t.Errorf("%d callers got a fresh execution, want exactly 1", executed)
		}
		wantCount(t, up, 1)
		last := s.Do(t, call{Key: c.Key, Body: c.Body})
		if !last.replayed() || !bytes.Equal(last.Body, okBody) {
			t.Errorf("after the race, a retry must replay the one execution: %s", last)
		}
	})
}

func TestInProgressConflictHasRetryAfter(t *testing.T) {
	eachStore(t, func(t *testing.T, sb storeBackend) {
		for _, tc := range []struct {
			name      string
			directive string
			want      string
		}{
			{"default 2s", "", "2"},
			{"retry_after 5s", "retry_after 5s", "5"},
		} {
			t.Run(tc.name, func(t *testing.T) {
				up := newUpstream(t)
				s := protectedSite(t, sb, up.Addr(), tc.directive)
				c := call{Key: newKey(), Body: payBody(), Header: sleepFor(700 * time.Millisecond)}
				firstCh := runBackground(t, s, c)
				up.WaitStarted(t, 1)

				second := s.Do(t, call{Key: c.Key, Body: c.Body})
				wantProblem(t, second, http.StatusConflict)
				if got := second.Header.Get("Retry-After"); got != tc.want {
					t.Errorf("Retry-After = %q, want %q", got, tc.want)
				}

				first := <-firstCh
				wantExecuted(t, first, http.StatusCreated)
				wantReplayOf(t, s.Do(t, call{Key: c.Key, Body: c.Body}), first)
				wantCount(t, up, 1)
			})
		}
	})
}

// An owner that died leaves an in_progress record whose lock goes stale;
// of many concurrent retries exactly one takes it over (a compare-and-swap)
// and executes. Postgres only: a dead owner is simulated by writing the
// record as a crashed instance would leave it, which the memory store
// cannot be made to hold from outside (memory_test.go covers its takeover).
// Catches a takeover by read-then-write, which lets several retriers in.
func TestStaleLockIsTakenOverByOneRetrier(t *testing.T) {
	sb := postgresBackend(t)
	up := newUpstream(t)
	// The record is turned back into a dead owner's behind the handler's
	// back; its replay cache would still replay the completed one. The
	// lock_timeout outlasts the takeover's execution (300ms), so that
	// the new owner needs no renewal: on a loaded machine, a renewal due
	// 100ms into a 300ms lock could land too late and let a second
	// retrier take over, which is the lease's documented limit, not what
	// this test is about.
	s := protectedSite(t, sb, up.Addr(), "lock_timeout 1s", "replay_cache off")
	c := call{Key: newKey(), Body: payBody()}
	dead := s.Do(t, c) // a real record, with the real fingerprint
	wantExecuted(t, dead, http.StatusCreated)
	sb.waitCompleted(t, c.Key)
	n := pgtest.Exec(t, sb.DSN, `UPDATE `+pgtest.QuoteIdent(sb.Table)+` SET status = 'in_progress',
		lock_token = $1, locked_at = now() - interval '1 hour',
		response_status = NULL, response_headers = NULL, response_body = NULL,
		replayable = NULL, response_size = NULL
		WHERE key = $2`, bytes.Repeat([]byte{0xde}, 16), c.Key)
	primaryLongUp(t, sb.DSN, sb.Table)
	if n != 1 {
		t.Fatalf("updated %d rows, want 1", n)
	}

	const retriers = 10
	replies := make([]reply, retriers)
	var wg sync.WaitGroup
	start := make(chan struct{})
	for i := range retriers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			<-start
			replies[i] = s.Do(t, call{Key: c.Key, Body: c.Body, Header: sleepFor(300 * time.Millisecond)})
		}()
	}
	close(start)
	wg.Wait()

	var owner reply
	takeovers := 0
	for _, r := range replies {
		switch {
		case r.Status == http.StatusCreated && !r.replayed():
			takeovers++
			owner = r
		case r.Status == http.StatusConflict:
			wantRetryAfter(t, r)
		case r.Status == http.StatusCreated && r.replayed():
		default:
			t.Errorf("unexpected reply %s", r)
		}
	}
	if takeovers != 1 {
		t.Fatalf("%d retriers executed, want exactly 1", takeovers)
	}
	for _, r := range replies {
		if r.replayed() && !bytes.Equal(r.Body, owner.Body) {
			t.Errorf("a replay differs from the takeover's response")
		}
	}
	wantCount(t, up, 2)
	wantReplayOf(t, s.Do(t, c), owner)
	rows := pgtest.Query(t, sb.DSN, `SELECT status, lock_token IS NULL FROM `+pgtest.QuoteIdent(sb.Table))
	if len(rows) != 1 || rows[0][0] != "completed" || rows[0][1] != "true" {
		t.Errorf("after the takeover the row is %v, want one completed row without a lock", rows)
	}
}

// A live owner renews its lock: a retry sent after lock_timeout, while the
// first request still runs, is not a takeover. Catches a lock that is only
// taken at the start and never renewed.
func TestSlowRequestIsNotTakenOver(t *testing.T) {
	eachStore(t, func(t *testing.T, sb storeBackend) {
		up := newUpstream(t)
		// A 1s lock rather than a shorter one: on a loaded 2-core machine a
		// renewal can wait longer than a 300ms lock's margin for a pool
		// connection (docs/guarantees.md), which is not what this test is about.
		s := protectedSite(t, sb, up.Addr(), "lock_timeout 1s")
		// 1.5s past the last retry, for the retry to be answered while
		// the first request still runs on a loaded machine.
		c := call{Key: newKey(), Body: payBody(), Header: sleepFor(4500 * time.Millisecond)}
		firstCh := runBackground(t, s, c)
		up.WaitStarted(t, 1)
		start := time.Now()
		for _, at := range []time.Duration{1300 * time.Millisecond, 2000 * time.Millisecond, 3000 * time.Millisecond} {
			time.Sleep(time.Until(start.Add(at)))
			r := s.Do(t, call{Key: c.Key, Body: c.Body})
			if r.Status != http.StatusConflict {
				t.Errorf("retry at %v past lock_timeout: got %s, want 409 in progress", at, r)
				continue
			}
			wantRetryAfter(t, r)
		}
		first := <-firstCh
		wantExecuted(t, first, http.StatusCreated)
		wantReplayOf(t, s.Do(t, call{Key: c.Key, Body: c.Body}), first)
		wantCount(t, up, 1)
	})
}
