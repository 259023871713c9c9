package idempotency

// What the admin API (admin.go) asks of the stores: to list the records
// that a selector matches, and to delete one of them. Neither is on the
// request path.

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"net/http"
	"slices"
	"strings"
	"time"

	"github.com/caddy-idempotency/idempotency/store"
	"github.com/jackc/pgx/v5"
)

// lockState describes the lock of an in-progress record by the store's
// clock: its age, and its lease.
func lockState(ir store.InspectedRecord) string {
	age := ir.Now.Sub(ir.Record.LockedAt).Round(time.Second)
	until := leaseEnd(ir)
	switch {
	case ir.Record.LockedUntil.IsZero() && ir.LeaseEnded:
		return fmt.Sprintf("locked %s ago, no lease recorded (written before migration 0002), ended by lock_timeout", age)
	case ir.Record.LockedUntil.IsZero():
		return fmt.Sprintf("locked %s ago, no lease recorded (written before migration 0002), live by lock_timeout", age)
	case ir.LeaseEnded:
		return fmt.Sprintf("locked %s ago, lease ended %s ago at %s", age, ir.Now.Sub(until).Round(time.Second), until.Format(time.RFC3339))
	}
	return fmt.Sprintf("locked %s ago, lease live until %s (%s more)", age, until.Format(time.RFC3339), until.Sub(ir.Now).Round(time.Second))
}

// leaseEnd is when the lease of ir's record ends (LeaseEnds).
func leaseEnd(ir store.InspectedRecord) time.Time {
	if ir.LeaseEnds.IsZero() {
		return ir.Record.LockedUntil
	}
	return ir.LeaseEnds
}

// The refusals of releaseRecord, besides ErrNoRecord; its callers word
// them.
var (
	// errAmbiguous: the credential id matches several credentials.
	errAmbiguous = errors.New("several credentials match")
	// errCompleted: without force, a record that is not in progress,
	// whose retries are replayed.
	errCompleted = errors.New("the record is not in progress")
	// errLeaseLive: without force, a record in progress whose owner may
	// still be running it.
	errLeaseLive = errors.New("the record is in progress under a live lease")
	// errChanged: the record changed between its reading and its
	// deletion (completed, renewed or released meanwhile).
	errChanged = errors.New("the record changed meanwhile")
)

// releaseRecord is the release of the admin API and the CLI alike: it
// finds the one record of f's key that f selects and deletes it. Without
// force, only an in-progress record whose owner is gone, by the rule of
// a takeover and a renewal (its lease has ended by the store's clock);
// the deletion checks it again, so a renewal that comes first keeps the
// record. It returns the record as it was found, and one of the errors
// above or the store's.
func releaseRecord(ctx context.Context, st store.Inspector, f store.RecordFilter, force bool) (store.InspectedRecord, error) {
	f.Limit, f.WithResponse = 2, false
	recs, err := st.InspectRecords(ctx, f)
	switch {
	case err != nil:
		return store.InspectedRecord{}, err
	case len(recs) == 0:
		return store.InspectedRecord{}, store.ErrNoRecord
	case len(recs) > 1:
		return store.InspectedRecord{}, errAmbiguous
	}
	rec := recs[0]
	switch {
	case force:
	case rec.Record.Status != store.StatusInProgress:
		return rec, errCompleted
	case !rec.LeaseEnded:
		return rec, errLeaseLive
	}
	status, err := st.DeleteRecord(ctx, rec.Key, force, f.LockTimeout)
	if errors.Is(err, store.ErrNoRecord) {
		return rec, errChanged
	}
	if err != nil {
		return rec, err
	}
	rec.Record.Status = status
	return rec, nil
}

// parseCredentialID parses a credential id as the log lines print it
// (credentialID): a hex prefix of a credential's keyed hash.
func parseCredentialID(id string) ([]byte, error) {
	prefix, err := hex.DecodeString(id)
	if err != nil || len(prefix) < 6 || len(prefix) > sha256.Size {
		// The value is not repeated: a raw credential pasted here by
		// mistake would reach the log with the error.
		return nil, errors.New("credential id: want 12 to 64 hex digits, an even number (the credential_id of the log lines)")
	}
	return prefix, nil
}

func (m *MemoryStore) adminName() (name, backend, table, database string) {
	return "memory", "memory", "", ""
}

func (s *PostgresStore) adminName() (name, backend, table, database string) {
	return "postgres:" + s.table.String(), "postgres", s.table.String(), describeDSN(s.poolKey.dsn)
}

func (m *MemoryStore) InspectRecords(ctx context.Context, f store.RecordFilter) ([]store.InspectedRecord, error) {
	s := m.records
	var packed []packedResponse
	var out []store.InspectedRecord
	s.mu.Lock()
	now := s.now()
	for rk, rec := range s.m {
		if !f.Matches(rk) {
			continue
		}
		ir := store.InspectedRecord{Key: rk, Record: rec.Record, Expired: !now.Before(rec.ExpiresAt), Now: now}
		ir.Record.TTL = rec.ExpiresAt.Sub(now)
		ir.LeaseEnded = rec.Status == store.StatusInProgress && rec.leaseEnded(now)
		if rec.Status == store.StatusInProgress {
			ir.LeaseEnds = rec.LockedUntil
		}
		if rec.Status == store.StatusCompleted {
			body, headers := len(rec.response.body), len(rec.response.headers)
			if !rec.response.replayable {
				body = 0
			}
			ir.StoredBody, ir.StoredHeaders = &body, &headers
		}
		out = append(out, ir)
		packed = append(packed, rec.response)
	}
	s.mu.Unlock()
	// A map has no order: sort, then cut, so that a limit gives the
	// same records each time.
	idx := make([]int, len(out))
	for i := range idx {
		idx[i] = i
	}
	slices.SortFunc(idx, func(a, b int) int {
		if c := bytes.Compare(out[a].Key.CredentialHash[:], out[b].Key.CredentialHash[:]); c != 0 {
			return c
		}
		return strings.Compare(out[a].Key.Key, out[b].Key.Key)
	})
	if f.Limit > 0 && len(idx) > f.Limit {
		idx = idx[:f.Limit]
	}
	sorted := make([]store.InspectedRecord, len(idx))
	for i, j := range idx {
		sorted[i] = out[j]
		if sorted[i].Record.Status == store.StatusCompleted {
			p := packed[j]
			resp := &store.Response{Status: p.status, Replayable: p.replayable, BodySize: p.bodySize}
			if f.WithResponse {
				// A copy: a packed response never changes once stored.
				var err error
				if resp, err = p.unpack(); err != nil {
					return nil, fmt.Errorf("memory store: %w", err)
				}
			}
			sorted[i].Record.Response = resp
		}
	}
	return sorted, ctx.Err()
}

func (m *MemoryStore) DeleteRecord(_ context.Context, key store.RecordKey, force bool, _ time.Duration) (store.Status, error) {
	s := m.records
	s.mu.Lock()
	rec, ok := s.m[key]
	if !ok || (!force && (rec.Status != store.StatusInProgress || !rec.leaseEnded(s.now()))) {
		s.mu.Unlock()
		return "", store.ErrNoRecord
	}
	delete(s.m, key)
	s.mu.Unlock()
	s.waits.wake(key)
	return rec.Status, nil
}

func (s *PostgresStore) InspectRecords(ctx context.Context, f store.RecordFilter) ([]store.InspectedRecord, error) {
	response := `NULL::bytea, NULL::bytea`
	if f.WithResponse {
		response = `COALESCE(response_header_bytes, convert_to(response_headers::text, 'UTF8')), response_body`
	}
	// One query per credential prefix: each is a range of the primary
	// key's index. Without a prefix, the range is the whole table.
	prefixes := f.CredentialPrefixes
	if len(prefixes) == 0 {
		prefixes = [][]byte{{}}
	}
	var out []store.InspectedRecord
	for _, p := range prefixes {
		rows, err := s.pool.Query(ctx, `SELECT credential_hash, key, status, method, path, created_at, expires_at,
	expires_at <= now(), lease_ends <= now(), lease_ends, now(),
	(extract(epoch FROM expires_at - now()) * 1000000)::bigint,
	locked_at, locked_until, response_status, replayable, response_size,
	octet_length(response_body), octet_length(COALESCE(response_header_bytes, convert_to(response_headers::text, 'UTF8'))),
	`+response+`
FROM `+s.table.quoted()+` AS r,
	LATERAL (SELECT CASE WHEN status = 'in_progress' THEN `+leaseEndSQL(primarySinceSQL(s.table), "r", "$6::bigint"+microseconds)+` END) AS l (lease_ends)
WHERE credential_hash >= $1 AND ($2::bytea IS NULL OR credential_hash < $2)
	AND ($3 = '' OR key = $3) AND ($4 = '' OR starts_with(key, $4))
ORDER BY credential_hash, key
LIMIT $5`, p, prefixEnd(p), f.Key, f.KeyPrefix, f.Limit, f.LockTimeout.Microseconds())
		if err != nil {
			return nil, err
		}
		recs, err := pgx.CollectRows(rows, scanInspected)
		if err != nil {
			return nil, err
		}
		out = append(out, recs...)
	}
	if len(f.CredentialPrefixes) > 1 {
		slices.SortFunc(out, func(a, b store.InspectedRecord) int {
			if c := bytes.Compare(a.Key.CredentialHash[:], b.Key.CredentialHash[:]); c != 0 {
				return c
			}
			return strings.Compare(a.Key.Key, b.Key.Key)
		})
		out = slices.CompactFunc(out, func(a, b store.InspectedRecord) bool { return a.Key == b.Key })
		if len(out) > f.Limit {
			out = out[:f.Limit]
		}
	}
	return out, nil
}

func scanInspected(row pgx.CollectableRow) (store.InspectedRecord, error) {
	var (
		ir                     store.InspectedRecord
		credHash               []byte
		status                 string
		ttl                    int64
		lockedAt, lockedUntil  *time.Time
		leaseEnded             *bool
		leaseEnds              *time.Time
		respStatus             *int32
		replayable             *bool
		respSize               *int64
		storedBody, storedHdrs *int32
		respHeaders, respBody  []byte
	)
	err := row.Scan(&credHash, &ir.Key.Key, &status, &ir.Record.Method, &ir.Record.Path, &ir.Record.CreatedAt, &ir.Record.ExpiresAt,
		&ir.Expired, &leaseEnded, &leaseEnds, &ir.Now, &ttl, &lockedAt, &lockedUntil, &respStatus, &replayable, &respSize,
		&storedBody, &storedHdrs, &respHeaders, &respBody)
	if err != nil {
		return ir, err
	}
	copy(ir.Key.CredentialHash[:], credHash)
	ir.LeaseEnded = leaseEnded != nil && *leaseEnded
	if leaseEnds != nil {
		ir.LeaseEnds = leaseEnds.UTC()
	}
	ir.Record.Status = store.Status(status)
	ir.Record.CreatedAt, ir.Record.ExpiresAt, ir.Now = ir.Record.CreatedAt.UTC(), ir.Record.ExpiresAt.UTC(), ir.Now.UTC()
	ir.Record.TTL = time.Duration(ttl) * time.Microsecond
	if lockedAt != nil {
		ir.Record.LockedAt = lockedAt.UTC()
	}
	if lockedUntil != nil {
		ir.Record.LockedUntil = lockedUntil.UTC()
	}
	if ir.Record.Status != store.StatusCompleted {
		return ir, nil
	}
	resp := storedResponse(respStatus, replayable, respSize, respBody)
	if respHeaders != nil {
		if resp.Header, err = decodeHeaders(respHeaders); err != nil {
			return ir, fmt.Errorf("decoding stored response headers: %w", err)
		}
	}
	ir.Record.Response = resp
	body, headers := 0, 0
	if storedBody != nil {
		body = int(*storedBody)
	}
	if storedHdrs != nil {
		headers = int(*storedHdrs)
	}
	ir.StoredBody, ir.StoredHeaders = &body, &headers
	return ir, nil
}

func (s *PostgresStore) DeleteRecord(ctx context.Context, key store.RecordKey, force bool, lockTimeout time.Duration) (store.Status, error) {
	tx, err := s.pool.Begin(ctx)
	if err != nil {
		return "", err
	}
	defer func() { _ = tx.Rollback(context.Background()) }() // a no-op once committed
	var status string
	err = tx.QueryRow(ctx, `DELETE FROM `+s.table.quoted()+` AS r
WHERE credential_hash = $1 AND key = $2
	AND ($3 OR (status = 'in_progress' AND `+leaseEndSQL(primarySinceSQL(s.table), "r", "$4::bigint"+microseconds)+` <= now()))
RETURNING status`, key.CredentialHash[:], key.Key, force, lockTimeout.Microseconds()).Scan(&status)
	if errors.Is(err, pgx.ErrNoRows) {
		return "", store.ErrNoRecord
	}
	if err != nil {
		return "", err
	}
	// Wakes the requests of handlers with `wait`, on every instance.
	if _, err := tx.Exec(ctx, `SELECT pg_notify($1, $2)`, notifyChannel(s.table), notifyPayload(key)); err != nil {
		return "", err
	}
	if err := tx.Commit(ctx); err != nil {
		return "", err
	}
	return store.Status(status), nil
}

// Interface guards
var (
	_ store.Inspector = (*MemoryStore)(nil)
	_ store.Inspector = (*PostgresStore)(nil)
)

// recordJSON is a record as the admin API and the CLI's --json show it:
// never a raw credential, and the stored response only when asked
// (body=1).
type recordJSON struct {
	CredentialHash string        `json:"credential_hash"`
	CredentialID   string        `json:"credential_id"`
	Key            string        `json:"key"`
	Status         store.Status  `json:"status"`
	Expired        bool          `json:"expired"`
	Method         string        `json:"method"`
	Path           string        `json:"path"`
	Created        time.Time     `json:"created"`
	Expires        time.Time     `json:"expires"`
	Locked         *time.Time    `json:"locked,omitempty"`
	LockedUntil    *time.Time    `json:"locked_until,omitempty"`
	LeaseEnds      *time.Time    `json:"lease_ends,omitempty"`
	LeaseEnded     bool          `json:"lease_ended,omitempty"`
	ResponseStatus *int          `json:"response_status,omitempty"`
	Replayable     *bool         `json:"replayable,omitempty"`
	BodySize       *int64        `json:"response_body_size,omitempty"`
	StoredBody     *int          `json:"stored_body_bytes,omitempty"`
	StoredHeaders  *int          `json:"stored_headers_bytes,omitempty"`
	Response       *responseJSON `json:"response,omitempty"`
}

// responseJSON is a stored response, which the admin API shows with
// body=1.
type responseJSON struct {
	Header http.Header `json:"headers"`
	// Body is base64, as JSON gives bytes: a body need not be text.
	Body []byte `json:"body_base64"`
}

func newRecordJSON(ir store.InspectedRecord, withResponse bool) recordJSON {
	rec := recordJSON{
		CredentialHash: fmt.Sprintf("%x", ir.Key.CredentialHash),
		CredentialID:   credentialID(ir.Key.CredentialHash),
		Key:            ir.Key.Key,
		Status:         ir.Record.Status,
		Expired:        ir.Expired,
		LeaseEnded:     ir.LeaseEnded,
		Method:         ir.Record.Method,
		Path:           ir.Record.Path,
		Created:        ir.Record.CreatedAt.UTC(),
		Expires:        ir.Record.ExpiresAt.UTC(),
		StoredBody:     ir.StoredBody,
		StoredHeaders:  ir.StoredHeaders,
	}
	if ir.Record.Status == store.StatusInProgress {
		locked, until, ends := ir.Record.LockedAt.UTC(), ir.Record.LockedUntil.UTC(), leaseEnd(ir).UTC()
		rec.Locked, rec.LockedUntil, rec.LeaseEnds = &locked, &until, &ends
	}
	if resp := ir.Record.Response; resp != nil {
		rec.ResponseStatus, rec.Replayable, rec.BodySize = &resp.Status, &resp.Replayable, &resp.BodySize
		if withResponse {
			rec.Response = &responseJSON{resp.Header, resp.Body}
		}
	}
	return rec
}
