package idempotency

// Faults, one test each: the database unreachable, its connections
// killed under load, or silent while a response is stored, a Caddy instance killed with SIGKILL mid-request, a
// client hanging up mid-response, and config reloads under load. Each
// checks the upstream's ledger: whatever fails, nothing executes twice.

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/caddy-idempotency/idempotency/internal/pgtest"
	"github.com/caddy-idempotency/idempotency/store"
	"github.com/caddy-idempotency/idempotency/store/storetest"
)

// outcome sends c until it gets an answer that is not transient (409 in
// progress, 503 store unavailable, a transport error), as a client that
// honours the protocol does, and returns it with the number of transient
// answers it met on the way.
func outcome(ctx context.Context, s *site, c call) (reply, int, error) {
	transient := 0
	for {
		r, err := s.DoCtx(ctx, c)
		switch pt := problemType(r); {
		case err != nil && ctx.Err() != nil:
			return reply{}, transient, err
		case err == nil && pt != "in-progress" && pt != "store-unavailable":
			return r, transient, nil
		}
		transient++
		ctxSleep(ctx, 50*time.Millisecond)
	}
}

// Postgres unreachable mid-traffic: requests fail closed (503 with
// Retry-After, the upstream not called) and service comes back by itself
// once the database is reachable again, without restarting Caddy.
func TestFaultPostgresUnreachable(t *testing.T) {
	sb := postgresBackend(t)
	fwd := pgtest.NewForwarder(t, pgtest.Addr(t, sb.DSN))
	up := newUpstream(t)
	s := protectedSite(t, storeBackend{Name: "postgres", DSN: pgtest.ThroughForwarder(t, sb.DSN, fwd), Table: sb.Table},
		up.Addr(), "retry_after 1s", "lock_timeout 2s")

	type sent struct {
		c        call
		at, done time.Time
		reply    reply
		err      error
	}
	var (
		mu   sync.Mutex
		log  []sent
		stop = make(chan struct{})
		wg   sync.WaitGroup
	)
	for range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				select {
				case <-stop:
					return
				default:
				}
				c := call{Key: newKey(), Body: payBody()}
				at := time.Now()
				r, err := s.DoCtx(context.Background(), c)
				mu.Lock()
				log = append(log, sent{c: c, at: at, done: time.Now(), reply: r, err: err})
				mu.Unlock()
				time.Sleep(10 * time.Millisecond)
			}
		}()
	}
	storetest.WaitFor(t, 10*time.Second, "traffic to flow", func() bool {
		mu.Lock()
		defer mu.Unlock()
		return len(log) >= 20
	})
	fwd.Cut()
	cutAt := time.Now()
	time.Sleep(1500 * time.Millisecond)
	// The outage lasts until a request sent into it has been answered: on
	// a loaded machine none may have been within the first 1.5 s.
	storetest.WaitFor(t, 20*time.Second, "a request sent into the outage to be answered", func() bool {
		mu.Lock()
		defer mu.Unlock()
		for _, l := range log {
			if l.at.After(cutAt) {
				return true
			}
		}
		return false
	})
	fwd.Restore()
	restoredAt := time.Now()
	// Traffic runs on until service is back and 20 more requests have
	// been answered, however slow the machine.
	storetest.WaitFor(t, 15*time.Second, "service to come back and traffic to flow", func() bool {
		mu.Lock()
		defer mu.Unlock()
		n := 0
		for _, l := range log {
			if n > 0 || l.at.After(restoredAt) && l.reply.Status == http.StatusCreated {
				n++
			}
		}
		return n > 20
	})
	close(stop)
	wg.Wait()

	executed := make(map[string]int)
	for _, e := range up.Executions() {
		executed[e.Key]++
	}
	sort.Slice(log, func(i, j int) bool { return log[i].at.Before(log[j].at) })
	var before, during, refused, after int
	var recovered time.Time
	for _, l := range log {
		key := l.c.Key
		if l.err != nil {
			t.Errorf("request sent %v after the cut: %v", l.at.Sub(cutAt), l.err)
			continue
		}
		if executed[key] > 1 {
			t.Errorf("%s executed %d times", key, executed[key])
		}
		if l.reply.Status == http.StatusServiceUnavailable {
			refused++
			wantProblem(t, l.reply, http.StatusServiceUnavailable)
			wantRetryAfter(t, l.reply)
			if executed[key] != 0 {
				t.Errorf("%s got 503, but the upstream executed it", key)
			}
		}
		switch {
		case l.done.Before(cutAt):
			before++
		case l.at.After(cutAt) && l.done.Before(restoredAt):
			// Sent and answered while the database was unreachable.
			during++
			if l.reply.Status != http.StatusServiceUnavailable {
				t.Errorf("sent %v into the outage: got %s, want 503", l.at.Sub(cutAt), l.reply)
			}
		case l.at.After(restoredAt):
			after++
			if l.reply.Status == http.StatusCreated && recovered.IsZero() {
				recovered = l.at
			}
			if !recovered.IsZero() && l.reply.Status != http.StatusCreated {
				t.Errorf("sent %v after recovery: got %s", l.at.Sub(recovered), l.reply)
			}
		}
	}
	t.Logf("%d requests before the cut, %d during (%d refused in all), %d after; recovered %v after the restore",
		before, during, refused, after, recovered.Sub(restoredAt).Round(time.Millisecond))
	if before == 0 || during == 0 || recovered.IsZero() {
		t.Fatalf("the traffic did not span the outage and the recovery (recovered: %v)", !recovered.IsZero())
	}
	// At once, but for a loaded machine's requests: the pool dials anew.
	if d := recovered.Sub(restoredAt); d > 5*time.Second {
		t.Errorf("service came back %v after the database did", d)
	}
	// A refused key never executed: its retry executes it, once (after
	// lock_timeout, if the refused acquire had committed all the same,
	// its answer lost with the connection).
	for _, l := range log {
		if l.err != nil || l.reply.Status != http.StatusServiceUnavailable {
			continue
		}
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		r, _, err := outcome(ctx, s, l.c)
		cancel()
		if err != nil || r.Status != http.StatusCreated || r.replayed() {
			t.Errorf("retry of refused key %s: %s, %v; want a first execution", l.c.Key, r, err)
		}
		break
	}
}

// An outage of the database, as the log tells it: with clients sending
// into it as fast as they are answered, each operation writes one
// idempotency.store_error line a second at most, the lines it left out
// counted, and the outage is one warning as it begins and one line as the
// store answers again, counting the requests in flight that it held (their
// completions retried until the store answered). Catches a line per
// refused request (5,165 in a 20 s outage) and requests held without a
// word.
func TestFaultPostgresOutageLogs(t *testing.T) {
	sb := postgresBackend(t)
	fwd := pgtest.NewForwarder(t, pgtest.Addr(t, sb.DSN))
	up := newUpstream(t)
	s := protectedSite(t, storeBackend{Name: "postgres", DSN: pgtest.ThroughForwarder(t, sb.DSN, fwd), Table: sb.Table},
		up.Addr(), "retry_after 1s", "lock_timeout 3s", "prune_interval 0")
	wantExecuted(t, s.Do(t, call{Key: newKey(), Body: payBody()}), http.StatusCreated)

	// Requests in flight as the database goes away: their upstream
	// answers during the outage.
	const inFlight = 3
	var held [inFlight]<-chan reply
	for i := range held {
		held[i] = runBackground(t, s, call{Key: newKey(), Body: payBody(), Header: sleepFor(300 * time.Millisecond)})
	}
	up.WaitStarted(t, 1+inFlight)
	// Clients of their own: a connection whose response has been read
	// whole is idle to its client while its request is held on the
	// server, and a request sent on it would wait for the outage's end.
	clients := *s
	tr := &http.Transport{MaxIdleConnsPerHost: 64}
	t.Cleanup(tr.CloseIdleConnections)
	clients.client = &http.Client{Transport: tr, Timeout: s.client.Timeout}
	fwd.Cut()
	cut := time.Now()
	var refused atomic.Int64
	var wg sync.WaitGroup
	for range 8 {
		wg.Go(func() {
			for time.Since(cut) < 2500*time.Millisecond {
				c := call{Key: newKey(), Body: payBody()}
				r, err := clients.DoCtx(context.Background(), c)
				switch {
				case err != nil:
					t.Errorf("a request into the outage, %s: %v", c.Key, err)
					return
				case r.Status == http.StatusServiceUnavailable:
					refused.Add(1)
				default:
					t.Errorf("a request into the outage: %s, want 503", r)
				}
			}
		})
	}
	wg.Wait()
	fwd.Restore()
	down := time.Since(cut)
	for _, ch := range held {
		wantExecuted(t, <-ch, http.StatusCreated)
	}
	storetest.WaitFor(t, 10*time.Second, "service to come back", func() bool {
		r, err := s.DoCtx(context.Background(), call{Key: newKey(), Body: payBody()})
		return err == nil && r.Status == http.StatusCreated
	})
	executed := make(map[string]int)
	for _, e := range up.Executions() {
		if executed[e.Key]++; executed[e.Key] > 1 {
			t.Errorf("%s executed %d times", e.Key, executed[e.Key])
		}
	}

	var unavailable, recovered []map[string]any
	last, tooClose := map[string]float64{}, map[string]bool{}
	events := int64(0)
	for _, l := range s.moduleLogLines(t) {
		switch l["msg"] {
		case "idempotency.store_unavailable":
			unavailable = append(unavailable, l)
		case "idempotency.store_recovered":
			recovered = append(recovered, l)
		case "idempotency.store_error":
			op, _ := l["operation"].(string)
			ts, _ := l["ts"].(float64)
			if prev, ok := last[op]; ok && ts-prev < 0.99 && !tooClose[op] {
				tooClose[op] = true
				t.Errorf("two %s store_error lines %.3fs apart", op, ts-prev)
			}
			last[op] = ts
			if op == store.OpAcquire {
				n, _ := l["suppressed"].(float64)
				events += 1 + int64(n)
			}
		}
	}
	if len(unavailable) != 1 || len(recovered) != 1 {
		t.Fatalf("%d store_unavailable and %d store_recovered lines for one outage, want one each", len(unavailable), len(recovered))
	}
	u, r := unavailable[0], recovered[0]
	if u["level"] != "warn" || r["level"] != "info" || u["ts"].(float64) > r["ts"].(float64) {
		t.Errorf("the outage's lines: %v, then %v", u, r)
	}
	if r["held"] != float64(inFlight) {
		t.Errorf("the store answered again after holding %v requests, want the %d in flight: %v", r["held"], inFlight, r)
	}
	if d, _ := r["down_seconds"].(float64); d < 1 || d > down.Seconds()+5 {
		t.Errorf("the store answered again after %vs, for an outage of %v", r["down_seconds"], down)
	}
	left, _ := r["suppressed_store_errors"].(map[string]any)
	n, _ := left[store.OpAcquire].(float64)
	events += int64(n)
	if events != refused.Load() {
		t.Errorf("the acquire lines account for %d failures, and the lines they left out with them; %d requests were refused",
			events, refused.Load())
	}
	t.Logf("%d requests refused during an outage of %v", refused.Load(), down.Round(time.Millisecond))
	data, err := os.ReadFile(s.LogPath)
	if err != nil {
		t.Fatal(err)
	}
	for _, line := range strings.Split(string(data), "\n") {
		if strings.Contains(line, `"msg":"idempotency.store_`) {
			t.Logf("%s", line)
		}
	}
}

// A database that goes silent (its replies lost, no reset: a host that
// died, a failover without one) for a third of lock_timeout must not let
// a lease run out: a retry on another instance would take the record
// over and execute it a second time. The statements in flight get no
// reply, so the next ones, on live connections, must be sent while the
// lock is still held: the completion's next attempt, when the silence
// comes as the response is being stored; the renewals that follow a
// stuck one, when it comes while the upstream runs. Catches a completion
// attempt bounded by the store timeout (5s, longer than this lock's
// whole lease), renewals that stop once the response is being stored,
// and renewals sent again only an interval after a stuck one.
func TestFaultPostgresSilent(t *testing.T) {
	for _, tc := range []struct {
		name string
		// work is how long the upstream runs after the silence
		// begins; the response is stored as it ends.
		work time.Duration
	}{
		{"during complete", 0},
		{"during execution", 2 * time.Second},
	} {
		t.Run(tc.name, func(t *testing.T) { testPostgresSilent(t, tc.work) })
	}
}

func testPostgresSilent(t *testing.T, work time.Duration) {
	sb := postgresBackend(t)
	fwd := pgtest.NewForwarder(t, pgtest.Addr(t, sb.DSN))
	const silence = time.Second
	var executions atomic.Int32
	up := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body)
		if executions.Add(1) == 1 {
			fwd.Mute()
			time.AfterFunc(silence, fwd.Unmute)
			time.Sleep(work)
		}
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusCreated)
		fmt.Fprintf(w, `{"charge":%d}`, executions.Load())
	}))
	t.Cleanup(up.Close)

	portA, portB := freeTCPPort(t), freeTCPPort(t)
	site := func(port int, dsn string) string {
		return fmt.Sprintf(`http://127.0.0.1:%d {
	idempotency {
		%s
		lock_timeout 3s
		retry_after 1s
	}
	reverse_proxy %s
}
`, port, storeBackend{Name: "postgres", DSN: dsn, Table: sb.Table}.Block(), strings.TrimPrefix(up.URL, "http://"))
	}
	srv := startCaddyfile(t, site(portA, pgtest.ThroughForwarder(t, sb.DSN, fwd))+site(portB, sb.DSN))
	a, b := newSiteClient(t, srv, portA), newSiteClient(t, srv, portB)

	c := call{Key: newKey(), Body: payBody()}
	type answer struct {
		r   reply
		err error
		at  time.Time
	}
	first := make(chan answer, 1)
	go func() {
		r, err := a.DoCtx(context.Background(), c)
		first <- answer{r, err, time.Now()}
	}()
	storetest.WaitFor(t, 15*time.Second, "the first execution", func() bool { return executions.Load() > 0 })
	executed := time.Now()

	// Another instance retries the key, as a client that timed out
	// would, until it gets the stored answer.
	var retried reply
	deadline := executed.Add(work + 10*silence)
	for {
		r, err := b.DoCtx(context.Background(), c)
		if err != nil {
			t.Fatalf("retry: %v", err)
		}
		if r.Status != http.StatusConflict {
			retried = r
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the retry still got 409 %v after the first execution", time.Since(executed).Round(time.Millisecond))
		}
		time.Sleep(100 * time.Millisecond)
	}
	got := <-first
	t.Logf("the retry got its answer %v after the first execution began; the first request %v",
		time.Since(executed).Round(time.Millisecond), got.at.Sub(executed).Round(time.Millisecond))
	if n := executions.Load(); n != 1 {
		t.Fatalf("the key executed %d times; the retry got %v", n, retried)
	}
	if got.err != nil || got.r.Status != http.StatusCreated {
		t.Errorf("the first request got %v, %v; want its 201", got.r, got.err)
	}
	if !retried.replayed() || retried.Status != http.StatusCreated || string(retried.Body) != `{"charge":1}` {
		t.Errorf("the retry got %v, want the first answer replayed", retried)
	}
}

// Connections killed under load (pg_terminate_backend, as a database
// restart or a failover does to them): requests fail closed while it
// lasts, no key executes twice, and service recovers without a restart.
func TestFaultPostgresConnectionsKilled(t *testing.T) {
	sb := postgresBackend(t)
	app := "idem_kill_" + pgtest.RandomHex(4)
	up := newUpstream(t)
	// A completion is retried while its lock is younger than
	// lock_timeout: a few kills of every connection leave it time.
	s := protectedSite(t, storeBackend{Name: "postgres", DSN: pgtest.WithApplicationName(sb.DSN, app), Table: sb.Table},
		up.Addr(), "retry_after 1s", "lock_timeout 5s")

	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	// The killer's own connection has another application_name.
	killer := pgtest.Connect(t, sb.DSN)
	killerDone := make(chan int)
	stopKiller := make(chan struct{})
	go func() {
		killed := 0
		defer func() { killerDone <- killed }()
		for first := true; ; first = false {
			if !first {
				select {
				case <-stopKiller:
					return
				case <-time.After(500 * time.Millisecond):
				}
			}
			var n int
			if err := killer.QueryRow(ctx, "SELECT count(*) FILTER (WHERE pg_terminate_backend(pid)) "+
				"FROM pg_stat_activity WHERE datname = current_database() AND application_name = $1", app).Scan(&n); err != nil {
				t.Errorf("killing connections: %v", err)
				return
			}
			killed += n
		}
	}()

	const keys, clients = 100, 2
	var transient atomic.Int64
	answers := make([][clients]reply, keys)
	bodies := make([][]byte, keys)
	callOf := func(i int) call {
		return call{Key: fmt.Sprintf("kill-%s-%04d", app, i), Body: bodies[i],
			Header: sleepFor(time.Duration(i%7) * 25 * time.Millisecond)}
	}
	var wg sync.WaitGroup
	sem := make(chan struct{}, 16)
	for i := range keys {
		bodies[i] = payBody()
		for c := range clients {
			wg.Add(1)
			sem <- struct{}{}
			go func() {
				defer wg.Done()
				defer func() { <-sem }()
				r, n, err := outcome(ctx, s, callOf(i))
				if err != nil {
					t.Errorf("key %d client %d: %v", i, c, err)
				}
				transient.Add(int64(n))
				answers[i][c] = r
			}()
		}
	}
	wg.Wait()
	close(stopKiller)
	killed := <-killerDone

	// Service recovers by itself: after a first failure on each
	// connection the pool may still hold from the last kill, requests
	// succeed again.
	recovered := false
	for range 20 {
		if r := s.Do(t, call{Key: newKey(), Body: payBody()}); r.Status == http.StatusCreated {
			recovered = true
			break
		}
	}
	if !recovered {
		t.Fatalf("still failing after the kills stopped")
	}
	for range 10 {
		wantExecuted(t, s.Do(t, call{Key: newKey(), Body: payBody()}), http.StatusCreated)
	}

	executed := make(map[string]int)
	for _, e := range up.Executions() {
		executed[e.Key]++
	}
	for i := range keys {
		key := callOf(i).Key
		if executed[key] != 1 {
			t.Errorf("%s executed %d times, want once", key, executed[key])
		}
		if a, b := answers[i][0], answers[i][1]; a.Status != b.Status || string(a.Body) != string(b.Body) {
			t.Errorf("%s: the two clients got different answers:\n%s\n%s", key, a, b)
		}
	}
	// A client has its answer while its record is being completed: the
	// last ones may still be on their way.
	notCompleted := func() string {
		return pgtest.Query(t, sb.DSN, "SELECT count(*) FROM "+pgtest.QuoteIdent(sb.Table)+" WHERE status <> 'completed'")[0][0]
	}
	deadline := time.Now().Add(10 * time.Second)
	for notCompleted() != "0" && time.Now().Before(deadline) {
		time.Sleep(50 * time.Millisecond)
	}
	if n := notCompleted(); n != "0" {
		t.Errorf("%s records not completed", n)
	}
	t.Logf("%d connections killed, %d transient answers (409 in progress, 503) along the way", killed, transient.Load())
	if killed == 0 || transient.Load() == 0 {
		t.Errorf("the kills did not reach the traffic (%d killed, %d transient answers)", killed, transient.Load())
	}
}

// An instance killed with SIGKILL mid-request leaves its record in
// progress, with nobody to renew the lock: retries (here on the other
// instance) get 409 with Retry-After until the lock is lock_timeout old,
// then exactly one retrier takes it over and executes, and the others get
// its replay.
func TestFaultCaddySIGKILLMidRequest(t *testing.T) {
	sb := postgresBackend(t)
	up := newUpstream(t)
	const lockTimeout = 1500 * time.Millisecond
	siteBlock := func(port int) string {
		return fmt.Sprintf(`http://127.0.0.1:%d {
	idempotency {
		%s
		lock_timeout %s
		retry_after 1s
	}
	reverse_proxy %s
}
`, port, sb.Block(), lockTimeout, up.Addr())
	}
	portA, portB := freeTCPPort(t), freeTCPPort(t)
	a := startCaddyProc(t, "a", siteBlock(portA))
	b := startCaddyProc(t, "b", siteBlock(portB))
	siteA, siteB := procSite(t, a, portA), procSite(t, b, portB)

	c := call{Key: newKey(), Body: payBody(), Header: sleepFor(time.Second)}
	firstErr := make(chan error, 1)
	go func() {
		_, err := siteA.DoCtx(context.Background(), c)
		firstErr <- err
	}()
	up.WaitStarted(t, 1)
	time.Sleep(100 * time.Millisecond) // past the acquire: A is executing
	a.Kill(t)
	killedAt := time.Now()
	if err := <-firstErr; err == nil {
		t.Fatalf("the request to the killed instance got an answer")
	}

	type answer struct {
		at time.Time
		r  reply
	}
	const retriers = 4
	answers := make([][]answer, retriers)
	var wg sync.WaitGroup
	for i := range retriers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			deadline := time.Now().Add(15 * time.Second)
			for time.Now().Before(deadline) {
				at := time.Now()
				r, err := siteB.DoCtx(context.Background(), call{Key: c.Key, Body: c.Body, Header: c.Header})
				if err != nil {
					t.Errorf("retrier %d: %v", i, err)
					return
				}
				answers[i] = append(answers[i], answer{at, r})
				if problemType(r) != "in-progress" {
					return
				}
				time.Sleep(time.Duration(80+20*i) * time.Millisecond)
			}
			t.Errorf("retrier %d got no outcome", i)
		}()
	}
	wg.Wait()

	execs := up.Executions()
	if len(execs) != 2 {
		t.Fatalf("the upstream executed %d times, want 2: the killed instance's attempt and one takeover", len(execs))
	}
	takeoverID := execs[1].ID
	// A renewed its lock at most a renewal interval before it died.
	earliest := killedAt.Add(lockTimeout - lockTimeout/3 - 100*time.Millisecond)
	var executed []answer
	conflicts := 0
	for i, as := range answers {
		for _, an := range as {
			switch {
			case problemType(an.r) == "in-progress":
				conflicts++
				wantRetryAfter(t, an.r)
			case an.r.replayed():
				if an.r.Header.Get("X-Execution-Id") != takeoverID {
					t.Errorf("retrier %d: replay of %q, want of the takeover's execution %s", i, an.r.Header.Get("X-Execution-Id"), takeoverID)
				}
			default:
				executed = append(executed, an)
				wantExecuted(t, an.r, http.StatusCreated)
			}
		}
	}
	if len(executed) != 1 {
		t.Fatalf("%d retriers executed, want exactly one", len(executed))
	}
	took := executed[0].at.Sub(killedAt)
	t.Logf("takeover %v after the kill (lock_timeout %v), %d conflicts before and during it", took.Round(time.Millisecond), lockTimeout, conflicts)
	if executed[0].at.Before(earliest) {
		t.Errorf("taken over %v after the kill: before the lock could be stale", took)
	}
	// The machine's speed shows in the gaps between a retrier's
	// requests (80-140ms apart when it is idle): the takeover comes
	// within a second and the longest of them of the stale lock.
	var gap time.Duration
	for _, as := range answers {
		for j := 1; j < len(as); j++ {
			gap = max(gap, as[j].at.Sub(as[j-1].at))
		}
	}
	if took > lockTimeout+time.Second+gap {
		t.Errorf("taken over only %v after the kill, lock_timeout is %v, retries at most %v apart", took, lockTimeout, gap)
	}
	if n := b.logMessages(t)["idempotency.takeover"]; n != 1 {
		t.Errorf("%d idempotency.takeover log lines, want 1", n)
	}
}

// A client that hangs up mid-response, after the first bytes reached it:
// the upstream's response is still read to its end and stored, and the
// retry gets all of it. (TestClientDisconnectStillCompletes hangs up
// before the response starts.) Catches a recorder that stops recording,
// or a proxy that stops reading, when writes to the client fail.
func TestFaultClientDisconnectMidResponse(t *testing.T) {
	eachStore(t, func(t *testing.T, sb storeBackend) {
		up := newUpstream(t)
		s := protectedSite(t, sb, up.Addr())
		gate := "g-" + pgtest.RandomHex(4)
		c := call{Key: newKey(), Body: payBody(), Header: map[string]string{"X-Test-Gate": gate}}
		ctx, cancel := context.WithCancel(context.Background())
		req, err := s.request(ctx, c)
		if err != nil {
			t.Fatal(err)
		}
		resp, err := s.client.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		first := make([]byte, 64)
		n, _ := resp.Body.Read(first)
		if !strings.HasPrefix(string(first[:n]), "first-") {
			t.Fatalf("first chunk %q", first[:n])
		}
		cancel() // hang up with the response half sent
		resp.Body.Close()
		up.Open(gate)
		up.WaitEnded(t, 1)
		e := up.Executions()[0]
		if !e.Finished {
			t.Fatalf("the upstream did not finish its response after the client hung up")
		}

		r := pollPastInProgress(t, s, call{Key: c.Key, Body: c.Body})
		if want := "first-" + e.ID + "\nsecond\n"; !r.replayed() || string(r.Body) != want {
			t.Errorf("retry after hanging up mid-response: got %s, want a replay of %q", r, want)
		}
		wantCount(t, up, 1)
	})
}

// doThroughReload sends c, and sends it again, with the same key, when
// the connection is reset before an answer: Caddy opens a new listening
// socket for each config (SO_REUSEPORT) and closes the old one, and Linux
// resets the connections still queued on it. A client does what the key
// is for: it sends the request again. reset reports that it did.
func doThroughReload(s *site, c call, resets *atomic.Int64) (r reply, reset bool, err error) {
	for range 5 {
		r, err = s.DoCtx(context.Background(), c)
		if !errors.Is(err, syscall.ECONNRESET) && !errors.Is(err, io.EOF) {
			return r, reset, err
		}
		reset = true
		resets.Add(1)
	}
	return r, reset, err
}

// Config reloads under load, as an operator does them (POST /load): no
// request fails but for a reset connection that the client sends again,
// no key executes twice, and the database connections do not pile up. Reloads
// that keep the dsn and max_conns share the pool, and its connections; a
// reload that changes max_conns opens a new pool and closes the old one.
func TestFaultConfigReloadUnderLoad(t *testing.T) {
	sb := postgresBackend(t)
	app := "idem_reload_" + pgtest.RandomHex(4)
	dsn := pgtest.WithApplicationName(sb.DSN, app)
	up := newUpstream(t)
	port := freeTCPPort(t)
	config := func(i int) (string, int) {
		maxConns := 4
		if i%3 == 2 {
			maxConns = 5
		}
		return fmt.Sprintf(`http://127.0.0.1:%d {
	idempotency {
		store postgres {
			dsn %q
			table %s
			max_conns %d
		}
		retry_after %ds
		lock_timeout %ds
	}
	reverse_proxy %s
}
`, port, dsn, sb.Table, maxConns, 1+i%2, 5+i%4, up.Addr()), maxConns
	}
	first, _ := config(0)
	p := startCaddyProc(t, "reloaded", first)
	s := procSite(t, p, port)

	var (
		stop     = make(chan struct{})
		wg       sync.WaitGroup
		requests atomic.Int64
		resets   atomic.Int64
	)
	for i := range 6 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				select {
				case <-stop:
					return
				default:
				}
				c := call{Key: newKey(), Body: payBody()}
				if i%2 == 0 {
					c.Header = sleepFor(150 * time.Millisecond) // in flight across reloads
				}
				r, reset, err := doThroughReload(s, c, &resets)
				if err != nil || r.Status != http.StatusCreated || r.replayed() && !reset {
					t.Errorf("first request during reloads: %s, %v", r, err)
					continue
				}
				again, _, err := doThroughReload(s, c, &resets)
				if err != nil || !again.replayed() || string(again.Body) != string(r.Body) {
					t.Errorf("replay during reloads: %s, %v", again, err)
				}
				requests.Add(2)
			}
		}()
	}

	pids := make(map[string]bool)
	sample := func() int {
		rows := pgtest.Query(t, sb.DSN, "SELECT pid FROM pg_stat_activity WHERE datname = current_database() AND application_name = $1", app)
		for _, r := range rows {
			pids[r[0]] = true
		}
		return len(rows)
	}
	const reloads = 9
	pools := 1
	_, prevMax := config(0)
	most := 0
	for i := 1; i <= reloads; i++ {
		time.Sleep(300 * time.Millisecond)
		most = max(most, sample())
		cfg, maxConns := config(i)
		if maxConns != prevMax {
			pools++
		}
		prevMax = maxConns
		if err := p.Load(cfg); err != nil {
			t.Fatalf("reload %d: %v", i, err)
		}
		most = max(most, sample())
	}
	time.Sleep(300 * time.Millisecond)
	close(stop)
	wg.Wait()

	_, lastMax := config(reloads)
	storetest.WaitFor(t, 15*time.Second, "the connections to settle", func() bool { return sample() <= lastMax })
	t.Logf("%d requests through %d reloads (%d connections reset and the request sent again); at most %d connections at once, %d distinct over the run, %d pools",
		requests.Load(), reloads, resets.Load(), most, len(pids), pools)
	if requests.Load() == 0 {
		t.Fatal("no request went through")
	}
	executed := make(map[string]int)
	for _, e := range up.Executions() {
		if executed[e.Key]++; executed[e.Key] == 2 {
			t.Errorf("%s executed twice", e.Key)
		}
	}
	// During a reload that changes the pool, the old one closes after the
	// new one opened.
	if most > 4+5 {
		t.Errorf("%d connections at once, more than two pools' worth", most)
	}
	if len(pids) > pools*5 {
		t.Errorf("%d distinct connections over %d reloads with %d pools: reloads opened connections", len(pids), reloads, pools)
	}
}
