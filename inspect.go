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
	"slices"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
)

// recordFilter selects records: those whose credential hash starts with
// one of credPrefixes (any credential if there are none) and whose key is
// key, or starts with keyPrefix.
type recordFilter struct {
	credPrefixes [][]byte
	key          string
	keyPrefix    string
	limit        int
	// withResponse: read the stored headers and body too.
	withResponse bool
}

func (f recordFilter) matches(rk RecordKey) bool {
	switch {
	case f.key != "" && rk.Key != f.key:
		return false
	case f.keyPrefix != "" && !strings.HasPrefix(rk.Key, f.keyPrefix):
		return false
	case len(f.credPrefixes) == 0:
		return true
	}
	return slices.ContainsFunc(f.credPrefixes, func(p []byte) bool {
		return bytes.HasPrefix(rk.CredentialHash[:], p)
	})
}

// inspectedRecord is a record as an operator sees it. Response is set
// only when the filter asked for it.
type inspectedRecord struct {
	key     RecordKey
	rec     Record
	expired bool
	// leaseEnded: in progress, and no live request owns it.
	leaseEnded bool
	// stored sizes, which a listing gives without reading the response.
	storedBody, storedHeaders *int
}

// inspector is implemented by the stores that an operator can look into
// through the admin API.
type inspector interface {
	// inspectRecords returns up to f.limit records that f selects,
	// ordered by credential hash and key; expired ones included.
	inspectRecords(ctx context.Context, f recordFilter) ([]inspectedRecord, error)
	// deleteRecord deletes the record of key and wakes the requests
	// that wait on it. Without force, only an in-progress record whose
	// lease has ended: one that no live request owns. It returns the
	// status of the record it deleted, or errNoRecord.
	deleteRecord(ctx context.Context, key RecordKey, force bool) (Status, error)
}

// errNoRecord: the record to delete is gone, or (without force) no
// longer an in-progress record with an ended lease.
var errNoRecord = errors.New("no such record")

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

func (m *MemoryStore) inspectRecords(ctx context.Context, f recordFilter) ([]inspectedRecord, error) {
	s := m.records
	var packed []packedResponse
	var out []inspectedRecord
	s.mu.Lock()
	now := s.now()
	for rk, rec := range s.m {
		if !f.matches(rk) {
			continue
		}
		ir := inspectedRecord{key: rk, rec: rec.Record, expired: !now.Before(rec.ExpiresAt)}
		ir.rec.TTL = rec.ExpiresAt.Sub(now)
		ir.leaseEnded = rec.Status == StatusInProgress && !now.Before(rec.LockedUntil)
		if rec.Status == StatusCompleted {
			body, headers := len(rec.response.data)-rec.response.headerEnd, rec.response.headerEnd
			if !rec.response.replayable {
				body = 0
			}
			ir.storedBody, ir.storedHeaders = &body, &headers
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
		if c := bytes.Compare(out[a].key.CredentialHash[:], out[b].key.CredentialHash[:]); c != 0 {
			return c
		}
		return strings.Compare(out[a].key.Key, out[b].key.Key)
	})
	if f.limit > 0 && len(idx) > f.limit {
		idx = idx[:f.limit]
	}
	sorted := make([]inspectedRecord, len(idx))
	for i, j := range idx {
		sorted[i] = out[j]
		if sorted[i].rec.Status == StatusCompleted {
			p := packed[j]
			resp := &Response{Status: p.status, Replayable: p.replayable, BodySize: p.bodySize}
			if f.withResponse {
				// A copy: a packed response never changes once stored.
				resp = p.unpack()
			}
			sorted[i].rec.Response = resp
		}
	}
	return sorted, ctx.Err()
}

func (m *MemoryStore) deleteRecord(_ context.Context, key RecordKey, force bool) (Status, error) {
	s := m.records
	s.mu.Lock()
	rec, ok := s.m[key]
	if !ok || (!force && (rec.Status != StatusInProgress || s.now().Before(rec.LockedUntil))) {
		s.mu.Unlock()
		return "", errNoRecord
	}
	delete(s.m, key)
	s.mu.Unlock()
	s.waits.wake(key)
	return rec.Status, nil
}

func (s *PostgresStore) inspectRecords(ctx context.Context, f recordFilter) ([]inspectedRecord, error) {
	response := `NULL::bytea, NULL::bytea`
	if f.withResponse {
		response = `COALESCE(response_header_bytes, convert_to(response_headers::text, 'UTF8')), response_body`
	}
	// One query per credential prefix: each is a range of the primary
	// key's index. Without a prefix, the range is the whole table.
	prefixes := f.credPrefixes
	if len(prefixes) == 0 {
		prefixes = [][]byte{{}}
	}
	var out []inspectedRecord
	for _, p := range prefixes {
		rows, err := s.pool.Query(ctx, `SELECT credential_hash, key, status, method, path, created_at, expires_at,
	expires_at <= now(), status = 'in_progress' AND (locked_until IS NULL OR locked_until <= now()),
	(extract(epoch FROM expires_at - now()) * 1000000)::bigint,
	locked_at, locked_until, response_status, replayable, response_size,
	octet_length(response_body), octet_length(COALESCE(response_header_bytes, convert_to(response_headers::text, 'UTF8'))),
	`+response+`
FROM `+s.table.quoted()+`
WHERE credential_hash >= $1 AND ($2::bytea IS NULL OR credential_hash < $2)
	AND ($3 = '' OR key = $3) AND ($4 = '' OR starts_with(key, $4))
ORDER BY credential_hash, key
LIMIT $5`, p, prefixEnd(p), f.key, f.keyPrefix, f.limit)
		if err != nil {
			return nil, err
		}
		recs, err := pgx.CollectRows(rows, scanInspected)
		if err != nil {
			return nil, err
		}
		out = append(out, recs...)
	}
	if len(f.credPrefixes) > 1 {
		slices.SortFunc(out, func(a, b inspectedRecord) int {
			if c := bytes.Compare(a.key.CredentialHash[:], b.key.CredentialHash[:]); c != 0 {
				return c
			}
			return strings.Compare(a.key.Key, b.key.Key)
		})
		out = slices.CompactFunc(out, func(a, b inspectedRecord) bool { return a.key == b.key })
		if len(out) > f.limit {
			out = out[:f.limit]
		}
	}
	return out, nil
}

func scanInspected(row pgx.CollectableRow) (inspectedRecord, error) {
	var (
		ir                     inspectedRecord
		credHash               []byte
		status                 string
		ttl                    int64
		lockedAt, lockedUntil  *time.Time
		respStatus             *int32
		replayable             *bool
		respSize               *int64
		storedBody, storedHdrs *int32
		respHeaders, respBody  []byte
	)
	err := row.Scan(&credHash, &ir.key.Key, &status, &ir.rec.Method, &ir.rec.Path, &ir.rec.CreatedAt, &ir.rec.ExpiresAt,
		&ir.expired, &ir.leaseEnded, &ttl, &lockedAt, &lockedUntil, &respStatus, &replayable, &respSize,
		&storedBody, &storedHdrs, &respHeaders, &respBody)
	if err != nil {
		return ir, err
	}
	copy(ir.key.CredentialHash[:], credHash)
	ir.rec.Status = Status(status)
	ir.rec.CreatedAt, ir.rec.ExpiresAt = ir.rec.CreatedAt.UTC(), ir.rec.ExpiresAt.UTC()
	ir.rec.TTL = time.Duration(ttl) * time.Microsecond
	if lockedAt != nil {
		ir.rec.LockedAt = lockedAt.UTC()
	}
	if lockedUntil != nil {
		ir.rec.LockedUntil = lockedUntil.UTC()
	}
	if ir.rec.Status != StatusCompleted {
		return ir, nil
	}
	resp := storedResponse(respStatus, replayable, respSize, respBody)
	if respHeaders != nil {
		if resp.Header, err = decodeHeaders(respHeaders); err != nil {
			return ir, fmt.Errorf("decoding stored response headers: %w", err)
		}
	}
	ir.rec.Response = resp
	body, headers := 0, 0
	if storedBody != nil {
		body = int(*storedBody)
	}
	if storedHdrs != nil {
		headers = int(*storedHdrs)
	}
	ir.storedBody, ir.storedHeaders = &body, &headers
	return ir, nil
}

func (s *PostgresStore) deleteRecord(ctx context.Context, key RecordKey, force bool) (Status, error) {
	tx, err := s.pool.Begin(ctx)
	if err != nil {
		return "", err
	}
	defer func() { _ = tx.Rollback(context.Background()) }() // a no-op once committed
	var status string
	err = tx.QueryRow(ctx, `DELETE FROM `+s.table.quoted()+`
WHERE credential_hash = $1 AND key = $2
	AND ($3 OR (status = 'in_progress' AND (locked_until IS NULL OR locked_until <= now())))
RETURNING status`, key.CredentialHash[:], key.Key, force).Scan(&status)
	if errors.Is(err, pgx.ErrNoRows) {
		return "", errNoRecord
	}
	if err != nil {
		return "", err
	}
	// Wakes the requests of handlers with `wait`, on every instance, as
	// the CLI's release does.
	if _, err := tx.Exec(ctx, `SELECT pg_notify($1, $2)`, notifyChannel(s.table), notifyPayload(key)); err != nil {
		return "", err
	}
	if err := tx.Commit(ctx); err != nil {
		return "", err
	}
	return Status(status), nil
}

// Interface guards
var (
	_ inspector = (*MemoryStore)(nil)
	_ inspector = (*PostgresStore)(nil)
)
