package idempotency

import (
	"context"
	"fmt"
	"net/http"
	"os"
	"testing"
	"time"

	"github.com/caddy-idempotency/idempotency/internal/pgtest"
	"github.com/caddy-idempotency/idempotency/store"
	"github.com/jackc/pgx/v5"
)

// A graceful stop whose grace_period ends before a protected request does
// must not leave its record in progress: the process waits for the
// request to store its response, so that the client's retry, on another
// instance, gets a replay instead of a takeover and a second execution.
func TestGracefulStopStoresRequestsInFlight(t *testing.T) {
	sb := postgresBackend(t)
	up := newUpstream(t)
	siteBlock := func(port int) string {
		return fmt.Sprintf(`http://127.0.0.1:%d {
	idempotency {
		%s
		lock_timeout 1s
	}
	reverse_proxy %s
}
`, port, sb.Block(), up.Addr())
	}
	portA, portB := freeTCPPort(t), freeTCPPort(t)
	// The processes' grace_period is 5s: the request outlasts it.
	a := startCaddyProc(t, "a", siteBlock(portA))
	b := startCaddyProc(t, "b", siteBlock(portB))
	siteA, siteB := procSite(t, a, portA), procSite(t, b, portB)

	c := call{Key: newKey(), Body: payBody(), Header: sleepFor(6500 * time.Millisecond)}
	go func() { _, _ = siteA.DoCtx(context.Background(), c) }()
	up.WaitStarted(t, 1)
	if err := a.cmd.Process.Signal(os.Interrupt); err != nil {
		t.Fatal(err)
	}
	select {
	case <-a.exited:
	case <-time.After(20 * time.Second):
		t.Fatal("instance a did not exit")
	}
	rows := pgtest.Query(t, sb.DSN, "SELECT status FROM "+pgx.Identifier{sb.Table}.Sanitize()+" WHERE key = $1", c.Key)
	if len(rows) != 1 || rows[0][0] != string(store.StatusCompleted) {
		t.Fatalf("after the stop, the record is %v, want completed", rows)
	}
	r := siteB.Do(t, call{Key: c.Key, Body: c.Body, Header: c.Header})
	if r.Status != http.StatusCreated || !r.replayed() {
		t.Fatalf("retry on the other instance: %s, want a replay", r)
	}
	wantCount(t, up, 1)
}
