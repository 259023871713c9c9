// Package webhooksig verifies the signatures that webhook senders put on
// their deliveries, each sender's scheme as its own documentation gives
// it: Stripe's Stripe-Signature, GitHub's X-Hub-Signature-256, Standard
// Webhooks' webhook-* headers (which Svix sends as svix-*), and Shopify's
// X-Shopify-Hmac-Sha256. The idempotency handler verifies a delivery
// before it records anything, so that a forged delivery neither gets the
// stored answer of a real one nor holds its key.
//
// Verification is in two steps: Check reads the signature headers and
// the timestamp, before the body is read, so that an unsigned or stale
// flood costs no body buffer; Delivery.Verify then computes the HMAC over
// the body's bytes as received, before any canonicalisation, under every
// secret (several verify alike while one is rotated out), and compares it
// with every signature in constant time.
package webhooksig

import (
	"crypto/hmac"
	"crypto/sha256"
	"encoding/base64"
	"encoding/hex"
	"errors"
	"fmt"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"time"
)

// Tolerance is how far a signed timestamp may be from the clock, either
// way: a captured delivery is refused once it is older.
const Tolerance = 5 * time.Minute

// A Sender is one sender's scheme, and where its deliveries carry their
// event id.
type Sender struct {
	// Name is the provider's name in the config: stripe, github,
	// standard, shopify.
	Name string
	// KeyHeader or KeyJSON is where a delivery carries the id of its
	// event, which redeliveries repeat, in what the signature covers.
	// KeyDigest: the signature covers no id (GitHub's and Shopify's
	// delivery ids are headers of their own, which anyone can change on
	// a captured delivery), so the key is the body's digest: a delivery
	// is its body, and a redelivery repeats it byte for byte.
	KeyHeader, KeyJSON string
	KeyDigest          bool
	// Retention is how long its records are kept by default: as long as
	// the sender redelivers, or, for senders that sign no timestamp,
	// long enough that a captured delivery sent again finds its record.
	Retention time.Duration
	// Signs is the header that carries the signature.
	Signs string
	// Timestamped: the sender signs a timestamp, and a delivery older
	// than Tolerance is refused.
	Timestamped bool

	secret func(string) ([]byte, error)
	check  func(h http.Header, now time.Time) (Delivery, error)
}

// Senders are the known senders, by name.
var Senders = map[string]*Sender{
	"stripe": {
		Name: "stripe", KeyJSON: "/id", Retention: 72 * time.Hour, Signs: "Stripe-Signature", Timestamped: true,
		secret: stripeSecret, check: stripeCheck,
	},
	"github": {
		Name: "github", KeyDigest: true, Retention: 30 * 24 * time.Hour, Signs: "X-Hub-Signature-256",
		secret: rawSecret, check: githubCheck,
	},
	"standard": {
		Name: "standard", KeyHeader: "Webhook-Id", Retention: 72 * time.Hour, Signs: "Webhook-Signature", Timestamped: true,
		secret: standardSecret, check: standardCheck,
	},
	"shopify": {
		Name: "shopify", KeyDigest: true, Retention: 30 * 24 * time.Hour, Signs: "X-Shopify-Hmac-Sha256",
		secret: rawSecret, check: shopifyCheck,
	},
}

// Names are the known senders' names, sorted.
func Names() []string {
	names := make([]string, 0, len(Senders))
	for n := range Senders {
		names = append(names, n)
	}
	slices.Sort(names)
	return names
}

// A Verifier verifies the deliveries of one sender under its secrets.
type Verifier struct {
	Sender *Sender
	keys   [][]byte
}

// New returns the verifier of the sender named provider, under secrets,
// given as the sender hands them out (Stripe's and Standard Webhooks'
// whsec_…). Its errors never quote a secret.
func New(provider string, secrets []string) (*Verifier, error) {
	s, ok := Senders[provider]
	if !ok {
		// Not quoted: a provider left out of a config makes a signing
		// secret the first value.
		return nil, fmt.Errorf("unknown webhook provider (want one of %s)", strings.Join(Names(), ", "))
	}
	if len(secrets) == 0 {
		return nil, fmt.Errorf("webhook %s needs its signing secret", provider)
	}
	v := &Verifier{Sender: s}
	for i, secret := range secrets {
		key, err := s.secret(secret)
		if err != nil {
			return nil, fmt.Errorf("webhook %s: secret %d: %w", provider, i+1, err)
		}
		v.keys = append(v.keys, key)
	}
	return v, nil
}

// IDHeader is the header that carries the id of h's delivery: a Standard
// Webhooks delivery signed under Svix's header names carries it in
// svix-id, the id its signature covers.
func (v *Verifier) IDHeader(h http.Header) string {
	if v.Sender.Name == "standard" && len(h.Values("Webhook-Signature")) == 0 && len(h.Values("Svix-Signature")) > 0 {
		return "Svix-Id"
	}
	return v.Sender.KeyHeader
}

// Check reads h's signature and timestamp, at now: the delivery to
// verify against its body, or why it cannot be verified at all.
func (v *Verifier) Check(h http.Header, now time.Time) (Delivery, error) {
	d, err := v.Sender.check(h, now)
	d.keys = v.keys
	return d, err
}

// A Delivery is what a delivery's headers say is signed: the bytes that
// the sender signs before the body, and the signatures to match.
type Delivery struct {
	prefix []byte
	sigs   [][]byte
	keys   [][]byte
}

// ErrNoMatch: no signature of the delivery is the HMAC of its body
// under any of the secrets.
var ErrNoMatch = errors.New("no signature matches the body under the configured secrets")

// Verify reports whether body, as received, is signed: nil if one of the
// signatures is its HMAC under one of the secrets.
func (d Delivery) Verify(body []byte) error {
	sum := make([]byte, 0, sha256.Size)
	for _, key := range d.keys {
		mac := hmac.New(sha256.New, key)
		mac.Write(d.prefix)
		mac.Write(body)
		sum = mac.Sum(sum[:0])
		for _, sig := range d.sigs {
			if hmac.Equal(sum, sig) {
				return nil
			}
		}
	}
	return ErrNoMatch
}

// one returns the value of the header name, which must be sent once.
func one(h http.Header, name string) (string, error) {
	switch values := h.Values(name); len(values) {
	case 0:
		return "", fmt.Errorf("no %s header", name)
	case 1:
		if values[0] == "" {
			return "", fmt.Errorf("an empty %s header", name)
		}
		return values[0], nil
	default:
		return "", fmt.Errorf("the %s header is sent %d times", name, len(values))
	}
}

// timestamp parses a signed timestamp in seconds, and refuses one that
// is more than Tolerance from now.
func timestamp(s string, now time.Time) error {
	if s == "" || len(s) > 12 || strings.Trim(s, "0123456789") != "" {
		return errors.New("the signed timestamp is not a number of seconds")
	}
	t, _ := strconv.ParseInt(s, 10, 64)
	if d := now.Sub(time.Unix(t, 0)); d > Tolerance || d < -Tolerance {
		return fmt.Errorf("the signed timestamp is more than %s from the clock", Tolerance)
	}
	return nil
}

func rawSecret(s string) ([]byte, error) {
	if strings.TrimSpace(s) == "" {
		return nil, errors.New("empty")
	}
	return []byte(s), nil
}

// stripeSecret: Stripe's HMAC key is the whole whsec_… string.
func stripeSecret(s string) ([]byte, error) {
	if !strings.HasPrefix(s, "whsec_") || len(s) == len("whsec_") {
		return nil, errors.New("a Stripe endpoint's signing secret starts with whsec_ (an API key, sk_…, is not one)")
	}
	return []byte(s), nil
}

// standardSecret: the key is the base64 after whsec_.
func standardSecret(s string) ([]byte, error) {
	key, err := base64.StdEncoding.DecodeString(strings.TrimPrefix(s, "whsec_"))
	if err != nil || len(key) == 0 {
		return nil, errors.New("a Standard Webhooks secret is whsec_ followed by base64")
	}
	return key, nil
}

// stripeCheck reads Stripe-Signature: t=<seconds>, then v1=<hex> entries
// (one per secret of the endpoint while one is rolled), over "t.body".
// Other schemes (v0) are not signatures to accept.
func stripeCheck(h http.Header, now time.Time) (Delivery, error) {
	header, err := one(h, "Stripe-Signature")
	if err != nil {
		return Delivery{}, err
	}
	var d Delivery
	t := ""
	for item := range strings.SplitSeq(header, ",") {
		name, value, _ := strings.Cut(strings.TrimSpace(item), "=")
		switch name {
		case "t":
			if t != "" {
				return Delivery{}, errors.New("Stripe-Signature has more than one t")
			}
			t = value
		case "v1":
			if sig, err := hex.DecodeString(value); err == nil && len(sig) == sha256.Size {
				d.sigs = append(d.sigs, sig)
			}
		}
	}
	if err := timestamp(t, now); err != nil {
		return Delivery{}, fmt.Errorf("Stripe-Signature: %w", err)
	}
	if len(d.sigs) == 0 {
		return Delivery{}, errors.New("Stripe-Signature has no v1 signature")
	}
	d.prefix = []byte(t + ".")
	return d, nil
}

// githubCheck reads X-Hub-Signature-256: sha256=<hex> of the body.
func githubCheck(h http.Header, _ time.Time) (Delivery, error) {
	header, err := one(h, "X-Hub-Signature-256")
	if err != nil {
		return Delivery{}, err
	}
	hexSig, ok := strings.CutPrefix(header, "sha256=")
	sig, err := hex.DecodeString(hexSig)
	if !ok || err != nil || len(sig) != sha256.Size {
		return Delivery{}, errors.New("X-Hub-Signature-256 is not sha256= and 64 hex digits")
	}
	return Delivery{sigs: [][]byte{sig}}, nil
}

// standardCheck reads webhook-id, webhook-timestamp and webhook-signature
// (or Svix's svix-* names for them, where webhook-signature is absent):
// space-separated v1,<base64> entries over "id.timestamp.body".
func standardCheck(h http.Header, now time.Time) (Delivery, error) {
	prefix := "Webhook-"
	if len(h.Values("Webhook-Signature")) == 0 && len(h.Values("Svix-Signature")) > 0 {
		prefix = "Svix-"
	}
	id, err := one(h, prefix+"Id")
	if err != nil {
		return Delivery{}, err
	}
	t, err := one(h, prefix+"Timestamp")
	if err != nil {
		return Delivery{}, err
	}
	if err := timestamp(t, now); err != nil {
		return Delivery{}, fmt.Errorf("%sTimestamp: %w", prefix, err)
	}
	header, err := one(h, prefix+"Signature")
	if err != nil {
		return Delivery{}, err
	}
	var d Delivery
	for entry := range strings.FieldsSeq(header) {
		if b64, ok := strings.CutPrefix(entry, "v1,"); ok {
			if sig, err := base64.StdEncoding.DecodeString(b64); err == nil && len(sig) == sha256.Size {
				d.sigs = append(d.sigs, sig)
			}
		}
	}
	if len(d.sigs) == 0 {
		return Delivery{}, fmt.Errorf("%sSignature has no v1 signature", prefix)
	}
	d.prefix = []byte(id + "." + t + ".")
	return d, nil
}

// shopifyCheck reads X-Shopify-Hmac-Sha256: the base64 HMAC of the body.
func shopifyCheck(h http.Header, _ time.Time) (Delivery, error) {
	header, err := one(h, "X-Shopify-Hmac-Sha256")
	if err != nil {
		return Delivery{}, err
	}
	sig, err := base64.StdEncoding.DecodeString(header)
	if err != nil || len(sig) != sha256.Size {
		return Delivery{}, errors.New("X-Shopify-Hmac-Sha256 is not the base64 of a SHA-256 HMAC")
	}
	return Delivery{sigs: [][]byte{sig}}, nil
}
