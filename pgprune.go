package idempotency

// Pruning the Postgres store's expired records, one instance at a time.

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
)

// Prune implements Store. It holds a session advisory lock, keyed by the
// table, on one connection for the whole run, so that among the instances
// of a cluster one prunes and the others return at once.
func (s *PostgresStore) Prune(ctx context.Context, batchSize int) (int64, error) {
	if err := s.ready(ctx); err != nil {
		return 0, err
	}
	n, _, err := s.prune(ctx, batchSize)
	return n, err
}

// prune is Prune, and also reports whether it held the lock: false means
// that another instance was pruning (the operator CLI says so).
func (s *PostgresStore) prune(ctx context.Context, batchSize int) (total int64, locked bool, err error) {
	if batchSize <= 0 {
		return 0, false, fmt.Errorf("postgres store: prune: batch size must be positive, not %d", batchSize)
	}
	conn, err := s.pool.Acquire(ctx)
	if err != nil {
		return 0, false, fmt.Errorf("postgres store: prune: %w", err)
	}
	lockKey := s.table.pruneLockKey()
	if err := conn.QueryRow(ctx, "SELECT pg_try_advisory_lock($1)", lockKey).Scan(&locked); err != nil {
		conn.Release()
		return 0, false, fmt.Errorf("postgres store: prune: %w", err)
	}
	if !locked {
		conn.Release()
		return 0, false, nil
	}
	defer unlockPrune(conn, lockKey)
	// With migrate off, nothing else has looked at the table.
	if err := checkTable(ctx, conn, s.table); err != nil {
		return 0, true, fmt.Errorf("postgres store: prune: %w", err)
	}

	for {
		start := time.Now()
		tag, err := conn.Exec(ctx, s.sql.pruneBatch, batchSize)
		if err != nil {
			return total, true, fmt.Errorf("postgres store: prune: %w", err)
		}
		total += tag.RowsAffected()
		if tag.RowsAffected() < int64(batchSize) {
			return total, true, nil
		}
		// Pruning yields to live traffic: after a full batch it rests
		// twice as long as the batch took, so that a backlog of expired
		// rows takes at most a third of the database's time from the
		// requests being served. Resting only as long let their p99
		// reach twice its figure without pruning in some runs of
		// `make bench-scale`; a backlog still drains at thousands of
		// rows a second.
		t := time.NewTimer(2 * time.Since(start))
		select {
		case <-t.C:
		case <-ctx.Done():
			t.Stop()
			return total, true, fmt.Errorf("postgres store: prune: %w", ctx.Err())
		}
	}
}

// unlockPrune gives the prune lock back. A session lock outlives the work
// it guards: returned to the pool still held, it would stop every instance
// from pruning for as long as the connection lives. So the unlock does not
// use the caller's context, which may be why pruning stopped, and a
// connection that cannot unlock is closed, which unlocks it.
func unlockPrune(conn *pgxpool.Conn, lockKey int64) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if _, err := conn.Exec(ctx, "SELECT pg_advisory_unlock($1)", lockKey); err != nil {
		_ = conn.Hijack().Close(ctx)
		return
	}
	conn.Release()
}
