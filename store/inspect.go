package store

// What the admin API asks of a store: to list the records that a
// selector matches, and to delete one of them. Neither is on the request
// path.

import (
	"bytes"
	"slices"
	"strings"
	"time"
)

// RecordFilter selects records for an Inspector: those whose credential
// hash starts with one of CredentialPrefixes (any credential if there
// are none) and whose key is Key, or starts with KeyPrefix, up to Limit.
type RecordFilter struct {
	CredentialPrefixes [][]byte
	Key                string
	KeyPrefix          string
	Limit              int
	// WithResponse: read the stored headers and body too.
	WithResponse bool
	// LockTimeout is the handlers' lock timeout, by which the lease of a
	// record written before migration 0002 (which has no locked_until)
	// is judged, as a retry judges it (the Postgres store's leaseEndSQL).
	LockTimeout time.Duration
}

// Matches reports whether f selects the record of rk.
func (f RecordFilter) Matches(rk RecordKey) bool {
	switch {
	case f.Key != "" && rk.Key != f.Key:
		return false
	case f.KeyPrefix != "" && !strings.HasPrefix(rk.Key, f.KeyPrefix):
		return false
	case len(f.CredentialPrefixes) == 0:
		return true
	}
	return slices.ContainsFunc(f.CredentialPrefixes, func(p []byte) bool {
		return bytes.HasPrefix(rk.CredentialHash[:], p)
	})
}

// InspectedRecord is a record as an operator sees it, as an Inspector
// gives it. Record.Response is set only when the filter asked for it
// (WithResponse).
type InspectedRecord struct {
	Key     RecordKey
	Record  Record
	Expired bool
	// LeaseEnded: in progress, and its owner is gone (by the rule of a
	// takeover: the Postgres store's leaseEndSQL).
	LeaseEnded bool
	// LeaseEnds is when the lease of a record in progress ends by that
	// rule: Record.LockedUntil, or later after an outage, which does not
	// count against a lease (zero where the store cannot tell: then
	// LockedUntil).
	LeaseEnds time.Time
	// Now is the store's clock when the record was read, for ages.
	Now time.Time
	// The stored sizes, which a listing gives without reading the
	// response; nil where the store cannot tell.
	StoredBody, StoredHeaders *int
}
