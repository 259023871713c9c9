package idempotency

import (
	"bytes"
	"context"
	"crypto/hmac"
	"crypto/sha256"
	"encoding/base64"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"io/fs"
	"net/http"
	"os"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/caddy-idempotency/idempotency/internal/pgtest"
	"github.com/caddy-idempotency/idempotency/migrations"
	"github.com/caddy-idempotency/idempotency/store"
	"github.com/caddy-idempotency/idempotency/stores/memory"
	"github.com/caddy-idempotency/idempotency/stores/postgres"
	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
)

// handlerCredentialHash is the hash under which a handler of sb without
// credential_secret keys the records of cred: under the store's default
// secret, which the handler has created by now.
func handlerCredentialHash(t testing.TB, sb storeBackend, cred string) [32]byte {
	t.Helper()
	return newCredentialHasher(storeSecret(t, sb)).hash(cred)
}

// storeSecret is sb's default credential secret.
func storeSecret(t testing.TB, sb storeBackend) []byte {
	t.Helper()
	if sb.Name == "memory" {
		secret, _ := (&memory.Store{}).CredentialSecret(context.Background())
		return secret
	}
	tn, err := postgres.ParseTable(sb.Table)
	if err != nil {
		t.Fatal(err)
	}
	rows := pgtest.Query(t, sb.DSN, "SELECT encode(secret, 'hex') FROM "+tn.SecretTable())
	if len(rows) != 1 {
		t.Fatalf("%d rows in the secret table of %s, want 1", len(rows), sb.Table)
	}
	secret, err := hex.DecodeString(rows[0][0])
	if err != nil {
		t.Fatal(err)
	}
	return secret
}

// migrationCount is the number of the Postgres store's migrations.
func migrationCount(t testing.TB) int {
	t.Helper()
	files, err := fs.Glob(migrations.Files, "*.sql")
	if err != nil {
		t.Fatal(err)
	}
	return len(files)
}

// loadErr loads a config that must fail, and returns its error.
func loadErr(t *testing.T, caddyfile string) error {
	t.Helper()
	js, _, err := adaptCaddyfile(globalOptions(t.TempDir()+"/caddy.log", "") + caddyfile)
	if err != nil {
		t.Fatalf("adapting: %v", err)
	}
	caddyMu.Lock()
	defer caddyMu.Unlock()
	err = caddy.Load(js, true)
	if err == nil {
		_ = caddy.Stop()
		t.Fatalf("loading succeeded, want an error for:\n%s", caddyfile)
	}
	return err
}

// reloadSite replaces the running config of s (whose caddyMu the test
// holds) with its site, logging to the same file, whose idempotency block
// is directives.
func reloadSite(t *testing.T, s *site, upstreamAddr string, directives ...string) {
	t.Helper()
	port, _ := strconv.Atoi(s.URL[strings.LastIndexByte(s.URL, ':')+1:])
	js, _, err := adaptCaddyfile(globalOptions(s.LogPath, "") + fmt.Sprintf(`http://127.0.0.1:%d {
	idempotency {
		%s
	}
	reverse_proxy %s
}
`, port, strings.Join(directives, "\n\t\t"), upstreamAddr))
	if err != nil {
		t.Fatal(err)
	}
	if err := caddy.Load(js, true); err != nil {
		t.Fatalf("reload: %v", err)
	}
	s.reloaded(t)
}

// sendWith sends c with extra header fields added to those it has.
func (s *site) sendWith(t *testing.T, c call, extra http.Header) reply {
	t.Helper()
	req, err := s.request(context.Background(), c)
	if err != nil {
		t.Fatal(err)
	}
	for name, values := range extra {
		for _, v := range values {
			req.Header.Add(name, v)
		}
	}
	resp, err := s.client.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return reply{Status: resp.StatusCode, Header: resp.Header, Body: b}
}

// basicAlice is a Basic credential whose password is in every dictionary.
var basicAlice = "Basic " + base64.StdEncoding.EncodeToString([]byte("alice:sunshine1"))

// Item 9.13: neither the stored credential_hash nor the logged
// credential_id is an unkeyed hash of the credential (or a part of one),
// from which a dictionary would recover alice's password; both are the
// keyed hash under the store's secret.
func TestCredentialHashIsKeyed(t *testing.T) {
	eachStore(t, func(t *testing.T, sb storeBackend) {
		up := newUpstream(t)
		s := protectedSite(t, sb, up.Addr())
		c := call{Key: newKey(), Body: payBody(), Cred: basicAlice}
		wantExecuted(t, s.Do(t, c), http.StatusCreated)
		// A mismatch after a replay: two more lines with a credential_id.
		if r := s.Do(t, c); !r.replayed() {
			t.Fatalf("not a replay: %s", r)
		}
		wantProblem(t, s.Do(t, call{Key: c.Key, Body: payBody(), Cred: basicAlice}), http.StatusConflict)

		unkeyed := sha256.Sum256([]byte(basicAlice))
		unkeyedHex := hex.EncodeToString(unkeyed[:])
		keyed := handlerCredentialHash(t, sb, basicAlice)
		ids := 0
		for _, l := range s.moduleLogLines(t) {
			id, ok := l["credential_id"].(string)
			if !ok {
				continue
			}
			ids++
			if id == "" || strings.HasPrefix(unkeyedHex, id) {
				t.Errorf("%s logs credential_id %q, a prefix of the credential's SHA-256", l["msg"], id)
			}
			if id != hex.EncodeToString(keyed[:6]) {
				t.Errorf("%s logs credential_id %q, want %x", l["msg"], id, keyed[:6])
			}
		}
		if ids < 2 {
			t.Fatalf("%d log lines with a credential_id, want 2", ids)
		}
		if sb.Name != "postgres" {
			return
		}
		rows := pgtest.Query(t, sb.DSN, "SELECT encode(credential_hash, 'hex') FROM "+pgtest.QuoteIdent(sb.Table))
		if len(rows) != 1 {
			t.Fatalf("%d rows, want 1", len(rows))
		}
		if rows[0][0] == unkeyedHex || rows[0][0][:12] == unkeyedHex[:12] {
			t.Errorf("credential_hash %s is the credential's SHA-256", rows[0][0])
		}
		if rows[0][0] != hex.EncodeToString(keyed[:]) {
			t.Errorf("credential_hash %s, want the HMAC under the table's secret %x", rows[0][0], keyed)
		}
	})
}

// Instances that share a table agree on its secret without being told
// one: a key executed through one handler replays through another, also
// after a reload; and handlers that start together create one secret.
func TestCredentialSecretSharedByInstances(t *testing.T) {
	sb := postgresBackend(t)
	up := newUpstream(t)
	port := freeTCPPort(t)
	// Two handlers on one table, each with its own replay cache, so that
	// the replay must come from the table, found under the same hash.
	srv := startCaddyfile(t, fmt.Sprintf(`http://127.0.0.1:%d {
	@a header X-Instance a
	@b header X-Instance b
	route {
		idempotency @a {
			%s
		}
		idempotency @b {
			%s
		}
		reverse_proxy %s
	}
}
`, port, sb.Block(), sb.Block(), up.Addr()))
	s := newSiteClient(t, srv, port)
	c := call{Key: newKey(), Body: payBody(), Header: map[string]string{"X-Instance": "a"}}
	first := s.Do(t, c)
	wantExecuted(t, first, http.StatusCreated)
	c.Header = map[string]string{"X-Instance": "b"}
	wantReplayOf(t, s.Do(t, c), first)

	// A handler provisioned anew (a restart, as far as the secret goes).
	reloadSite(t, s, up.Addr(), sb.Block())
	wantReplayOf(t, s.Do(t, c), first)
	wantCount(t, up, 1)

	// Stores that start at once, on a table that has no secret yet.
	table := pgtest.FreshTable(t)
	stores := make([]*postgres.Store, 8)
	ctx, cancel := caddy.NewContext(caddy.Context{Context: context.Background()})
	defer cancel()
	for i := range stores {
		stores[i] = &postgres.Store{DSN: sb.DSN, Table: table, MaxConns: 4}
		stores[i].UseCredentialSecret()
		if err := stores[i].Provision(ctx); err != nil {
			t.Fatal(err)
		}
		defer stores[i].Cleanup()
	}
	secrets := make([][]byte, len(stores))
	var wg sync.WaitGroup
	for i, st := range stores {
		wg.Go(func() {
			var err error
			if secrets[i], err = st.CredentialSecret(context.Background()); err != nil {
				t.Error(err)
			}
		})
	}
	wg.Wait()
	for i := range secrets {
		if len(secrets[i]) != store.MinSecretLen || !bytes.Equal(secrets[i], secrets[0]) {
			t.Fatalf("concurrent starts disagree on the secret: %x", secrets)
		}
	}
}

// The memory store's secret outlives a config reload, as its records do.
func TestMemoryCredentialSecretSurvivesReload(t *testing.T) {
	up := newUpstream(t)
	s := protectedSite(t, storeBackend{Name: "memory"}, up.Addr())
	c := call{Key: newKey(), Body: payBody()}
	first := s.Do(t, c)
	wantExecuted(t, first, http.StatusCreated)
	reloadSite(t, s, up.Addr(), "store memory", "retry_after 3s")
	wantReplayOf(t, s.Do(t, c), first)
	wantCount(t, up, 1)
}

// credential_secret, from an {env.*} placeholder resolved at start and
// kept out of the config, replaces the store's secret: records are keyed
// under it, and a record keyed under the old secret is out of reach.
func TestCredentialSecretConfigured(t *testing.T) {
	eachStore(t, func(t *testing.T, sb storeBackend) {
		secret := "configured-" + pgtest.RandomHex(16)
		t.Setenv("IDEMPOTENCY_TEST_CRED_SECRET", secret)
		up := newUpstream(t)
		s := protectedSite(t, sb, up.Addr())
		c := call{Key: newKey(), Body: payBody()}
		wantExecuted(t, s.Do(t, c), http.StatusCreated)

		reloadSite(t, s, up.Addr(), sb.Block(), "credential_secret {env.IDEMPOTENCY_TEST_CRED_SECRET}")
		// Under another secret, the same credential and key are another
		// record: the request executes again (README: Credential secret).
		first := s.Do(t, c)
		wantExecuted(t, first, http.StatusCreated)
		wantReplayOf(t, s.Do(t, c), first)
		wantCount(t, up, 2)

		keyed := newCredentialHasher([]byte(secret)).hash(defaultCred)
		stored := handlerCredentialHash(t, sb, defaultCred)
		var id string
		for _, l := range s.moduleLogLines(t) {
			if l["msg"] == "idempotency.replay" {
				id, _ = l["credential_id"].(string)
			}
		}
		if id != hex.EncodeToString(keyed[:6]) {
			t.Errorf("replay logs credential_id %q, want %x (under credential_secret; the store's gives %x)", id, keyed[:6], stored[:6])
		}
		if sb.Name == "postgres" {
			rows := pgtest.Query(t, sb.DSN, "SELECT encode(credential_hash, 'hex') FROM "+pgtest.QuoteIdent(sb.Table)+" ORDER BY created_at")
			if len(rows) != 2 || rows[1][0] != hex.EncodeToString(keyed[:]) || rows[0][0] != hex.EncodeToString(stored[:]) {
				t.Errorf("credential hashes %v, want [%x %x]", rows, stored, keyed)
			}
		}
	})
	// Never in the config: the placeholder is resolved at provision,
	// and the config keeps it.
	secret := "configured-" + pgtest.RandomHex(16)
	t.Setenv("IDEMPOTENCY_TEST_CRED_SECRET", secret)
	h := &Handler{CredentialSecret: "{env.IDEMPOTENCY_TEST_CRED_SECRET}"}
	if err := provisionHandler(t, h); err != nil {
		t.Fatal(err)
	}
	js, err := json.Marshal(h)
	if err != nil || strings.Contains(string(js), secret) || !strings.Contains(string(js), "{env.IDEMPOTENCY_TEST_CRED_SECRET}") {
		t.Errorf("the provisioned config %s (%v) should keep the placeholder, not the secret", js, err)
	}
}

// A secret shorter than 32 bytes is refused: in the Caddyfile, with its
// line, and at start when a placeholder gives it.
func TestCredentialSecretTooShort(t *testing.T) {
	_, _, err := adaptCaddyfile("http://127.0.0.1:8080 {\n\tidempotency {\n\t\tcredential_secret hunter2\n\t}\n\treverse_proxy 127.0.0.1:9\n}\n")
	if err == nil || !strings.Contains(err.Error(), "Caddyfile:3") || !strings.Contains(err.Error(), "fewer than 32") {
		t.Errorf("a 7-byte credential_secret: %v, want an error naming line 3 and the minimum", err)
	}
	eachStore(t, func(t *testing.T, sb storeBackend) {
		t.Setenv("IDEMPOTENCY_TEST_SHORT_SECRET", strings.Repeat("x", 31))
		err := loadErr(t, fmt.Sprintf(`http://127.0.0.1:%d {
	idempotency {
		%s
		credential_secret {env.IDEMPOTENCY_TEST_SHORT_SECRET}
	}
	reverse_proxy 127.0.0.1:9
}
`, freeTCPPort(t), sb.Block()))
		if !strings.Contains(err.Error(), "credential_secret is 31 bytes, fewer than 32") {
			t.Errorf("load error %v, want one about the secret's length", err)
		}
		if strings.Contains(err.Error(), strings.Repeat("x", 31)) {
			t.Errorf("the error shows the secret: %v", err)
		}
	})
}

// Item 9.15: a credential that is not exactly one placeholder puts
// callers in shared scopes: a constant, every caller; text around a
// placeholder, every caller whose placeholder is empty ("tenant-");
// two placeholders, callers whose values run together alike ("ab"+"c",
// "a"+"bc"). They are refused in the Caddyfile, with the line, and in
// JSON.
func TestConstantCredentialRefused(t *testing.T) {
	for _, cred := range []string{
		"tenant-x", `\{http.auth.user.id}`,
		"tenant-{http.request.header.X-Tenant}",
		"{http.request.header.X-Org}{http.request.header.X-User}",
		"{http.request.header.X-Org}-x",
	} {
		_, _, err := adaptCaddyfile("http://127.0.0.1:8080 {\n\tidempotency {\n\t\tcredential " + cred + "\n\t}\n\treverse_proxy 127.0.0.1:9\n}\n")
		if err == nil || !strings.Contains(err.Error(), "Caddyfile:3") || !strings.Contains(err.Error(), "exactly one placeholder") {
			t.Errorf("credential %s: %v, want an error naming line 3", cred, err)
		}
	}
	if _, _, err := adaptCaddyfile("http://127.0.0.1:8080 {\n\tidempotency {\n\t\tcredential {http.auth.user.id}\n\t}\n\treverse_proxy 127.0.0.1:9\n}\n"); err != nil {
		t.Errorf("credential {http.auth.user.id}: %v", err)
	}
	for _, h := range []*Handler{
		{Credential: "tenant-x"},
		{Credential: "tenant-{http.request.header.X-Tenant}"},
	} {
		if err := provisionHandler(t, h); err != nil {
			t.Fatal(err)
		}
		if err := h.Validate(); err == nil || !strings.Contains(err.Error(), "one scope") {
			t.Errorf("Validate of credential %q: %v, want an error", h.Credential, err)
		}
	}
}

// A key header that carries credentials would put them in the table and
// the log, where keys go as they are.
func TestCredentialKeyHeaderRefused(t *testing.T) {
	for _, h := range []*Handler{
		{KeyHeader: "Authorization"},
		{KeyHeader: "cookie"},
		{KeyHeader: "X-Api-Key", CredentialHeader: "x-api-key"},
		{KeyHeader: "X-K", Credential: "{http.request.header.x-k}"},
	} {
		if err := provisionHandler(t, h); err != nil {
			t.Fatal(err)
		}
		if err := h.Validate(); err == nil || !strings.Contains(err.Error(), "carries credentials") {
			t.Errorf("Validate of key_header %q: %v, want an error", h.KeyHeader, err)
		}
	}
}

// The CLI hashes --credential as the handlers do: under the table's
// stored secret, or under --credential-secret when the handlers have
// credential_secret.
func TestCLICredentialSecret(t *testing.T) {
	dsn := pgtest.DSN(t)
	sb := postgresBackend(t)
	secret := "configured-" + pgtest.RandomHex(16)
	t.Setenv("IDEMPOTENCY_TEST_CLI_SECRET", secret)
	env := []string{"IDEMPOTENCY_DSN=" + dsn}
	up := newUpstream(t)
	s := protectedSite(t, sb, up.Addr())
	stored := call{Key: newKey(), Body: payBody(), Cred: basicAlice}
	wantExecuted(t, s.Do(t, stored), http.StatusCreated)
	reloadSite(t, s, up.Addr(), sb.Block(), "credential_secret {env.IDEMPOTENCY_TEST_CLI_SECRET}")
	configured := call{Key: newKey(), Body: payBody(), Cred: basicAlice}
	wantExecuted(t, s.Do(t, configured), http.StatusCreated)

	keyedStored := handlerCredentialHash(t, sb, basicAlice)
	keyedConfigured := newCredentialHasher([]byte(secret)).hash(basicAlice)
	base := []string{"inspect", "--table", sb.Table, "--credential", basicAlice}
	wantCLI(t, runCLI(t, env, append(base, "--key", stored.Key)...), exitOK,
		"credential id:    "+hex.EncodeToString(keyedStored[:6]))
	// The secret from the environment, as the handlers take it, out of
	// the process list.
	wantCLI(t, runCLI(t, env, append(base, "--key", configured.Key, "--credential-secret", "{env.IDEMPOTENCY_TEST_CLI_SECRET}")...), exitOK,
		"credential id:    "+hex.EncodeToString(keyedConfigured[:6]))
	wantCLI(t, runCLI(t, env, append(base, "--key", configured.Key)...), exitNotFound, "--credential-secret")
	wantCLI(t, runCLI(t, env, append(base, "--key", configured.Key, "--credential-secret", "short")...), exitUsage, "fewer than 32")
	wantCLI(t, runCLI(t, env, "inspect", "--table", sb.Table, "--key", configured.Key,
		"--credential-id", hex.EncodeToString(keyedConfigured[:6]), "--credential-secret", secret), exitUsage, "goes with --credential")
	// A table no handler without credential_secret has used has no
	// secret: the CLI says what to do rather than hash under nothing.
	fresh := pgtest.FreshTable(t)
	wantCLI(t, runCLI(t, env, "migrate", "--table", fresh), exitOK)
	wantCLI(t, runCLI(t, env, "inspect", "--table", fresh, "--key", configured.Key, "--credential", basicAlice), exitError,
		"no stored credential secret", "--credential-secret")
}

// Item 9.11: two fields of the key header, or of the credential header,
// with different values leave it unclear which one counts: 400 naming the
// header, nothing executed, nothing stored. Identical repeats are one.
func TestDuplicateHeaderFields(t *testing.T) {
	eachStore(t, func(t *testing.T, sb storeBackend) {
		up := newUpstream(t)
		port, customPort := freeTCPPort(t), freeTCPPort(t)
		srv := startCaddyfile(t, fmt.Sprintf(`http://127.0.0.1:%d {
	idempotency {
		%s
	}
	reverse_proxy %s
}
http://127.0.0.1:%d {
	idempotency {
		%s
		credential_header X-Api-Key
	}
	reverse_proxy %s
}
`, port, sb.Block(), up.Addr(), customPort, sb.Block(), up.Addr()))
		s, custom := newSiteClient(t, srv, port), newSiteClient(t, srv, customPort)
		twoKeys := call{Key: newKey(), Body: payBody()}
		p := wantProblem(t, s.sendWith(t, twoKeys, http.Header{"Idempotency-Key": {newKey()}}), http.StatusBadRequest)
		if !strings.Contains(p.Detail, "Idempotency-Key") {
			t.Errorf("detail %q does not name the header", p.Detail)
		}
		p = wantProblem(t, s.sendWith(t, call{Key: newKey(), Body: payBody()}, http.Header{"Authorization": {"Bearer tenant-b-token"}}), http.StatusBadRequest)
		if !strings.Contains(p.Detail, "Authorization") {
			t.Errorf("detail %q does not name the header", p.Detail)
		}
		p = wantProblem(t, custom.sendWith(t, call{Key: newKey(), Body: payBody(), CredHeader: "X-Api-Key", Cred: "key-a"},
			http.Header{"X-Api-Key": {"key-b"}}), http.StatusBadRequest)
		if !strings.Contains(p.Detail, "X-Api-Key") || strings.Contains(p.Title+p.Detail, "Authorization") {
			t.Errorf("problem %+v should name X-Api-Key", p)
		}
		wantCount(t, up, 0)
		if sb.Name == "postgres" {
			if n := pgCount(t, sb); n != 0 {
				t.Errorf("%d records after refused requests, want 0", n)
			}
		}
		// Nothing stored: the key executes when sent once.
		wantExecuted(t, s.Do(t, twoKeys), http.StatusCreated)

		// The same value twice is one value.
		same := call{Key: newKey(), Body: payBody()}
		first := s.sendWith(t, same, http.Header{"Idempotency-Key": {same.Key}, "Authorization": {defaultCred}})
		wantExecuted(t, first, http.StatusCreated)
		wantReplayOf(t, s.Do(t, same), first)
		wantCount(t, up, 2)
	})
}

// A credential placeholder that reads a header obeys the header's rule:
// Caddy's placeholder joins the fields ("tenant-a,other"), which would put
// the request in a scope of its own and execute its key again.
func TestDuplicateCredentialPlaceholderHeader(t *testing.T) {
	eachStore(t, func(t *testing.T, sb storeBackend) {
		up := newUpstream(t)
		s := protectedSite(t, sb, up.Addr(), "credential {http.request.header.X-Api-Key}")
		c := call{Key: newKey(), Body: payBody(), CredHeader: "X-Api-Key", Cred: "tenant-a"}
		p := wantProblem(t, s.sendWith(t, c, http.Header{"X-Api-Key": {"other"}}), http.StatusBadRequest)
		if !strings.Contains(p.Title+p.Detail, "X-Api-Key") || strings.Contains(p.Title+p.Detail, "Authorization") {
			t.Errorf("problem %+v should name X-Api-Key", p)
		}
		wantCount(t, up, 0)
		first := s.Do(t, c)
		wantExecuted(t, first, http.StatusCreated)
		// The same value twice is one value, as for credential_header.
		wantReplayOf(t, s.sendWith(t, c, http.Header{"X-Api-Key": {"tenant-a"}}), first)
		wantCount(t, up, 1)
	})
}

// Item 9.12: with another key_header, the problems name it, not
// Idempotency-Key.
func TestProblemsNameKeyHeader(t *testing.T) {
	eachStore(t, func(t *testing.T, sb storeBackend) {
		up := newUpstream(t)
		s := protectedSite(t, sb, up.Addr(), "key_header X-Request-Key")
		check := func(what string, r reply, status int) {
			t.Helper()
			p := wantProblem(t, r, status)
			if strings.Contains(p.Title+p.Detail, "Idempotency-Key") {
				t.Errorf("%s: problem names Idempotency-Key: %+v", what, p)
			}
			if !strings.Contains(p.Title+p.Detail, "X-Request-Key") {
				t.Errorf("%s: problem does not name X-Request-Key: %+v", what, p)
			}
		}
		check("missing", s.Do(t, call{Body: payBody()}), http.StatusBadRequest)
		check("malformed", s.Do(t, call{Key: "short", KeyHeader: "X-Request-Key", Body: payBody()}), http.StatusBadRequest)
		check("two values", s.sendWith(t, call{Key: newKey(), KeyHeader: "X-Request-Key", Body: payBody()},
			http.Header{"X-Request-Key": {newKey()}}), http.StatusBadRequest)
		c := call{Key: newKey(), KeyHeader: "X-Request-Key", Body: payBody()}
		wantExecuted(t, s.Do(t, c), http.StatusCreated)
		check("reused", s.Do(t, call{Key: c.Key, KeyHeader: "X-Request-Key", Body: payBody()}), http.StatusConflict)
		slow := call{Key: newKey(), KeyHeader: "X-Request-Key", Body: payBody(), Header: sleepFor(500 * time.Millisecond)}
		done := runBackground(t, s, slow)
		up.WaitStarted(t, 2)
		slow.Header = nil
		check("in progress", s.Do(t, slow), http.StatusConflict)
		<-done
	})
}

// Hashing a credential is HMAC-SHA-256, from a reused state too, and
// costs a request no allocation: the states are pooled.
func TestCredentialHashDoesNotAllocate(t *testing.T) {
	secret := bytes.Repeat([]byte{1}, store.MinSecretLen)
	c := newCredentialHasher(secret)
	cred := "Bearer " + strings.Repeat("t", 100)
	mac := hmac.New(sha256.New, secret)
	mac.Write([]byte(cred))
	want := [32]byte(mac.Sum(nil))
	for range 3 {
		if got := c.hash(cred); got != want {
			t.Fatalf("hash = %x, want the HMAC %x", got, want)
		}
	}
	if raceEnabled {
		t.Skip("the race detector drops pooled states at random")
	}
	if allocs := testing.AllocsPerRun(100, func() {
		if c.hash(cred) != want {
			t.Fatal("the hash changed")
		}
	}); allocs != 0 {
		t.Errorf("%v allocations per hash, want 0", allocs)
	}
}

// The stores that tests define around the memory store share its secret.
func (s *benchMemoryStore) UseCredentialSecret() {}

func (s *benchMemoryStore) CredentialSecret(ctx context.Context) ([]byte, error) {
	return s.Store.(*memory.Store).CredentialSecret(ctx)
}

func (s *cacheTestStore) UseCredentialSecret() {}

func (s *cacheTestStore) CredentialSecret(ctx context.Context) ([]byte, error) {
	return s.Store.(*memory.Store).CredentialSecret(ctx)
}

// No raw token ever reaches the database or a log line.
func TestCredentialIsNeverStoredOrLogged(t *testing.T) {
	eachStore(t, func(t *testing.T, sb storeBackend) {
		up := newUpstream(t)
		s := protectedSite(t, sb, up.Addr())
		secret := "sk_live_" + pgtest.RandomHex(12)
		cred := "Bearer " + secret
		c := call{Key: newKey(), Body: payBody(), Cred: cred, Header: sleepFor(300 * time.Millisecond)}
		ch := runBackground(t, s, c)
		up.WaitStarted(t, 1)
		s.Do(t, call{Key: c.Key, Body: c.Body, Cred: cred}) // in progress
		<-ch
		s.Do(t, call{Key: c.Key, Body: c.Body, Cred: cred})    // replay
		s.Do(t, call{Key: c.Key, Body: payBody(), Cred: cred}) // mismatch
		wantCount(t, up, 1)

		needles := map[string]string{
			"raw":    secret,
			"hex":    hex.EncodeToString([]byte(secret)),
			"base64": base64.StdEncoding.EncodeToString([]byte(secret))[:16],
		}
		logs, err := os.ReadFile(s.LogPath)
		if err != nil {
			t.Fatal(err)
		}
		for form, needle := range needles {
			if bytes.Contains(logs, []byte(needle)) {
				t.Errorf("the log holds the credential (%s)", form)
			}
		}
		if sb.Name != "postgres" {
			return
		}
		rows := pgtest.Query(t, sb.DSN, "SELECT t::text FROM "+pgtest.QuoteIdent(sb.Table)+" t")
		if len(rows) != 1 {
			t.Fatalf("table has %d rows, want 1", len(rows))
		}
		for form, needle := range needles {
			if strings.Contains(strings.ToLower(rows[0][0]), strings.ToLower(needle)) {
				t.Errorf("the database row holds the credential (%s): %s", form, rows[0][0])
			}
		}
	})
}

// Credentials that an upstream sends back are not stored nor replayed:
// the header the handler reads its credential from (here X-Api-Key, as
// credential_header or through a credential placeholder), Cookie,
// Set-Cookie2, and the Authentication-Info headers (RFC 7615), as with
// Authorization.
// They would otherwise sit in the store, the admin API's records and the
// CLI's output. Catches a never-stored list that knew only
// Authorization as a credential.
func TestCredentialHeadersAreNotReplayed(t *testing.T) {
	for _, directive := range []string{"credential_header X-Api-Key", "credential {http.request.header.x-api-key}"} {
		t.Run(directive, func(t *testing.T) { testCredentialHeadersAreNotReplayed(t, directive) })
	}
}

func testCredentialHeadersAreNotReplayed(t *testing.T, directive string) {
	eachStore(t, func(t *testing.T, sb storeBackend) {
		up := newUpstream(t)
		s := protectedSite(t, sb, up.Addr(), directive)
		c := call{Key: newKey(), Body: payBody(), Cred: "tenant-a-key", CredHeader: "X-Api-Key",
			Header: map[string]string{"X-Test-Credentials": "1"}}
		first := s.Do(t, c)
		wantExecuted(t, first, http.StatusCreated)
		credentials := []string{"X-Api-Key", "Cookie", "Set-Cookie2", "Authentication-Info", "Proxy-Authentication-Info"}
		for _, h := range credentials {
			if first.Header.Get(h) == "" {
				t.Errorf("the first caller must get the upstream's %s", h)
			}
		}
		replay := s.Do(t, c)
		if !replay.replayed() || !bytes.Equal(replay.Body, first.Body) {
			t.Fatalf("want a replay, got %s", replay)
		}
		for _, h := range credentials {
			if v := replay.Header.Values(h); len(v) != 0 {
				t.Errorf("replay carries %s: %q", h, v)
			}
		}
		if got := replay.Header.Values("X-Multi"); !equalStrings(got, []string{"one", "two"}) {
			t.Errorf("replay X-Multi = %q, want [one two]", got)
		}
	})
}

// RFC 9110 requires a WWW-Authenticate challenge on every 401: a request
// without its credential learns which scheme, or which header, to send.
// No other problem carries one.
func TestCredentialMissingChallenges(t *testing.T) {
	up := newUpstream(t)
	for _, tc := range []struct {
		name       string
		directives []string
		credHeader string
		want       string
	}{
		{"Authorization", nil, "", "Bearer"},
		{"credential_header", []string{"credential_header X-Api-Key"}, "X-Api-Key", `ApiKey header="X-Api-Key"`},
		{"credential placeholder of a header", []string{"credential {http.request.header.X-User}"}, "X-User", `ApiKey header="X-User"`},
		{"credential placeholder of no header", []string{"credential {http.auth.user.id}"}, "", "Bearer"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s := protectedSite(t, storeBackend{Name: "memory"}, up.Addr(), tc.directives...)
			for _, cred := range []string{noCred, " "} {
				resp := s.Do(t, call{Key: newKey(), Body: payBody(), Cred: cred, CredHeader: tc.credHeader})
				wantProblem(t, resp, http.StatusUnauthorized)
				if got := resp.Header.Values("WWW-Authenticate"); len(got) != 1 || got[0] != tc.want {
					t.Errorf("credential %q: WWW-Authenticate %q, want %q", cred, got, tc.want)
				}
			}
			if tc.credHeader != "" {
				resp := s.Do(t, call{Body: payBody(), Cred: "secret", CredHeader: tc.credHeader})
				wantProblem(t, resp, http.StatusBadRequest)
				if got := resp.Header.Values("WWW-Authenticate"); len(got) != 0 {
					t.Errorf("a 400 carries WWW-Authenticate %q", got)
				}
			}
		})
	}
	wantCount(t, up, 0)
}

// Handlers that share records share callers only where they read the
// credential alike: a user id read from one site's X-User, sent as the
// Authorization of another site of the store, is not that user, and
// gets no replay of the user's response. Catches a credential hashed
// without its source, which handed alice's stored response to whoever
// sent "Authorization: alice" to a sibling site.
func TestCredentialSourcesDoNotShareCallers(t *testing.T) {
	eachStore(t, func(t *testing.T, sb storeBackend) {
		up := newUpstream(t)
		a, b := freeTCPPort(t), freeTCPPort(t)
		srv := startCaddyfile(t, fmt.Sprintf(`http://127.0.0.1:%d {
	idempotency {
		%s
		credential {http.request.header.X-User}
	}
	reverse_proxy %s
}
http://127.0.0.1:%d {
	idempotency {
		%s
	}
	reverse_proxy %s
}
`, a, sb.Block(), up.Addr(), b, sb.Block(), up.Addr()))
		victim, other := newSiteClient(t, srv, a), newSiteClient(t, srv, b)
		c := call{Key: newKey(), Body: payBody(), Header: map[string]string{"X-User": "alice"}}
		wantExecuted(t, victim.Do(t, c), http.StatusCreated)
		if sb.Name == "postgres" {
			sb.waitCompleted(t, c.Key)
		}
		r := other.Do(t, call{Key: c.Key, Body: c.Body, Cred: "alice"})
		if r.replayed() || r.Status == http.StatusCreated {
			t.Fatalf("Authorization: alice on another site got alice's response: %s", r)
		}
		wantProblem(t, r, http.StatusConflict)
		wantCount(t, up, 1)
	})
}

// A key or credential header that Caddy's server drops from every
// request (a name with '_' or '.', unless the server lists it) is refused
// at load, naming the servers option that lets it through; listed, it
// is accepted. Catches a handler that loads and then answers every
// request 401 or 400 for a header it can never see.
func TestDroppedHeaderNamesRefused(t *testing.T) {
	for _, line := range []string{"credential_header X.Api", "key_header Idempotency_Key"} {
		err := loadErr(t, fmt.Sprintf("http://127.0.0.1:%d {\n\tidempotency {\n\t\t%s\n\t}\n\trespond 200\n}\n", freeTCPPort(t), line))
		if !strings.Contains(err.Error(), "expected_underscore_headers or expected_dot_headers") {
			t.Errorf("%s: %v", line, err)
		}
	}
	srv := &caddyhttp.Server{ExpectedDotHeaders: []string{"X.Api"}, ExpectedUnderscoreHeaders: []string{"X_Tenant*"}}
	ctx := caddy.Context{Context: context.WithValue(context.Background(), caddyhttp.ServerCtxKey, srv)}
	for _, name := range []string{"X.Api", "x.api", "X_Tenant_Key", "X-Api"} {
		if err := checkHeaderArrives(ctx, "credential_header", name); err != nil {
			t.Errorf("%s: %v", name, err)
		}
	}
	if checkHeaderArrives(ctx, "credential_header", "X.Other") == nil {
		t.Error("X.Other, not listed: accepted")
	}
}
