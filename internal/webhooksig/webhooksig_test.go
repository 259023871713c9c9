package webhooksig

import (
	"encoding/base64"
	"net/http"
	"strconv"
	"strings"
	"testing"
	"time"

	standardwebhooks "github.com/standard-webhooks/standard-webhooks/libraries/go"
	stripewebhook "github.com/stripe/stripe-go/v82/webhook"
)

// verify runs both steps on a delivery: nil if it verifies.
func verify(t *testing.T, provider string, secrets []string, h http.Header, body []byte, now time.Time) error {
	t.Helper()
	v, err := New(provider, secrets)
	if err != nil {
		t.Fatal(err)
	}
	d, err := v.Check(h, now)
	if err != nil {
		return err
	}
	return d.Verify(body)
}

// Each sender's own signature verifies, with the first or the second of
// two secrets; another body, another secret, a stale timestamp, a
// missing or doubled header do not. The signatures come from the
// senders' own code (stripe-go, the Standard Webhooks library), GitHub's
// documented test vector, and, for Shopify, an HMAC computed apart
// (openssl dgst -sha256 -hmac ... -binary | base64).
func TestSendersSignaturesVerify(t *testing.T) {
	now := time.Now()
	body := []byte(`{"id":"evt_1","type":"payment_intent.succeeded"}`)

	// Stripe, with stripe-go's signing.
	stripeSecret, otherStripe := "whsec_test_secret_one", "whsec_test_secret_two"
	signed := stripewebhook.GenerateTestSignedPayload(&stripewebhook.UnsignedPayload{Payload: body, Secret: stripeSecret, Timestamp: now})
	stripeHeader := http.Header{"Stripe-Signature": {signed.Header}}
	if err := verify(t, "stripe", []string{otherStripe, stripeSecret}, stripeHeader, body, now); err != nil {
		t.Errorf("stripe, second secret: %v", err)
	}
	stale := stripewebhook.GenerateTestSignedPayload(&stripewebhook.UnsignedPayload{Payload: body, Secret: stripeSecret, Timestamp: now.Add(-6 * time.Minute)})
	future := stripewebhook.GenerateTestSignedPayload(&stripewebhook.UnsignedPayload{Payload: body, Secret: stripeSecret, Timestamp: now.Add(6 * time.Minute)})
	for name, c := range map[string]struct {
		h       http.Header
		body    []byte
		secrets []string
	}{
		"another body":        {stripeHeader, append([]byte(nil), append(body, ' ')...), []string{stripeSecret}},
		"another secret":      {stripeHeader, body, []string{otherStripe}},
		"stale":               {http.Header{"Stripe-Signature": {stale.Header}}, body, []string{stripeSecret}},
		"from the future":     {http.Header{"Stripe-Signature": {future.Header}}, body, []string{stripeSecret}},
		"unsigned":            {http.Header{}, body, []string{stripeSecret}},
		"twice":               {http.Header{"Stripe-Signature": {signed.Header, signed.Header}}, body, []string{stripeSecret}},
		"v0 only":             {http.Header{"Stripe-Signature": {strings.Replace(signed.Header, "v1=", "v0=", 1)}}, body, []string{stripeSecret}},
		"two timestamps":      {http.Header{"Stripe-Signature": {"t=1," + signed.Header}}, body, []string{stripeSecret}},
		"signature as secret": {http.Header{"Stripe-Signature": {"t=" + strconv.FormatInt(now.Unix(), 10) + ",v1=" + strings.Repeat("0", 64)}}, body, []string{stripeSecret}},
	} {
		if err := verify(t, "stripe", c.secrets, c.h, c.body, now); err == nil {
			t.Errorf("stripe, %s: verified", name)
		}
	}

	// GitHub's documented test vector.
	gh := http.Header{"X-Hub-Signature-256": {"sha256=757107ea0eb2509fc211221cce984b8a37570b6d7586c22c46f4379c8b043e17"}}
	if err := verify(t, "github", []string{"It's a Secret to Everybody"}, gh, []byte("Hello, World!"), now); err != nil {
		t.Errorf("github: %v", err)
	}
	if err := verify(t, "github", []string{"It's a Secret to Everybody"}, gh, []byte("Hello, World?"), now); err == nil {
		t.Error("github, another body: verified")
	}
	if err := verify(t, "github", []string{"It's a Secret to Everybody"}, http.Header{"X-Hub-Signature": {"sha1=0"}}, []byte("Hello, World!"), now); err == nil {
		t.Error("github, sha1 only: verified")
	}

	// Standard Webhooks, with its reference library, under both header
	// names (Svix sends svix-*).
	key := base64.StdEncoding.EncodeToString([]byte("a standard webhooks secret key!!"))
	wh, err := standardwebhooks.NewWebhook("whsec_" + key)
	if err != nil {
		t.Fatal(err)
	}
	sig, err := wh.Sign("msg_1", now, body)
	if err != nil {
		t.Fatal(err)
	}
	ts := strconv.FormatInt(now.Unix(), 10)
	std := http.Header{"Webhook-Id": {"msg_1"}, "Webhook-Timestamp": {ts}, "Webhook-Signature": {"v1,bm90IGl0 " + sig}}
	svix := http.Header{"Svix-Id": {"msg_1"}, "Svix-Timestamp": {ts}, "Svix-Signature": {sig}}
	for name, h := range map[string]http.Header{"webhook-*": std, "svix-*": svix} {
		if err := verify(t, "standard", []string{"whsec_" + base64.StdEncoding.EncodeToString([]byte("x")), "whsec_" + key}, h, body, now); err != nil {
			t.Errorf("standard, %s, second secret: %v", name, err)
		}
	}
	v, _ := New("standard", []string{"whsec_" + key})
	if got := v.IDHeader(svix); got != "Svix-Id" {
		t.Errorf("IDHeader of a svix-* delivery = %s", got)
	}
	otherID := http.Header{"Webhook-Id": {"msg_2"}, "Webhook-Timestamp": {ts}, "Webhook-Signature": {sig}}
	if err := verify(t, "standard", []string{"whsec_" + key}, otherID, body, now); err == nil {
		t.Error("standard, another id: verified")
	}
	staleStd := http.Header{"Webhook-Id": {"msg_1"}, "Webhook-Timestamp": {strconv.FormatInt(now.Add(-time.Hour).Unix(), 10)}, "Webhook-Signature": {sig}}
	if err := verify(t, "standard", []string{"whsec_" + key}, staleStd, body, now); err == nil {
		t.Error("standard, stale: verified")
	}

	// Shopify, against an HMAC computed apart.
	shopBody := []byte(`{"id":123,"topic":"orders/create"}`)
	shop := http.Header{"X-Shopify-Hmac-Sha256": {"3AGelgbdxZEe47CEgVG/XYOaaA9FfMX79suG3v/VhMM="}}
	if err := verify(t, "shopify", []string{"old", "shpss_test_secret"}, shop, shopBody, now); err != nil {
		t.Errorf("shopify, second secret: %v", err)
	}
	if err := verify(t, "shopify", []string{"shpss_test_secret"}, shop, append(shopBody, '\n'), now); err == nil {
		t.Error("shopify, another body: verified")
	}
}

// A secret that cannot be the sender's is refused at start, without
// being quoted.
func TestSecretsRefused(t *testing.T) {
	for _, c := range []struct{ provider, secret string }{
		{"stripe", "sk_live_not_a_signing_secret"},
		{"standard", "whsec_not base64!"},
		{"github", ""},
		{"paypal", "x"},
	} {
		_, err := New(c.provider, []string{c.secret})
		if err == nil {
			t.Errorf("%s %q: accepted", c.provider, c.secret)
			continue
		}
		if c.secret != "" && strings.Contains(err.Error(), c.secret) {
			t.Errorf("%s: the error quotes the secret: %v", c.provider, err)
		}
	}
}
