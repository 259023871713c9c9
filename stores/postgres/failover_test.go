package postgres

import (
	"context"
	"crypto/sha256"
	"net/http"
	"testing"
	"time"

	"github.com/caddy-idempotency/idempotency/internal/pgtest"
	"github.com/caddy-idempotency/idempotency/store"
	"github.com/caddy-idempotency/idempotency/store/storetest"
	"github.com/jackc/pgx/v5"
)

// acquireOn runs the store's acquire of table for one new key on conn,
// as a store whose pool holds conn would, and returns its outcome.
func acquireOn(t *testing.T, conn *pgx.Conn, table string) store.Outcome {
	t.Helper()
	tn, err := ParseTable(table)
	if err != nil {
		t.Fatal(err)
	}
	hash := sha256.Sum256([]byte("tenant"))
	token := store.NewLockToken()
	fp := sha256.Sum256([]byte("body"))
	var n int64
	var outcome int32
	err = conn.QueryRow(context.Background(), newPostgresSQL(tn).acquire.one,
		hash[:], "key-"+pgtest.RandomHex(8), fp[:], http.MethodPost, "/", token[:], int64(time.Hour/time.Microsecond), int64(time.Minute/time.Microsecond),
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
	pair := pgtest.StartPair(t, true, 0)
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
	storetest.WaitFor(t, 10*time.Second, "the standby to replay the migrations", func() bool {
		return pgtest.Query(t, pair.StandbyDSN(), "SELECT to_regclass('idempotency_keys_primaries') IS NOT NULL")[0][0] == "true"
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
	rows := pgtest.Query(t, pair.StandbyDSN(), `SELECT p.system_identifier = (SELECT system_identifier FROM pg_control_system()),
		p.timeline = ('x' || left(pg_walfile_name(pg_current_wal_lsn()), 8))::bit(32)::int AND p.timeline > 1, p.first_seen >= $1
		FROM idempotency_keys_primaries AS p`, promoted)
	if len(rows) != 1 || rows[0][0] != "true" || rows[0][1] != "true" || rows[0][2] != "true" {
		t.Fatalf("the primaries table after an acquire on the promoted server, on a connection opened before: %v; "+
			"want one row, the server's system identifier and its new timeline, first seen after the promotion", rows)
	}
	tn, _ := ParseTable(table)
	var sinceOK bool
	if err := conn.QueryRow(ctx, "SELECT "+primarySinceSQL(tn)+" = (SELECT first_seen FROM idempotency_keys_primaries)").Scan(&sinceOK); err != nil || !sinceOK {
		t.Fatalf("the promoted server's primary_since on that connection is not its row's first_seen (%v)", err)
	}
}
