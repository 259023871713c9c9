package postgres

// The Postgres store's Store methods: the acquire's retry loop, and the
// owner's statements with what a lost reply leaves to find out.

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"slices"
	"strings"
	"time"

	"github.com/caddy-idempotency/idempotency/store"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"go.uber.org/zap"
)

// acquireAttempts bounds the retries of Acquire's statement. It returns
// no row only when another transaction inserted the key, or took its
// expired record, after the statement's snapshot was taken: the conflict
// makes the INSERT see that row, but the snapshot hides it from the
// SELECT. The next attempt's snapshot sees it.
const acquireAttempts = 5

// Acquire implements Store. The acquires of concurrent requests share
// statements (pgbatch.go); each request gets its own outcome.
func (s *Store) Acquire(ctx context.Context, req store.AcquireRequest) (store.AcquireResult, error) {
	if err := s.Ready(ctx); err != nil {
		return store.AcquireResult{}, err
	}
	contended, start := 0, time.Now()
	// mayHaveCommitted: an attempt's statement may have reached the
	// database, and committed there, before its connection was lost.
	mayHaveCommitted := false
	for backoff := 10 * time.Millisecond; ; backoff = min(2*backoff, 250*time.Millisecond) {
		res, err := s.acquires.do(ctx, queuedAcquire{AcquireRequest: req, mayHaveCommitted: mayHaveCommitted})
		switch {
		case errors.Is(err, pgx.ErrNoRows):
			if contended++; contended < acquireAttempts {
				continue
			}
			return store.AcquireResult{}, fmt.Errorf("postgres store: acquire: key still contended after %d attempts", acquireAttempts)
		case err == nil:
			return res, nil
		}
		// A statement whose connection failed may have committed all
		// the same: the record would then be locked by a request that
		// never learned it, and every retry get 409 until the lock ran
		// out. Trying again with the same token either finds that
		// record, the caller's, or does what the first attempt did not.
		// It is tried again within the store timeout, through a
		// failover too (the new primary refuses connections until it is
		// promoted): an acquire that committed on the old primary was
		// replicated to it. A database that refuses the first attempt's
		// connection is down, and nothing was sent: the request fails at
		// once, as it would have. A pooled connection that the database
		// closed while idle fails before anything is written to it
		// (SafeToRetry): that attempt sent nothing either.
		var connectErr *pgconn.ConnectError
		refused := errors.As(err, &connectErr)
		// A server that answers read-only was demoted behind a
		// connection that outlived it (a pooler in front of each node):
		// nothing was written, and the pool, emptied, dials for the
		// primary again.
		mayHaveCommitted = mayHaveCommitted || connectionLost(err) && !refused && !pgconn.SafeToRetry(err)
		if !connectionLost(err) && !readOnly(err) || refused && !mayHaveCommitted || ctx.Err() != nil || time.Since(start)+backoff > store.CallTimeout {
			return store.AcquireResult{}, fmt.Errorf("postgres store: acquire: %w", err)
		}
		t := time.NewTimer(backoff)
		select {
		case <-t.C:
		case <-ctx.Done():
			t.Stop()
			return store.AcquireResult{}, fmt.Errorf("postgres store: acquire: %w", err)
		}
	}
}

// connectionLost reports whether err is the loss of the connection (or a
// failure to get one), after which a statement's effect is unknown, or
// certainly absent, rather than the database's answer to it.
func connectionLost(err error) bool {
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) {
		return sessionEnded(pgErr)
	}
	var netErr net.Error
	return pgconn.SafeToRetry(err) || errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) ||
		(errors.As(err, &netErr) && !netErr.Timeout())
}

// Unanswered implements store.Classifier.
func (s *Store) Unanswered(err error) bool {
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) {
		return sessionEnded(pgErr) || strings.HasPrefix(pgErr.Code, "57P0") || pgErr.Code == pgReadOnly
	}
	return connectionLost(err)
}

// Complete implements Store.
func (s *Store) Complete(ctx context.Context, key store.RecordKey, token store.LockToken, resp *store.Response, retention time.Duration) error {
	// NULL marks a body that was not kept; an empty body is kept as ''.
	var body []byte
	if resp.Replayable {
		body = resp.Body
		if body == nil {
			body = []byte{}
		}
	}
	err := s.execOwned(ctx, s.completes, ownedRequest{key: key, token: token, resp: &completion{
		status: int32(resp.Status), headers: store.EncodeResponseHeaders(resp), body: body,
		replayable: resp.Replayable, size: resp.BodySize, retention: retention,
	}})
	switch {
	case err == nil:
		return nil
	case permanentError(err):
		return fmt.Errorf("%w: %w", store.ErrUnstorable, err)
	case errors.Is(err, store.ErrLockLost):
		// An earlier attempt whose reply was lost may have completed it.
		// (Copies, so that key and token need not live on the heap on
		// every call.)
		hash, token := key.CredentialHash, token
		return s.afterLockLost(ctx, store.OpComplete, s.sql.completedBy, hash[:], key.Key, token[:])
	}
	return err
}

// afterLockLost runs check, a query that tells whether an earlier
// attempt of the same call took effect, after a statement found no
// record of the caller's: nil if it did, ErrLockLost if not.
func (s *Store) afterLockLost(ctx context.Context, op, check string, args ...any) error {
	var done bool
	if err := s.pool.QueryRow(ctx, check, args...).Scan(&done); err != nil {
		s.failed(err)
		return fmt.Errorf("postgres store: %s: %w", op, err)
	}
	if done {
		return nil
	}
	return store.ErrLockLost
}

// permanentError reports whether err is the database refusing the
// statement's data, which no retry changes: a data exception (class 22),
// an integrity constraint violation (23) or a program limit exceeded
// (54), such as a value too large.
func permanentError(err error) bool {
	var pgErr *pgconn.PgError
	if !errors.As(err, &pgErr) {
		return false
	}
	switch pgErr.Code[:min(2, len(pgErr.Code))] {
	case "22", "23", "54":
		return true
	}
	return false
}

// Release implements Store. A record that is gone counts as released:
// an earlier attempt whose reply was lost, or an operator, deleted it;
// either way the key is free.
func (s *Store) Release(ctx context.Context, key store.RecordKey, token store.LockToken) error {
	err := s.execOwned(ctx, s.releases, ownedRequest{key: key, token: token})
	if errors.Is(err, store.ErrLockLost) {
		hash := key.CredentialHash
		return s.afterLockLost(ctx, store.OpRelease, s.sql.gone, hash[:], key.Key)
	}
	return err
}

// Renew implements Store.
func (s *Store) Renew(ctx context.Context, key store.RecordKey, token store.LockToken) error {
	return s.execOwned(ctx, s.renewals, ownedRequest{key: key, token: token})
}

// renewChunk bounds the locks that one renewal statement carries: a
// renewal row is some 80 bytes, so a statement of renewChunk rows stays
// small while covering the locks of any plausible instance at once.
const renewChunk = 4096

// RenewLocks implements LockRenewer: the locks are renewed in one
// statement (one per renewChunk locks), outside the renewal batcher,
// which serves the single renewals that confirm a late acquire. Like
// every statement of an owner, it never waits behind acquires.
func (s *Store) RenewLocks(ctx context.Context, locks []store.HeldLock) []error {
	// The rows go in the batches' order (sendBatch): order holds the
	// locks' indexes sorted so.
	order := make([]int, len(locks))
	for i := range order {
		order[i] = i
	}
	slices.SortFunc(order, func(x, y int) int { return compareKeys(locks[x].Key, locks[y].Key) })
	errs := make([]error, len(locks))
	for start := 0; start < len(order); start += renewChunk {
		part := order[start:min(start+renewChunk, len(order))]
		calls := make([]*batchCall[ownedRequest, bool], len(part))
		for i, j := range part {
			calls[i] = &batchCall[ownedRequest, bool]{req: ownedRequest{key: locks[j].Key, token: locks[j].Token}}
		}
		s.sendOwned(ctx, store.OpRenew, s.sql.renew, calls)
		for i, c := range calls {
			switch {
			case c.err != nil:
				errs[part[i]] = c.err
			case !c.res:
				errs[part[i]] = store.ErrLockLost
			}
		}
	}
	return errs
}

// failed is what the store learns from err, the failure of one of its
// statements: that its connections are dead (dropDeadConns), or that
// they go through a pooler that loses their prepared statements
// (nameExecMode).
func (s *Store) failed(err error) {
	s.dropDeadConns(err)
	s.nameExecMode(err)
}

// SQLSTATEs that a server answers a statement with when a connection
// prepares a statement under a name that it already has, or uses one
// that it does not have.
const (
	pgDuplicatePreparedStatement = "42P05"
	pgInvalidStatementName       = "26000"
)

// nameExecMode logs, once per pool, what these errors mean when pgx
// prepares named statements (its default mode, cache_statement): the dsn
// goes through a transaction pooler, which gives a client's next
// transaction another server connection, where the statement the client
// prepared is missing, or another client's of the same name is already
// there. The store never names a statement itself: every named one is
// pgx's (stmtcache_...). Each request still fails closed, and its
// store_error line quotes the server's error, which names neither the
// pooler nor the setting that fixes it.
func (s *Store) nameExecMode(err error) {
	var pgErr *pgconn.PgError
	if !s.prepares || !errors.As(err, &pgErr) ||
		pgErr.Code != pgDuplicatePreparedStatement && pgErr.Code != pgInvalidStatementName ||
		!s.execModeNamed.CompareAndSwap(false, true) {
		return
	}
	s.logger.Error("idempotency.exec_mode",
		zap.String("table", s.table.String()), zap.String("sqlstate", pgErr.Code), zap.Error(err),
		zap.String("fix", "the dsn goes through a transaction pooler (PgBouncer pool_mode = transaction) that does not keep "+
			"the statements pgx prepares in its default mode, cache_statement: add default_query_exec_mode=cache_describe "+
			"to the dsn (or give PgBouncer 1.21+ max_prepared_statements); see the README, \"Behind a connection pooler\""))
}

// dropDeadConns empties the pool when err says the server ended a
// connection (a restart, a failover, pg_terminate_backend). Its idle
// siblings were almost certainly ended with it, and the pool only finds
// out by failing one statement on each: a completion retried against
// them could run out its lock's lifetime on dead connections, and a
// retry would then execute the request again.
//
// It empties the pool, too, when the server ends sessions (57P0x:
// shutting down, starting, database dropped, which a pooler may relay at
// a severity of its own), and when it answers read-only: a pooler in
// front of each node keeps its clients' connections while its node is
// demoted, and those connections would answer every statement with 25006
// for as long as they lived (an hour, by pgxpool's default), where new
// ones find the primary that target_session_attrs=read-write asks for.
func (s *Store) dropDeadConns(err error) {
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) && (sessionEnded(pgErr) || strings.HasPrefix(pgErr.Code, "57P0") || pgErr.Code == pgReadOnly) ||
		errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) {
		s.pool.Reset()
	}
}

// sessionEnded reports whether the server ended the session with
// pgErr: a connection exception (08), or a FATAL error (57P01,
// pg_terminate_backend, among others).
func sessionEnded(pgErr *pgconn.PgError) bool {
	return pgErr.Severity == "FATAL" || strings.HasPrefix(pgErr.Code, "08")
}

// pgReadOnly is SQLSTATE read_only_sql_transaction: a statement that
// writes, sent to a standby or to a server set read-only.
const pgReadOnly = "25006"

// readOnly reports whether err is a server refusing to write, which
// wrote nothing.
func readOnly(err error) bool {
	var pgErr *pgconn.PgError
	return errors.As(err, &pgErr) && pgErr.Code == pgReadOnly
}
