package idempotency

import (
	"context"
	"net/http"
	"net/url"
	"regexp"
	"testing"
	"time"

	"github.com/caddy-idempotency/idempotency/internal/pgtest"
	"github.com/caddy-idempotency/idempotency/stores/postgres"
)

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
	// The ages it prints are in whole seconds, read when the CLI runs: on a
	// busy machine, a second or two later than the record was dated.
	res := runCLI(t, env, append([]string{"release"}, target...)...)
	wantCLI(t, res, exitError, "live lease", "--force")
	wantCLIMatches(t, res, `locked [0-5]s ago, lease live until`)
	wantCLI(t, runCLI(t, env, append([]string{"inspect"}, target...)...), exitOK, "in_progress, locked", "lease live until")
	if n := pgCount(t, sb); n != 1 {
		t.Fatalf("%d records after the refused releases, want 1", n)
	}

	// Dated back past its lease on a server that has been the primary only
	// since the test began: the outage rule keeps it live, and both say
	// until when, not the locked_until that has passed.
	pgtest.Exec(t, sb.DSN, `UPDATE `+pgtest.QuoteIdent(sb.Table)+` SET locked_at = now() - interval '40 seconds', locked_until = now() - interval '10 seconds' WHERE key = $1`, k)
	tn, err := postgres.ParseTable(sb.Table)
	if err != nil {
		t.Fatal(err)
	}
	pgtest.Exec(t, sb.DSN, `UPDATE `+tn.PrimariesTable()+` SET first_seen = now()`)
	recs = admin.records(url.Values{"store": {name}, "key": {k}}, nil)
	if r := recs.Records; len(r) != 1 || r[0].LeaseEnded || r[0].LeaseEnds == nil || time.Until(*r[0].LeaseEnds) < 20*time.Second {
		t.Fatalf("the record whose locked_until passed before the server was up for its lease, by the admin API: %+v; want its lease live about 30s more", recs)
	}
	res = runCLI(t, env, append([]string{"inspect"}, target...)...)
	wantCLI(t, res, exitOK, "in_progress, locked")
	wantCLIMatches(t, res, `lease live until \S+ \(\d+s more\)`)

	// Its owner is gone (the lease ended, unrenewed): both see it so,
	// and the CLI releases it.
	pgtest.Exec(t, sb.DSN, `UPDATE `+pgtest.QuoteIdent(sb.Table)+` SET locked_at = now() - interval '40 seconds', locked_until = now() - interval '10 seconds' WHERE key = $1`, k)
	primaryLongUp(t, sb.DSN, sb.Table)
	recs = admin.records(url.Values{"store": {name}, "key": {k}}, nil)
	if len(recs.Records) != 1 || !recs.Records[0].LeaseEnded {
		t.Fatalf("the record whose lease ended, by the admin API: %+v", recs)
	}
	wantCLI(t, runCLI(t, env, append([]string{"inspect", "--json"}, target...)...), exitOK, `"lease_ended": true`)
	res = runCLI(t, env, append([]string{"release"}, target...)...)
	wantCLI(t, res, exitOK, "released key", "deleted its in_progress record")
	wantCLIMatches(t, res, `was in progress, locked 4[0-5]s ago, lease ended 1[0-5]s ago`)
	if n := pgCount(t, sb); n != 0 {
		t.Fatalf("%d records after the release, want 0", n)
	}
}

// wantCLIMatches checks that what the CLI printed matches pattern.
func wantCLIMatches(t *testing.T, res cliResult, pattern string) {
	t.Helper()
	if !regexp.MustCompile(pattern).MatchString(res.stdout + res.stderr) {
		t.Errorf("output does not match %q: %s", pattern, res)
	}
}
