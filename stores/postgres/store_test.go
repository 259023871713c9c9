package postgres

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"net/url"
	"reflect"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/caddy-idempotency/idempotency/internal/pgtest"
	"github.com/caddy-idempotency/idempotency/migrations"
	"github.com/caddy-idempotency/idempotency/store"
	"github.com/caddy-idempotency/idempotency/store/storetest"
	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

func TestPostgresAcquireCreatesThenReturnsExisting(t *testing.T) {
	t.Parallel()
	s := newTestStore(t, pgtest.FreshTable(t), 8)
	req := storetest.Request("cred", "key-00000001", `{"amount":100}`)

	before := time.Now()
	storetest.MustAcquire(t, s, req, store.OutcomeCreated)

	rec := storetest.MustAcquire(t, s, storetest.Retry(req), store.OutcomeExisting)
	if rec.Status != store.StatusInProgress || rec.Fingerprint != req.Fingerprint ||
		rec.Method != req.Method || rec.Path != req.Path || rec.Response != nil {
		t.Errorf("record = %+v", rec)
	}
	for name, ts := range map[string]time.Time{"created_at": rec.CreatedAt, "locked_at": rec.LockedAt} {
		if ts.Location() != time.UTC || ts.Sub(before).Abs() > 5*time.Second {
			t.Errorf("%s = %v, want about %v in UTC", name, ts, before)
		}
	}
	if got := rec.ExpiresAt.Sub(rec.CreatedAt); got != req.Retention {
		t.Errorf("expires_at - created_at = %v, want %v", got, req.Retention)
	}

	// Another credential's identical key is another record.
	other := storetest.Retry(req)
	other.Key.CredentialHash = sha256.Sum256([]byte("tenant B"))
	storetest.MustAcquire(t, s, other, store.OutcomeCreated)
}

func TestPostgresCompleteThenReplay(t *testing.T) {
	t.Parallel()
	s := newTestStore(t, pgtest.FreshTable(t), 8)
	tests := []struct {
		name string
		resp store.Response
		want store.Response
	}{
		{
			name: "headers and body",
			resp: store.Response{
				Status: http.StatusCreated,
				Header: http.Header{
					"Content-Type": {"application/json"},
					"Link":         {"</a>; rel=next", "</b>; rel=last"},
					"X-Empty":      {""},
				},
				Body:       []byte("{\"id\":\"ch_1\"}\x00\xff binary-safe"),
				Replayable: true,
				BodySize:   27,
			},
		},
		{
			name: "empty body, no headers",
			resp: store.Response{Status: http.StatusNoContent, Replayable: true},
			want: store.Response{Status: http.StatusNoContent, Header: http.Header{}, Body: []byte{}, Replayable: true},
		},
		{
			name: "body too large to keep",
			resp: store.Response{
				Status:     http.StatusOK,
				Header:     http.Header{"Content-Type": {"text/csv"}},
				Body:       []byte("partial bytes the store must not keep"),
				Replayable: false,
				BodySize:   5 << 20,
			},
			want: store.Response{
				Status:   http.StatusOK,
				Header:   http.Header{"Content-Type": {"text/csv"}},
				BodySize: 5 << 20,
			},
		},
	}
	for i, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			req := storetest.Request("cred", fmt.Sprintf("complete-%d", i), "body")
			storetest.MustAcquire(t, s, req, store.OutcomeCreated)
			if err := s.Complete(context.Background(), req.Key, req.Token, &tt.resp, req.Retention); err != nil {
				t.Fatalf("complete: %v", err)
			}
			rec := storetest.MustAcquire(t, s, storetest.Retry(req), store.OutcomeExisting)
			if rec.Status != store.StatusCompleted || !rec.LockedAt.IsZero() {
				t.Errorf("status %q, locked_at %v", rec.Status, rec.LockedAt)
			}
			want := tt.want
			if want.Status == 0 {
				want = tt.resp
			}
			if !reflect.DeepEqual(rec.Response, &want) {
				t.Errorf("response =\n%#v\nwant\n%#v", rec.Response, &want)
			}
		})
	}
}

func TestPostgresConcurrentAcquireHasOneWinner(t *testing.T) {
	const callers = 40
	s := newTestStore(t, pgtest.FreshTable(t), callers)
	req := storetest.Request("cred", "race-0000001", "body")

	outcomes := raceAcquire(t, s, req, callers)
	if outcomes[store.OutcomeCreated] != 1 || outcomes[store.OutcomeExisting] != callers-1 {
		t.Fatalf("outcomes = %v, want one created and %d existing", outcomes, callers-1)
	}
}

// raceAcquire makes n callers acquire req at once and counts the outcomes.
func raceAcquire(t *testing.T, s *Store, req store.AcquireRequest, n int) map[store.Outcome]int {
	t.Helper()
	// Open the connections first, so that the callers race on the row
	// rather than on dialling.
	warm := make([]func(), 0, n)
	for range n {
		c, err := s.pool.Acquire(context.Background())
		if err != nil {
			t.Fatal(err)
		}
		warm = append(warm, c.Release)
	}
	for _, release := range warm {
		release()
	}
	return storetest.AcquireConcurrently(t, s, req, n)
}

func TestPostgresStaleLockTakeover(t *testing.T) {
	const callers = 30
	s := newTestStore(t, pgtest.FreshTable(t), callers)
	ctx := context.Background()
	owner := storetest.Request("cred", "stale-000001", "body")
	storetest.MustAcquire(t, s, owner, store.OutcomeCreated)
	created := storetest.MustAcquire(t, s, storetest.Retry(owner), store.OutcomeExisting).CreatedAt

	// The owner died an hour ago.
	mustExec(t, s, "UPDATE "+s.table.quoted()+" SET locked_at = now() - interval '1 hour', locked_until = now() - interval '1 hour' + interval '30 seconds'")
	primaryLongUp(t, s.DSN, s.Table)

	t.Run("other request does not take over", func(t *testing.T) {
		other := storetest.Request("cred", owner.Key.Key, "another body")
		rec := storetest.MustAcquire(t, s, other, store.OutcomeExisting)
		if rec.Fingerprint != owner.Fingerprint {
			t.Errorf("the record's fingerprint changed")
		}
	})

	outcomes := raceAcquire(t, s, owner, callers)
	if outcomes[store.OutcomeTakenOver] != 1 || outcomes[store.OutcomeExisting] != callers-1 {
		t.Fatalf("outcomes = %v, want one taken over and %d existing", outcomes, callers-1)
	}

	rec := storetest.MustAcquire(t, s, storetest.Retry(owner), store.OutcomeExisting)
	if !rec.CreatedAt.Equal(created) {
		t.Errorf("created_at moved from %v to %v on takeover", created, rec.CreatedAt)
	}
	if age := time.Since(rec.LockedAt); age > 10*time.Second {
		t.Errorf("lock is %v old after takeover", age)
	}
	if err := s.Complete(ctx, owner.Key, owner.Token, &store.Response{Status: 200, Replayable: true}, owner.Retention); !errors.Is(err, store.ErrLockLost) {
		t.Errorf("the dead owner's complete: %v, want ErrLockLost", err)
	}
}

func TestPostgresRenewPreventsTakeover(t *testing.T) {
	t.Parallel()
	s := newTestStore(t, pgtest.FreshTable(t), 8)
	ctx := context.Background()
	owner := storetest.Request("cred", "renew-000001", "body")
	// A 1s lock: a retry's acquire after a renewal may wait a while on a
	// loaded machine, and must still find the lock held.
	owner.LockTimeout = time.Second
	storetest.MustAcquire(t, s, owner, store.OutcomeCreated)

	// Four lock timeouts long: without the renewals, the retries would
	// take over from the third one on.
	for range 12 {
		time.Sleep(owner.LockTimeout / 3)
		if err := s.Renew(ctx, owner.Key, owner.Token); err != nil {
			t.Fatalf("renew: %v", err)
		}
		storetest.MustAcquire(t, s, storetest.Retry(owner), store.OutcomeExisting)
	}

	time.Sleep(2 * owner.LockTimeout)
	storetest.MustAcquire(t, s, storetest.Retry(owner), store.OutcomeTakenOver)
	if err := s.Renew(ctx, owner.Key, owner.Token); !errors.Is(err, store.ErrLockLost) {
		t.Errorf("renew after takeover: %v, want ErrLockLost", err)
	}
}

func TestPostgresLockLost(t *testing.T) {
	t.Parallel()
	s := newTestStore(t, pgtest.FreshTable(t), 8)
	ctx := context.Background()
	resp := &store.Response{Status: http.StatusOK, Header: http.Header{}, Body: []byte("ok"), Replayable: true, BodySize: 2}
	ops := map[string]func(store.RecordKey, store.LockToken) error{
		"complete": func(k store.RecordKey, tok store.LockToken) error { return s.Complete(ctx, k, tok, resp, time.Hour) },
		"release":  func(k store.RecordKey, tok store.LockToken) error { return s.Release(ctx, k, tok) },
		"renew":    func(k store.RecordKey, tok store.LockToken) error { return s.Renew(ctx, k, tok) },
	}
	// A record that is gone is released (an earlier attempt whose reply
	// was lost released it), and one completed by the token is completed
	// (an earlier attempt completed it).
	wantLost := func(t *testing.T, k store.RecordKey, tok store.LockToken, except ...string) {
		t.Helper()
		for name, op := range ops {
			err := op(k, tok)
			if slices.Contains(except, name) {
				if err != nil {
					t.Errorf("%s: %v, want nil", name, err)
				}
			} else if !errors.Is(err, store.ErrLockLost) {
				t.Errorf("%s: %v, want ErrLockLost", name, err)
			}
		}
	}

	req := storetest.Request("cred", "lost-0000001", "body")
	storetest.MustAcquire(t, s, req, store.OutcomeCreated)

	t.Run("wrong token", func(t *testing.T) {
		wantLost(t, req.Key, store.NewLockToken())
		storetest.MustAcquire(t, s, storetest.Retry(req), store.OutcomeExisting) // untouched
	})
	t.Run("no such record", func(t *testing.T) {
		wantLost(t, storetest.Request("cred", "never-acquired", "").Key, req.Token, "release")
	})
	t.Run("after release", func(t *testing.T) {
		r := storetest.Request("cred", "lost-0000002", "body")
		storetest.MustAcquire(t, s, r, store.OutcomeCreated)
		if err := s.Release(ctx, r.Key, r.Token); err != nil {
			t.Fatalf("release: %v", err)
		}
		wantLost(t, r.Key, r.Token, "release")
		storetest.MustAcquire(t, s, storetest.Retry(r), store.OutcomeCreated)
	})
	t.Run("after complete", func(t *testing.T) {
		if err := s.Complete(ctx, req.Key, req.Token, resp, req.Retention); err != nil {
			t.Fatalf("complete: %v", err)
		}
		wantLost(t, req.Key, req.Token, "complete")
		rec := storetest.MustAcquire(t, s, storetest.Retry(req), store.OutcomeExisting)
		if rec.Status != store.StatusCompleted {
			t.Errorf("status %q after a late release or renew", rec.Status)
		}
	})
}

func TestPostgresExpiredRecordIsCreatedAnew(t *testing.T) {
	t.Parallel()
	s := newTestStore(t, pgtest.FreshTable(t), 8)
	ctx := context.Background()

	for _, completed := range []bool{true, false} {
		t.Run(fmt.Sprintf("completed=%v", completed), func(t *testing.T) {
			old := storetest.Request("cred", fmt.Sprintf("expired-%v", completed), "old body")
			storetest.MustAcquire(t, s, old, store.OutcomeCreated)
			if completed {
				if err := s.Complete(ctx, old.Key, old.Token, &store.Response{Status: 201, Replayable: true}, old.Retention); err != nil {
					t.Fatal(err)
				}
			}
			oldRec := storetest.MustAcquire(t, s, storetest.Retry(old), store.OutcomeExisting)
			// An in-progress record expires only once its lease has ended
			// too (TestPostgresLiveLeaseNeverExpires).
			mustExec(t, s, "UPDATE "+s.table.quoted()+" SET expires_at = now() - interval '1 second', locked_until = now() - interval '1 second' WHERE key = $1", old.Key.Key)

			// Even with another body: an expired key is a free key.
			fresh := storetest.Request("cred", old.Key.Key, "new body")
			storetest.MustAcquire(t, s, fresh, store.OutcomeCreated)
			rec := storetest.MustAcquire(t, s, storetest.Retry(fresh), store.OutcomeExisting)
			if rec.Status != store.StatusInProgress || rec.Fingerprint != fresh.Fingerprint || rec.Response != nil {
				t.Errorf("record = %+v", rec)
			}
			if !rec.CreatedAt.After(oldRec.CreatedAt) || !rec.ExpiresAt.After(time.Now()) {
				t.Errorf("created_at %v (was %v), expires_at %v", rec.CreatedAt, oldRec.CreatedAt, rec.ExpiresAt)
			}
			if err := s.Complete(ctx, old.Key, old.Token, &store.Response{Status: 200, Replayable: true}, old.Retention); !errors.Is(err, store.ErrLockLost) {
				t.Errorf("complete by the expired record's owner: %v, want ErrLockLost", err)
			}
		})
	}
}

// fillForPrune stores expired and live records.
func fillForPrune(t *testing.T, s *Store, expired, live int) {
	t.Helper()
	for i := range expired + live {
		req := storetest.Request("cred", fmt.Sprintf("prune-%06d", i), "body")
		if i < expired {
			req.Retention, req.LockTimeout = -time.Minute, -time.Minute
		}
		storetest.MustAcquire(t, s, req, store.OutcomeCreated)
	}
}

func countRows(t *testing.T, s *Store, where string) int {
	t.Helper()
	var n int
	if err := s.pool.QueryRow(context.Background(), "SELECT count(*) FROM "+s.table.quoted()+" WHERE "+where).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

func TestPrunePostgresDeletesExpiredInBatches(t *testing.T) {
	t.Parallel()
	s := newTestStore(t, pgtest.FreshTable(t), 8)
	ctx := context.Background()
	fillForPrune(t, s, 23, 4)

	n, err := s.Prune(ctx, 10) // 10, 10, 3
	if err != nil || n != 23 {
		t.Fatalf("prune = %d, %v; want 23", n, err)
	}
	if live, all := countRows(t, s, "expires_at > now()"), countRows(t, s, "true"); live != 4 || all != 4 {
		t.Errorf("%d rows left, %d live; want the 4 live ones", all, live)
	}
	if n, err := s.Prune(ctx, 10); err != nil || n != 0 {
		t.Errorf("second prune = %d, %v; want 0", n, err)
	}
	if _, err := s.Prune(ctx, 0); err == nil {
		t.Errorf("prune with batch size 0: no error")
	}
}

func TestPrunePostgresOneAtATime(t *testing.T) {
	t.Parallel()
	s := newTestStore(t, pgtest.FreshTable(t), 8)
	ctx := context.Background()
	fillForPrune(t, s, 12, 0)
	lockKey := s.table.PruneLockKey()

	// Another instance is pruning.
	other := pgtest.Connect(t, pgtest.DSN(t))
	var locked bool
	if err := other.QueryRow(ctx, "SELECT pg_try_advisory_lock($1)", lockKey).Scan(&locked); err != nil || !locked {
		t.Fatalf("taking the prune lock: %v, %v", locked, err)
	}
	if n, err := s.Prune(ctx, 5); err != nil || n != 0 {
		t.Fatalf("prune while another prunes = %d, %v; want 0", n, err)
	}
	if n := countRows(t, s, "true"); n != 12 {
		t.Fatalf("%d rows left, want 12 untouched", n)
	}
	if _, err := other.Exec(ctx, "SELECT pg_advisory_unlock($1)", lockKey); err != nil {
		t.Fatal(err)
	}

	// Concurrent pruners share the work without deleting a row twice.
	const pruners = 4
	var (
		wg    sync.WaitGroup
		mu    sync.Mutex
		total int64
	)
	for range pruners {
		wg.Go(func() {
			n, err := s.Prune(ctx, 5)
			if err != nil {
				t.Errorf("prune: %v", err)
			}
			mu.Lock()
			total += n
			mu.Unlock()
		})
	}
	wg.Wait()
	if total != 12 || countRows(t, s, "true") != 0 {
		t.Errorf("pruners deleted %d rows in all, want 12", total)
	}

	// Every pruner let go of the lock.
	if err := other.QueryRow(ctx, "SELECT pg_try_advisory_lock($1)", lockKey).Scan(&locked); err != nil || !locked {
		t.Errorf("the prune lock is still held after pruning: %v, %v", locked, err)
	}
}

func TestPrunePostgresCancelledLetsGoOfLock(t *testing.T) {
	t.Parallel()
	s := newTestStore(t, pgtest.FreshTable(t), 8)
	fillForPrune(t, s, 3, 0)
	ctx := context.Background()

	// The table is locked (pruning skips rows that requests hold, so it
	// takes a table lock to make it wait), so the prune's DELETE waits
	// until the instance shuts down.
	tx, err := s.pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	if _, err := tx.Exec(ctx, "LOCK TABLE "+s.table.quoted()+" IN EXCLUSIVE MODE"); err != nil {
		t.Fatal(err)
	}
	shutdown, cancel := context.WithTimeout(ctx, 300*time.Millisecond)
	defer cancel()
	if _, err := s.Prune(shutdown, 1); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("prune cut short: %v, want context.DeadlineExceeded", err)
	}
	if err := tx.Rollback(ctx); err != nil {
		t.Fatal(err)
	}

	// The lock is not left behind on a pooled connection: once the
	// server is done with the abandoned statement, pruning resumes.
	deadline := time.Now().Add(10 * time.Second)
	for countRows(t, s, "true") > 0 {
		if time.Now().After(deadline) {
			t.Fatal("pruning never resumed after a cancelled prune")
		}
		if _, err := s.Prune(ctx, 1); err != nil {
			t.Fatalf("prune: %v", err)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

func TestMigratePostgresIdempotent(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := newTestStore(t, pgtest.FreshTable(t), 8).pool

	t.Run("twice", func(t *testing.T) {
		table := pgtest.FreshTable(t)
		for i, want := range []int{migrationCount(t), 0} {
			if n, err := Migrate(ctx, pool, table); err != nil || n != want {
				t.Fatalf("migration %d: applied %d, %v; want %d", i+1, n, err, want)
			}
		}
		assertMigrated(t, pool, table)
	})

	t.Run("concurrently", func(t *testing.T) {
		table := pgtest.FreshTable(t)
		var (
			wg    sync.WaitGroup
			mu    sync.Mutex
			total int
		)
		for range 8 {
			wg.Go(func() {
				n, err := Migrate(ctx, pool, table)
				if err != nil {
					t.Errorf("migrate: %v", err)
				}
				mu.Lock()
				total += n
				mu.Unlock()
			})
		}
		wg.Wait()
		if total != migrationCount(t) {
			t.Errorf("applied %d migrations in all, want %d", total, migrationCount(t))
		}
		assertMigrated(t, pool, table)
	})

	t.Run("applied by hand", func(t *testing.T) {
		// A DBA ran the file with psql; the runner finds the table there.
		table := pgtest.FreshTable(t)
		sql, err := migrations.Files.ReadFile("0001_create_idempotency_keys.sql")
		if err != nil {
			t.Fatal(err)
		}
		if _, err := pool.Exec(ctx, strings.ReplaceAll(string(sql), DefaultTable, table)); err != nil {
			t.Fatalf("applying the file by hand: %v", err)
		}
		if n, err := Migrate(ctx, pool, table); err != nil || n != migrationCount(t) {
			t.Fatalf("migrate after a manual apply: %d, %v; want the bookkeeping of 1 and the others applied", n, err)
		}
		assertMigrated(t, pool, table)
	})

	t.Run("table dropped by hand", func(t *testing.T) {
		// The bookkeeping says migrated, the table is gone: it is
		// created again rather than left missing under every request.
		table := pgtest.FreshTable(t)
		if n, err := Migrate(ctx, pool, table); err != nil || n != migrationCount(t) {
			t.Fatalf("first migration: %d, %v", n, err)
		}
		if _, err := pool.Exec(ctx, "DROP TABLE "+table); err != nil {
			t.Fatal(err)
		}
		if n, err := Migrate(ctx, pool, table); err != nil || n != migrationCount(t) {
			t.Fatalf("migrate after the table was dropped: applied %d, %v; want all", n, err)
		}
		assertMigrated(t, pool, table)
	})
}

// assertMigrated checks the table, its index and the bookkeeping.
func assertMigrated(t *testing.T, pool *pgxpool.Pool, table string) {
	t.Helper()
	tn, err := ParseTable(table)
	if err != nil {
		t.Fatal(err)
	}
	var columns, indexes, versions int
	var secretTable bool
	err = pool.QueryRow(context.Background(), `SELECT
	(SELECT count(*) FROM pg_attribute WHERE attrelid = to_regclass($1) AND attnum > 0 AND NOT attisdropped),
	(SELECT count(*) FROM pg_index WHERE indrelid = to_regclass($1)),
	(SELECT count(*) FROM `+tn.sibling(MigrationsTable)+` WHERE table_name = $2),
	to_regclass($3) IS NOT NULL`,
		tn.quoted(), tn.String(), tn.SecretTable()).Scan(&columns, &indexes, &versions, &secretTable)
	if err != nil {
		t.Fatal(err)
	}
	if columns != 18 || indexes != 2 || versions != migrationCount(t) || !secretTable {
		t.Errorf("%s has %d columns, %d indexes, %d versions recorded, secret table %v; want 18, 2, %d and true",
			table, columns, indexes, versions, secretTable, migrationCount(t))
	}
}

func TestMigratePostgresSchemaAndLongNames(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	s := newTestStore(t, pgtest.FreshTable(t), 8)
	schema := pgtest.FreshTable(t) // a unique name, dropped with CASCADE below
	mustExec(t, s, "CREATE SCHEMA "+schema)
	t.Cleanup(func() { mustExec(t, s, "DROP SCHEMA "+schema+" CASCADE") })

	// Two 63-character names sharing a 60-character prefix: truncating
	// their index names would make them collide.
	long := strings.Repeat("x", 60)
	for _, table := range []string{
		schema + ".Mixed_Case",
		schema + "." + long + "aaa",
		schema + "." + long + "bbb",
	} {
		t.Run(table, func(t *testing.T) {
			if n, err := Migrate(ctx, s.pool, table); err != nil || n != migrationCount(t) {
				t.Fatalf("migrate: %d, %v", n, err)
			}
			assertMigrated(t, s.pool, table)

			st := newTestStore(t, table, 8)
			req := storetest.Request("cred", "schema-00001", "body")
			storetest.MustAcquire(t, st, req, store.OutcomeCreated)
			if err := st.Complete(ctx, req.Key, req.Token, &store.Response{Status: 200, Replayable: true}, req.Retention); err != nil {
				t.Fatal(err)
			}
		})
	}
	var n int
	if err := s.pool.QueryRow(ctx, "SELECT count(*) FROM "+schema+".mixed_case").Scan(&n); err != nil || n != 1 {
		t.Errorf("Mixed_Case is not the table mixed_case, as in SQL: %d rows, %v", n, err)
	}
}

func TestPostgresInvalidTableNames(t *testing.T) {
	t.Parallel()
	dsn := pgtest.DSN(t)
	for _, table := range []string{
		"x; DROP TABLE y",
		"a.b.c",
		"1abc",
		"a-b",
		`"quoted"`,
		"tab le",
		".a",
		"a.",
		"a..b",
		"tablé",
		strings.Repeat("a", 64),
	} {
		t.Run(table, func(t *testing.T) {
			if _, err := ParseTable(table); err == nil {
				t.Errorf("ParseTable accepted it")
			}
			s := &Store{DSN: dsn, Table: table}
			ctx, cancel := caddy.NewContext(caddy.Context{Context: context.Background()})
			defer cancel()
			if err := s.Provision(ctx); err == nil || s.pool != nil {
				t.Errorf("Provision accepted it (err %v)", err)
			}
			if _, err := Migrate(context.Background(), nil, table); err == nil {
				t.Errorf("Migrate accepted it")
			}
			d := caddyfile.NewTestDispenser("postgres {\n\tdsn x\n\ttable `" + table + "`\n}")
			if err := new(Store).UnmarshalCaddyfile(d); err == nil || !strings.Contains(err.Error(), "Testfile:3") {
				t.Errorf("UnmarshalCaddyfile: %v, want an error at line 3", err)
			}
		})
	}
	for _, table := range []string{"idempotency_keys", "_x", "public.Keys", strings.Repeat("a", 63) + "." + strings.Repeat("b", 63)} {
		if _, err := ParseTable(table); err != nil {
			t.Errorf("ParseTable(%q): %v", table, err)
		}
	}
}

func TestPostgresNeverStoresRawCredential(t *testing.T) {
	t.Parallel()
	s := newTestStore(t, pgtest.FreshTable(t), 8)
	const credential = "Bearer sk_live_51HxTopSecretCredential"
	req := storetest.Request(credential, "cred-check-1", `{"amount":100}`)
	storetest.MustAcquire(t, s, req, store.OutcomeCreated)
	if err := s.Complete(context.Background(), req.Key, req.Token, &store.Response{
		Status: 200, Header: http.Header{"Content-Type": {"application/json"}}, Body: []byte(`{"ok":true}`), Replayable: true, BodySize: 11,
	}, time.Hour); err != nil {
		t.Fatal(err)
	}

	var row string
	if err := s.pool.QueryRow(context.Background(), "SELECT r::text FROM "+s.table.quoted()+" r").Scan(&row); err != nil {
		t.Fatal(err)
	}
	hash := sha256.Sum256([]byte(credential))
	if !strings.Contains(row, hex.EncodeToString(hash[:])) {
		t.Fatalf("the row does not hold the credential's hash: %s", row)
	}
	for _, secret := range []string{credential, "sk_live_51HxTopSecretCredential", hex.EncodeToString([]byte("sk_live_51HxTopSecretCredential"))} {
		if strings.Contains(strings.ToLower(row), strings.ToLower(secret)) {
			t.Errorf("the row holds %q: %s", secret, row)
		}
	}
}

func TestPostgresProvisionSharesPool(t *testing.T) {
	table := pgtest.FreshTable(t)
	t.Setenv("IDEMPOTENCY_TEST_SECRET_DSN", pgtest.DSN(t))
	ctx := context.Background()

	provision := func() (*Store, func()) {
		s := &Store{DSN: "{env.IDEMPOTENCY_TEST_SECRET_DSN}", Table: table, MaxConns: 3}
		cctx, cancel := caddy.NewContext(caddy.Context{Context: ctx})
		if err := s.Provision(cctx); err != nil {
			t.Fatalf("provision: %v", err)
		}
		return s, cancel
	}
	// A reload: the new config starts before the old one stops, and the
	// old config's context is cancelled.
	old, cancelOld := provision()
	current, cancelCurrent := provision()
	defer cancelCurrent()
	if old.pool != current.pool {
		t.Fatal("two stores with the same dsn and max_conns opened two pools")
	}
	if refs, _ := postgresPools.References(current.poolKey); refs != 2 {
		t.Errorf("%d references to the pool, want 2", refs)
	}
	cancelOld()
	if err := old.Cleanup(); err != nil {
		t.Fatal(err)
	}
	storetest.MustAcquire(t, current, storetest.Request("cred", "reload-00001", ""), store.OutcomeCreated)

	config, err := json.Marshal(current)
	if err != nil {
		t.Fatal(err)
	}
	if strings.Contains(string(config), pgtest.DSN(t)) {
		t.Errorf("the config holds the resolved dsn: %s", config)
	}

	if err := current.Cleanup(); err != nil {
		t.Fatal(err)
	}
	if _, ok := postgresPools.References(current.poolKey); ok {
		t.Errorf("the pool outlived its last store")
	}
}

func TestPostgresUnreachable(t *testing.T) {
	t.Parallel()
	port, err := pgtest.FreePort()
	if err != nil {
		t.Fatal(err)
	}
	dsn := fmt.Sprintf("postgres://postgres@127.0.0.1:%d/test?sslmode=disable&connect_timeout=2", port)
	off := false

	for _, migrate := range []*bool{nil, &off} {
		// The pool dials lazily, and migrations wait for the store's
		// start: requests fail closed until the database answers.
		s := &Store{DSN: dsn, Table: "unreachable", Migrate: migrate, tableSecret: true}
		ctx, cancel := caddy.NewContext(caddy.Context{Context: context.Background()})
		if err := s.Provision(ctx); err != nil {
			t.Fatalf("provision with migrate %v: %v", migrate, err)
		}
		_, err := s.Acquire(context.Background(), storetest.Request("cred", "unreachable", ""))
		if err == nil || errors.Is(err, store.ErrLockLost) {
			t.Errorf("acquire = %v, want a store error", err)
		}
		if err := s.Cleanup(); err != nil {
			t.Error(err)
		}
		cancel()
	}

	s := &Store{DSN: "{env.IDEMPOTENCY_TEST_UNSET_VARIABLE}"}
	ctx, cancel := caddy.NewContext(caddy.Context{Context: context.Background()})
	defer cancel()
	if err := s.Provision(ctx); err == nil || !strings.Contains(err.Error(), "empty") {
		t.Errorf("provision with an empty dsn: %v", err)
	}
}

func TestPostgresUnmarshalCaddyfile(t *testing.T) {
	off := false
	tests := []struct {
		input   string
		want    Store
		wantErr string // with the line, e.g. "Testfile:3"
	}{
		{
			input: `postgres {
				dsn {env.DATABASE_URL}
			}`,
			want: Store{DSN: "{env.DATABASE_URL}"},
		},
		{
			input: `postgres {
				dsn       "host=db user=caddy dbname=app"
				table     billing.idempotency
				max_conns 32
				migrate   off
			}`,
			want: Store{DSN: "host=db user=caddy dbname=app", Table: "billing.idempotency", MaxConns: 32, Migrate: &off},
		},
		{
			input: `postgres {
				dsn     postgres://db/app
				migrate on
			}`,
			want: Store{DSN: "postgres://db/app"},
		},
		{input: `postgres`, wantErr: "dsn is required, at Testfile:1"},
		{input: `postgres extra {
				dsn x
			}`, wantErr: "Testfile:1"},
		{input: `postgres {
				dsn x
				dsn y
			}`, wantErr: "dsn given more than once, at Testfile:3"},
		{input: `postgres {
				dsn x
				tablename t
			}`, wantErr: `unrecognized option "tablename", at Testfile:3`},
		{input: `postgres {
				dsn
			}`, wantErr: "wrong argument count or unexpected line ending after 'dsn', at Testfile:2"},
		{input: `postgres {
				dsn x
				table a b
			}`, wantErr: "Testfile:3"},
		{input: `postgres {
				dsn x
				max_conns lots
			}`, wantErr: `max_conns must be a positive integer, not "lots", at Testfile:3`},
		{input: `postgres {
				dsn x
				max_conns 0
			}`, wantErr: "Testfile:3"},
		{input: `postgres {
				dsn x

				max_conns 99999999999
			}`, wantErr: "Testfile:4"},
		{input: `postgres {
				dsn x
				migrate yes
			}`, wantErr: `migrate must be on or off, not "yes", at Testfile:3`},
		{input: `postgres {
				dsn x
				table x;DROP
			}`, wantErr: "Testfile:3"},
	}
	for _, tt := range tests {
		t.Run(tt.input, func(t *testing.T) {
			var got Store
			err := got.UnmarshalCaddyfile(caddyfile.NewTestDispenser(tt.input))
			if tt.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
					t.Fatalf("error = %v, want one containing %q", err, tt.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if !reflect.DeepEqual(got, tt.want) {
				t.Errorf("got %+v, want %+v", got, tt.want)
			}
		})
	}
}

// The statements of the request path find their row through the primary
// key even when the table is mostly expired rows, which is what it looks
// like to the planner during a pruning backlog: there, the expires_at
// index looks as if it held next to no live row, and a lookup through it
// filters every live record. Both the generic plan of a prepared
// statement and a custom one are checked, for batches of one row and
// full ones, in every exec mode: the arrays of a batch are matched
// through the primary key, never by a scan of the table.
func TestPostgresStatementsUsePrimaryKeyWhenMostRowsExpired(t *testing.T) {
	t.Parallel()
	table := pgtest.FreshTable(t)
	s := newTestStore(t, table, 2)
	mustExec(t, s, `INSERT INTO `+s.table.quoted()+` (credential_hash, key, fingerprint, method, path, status,
	created_at, expires_at, response_status, response_headers, response_body, replayable, response_size)
SELECT sha256(('tenant-' || (i % 100))::bytea), 'expired-' || i, sha256(i::text::bytea), 'POST', '/v1/charges',
	'completed', now() - interval '2 days', now() - interval '1 day', 200, '{}', '\x00', true, 1
FROM generate_series(1, 20000) AS i`)
	mustExec(t, s, "ANALYZE "+s.table.quoted())
	for _, mode := range execModes {
		t.Run(mode, func(t *testing.T) {
			checkPrimaryKeyPlans(t, newTestPostgresStoreInMode(t, table, mode, 2))
		})
	}
}

// A connection plans each statement once, at its first use, and keeps
// the plan: one opened on a new, empty table must not keep a plan that
// scans it. With a plan that locked rows through a hash join over a
// scan, every completion read the whole table; first executions fell as
// the table grew (a quarter slower at 27,000 rows) until an ANALYZE
// replaced the plans. Through a pooler, where no planner setting may be
// sent, the plans are the same.
func TestPostgresStatementsUsePrimaryKeyOnAnEmptyTable(t *testing.T) {
	t.Parallel()
	table := pgtest.FreshTable(t)
	for _, mode := range execModes {
		t.Run(mode, func(t *testing.T) {
			checkPrimaryKeyPlans(t, newTestPostgresStoreInMode(t, table, mode, 2))
		})
	}
}

// A connection that prepares the statements (cache_statement) keeps one
// plan of each, made for any arguments, rather than planning every
// execution for its own: the plans made for given arrays cost no less
// than the generic one (migration 0006). Planning each batch anew costs a
// planning per statement, and gives plans that checkPrimaryKeyPlans has
// not seen.
func TestPostgresPreparedStatementsKeepGenericPlans(t *testing.T) {
	t.Parallel()
	s := newTestPostgresStoreInMode(t, pgtest.FreshTable(t), "cache_statement", 1)
	ctx := context.Background()
	resp := &store.Response{Status: 201, Replayable: true}
	for i := range 12 {
		// Batches of one, then of two and of three, each in its own
		// form: the statements of one connection (max_conns 1).
		for _, rows := range []int{1, 2, 3} {
			var acquires []*batchCall[queuedAcquire, store.AcquireResult]
			var owned []*batchCall[ownedRequest, bool]
			for j := range rows {
				req := storetest.Request("cred", fmt.Sprintf("key-%d-%d-%d", i, rows, j), "body")
				acquires = append(acquires, &batchCall[queuedAcquire, store.AcquireResult]{ctx: ctx, req: queuedAcquire{AcquireRequest: req}})
				owned = append(owned, &batchCall[ownedRequest, bool]{ctx: ctx, req: ownedRequest{key: req.Key, token: req.Token}})
			}
			slices.SortFunc(acquires, func(x, y *batchCall[queuedAcquire, store.AcquireResult]) int {
				return compareKeys(x.req.Key, y.req.Key)
			})
			slices.SortFunc(owned, func(x, y *batchCall[ownedRequest, bool]) int { return compareKeys(x.req.key, y.req.key) })
			s.sendAcquires(ctx, acquires)
			for _, c := range acquires {
				if c.err != nil || c.res.Outcome != store.OutcomeCreated {
					t.Fatalf("acquire of %d: %v, %+v", rows, c.err, c.res)
				}
			}
			send := func(op string, st statement) {
				for _, c := range owned {
					c.res = false
				}
				s.sendOwned(ctx, op, st, owned)
				for _, c := range owned {
					if c.err != nil || !c.res {
						t.Fatalf("%s of %d: %v, %v", op, rows, c.err, c.res)
					}
				}
			}
			send(store.OpRenew, s.sql.renew)
			if i%2 == 0 {
				send(store.OpRelease, s.sql.release)
				continue
			}
			for _, c := range owned {
				c.req.resp = &completion{status: int32(resp.Status), body: []byte{}, replayable: true, retention: time.Hour}
			}
			send(store.OpComplete, s.sql.complete)
		}
	}
	rows, err := s.pool.Query(ctx, `SELECT statement, generic_plans, custom_plans FROM pg_prepared_statements
WHERE statement LIKE 'WITH %'`)
	if err != nil {
		t.Fatal(err)
	}
	type prepared struct {
		SQL             string
		Generic, Custom int64
	}
	statements, err := pgx.CollectRows(rows, pgx.RowToStructByPos[prepared])
	if err != nil {
		t.Fatal(err)
	}
	// acquire, renew, release and complete, each in the form for one
	// request and the batch's.
	if len(statements) != 8 {
		t.Errorf("%d statements prepared, want 8", len(statements))
	}
	for _, st := range statements {
		// The first five executions are planned for their arguments,
		// which is how Postgres learns what the generic plan saves.
		if st.Custom > 5 || st.Generic == 0 {
			t.Errorf("%d custom plans, %d generic ones, of:\n%s", st.Custom, st.Generic, st.SQL)
		}
	}
}

// execModes are pgx's exec modes: its default, cache_statement, and
// those that a transaction pooler needs.
var execModes = []string{"cache_statement", "cache_describe", "exec", "simple_protocol"}

// newTestPostgresStoreInMode is newTestStore on a DSN whose
// default_query_exec_mode is mode.
func newTestPostgresStoreInMode(t *testing.T, table, mode string, maxConns int32) *Store {
	t.Helper()
	u, err := url.Parse(pgtest.DSN(t))
	if err != nil || u.Scheme == "" {
		t.Skipf("the test DSN is not a URL: %v", err)
	}
	q := u.Query()
	q.Set("default_query_exec_mode", mode)
	u.RawQuery = q.Encode()
	return provisionTestStore(t, &Store{DSN: u.String(), Table: table, MaxConns: maxConns})
}

// checkPrimaryKeyPlans checks that every statement of the request path,
// in its generic and custom plans on s's table as it is, finds its rows
// through the primary key alone, on connections that carry no planner
// setting of their own (which a pooler would refuse at startup, and
// which would be session state).
func checkPrimaryKeyPlans(t *testing.T, s *Store) {
	t.Helper()
	ctx := context.Background()
	conn, err := s.pool.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Release()
	var settings []string
	if err := conn.QueryRow(ctx, `SELECT coalesce(array_agg(name || ' (' || source || ')'), '{}') FROM pg_settings
WHERE category LIKE 'Query Tuning%' AND source IN ('client', 'session')`).Scan(&settings); err != nil {
		t.Fatal(err)
	}
	if len(settings) > 0 {
		t.Errorf("the store's connection sets planner settings: %v", settings)
	}
	defer conn.Exec(ctx, "RESET plan_cache_mode")
	const (
		hash  = `'\x` + "0000000000000000000000000000000000000000000000000000000000000000" + `'::bytea`
		token = `'\x` + "00000000000000000000000000000000" + `'::bytea`
	)
	// A statement for one request takes the values; a batch takes
	// arrays: batches of two and full ones.
	arr := func(elem string, rows int) string {
		if rows == 1 {
			return elem
		}
		return "ARRAY[" + strings.TrimSuffix(strings.Repeat(elem+", ", rows), ", ") + "]"
	}
	form := func(st statement, rows int) string {
		if rows == 1 {
			return st.one
		}
		return st.batch
	}
	statements := map[string]struct{ sql, args string }{
		"lookup": {s.sql.lookup, hash + `, 'key-00000001'`},
	}
	for _, rows := range []int{1, 2, batchRows} {
		keys := make([]string, rows)
		for i := range keys {
			keys[i] = fmt.Sprintf("'key-%08d'", i)
		}
		keyArgs := keys[0]
		if rows > 1 {
			keyArgs = "ARRAY[" + strings.Join(keys, ", ") + "]"
		}
		owned := arr(hash, rows) + ", " + keyArgs + ", " + arr(token, rows)
		statements[fmt.Sprintf("acquire %d", rows)] = struct{ sql, args string }{form(s.sql.acquire, rows),
			arr(hash, rows) + ", " + keyArgs + ", " + arr(hash, rows) + ", " + arr(`'POST'`, rows) + ", " +
				arr(`'/v1/charges'`, rows) + ", " + arr(token, rows) + ", " + arr("86400000000::bigint", rows) + ", " + arr("30000000::bigint", rows)}
		statements[fmt.Sprintf("complete %d", rows)] = struct{ sql, args string }{form(s.sql.complete, rows),
			owned + ", " + arr("200", rows) + ", " + arr(`'\x01'::bytea`, rows) + ", " + arr(`'\x00'::bytea`, rows) + ", " +
				arr("true", rows) + ", " + arr("1::bigint", rows) + ", " + arr("86400000000::bigint", rows)}
		statements[fmt.Sprintf("renew %d", rows)] = struct{ sql, args string }{form(s.sql.renew, rows), owned}
		statements[fmt.Sprintf("release %d", rows)] = struct{ sql, args string }{form(s.sql.release, rows), owned}
	}
	for name, st := range statements {
		if _, err := conn.Exec(ctx, "PREPARE plan_check AS "+st.sql); err != nil {
			t.Fatalf("%s: PREPARE: %v", name, err)
		}
		for _, mode := range []string{"force_generic_plan", "force_custom_plan"} {
			if _, err := conn.Exec(ctx, "SET plan_cache_mode = "+mode); err != nil {
				t.Fatal(err)
			}
			rows, err := conn.Query(ctx, "EXPLAIN EXECUTE plan_check("+st.args+")", pgx.QueryExecModeSimpleProtocol)
			if err != nil {
				t.Fatalf("%s, %s: EXPLAIN: %v", name, mode, err)
			}
			lines, err := pgx.CollectRows(rows, pgx.RowTo[string])
			if err != nil {
				t.Fatalf("%s, %s: EXPLAIN: %v", name, mode, err)
			}
			plan := strings.Join(lines, "\n")
			if strings.Contains(plan, "expires_at_idx") || strings.Contains(plan, "Seq Scan") || !strings.Contains(plan, "_pkey") {
				t.Errorf("%s, %s: the plan does not look the key up through the primary key:\n%s", name, mode, plan)
			}
		}
		if _, err := conn.Exec(ctx, "DEALLOCATE plan_check"); err != nil {
			t.Fatal(err)
		}
	}
}

// Requests that own a record get connections while new requests queue
// for them: with every acquire stuck in the database, the owner of a
// record still renews its lock, completes its record and releases
// another within a second. Without connections kept from acquires, the
// owner would queue behind them until its lock went stale, and a retry
// would then run its request a second time.
func TestPostgresOwnersGetConnectionsWhileAcquiresQueue(t *testing.T) {
	t.Parallel()
	const maxConns = 8
	s := newTestStore(t, pgtest.FreshTable(t), maxConns)
	ctx := context.Background()

	owned := storetest.Request("cred", "key-owned-1", "body")
	storetest.MustAcquire(t, s, owned, store.OutcomeCreated)
	released := storetest.Request("cred", "key-owned-2", "body")
	storetest.MustAcquire(t, s, released, store.OutcomeCreated)
	hot := storetest.Request("cred", "key-hot", "body")
	storetest.MustAcquire(t, s, hot, store.OutcomeCreated)

	// Another session locks the hot record's row: every acquire of that
	// key waits for the lock inside its statement, holding a connection.
	locker := pgtest.Connect(t, pgtest.DSN(t))
	tx, err := locker.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	if _, err := tx.Exec(ctx, "SELECT 1 FROM "+s.table.quoted()+" WHERE key = 'key-hot' FOR UPDATE"); err != nil {
		t.Fatal(err)
	}
	stuckCtx, unstick := context.WithTimeout(ctx, 20*time.Second)
	defer unstick()
	var stuck sync.WaitGroup
	for range 3 * maxConns {
		stuck.Add(1)
		go func() {
			defer stuck.Done()
			_, _ = s.Acquire(stuckCtx, storetest.Retry(hot))
		}()
	}
	// Wait until the acquires hold every connection they may: one per
	// lane of their batcher, each batch holding one request for the key
	// (two cannot share a statement). (Not asked of the locker: a
	// transaction sees one snapshot of the activity statistics.)
	// The acquires are told by their start and their table's name, which
	// comes early: pg_stat_activity keeps a statement's first 1 KiB only
	// (track_activity_query_size).
	watcher := pgtest.Connect(t, pgtest.DSN(t))
	deadline := time.Now().Add(10 * time.Second)
	for {
		var waiting int
		if err := watcher.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity
WHERE datname = current_database() AND wait_event_type = 'Lock' AND state = 'active'
	AND query LIKE 'WITH input AS%' AND position($1 IN query) > 0`,
			s.table.name).Scan(&waiting); err != nil {
			t.Fatal(err)
		}
		if waiting >= s.acquires.lanes {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("only %d acquires are waiting for the row lock, want %d", waiting, s.acquires.lanes)
		}
		time.Sleep(20 * time.Millisecond)
	}

	ownerCtx, cancel := context.WithTimeout(ctx, time.Second)
	defer cancel()
	if err := s.Renew(ownerCtx, owned.Key, owned.Token); err != nil {
		t.Errorf("renew while acquires queue: %v", err)
	}
	if err := s.Complete(ownerCtx, owned.Key, owned.Token, &store.Response{Status: 201, Replayable: true}, owned.Retention); err != nil {
		t.Errorf("complete while acquires queue: %v", err)
	}
	if err := s.Release(ownerCtx, released.Key, released.Token); err != nil {
		t.Errorf("release while acquires queue: %v", err)
	}

	if err := tx.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	stuck.Wait()
}

// Records completed before migration 0002 have their headers as JSON in
// response_headers; they still replay.
func TestPostgresReplaysHeadersStoredAsJSON(t *testing.T) {
	t.Parallel()
	s := newTestStore(t, pgtest.FreshTable(t), 2)
	ctx := context.Background()
	req := storetest.Request("cred", "json-key", "body")
	if res, err := s.Acquire(ctx, req); err != nil || res.Outcome != store.OutcomeCreated {
		t.Fatalf("acquire: %+v, %v", res, err)
	}
	mustExec(t, s, `UPDATE `+s.table.quoted()+` SET status = 'completed', lock_token = NULL, locked_at = NULL,
	response_status = 200, response_headers = '{"X-A": ["1", "2"], "Content-Type": ["text/plain"]}',
	response_body = 'hi', replayable = true, response_size = 2`)
	res, err := s.Acquire(ctx, storetest.Retry(req))
	if err != nil || res.Outcome != store.OutcomeExisting || res.Record.Response == nil {
		t.Fatalf("replay: %+v, %v", res, err)
	}
	if h := res.Record.Response.Header; !slices.Equal(h["X-A"], []string{"1", "2"}) || h.Get("Content-Type") != "text/plain" || len(h) != 2 {
		t.Errorf("headers = %q", h)
	}
}

// Both stores: a Complete that the store refuses for good returns
// ErrUnstorable, not a transient error.
func TestPostgresCompleteUnstorableIsPermanent(t *testing.T) {
	t.Parallel()
	s := newTestStore(t, pgtest.FreshTable(t), 2)
	mustExec(t, s, "ALTER TABLE "+s.table.quoted()+" ADD CONSTRAINT small_bodies CHECK (octet_length(response_body) < 5)")
	ctx := context.Background()
	req := storetest.Request("cred", "unstorable", "body")
	if res, err := s.Acquire(ctx, req); err != nil || res.Outcome != store.OutcomeCreated {
		t.Fatalf("acquire: %+v, %v", res, err)
	}
	err := s.Complete(ctx, req.Key, req.Token, &store.Response{Status: 200, Body: []byte("too long"), Replayable: true}, req.Retention)
	if !errors.Is(err, store.ErrUnstorable) {
		t.Fatalf("complete: %v, want ErrUnstorable", err)
	}
	if err := s.Complete(ctx, req.Key, req.Token, &store.Response{Status: 200, BodySize: 8}, req.Retention); err != nil {
		t.Fatalf("complete without the body: %v", err)
	}
}

// A reload that changes the pool (another dsn or max_conns) cleans up the
// old config's store while its requests still run: the pool stays open
// for them until they are done. Catches closing it at once (their
// completions failed with "closed pool", and the retries of their keys
// executed a second time once the locks went stale).
func TestPoolOutlivesUnloadedRequests(t *testing.T) {
	table := pgtest.FreshTable(t)
	dsn := pgtest.WithApplicationName(pgtest.DSN(t), "idem_drain_"+pgtest.RandomHex(4))
	s := &Store{DSN: dsn, Table: table, MaxConns: 2}
	ctx, cancel := caddy.NewContext(caddy.Context{Context: context.Background()})
	if err := s.Provision(ctx); err != nil {
		t.Fatal(err)
	}
	var busy atomic.Bool
	busy.Store(true)
	s.DrainWhile(busy.Load, time.Minute)

	req := storetest.Request("cred", "drain-"+pgtest.RandomHex(4), `{}`)
	storetest.MustAcquire(t, s, req, store.OutcomeCreated)
	cancel() // the config is unloaded, its request still running
	if err := s.Cleanup(); err != nil {
		t.Fatal(err)
	}
	if err := s.Complete(context.Background(), req.Key, req.Token, &store.Response{Status: 201, Body: []byte{}, Replayable: true}, req.Retention); err != nil {
		t.Fatalf("completing after the config was unloaded: %v", err)
	}
	if _, ok := postgresPools.References(s.poolKey); !ok {
		t.Fatalf("the pool was let go while a request owned a record")
	}
	busy.Store(false)
	storetest.WaitFor(t, 15*time.Second, "the pool to be let go", func() bool {
		_, ok := postgresPools.References(s.poolKey)
		return !ok
	})
}
