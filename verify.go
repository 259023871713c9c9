package idempotency

// Webhooks verified at the edge: `webhook <provider> <secret...>` sets a
// sender's scope, key, store_status and retention, and verifies each
// delivery's signature (internal/webhooksig) before anything else is done
// with it. Recording first let a forged delivery with a real event id be
// answered with the real one's stored response, and a forged body under
// a real id hold the key against the real sender's delivery.

import (
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"net/http"
	"time"

	"github.com/caddy-idempotency/idempotency/internal/errlog"
	"github.com/caddy-idempotency/idempotency/internal/startup"
	"github.com/caddy-idempotency/idempotency/internal/webhooksig"
	"github.com/caddy-idempotency/idempotency/store"
	"github.com/caddyserver/caddy/v2"
	"go.uber.org/zap"
)

// WebhookConfig names a webhook sender and the secrets its deliveries
// are signed with.
type WebhookConfig struct {
	// The sender: stripe, github, standard (Standard Webhooks, which
	// Svix speaks) or shopify.
	Provider string `json:"provider"`
	// The signing secrets, as the sender hands them out (Stripe's and
	// Standard Webhooks' whsec_…). Several verify alike, while one is
	// rotated out. Placeholders such as {env.STRIPE_WEBHOOK_SECRET} are
	// resolved at start and never written into the config.
	Secrets []string `json:"secrets"`
}

// resultUnverified: a webhook delivery whose signature did not verify;
// it reached neither the store nor the upstream.
const resultUnverified = "unverified"

var probSignatureInvalid = problem{
	Type:   problemTypeBase + "signature-invalid",
	Title:  "Webhook signature invalid",
	Status: http.StatusUnauthorized,
}

// webhookVerifier is a handler's verification of its sender's signatures.
type webhookVerifier struct {
	*webhooksig.Verifier
	// challenge is the WWW-Authenticate of a 401.
	challenge string
	// signedID: the key is the delivery's id header, which the preset
	// sets (and Standard Webhooks names as its signature does);
	// digestKey: the key is the signed body's digest (the sender signs
	// no id).
	signedID, digestKey bool
	// presetScope: the scope is the sender's name, which the preset set.
	presetScope bool
	// log bounds the idempotency.unverified lines, as store errors are.
	log *errlog.Limiter
}

// provisionSender resolves the webhook's secrets and expands its preset
// under what the config sets explicitly: the scope (unless a credential
// is read), the key (unless key_header or key_json is set), store_status
// 2xx and the sender's retention.
func (h *Handler) provisionSender() error {
	if h.Webhook == nil {
		return nil
	}
	secrets := make([]string, len(h.Webhook.Secrets))
	for i, raw := range h.Webhook.Secrets {
		var err error
		if secrets[i], err = resolveSecret(raw); err != nil {
			return fmt.Errorf("webhook %s: secret %w", h.Webhook.Provider, err)
		}
	}
	v, err := webhooksig.New(h.Webhook.Provider, secrets)
	if err != nil {
		return err
	}
	s := v.Sender
	h.verifier = &webhookVerifier{
		Verifier:  v,
		challenge: fmt.Sprintf(`Webhook-Signature provider=%q, header=%q`, s.Name, s.Signs),
		log:       new(errlog.Limiter),
	}
	if h.Scope == "" && h.Credential == "" && h.CredentialHeader == "" {
		h.Scope, h.verifier.presetScope = s.Name, true
	}
	if h.KeyHeader == "" && h.KeyJSON == "" {
		h.KeyHeader, h.KeyJSON = s.KeyHeader, s.KeyJSON
		h.verifier.signedID, h.verifier.digestKey = s.KeyHeader != "", s.KeyDigest
	}
	if len(h.StoreStatus) == 0 {
		h.StoreStatus = []string{"2xx"}
	}
	if h.Retention == 0 {
		h.Retention = caddy.Duration(s.Retention)
	}
	return nil
}

// bodyKeyed reports whether the key is read from the body (step 3):
// key_json, or a webhook's body digest.
func (h *Handler) bodyKeyed() bool {
	return h.keyPointer != nil || h.verifier != nil && h.verifier.digestKey
}

// digestKey is the key of a delivery whose sender signs no id: its
// body's SHA-256, which only a delivery of the same signed body has.
func digestKey(body []byte) string {
	sum := sha256.Sum256(body)
	return "sha256-" + hex.EncodeToString(sum[:])
}

// scopeGroup is the webhook routes of a config whose scope the preset
// set, by the records and the scope they share (startup.Join).
type scopeGroup struct{ routes map[string]string }

func (g *scopeGroup) Start() <-chan struct{} {
	done := make(chan struct{})
	close(done)
	return done
}

// checkPresetScope refuses a second route of one sender on one store,
// in one config, whose scope both take from the preset: a sender sends
// an event to each of its endpoints under one id (Stripe, to every
// endpoint of an account), so the second route would meet the first's
// record and answer 409 to every delivery, until the sender gives up on
// the event. Routes of different configs (instances of a fleet, a
// reload) are one route, and share records as they should.
func (h *Handler) checkPresetScope(ctx caddy.Context) error {
	if h.verifier == nil || !h.verifier.presetScope {
		return nil
	}
	g, _, err := startup.Join(ctx, "webhook-scopes", func() startup.Group { return &scopeGroup{routes: map[string]string{}} })
	if err != nil || g == nil {
		return err
	}
	routes := g.(*scopeGroup).routes
	id := h.records + "\x00" + h.Scope
	here := store.ServerName(ctx)
	if there, ok := routes[id]; ok {
		return fmt.Errorf("webhook %s: two routes of this config (on server %s and on server %s) verify %s deliveries on one store under the scope %q, which both take from the preset: %s sends an event to each endpoint under one id, so the second route would answer 409 to every delivery; give each route its own scope (scope %s-<name>), or, where both serve one endpoint (a site on two servers), name the scope both share (scope %s)",
			h.Scope, there, here, h.Scope, h.Scope, h.Scope, h.Scope, h.Scope)
	}
	routes[id] = here
	return nil
}

// keyHeader is the header that r's key is read from.
func (h *Handler) keyHeader(r *http.Request) string {
	if h.verifier != nil && h.verifier.signedID {
		return h.verifier.IDHeader(r.Header)
	}
	return h.KeyHeader
}

// verifyDelivery is step 0 of a webhook's delivery: its signature headers
// and timestamp are checked before its body is read, so that an unsigned
// or stale flood costs no body buffer; then the body is read (step 3,
// early) and its HMAC checked. It returns the budget the body holds, and
// the error that says why the delivery does not verify, or a problem
// reading the body. Nothing else has been done with the request yet.
func (h *Handler) verifyDelivery(q *request) (held int64, prob *problem, err error) {
	d, err := h.verifier.Check(q.r.Header, time.Now())
	if err != nil {
		return 0, nil, err
	}
	body, held, prob := h.readBody(q.r)
	q.body, q.bodyRead, q.bodyCut = body, true, prob
	if prob != nil {
		return held, prob, nil
	}
	if err := d.Verify(body); err != nil {
		return held, nil, err
	}
	return held, nil, nil
}

// unverified answers a delivery whose signature did not verify (err,
// webhooksig's, says why, and never quotes a secret): 401 in enforcement, with the sender's challenge; shadow mode logs
// it and hands the delivery on, unrecorded. Either way it is logged, at
// most a line a second, with the count of those left out.
func (h *Handler) unverified(q *request, err error) error {
	if ok, suppressed := h.verifier.log.Allow(errlog.Now()); ok {
		fields := []zap.Field{zap.String("provider", h.verifier.Sender.Name), zap.String("reason", err.Error()),
			zap.String("host", logHost(q.r)), zap.String("method", q.r.Method), zap.String("path", clientPath(q.r))}
		if suppressed > 0 {
			fields = append(fields, zap.Int64("suppressed", suppressed))
		}
		h.logger.Warn("idempotency.unverified", fields...)
	}
	if !h.Shadow {
		q.w.Header().Set("WWW-Authenticate", h.verifier.challenge)
	}
	p := probSignatureInvalid.withDetail(fmt.Sprintf(
		"this endpoint takes %s webhook deliveries signed in %s, and this one does not verify: %v; nothing was recorded or executed",
		h.verifier.Sender.Name, h.verifier.Sender.Signs, err))
	return h.answer(q, verdict{result: resultUnverified, prob: p})
}
