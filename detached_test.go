package idempotency

// An execution outlives its client: it completes and stores its result
// when the client hangs up, across a reload, and when the handler panics,
// within the execution timeout.

import (
	"bytes"
	"context"
	"fmt"
	"net/http"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
)

// The flaky-wifi case: the client goes away mid-request; the upstream runs
// on to completion and the client's retry gets a replay. Catches an
// upstream request bound to the client's context.
func TestClientDisconnectStillCompletes(t *testing.T) {
	eachStore(t, func(t *testing.T, sb storeBackend) {
		up := newUpstream(t)
		s := protectedSite(t, sb, up.Addr(), "lock_timeout 1s", "execution_timeout 10s")
		c := call{Key: newKey(), Body: payBody(), Header: sleepFor(700 * time.Millisecond)}

		ctx, cancel := context.WithCancel(context.Background())
		errCh := make(chan error, 1)
		go func() {
			_, err := s.DoCtx(ctx, c)
			errCh <- err
		}()
		up.WaitStarted(t, 1)
		time.Sleep(50 * time.Millisecond)
		cancel()
		if err := <-errCh; err == nil {
			t.Fatalf("the cancelled request succeeded; the test did not disconnect")
		}

		up.WaitEnded(t, 1)
		e := up.Executions()[0]
		if !e.Finished || e.Cancelled {
			t.Fatalf("the upstream's work was cancelled when the client disconnected (finished=%v cancelled=%v)", e.Finished, e.Cancelled)
		}

		r := pollPastInProgress(t, s, call{Key: c.Key, Body: c.Body})
		if !r.replayed() || r.Status != http.StatusCreated || r.Header.Get("X-Execution-Id") != e.ID {
			t.Errorf("retry after a disconnect: got %s, want a replay of execution %s", r, e.ID)
		}
		wantCount(t, up, 1)
	})
}

// A config reload while a disconnected client's request still runs: the
// old config's store is cleaned up under the detached work, which must
// still store its response so that the retry is a replay. Catches a store
// whose Cleanup pulls the pool from under in-flight requests (the retry
// then finds a stale lock and executes a second time).
func TestReloadDuringDetachedExecution(t *testing.T) {
	eachStore(t, func(t *testing.T, sb storeBackend) {
		up := newUpstream(t)
		port := freeTCPPort(t)
		logPath := t.TempDir() + "/caddy.log"
		cfg := func(extra string) []byte {
			js, _, err := adaptCaddyfile(globalOptions(logPath, "") + fmt.Sprintf(`http://127.0.0.1:%d {
	idempotency {
		%s
		lock_timeout 1s
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
		srv := startCaddyJSON(t, cfg(""), logPath)
		s := newSiteClient(t, srv, port)
		c := call{Key: newKey(), Body: payBody(), Header: sleepFor(800 * time.Millisecond)}
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan struct{})
		go func() {
			defer close(done)
			_, _ = s.DoCtx(ctx, c)
		}()
		up.WaitStarted(t, 1)
		time.Sleep(50 * time.Millisecond)
		cancel()
		<-done
		if err := caddy.Load(cfg("retry_after 1s"), true); err != nil { // caddyMu is held by this test
			t.Fatalf("reload: %v", err)
		}
		s.reloaded(t)
		up.WaitEnded(t, 1)
		e := up.Executions()[0]
		if !e.Finished {
			t.Fatalf("the detached work did not finish across the reload")
		}
		time.Sleep(400 * time.Millisecond) // past lock_timeout: a stuck lock would now be taken over
		r := pollPastInProgress(t, s, call{Key: c.Key, Body: c.Body})
		if !r.replayed() || r.Header.Get("X-Execution-Id") != e.ID {
			t.Errorf("retry after a reload during the detached work: got %s, want a replay of execution %s", r, e.ID)
		}
		wantCount(t, up, 1)
	})
}

// The detached work is bounded, and what the cut-off execution stores is
// the outcome-unknown problem. Catches context.WithoutCancel without a
// timeout, and a stored empty 499.
func TestExecutionTimeoutBoundsDetachedWork(t *testing.T) {
	eachStore(t, func(t *testing.T, sb storeBackend) {
		up := newUpstream(t)
		s := protectedSite(t, sb, up.Addr(), "execution_timeout 1s")
		c := call{Key: newKey(), Body: payBody(), Header: sleepFor(10 * time.Second)}
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan struct{})
		go func() {
			defer close(done)
			_, _ = s.DoCtx(ctx, c)
		}()
		up.WaitStarted(t, 1)
		time.Sleep(50 * time.Millisecond)
		cancel()
		<-done
		up.WaitEnded(t, 1)
		e := up.Executions()[0]
		if !e.Cancelled {
			t.Fatalf("the upstream ran to its end although execution_timeout is 1s")
		}
		// Far from the 10s the work would run unbounded, with room for
		// a loaded machine.
		if took := e.Ended.Sub(e.Started); took > 5*time.Second {
			t.Errorf("the detached work ran %v, want about 1.05s (execution_timeout 1s)", took)
		}
		// reverse_proxy writes a bare 499 when it is cancelled: the retry
		// must get the stored outcome-unknown problem, not an empty 499,
		// and must not run the work a second time.
		r := pollPastInProgress(t, s, call{Key: c.Key, Body: c.Body})
		wantReplayedProblem(t, r, http.StatusBadGateway, "outcome-unknown")
		wantCount(t, up, 1)
	})
}

// A next handler that panics (reverse_proxy when the upstream fails in
// the middle of its response; here `abort`) still ends its record: the
// retry gets the stored outcome-unknown answer, not 409 for as long as a
// lock that nobody stops renewing lives.
func TestPanickingHandlerCompletesItsRecord(t *testing.T) {
	eachStore(t, func(t *testing.T, sb storeBackend) {
		port := freeTCPPort(t)
		s := siteFromCaddyfile(t, port, fmt.Sprintf(`http://127.0.0.1:%d {
	idempotency {
		%s
		lock_timeout 1s
	}
	abort
}
`, port, sb.Block()))
		c := call{Key: newKey(), Body: payBody()}
		if r, err := s.DoCtx(context.Background(), c); err == nil {
			t.Fatalf("an aborted request got an answer: %s", r)
		}
		// Past lock_timeout: a lock that were still renewed would answer
		// 409, and one left to go stale would be taken over.
		time.Sleep(1500 * time.Millisecond)
		// Its completion may still be on its way: a client retries a 409
		// with Retry-After.
		r := pollPastInProgress(t, s, c)
		if r.Status != http.StatusBadGateway || !r.replayed() || !bytes.Contains(r.Body, []byte("#outcome-unknown")) {
			t.Fatalf("retry after an abort: %s; want the stored outcome-unknown problem, replayed", r)
		}
		wantReplayOf(t, s.Do(t, c), r)
	})
}
