package memory

import (
	"bytes"
	"context"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/caddy-idempotency/idempotency/store"
)

// The records as the admin API and the CLI see them: listed, and
// released by an operator.

func (m *Store) StoreName() (name, backend, table, database string) {
	return "memory", "memory", "", ""
}

func (m *Store) InspectRecords(ctx context.Context, f store.RecordFilter) ([]store.InspectedRecord, error) {
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
			resp := &store.Response{Status: p.status, Replayable: p.replayable, BodySize: p.bodySize, Sealed: p.sealed}
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

func (m *Store) DeleteRecord(_ context.Context, key store.RecordKey, force bool, _ time.Duration) (store.Status, error) {
	s := m.records
	s.mu.Lock()
	rec, ok := s.m[key]
	if !ok || (!force && (rec.Status != store.StatusInProgress || !rec.leaseEnded(s.now()))) {
		s.mu.Unlock()
		return "", store.ErrNoRecord
	}
	delete(s.m, key)
	s.mu.Unlock()
	s.waits.Wake(key)
	return rec.Status, nil
}

var _ store.Inspector = (*Store)(nil)
