package memory

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net/http"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/caddy-idempotency/idempotency/store"
	"github.com/caddy-idempotency/idempotency/store/storetest"
	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
)

func TestMemoryConcurrentTakeoverOnce(t *testing.T) {
	s, clock := newTestMemoryStore(100)
	dead := storetest.Request("cred", "concurrent-key", "body")
	storetest.MustAcquire(t, s, dead, store.OutcomeCreated)
	clock.Advance(storetest.LockTimeout + time.Second)

	got := storetest.AcquireConcurrently(t, s, storetest.Request("cred", "concurrent-key", "body"), 50)
	if got[store.OutcomeTakenOver] != 1 || got[store.OutcomeExisting] != 49 {
		t.Fatalf("outcomes = %v, want 1 taken over and 49 existing", got)
	}
	if err := s.Complete(context.Background(), dead.Key, dead.Token, &store.Response{Status: 200}, dead.Retention); !errors.Is(err, store.ErrLockLost) {
		t.Fatalf("the dead owner's Complete: %v, want ErrLockLost", err)
	}
}

func TestMemoryTakeover(t *testing.T) {
	s, clock := newTestMemoryStore(100)
	ctx := context.Background()
	first := storetest.Request("cred", "takeover-key", "body")
	storetest.MustAcquire(t, s, first, store.OutcomeCreated)

	// The lease ends at LockedUntil: until then it is live.
	clock.Advance(storetest.LockTimeout - time.Nanosecond)
	retry := storetest.Request("cred", "takeover-key", "body")
	if rec := storetest.MustAcquire(t, s, retry, store.OutcomeExisting); rec.Status != store.StatusInProgress {
		t.Fatalf("status %s", rec.Status)
	}

	// A different request never takes over: it must see the mismatch.
	clock.Advance(time.Nanosecond)
	other := storetest.Request("cred", "takeover-key", "body")
	other.Fingerprint = [32]byte{3}
	storetest.MustAcquire(t, s, other, store.OutcomeExisting)

	storetest.MustAcquire(t, s, retry, store.OutcomeTakenOver)
	if err := s.Renew(ctx, first.Key, first.Token); !errors.Is(err, store.ErrLockLost) {
		t.Fatalf("old owner's Renew: %v, want ErrLockLost", err)
	}
	if err := s.Release(ctx, first.Key, first.Token); !errors.Is(err, store.ErrLockLost) {
		t.Fatalf("old owner's Release: %v, want ErrLockLost", err)
	}
	// The takeover renewed the lock.
	rec := storetest.MustAcquire(t, s, storetest.Request("cred", "takeover-key", "body"), store.OutcomeExisting)
	if !rec.LockedAt.Equal(clock.Now()) || rec.CreatedAt.Equal(rec.LockedAt) {
		t.Fatalf("after takeover: created %v, locked %v, now %v", rec.CreatedAt, rec.LockedAt, clock.Now())
	}
	if err := s.Complete(ctx, retry.Key, retry.Token, &store.Response{Status: 201, Replayable: true}, retry.Retention); err != nil {
		t.Fatal(err)
	}
	// A completed record is never taken over, however old.
	clock.Advance(time.Hour)
	if rec := storetest.MustAcquire(t, s, storetest.Request("cred", "takeover-key", "body"), store.OutcomeExisting); rec.Status != store.StatusCompleted || rec.Response.Status != 201 {
		t.Fatalf("record %+v", rec)
	}
}

func TestMemoryRenewKeepsTheLock(t *testing.T) {
	s, clock := newTestMemoryStore(100)
	owner := storetest.Request("cred", "renew-key", "body")
	storetest.MustAcquire(t, s, owner, store.OutcomeCreated)
	for range 3 {
		clock.Advance(storetest.LockTimeout * 2 / 3)
		if err := s.Renew(context.Background(), owner.Key, owner.Token); err != nil {
			t.Fatal(err)
		}
	}
	clock.Advance(storetest.LockTimeout * 2 / 3)
	rec := storetest.MustAcquire(t, s, storetest.Request("cred", "renew-key", "body"), store.OutcomeExisting)
	if rec.Status != store.StatusInProgress {
		t.Fatalf("status %s", rec.Status)
	}
}

func TestMemoryTokenChecks(t *testing.T) {
	ctx := context.Background()
	resp := &store.Response{Status: 200, Replayable: true}
	for _, tc := range []struct {
		name string
		op   func(s store.Store, key store.RecordKey, token store.LockToken) error
	}{
		{"Complete", func(s store.Store, key store.RecordKey, token store.LockToken) error {
			return s.Complete(ctx, key, token, resp, time.Hour)
		}},
		{"Release", func(s store.Store, key store.RecordKey, token store.LockToken) error {
			return s.Release(ctx, key, token)
		}},
		{"Renew", func(s store.Store, key store.RecordKey, token store.LockToken) error { return s.Renew(ctx, key, token) }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s, _ := newTestMemoryStore(100)
			owner := storetest.Request("cred", "token-key", "body")
			storetest.MustAcquire(t, s, owner, store.OutcomeCreated)

			if err := tc.op(s, owner.Key, store.NewLockToken()); !errors.Is(err, store.ErrLockLost) {
				t.Fatalf("wrong token: %v, want ErrLockLost", err)
			}
			// A missing record is released, by the Store contract (an
			// earlier attempt, whose reply was lost, released it).
			missing := owner.Key
			missing.Key = "missing-key"
			if err := tc.op(s, missing, owner.Token); tc.name != "Release" && !errors.Is(err, store.ErrLockLost) {
				t.Fatalf("missing record: %v, want ErrLockLost", err)
			}
			otherTenant := owner.Key
			otherTenant.CredentialHash = [32]byte{9}
			if err := tc.op(s, otherTenant, owner.Token); tc.name != "Release" && !errors.Is(err, store.ErrLockLost) {
				t.Fatalf("other credential: %v, want ErrLockLost", err)
			}
			if err := tc.op(s, owner.Key, owner.Token); err != nil {
				t.Fatalf("owner: %v", err)
			}
			// Repeated (its reply was lost), the call finds it done.
			if err := tc.op(s, owner.Key, owner.Token); err != nil {
				t.Fatalf("second %s: %v", tc.name, err)
			}
		})
	}
}

func TestMemoryCompleteAndRelease(t *testing.T) {
	s, _ := newTestMemoryStore(100)
	ctx := context.Background()
	req := storetest.Request("cred", "complete-key", "body")
	storetest.MustAcquire(t, s, req, store.OutcomeCreated)
	resp := &store.Response{Status: 201, Header: http.Header{"Content-Type": {"application/json"}}, Body: []byte(`{"id":1}`), Replayable: true, BodySize: 8}
	if err := s.Complete(ctx, req.Key, req.Token, resp, req.Retention); err != nil {
		t.Fatal(err)
	}
	if err := s.Release(ctx, req.Key, req.Token); !errors.Is(err, store.ErrLockLost) {
		t.Fatalf("Release of a completed record: %v, want ErrLockLost", err)
	}
	rec := storetest.MustAcquire(t, s, storetest.Request("cred", "complete-key", "body"), store.OutcomeExisting)
	if rec.Status != store.StatusCompleted || rec.Fingerprint != req.Fingerprint || rec.Method != req.Method || rec.Path != req.Path ||
		rec.Response.Status != 201 || string(rec.Response.Body) != `{"id":1}` || rec.Response.Header.Get("Content-Type") != "application/json" ||
		!rec.Response.Replayable || rec.Response.BodySize != 8 {
		t.Fatalf("record %+v, response %+v", rec, rec.Response)
	}
	if want := rec.CreatedAt.Add(storetest.Retention); !rec.ExpiresAt.Equal(want) {
		t.Fatalf("expires %v, want %v", rec.ExpiresAt, want)
	}

	released := storetest.Request("cred", "release-key", "body")
	storetest.MustAcquire(t, s, released, store.OutcomeCreated)
	if err := s.Release(ctx, released.Key, released.Token); err != nil {
		t.Fatal(err)
	}
	storetest.MustAcquire(t, s, storetest.Request("cred", "release-key", "body"), store.OutcomeCreated)
}

func TestMemoryExpiredRecordsAreAbsent(t *testing.T) {
	s, clock := newTestMemoryStore(100)
	req := storetest.Request("cred", "expiry-key", "body")
	storetest.MustAcquire(t, s, req, store.OutcomeCreated)
	if err := s.Complete(context.Background(), req.Key, req.Token, &store.Response{Status: 200, Replayable: true}, req.Retention); err != nil {
		t.Fatal(err)
	}
	clock.Advance(storetest.Retention - time.Nanosecond)
	storetest.MustAcquire(t, s, storetest.Request("cred", "expiry-key", "body"), store.OutcomeExisting)
	clock.Advance(time.Nanosecond)
	again := storetest.Request("cred", "expiry-key", "body")
	again.Fingerprint = [32]byte{4} // even another request: the key is free again
	storetest.MustAcquire(t, s, again, store.OutcomeCreated)
	if rec := storetest.MustAcquire(t, s, storetest.Request("cred", "expiry-key", "body"), store.OutcomeExisting); rec.Status != store.StatusInProgress || rec.Fingerprint != again.Fingerprint {
		t.Fatalf("record %+v", rec)
	}

	// An in_progress record expires too.
	stuck := storetest.Request("cred", "stuck-key", "body")
	stuck.Retention = time.Minute
	storetest.MustAcquire(t, s, stuck, store.OutcomeCreated)
	clock.Advance(time.Minute)
	storetest.MustAcquire(t, s, storetest.Request("cred", "stuck-key", "body"), store.OutcomeCreated)
}

func TestMemoryPrune(t *testing.T) {
	s, clock := newTestMemoryStore(100)
	ctx := context.Background()
	for i := range 10 {
		storetest.MustAcquire(t, s, storetest.Request("cred", "old-"+strings.Repeat("x", i), "body"), store.OutcomeCreated)
	}
	clock.Advance(storetest.Retention / 2)
	for i := range 5 {
		storetest.MustAcquire(t, s, storetest.Request("cred", "new-"+strings.Repeat("x", i), "body"), store.OutcomeCreated)
	}
	if n, err := s.Prune(ctx, 3); err != nil || n != 0 {
		t.Fatalf("Prune before expiry = %d, %v", n, err)
	}
	clock.Advance(storetest.Retention / 2)
	if n, err := s.Prune(ctx, 3); err != nil || n != 10 {
		t.Fatalf("Prune = %d, %v; want 10", n, err)
	}
	if n, err := s.Prune(ctx, 0); err != nil || n != 0 {
		t.Fatalf("second Prune = %d, %v; want 0", n, err)
	}
	if len(s.records.m) != 5 {
		t.Fatalf("%d records left, want 5", len(s.records.m))
	}
	for key := range s.records.m {
		if !strings.HasPrefix(key.Key, "new-") {
			t.Fatalf("live record %q was pruned", key.Key)
		}
	}

	clock.Advance(storetest.Retention)
	cancelled, cancel := context.WithCancel(ctx)
	cancel()
	if _, err := s.Prune(cancelled, 3); !errors.Is(err, context.Canceled) {
		t.Fatalf("Prune with a cancelled context: %v", err)
	}
	if n, err := s.Prune(ctx, 0); err != nil || n != 5 {
		t.Fatalf("unbatched Prune = %d, %v; want 5", n, err)
	}
}

func TestMemoryFull(t *testing.T) {
	s, clock := newTestMemoryStore(3)
	ctx := context.Background()
	first := storetest.Request("cred", "full-1", "body")
	first.Retention = time.Hour
	storetest.MustAcquire(t, s, first, store.OutcomeCreated)
	storetest.MustAcquire(t, s, storetest.Request("cred", "full-2", "body"), store.OutcomeCreated)
	storetest.MustAcquire(t, s, storetest.Request("cred", "full-3", "body"), store.OutcomeCreated)

	if _, err := s.Acquire(ctx, storetest.Request("cred", "full-4", "body")); !errors.Is(err, store.ErrStoreFull) {
		t.Fatalf("new key in a full store: %v, want ErrStoreFull", err)
	}
	// Live records are never evicted, and keys already there still answer.
	storetest.MustAcquire(t, s, storetest.Request("cred", "full-1", "body"), store.OutcomeExisting)

	// An expired record makes room.
	clock.Advance(time.Hour)
	storetest.MustAcquire(t, s, storetest.Request("cred", "full-4", "body"), store.OutcomeCreated)
	if _, ok := s.records.m[first.Key]; ok {
		t.Fatal("the expired record is still stored")
	}
	if _, err := s.Acquire(ctx, storetest.Request("cred", "full-5", "body")); !errors.Is(err, store.ErrStoreFull) {
		t.Fatalf("new key in a full store: %v, want ErrStoreFull", err)
	}

	// So does a released one.
	released := storetest.Request("cred", "full-4", "body")
	if err := s.Release(ctx, released.Key, s.records.m[released.Key].token); err != nil {
		t.Fatal(err)
	}
	storetest.MustAcquire(t, s, storetest.Request("cred", "full-5", "body"), store.OutcomeCreated)
}

func TestMemoryCancelledContext(t *testing.T) {
	s, _ := newTestMemoryStore(100)
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	req := storetest.Request("cred", "cancelled-key", "body")
	if _, err := s.Acquire(ctx, req); !errors.Is(err, context.Canceled) {
		t.Fatalf("Acquire: %v", err)
	}
	if err := s.Complete(ctx, req.Key, req.Token, &store.Response{}, req.Retention); !errors.Is(err, context.Canceled) {
		t.Fatalf("Complete: %v", err)
	}
	if err := s.Release(ctx, req.Key, req.Token); !errors.Is(err, context.Canceled) {
		t.Fatalf("Release: %v", err)
	}
	if err := s.Renew(ctx, req.Key, req.Token); !errors.Is(err, context.Canceled) {
		t.Fatalf("Renew: %v", err)
	}
}

// A reload keeps the records, whatever max_entries the new config gives:
// a completed key replays instead of executing again (the records were
// once pooled by max_entries, so a reload that changed it emptied the
// store).
func TestMemoryProvisionSharesRecords(t *testing.T) {
	ctx, cancel := caddy.NewContext(caddy.Context{Context: context.Background()})
	defer cancel()
	// Other tests' stores may still hold the process's records.
	refsBefore, _ := memoryPool.References(memoryPoolKey)
	const maxEntries = 4242
	provision := func(maxEntries int) *Store {
		t.Helper()
		m := &Store{MaxEntries: maxEntries}
		if err := m.Provision(ctx); err != nil {
			t.Fatal(err)
		}
		return m
	}

	old := provision(maxEntries)
	req := storetest.Request("cred", "reload-key", "body")
	storetest.MustAcquire(t, old, req, store.OutcomeCreated)

	// A reload provisions the new config before cleaning up the old one.
	reloaded := provision(maxEntries + 1)
	if reloaded.records != old.records {
		t.Fatal("the reloaded store, with another max_entries, does not share the records")
	}
	if got := reloaded.records.maxEntries; got != maxEntries+1 {
		t.Errorf("cap %d after the reload, want the new config's %d", got, maxEntries+1)
	}
	if err := old.Cleanup(); err != nil {
		t.Fatal(err)
	}
	if err := reloaded.Complete(context.Background(), req.Key, req.Token, &store.Response{Status: 200, Replayable: true}, req.Retention); err != nil {
		t.Fatalf("in-flight request completing after the reload: %v", err)
	}
	retry := req
	retry.Token = store.NewLockToken()
	if rec := storetest.MustAcquire(t, reloaded, retry, store.OutcomeExisting); rec.Status != store.StatusCompleted {
		t.Fatalf("the completed key after the reload: %+v", rec)
	}

	if err := reloaded.Cleanup(); err != nil {
		t.Fatal(err)
	}
	if refs, _ := memoryPool.References(memoryPoolKey); refs != refsBefore {
		t.Fatalf("%d references to the records, want the %d from before", refs, refsBefore)
	}
	if refsBefore > 0 {
		return
	}
	fresh := provision(maxEntries)
	defer fresh.Cleanup()
	storetest.MustAcquire(t, fresh, req, store.OutcomeCreated)
}

func TestMemoryProvisionDefaults(t *testing.T) {
	ctx, cancel := caddy.NewContext(caddy.Context{Context: context.Background()})
	defer cancel()
	m := &Store{}
	if err := m.Provision(ctx); err != nil {
		t.Fatal(err)
	}
	defer m.Cleanup()
	if m.MaxEntries != defaultMemoryMaxEntries || m.records.maxEntries != defaultMemoryMaxEntries {
		t.Fatalf("max entries %d, %d", m.MaxEntries, m.records.maxEntries)
	}

	bad := &Store{MaxEntries: -1}
	if err := bad.Provision(ctx); err == nil {
		t.Fatal("negative max_entries accepted")
	}
	if err := bad.Cleanup(); err != nil {
		t.Fatalf("Cleanup after a failed Provision: %v", err)
	}

	if _, err := caddy.GetModule("http.handlers.idempotency.stores.memory"); err != nil {
		t.Fatal(err)
	}
}

func TestMemoryUnmarshalCaddyfile(t *testing.T) {
	for _, tc := range []struct {
		name, input string
		want        int
		errHas      string
		line        int // where the error points
	}{
		{name: "bare", input: "memory", want: 0},
		{name: "empty block", input: "memory {\n}", want: 0},
		{name: "max_entries", input: "memory {\n\tmax_entries 500\n}", want: 500},
		{name: "argument", input: "memory 500", line: 1, errHas: "wrong argument count"},
		{name: "missing value", input: "memory {\n\tmax_entries\n}", line: 2, errHas: "wrong argument count"},
		{name: "two values", input: "memory {\n\tmax_entries 1 2\n}", line: 2, errHas: "wrong argument count"},
		{name: "zero", input: "memory {\n\tmax_entries 0\n}", line: 2, errHas: `max_entries must be a positive integer, got "0"`},
		{name: "negative", input: "memory {\n\tmax_entries -5\n}", line: 2, errHas: `max_entries must be a positive integer, got "-5"`},
		{name: "not a number", input: "memory {\n\tmax_entries lots\n}", line: 2, errHas: `max_entries must be a positive integer, got "lots"`},
		{name: "repeated", input: "memory {\n\tmax_entries 1\n\tmax_entries 2\n}", line: 3, errHas: "max_entries given more than once"},
		{name: "unknown", input: "memory {\n\tmax_bytes 1\n}", line: 2, errHas: `unrecognized memory store option "max_bytes"`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var m Store
			err := m.UnmarshalCaddyfile(caddyfile.NewTestDispenser(tc.input))
			if tc.errHas != "" {
				if err == nil || !strings.Contains(err.Error(), tc.errHas) || !strings.Contains(err.Error(), fmt.Sprintf("Testfile:%d", tc.line)) {
					t.Fatalf("error %v, want one containing %q at line %d", err, tc.errHas, tc.line)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if m.MaxEntries != tc.want {
				t.Fatalf("MaxEntries = %d, want %d", m.MaxEntries, tc.want)
			}
		})
	}
}

// A packed response unpacks to what was packed: every name, every value
// in its order, the body, and the fields beside them.
func TestPackedResponseRoundTrip(t *testing.T) {
	long := strings.Repeat("v", 70000) // a length that takes three varint bytes
	cases := map[string]*store.Response{
		"headers and body": {Status: 201, Replayable: true, BodySize: 4,
			Header: http.Header{"Content-Type": {"application/json"}, "Vary": {"Accept", "Origin", ""}, "X-Long": {long}},
			Body:   []byte("body")},
		"no headers, no body": {Status: 204, Replayable: true},
		"not replayable":      {Status: 200, BodySize: 1 << 30, Header: http.Header{"X-A": {"1"}}},
		"empty header value":  {Status: 200, Replayable: true, Header: http.Header{"X-Empty": {""}}, Body: []byte{}},
	}
	for name, want := range cases {
		got, err := packResponse(want).unpack()
		if err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		if got.Status != want.Status || got.Replayable != want.Replayable || got.BodySize != want.BodySize ||
			!bytes.Equal(got.Body, want.Body) || len(got.Header) != len(want.Header) {
			t.Errorf("%s: unpacked %+v, want %+v", name, got, want)
			continue
		}
		for k, vs := range want.Header {
			if !slices.Equal(got.Header[k], vs) {
				t.Errorf("%s: header %s = %q, want %q", name, k, got.Header[k], vs)
			}
		}
		// Appending to one header's values must not write over the next.
		if vs := got.Header["Vary"]; vs != nil {
			_ = append(vs, "X")
			if got.Header.Get("X-Long") != long {
				t.Errorf("%s: appending to Vary changed X-Long", name)
			}
		}
	}
}

// A kept body holds at most an eighth (or 256 bytes) more than its
// bytes: a buffer grown by append, or sized for a Content-Length that
// was not sent (a HEAD answer), is cut to its size where the store keeps
// it; a tight one is kept as it is, without a copy. (The replay cache's
// twin is in the handler's tests.)
func TestKeptBodiesAreCutToTheirSize(t *testing.T) {
	loose := make([]byte, 10, 64<<10)
	tight := make([]byte, 100, 110)
	if got := packResponse(&store.Response{Body: loose}).body; len(got) != 10 || cap(got) > 10+256 {
		t.Errorf("the memory store keeps a body of %d bytes in a buffer of %d", len(got), cap(got))
	}
	if got := packResponse(&store.Response{Body: tight}).body; &got[0] != &tight[0] {
		t.Error("the memory store copied a body that fits its buffer")
	}
}

// A record is the caller's copy: what a caller changes of the response it
// completed with, or of a record it was given, changes nothing stored.
func TestMemoryRecordsAreCopies(t *testing.T) {
	s, _ := newTestMemoryStore(100)
	req := storetest.Request("cred", "copy-key", "body")
	storetest.MustAcquire(t, s, req, store.OutcomeCreated)
	resp := &store.Response{Status: 200, Header: http.Header{"X-A": {"1"}}, Body: []byte("body"), Replayable: true}
	if err := s.Complete(context.Background(), req.Key, req.Token, resp, req.Retention); err != nil {
		t.Fatal(err)
	}
	// The caller changes what it gave up (the body is the store's now:
	// Store.Complete)...
	resp.Header.Set("X-A", "2")
	resp.Status = 500
	// ...and a replaying handler changes the headers and status it was
	// given (the body is read-only: Store.Acquire).
	rec := storetest.MustAcquire(t, s, storetest.Request("cred", "copy-key", "body"), store.OutcomeExisting)
	rec.Response.Header["X-A"][0] = "3"
	rec.Response.Status = 502
	rec.Status = store.StatusInProgress

	rec = storetest.MustAcquire(t, s, storetest.Request("cred", "copy-key", "body"), store.OutcomeExisting)
	if rec.Status != store.StatusCompleted || rec.Response.Status != 200 || string(rec.Response.Body) != "body" || rec.Response.Header.Get("X-A") != "1" {
		t.Fatalf("the store's record changed: %+v, %+v", rec, rec.Response)
	}
}
