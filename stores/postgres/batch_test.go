package postgres

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"net/http"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/caddy-idempotency/idempotency/internal/pgtest"
	"github.com/caddy-idempotency/idempotency/store"
	"github.com/caddy-idempotency/idempotency/store/storetest"
	"github.com/jackc/pgx/v5/pgconn"
)

// sendAcquireBatch runs reqs as one batch, one statement, and returns the
// calls in the order of reqs.
func sendAcquireBatch(s *Store, reqs ...store.AcquireRequest) []*batchCall[queuedAcquire, store.AcquireResult] {
	calls := make([]*batchCall[queuedAcquire, store.AcquireResult], len(reqs))
	for i, r := range reqs {
		calls[i] = &batchCall[queuedAcquire, store.AcquireResult]{ctx: context.Background(), req: queuedAcquire{AcquireRequest: r}, done: make(chan struct{})}
	}
	s.acquires.sendBatch(slices.Clone(calls))
	return calls
}

// One statement acquires rows in every state, and each request gets the
// outcome it would have got alone.
func TestPostgresBatchedAcquireGivesEachRowItsOutcome(t *testing.T) {
	t.Parallel()
	s := newTestStore(t, pgtest.FreshTable(t), 2)
	ctx := context.Background()

	fresh := storetest.Request("cred", "new", "body")
	done := storetest.Request("cred", "done", "body")
	storetest.MustAcquire(t, s, done, store.OutcomeCreated)
	if err := s.Complete(ctx, done.Key, done.Token, &store.Response{Status: 201, Body: []byte("ok"), Replayable: true, BodySize: 2}, done.Retention); err != nil {
		t.Fatal(err)
	}
	busy := storetest.Request("cred", "busy", "body")
	storetest.MustAcquire(t, s, busy, store.OutcomeCreated)
	mine := storetest.Request("cred", "mine", "body")
	storetest.MustAcquire(t, s, mine, store.OutcomeCreated)
	stale := storetest.Request("cred", "stale", "body")
	storetest.MustAcquire(t, s, stale, store.OutcomeCreated)
	staleOther := storetest.Request("cred", "stale-other", "body")
	storetest.MustAcquire(t, s, staleOther, store.OutcomeCreated)
	expired := storetest.Request("cred", "expired", "body")
	storetest.MustAcquire(t, s, expired, store.OutcomeCreated)
	if err := s.Complete(ctx, expired.Key, expired.Token, &store.Response{Status: 201, Replayable: true}, expired.Retention); err != nil {
		t.Fatal(err)
	}
	otherTenant := storetest.Request("another cred", "done", "body")
	mustExec(t, s, "UPDATE "+s.table.quoted()+` SET locked_at = now() - interval '1 hour', locked_until = now() - interval '1 hour' + interval '30 seconds'
WHERE key IN ('stale', 'stale-other')`)
	primaryLongUp(t, s.DSN, s.Table)
	mustExec(t, s, "UPDATE "+s.table.quoted()+` SET expires_at = now() - interval '1 second' WHERE key = 'expired'`)

	calls := sendAcquireBatch(s,
		fresh, storetest.Retry(done), storetest.Retry(busy), mine, storetest.Retry(stale),
		storetest.Request("cred", "stale-other", "another body"), storetest.Retry(expired), otherTenant)
	want := []struct {
		outcome store.Outcome
		status  store.Status
	}{
		{store.OutcomeCreated, ""}, {store.OutcomeExisting, store.StatusCompleted}, {store.OutcomeExisting, store.StatusInProgress},
		{store.OutcomeCreated, ""}, {store.OutcomeTakenOver, ""}, {store.OutcomeExisting, store.StatusInProgress},
		{store.OutcomeCreated, ""}, {store.OutcomeCreated, ""},
	}
	for i, c := range calls {
		if c.err != nil {
			t.Errorf("%s: %v", c.req.Key.Key, c.err)
			continue
		}
		if c.res.Outcome != want[i].outcome {
			t.Errorf("%s: outcome %d, want %d", c.req.Key.Key, c.res.Outcome, want[i].outcome)
			continue
		}
		if want[i].status == "" {
			if c.res.Record != nil {
				t.Errorf("%s: a record with outcome %d", c.req.Key.Key, c.res.Outcome)
			}
			continue
		}
		if c.res.Record == nil || c.res.Record.Status != want[i].status {
			t.Errorf("%s: record %+v, want status %s", c.req.Key.Key, c.res.Record, want[i].status)
		}
	}
	if r := calls[1].res.Record; r != nil && (r.Response == nil || string(r.Response.Body) != "ok" || r.TTL <= 0) {
		t.Errorf("completed record: %+v", r)
	}
	if r := calls[5].res.Record; r != nil && r.Fingerprint != staleOther.Fingerprint {
		t.Error("another request took a stale lock over")
	}
}

// Batches and single requests, in every exec mode: pgx is given the
// rows' columns as the store's own column types (params.go), which the
// modes that do not ask the server for the parameters' types find by
// registration, and a body kept empty stays apart from one not kept
// (NULL). Catches a column type that a mode cannot encode, and a nil
// body sent as ” or an empty one as NULL.
func TestPostgresBatchesInEveryExecMode(t *testing.T) {
	t.Parallel()
	table := pgtest.FreshTable(t)
	for _, mode := range execModes {
		t.Run(mode, func(t *testing.T) {
			s := newTestPostgresStoreInMode(t, table, mode, 2)
			bodies := []struct {
				body       []byte
				replayable bool
			}{{[]byte("abc"), true}, {[]byte{}, true}, {nil, false}}
			for _, rows := range []int{1, len(bodies)} {
				var reqs []store.AcquireRequest
				for i := range rows {
					reqs = append(reqs, storetest.Request("cred", fmt.Sprintf("%s-%d-%d", mode, rows, i), "body"))
				}
				for _, c := range sendAcquireBatch(s, reqs...) {
					if c.err != nil || c.res.Outcome != store.OutcomeCreated {
						t.Fatalf("%d rows: acquire %s: %+v, %v", rows, c.req.Key.Key, c.res, c.err)
					}
				}
				var completes []*batchCall[ownedRequest, bool]
				for i, r := range reqs {
					resp := &store.Response{Status: 201 + i, Header: http.Header{"X-Row": {fmt.Sprint(i)}},
						Body: bodies[i].body, Replayable: bodies[i].replayable, BodySize: int64(len(bodies[i].body))}
					completes = append(completes, &batchCall[ownedRequest, bool]{ctx: context.Background(), done: make(chan struct{}),
						req: ownedRequest{key: r.Key, token: r.Token, resp: &completion{status: int32(resp.Status),
							headers: store.EncodeResponseHeaders(resp), body: resp.Body, replayable: resp.Replayable,
							size: resp.BodySize, retention: time.Hour}}})
				}
				s.completes.sendBatch(slices.Clone(completes))
				for _, c := range completes {
					if c.err != nil || !c.res {
						t.Fatalf("%d rows: complete %s: %v, %v", rows, c.req.key.Key, c.res, c.err)
					}
				}
				for i, c := range sendAcquireBatch(s, reqs...) {
					rec := c.res.Record
					if c.err != nil || rec == nil || rec.Response == nil {
						t.Fatalf("%d rows: replay %s: %+v, %v", rows, c.req.Key.Key, c.res, c.err)
					}
					got, want := rec.Response, bodies[i]
					if got.Status != 201+i || got.Header.Get("X-Row") != fmt.Sprint(i) || got.Replayable != want.replayable ||
						!bytes.Equal(got.Body, want.body) || (got.Body == nil) != (want.body == nil) {
						t.Errorf("%d rows: replay %s: %+v, want body %q (nil %v)", rows, c.req.Key.Key, got, want.body, want.body == nil)
					}
				}
			}
		})
	}
}

// The owners' statements tell each row of a batch its own fate: a lost
// lock fails its row alone, and so does a response that the database
// refuses.
func TestPostgresBatchedCompleteGivesEachRowItsOutcome(t *testing.T) {
	t.Parallel()
	s := newTestStore(t, pgtest.FreshTable(t), 2)
	mustExec(t, s, "ALTER TABLE "+s.table.quoted()+" ADD CONSTRAINT small_bodies CHECK (octet_length(response_body) < 5)")
	var reqs []store.AcquireRequest
	for i := range 4 {
		r := storetest.Request("cred", fmt.Sprintf("key-%d", i), "body")
		storetest.MustAcquire(t, s, r, store.OutcomeCreated)
		reqs = append(reqs, r)
	}
	send := func(rs ...ownedRequest) []*batchCall[ownedRequest, bool] {
		calls := make([]*batchCall[ownedRequest, bool], len(rs))
		for i, r := range rs {
			calls[i] = &batchCall[ownedRequest, bool]{ctx: context.Background(), req: r, done: make(chan struct{})}
		}
		s.completes.sendBatch(slices.Clone(calls))
		return calls
	}
	completion := func(body string) *completion {
		return &completion{status: 201, body: []byte(body), replayable: true, size: int64(len(body)), retention: time.Hour}
	}
	calls := send(
		ownedRequest{key: reqs[0].Key, token: reqs[0].Token, resp: completion("ok")},
		ownedRequest{key: reqs[1].Key, token: store.NewLockToken(), resp: completion("ok")},
		ownedRequest{key: reqs[2].Key, token: reqs[2].Token, resp: completion("far too long")},
		ownedRequest{key: reqs[3].Key, token: reqs[3].Token, resp: completion("ok")},
	)
	for i, want := range []bool{true, false, false, true} {
		if c := calls[i]; c.res != want {
			t.Errorf("%s: changed %v (%v), want %v", c.req.key.Key, c.res, c.err, want)
		}
	}
	if !permanentError(calls[2].err) {
		t.Errorf("the refused response: %v, want the database's refusal", calls[2].err)
	}
	for _, i := range []int{0, 1, 3} {
		if calls[i].err != nil {
			t.Errorf("%s: %v", calls[i].req.key.Key, calls[i].err)
		}
	}
}

// Two requests for one key never share a statement: the later one waits
// for the next batch, while the other keys go with the first.
func TestBatcherDefersDuplicateKeys(t *testing.T) {
	release := make(chan struct{})
	var (
		mu      sync.Mutex
		batches [][]string
	)
	b := &batcher[store.RecordKey, bool]{
		lanes: 1,
		key:   func(k store.RecordKey) store.RecordKey { return k },
		send: func(_ context.Context, calls []*batchCall[store.RecordKey, bool]) {
			var keys []string
			for _, c := range calls {
				keys = append(keys, c.req.Key)
				c.res = true
			}
			mu.Lock()
			batches = append(batches, keys)
			mu.Unlock()
			<-release
		},
	}
	key := func(k string) store.RecordKey { return store.RecordKey{Key: k} }
	var wg sync.WaitGroup
	do := func(k string) {
		wg.Go(func() {
			if ok, err := b.do(context.Background(), key(k)); !ok || err != nil {
				t.Errorf("%s: %v, %v", k, ok, err)
			}
		})
	}
	queued := func(n int) {
		storetest.WaitFor(t, 15*time.Second, fmt.Sprintf("%d queued", n), func() bool {
			b.mu.Lock()
			defer b.mu.Unlock()
			return len(b.queue) == n
		})
	}
	do("first")
	storetest.WaitFor(t, 15*time.Second, "the first batch", func() bool {
		mu.Lock()
		defer mu.Unlock()
		return len(batches) == 1
	})
	do("a")
	queued(1)
	do("a")
	queued(2)
	do("b")
	queued(3)
	close(release)
	wg.Wait()
	got := fmt.Sprint(batches)
	if got != "[[first] [a b] [a]]" {
		t.Errorf("batches %s, want [[first] [a b] [a]]", got)
	}
}

// stallBatcher is a batcher of two lanes that opens the second after
// stallAfter, whose statements each wait for the next value of release
// (closing it lets them all go), and the keys of each batch it sent.
type stallBatcher struct {
	*batcher[store.RecordKey, bool]
	release chan struct{}
	mu      sync.Mutex
	batches [][]string
	wg      sync.WaitGroup
}

func newStallBatcher(stallAfter time.Duration) *stallBatcher {
	sb := &stallBatcher{release: make(chan struct{})}
	sb.batcher = &batcher[store.RecordKey, bool]{
		lanes:      2,
		stallAfter: stallAfter,
		key:        func(k store.RecordKey) store.RecordKey { return k },
		send: func(_ context.Context, calls []*batchCall[store.RecordKey, bool]) {
			var keys []string
			for _, c := range calls {
				keys = append(keys, c.req.Key)
				c.res = true
			}
			sb.mu.Lock()
			sb.batches = append(sb.batches, keys)
			sb.mu.Unlock()
			<-sb.release
		},
	}
	return sb
}

func (sb *stallBatcher) do(t *testing.T, k string) {
	sb.wg.Go(func() {
		if ok, err := sb.batcher.do(context.Background(), store.RecordKey{Key: k}); !ok || err != nil {
			t.Errorf("%s: %v, %v", k, ok, err)
		}
	})
}

func (sb *stallBatcher) sent() string {
	sb.mu.Lock()
	defer sb.mu.Unlock()
	return fmt.Sprint(sb.batches)
}

func (sb *stallBatcher) waitSent(t *testing.T, want string) {
	t.Helper()
	storetest.WaitFor(t, 15*time.Second, "batches "+want, func() bool { return sb.sent() == want })
}

// While a statement of its kind is in flight, and makes progress, the
// requests that arrive queue for the next batch, all of them, rather
// than open a second lane each: two statements at a time sent batches of
// half the size, each a round trip more for Caddy's CPU. Catches a
// second lane opened by the second request to arrive.
func TestBatcherSendsOneLaneWithoutStall(t *testing.T) {
	sb := newStallBatcher(time.Hour)
	sb.do(t, "first")
	sb.waitSent(t, "[[first]]")
	for _, k := range []string{"a", "b", "c"} {
		sb.do(t, k)
	}
	storetest.WaitFor(t, 15*time.Second, "3 queued", func() bool {
		sb.mu.Lock()
		defer sb.mu.Unlock()
		sb.batcher.mu.Lock()
		defer sb.batcher.mu.Unlock()
		return len(sb.batcher.queue) == 3
	})
	close(sb.release)
	sb.wg.Wait()
	sb.mu.Lock()
	defer sb.mu.Unlock()
	if len(sb.batches) != 2 || !slices.Equal(slices.Sorted(slices.Values(sb.batches[1])), []string{"a", "b", "c"}) {
		t.Errorf("batches %v, want [[first] [a b c]] (the three in any order)", sb.batches)
	}
}

// A statement stuck (waiting for a row lock) does not stop its kind: once
// no batch has finished for stallAfter, the queued requests go on a
// second lane, and whichever lane finishes first closes, so none is left
// queued behind a lane that closed. Catches a batcher that waits for the
// stuck statement, and one whose second lane strands the requests that
// queue after it.
func TestBatcherOpensASecondLaneOnStall(t *testing.T) {
	sb := newStallBatcher(50 * time.Millisecond)
	sb.do(t, "stuck")
	sb.waitSent(t, "[[stuck]]")
	sb.do(t, "a")
	sb.waitSent(t, "[[stuck] [a]]")
	// Both statements are in flight: the next requests queue, and go
	// once a lane is free, whichever it is, in one batch or two (they
	// queue in either order).
	sb.do(t, "b")
	sb.do(t, "c")
	sb.release <- struct{}{}
	sb.release <- struct{}{}
	close(sb.release)
	sb.wg.Wait()
	sb.mu.Lock()
	rest := slices.Concat(sb.batches[2:]...)
	sb.mu.Unlock()
	slices.Sort(rest)
	if got := sb.sent(); !strings.HasPrefix(got, "[[stuck] [a] ") || !slices.Equal(rest, []string{"b", "c"}) {
		t.Errorf("batches %s, want [[stuck] [a]] then b and c", got)
	}
	sb.batcher.mu.Lock()
	defer sb.batcher.mu.Unlock()
	if sb.batcher.sending != 0 || len(sb.batcher.queue) != 0 {
		t.Errorf("%d lanes open, %d queued after every request returned", sb.batcher.sending, len(sb.batcher.queue))
	}
}

// A batch's statement runs until the last of its requests' deadlines,
// not the first: one request's short deadline must not fail the others'
// rows; and a request without a deadline bounds it by store.CallTimeout.
// Catches a statement given the first request's context, or one watched
// for nothing but its requests giving up.
func TestBatchStatementOutlivesTheShortestDeadline(t *testing.T) {
	got := make(chan time.Time, 4)
	b := &batcher[store.RecordKey, bool]{
		lanes: 1,
		key:   func(k store.RecordKey) store.RecordKey { return k },
		send: func(ctx context.Context, calls []*batchCall[store.RecordKey, bool]) {
			d, ok := ctx.Deadline()
			if !ok {
				t.Error("a statement without a deadline")
			}
			got <- d
			for _, c := range calls {
				c.res = true
			}
		},
	}
	// Both in one batch: the lane is taken by hand, and given back to
	// the next call once both queued.
	b.sending = 1
	long := time.Now().Add(time.Hour)
	shortCtx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	longCtx, cancel := context.WithDeadline(context.Background(), long)
	defer cancel()
	var wg sync.WaitGroup
	wg.Go(func() { _, _ = b.do(shortCtx, store.RecordKey{Key: "short"}) })
	wg.Go(func() { _, _ = b.do(longCtx, store.RecordKey{Key: "long"}) })
	storetest.WaitFor(t, 15*time.Second, "2 queued", func() bool {
		b.mu.Lock()
		defer b.mu.Unlock()
		return len(b.queue) == 2
	})
	b.mu.Lock()
	b.sending = 0
	b.mu.Unlock()
	if _, err := b.do(context.Background(), store.RecordKey{Key: "none"}); err != nil {
		t.Fatal(err)
	}
	wg.Wait()
	if d := <-got; !d.Equal(long) {
		t.Errorf("the statement's deadline is %v, want the last request's, %v", d, long)
	}
	start := time.Now()
	if _, err := b.do(context.Background(), store.RecordKey{Key: "alone"}); err != nil {
		t.Fatal(err)
	}
	if d := <-got; d.Before(start.Add(store.CallTimeout)) || d.After(time.Now().Add(store.CallTimeout)) {
		t.Errorf("a request without a deadline gave its statement %v, want store.CallTimeout from its sending", time.Until(d))
	}
}

// Two instances (two stores, two pools) send batches over the same keys
// at once. Every batch locks its rows in one order, the same on every
// instance, so no statement ever deadlocks; and the batches are real
// (fewer statements than requests).
func TestPostgresBatchesOfTwoInstancesNeverDeadlock(t *testing.T) {
	table := pgtest.FreshTable(t)
	statementCounter.Watch(t, table)
	stores := []*Store{newTestStore(t, table, 8), newTestStore(t, table, 9)}
	if stores[0].pool == stores[1].pool {
		t.Fatal("the two instances share a pool")
	}
	const (
		workers = 16
		keys    = 24
	)
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
	defer cancel()
	var (
		wg       sync.WaitGroup
		acquires atomic.Int64
		owned    atomic.Int64
	)
	fail := func(what string, err error) {
		var pgErr *pgconn.PgError
		if errors.As(err, &pgErr) && pgErr.Code == "40P01" {
			t.Errorf("%s: deadlock: %v", what, err)
			return
		}
		t.Errorf("%s: %v", what, err)
	}
	for _, s := range stores {
		for w := range workers {
			wg.Go(func() {
				rng := rand.New(rand.NewPCG(uint64(w), 1))
				for ctx.Err() == nil {
					req := storetest.Request("cred", fmt.Sprintf("key-%02d", rng.IntN(keys)), "body")
					req.LockTimeout, req.Retention = time.Second, time.Second+50*time.Millisecond
					res, err := s.Acquire(context.Background(), req)
					acquires.Add(1)
					if err != nil {
						fail("acquire", err)
						return
					}
					if res.Outcome == store.OutcomeExisting {
						continue
					}
					owned.Add(1)
					if err := s.Renew(context.Background(), req.Key, req.Token); err != nil && !errors.Is(err, store.ErrLockLost) {
						fail("renew", err)
						return
					}
					if rng.IntN(4) == 0 {
						err = s.Complete(context.Background(), req.Key, req.Token, &store.Response{Status: 201, Replayable: true}, req.Retention)
					} else {
						err = s.Release(context.Background(), req.Key, req.Token)
					}
					if err != nil && !errors.Is(err, store.ErrLockLost) {
						fail("complete or release", err)
						return
					}
				}
			})
		}
	}
	wg.Wait()
	statements, _ := statementCounter.Take(table)
	sent := 0
	for _, st := range statements {
		if st == "acquire" {
			sent++
		}
	}
	t.Logf("%d acquires (%d owned) in %d statements", acquires.Load(), owned.Load(), sent)
	if owned.Load() == 0 || int64(sent) >= acquires.Load() {
		t.Errorf("%d acquires (%d owned) in %d statements: no batches", acquires.Load(), owned.Load(), sent)
	}
}

// With follow, a call for a key that the batch already has rides on that
// key's call instead of waiting for a batch of its own; one that follow
// turns away goes in the next batch. Catches followers that are dropped,
// left waiting, or sent again as the lead's duplicate in one statement.
func TestBatcherFollowersRideOnTheLead(t *testing.T) {
	type req struct {
		key    string
		follow bool // whether follow gives this call the lead's outcome
	}
	release := make(chan struct{})
	var (
		mu      sync.Mutex
		batches [][]string
		sent    atomic.Int32
	)
	b := &batcher[req, int32]{
		lanes: 1,
		key:   func(r req) store.RecordKey { return store.RecordKey{Key: r.key} },
		send: func(_ context.Context, calls []*batchCall[req, int32]) {
			var keys []string
			for _, c := range calls {
				keys = append(keys, c.req.key)
				c.res = sent.Add(1)
			}
			mu.Lock()
			batches = append(batches, keys)
			mu.Unlock()
			<-release
		},
		follow: func(lead, c *batchCall[req, int32]) bool {
			if !c.req.follow {
				return false
			}
			c.res = lead.res
			return true
		},
	}
	var wg sync.WaitGroup
	results := make(map[string]int32)
	do := func(name string, r req) {
		wg.Go(func() {
			res, err := b.do(context.Background(), r)
			if err != nil {
				t.Errorf("%s: %v", name, err)
			}
			mu.Lock()
			results[name] = res
			mu.Unlock()
		})
	}
	queued := func(n int) {
		storetest.WaitFor(t, 15*time.Second, fmt.Sprintf("%d queued", n), func() bool {
			b.mu.Lock()
			defer b.mu.Unlock()
			return len(b.queue) == n
		})
	}
	do("first", req{key: "first"})
	storetest.WaitFor(t, 15*time.Second, "the first batch", func() bool {
		mu.Lock()
		defer mu.Unlock()
		return len(batches) == 1
	})
	do("a lead", req{key: "a"})
	queued(1)
	do("a follower", req{key: "a", follow: true})
	queued(2)
	do("a turned away", req{key: "a"})
	queued(3)
	do("b", req{key: "b"})
	queued(4)
	close(release)
	wg.Wait()
	if got := fmt.Sprint(batches); got != "[[first] [a b] [a]]" {
		t.Errorf("batches %s, want [[first] [a b] [a]]", got)
	}
	if results["a follower"] != results["a lead"] {
		t.Errorf("the follower got %d, its lead %d", results["a follower"], results["a lead"])
	}
	if results["a turned away"] == results["a lead"] {
		t.Errorf("the call turned away got its lead's outcome")
	}
}

// An acquire rides on another of its key only where the statement would
// have answered it the same. Catches sharing a record in progress with a
// request of another fingerprint (a stale lock that only it would take
// over), sharing with an acquire whose earlier attempt may own the record,
// and sharing a failure or a creation.
func TestFollowAcquire(t *testing.T) {
	fp := func(s string) (f [32]byte) { copy(f[:], s); return f }
	existing := func(status store.Status, fingerprint string) store.AcquireResult {
		return store.AcquireResult{Outcome: store.OutcomeExisting, Record: &store.Record{Status: status, Fingerprint: fp(fingerprint)}}
	}
	call := func(fingerprint string, mayHaveCommitted bool, res store.AcquireResult, err error) *batchCall[queuedAcquire, store.AcquireResult] {
		return &batchCall[queuedAcquire, store.AcquireResult]{
			req: queuedAcquire{AcquireRequest: store.AcquireRequest{Fingerprint: fp(fingerprint)}, mayHaveCommitted: mayHaveCommitted},
			res: res, err: err,
		}
	}
	for _, tc := range []struct {
		name   string
		lead   *batchCall[queuedAcquire, store.AcquireResult]
		follow *batchCall[queuedAcquire, store.AcquireResult]
		want   bool
	}{
		{"completed, same request", call("x", false, existing(store.StatusCompleted, "x"), nil), call("x", false, store.AcquireResult{}, nil), true},
		{"completed, another request", call("x", false, existing(store.StatusCompleted, "x"), nil), call("y", false, store.AcquireResult{}, nil), true},
		{"in progress, same request", call("x", false, existing(store.StatusInProgress, "x"), nil), call("x", false, store.AcquireResult{}, nil), true},
		{"in progress, another request", call("y", false, existing(store.StatusInProgress, "x"), nil), call("x", false, store.AcquireResult{}, nil), false},
		{"in progress, its own earlier attempt", call("x", false, existing(store.StatusInProgress, "x"), nil), call("x", true, store.AcquireResult{}, nil), false},
		{"created", call("x", false, store.AcquireResult{Outcome: store.OutcomeCreated}, nil), call("x", false, store.AcquireResult{}, nil), false},
		{"taken over", call("x", false, store.AcquireResult{Outcome: store.OutcomeTakenOver}, nil), call("x", false, store.AcquireResult{}, nil), false},
		{"failed", call("x", false, store.AcquireResult{}, errors.New("conn closed")), call("x", false, store.AcquireResult{}, nil), false},
	} {
		got := followAcquire(tc.lead, tc.follow)
		if got != tc.want {
			t.Errorf("%s: follows %v, want %v", tc.name, got, tc.want)
		}
		if got && (tc.follow.res.Outcome != store.OutcomeExisting || tc.follow.res.Record == tc.lead.res.Record ||
			tc.follow.res.Record.Status != tc.lead.res.Record.Status) {
			t.Errorf("%s: the follower got %+v, want a copy of the lead's record", tc.name, tc.follow.res)
		}
	}
}

// Many requests for one key at once (a client retrying in a loop while
// the first runs) share statements: they cost what a few requests cost,
// not one statement each, one after the other, in front of every other
// key's requests. Each still gets the record in progress.
func TestPostgresAcquiresOfOneKeyShareStatements(t *testing.T) {
	table := pgtest.FreshTable(t)
	statementCounter.Watch(t, table)
	s := newTestStore(t, table, 8)
	first := storetest.Request("cred", "flooded", "body")
	storetest.MustAcquire(t, s, first, store.OutcomeCreated)
	statementCounter.Take(table)
	const flood = 400
	var (
		wg    sync.WaitGroup
		start = make(chan struct{})
	)
	for range flood {
		wg.Go(func() {
			<-start
			res, err := s.Acquire(context.Background(), storetest.Retry(first))
			if err != nil || res.Outcome != store.OutcomeExisting || res.Record.Status != store.StatusInProgress {
				t.Errorf("acquire: %+v, %v; want the record in progress", res, err)
			}
		})
	}
	close(start)
	wg.Wait()
	statements, _ := statementCounter.Take(table)
	t.Logf("%d acquires of one key in %d statements", flood, len(statements))
	if len(statements) > flood/10 {
		t.Errorf("%d acquires of one key took %d statements: one each", flood, len(statements))
	}
}
