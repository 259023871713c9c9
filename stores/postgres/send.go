package postgres

// Sending a batch: each kind of statement's requests marshalled into
// arrays, and its rows scanned back to each request's outcome.

import (
	"context"
	"fmt"
	"time"

	"github.com/caddy-idempotency/idempotency/store"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgtype"
)

// queuedAcquire is an acquire as its batcher queues it. mayHaveCommitted:
// an earlier attempt of the same acquire may have committed.
type queuedAcquire struct {
	store.AcquireRequest
	mayHaveCommitted bool
}

// sendAcquires runs the acquire statement for a batch of requests.
//
// Its statements take at most acquireSlots of the pool's connections at
// once. A request that owns a record must renew its lock and complete it
// before the lock goes stale, or a retry takes the record over and runs
// the request a second time. When the database falls behind, new
// requests queue for connections faster than they get them; if owners
// queued behind them, their renewals and completions would wait as long.
// So new requests wait here instead, and the connections kept from them
// serve the owners first (whose statements have batchers of their own):
// under overload, new requests are slowed or refused (503, after the
// store timeout), never the ones in flight.
func (s *Store) sendAcquires(ctx context.Context, calls []*batchCall[queuedAcquire, store.AcquireResult]) {
	fail := func(err error) {
		for _, c := range calls {
			c.err = err
		}
	}
	select {
	case s.admitted <- struct{}{}:
		defer func() { <-s.admitted }()
	case <-ctx.Done():
		fail(fmt.Errorf("waiting for a connection: %w", ctx.Err()))
		return
	}
	n := len(calls)
	var (
		hashes, fingerprints, tokens = make(column[bytesParam], n), make(column[bytesParam], n), make(column[bytesParam], n)
		keys, methods, paths         = make(column[textParam], n), make(column[textParam], n), make(column[textParam], n)
		retentions, locks            = make(column[int8Param], n), make(column[int8Param], n)
	)
	for i, c := range calls {
		r := &c.req
		hashes[i] = r.Key.CredentialHash[:]
		keys[i] = textParam(r.Key.Key)
		fingerprints[i] = r.Fingerprint[:]
		methods[i] = textParam(r.Method)
		paths[i] = textParam(r.Path)
		tokens[i] = r.Token[:]
		retentions[i] = int8Param(r.Retention.Microseconds())
		locks[i] = int8Param(r.LockTimeout.Microseconds())
	}
	sql, args := s.sql.acquire.forRows(len(calls), []any{hashes, keys, fingerprints, methods, paths, tokens, retentions, locks})
	rows, err := s.pool.Query(ctx, sql, args...)
	if err != nil {
		s.failed(err)
		fail(err)
		return
	}
	// One set of destinations for every row: the record's columns are
	// NULL in the common case, a key just created, and a variable per
	// column and row, escaping to Scan, was an allocation each.
	var (
		row  acquireRow
		dest = row.dest()
	)
	answered := 0
	for rows.Next() {
		if err = rows.Scan(dest...); err != nil {
			break
		}
		if row.n < 1 || int(row.n) > len(calls) {
			continue
		}
		c := calls[row.n-1]
		answered++
		switch {
		case row.outcome < 0:
			c.err = pgx.ErrNoRows
			continue
		case store.Outcome(row.outcome) != store.OutcomeExisting:
			c.res = store.AcquireResult{Outcome: store.Outcome(row.outcome)}
			continue
		}
		rec, recErr := row.record()
		if recErr != nil {
			c.err = recErr
			continue
		}
		c.res = store.AcquireResult{Outcome: store.OutcomeExisting, Record: rec}
	}
	rows.Close()
	if err == nil {
		err = rows.Err()
	}
	if err == nil && answered != len(calls) {
		err = fmt.Errorf("the statement answered %d of %d requests", answered, len(calls))
	}
	if err != nil {
		s.failed(err)
		fail(err)
	}
}

// acquireRow is a row of the acquire statement: the request's ordinal,
// its outcome, and the record found (recordColumnNames), NULL but for an
// existing one.
type acquireRow struct {
	n                                           int64
	outcome                                     int32
	status, method, path                        pgtype.Text
	fingerprint, headers, body                  []byte
	createdAt, expiresAt, lockedAt, lockedUntil pgtype.Timestamptz
	respStatus                                  pgtype.Int4
	replayable                                  pgtype.Bool
	size, ttl                                   pgtype.Int8
}

// dest is what Scan fills, in the statement's order.
func (r *acquireRow) dest() []any {
	return []any{&r.n, &r.outcome, &r.status, &r.fingerprint, &r.method, &r.path, &r.createdAt, &r.expiresAt,
		&r.lockedAt, &r.lockedUntil, &r.respStatus, &r.headers, &r.body, &r.replayable, &r.size, &r.ttl}
}

// record is the existing record that r holds.
func (r *acquireRow) record() (*store.Record, error) {
	rec := &store.Record{
		Status:    store.Status(r.status.String),
		Method:    r.method.String,
		Path:      r.path.String,
		CreatedAt: r.createdAt.Time.UTC(),
		ExpiresAt: r.expiresAt.Time.UTC(),
		TTL:       time.Duration(r.ttl.Int64) * time.Microsecond,
	}
	copy(rec.Fingerprint[:], r.fingerprint)
	if r.lockedAt.Valid {
		rec.LockedAt = r.lockedAt.Time.UTC()
	}
	if r.lockedUntil.Valid {
		rec.LockedUntil = r.lockedUntil.Time.UTC()
	}
	if rec.Status == store.StatusCompleted {
		resp := &store.Response{Body: r.body, Status: int(r.respStatus.Int32), Replayable: r.replayable.Bool, BodySize: r.size.Int64}
		if err := store.DecodeResponseHeaders(r.headers, resp); err != nil {
			return nil, fmt.Errorf("%w: decoding its stored response headers: %w", store.ErrRecordUnreadable, err)
		}
		rec.Response = resp
	}
	return rec, nil
}

// storedResponse is the response of a completed record, from its
// columns but the headers, which each caller decodes as it needs.
func storedResponse(status *int32, replayable *bool, size *int64, body []byte) *store.Response {
	resp := &store.Response{Body: body}
	if status != nil {
		resp.Status = int(*status)
	}
	if replayable != nil {
		resp.Replayable = *replayable
	}
	if size != nil {
		resp.BodySize = *size
	}
	return resp
}

// ownedRequest is a statement on a record that the caller owns under
// token: a completion (with resp), a release or a renewal.
type ownedRequest struct {
	key   store.RecordKey
	token store.LockToken
	resp  *completion
}

// completion is a response as the complete statement stores it.
type completion struct {
	status     int32
	headers    []byte
	body       []byte
	replayable bool
	size       int64
	retention  time.Duration
}

// ownedBatcher sends one kind of statement on owned records.
type ownedBatcher = batcher[ownedRequest, bool]

// newOwnedBatcher returns the batcher of the statement that *sql holds
// (read at each batch: EnableWaiting changes it), op naming it in errors.
func (s *Store) newOwnedBatcher(op string, sql *statement) *ownedBatcher {
	return &ownedBatcher{
		lanes:      batchLanes,
		stallAfter: batchStall,
		key:        func(r ownedRequest) store.RecordKey { return r.key },
		size: func(r ownedRequest) int {
			if r.resp == nil {
				return 0
			}
			return len(r.resp.headers) + len(r.resp.body)
		},
		send: func(ctx context.Context, calls []*batchCall[ownedRequest, bool]) {
			s.sendOwned(ctx, op, *sql, calls)
		},
	}
}

// execOwned runs a statement conditioned on the caller still owning the
// record, in a batch: a row the statement did not change means that the
// lock was lost.
func (s *Store) execOwned(ctx context.Context, b *ownedBatcher, req ownedRequest) error {
	changed, err := b.do(ctx, req)
	if err != nil {
		return err
	}
	if !changed {
		return store.ErrLockLost
	}
	return nil
}

// sendOwned runs st for a batch of owned records and tells each call
// whether its row changed. The database refusing one row's data (a
// permanent error) would fail the whole statement: the rows of a batch
// that failed so are then sent alone, so that only the culprit fails.
func (s *Store) sendOwned(ctx context.Context, op string, st statement, calls []*batchCall[ownedRequest, bool]) {
	n := len(calls)
	var (
		hashes, tokens = make(column[bytesParam], n), make(column[bytesParam], n)
		keys           = make(column[textParam], n)
		args           = make([]any, 0, 11)
	)
	for i, c := range calls {
		hashes[i] = c.req.key.CredentialHash[:]
		keys[i] = textParam(c.req.key.Key)
		tokens[i] = c.req.token[:]
	}
	args = append(args, hashes, keys, tokens)
	if calls[0].req.resp != nil {
		var (
			statuses          = make(column[int4Param], n)
			headers, bodies   = make(column[bytesParam], n), make(column[bytesParam], n)
			replayables       = make(column[boolParam], n)
			sizes, retentions = make(column[int8Param], n), make(column[int8Param], n)
		)
		for i, c := range calls {
			r := c.req.resp
			statuses[i] = int4Param(r.status)
			headers[i] = r.headers
			bodies[i] = r.body
			replayables[i] = boolParam(r.replayable)
			sizes[i] = int8Param(r.size)
			retentions[i] = int8Param(r.retention.Microseconds())
		}
		args = append(args, statuses, headers, bodies, replayables, sizes, retentions)
	}
	var row int64
	dest := []any{&row}
	if s.listener != nil && op != store.OpRenew {
		// EnableWaiting made the statements that end a record notify:
		// their rows have a second column, pg_notify's void.
		dest = append(dest, nil)
		payloads := make([]string, len(calls))
		for i, c := range calls {
			payloads[i] = notifyPayload(c.req.key)
		}
		args = append(args, s.channel, payloads)
	}
	sql, args := st.forRows(len(calls), args)
	rows, err := s.pool.Query(ctx, sql, args...)
	if err == nil {
		for rows.Next() {
			if err = rows.Scan(dest...); err != nil {
				break
			}
			if row >= 1 && int(row) <= len(calls) {
				calls[row-1].res = true
			}
		}
		rows.Close()
		if err == nil {
			err = rows.Err()
		}
	}
	if err == nil {
		return
	}
	s.failed(err)
	if permanentError(err) && len(calls) > 1 {
		for _, c := range calls {
			c.res = false
			s.sendOwned(ctx, op, st, []*batchCall[ownedRequest, bool]{c})
		}
		return
	}
	for _, c := range calls {
		c.res, c.err = false, fmt.Errorf("postgres store: %s: %w", op, err)
	}
}
