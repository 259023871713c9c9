package storetest

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"sync"
	"testing"
	"time"

	"github.com/caddy-idempotency/idempotency/store"
)

// Many attempts at one new key at once: exactly one creates the record,
// and every other finds it in progress. Catches a read-then-insert.
func testConcurrentAcquireCreatesOnce(t *testing.T, s store.Store) {
	const n = 50
	outcomes := AcquireConcurrently(t, s, Request("cred", "concurrent-key", "body"), n)
	if outcomes[store.OutcomeCreated] != 1 || outcomes[store.OutcomeExisting] != n-1 {
		t.Fatalf("outcomes %v, want 1 created and %d existing", outcomes, n-1)
	}
}

// AcquireConcurrently acquires req from s in n attempts at once, each
// with a token of its own, and counts the outcomes. An attempt that
// finds the record must find it in progress.
func AcquireConcurrently(t testing.TB, s store.Store, req store.AcquireRequest, n int) map[store.Outcome]int {
	t.Helper()
	var (
		wg       sync.WaitGroup
		mu       sync.Mutex
		outcomes = map[store.Outcome]int{}
		start    = make(chan struct{})
	)
	for range n {
		wg.Go(func() {
			<-start
			res, err := s.Acquire(context.Background(), Retry(req))
			if err != nil {
				t.Error(err)
				return
			}
			if res.Outcome == store.OutcomeExisting && res.Record.Status != store.StatusInProgress {
				t.Errorf("existing record is %s", res.Record.Status)
			}
			mu.Lock()
			outcomes[res.Outcome]++
			mu.Unlock()
		})
	}
	close(start)
	wg.Wait()
	return outcomes
}

// A call whose context has ended does nothing and says so: a store must
// not act for a caller that has given up.
func testCancelledContext(t *testing.T, s store.Store) {
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	req := Request("cred", "cancelled-key", "body")
	if _, err := s.Acquire(ctx, req); err == nil {
		t.Fatal("acquire with an ended context: no error")
	}
	MustAcquire(t, s, Retry(req), store.OutcomeCreated)
}

// WaitForWakes waits until s, a store.Waiter, wakes its waiters: they
// may start to flow a moment after waiting was enabled (a listener
// connecting), and a probe record's release wakes its waiter once they
// do.
func WaitForWakes(t testing.TB, s store.Store) {
	t.Helper()
	w, _ := store.As[store.Waiter](s)
	ctx := context.Background()
	probes := 0
	WaitFor(t, 15*time.Second, "the store's wakes to flow", func() bool {
		probes++
		req := Request("Bearer waiter", fmt.Sprintf("probe-%d", probes), "{}")
		MustAcquire(t, s, req, store.OutcomeCreated)
		wctx, cancel := context.WithCancel(ctx)
		defer cancel()
		ch := w.WaitCompleted(wctx, req.Key)
		if err := s.Release(ctx, req.Key, req.Token); err != nil {
			t.Fatal(err)
		}
		select {
		case <-ch:
			return true
		case <-time.After(200 * time.Millisecond):
			return false
		}
	})
}

// A waiter of a record is woken by its completion and by its release,
// and not by another record's.
func testWaiter(t *testing.T, s store.Store) {
	w, _ := store.As[store.Waiter](s)
	ctx := context.Background()
	woken := func(ch <-chan struct{}) bool {
		select {
		case <-ch:
			return true
		case <-time.After(10 * time.Second):
			return false
		}
	}
	WaitForWakes(t, s)
	for _, end := range []string{"complete", "release"} {
		req := Request("Bearer waiter", "key-"+end, "{}")
		MustAcquire(t, s, req, store.OutcomeCreated)
		other := Request("Bearer waiter", "key-other-"+end, "{}")
		MustAcquire(t, s, other, store.OutcomeCreated)
		wctx, cancel := context.WithCancel(ctx)
		ch := w.WaitCompleted(wctx, req.Key)
		otherCh := w.WaitCompleted(wctx, other.Key)
		var err error
		if end == "complete" {
			err = s.Complete(ctx, req.Key, req.Token, &store.Response{Status: 201, Header: http.Header{}, Body: []byte("ok"), Replayable: true, BodySize: 2}, req.Retention)
		} else {
			err = s.Release(ctx, req.Key, req.Token)
		}
		if err != nil {
			t.Fatal(err)
		}
		if !woken(ch) {
			t.Errorf("%s did not wake the waiter", end)
		}
		select {
		case <-otherCh:
			t.Errorf("%s woke the waiter of another record", end)
		default:
		}
		cancel()
		if err := s.Release(ctx, other.Key, other.Token); err != nil && !errors.Is(err, store.ErrLockLost) {
			t.Fatal(err)
		}
	}
}
