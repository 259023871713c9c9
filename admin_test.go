package idempotency

// The admin API (admin.go) through Caddy's real admin endpoint, against
// both stores: list, show, release, and what a release does to the
// key's next request.

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"strings"
	"testing"
	"time"

	"github.com/caddy-idempotency/idempotency/internal/pgtest"
	"github.com/caddy-idempotency/idempotency/store"
	"github.com/caddyserver/caddy/v2"
)

// adminClient talks to an in-process Caddy's admin endpoint.
type adminClient struct {
	t    *testing.T
	base string
}

// do sends a request to the admin endpoint; a non-nil body is sent as
// JSON. It returns the status and the raw answer.
func (a adminClient) do(method, path string, body any) (int, []byte) {
	a.t.Helper()
	var rd io.Reader
	if body != nil {
		b, err := json.Marshal(body)
		if err != nil {
			a.t.Fatal(err)
		}
		rd = bytes.NewReader(b)
	}
	req, err := http.NewRequest(method, a.base+path, rd)
	if err != nil {
		a.t.Fatal(err)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		a.t.Fatalf("%s %s: %v", method, path, err)
	}
	defer resp.Body.Close()
	out, err := io.ReadAll(resp.Body)
	if err != nil {
		a.t.Fatal(err)
	}
	return resp.StatusCode, out
}

type adminRecords struct {
	Store     string       `json:"store"`
	Records   []recordJSON `json:"records"`
	Truncated bool         `json:"truncated"`
}

// records lists records, by GET with query parameters or, with a body,
// by POST; it fails the test unless the answer is 200.
func (a adminClient) records(q url.Values, body map[string]any) adminRecords {
	a.t.Helper()
	method, path := http.MethodGet, "/idempotency/records?"+q.Encode()
	if body != nil {
		method, path = http.MethodPost, "/idempotency/records"
	}
	status, out := a.do(method, path, body)
	if status != http.StatusOK {
		a.t.Fatalf("%s %s: %d %s", method, path, status, out)
	}
	a.noSecrets(out)
	var recs adminRecords
	if err := json.Unmarshal(out, &recs); err != nil {
		a.t.Fatalf("%s: %v", out, err)
	}
	return recs
}

// noSecrets fails the test if an answer holds the raw credential.
func (a adminClient) noSecrets(out []byte) {
	a.t.Helper()
	if bytes.Contains(out, []byte("tenant-a-token")) {
		a.t.Errorf("the admin API shows a raw credential: %s", out)
	}
}

// wantStatus sends a request and checks its status and message.
func (a adminClient) wantStatus(method, path string, body any, status int, contains string) {
	a.t.Helper()
	got, out := a.do(method, path, body)
	if got != status || !strings.Contains(string(out), contains) {
		a.t.Fatalf("%s %s: %d %s, want %d with %q", method, path, got, out, status, contains)
	}
	a.noSecrets(out)
}

// startAdminSite starts Caddy with an admin endpoint and one protected
// site on store sb.
func startAdminSite(t *testing.T, sb storeBackend, up *upstream, directives ...string) (*site, adminClient, string) {
	t.Helper()
	admin := fmt.Sprintf("127.0.0.1:%d", freeTCPPort(t))
	port := freeTCPPort(t)
	srv := startCaddyfileAdmin(t, fmt.Sprintf(`http://127.0.0.1:%d {
	idempotency {
		%s
		%s
	}
	reverse_proxy %s {
		flush_interval -1
	}
}
`, port, sb.Block(), strings.Join(directives, "\n\t\t"), up.Addr()), admin)
	name := "memory"
	if sb.Name == "postgres" {
		name = "postgres:" + sb.Table
	}
	return newSiteClient(t, srv, port), adminClient{t: t, base: "http://" + admin}, name
}

// An operator lists and shows the records of the running store by the
// CLI's selectors, without seeing a credential or a body unless asked;
// a completed record is released only with force, after which its key
// executes again at once, the replay cache notwithstanding.
func TestAdminAPIRecords(t *testing.T) {
	eachStore(t, func(t *testing.T, sb storeBackend) {
		up := newUpstream(t)
		s, admin, name := startAdminSite(t, sb, up)

		status, out := admin.do(http.MethodGet, "/idempotency/stores", nil)
		var stores []adminStore
		if err := json.Unmarshal(out, &stores); status != http.StatusOK || err != nil {
			t.Fatalf("stores: %d %s %v", status, out, err)
		}
		if len(stores) != 1 || stores[0].Name != name || stores[0].Handlers != 1 {
			t.Fatalf("stores: %s, want one named %s", out, name)
		}

		k1 := newKey()
		c1 := call{Key: k1, Body: payBody()}
		first := s.Do(t, c1)
		wantExecuted(t, first, http.StatusCreated)
		// The replay puts the record in the handler's replay cache.
		wantReplayOf(t, s.Do(t, c1), first)
		c2 := call{Key: k1 + "-second", Body: payBody()}
		wantExecuted(t, s.Do(t, c2), http.StatusCreated)

		// List by key: no body, no headers, no credential.
		recs := admin.records(url.Values{"store": {name}, "key": {k1}}, nil)
		if len(recs.Records) != 1 {
			t.Fatalf("records of %s: %+v", k1, recs)
		}
		rec := recs.Records[0]
		if rec.Key != k1 || rec.Status != store.StatusCompleted || rec.Method != "POST" || rec.Path != "/pay" ||
			rec.ResponseStatus == nil || *rec.ResponseStatus != http.StatusCreated || rec.Response != nil || len(rec.CredentialID) != 12 {
			t.Fatalf("record: %+v", rec)
		}
		_, raw := admin.do(http.MethodGet, "/idempotency/records?key="+k1, nil)
		if bytes.Contains(raw, c1.Body) || bytes.Contains(raw, first.Body) {
			t.Errorf("a listing shows a body: %s", raw)
		}

		// Show, by credential id, with the body: as stored, or, sealed
		// (Postgres, by default), said to be sealed, without it.
		wantBody := func(recs adminRecords, how string) {
			t.Helper()
			if len(recs.Records) != 1 || recs.Records[0].Response == nil || !bytes.Equal(recs.Records[0].Response.Body, first.Body) ||
				recs.Records[0].Response.Header.Get("X-Execution-Id") != first.Header.Get("X-Execution-Id") {
				t.Fatalf("shown with body=1 %s: %+v, want body %q", how, recs, first.Body)
			}
		}
		recs = admin.records(url.Values{"key": {k1}, "credential_id": {rec.CredentialID}, "body": {"1"}}, nil)
		if sealed := sb.Name == "postgres"; sealed != rec.Sealed {
			t.Fatalf("listed as sealed: %v, want %v", rec.Sealed, sealed)
		} else if sealed && (len(recs.Records) != 1 || !recs.Records[0].Sealed || recs.Records[0].Response != nil) {
			t.Fatalf("a sealed record shown with body=1 by credential id: %+v, want sealed, without the response", recs)
		} else if !sealed {
			wantBody(recs, "by credential id")
		}
		// By the raw credential, the sealed response opens.
		wantBody(admin.records(nil, map[string]any{"key": k1, "credential": defaultCred, "body": true}), "by credential")
		if recs := admin.records(nil, map[string]any{"key": k1, "credential_id": rec.CredentialID, "body": true}); sb.Name == "postgres" && recs.Records[0].Response != nil {
			t.Fatalf("sealed, shown by credential id: %+v", recs)
		}

		// With bodies, a listing is short: each response is held in
		// memory.
		if status, out := admin.do(http.MethodGet, "/idempotency/records?body=1&limit=11&key="+k1, nil); status != http.StatusBadRequest ||
			!bytes.Contains(out, []byte("with body, limit must be 1 to 10")) {
			t.Errorf("body=1&limit=11: %d %s, want 400 naming the limit with bodies", status, out)
		}

		// By the raw credential, in a POST body only.
		recs = admin.records(nil, map[string]any{"store": name, "key": k1, "credential": defaultCred})
		if len(recs.Records) != 1 || recs.Records[0].CredentialHash != rec.CredentialHash {
			t.Fatalf("by credential: %+v, want %s", recs, rec.CredentialHash)
		}
		if recs := admin.records(nil, map[string]any{"key": k1, "credential": "Bearer someone-else"}); len(recs.Records) != 0 {
			t.Fatalf("another credential's records: %+v", recs)
		}
		admin.wantStatus(http.MethodGet, "/idempotency/records?key="+k1+"&credential=Bearer+tenant-a-token", nil,
			http.StatusBadRequest, "POST body")

		// By key prefix, with a limit.
		if recs := admin.records(url.Values{"key_prefix": {k1}}, nil); len(recs.Records) != 2 || recs.Truncated {
			t.Fatalf("by key prefix: %+v, want 2", recs)
		}
		if recs := admin.records(url.Values{"key_prefix": {k1}, "limit": {"1"}}, nil); len(recs.Records) != 1 || !recs.Truncated {
			t.Fatalf("by key prefix, limit 1: %+v, want 1, truncated", recs)
		}

		admin.wantStatus(http.MethodGet, "/idempotency/records?store=nonesuch", nil, http.StatusNotFound, name)

		// A completed record is kept without force, and still replayed.
		release := map[string]any{"store": name, "key": k1, "credential_id": rec.CredentialID}
		admin.wantStatus(http.MethodPost, "/idempotency/release", release, http.StatusConflict, "not in progress")
		wantReplayOf(t, s.Do(t, c1), first)
		wantCount(t, up, 2)

		// With force it goes, from the store and the replay cache: the
		// key executes again.
		admin.wantStatus(http.MethodPost, "/idempotency/release",
			map[string]any{"key": k1, "credential": defaultCred, "force": true}, http.StatusOK, `"status": "completed"`)
		if recs := admin.records(url.Values{"key": {k1}}, nil); len(recs.Records) != 0 {
			t.Fatalf("records after release: %+v", recs)
		}
		wantExecuted(t, s.Do(t, c1), http.StatusCreated)
		wantCount(t, up, 3)
		admin.wantStatus(http.MethodPost, "/idempotency/release?key=nonesuch-key&credential_id="+rec.CredentialID, nil,
			http.StatusNotFound, "no record")
	})
}

// A record in progress under a live lease may still be running: release
// refuses it without force. With force, the key executes again while the
// first request runs on, whose response is then not stored: its
// connection is cut rather than ended as a success no retry gets.
func TestAdminAPIReleaseInProgress(t *testing.T) {
	eachStore(t, func(t *testing.T, sb storeBackend) {
		up := newUpstream(t)
		s, admin, name := startAdminSite(t, sb, up)

		k := newKey()
		c := call{Key: k, Body: payBody(), Header: map[string]string{"X-Test-Gate": "held"}}
		done := make(chan error, 1)
		go func() {
			_, err := s.oneShot().DoCtx(context.Background(), c)
			done <- err
		}()
		up.WaitStarted(t, 1)

		recs := admin.records(url.Values{"store": {name}, "key": {k}}, nil)
		if len(recs.Records) != 1 || recs.Records[0].Status != store.StatusInProgress || recs.Records[0].LockedUntil == nil || recs.Records[0].LeaseEnded {
			t.Fatalf("the held record: %+v", recs)
		}
		id := recs.Records[0].CredentialID
		release := map[string]any{"key": k, "credential_id": id}
		admin.wantStatus(http.MethodPost, "/idempotency/release", release, http.StatusConflict, "live lease")
		wantProblem(t, s.Do(t, call{Key: k, Body: c.Body}), http.StatusConflict)

		release["force"] = true
		admin.wantStatus(http.MethodPost, "/idempotency/release", release, http.StatusOK, `"status": "in_progress"`)
		retry := call{Key: k, Body: c.Body, Header: map[string]string{"X-Test-Gate": "retry"}}
		up.Open("retry")
		wantExecuted(t, s.Do(t, retry), http.StatusCreated)
		up.Open("held")
		select {
		case err := <-done:
			if err == nil {
				t.Errorf("the held request, whose record was released, got a whole answer")
			}
		case <-time.After(10 * time.Second):
			t.Fatal("the held request did not end")
		}
		wantCount(t, up, 2)
	})
}

// An in-progress record whose lease has ended (its owner is gone) is
// released without force: nothing can be running it.
func TestAdminAPIReleaseEndedLease(t *testing.T) {
	sb := postgresBackend(t)
	up := newUpstream(t)
	s, admin, name := startAdminSite(t, sb, up)
	k := newKey()
	c := call{Key: k, Body: payBody(), Header: map[string]string{"X-Test-Gate": "held"}}
	done := make(chan struct{})
	go func() {
		defer close(done)
		_, _ = s.DoCtx(context.Background(), c)
	}()
	defer func() { up.Open("held"); <-done }()
	up.WaitStarted(t, 1)
	// As if its owner had died: the lease ends, and is not renewed
	// before the default lock_timeout's third, 10s.
	pgtest.Exec(t, sb.DSN, `UPDATE `+pgtest.QuoteIdent(sb.Table)+` SET locked_until = now() - interval '1 second' WHERE key = $1`, k)
	recs := admin.records(url.Values{"store": {name}, "key": {k}}, nil)
	if len(recs.Records) != 1 || !recs.Records[0].LeaseEnded {
		t.Fatalf("the record whose lease ended: %+v", recs)
	}
	admin.wantStatus(http.MethodPost, "/idempotency/release",
		map[string]any{"key": k, "credential_id": recs.Records[0].CredentialID}, http.StatusOK, `"status": "in_progress"`)
}

// With several stores running, a request must name one, and the error
// lists them.
func TestAdminAPISeveralStores(t *testing.T) {
	pg := postgresBackend(t)
	up := newUpstream(t)
	admin := fmt.Sprintf("127.0.0.1:%d", freeTCPPort(t))
	site := func(sb storeBackend) string {
		return fmt.Sprintf(`http://127.0.0.1:%d {
	idempotency {
		%s
	}
	reverse_proxy %s
}
`, freeTCPPort(t), sb.Block(), up.Addr())
	}
	startCaddyfileAdmin(t, site(storeBackend{Name: "memory"})+site(pg)+site(pg), admin)
	a := adminClient{t: t, base: "http://" + admin}
	status, out := a.do(http.MethodGet, "/idempotency/stores", nil)
	var stores []adminStore
	if err := json.Unmarshal(out, &stores); status != http.StatusOK || err != nil || len(stores) != 2 ||
		stores[0].Name != "memory" || stores[1].Name != "postgres:"+pg.Table || stores[1].Handlers != 2 {
		t.Fatalf("stores: %d %s", status, out)
	}
	a.wantStatus(http.MethodGet, "/idempotency/records", nil, http.StatusBadRequest, "memory, postgres:"+pg.Table)
	if recs := a.records(url.Values{"store": {"postgres:" + pg.Table}}, nil); len(recs.Records) != 0 {
		t.Fatalf("records of a new table: %+v", recs)
	}
}

// A reload swaps the stores the admin API serves: the unloaded config's
// handlers are gone from it.
func TestAdminAPIReload(t *testing.T) {
	pg := postgresBackend(t)
	up := newUpstream(t)
	s, a, _ := startAdminSite(t, storeBackend{Name: "memory"}, up)
	cfg := globalOptions(s.LogPath, strings.TrimPrefix(a.base, "http://")) + fmt.Sprintf(`http://127.0.0.1:%d {
	idempotency {
		%s
	}
	reverse_proxy %s
}
`, freeTCPPort(t), pg.Block(), up.Addr())
	cfgJSON, _, err := adaptCaddyfile(cfg)
	if err != nil {
		t.Fatal(err)
	}
	if err := caddy.Load(cfgJSON, true); err != nil {
		t.Fatal(err)
	}
	// The old admin server stops in the background; a request must not
	// land in the queue of its listener as it closes.
	waitListenerReleased(t, strings.TrimPrefix(a.base, "http://"))
	status, out := a.do(http.MethodGet, "/idempotency/stores", nil)
	var stores []adminStore
	if err := json.Unmarshal(out, &stores); status != http.StatusOK || err != nil || len(stores) != 1 || stores[0].Name != "postgres:"+pg.Table {
		t.Fatalf("stores after the reload: %d %s", status, out)
	}
}

// A query that does not parse whole (Go drops a pair with a ';') is
// refused, not read without the selectors it lost: those would list
// records of credentials the caller did not name.
func TestAdminAPIRefusesMalformedQuery(t *testing.T) {
	_, admin, name := startAdminSite(t, storeBackend{Name: "memory"}, newUpstream(t))
	admin.wantStatus(http.MethodGet, "/idempotency/records?store="+name+"&key=k-000001&credential_id=0686f898bd37;", nil,
		http.StatusBadRequest, "query string")
	admin.wantStatus(http.MethodGet, "/idempotency/records?store="+name+"&credential_id=Bearer%20secret-token", nil,
		http.StatusBadRequest, "credential id")
	_, out := admin.do(http.MethodGet, "/idempotency/records?store="+name+"&credential_id=Bearer%20secret-token", nil)
	if strings.Contains(string(out), "secret-token") {
		t.Errorf("the error repeats the value given as credential_id: %s", out)
	}
}
