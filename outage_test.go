package idempotency

import (
	"context"
	"crypto/sha256"
	"fmt"
	"net"
	"net/http"
	"syscall"
	"testing"
	"time"

	"github.com/caddy-idempotency/idempotency/store"
	"github.com/jackc/pgx/v5"
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
	pg, _ := startPGPrimary(t, "''")
	dsn := pg.PrimaryDSN()
	var fw *tcpForwarder
	if crash {
		fw = newTCPForwarder(t, fmt.Sprintf("127.0.0.1:%d", pg.PrimaryPort))
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
		crashBackend(t, pg.PrimaryDSN())
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
	tn, err := parseTableName(table)
	if err != nil {
		t.Fatal(err)
	}
	pgExec(t, dsn, `INSERT INTO `+tn.primariesTable()+` (system_identifier, timeline, started, first_seen)
	SELECT `+thisPrimarySQL+`, `+serverStartSQL+`, '-infinity'
	ON CONFLICT (system_identifier, timeline) DO UPDATE SET started = excluded.started, first_seen = excluded.first_seen`)
}

// crashBackend kills one backend of the server at dsn with SIGKILL, as the
// OOM killer would, and returns once the server, restarted by its
// postmaster after crash recovery, accepts connections again.
func crashBackend(t testing.TB, dsn string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	conn, err := pgx.Connect(ctx, dsn)
	if err != nil {
		t.Fatal(err)
	}
	const started = "SELECT " + serverStartSQL
	var pid int
	var before time.Time
	if err := conn.QueryRow(ctx, "SELECT pg_backend_pid(), "+serverStartSQL).Scan(&pid, &before); err != nil {
		t.Fatal(err)
	}
	if err := syscall.Kill(pid, syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	_ = conn.Close(ctx)
	for {
		var after time.Time
		c, err := pgx.Connect(ctx, dsn)
		if err == nil {
			err = c.QueryRow(ctx, started).Scan(&after)
			_ = c.Close(ctx)
		}
		switch {
		case err == nil && after.After(before):
			return
		case ctx.Err() != nil:
			t.Fatalf("the server did not come back from its crash (its start %v, then %v): %v", before, after, err)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// acquireOn runs the store's acquire of table for one new key on conn,
// as a store whose pool holds conn would, and returns its outcome.
func acquireOn(t *testing.T, conn *pgx.Conn, table string) store.Outcome {
	t.Helper()
	tn, err := parseTableName(table)
	if err != nil {
		t.Fatal(err)
	}
	hash := sha256.Sum256([]byte("tenant"))
	token := newLockToken()
	fp := sha256.Sum256([]byte("body"))
	var n int64
	var outcome int32
	err = conn.QueryRow(context.Background(), newPostgresSQL(tn).acquire.one,
		hash[:], newKey(), fp[:], http.MethodPost, "/", token[:], int64(time.Hour/time.Microsecond), int64(time.Minute/time.Microsecond),
	).Scan(&n, &outcome, nil, nil, nil, nil, nil, nil, nil, nil, nil, nil, nil, nil, nil, nil)
	if err != nil {
		t.Fatalf("acquire: %v", err)
	}
	return store.Outcome(outcome)
}

// The timeline is read by every statement: a standby's connection that
// outlives its promotion (as a pooler's do, and a standby's sessions are
// not ended by a promotion) notes the new primary at its next acquire,
// and judges leases from then (migration 0004).
func TestPrimaryNotedOnAConnectionThatOutlivesPromotion(t *testing.T) {
	pair := startPGPair(t, true, 0)
	ctx := context.Background()
	const table = "idempotency_keys"
	primary, err := pgx.Connect(ctx, pair.PrimaryDSN())
	if err != nil {
		t.Fatal(err)
	}
	defer primary.Close(ctx)
	if _, err := Migrate(ctx, primary, table); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 10*time.Second, "the standby to replay the migrations", func() bool {
		return pgQuery(t, pair.StandbyDSN(), "SELECT to_regclass('idempotency_keys_primaries') IS NOT NULL")[0][0] == "true"
	})
	conn, err := pgx.Connect(ctx, pair.StandbyDSN())
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(ctx)
	var sysid int64
	var timeline *int32
	if err := conn.QueryRow(ctx, "SELECT "+thisPrimarySQL).Scan(&sysid, &timeline); err != nil {
		t.Fatal(err)
	}
	if timeline != nil {
		t.Fatalf("on the standby: timeline %v, want none", *timeline)
	}

	promoted := time.Now()
	pair.Promote(t)
	if got := acquireOn(t, conn, table); got != store.OutcomeCreated {
		t.Fatalf("acquire on the promoted server: outcome %d, want created", got)
	}
	rows := pgQuery(t, pair.StandbyDSN(), `SELECT p.system_identifier = (SELECT system_identifier FROM pg_control_system()),
		p.timeline = ('x' || left(pg_walfile_name(pg_current_wal_lsn()), 8))::bit(32)::int AND p.timeline > 1, p.first_seen >= $1
		FROM idempotency_keys_primaries AS p`, promoted)
	if len(rows) != 1 || rows[0][0] != "true" || rows[0][1] != "true" || rows[0][2] != "true" {
		t.Fatalf("the primaries table after an acquire on the promoted server, on a connection opened before: %v; "+
			"want one row, the server's system identifier and its new timeline, first seen after the promotion", rows)
	}
	tn, _ := parseTableName(table)
	var sinceOK bool
	if err := conn.QueryRow(ctx, "SELECT "+primarySinceSQL(tn)+" = (SELECT first_seen FROM idempotency_keys_primaries)").Scan(&sinceOK); err != nil || !sinceOK {
		t.Fatalf("the promoted server's primary_since on that connection is not its row's first_seen (%v)", err)
	}
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
	fwd := newTCPForwarder(t, postgresAddr(t, sb.DSN))
	up := newUpstream(t)
	s := protectedSite(t, storeBackend{Name: ""}, up.Addr(), fmt.Sprintf(
		"store postgres {\n\t\t\tdsn %q\n\t\t\ttable %s\n\t\t}\n\t\tlock_timeout %s\n\t\tretry_after 1s\n\t\tprune_interval 0",
		throughForwarder(t, sb.DSN, fwd), sb.Table, lock))
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
