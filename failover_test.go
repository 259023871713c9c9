package idempotency

// A failover under load: two Caddy processes on the multi-host DSN of a
// primary and its synchronous standby, clients that retry each key until
// they get a 2xx, the primary stopped at once mid-load, the standby
// promoted a moment later, more load, and then every key sent once more
// to the instance that had not answered it (its replay cache cannot
// stand in for the table). Then, against the upstream's ledger and the
// promoted server's table: every key executed exactly once, every record
// completed, only 503 and 409 in progress while there was no primary,
// 2xx again soon after the promotion, and `wait` woken on the promoted
// server.
//
// IDEMPOTENCY_FAILOVER_ASYNC=1 runs the same failover on asynchronous
// replication, and reports what it lost instead of failing on it: the
// figures of docs/high-availability.md. IDEMPOTENCY_FAILOVER_LAG=1s
// holds the asynchronous standby that far behind the primary.

import (
	"cmp"
	"context"
	"fmt"
	"math/rand/v2"
	"net/http"
	"os"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/caddy-idempotency/idempotency/internal/pgtest"
	"github.com/caddy-idempotency/idempotency/store"
	"github.com/caddy-idempotency/idempotency/store/storetest"
	"github.com/jackc/pgx/v5"
)

const (
	// failoverLock is well above the outage (about two seconds here), so
	// that no lease expires under a request in flight while there is no
	// primary: a lease shorter than the outage lets a retry take over a
	// request that is still running.
	failoverLock = 10 * time.Second
	// failoverGap is how long there is no primary.
	failoverGap = 1500 * time.Millisecond
	// failoverRecovery is how soon after the promotion a 2xx must come.
	failoverRecovery = 2 * time.Second
)

// failoverAttempt is one request of a client and what it got.
type failoverAttempt struct {
	sent, recv time.Time
	status     int
	problem    string // the module's problem type, if it answered with one
	replayed   bool
	// retryAfter: the answer had a Retry-After header.
	retryAfter bool
	err        error
}

func (a failoverAttempt) ok() bool { return a.err == nil && a.status >= 200 && a.status < 300 }

// failoverKey is one key's request and its attempts, in order.
type failoverKey struct {
	key    string
	body   []byte
	header map[string]string
	// attempts run until the first 2xx; again are those of the key sent
	// once more after the failover, until a 2xx.
	attempts, again []failoverAttempt
	// retries are those of a second client of a slow key (load).
	retries []failoverAttempt
	// answeredBy is the instance that gave the last 2xx.
	answeredBy int
}

// failoverRun is what a run did and saw.
type failoverRun struct {
	pair                                *pgtest.Pair
	up                                  *upstream
	procs                               [2]*caddyProc
	sites, waitSites                    [2]*site
	keys                                []*failoverKey
	start, kill, promote, promoted, end time.Time
	// listening is when both instances listened on the promoted server.
	listening time.Time
	// table is the status of each record on the promoted server once the
	// load ended, before the keys were sent again.
	table map[string]string
	// lag is how far behind the asynchronous standby was held.
	lag time.Duration
	// lock is the instances' lock_timeout; gap is how long there is no
	// primary.
	lock, gap time.Duration
	// patience is how long a client sends a key before it gives up.
	patience time.Duration
}

func TestFailover(t *testing.T) {
	synchronous := os.Getenv("IDEMPOTENCY_FAILOVER_ASYNC") != "1"
	r := startFailover(t, synchronous, failoverLock, failoverGap)
	r.load(t, 16, nil)
	r.checkWaitAfterFailover(t)
	r.report(t, synchronous)
}

// startFailover starts the pair of servers, the upstream and two Caddy
// processes. Each serves two sites: one for the load, and one with
// `wait` on a table of its own, whose waiters the LISTEN connection must
// wake on the promoted server.
func startFailover(t *testing.T, synchronous bool, lock, gap time.Duration) *failoverRun {
	t.Helper()
	var lag time.Duration
	if s := os.Getenv("IDEMPOTENCY_FAILOVER_LAG"); s != "" && !synchronous {
		var err error
		if lag, err = time.ParseDuration(s); err != nil {
			t.Fatalf("IDEMPOTENCY_FAILOVER_LAG=%q: %v", s, err)
		}
	}
	r := &failoverRun{pair: pgtest.StartPair(t, synchronous, lag), up: newUpstream(t), lag: lag, lock: lock, gap: gap}
	for i := range r.procs {
		port, waitPort := freeTCPPort(t), freeTCPPort(t)
		r.procs[i] = startCaddyProc(t, fmt.Sprintf("instance-%c", 'a'+i), fmt.Sprintf(`http://127.0.0.1:%[1]d {
	idempotency {
		store postgres {
			dsn %[3]q
			table idempotency_keys
		}
		lock_timeout %[4]s
		retry_after 1s
		prune_interval 0
	}
	reverse_proxy %[5]s
}
http://127.0.0.1:%[2]d {
	idempotency {
		store postgres {
			dsn %[3]q
			table idempotency_wait
		}
		lock_timeout %[4]s
		wait 5s
		prune_interval 0
	}
	reverse_proxy %[5]s
}
`, port, waitPort, r.pair.DSN(), lock, r.up.Addr()))
		r.sites[i] = procSite(t, r.procs[i], port)
		r.waitSites[i] = procSite(t, r.procs[i], waitPort)
	}
	return r
}

// load runs clients that each send keys one after the other, every key
// until it gets a 2xx, alternating between the instances. The primary
// is stopped while they run, and the standby promoted r.gap later.
//
// The slow keys, if any, are sent 0.5 s into the load, one to each
// instance in turn, and their upstream calls (X-Test-Sleep) end while
// there is no primary: each is then retried, from the promotion on, on
// the other instance, as a client that gave up on its answer would, and
// those attempts are the key's retries.
func (r *failoverRun) load(t *testing.T, clients int, slow []*failoverKey) {
	t.Helper()
	var (
		next        atomic.Int64
		stop        atomic.Bool
		mu          sync.Mutex
		wg          sync.WaitGroup
		seq         = pgtest.RandomHex(3)
		ctx, cancel = context.WithTimeout(context.Background(), 80*time.Second)
	)
	defer cancel()
	r.keys = append(r.keys, slow...)
	r.start = time.Now()
	for range clients {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for !stop.Load() {
				i := next.Add(1)
				k := &failoverKey{
					key:    fmt.Sprintf("failover-%s-%06d", seq, i),
					body:   payBody(),
					header: map[string]string{"X-Test-Sleep": fmt.Sprintf("%dms", rand.IntN(30))},
				}
				mu.Lock()
				r.keys = append(r.keys, k)
				mu.Unlock()
				k.attempts = r.send(ctx, k, int(i%2))
			}
		}()
	}
	promoted := make(chan struct{})
	for i, k := range slow {
		wg.Add(2)
		go func() {
			defer wg.Done()
			time.Sleep(500 * time.Millisecond)
			k.attempts = r.send(ctx, k, i%2)
		}()
		go func() {
			defer wg.Done()
			<-promoted
			k.retries = r.send(ctx, &failoverKey{key: k.key, body: k.body, header: k.header}, 1-i%2)
		}()
	}
	time.Sleep(1500 * time.Millisecond)
	r.kill = time.Now()
	r.pair.KillPrimary(t)
	time.Sleep(r.gap - time.Since(r.kill))
	r.promote = time.Now()
	r.pair.Promote(t)
	r.promoted = time.Now()
	close(promoted)
	listening := make(chan time.Time, 1)
	go func() {
		// Both instances' LISTEN connections, back on the promoted server.
		// (Not through pgQuery: a goroutine must not end the test.)
		for ctx.Err() == nil {
			var n int
			conn, err := pgx.Connect(ctx, r.pair.StandbyDSN())
			if err == nil {
				err = conn.QueryRow(ctx, "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND application_name = 'caddy-idempotency-listener'").Scan(&n)
				conn.Close(ctx)
			}
			if err == nil && n == 2 {
				listening <- time.Now()
				return
			}
			time.Sleep(50 * time.Millisecond)
		}
		listening <- time.Time{}
	}()
	time.Sleep(3 * time.Second)
	stop.Store(true)
	wg.Wait()
	r.end = time.Now()
	r.listening = <-listening
	r.table = pgTableStatuses(t, r.pair.StandbyDSN())

	// Every key once more, as a client that lost its answer sends it, to
	// the instance that did not answer it: its replay cache cannot
	// answer for the table. A record the failover lost executes again.
	keys := make(chan *failoverKey)
	for range clients {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for k := range keys {
				k.again = r.send(ctx, k, 1-k.answeredBy)
			}
		}()
	}
	for _, k := range r.keys {
		keys <- k
	}
	close(keys)
	wg.Wait()
}

// send sends a key until it gets a 2xx, or gives up after r.patience
// (30s if not set).
func (r *failoverRun) send(ctx context.Context, k *failoverKey, inst int) (attempts []failoverAttempt) {
	deadline := time.Now().Add(cmp.Or(r.patience, 30*time.Second))
	for ctx.Err() == nil && time.Now().Before(deadline) {
		a := failoverAttempt{sent: time.Now()}
		rep, err := r.sites[inst].DoCtx(ctx, call{Key: k.key, Body: k.body, Header: k.header})
		a.recv, a.err = time.Now(), err
		if err == nil {
			a.status, a.problem, a.replayed = rep.Status, problemType(rep), rep.replayed()
			a.retryAfter = rep.Header.Get("Retry-After") != ""
		}
		attempts = append(attempts, a)
		if a.ok() {
			k.answeredBy = inst
			return attempts
		}
		inst = 1 - inst
		ctxSleep(ctx, time.Duration(40+rand.IntN(40))*time.Millisecond)
	}
	return attempts
}

// TestFailoverLongerThanLease holds the primary down for longer than
// lock_timeout. Time without a primary does not count against a lease:
// the owners whose upstream answered during the outage store their
// responses once the standby is promoted, and the retries of other
// clients, sent from the promotion on, get 409 in progress and then the
// replay, never a takeover.
func TestFailoverLongerThanLease(t *testing.T) {
	const lock, gap = 3 * time.Second, 6 * time.Second
	r := startFailover(t, true, lock, gap)
	var slow []*failoverKey
	for i := range 8 {
		slow = append(slow, &failoverKey{
			key:    fmt.Sprintf("failover-slow-%s-%02d", pgtest.RandomHex(3), i),
			body:   payBody(),
			header: map[string]string{"X-Test-Sleep": "2s"},
		})
	}
	r.load(t, 8, slow)
	for _, k := range slow {
		if len(k.attempts) != 1 || !k.attempts[0].ok() {
			t.Errorf("%s: the owner's request, whose upstream answered during the outage, got %+v, want its 2xx",
				k.key, k.attempts)
		}
		if len(k.retries) == 0 || !k.retries[len(k.retries)-1].replayed {
			t.Errorf("%s: the retries after the promotion ended without a replay: %+v", k.key, k.retries)
		}
	}
	r.report(t, true)
}

// checkWaitAfterFailover checks that `wait` works on the promoted
// server: each instance's LISTEN connection is back, on the new
// primary, and a request waiting on one instance is woken by the
// completion of the same request on the other, long before its wait
// would have run out.
func (r *failoverRun) checkWaitAfterFailover(t *testing.T) {
	t.Helper()
	if r.listening.Before(r.promoted) {
		t.Fatalf("the instances did not LISTEN on the promoted server")
	}
	t.Logf("failover: the LISTEN connections were back on the promoted server %v after the promotion",
		r.listening.Sub(r.promoted).Round(10*time.Millisecond))

	c := call{Key: newKey(), Body: payBody(), Header: sleepFor(time.Second)}
	first := make(chan reply, 1)
	go func() {
		rep, err := r.waitSites[0].DoCtx(context.Background(), c)
		if err != nil {
			t.Errorf("the first request: %v", err)
		}
		first <- rep
	}()
	storetest.WaitFor(t, 15*time.Second, "the first request to reach the upstream", func() bool {
		for _, e := range r.up.Executions() {
			if e.Key == c.Key {
				return true
			}
		}
		return false
	})
	sent := time.Now()
	second := r.waitSites[1].Do(t, c)
	waited := time.Since(sent)
	f := <-first
	if !second.replayed() || second.Status != f.Status || string(second.Body) != string(f.Body) {
		t.Errorf("the waiting request got %s, want a replay of %s", second, f)
	}
	// The first request ends about a second after it started; the wait
	// runs out after five.
	if waited > 3*time.Second {
		t.Errorf("the waiting request waited %v: no notification woke it", waited)
	}
	t.Logf("failover: a request waiting on the other instance was answered after %v", waited.Round(10*time.Millisecond))
}

// report checks the run against the ledger and the promoted server's
// table, and logs the figures. On asynchronous replication, losses are
// figures to report, not failures.
func (r *failoverRun) report(t *testing.T, synchronous bool) {
	t.Helper()
	fail := t.Errorf
	if !synchronous {
		fail = t.Logf
	}

	executions := make(map[string]int)
	for _, e := range r.up.Executions() {
		if strings.HasPrefix(e.Key, "failover-") {
			executions[e.Key]++
		}
	}
	final := pgTableStatuses(t, r.pair.StandbyDSN())

	var (
		twice, never, lost, unanswered, transportErrs, unexpected int
		inFlight                                                  int
		inFlightWait                                              time.Duration
		firstOK                                                   time.Time
		gap                                                       = make(map[string]int)
		conflicted, lateConflicts                                 int
		longestConflict                                           time.Duration
		examples                                                  []string
		incomplete, againReplayed, againExecuted, againUnanswered int
		againStatuses                                             = make(map[string]int)
		retriesExecuted                                           int
	)
	example := func(format string, args ...any) {
		if len(examples) < 20 {
			examples = append(examples, fmt.Sprintf(format, args...))
		}
	}
	for _, k := range r.keys {
		for _, a := range k.attempts {
			if a.ok() && !a.sent.Before(r.promote) && (firstOK.IsZero() || a.recv.Before(firstOK)) {
				firstOK = a.recv
			}
		}
	}
	if firstOK.IsZero() {
		t.Fatalf("no request sent after the promotion got a 2xx")
	}
	for _, k := range r.keys {
		n := executions[k.key]
		delete(executions, k.key)
		last := k.attempts[len(k.attempts)-1]
		switch {
		case !last.ok():
			unanswered++
			example("%s: no 2xx after %d attempts, the last %d %s %v", k.key, len(k.attempts), last.status, last.problem, last.err)
		case n > 1:
			twice++
			example("%s: executed %d times", k.key, n)
		case n == 0:
			never++
			example("%s: a 2xx, but the upstream never executed it", k.key)
		}
		if last.ok() && r.table[k.key] != string(store.StatusCompleted) {
			lost++
			example("%s: the promoted server's record is %q, want completed", k.key, r.table[k.key])
		}
		if final[k.key] != string(store.StatusCompleted) {
			incomplete++
			example("%s: the record ended %q, want completed", k.key, final[k.key])
		}
		switch again := k.again; {
		case len(again) == 0 || !again[len(again)-1].ok():
			againUnanswered++
			example("%s: sent again, no 2xx", k.key)
		case again[len(again)-1].replayed:
			againReplayed++
		default:
			againExecuted++
			example("%s: sent again, executed again after %d attempts", k.key, len(again))
		}
		for _, a := range k.again {
			if a.err == nil && !a.ok() {
				againStatuses[fmt.Sprintf("%d %s", a.status, a.problem)]++
			}
		}
		for _, a := range k.retries {
			switch {
			case a.ok() && !a.replayed:
				retriesExecuted++
				example("%s: a retry after the promotion executed it (a takeover of a live owner)", k.key)
			case a.err != nil || a.ok() || a.status == http.StatusConflict && a.problem == "in-progress",
				a.status == http.StatusServiceUnavailable && a.problem == "store-unavailable":
			default:
				unexpected++
				example("%s: unexpected answer to a retry %d %q", k.key, a.status, a.problem)
			}
		}
		var conflictFrom, conflictTo time.Time
		for _, a := range k.attempts {
			switch {
			case a.err != nil:
				transportErrs++
				example("%s: %v", k.key, a.err)
			case a.ok():
				if a.sent.Before(r.kill) && a.recv.After(r.kill) {
					inFlight++
					inFlightWait = max(inFlightWait, a.recv.Sub(a.sent))
				}
			case a.status == http.StatusConflict && a.problem == "in-progress",
				a.status == http.StatusServiceUnavailable && a.problem == "store-unavailable":
				if a.status == http.StatusConflict {
					if conflictFrom.IsZero() {
						conflictFrom = a.sent
					}
					conflictTo = a.recv
				}
			default:
				unexpected++
				example("%s: unexpected answer %d %q", k.key, a.status, a.problem)
			}
			if a.err == nil && !a.recv.Before(r.kill) && a.recv.Before(firstOK) {
				gap[fmt.Sprintf("%d %s", a.status, a.problem)]++
			}
		}
		if !conflictFrom.IsZero() {
			conflicted++
			longestConflict = max(longestConflict, conflictTo.Sub(conflictFrom))
			if conflictTo.After(firstOK) {
				lateConflicts++
				example("%s: 409 in progress from %v to %v after the promotion (lost acquire reply)", k.key,
					conflictFrom.Sub(r.promote).Round(10*time.Millisecond), conflictTo.Sub(r.promote).Round(10*time.Millisecond))
			}
		}
	}
	for key, n := range executions {
		fail("%s: executed %d times, but no client sent it", key, n)
	}
	counted := func(m map[string]int) string {
		var out []string
		for s, n := range m {
			out = append(out, fmt.Sprintf("%s: %d", strings.TrimSpace(s), n))
		}
		sort.Strings(out)
		return strings.Join(out, ", ")
	}
	var storeErrors, lockLost, takeovers, warnings int
	for _, p := range r.procs {
		counts := p.logMessages(t)
		storeErrors += counts["idempotency.store_error"]
		lockLost += counts["idempotency.lock_lost"]
		takeovers += counts["idempotency.takeover"]
		for msg, n := range counts {
			if strings.HasPrefix(msg, asyncWarning) {
				warnings += n
			}
		}
	}
	requests := 0
	for _, k := range r.keys {
		requests += len(k.attempts) + len(k.again)
	}
	mode := "synchronous replication"
	if !synchronous {
		mode = "asynchronous replication"
	}
	if r.lag > 0 {
		mode += fmt.Sprintf(", the standby %v behind", r.lag)
	}
	t.Logf("failover (%s, lock_timeout %v): %d keys, %d requests in %v; primary stopped at %v, "+
		"promotion requested %v later, done in %v; first 2xx %v after the promotion was requested; "+
		"executed twice: %d, never executed: %d, records lost: %d, keys without a 2xx: %d; "+
		"statuses between the stop and the first 2xx: [%s]; requests in flight at the stop that got their 2xx: %d "+
		"(the longest waited %v); keys that got 409 in progress: %d (the longest run %v), still after the first 2xx: %d; "+
		"sent again: %d replayed, %d executed again, %d without a 2xx, other answers [%s]; records not completed in the end: %d; "+
		"transport errors: %d, unexpected answers: %d; logged: %d store errors, %d lock lost, %d takeovers, %d replication warnings",
		mode, r.lock, len(r.keys), requests, r.end.Sub(r.start).Round(10*time.Millisecond),
		r.kill.Sub(r.start).Round(10*time.Millisecond), r.promote.Sub(r.kill).Round(10*time.Millisecond),
		r.promoted.Sub(r.promote).Round(10*time.Millisecond), firstOK.Sub(r.promote).Round(10*time.Millisecond),
		twice, never, lost, unanswered, counted(gap), inFlight, inFlightWait.Round(10*time.Millisecond),
		conflicted, longestConflict.Round(10*time.Millisecond), lateConflicts,
		againReplayed, againExecuted, againUnanswered, counted(againStatuses), incomplete,
		transportErrs, unexpected, storeErrors, lockLost, takeovers, warnings)
	if len(examples) > 0 {
		t.Logf("failover: the first %d notable keys:\n%s", len(examples), strings.Join(examples, "\n"))
	}

	if retriesExecuted > 0 {
		fail("failover: %d retries of slow keys executed them while their owner waited to store the response", retriesExecuted)
	}
	if twice > 0 || never > 0 || lost > 0 || unanswered > 0 || againExecuted > 0 || againUnanswered > 0 || incomplete > 0 {
		fail("failover: %d keys executed twice, %d answered 2xx but never executed, %d records lost, %d keys without a 2xx; "+
			"sent again, %d executed again and %d got no 2xx; %d records not completed in the end",
			twice, never, lost, unanswered, againExecuted, againUnanswered, incomplete)
	}
	if transportErrs > 0 || unexpected > 0 {
		t.Errorf("failover: %d transport errors and %d answers other than 2xx, 503 store unavailable and 409 in progress",
			transportErrs, unexpected)
	}
	if d := firstOK.Sub(r.promote); d > failoverRecovery {
		t.Errorf("failover: the first 2xx came %v after the promotion, want within %v", d, failoverRecovery)
	}
	switch {
	case synchronous && warnings > 0:
		t.Errorf("the replication warning was logged with a synchronous standby")
	case !synchronous && warnings != len(r.procs):
		t.Errorf("%d replication warnings logged with an asynchronous standby, want one per instance", warnings)
	}
}

// pgTableStatuses reads the status of every record by key.
func pgTableStatuses(t testing.TB, dsn string) map[string]string {
	t.Helper()
	table := make(map[string]string)
	for _, row := range pgtest.Query(t, dsn, "SELECT key, status FROM idempotency_keys") {
		table[row[0]] = row[1]
	}
	return table
}
