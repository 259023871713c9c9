package idempotency

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/caddy-idempotency/idempotency/internal/errlog"
	"github.com/caddy-idempotency/idempotency/internal/pgtest"
	"github.com/caddy-idempotency/idempotency/store"
	"github.com/caddy-idempotency/idempotency/store/storetest"
	"github.com/caddy-idempotency/idempotency/stores/postgres"
	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"
)

// downStore is a store that, while down is set, fails every call as a
// database that refuses connections does.
type downStore struct {
	store.Store
	down atomic.Bool
}

func (s *downStore) fail(op string) error {
	if !s.down.Load() {
		return nil
	}
	return fmt.Errorf("postgres store: %s: %w", op, &net.OpError{Op: "dial", Net: "tcp", Err: syscall.ECONNREFUSED})
}

func (s *downStore) Acquire(ctx context.Context, req store.AcquireRequest) (store.AcquireResult, error) {
	if err := s.fail(store.OpAcquire); err != nil {
		return store.AcquireResult{}, err
	}
	return s.Store.Acquire(ctx, req)
}

func (s *downStore) Complete(ctx context.Context, key store.RecordKey, token store.LockToken, resp *store.Response, retention time.Duration) error {
	if err := s.fail(store.OpComplete); err != nil {
		return err
	}
	return s.Store.Complete(ctx, key, token, resp, retention)
}

func (s *downStore) Renew(ctx context.Context, key store.RecordKey, token store.LockToken) error {
	if err := s.fail(store.OpRenew); err != nil {
		return err
	}
	return s.Store.Renew(ctx, key, token)
}

func (s *downStore) Release(ctx context.Context, key store.RecordKey, token store.LockToken) error {
	if err := s.fail(store.OpRelease); err != nil {
		return err
	}
	return s.Store.Release(ctx, key, token)
}

// testClock is the storeLog's clock, which only the test moves.
type testClock struct{ d atomic.Int64 }

func (c *testClock) now() time.Duration       { return time.Duration(c.d.Load()) }
func (c *testClock) advance(by time.Duration) { c.d.Add(int64(by)) }

// outageHandler is a provisioned handler on a fresh memory store that
// downStore can take down, under the instrumentation that watches the
// store's calls, logging to an observer, with its storeLog on a clock
// that the test moves.
func outageHandler(t *testing.T) (*Handler, *downStore, *observer.ObservedLogs, *testClock) {
	t.Helper()
	h := &Handler{LockTimeout: caddy.Duration(3 * time.Second), PruneInterval: new(caddy.Duration), ReplayCache: new(int64)}
	if err := provisionHandler(t, h); err != nil {
		t.Fatal(err)
	}
	core, logs := observer.New(zap.InfoLevel)
	h.logger = zap.New(core)
	sealing := h.store.(sealingStore)
	inst := sealing.Store.(instrumentedStore)
	ds := &downStore{Store: inst.Store}
	inst.Store = ds
	sealing.Store = inst
	h.store = sealing
	clock := new(testClock)
	clock.advance(time.Hour)
	h.storeLog.now = clock.now
	return h, ds, logs, clock
}

// During an outage, many concurrent requests fail alike: each operation
// writes one store_error line a second at most, the first of the outage
// at once, and the count of the lines left out adds up to the failures.
// The outage itself is one warning as it begins and one line as the
// store answers again, which counts the requests it held (their
// completions retried) and says for how long. Catches a line per failed
// request (5,165 in a 20 s outage), and an outage that held requests
// without a word.
func TestStoreErrorLinesDuringOutage(t *testing.T) {
	h, ds, logs, clock := outageHandler(t)
	var executions atomic.Int32
	next := created(&executions)

	// Requests in flight as the store goes down: their upstreams answer
	// during the outage, and their completions wait for the store.
	const inFlight = 4
	var started sync.WaitGroup
	started.Add(inFlight)
	answer := make(chan struct{})
	slow := caddyhttp.HandlerFunc(func(w http.ResponseWriter, r *http.Request) error {
		started.Done()
		<-answer
		return next.ServeHTTP(w, r)
	})
	heldStatus := make(chan int, inFlight)
	for i := range inFlight {
		go func() { heldStatus <- serve(context.Background(), h, fmt.Sprintf("held-%d", i), slow) }()
	}
	started.Wait()
	ds.down.Store(true)

	// Two bursts of failing requests, 1.5 s apart on the log's clock.
	refused := 0
	burst := func(n int) {
		statuses := make(chan int, n)
		var wg sync.WaitGroup
		for i := range n {
			wg.Go(func() { statuses <- serve(context.Background(), h, fmt.Sprintf("down-%d-%d", refused, i), next) })
		}
		wg.Wait()
		close(statuses)
		for s := range statuses {
			if s != http.StatusServiceUnavailable {
				t.Errorf("a request during the outage got %d, want 503", s)
			}
			refused++
		}
	}
	burst(200)
	acquireLines := func() []observer.LoggedEntry {
		return logs.FilterMessage("idempotency.store_error").FilterField(zap.String("operation", store.OpAcquire)).All()
	}
	if n := len(acquireLines()); n != 1 {
		t.Fatalf("%d acquire store_error lines for 200 failures within a second, want 1", n)
	}
	clock.advance(1500 * time.Millisecond)
	burst(100)
	close(answer) // the held requests' completions fail, and are retried
	storetest.WaitFor(t, 10*time.Second, "the held completions to fail", func() bool { return h.storeLog.held.Load() == inFlight })
	clock.advance(1500 * time.Millisecond)
	ds.down.Store(false)
	for range inFlight {
		if s := <-heldStatus; s != http.StatusCreated {
			t.Errorf("a request held through the outage got %d, want its 201", s)
		}
	}
	if n := executions.Load(); n != inFlight {
		t.Errorf("%d executions, want the %d requests in flight only", n, inFlight)
	}

	lines := acquireLines()
	if len(lines) != 2 {
		t.Fatalf("%d acquire store_error lines over 1.5 s of failures, want 2: %v", len(lines), lines)
	}
	if _, ok := lines[0].ContextMap()["suppressed"]; ok {
		t.Errorf("the outage's first line counts lines left out: %v", lines[0].ContextMap())
	}
	accounted := int64(len(lines))
	for _, l := range lines {
		n, _ := l.ContextMap()["suppressed"].(int64)
		accounted += n
	}
	unavailable := logs.FilterMessage("idempotency.store_unavailable").All()
	recovered := logs.FilterMessage("idempotency.store_recovered").All()
	if len(unavailable) != 1 || len(recovered) != 1 {
		t.Fatalf("%d store_unavailable and %d store_recovered lines for one outage, want one each", len(unavailable), len(recovered))
	}
	if unavailable[0].Level != zapcore.WarnLevel || recovered[0].Level != zapcore.InfoLevel {
		t.Errorf("store_unavailable at %v, store_recovered at %v; want warn and info", unavailable[0].Level, recovered[0].Level)
	}
	rec := recovered[0].ContextMap()
	if rec["held"] != int64(inFlight) {
		t.Errorf("the store answered again after holding %v requests, want %d: %v", rec["held"], inFlight, rec)
	}
	if rec["down_seconds"] != 3.0 {
		t.Errorf("the outage lasted %v s by the log's clock, want 3", rec["down_seconds"])
	}
	if f, _ := rec["failed"].(int64); f < int64(refused+inFlight) {
		t.Errorf("%d failed store calls during the outage, want at least the %d refused acquires and %d failed completions", f, refused, inFlight)
	}
	left, _ := rec["suppressed_store_errors"].(map[string]int64)
	accounted += left[store.OpAcquire]
	if accounted != int64(refused) {
		t.Errorf("acquire lines and the lines they say they left out account for %d failures, want the %d refused: %v, then %v",
			accounted, refused, lines, rec)
	}
	for _, op := range []string{store.OpComplete, store.OpRenew} {
		// Completions are retried, not failed for good; renewals are
		// limited like the rest, over the 3 s the clock moved.
		if n := logs.FilterMessage("idempotency.store_error").FilterField(zap.String("operation", op)).Len(); n > 3 {
			t.Errorf("%d %s store_error lines, want at most 3", n, op)
		}
	}
}

// testStoreLog is a storeLog that logs to an observer, on a clock that
// the test moves.
func testStoreLog() (*storeLog, *observer.ObservedLogs, *testClock) {
	core, logs := observer.New(zap.InfoLevel)
	clock := new(testClock)
	clock.advance(time.Hour)
	return &storeLog{h: &Handler{logger: zap.New(core)}, now: clock.now}, logs, clock
}

// A batch's statement is cancelled once all its requests have given up,
// and pgx then returns context.Canceled, which the request whose deadline
// passed may get in place of its own context's error. That is no answer
// from the store. Catches the store_recovered lines of a silent database
// that the tester saw (down_seconds 0.52, a completion attempt's timeout,
// while the requests it held were still waiting).
func TestStoreLogCancelledStatementIsNoAnswer(t *testing.T) {
	l, logs, _ := testStoreLog()
	timedOut, cancel := context.WithDeadline(context.Background(), time.Now().Add(-time.Second))
	defer cancel()
	l.observed(timedOut, store.OpComplete, l.begin(), fmt.Errorf("postgres store: complete: %w", context.DeadlineExceeded))
	// As sendOwned wraps the batch's error.
	batchCancelled := fmt.Errorf("postgres store: complete: %w", context.Canceled)
	l.observed(timedOut, store.OpComplete, l.begin(), batchCancelled)
	l.observed(context.Background(), store.OpRenew, l.begin(), batchCancelled) // a store closing
	if n := logs.FilterMessage("idempotency.store_recovered").Len(); n != 0 {
		t.Fatalf("%d store_recovered lines while no statement was answered", n)
	}
	if f := l.failed.Load(); f != 2 {
		t.Errorf("%d failed calls counted, want the 2 that timed out", f)
	}
	l.observed(context.Background(), store.OpComplete, l.begin(), nil)
	if n := logs.FilterMessage("idempotency.store_recovered").Len(); n != 1 {
		t.Errorf("%d store_recovered lines once the store answered, want 1", n)
	}
}

// The same, end to end: a database gone silent (its replies lost), with
// completions and renewals timing out against it, is one outage until it
// answers again.
func TestStoreLogSilentDatabaseIsOneOutage(t *testing.T) {
	fwd := pgtest.NewForwarder(t, pgtest.Addr(t, pgtest.DSN(t)))
	ps := provisionTestStore(t, &postgres.Store{DSN: pgtest.ThroughForwarder(t, pgtest.DSN(t), fwd), Table: pgtest.FreshTable(t), MaxConns: 8})
	l, logs, _ := testStoreLog()
	l.now = errlog.Now
	m := newStoreMetrics("storelog-silent")
	m.log = l
	st := instrumentedStore{ps, m}
	call := func(i int) error {
		ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
		defer cancel()
		key := store.RecordKey{Key: fmt.Sprintf("silent-%d", i)}
		if i%2 == 0 {
			return st.Complete(ctx, key, store.NewLockToken(), &store.Response{Status: 201}, time.Hour)
		}
		return st.Renew(ctx, key, store.NewLockToken())
	}
	if err := call(1); !errors.Is(err, store.ErrLockLost) {
		t.Fatalf("a renewal of no record: %v, want store.ErrLockLost", err)
	}
	fwd.Mute()
	var cancelled atomic.Int64
	var wg sync.WaitGroup
	for w := range 4 {
		wg.Go(func() {
			for i := 0; i < 12; i++ {
				if err := call(w*100 + i); errors.Is(err, context.Canceled) {
					cancelled.Add(1)
				}
			}
		})
	}
	wg.Wait()
	t.Logf("%d of 48 calls into the silence failed with context.Canceled", cancelled.Load())
	if n := logs.FilterMessage("idempotency.store_recovered").Len(); n != 0 {
		t.Errorf("%d store_recovered lines while the database was silent: %v", n, logs.FilterMessage("idempotency.store_recovered").All())
	}
	if n := logs.FilterMessage("idempotency.store_unavailable").Len(); n != 1 {
		t.Errorf("%d store_unavailable lines for one silence, want 1", n)
	}
	fwd.Unmute()
	storetest.WaitFor(t, 15*time.Second, "the store to answer", func() bool { return errors.Is(call(1), store.ErrLockLost) })
	if n := logs.FilterMessage("idempotency.store_recovered").Len(); n != 1 {
		t.Errorf("%d store_recovered lines once the database answered, want 1", n)
	}
}

// A store that flaps (an outage, an answer, an outage again within a
// second) writes no more than one store_error line a second per
// operation, and the lines it leaves out between two outages are counted
// as the next one begins, not by the next outage's lines. Catches renew
// lines 0.5 s apart, each false edge letting one through, and counts
// carried into an outage minutes later.
func TestStoreLogFlappingKeepsTheLimit(t *testing.T) {
	l, logs, clock := testStoreLog()
	down := fmt.Errorf("postgres store: renew: %w", context.DeadlineExceeded)
	timedOut, cancel := context.WithDeadline(context.Background(), time.Now().Add(-time.Second))
	defer cancel()
	line := func() (bool, int64) { return l.allow(store.OpRenew) }

	l.observed(timedOut, store.OpRenew, l.begin(), down)
	if ok, _ := line(); !ok {
		t.Fatal("the first line of an outage was left out")
	}
	clock.advance(300 * time.Millisecond)
	line() // left out
	clock.advance(200 * time.Millisecond)
	l.observed(context.Background(), store.OpRenew, l.begin(), nil)
	clock.advance(50 * time.Millisecond)
	line() // left out, after the outage's end: a renewal sent during it
	clock.advance(50 * time.Millisecond)
	l.observed(timedOut, store.OpRenew, l.begin(), down)
	clock.advance(100 * time.Millisecond)
	if ok, _ := line(); ok {
		t.Errorf("a second renew line 0.7 s after the first, at the start of a second outage")
	}
	clock.advance(300 * time.Millisecond)
	ok, suppressed := line()
	if !ok || suppressed != 1 {
		t.Errorf("a second after the first line: written %v, suppressed %d; want written, with the 1 left out in this outage", ok, suppressed)
	}
	recovered := logs.FilterMessage("idempotency.store_recovered").All()
	unavailable := logs.FilterMessage("idempotency.store_unavailable").All()
	if len(recovered) != 1 || len(unavailable) != 2 {
		t.Fatalf("%d store_recovered and %d store_unavailable lines, want 1 and 2", len(recovered), len(unavailable))
	}
	if got := recovered[0].ContextMap()["suppressed_store_errors"]; fmt.Sprint(got) != "map[renew:1]" {
		t.Errorf("store_recovered counts %v left out, want renew:1", got)
	}
	if got := unavailable[1].ContextMap()["suppressed_store_errors"]; fmt.Sprint(got) != "map[renew:1]" {
		t.Errorf("the second store_unavailable counts %v left out since the first outage, want renew:1", got)
	}
	if _, ok := unavailable[0].ContextMap()["suppressed_store_errors"]; ok {
		t.Errorf("the first store_unavailable counts lines left out before any: %v", unavailable[0].ContextMap())
	}
}
