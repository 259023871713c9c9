package postgres

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/caddy-idempotency/idempotency/store"
	"github.com/jackc/pgx/v5"
)

func (s *Store) StoreName() (name, backend, table, database string) {
	return "postgres:" + s.table.String(), "postgres", s.table.String(), DescribeDSN(s.poolKey.dsn)
}

func (s *Store) InspectRecords(ctx context.Context, f store.RecordFilter) ([]store.InspectedRecord, error) {
	// Without the response, the headers' column only where it is the
	// one-byte mark of a sealed response (store.EncodeResponseHeaders).
	response := `CASE WHEN octet_length(response_header_bytes) = 1 THEN response_header_bytes END, NULL::bytea`
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
		rows, err := s.pool.Query(ctx, `SELECT credential_hash, key, fingerprint, status, method, path, created_at, expires_at,
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
		credHash, fingerprint  []byte
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
	err := row.Scan(&credHash, &ir.Key.Key, &fingerprint, &status, &ir.Record.Method, &ir.Record.Path, &ir.Record.CreatedAt, &ir.Record.ExpiresAt,
		&ir.Expired, &leaseEnded, &leaseEnds, &ir.Now, &ttl, &lockedAt, &lockedUntil, &respStatus, &replayable, &respSize,
		&storedBody, &storedHdrs, &respHeaders, &respBody)
	if err != nil {
		return ir, err
	}
	copy(ir.Key.CredentialHash[:], credHash)
	copy(ir.Record.Fingerprint[:], fingerprint)
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
		if err = store.DecodeResponseHeaders(respHeaders, resp); err != nil {
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

func (s *Store) DeleteRecord(ctx context.Context, key store.RecordKey, force bool, lockTimeout time.Duration) (store.Status, error) {
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

var _ store.Inspector = (*Store)(nil)

// prefixEnd returns the smallest byte string greater than every string
// that starts with p, or nil if there is none (p is all 0xff): with p, the
// bounds of a range that the primary key's index can scan.
func prefixEnd(p []byte) []byte {
	end := bytes.Clone(p)
	for i := len(end) - 1; i >= 0; i-- {
		if end[i] < 0xff {
			end[i]++
			return end[:i+1]
		}
	}
	return nil
}
