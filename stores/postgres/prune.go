package postgres

// Pruning the Postgres store's expired records, one instance at a time.

import (
	"context"
	"fmt"
	"time"
)

// Prune implements Store. A transaction holds an advisory lock, keyed by
// the table, for the whole run, so that among the instances of a cluster
// one prunes and the others return at once.
func (s *Store) Prune(ctx context.Context, batchSize int) (int64, error) {
	if err := s.Ready(ctx); err != nil {
		return 0, err
	}
	n, _, err := s.PruneLocked(ctx, batchSize)
	if err != nil {
		s.nameExecMode(err)
	}
	return n, err
}

// PruneLocked is Prune, and also reports whether it held the lock: false means
// that another instance was pruning (the operator CLI says so).
//
// The lock is a transaction's, not a session's: through a transaction
// pooler, consecutive statements of one connection run on different
// server connections, and a session lock taken on one of them was never
// released on another, which stopped pruning for every instance for as
// long as that server connection lived. The transaction only holds the
// lock (it reads no row and writes none, so it holds back no vacuum); the
// batches are deleted outside it, each committed on its own, so that a
// large backlog neither keeps its rows locked until the end nor stays
// invisible to the other instances meanwhile. An instance that dies
// mid-run takes its transaction, and the lock, with it.
func (s *Store) PruneLocked(ctx context.Context, batchSize int) (total int64, locked bool, err error) {
	if batchSize <= 0 {
		return 0, false, fmt.Errorf("postgres store: prune: batch size must be positive, not %d", batchSize)
	}
	tx, err := s.pool.Begin(ctx)
	if err != nil {
		return 0, false, fmt.Errorf("postgres store: prune: %w", err)
	}
	// Not the caller's context, which may be why pruning stopped: a
	// rollback that fails closes the connection, which ends the
	// transaction too.
	defer func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_ = tx.Rollback(ctx)
	}()
	if err := tx.QueryRow(ctx, "SELECT pg_try_advisory_xact_lock($1)", s.table.PruneLockKey()).Scan(&locked); err != nil {
		return 0, false, fmt.Errorf("postgres store: prune: %w", err)
	}
	if !locked {
		return 0, false, nil
	}
	// With migrate off, nothing else has looked at the table.
	if err := checkTable(ctx, tx, s.table); err != nil {
		return 0, true, fmt.Errorf("postgres store: prune: %w", err)
	}

	for {
		start := time.Now()
		tag, err := s.pool.Exec(ctx, s.sql.pruneBatch, batchSize)
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
