package idempotency

// What the admin API (admin.go) asks of the stores: to list the records
// that a selector matches, and to delete one of them. Neither is on the
// request path.

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"net/http"
	"time"

	"github.com/caddy-idempotency/idempotency/store"
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

// given counts the selectors given, of those that name whose records
// they are (a credential id, a credential, a scope): at most one is.
func given(selectors ...string) int {
	n := 0
	for _, s := range selectors {
		if s != "" {
			n++
		}
	}
	return n
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

// recordJSON is a record as the admin API and the CLI's --json show it:
// never a raw credential, and the stored response only when asked
// (body=1).
type recordJSON struct {
	CredentialHash string       `json:"credential_hash"`
	CredentialID   string       `json:"credential_id"`
	Key            string       `json:"key"`
	Status         store.Status `json:"status"`
	Expired        bool         `json:"expired"`
	Method         string       `json:"method"`
	Path           string       `json:"path"`
	Created        time.Time    `json:"created"`
	Expires        time.Time    `json:"expires"`
	Locked         *time.Time   `json:"locked,omitempty"`
	LockedUntil    *time.Time   `json:"locked_until,omitempty"`
	LeaseEnds      *time.Time   `json:"lease_ends,omitempty"`
	LeaseEnded     bool         `json:"lease_ended,omitempty"`
	// Sealed: the stored response is sealed (seal.go), and shown only
	// to a request that names the raw credential.
	Sealed         bool          `json:"sealed,omitempty"`
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
		rec.Sealed = resp.Sealed
		if withResponse && !resp.Sealed {
			rec.Response = &responseJSON{resp.Header, resp.Body}
		}
	}
	return rec
}
