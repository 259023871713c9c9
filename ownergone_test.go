package idempotency

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"net/url"
	"sync"
	"testing"
	"time"
)

// "The owner is gone" is one rule: a renewal that reaches the store after
// the lease ended fails, as a takeover and a release would then succeed;
// one before it keeps the record from both. Renewal and release racing at
// the lease's end never both succeed (both may fail, each dated by its own
// statement's clock; the release succeeds when sent again).
func TestStoreLateRenewalVsRelease(t *testing.T) {
	eachRealStore(t, func(t *testing.T, s Store) {
		ctx := context.Background()
		ins := s.(inspector)
		const lease = 150 * time.Millisecond
		acquire := func(key string) AcquireRequest {
			t.Helper()
			req := testAcquireRequest("cred", key, "body")
			req.LockTimeout = lease
			if res, err := s.Acquire(ctx, req); err != nil || res.Outcome != OutcomeCreated {
				t.Fatalf("acquire: %+v, %v", res, err)
			}
			return req
		}

		late := acquire("late-renewal")
		time.Sleep(lease + 50*time.Millisecond)
		if err := s.Renew(ctx, late.Key, late.Token); !errors.Is(err, ErrLockLost) {
			t.Fatalf("a renewal after the lease ended: %v, want ErrLockLost", err)
		}
		if _, err := ins.deleteRecord(ctx, late.Key, false, 0); err != nil {
			t.Fatalf("a release after the lease ended: %v", err)
		}

		for i := range 12 {
			req := acquire(fmt.Sprintf("race-%02d", i))
			// Around the lease's end, from a little before to a little after.
			time.Sleep(lease - 30*time.Millisecond + time.Duration(i)*5*time.Millisecond)
			var renewErr, releaseErr error
			var wg sync.WaitGroup
			wg.Go(func() { renewErr = s.Renew(ctx, req.Key, req.Token) })
			wg.Go(func() { _, releaseErr = ins.deleteRecord(ctx, req.Key, false, 0) })
			wg.Wait()
			switch {
			case renewErr == nil && releaseErr == nil:
				t.Fatalf("race %d: the renewal and the release both succeeded", i)
			case renewErr != nil && !errors.Is(renewErr, ErrLockLost),
				releaseErr != nil && !errors.Is(releaseErr, errNoRecord):
				t.Fatalf("race %d: renewal %v, release %v", i, renewErr, releaseErr)
			case renewErr != nil && releaseErr != nil:
				// The renewal found the lease ended: so does a release now.
				if _, err := ins.deleteRecord(ctx, req.Key, false, 0); err != nil {
					t.Fatalf("race %d: a release after the renewal failed: %v", i, err)
				}
			}
			if renewErr == nil {
				// Renewed: the lease is live again, and the owner completes.
				if err := s.Complete(ctx, req.Key, req.Token, &Response{Status: 201, Replayable: true}, time.Hour); err != nil {
					t.Fatalf("race %d: completing after a renewal: %v", i, err)
				}
			}
		}
	})
}

// The CLI's release and the admin API's are one: both refuse a record
// whose request is still running (a live lease) without force, and both
// release one whose owner is gone, the CLI showing the lock's age and
// lease before it deletes.
func TestCLIAndAdminAPIReleaseAgree(t *testing.T) {
	sb := postgresBackend(t)
	env := []string{"IDEMPOTENCY_DSN=" + sb.DSN}
	buildCaddy(t) // before the request is held: its gate opens by itself after 5s
	up := newUpstream(t)
	s, admin, name := startAdminSite(t, sb, up)
	hold := func(k string) chan struct{} {
		done := make(chan struct{})
		go func() {
			defer close(done)
			_, _ = s.oneShot().DoCtx(context.Background(), call{Key: k, Body: payBody(), Header: map[string]string{"X-Test-Gate": "held"}})
		}()
		return done
	}
	k := newKey()
	done := hold(k)
	defer func() { up.Open("held"); <-done }()
	up.WaitStarted(t, 1)
	recs := admin.records(url.Values{"store": {name}, "key": {k}}, nil)
	if len(recs.Records) != 1 || recs.Records[0].LeaseEnded {
		t.Fatalf("the held record: %+v", recs)
	}
	id := recs.Records[0].CredentialID
	target := []string{"--table", sb.Table, "--key", k, "--credential-id", id}

	// Its request is running: neither releases it without force.
	admin.wantStatus(http.MethodPost, "/idempotency/release", map[string]any{"store": name, "key": k, "credential_id": id}, http.StatusConflict, "live lease")
	wantCLI(t, runCLI(t, env, append([]string{"release"}, target...)...), exitError, "live lease", "locked 0s ago, lease live until", "--force")
	wantCLI(t, runCLI(t, env, append([]string{"inspect"}, target...)...), exitOK, "in_progress, locked", "lease live until")
	if n := pgCount(t, sb); n != 1 {
		t.Fatalf("%d records after the refused releases, want 1", n)
	}

	// Its owner is gone (the lease ended, unrenewed): both see it so,
	// and the CLI releases it.
	pgExec(t, sb.DSN, `UPDATE `+quoteIdent(sb.Table)+` SET locked_at = now() - interval '40 seconds', locked_until = now() - interval '10 seconds' WHERE key = $1`, k)
	recs = admin.records(url.Values{"store": {name}, "key": {k}}, nil)
	if len(recs.Records) != 1 || !recs.Records[0].LeaseEnded {
		t.Fatalf("the record whose lease ended, by the admin API: %+v", recs)
	}
	wantCLI(t, runCLI(t, env, append([]string{"inspect", "--json"}, target...)...), exitOK, `"lease_ended": true`)
	wantCLI(t, runCLI(t, env, append([]string{"release"}, target...)...), exitOK,
		"was in progress, locked 40s ago, lease ended 10s ago", "released key", "deleted its in_progress record")
	if n := pgCount(t, sb); n != 0 {
		t.Fatalf("%d records after the release, want 0", n)
	}
}
