package idempotency

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net/http"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/caddy-idempotency/idempotency/store"
	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
)

// acquireConcurrently runs Acquire for n requests for the same key at
// once and counts the outcomes.
func acquireConcurrently(t *testing.T, s store.Store, n int) map[store.Outcome]int {
	t.Helper()
	var (
		wg       sync.WaitGroup
		mu       sync.Mutex
		outcomes = map[store.Outcome]int{}
		start    = make(chan struct{})
	)
	for range n {
		wg.Go(func() {
			<-start
			res, err := s.Acquire(context.Background(), memTestRequest("concurrent-key"))
			if err != nil {
				t.Error(err)
				return
			}
			if res.Outcome == store.OutcomeExisting && res.Record.Status != store.StatusInProgress {
				t.Errorf("existing record is %s", res.Record.Status)
			}
			mu.Lock()
			outcomes[res.Outcome]++
			mu.Unlock()
		})
	}
	close(start)
	wg.Wait()
	return outcomes
}

func TestMemoryConcurrentAcquireCreatesOnce(t *testing.T) {
	s, _ := newTestMemoryStore(100)
	got := acquireConcurrently(t, s, 50)
	if got[store.OutcomeCreated] != 1 || got[store.OutcomeExisting] != 49 {
		t.Fatalf("outcomes = %v, want 1 created and 49 existing", got)
	}
}

func TestMemoryConcurrentTakeoverOnce(t *testing.T) {
	s, clock := newTestMemoryStore(100)
	dead := memTestRequest("concurrent-key")
	mustAcquire(t, s, dead, store.OutcomeCreated)
	clock.advance(memTestLockTimeout + time.Second)

	got := acquireConcurrently(t, s, 50)
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
	first := memTestRequest("takeover-key")
	mustAcquire(t, s, first, store.OutcomeCreated)

	// The lease ends at LockedUntil: until then it is live.
	clock.advance(memTestLockTimeout - time.Nanosecond)
	retry := memTestRequest("takeover-key")
	if rec := mustAcquire(t, s, retry, store.OutcomeExisting); rec.Status != store.StatusInProgress {
		t.Fatalf("status %s", rec.Status)
	}

	// A different request never takes over: it must see the mismatch.
	clock.advance(time.Nanosecond)
	other := memTestRequest("takeover-key")
	other.Fingerprint = [32]byte{3}
	mustAcquire(t, s, other, store.OutcomeExisting)

	mustAcquire(t, s, retry, store.OutcomeTakenOver)
	if err := s.Renew(ctx, first.Key, first.Token); !errors.Is(err, store.ErrLockLost) {
		t.Fatalf("old owner's Renew: %v, want ErrLockLost", err)
	}
	if err := s.Release(ctx, first.Key, first.Token); !errors.Is(err, store.ErrLockLost) {
		t.Fatalf("old owner's Release: %v, want ErrLockLost", err)
	}
	// The takeover renewed the lock.
	rec := mustAcquire(t, s, memTestRequest("takeover-key"), store.OutcomeExisting)
	if !rec.LockedAt.Equal(clock.now()) || rec.CreatedAt.Equal(rec.LockedAt) {
		t.Fatalf("after takeover: created %v, locked %v, now %v", rec.CreatedAt, rec.LockedAt, clock.now())
	}
	if err := s.Complete(ctx, retry.Key, retry.Token, &store.Response{Status: 201, Replayable: true}, retry.Retention); err != nil {
		t.Fatal(err)
	}
	// A completed record is never taken over, however old.
	clock.advance(time.Hour)
	if rec := mustAcquire(t, s, memTestRequest("takeover-key"), store.OutcomeExisting); rec.Status != store.StatusCompleted || rec.Response.Status != 201 {
		t.Fatalf("record %+v", rec)
	}
}

func TestMemoryRenewKeepsTheLock(t *testing.T) {
	s, clock := newTestMemoryStore(100)
	owner := memTestRequest("renew-key")
	mustAcquire(t, s, owner, store.OutcomeCreated)
	for range 3 {
		clock.advance(memTestLockTimeout * 2 / 3)
		if err := s.Renew(context.Background(), owner.Key, owner.Token); err != nil {
			t.Fatal(err)
		}
	}
	clock.advance(memTestLockTimeout * 2 / 3)
	rec := mustAcquire(t, s, memTestRequest("renew-key"), store.OutcomeExisting)
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
			owner := memTestRequest("token-key")
			mustAcquire(t, s, owner, store.OutcomeCreated)

			if err := tc.op(s, owner.Key, newLockToken()); !errors.Is(err, store.ErrLockLost) {
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
	req := memTestRequest("complete-key")
	mustAcquire(t, s, req, store.OutcomeCreated)
	resp := &store.Response{Status: 201, Header: http.Header{"Content-Type": {"application/json"}}, Body: []byte(`{"id":1}`), Replayable: true, BodySize: 8}
	if err := s.Complete(ctx, req.Key, req.Token, resp, req.Retention); err != nil {
		t.Fatal(err)
	}
	if err := s.Release(ctx, req.Key, req.Token); !errors.Is(err, store.ErrLockLost) {
		t.Fatalf("Release of a completed record: %v, want ErrLockLost", err)
	}
	rec := mustAcquire(t, s, memTestRequest("complete-key"), store.OutcomeExisting)
	if rec.Status != store.StatusCompleted || rec.Fingerprint != req.Fingerprint || rec.Method != req.Method || rec.Path != req.Path ||
		rec.Response.Status != 201 || string(rec.Response.Body) != `{"id":1}` || rec.Response.Header.Get("Content-Type") != "application/json" ||
		!rec.Response.Replayable || rec.Response.BodySize != 8 {
		t.Fatalf("record %+v, response %+v", rec, rec.Response)
	}
	if want := rec.CreatedAt.Add(memTestRetention); !rec.ExpiresAt.Equal(want) {
		t.Fatalf("expires %v, want %v", rec.ExpiresAt, want)
	}

	released := memTestRequest("release-key")
	mustAcquire(t, s, released, store.OutcomeCreated)
	if err := s.Release(ctx, released.Key, released.Token); err != nil {
		t.Fatal(err)
	}
	mustAcquire(t, s, memTestRequest("release-key"), store.OutcomeCreated)
}

func TestMemoryRecordsAreCopies(t *testing.T) {
	s, _ := newTestMemoryStore(100)
	req := memTestRequest("copy-key")
	mustAcquire(t, s, req, store.OutcomeCreated)
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
	rec := mustAcquire(t, s, memTestRequest("copy-key"), store.OutcomeExisting)
	rec.Response.Header["X-A"][0] = "3"
	rec.Response.Status = 502
	rec.Status = store.StatusInProgress

	rec = mustAcquire(t, s, memTestRequest("copy-key"), store.OutcomeExisting)
	if rec.Status != store.StatusCompleted || rec.Response.Status != 200 || string(rec.Response.Body) != "body" || rec.Response.Header.Get("X-A") != "1" {
		t.Fatalf("the store's record changed: %+v, %+v", rec, rec.Response)
	}
}

func TestMemoryExpiredRecordsAreAbsent(t *testing.T) {
	s, clock := newTestMemoryStore(100)
	req := memTestRequest("expiry-key")
	mustAcquire(t, s, req, store.OutcomeCreated)
	if err := s.Complete(context.Background(), req.Key, req.Token, &store.Response{Status: 200, Replayable: true}, req.Retention); err != nil {
		t.Fatal(err)
	}
	clock.advance(memTestRetention - time.Nanosecond)
	mustAcquire(t, s, memTestRequest("expiry-key"), store.OutcomeExisting)
	clock.advance(time.Nanosecond)
	again := memTestRequest("expiry-key")
	again.Fingerprint = [32]byte{4} // even another request: the key is free again
	mustAcquire(t, s, again, store.OutcomeCreated)
	if rec := mustAcquire(t, s, memTestRequest("expiry-key"), store.OutcomeExisting); rec.Status != store.StatusInProgress || rec.Fingerprint != again.Fingerprint {
		t.Fatalf("record %+v", rec)
	}

	// An in_progress record expires too.
	stuck := memTestRequest("stuck-key")
	stuck.Retention = time.Minute
	mustAcquire(t, s, stuck, store.OutcomeCreated)
	clock.advance(time.Minute)
	mustAcquire(t, s, memTestRequest("stuck-key"), store.OutcomeCreated)
}

func TestMemoryPrune(t *testing.T) {
	s, clock := newTestMemoryStore(100)
	ctx := context.Background()
	for i := range 10 {
		mustAcquire(t, s, memTestRequest("old-"+strings.Repeat("x", i)), store.OutcomeCreated)
	}
	clock.advance(memTestRetention / 2)
	for i := range 5 {
		mustAcquire(t, s, memTestRequest("new-"+strings.Repeat("x", i)), store.OutcomeCreated)
	}
	if n, err := s.Prune(ctx, 3); err != nil || n != 0 {
		t.Fatalf("Prune before expiry = %d, %v", n, err)
	}
	clock.advance(memTestRetention / 2)
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

	clock.advance(memTestRetention)
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
	first := memTestRequest("full-1")
	first.Retention = time.Hour
	mustAcquire(t, s, first, store.OutcomeCreated)
	mustAcquire(t, s, memTestRequest("full-2"), store.OutcomeCreated)
	mustAcquire(t, s, memTestRequest("full-3"), store.OutcomeCreated)

	if _, err := s.Acquire(ctx, memTestRequest("full-4")); !errors.Is(err, store.ErrStoreFull) {
		t.Fatalf("new key in a full store: %v, want ErrStoreFull", err)
	}
	// Live records are never evicted, and keys already there still answer.
	mustAcquire(t, s, memTestRequest("full-1"), store.OutcomeExisting)

	// An expired record makes room.
	clock.advance(time.Hour)
	mustAcquire(t, s, memTestRequest("full-4"), store.OutcomeCreated)
	if _, ok := s.records.m[first.Key]; ok {
		t.Fatal("the expired record is still stored")
	}
	if _, err := s.Acquire(ctx, memTestRequest("full-5")); !errors.Is(err, store.ErrStoreFull) {
		t.Fatalf("new key in a full store: %v, want ErrStoreFull", err)
	}

	// So does a released one.
	released := memTestRequest("full-4")
	if err := s.Release(ctx, released.Key, s.records.m[released.Key].token); err != nil {
		t.Fatal(err)
	}
	mustAcquire(t, s, memTestRequest("full-5"), store.OutcomeCreated)
}

func TestMemoryCancelledContext(t *testing.T) {
	s, _ := newTestMemoryStore(100)
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	req := memTestRequest("cancelled-key")
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
	provision := func(maxEntries int) *MemoryStore {
		t.Helper()
		m := &MemoryStore{MaxEntries: maxEntries}
		if err := m.Provision(ctx); err != nil {
			t.Fatal(err)
		}
		return m
	}

	old := provision(maxEntries)
	req := memTestRequest("reload-key-" + randomHex(8))
	mustAcquire(t, old, req, store.OutcomeCreated)

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
	retry.Token = newLockToken()
	if rec := mustAcquire(t, reloaded, retry, store.OutcomeExisting); rec.Status != store.StatusCompleted {
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
	mustAcquire(t, fresh, req, store.OutcomeCreated)
}

func TestMemoryProvisionDefaults(t *testing.T) {
	ctx, cancel := caddy.NewContext(caddy.Context{Context: context.Background()})
	defer cancel()
	m := &MemoryStore{}
	if err := m.Provision(ctx); err != nil {
		t.Fatal(err)
	}
	defer m.Cleanup()
	if m.MaxEntries != defaultMemoryMaxEntries || m.records.maxEntries != defaultMemoryMaxEntries {
		t.Fatalf("max entries %d, %d", m.MaxEntries, m.records.maxEntries)
	}

	bad := &MemoryStore{MaxEntries: -1}
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
		{name: "repeated", input: "memory {\n\tmax_entries 1\n\tmax_entries 2\n}", line: 3, errHas: "max_entries already specified"},
		{name: "unknown", input: "memory {\n\tmax_bytes 1\n}", line: 2, errHas: `unrecognized memory store option "max_bytes"`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var m MemoryStore
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

// A reload that changes the memory store's max_entries keeps its
// records: a completed key replays. Catches records pooled by
// max_entries (the reload started an empty store, and the key executed
// again).
func TestMemoryReloadWithOtherMaxEntriesKeepsRecords(t *testing.T) {
	up := newUpstream(t)
	port := freeTCPPort(t)
	logPath := t.TempDir() + "/caddy.log"
	cfg := func(maxEntries int) []byte {
		js, _, err := adaptCaddyfile(globalOptions(logPath, "") + fmt.Sprintf(`http://127.0.0.1:%d {
	idempotency {
		store memory {
			max_entries %d
		}
	}
	reverse_proxy %s
}
`, port, maxEntries, up.Addr()))
		if err != nil {
			t.Fatal(err)
		}
		return js
	}
	srv := startCaddyJSON(t, cfg(1000), logPath)
	s := newSiteClient(t, srv, port)
	c := call{Key: newKey(), Body: payBody()}
	first := s.Do(t, c)
	wantExecuted(t, first, 201)
	if err := caddy.Load(cfg(2000), true); err != nil { // caddyMu is held by this test
		t.Fatalf("reload: %v", err)
	}
	s.reloaded(t)
	wantReplayOf(t, s.Do(t, c), first)
	wantCount(t, up, 1)
}

// A kept body holds at most an eighth (or 256 bytes) more than its
// bytes: a buffer grown by append, or sized for a Content-Length that
// was not sent (a HEAD answer), is cut to its size where a store keeps
// it; a tight one is kept as it is, without a copy.
func TestKeptBodiesAreCutToTheirSize(t *testing.T) {
	loose := make([]byte, 10, 64<<10)
	tight := make([]byte, 100, 110)
	for name, got := range map[string][]byte{
		"memory store": packResponse(&store.Response{Body: loose}).body,
		"replay cache": cachedResponse(&store.Response{Body: loose}).Body,
	} {
		if len(got) != 10 || cap(got) > 10+256 {
			t.Errorf("%s keeps a body of %d bytes in a buffer of %d", name, len(got), cap(got))
		}
	}
	if got := packResponse(&store.Response{Body: tight}).body; &got[0] != &tight[0] {
		t.Error("the memory store copied a body that fits its buffer")
	}
	if got := cachedResponse(&store.Response{Body: tight}).Body; &got[0] != &tight[0] {
		t.Error("the replay cache copied a body that fits its buffer")
	}
}
