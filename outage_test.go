package idempotency

import (
	"context"
	"fmt"
	"net"
	"net/http"
	"testing"
	"time"

	"github.com/caddy-idempotency/idempotency/internal/pgtest"
	"github.com/caddy-idempotency/idempotency/stores/postgres"
)

// A database restarted after being down for longer than lock_timeout: the
// time it was down does not count against a lease. The owner whose
// upstream answered during the outage stores its response once the server
// is back, and a retry on another instance meanwhile gets 409 in progress,
// then the replay. The owner that died (its Caddy killed) is taken over
// all the same, but only once the restarted server has been up for
// lock_timeout.
//
// A crash restart is the same outage without a new start time or
// timeline: one backend killed makes the postmaster stop every process and
// recover. Its recovery is held long here by keeping the instances from
// the server (a forwarder that refuses them), as a large WAL would.
func TestRestartLongerThanLease(t *testing.T) {
	t.Run("restart", func(t *testing.T) { testRestartLongerThanLease(t, false) })
	t.Run("crash restart", func(t *testing.T) { testRestartLongerThanLease(t, true) })
}

func testRestartLongerThanLease(t *testing.T, crash bool) {
	const lock = 2 * time.Second
	pg, _ := pgtest.StartPrimaryAlone(t, "''")
	dsn := pg.PrimaryDSN()
	var fw *pgtest.Forwarder
	if crash {
		fw = pgtest.NewForwarder(t, fmt.Sprintf("127.0.0.1:%d", pg.PrimaryPort))
		_, port, _ := net.SplitHostPort(fw.Addr())
		dsn = "postgres://postgres@127.0.0.1:" + port + "/postgres?sslmode=disable"
	}
	up := newUpstream(t)
	var sites [3]*site
	var procs [3]*caddyProc
	for i := range procs {
		port := freeTCPPort(t)
		procs[i] = startCaddyProc(t, fmt.Sprintf("instance-%c", 'a'+i), fmt.Sprintf(`http://127.0.0.1:%d {
	idempotency {
		store postgres {
			dsn %q
		}
		lock_timeout %s
		retry_after 1s
		prune_interval 0
	}
	reverse_proxy %s
}
`, port, dsn, lock, up.Addr()))
		sites[i] = procSite(t, procs[i], port)
	}
	owned := call{Key: newKey(), Body: payBody(), Header: sleepFor(1500 * time.Millisecond)}
	dead := call{Key: newKey(), Body: payBody(), Header: sleepFor(3 * time.Second)}
	ownerDone := make(chan reply, 1)
	go func() {
		rep, err := sites[0].DoCtx(context.Background(), owned)
		if err != nil {
			rep = reply{Status: -1, Body: []byte(err.Error())}
		}
		ownerDone <- rep
	}()
	go func() { _, _ = sites[2].DoCtx(context.Background(), dead) }()
	up.WaitStarted(t, 2)
	procs[2].Kill(t)

	// The owner's upstream answers while the server is down, and its lease,
	// dated by the last renewal, runs out.
	down := time.Now()
	if crash {
		fw.Cut()
		pgtest.CrashBackend(t, pg.PrimaryDSN())
	} else {
		pg.KillPrimary(t)
	}
	time.Sleep(time.Until(down.Add(2 * lock)))
	restart := time.Now()
	if crash {
		fw.Restore()
	} else {
		pg.StartPrimary(t)
	}
	t.Logf("the server was down for %v", time.Since(down).Round(10*time.Millisecond))

	// Retries of both keys on the instance that owns neither.
	var ownedRetried, takenOver reply
	var takenOverAt time.Time
	deadline := time.Now().Add(lock + 20*time.Second)
	for (ownedRetried.Status == 0 || takenOver.Status == 0) && time.Now().Before(deadline) {
		for _, c := range []call{owned, dead} {
			done := &ownedRetried
			if c.Key == dead.Key {
				done = &takenOver
			}
			if done.Status != 0 {
				continue
			}
			sent := time.Now()
			rep, err := sites[1].DoCtx(context.Background(), c)
			switch {
			case err != nil:
				t.Fatalf("a retry of %s: %v", c.Key, err)
			case rep.Status == http.StatusConflict && problemType(rep) == "in-progress",
				rep.Status == http.StatusServiceUnavailable && problemType(rep) == "store-unavailable":
			case rep.Status >= 200 && rep.Status < 300:
				*done = rep
				if c.Key == dead.Key {
					takenOverAt = sent
				}
			default:
				t.Fatalf("a retry of %s: %s", c.Key, rep)
			}
		}
		time.Sleep(100 * time.Millisecond)
	}

	owner := <-ownerDone
	if owner.Status != http.StatusCreated {
		t.Errorf("the owner, whose upstream answered while the server was down, got %s, want its 201", owner)
	}
	if !ownedRetried.replayed() {
		t.Errorf("a retry of the owned key got %s, want the owner's response replayed", ownedRetried)
	}
	counts := make(map[string]int)
	for _, e := range up.Executions() {
		counts[e.Key]++
	}
	if counts[owned.Key] != 1 {
		t.Errorf("the key whose owner waited out the restart executed %d times, want once", counts[owned.Key])
	}
	switch {
	case takenOver.Status == 0:
		t.Errorf("the dead owner's key was never taken over after the restart")
	case takenOver.replayed() || counts[dead.Key] != 2:
		t.Errorf("the dead owner's key: %s, executed %d times; want a takeover that executes it again",
			takenOver, counts[dead.Key])
	case takenOverAt.Before(restart.Add(lock)):
		t.Errorf("the dead owner's key was taken over %v after the restart began, before the server had been up for lock_timeout (%v)",
			takenOverAt.Sub(restart).Round(10*time.Millisecond), lock)
	default:
		t.Logf("the dead owner's key was taken over by a retry sent %v after the restart began",
			takenOverAt.Sub(restart).Round(10*time.Millisecond))
	}
}

// primaryLongUp makes the server look, to the leases of table, as if it had
// been the primary since long ago: a test that dates a lease an hour back
// means a lease that ran out while the server was up.
func primaryLongUp(t testing.TB, dsn, table string) {
	t.Helper()
	tn, err := postgres.ParseTable(table)
	if err != nil {
		t.Fatal(err)
	}
	pgtest.Exec(t, dsn, postgres.PrimaryLongUpSQL(tn))
}

// A partition between Caddy and a database that stays up, longer than
// lock_timeout, ends the lease by the database's clock while its owner
// still runs here: its renewals do not arrive. The client whose
// connection the outage broke retries to the same instance once the
// database answers again, while the upstream still runs. That retry gets 409 in progress, not a
// takeover: the owner is alive in this process, and its completion, under
// a token nobody replaced, stores the response, which the retry then
// replays. Catches a retry that takes the record over and executes the
// request a second time beside its live owner.
func TestPartitionLongerThanLeaseRetriedHere(t *testing.T) {
	// The upstream is still running when the database answers again.
	t.Run("retried once the database answers", func(t *testing.T) {
		testPartitionRetried(t, 2*time.Second, 7*time.Second, true)
	})
	// A retry sent early in the partition, while the owner's lease is
	// still live, is answered here too, not sent: an acquire held in the
	// network would reach the database after the lease ended and take
	// the record over. Here the cut refuses connections, so an acquire
	// sent would fail (503 after the store's timeout); answered here, it
	// is 409 in progress at once.
	t.Run("retried early in the partition", func(t *testing.T) {
		testPartitionRetried(t, 6*time.Second, 3*time.Second, false)
	})
}

// testPartitionRetried runs a request whose upstream takes upstream
// under lock_timeout lock, cuts the database, and retries the request on
// the same instance: once the cut has outlasted the lease and ended
// (afterCut), or at once during it.
func testPartitionRetried(t *testing.T, lock, upstream time.Duration, afterCut bool) {
	sb := postgresBackend(t)
	fwd := pgtest.NewForwarder(t, pgtest.Addr(t, sb.DSN))
	up := newUpstream(t)
	s := protectedSite(t, storeBackend{Name: ""}, up.Addr(), fmt.Sprintf(
		"store postgres {\n\t\t\tdsn %q\n\t\t\ttable %s\n\t\t}\n\t\tlock_timeout %s\n\t\tretry_after 1s\n\t\tprune_interval 0",
		pgtest.ThroughForwarder(t, sb.DSN, fwd), sb.Table, lock))
	c := call{Key: newKey(), Body: payBody(), Header: sleepFor(upstream)}
	owner := runBackground(t, s, c)
	up.WaitStarted(t, 1)
	fwd.Cut()
	if afterCut {
		time.Sleep(2*lock + 500*time.Millisecond)
		fwd.Restore()
	}
	retry := s.Do(t, c)
	if retry.Status != http.StatusConflict || problemType(retry) != "in-progress" {
		t.Errorf("a retry on the instance where its owner still runs (after the cut: %v): %s, want 409 in progress", afterCut, retry)
	}
	fwd.Restore()
	first := <-owner
	wantExecuted(t, first, http.StatusCreated)
	wantReplayOf(t, pollPastInProgress(t, s, c), first)
	wantCount(t, up, 1)
}
