package idempotency

import (
	"crypto/hmac"
	"crypto/sha256"
	"encoding/base64"
	"encoding/hex"
	"fmt"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/caddy-idempotency/idempotency/internal/pgtest"
	standardwebhooks "github.com/standard-webhooks/standard-webhooks/libraries/go"
	stripewebhook "github.com/stripe/stripe-go/v82/webhook"
)

// The secrets of the senders' tests: two per sender, the first rotated
// out, the second current.
var senderSecrets = map[string][2]string{
	"stripe":   {"whsec_old_" + "0123456789abcdef", "whsec_new_" + "fedcba9876543210"},
	"github":   {"github-old-secret", "github-new-secret"},
	"standard": {"whsec_" + base64.StdEncoding.EncodeToString([]byte("standard old key 0123456789abcd")), "whsec_" + base64.StdEncoding.EncodeToString([]byte("standard new key 0123456789abcd"))},
	"shopify":  {"shpss_old_secret", "shpss_new_secret"},
}

// signed returns the headers of a delivery of body with the event id,
// signed by provider's scheme under secret at ts: by the sender's own
// code where it has Go code (stripe-go, the Standard Webhooks library).
func signed(t *testing.T, provider, secret, id string, body []byte, ts time.Time) map[string]string {
	t.Helper()
	hmacOf := func() []byte {
		m := hmac.New(sha256.New, []byte(secret))
		m.Write(body)
		return m.Sum(nil)
	}
	switch provider {
	case "stripe":
		p := stripewebhook.GenerateTestSignedPayload(&stripewebhook.UnsignedPayload{Payload: body, Secret: secret, Timestamp: ts})
		return map[string]string{"Stripe-Signature": p.Header}
	case "github":
		return map[string]string{"X-GitHub-Delivery": id, "X-Hub-Signature-256": "sha256=" + hex.EncodeToString(hmacOf())}
	case "standard":
		wh, err := standardwebhooks.NewWebhook(secret)
		if err != nil {
			t.Fatal(err)
		}
		sig, err := wh.Sign(id, ts, body)
		if err != nil {
			t.Fatal(err)
		}
		return map[string]string{"Webhook-Id": id, "Webhook-Timestamp": strconv.FormatInt(ts.Unix(), 10), "Webhook-Signature": sig}
	case "shopify":
		return map[string]string{"X-Shopify-Event-Id": id, "X-Shopify-Hmac-Sha256": base64.StdEncoding.EncodeToString(hmacOf())}
	}
	t.Fatalf("no sender %s", provider)
	return nil
}

// senderBody is a delivery's body: Stripe's carries the event id.
func senderBody(provider, id string) []byte {
	if provider == "stripe" {
		return stripeEvent(id)
	}
	return []byte(`{"type":"order.created","order":"` + id + `"}`)
}

// wantUnverified asserts a 401 #signature-invalid with the sender's
// challenge.
func wantUnverified(t *testing.T, r reply, provider, what string) {
	t.Helper()
	if r.Status != http.StatusUnauthorized {
		t.Errorf("%s: %s, want 401", what, r)
		return
	}
	if p := wantProblem(t, r, http.StatusUnauthorized); !strings.HasSuffix(p.Type, "#signature-invalid") {
		t.Errorf("%s: problem %+v", what, p)
	}
	if c := r.Header.Get("WWW-Authenticate"); !strings.Contains(c, `provider="`+provider+`"`) {
		t.Errorf("%s: WWW-Authenticate %q", what, c)
	}
}

// For each sender, in its one line with two secrets: a delivery signed
// with the second secret executes once and its redelivery, signed anew,
// replays; a forged one (another secret), one with another body, a stale
// one (for senders that sign a timestamp) and an unsigned one get 401,
// leave no record and reach no upstream. Catches verification skipped,
// done after recording, or done with one secret only.
func TestWebhookSendersVerify(t *testing.T) {
	sb := postgresBackend(t)
	for _, provider := range []string{"stripe", "github", "standard", "shopify"} {
		t.Run(provider, func(t *testing.T) {
			up := newUpstream(t)
			secrets := senderSecrets[provider]
			t.Setenv("IDEMPOTENCY_TEST_WEBHOOK_SECRET", secrets[1])
			table := pgtest.FreshTable(t)
			s := protectedSite(t, storeBackend{Name: "postgres", DSN: sb.DSN, Table: table}, up.Addr(),
				fmt.Sprintf("webhook %s %s {env.IDEMPOTENCY_TEST_WEBHOOK_SECRET}", provider, secrets[0]))
			rows := func() int {
				return len(pgtest.Query(t, sb.DSN, "SELECT 1 FROM "+pgtest.QuoteIdent(table)))
			}
			deliver := func(id string, body []byte, h map[string]string) reply {
				return s.Do(t, call{Path: "/webhooks", Key: "", Cred: noCred, Body: body, Header: h})
			}

			id := "evt_" + pgtest.RandomHex(12)
			body := senderBody(provider, id)
			now := time.Now()
			first := deliver(id, body, signed(t, provider, secrets[1], id, body, now))
			wantExecuted(t, first, http.StatusCreated)
			wantReplayOf(t, deliver(id, body, signed(t, provider, secrets[1], id, body, now.Add(time.Minute))), first)
			if provider == "github" || provider == "shopify" {
				// Their signature covers no id: the same signed body under
				// another delivery id is the same delivery, not a new
				// event, and an attacker who captured it cannot have it
				// processed again by changing the id.
				wantReplayOf(t, deliver(id, body, signed(t, provider, secrets[1], "another-"+id, body, now)), first)
			}
			wantCount(t, up, 1)
			if n := rows(); n != 1 {
				t.Fatalf("%d records after one event, want 1", n)
			}

			forgedID := "evt_" + pgtest.RandomHex(12)
			forgedBody := senderBody(provider, forgedID)
			forged := map[string]map[string]string{
				"another secret": signed(t, provider, "whsec_"+base64.StdEncoding.EncodeToString([]byte("an attacker's own secret key!!")), forgedID, forgedBody, now),
				"unsigned":       {"X-GitHub-Delivery": forgedID, "X-Shopify-Event-Id": forgedID, "Webhook-Id": forgedID},
			}
			// A real signature over another body: the real event's id
			// with a forged body, as the attack that this closes sent.
			other := signed(t, provider, secrets[1], id, body, now)
			forged["another body"] = other
			if provider == "stripe" || provider == "standard" {
				forged["stale"] = signed(t, provider, secrets[1], forgedID, forgedBody, now.Add(-10*time.Minute))
			}
			for what, h := range forged {
				b := forgedBody
				if what == "another body" {
					b = []byte(strings.Replace(string(body), "order", "0rder", 1) + " ")
				}
				wantUnverified(t, deliver(forgedID, b, h), provider, what)
			}
			wantCount(t, up, 1)
			if n := rows(); n != 1 {
				t.Errorf("%d records after the forged deliveries, want 1", n)
			}
			// The real event still replays after the forgeries.
			wantReplayOf(t, deliver(id, body, signed(t, provider, secrets[1], id, body, now.Add(2*time.Minute))), first)
		})
	}
}

// Verification holds in every mode: with optional and fail_open (here
// over a store that is down), an unsigned delivery gets 401 and reaches
// no upstream; in shadow mode it is logged and passes on, unrecorded,
// as shadow_unverified. Catches a pass-through that comes before the
// verification.
func TestWebhookVerificationInEveryMode(t *testing.T) {
	secret := senderSecrets["github"][1]
	for _, mode := range []string{"optional", "on_store_error fail_open", "shadow"} {
		t.Run(strings.Fields(mode)[0], func(t *testing.T) {
			up := newUpstream(t)
			// A store whose database does not answer: fail_open would
			// execute; verification comes first.
			down := storeBackend{Name: "postgres", DSN: fmt.Sprintf("postgres://postgres@127.0.0.1:%d/none?sslmode=disable&connect_timeout=1", freeTCPPort(t)), Table: "idempotency_keys"}
			s := protectedSite(t, down, up.Addr(), "webhook github "+secret, mode)
			id := pgtest.RandomHex(16)
			r := s.Do(t, call{Path: "/webhooks", Cred: noCred, Body: []byte(`{"a":1}`), Header: map[string]string{"X-GitHub-Delivery": id}})
			if mode == "shadow" {
				wantExecuted(t, r, http.StatusCreated)
				wantCount(t, up, 1)
				return
			}
			wantUnverified(t, r, "github", mode)
			wantCount(t, up, 0)
		})
	}
}

// Operators name a webhook route's records by its scope: the admin API
// and the CLI find a verified delivery's record by `scope github`, and
// not by another scope.
func TestWebhookRecordsByScope(t *testing.T) {
	sb := postgresBackend(t)
	up := newUpstream(t)
	secret := senderSecrets["github"][1]
	s, admin, _ := startAdminSite(t, sb, up, "webhook github "+secret)
	id := pgtest.RandomHex(16)
	body := senderBody("github", id)
	wantExecuted(t, s.Do(t, call{Path: "/webhooks", Cred: noCred, Body: body, Header: signed(t, "github", secret, id, body, time.Now())}), http.StatusCreated)
	// GitHub signs no delivery id: the key is the body's digest.
	id = digestKey(body)
	sb.waitCompleted(t, id)

	if recs := admin.records(url.Values{"key": {id}, "scope": {"github"}}, nil); len(recs.Records) != 1 || recs.Records[0].Key != id {
		t.Fatalf("by scope github: %+v", recs)
	}
	if recs := admin.records(url.Values{"key": {id}, "scope": {"stripe"}}, nil); len(recs.Records) != 0 {
		t.Fatalf("by scope stripe: %+v", recs)
	}
	env := []string{"IDEMPOTENCY_DSN=" + sb.DSN}
	wantCLI(t, runCLI(t, env, "inspect", "--table", sb.Table, "--key", id, "--scope", "github"), exitOK, "status:           completed")
	wantCLI(t, runCLI(t, env, "inspect", "--table", sb.Table, "--key", id, "--scope", "stripe"), exitNotFound)
	wantCLI(t, runCLI(t, env, "inspect", "--table", sb.Table, "--key", id, "--scope", "github", "--credential", "x"), exitUsage, "one of")
}

// Two routes of one sender on one store, in one config, cannot both
// take their scope from the preset: the sender's event id, sent to each
// endpoint, would meet the first route's record on the second, which
// would answer 409 to every delivery. The config is refused, saying to
// name a scope; with a scope each, it loads and each route processes
// the event once.
func TestWebhookRoutesOfOneSenderNeedScopes(t *testing.T) {
	a, b := senderSecrets["stripe"][0], senderSecrets["stripe"][1]
	routes := func(scopeA, scopeB string) string {
		return fmt.Sprintf(`http://127.0.0.1:%%d {
	idempotency /a* {
		webhook stripe %s
		%s
	}
	idempotency /b* {
		webhook stripe %s
		%s
	}
	reverse_proxy %%s
}
`, a, scopeA, b, scopeB)
	}
	err := loadErr(t, fmt.Sprintf(routes("", ""), freeTCPPort(t), "127.0.0.1:9"))
	if !strings.Contains(err.Error(), "give each route its own scope") {
		t.Fatalf("two stripe routes without scopes: %v", err)
	}

	up := newUpstream(t)
	port := freeTCPPort(t)
	s := siteFromCaddyfile(t, port, fmt.Sprintf(routes("scope stripe-a", "scope stripe-b"), port, up.Addr()))
	id := "evt_" + pgtest.RandomHex(12)
	body := senderBody("stripe", id)
	for i, route := range []struct{ path, secret string }{{"/a", a}, {"/b", b}} {
		r := s.Do(t, call{Path: route.path, Cred: noCred, Body: body, Header: signed(t, "stripe", route.secret, id, body, time.Now())})
		wantExecuted(t, r, http.StatusCreated)
		wantCount(t, up, i+1)
	}
}

// A webhook route verifies every method that reaches it, not only the
// protected ones: an unsigned PUT gets 401 and reaches nothing, and a
// signed one goes on, unrecorded, as an unprotected method does.
// Catches the method check that let any other method skip verification.
func TestWebhookVerifiesEveryMethod(t *testing.T) {
	sb := postgresBackend(t)
	up := newUpstream(t)
	secret := senderSecrets["github"][1]
	s := protectedSite(t, sb, up.Addr(), "webhook github "+secret)
	body := []byte(`{"action":"created","n":"` + pgtest.RandomHex(6) + `"}`)
	for _, method := range []string{http.MethodPut, http.MethodDelete} {
		wantUnverified(t, s.Do(t, call{Method: method, Path: "/webhooks", Cred: noCred, Body: body}), "github", method)
	}
	wantCount(t, up, 0)
	r := s.Do(t, call{Method: http.MethodPut, Path: "/webhooks", Cred: noCred, Body: body, Header: signed(t, "github", secret, "", body, time.Now())})
	wantExecuted(t, r, http.StatusCreated)
	wantCount(t, up, 1)
	if n := pgCount(t, sb); n != 0 {
		t.Errorf("%d records after a signed PUT, want none: PUT is not protected", n)
	}
}

// Errors about webhook secrets and credential secrets never quote a
// secret: not a literal credential_secret whose braces name no
// placeholder, not a signing secret given where the provider goes.
func TestSecretErrorsDoNotQuoteSecrets(t *testing.T) {
	const secret = "Tr0ub4dor&3-{horse}-staple"
	if _, err := resolveCredentialSecret(secret); err == nil || strings.Contains(err.Error(), "horse") {
		t.Errorf("credential_secret %q: %v", secret, err)
	}
	_, _, err := adaptCaddyfile("example.com {\n\tidempotency {\n\t\twebhook whsec_NEWSECRETabc123 whsec_OLDSECRETdef456\n\t}\n}\n")
	if err == nil || strings.Contains(err.Error(), "SECRET") {
		t.Errorf("webhook without a provider: %v", err)
	}
}
