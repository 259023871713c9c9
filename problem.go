package idempotency

import (
	"encoding/json"
	"net/http"
	"strconv"
	"strings"

	"github.com/caddy-idempotency/idempotency/store"
)

// problem is an RFC 9457 problem detail. Every response that this module
// produces itself is one, so that clients can tell it from the upstream's
// own errors and act on the detail.
type problem struct {
	Type   string `json:"type"`
	Title  string `json:"title"`
	Status int    `json:"status"`
	Detail string `json:"detail"`
}

// problemTypeBase anchors problem types in the README's status code
// table, where each case is explained.
const problemTypeBase = "https://github.com/caddy-idempotency/idempotency#"

var (
	probKeyMissing = problem{
		Type:   problemTypeBase + "key-missing",
		Title:  "Idempotency-Key required",
		Status: http.StatusBadRequest,
		Detail: "this endpoint requires an Idempotency-Key header; send a unique key (for example a UUID) with each new request and the same key when you retry it",
	}
	probKeyMalformed = problem{
		Type:   problemTypeBase + "key-malformed",
		Title:  "Malformed Idempotency-Key",
		Status: http.StatusBadRequest,
	}
	probKeyDuplicate = problem{
		Type:   problemTypeBase + "key-duplicate",
		Title:  "Several Idempotency-Key values",
		Status: http.StatusBadRequest,
		Detail: "this request carries several Idempotency-Key header fields with different values, so it is unclear which key it means; nothing was executed: send the header once",
	}
	probCredentialMissing = problem{
		Type:   problemTypeBase + "credential-missing",
		Title:  "Credential required",
		Status: http.StatusUnauthorized,
		Detail: "idempotency keys are scoped to the caller's credential, and this request carries none; authenticate the request",
	}
	probCredentialDuplicate = problem{
		Type:   problemTypeBase + "credential-duplicate",
		Title:  "Several Authorization values",
		Status: http.StatusBadRequest,
		Detail: "this request carries several Authorization header fields with different values, so it is unclear whose request it is; nothing was executed: send the header once",
	}
	probBodyTooLarge = problem{
		Type:   problemTypeBase + "body-too-large",
		Title:  "Request body too large",
		Status: http.StatusRequestEntityTooLarge,
	}
	probBodyUnreadable = problem{
		Type:   problemTypeBase + "body-unreadable",
		Title:  "Request body could not be read",
		Status: http.StatusBadRequest,
		Detail: "the request body could not be read completely; nothing was executed, retry the request with the same Idempotency-Key",
	}
	probBodyBudget = problem{
		Type:   problemTypeBase + "body-budget",
		Title:  "Too many request bodies in flight",
		Status: http.StatusServiceUnavailable,
		Detail: "the server is buffering as many request bodies as it allows at once, so this request was not read nor executed; retry after the Retry-After delay with the same Idempotency-Key",
	}
	probKeyReused = problem{
		Type:   problemTypeBase + "key-reused",
		Title:  "Idempotency-Key reused",
		Status: http.StatusConflict,
		Detail: "this Idempotency-Key was already used with a different request (method, host, path, query, media type, content coding, trailers or body); use a new key for a new request",
	}
	probInProgress = problem{
		Type:   problemTypeBase + "in-progress",
		Title:  "Request in progress",
		Status: http.StatusConflict,
		Detail: "a request with this Idempotency-Key is still being processed; retry after the Retry-After delay to get its response",
	}
	probNotReplayable = problem{
		Type:   problemTypeBase + "not-replayable",
		Title:  "Response not replayable",
		Status: http.StatusConflict,
		Detail: "the request with this Idempotency-Key was executed, but its response cannot be replayed (it was too large to store, or it switched protocols); the request will not be executed again: look up its result another way, or use a new key for a new request",
	}
	probEncodingNotAcceptable = problem{
		Type:   problemTypeBase + "encoding-not-acceptable",
		Title:  "Stored response encoding not acceptable",
		Status: http.StatusNotAcceptable,
	}
	probStoreUnavailable = problem{
		Type:   problemTypeBase + "store-unavailable",
		Title:  "Idempotency store unavailable",
		Status: http.StatusServiceUnavailable,
		Detail: "the idempotency store could not be reached, so the request was not executed; retry after the Retry-After delay with the same Idempotency-Key",
	}
	probRecordUnreadable = problem{
		Type:   problemTypeBase + "record-unreadable",
		Title:  "Stored response unreadable",
		Status: http.StatusInternalServerError,
		Detail: "a response is stored for this Idempotency-Key, but it cannot be opened: it was sealed under another credential or secret, or changed after it was stored; the request was not executed again: use a new key for a new request, or ask the operator",
	}
	probNotExecuted = problem{
		Type:   problemTypeBase + "not-executed",
		Title:  "Request not executed",
		Detail: "the request could not be executed (the upstream could not be reached, or a handler refused it before it reached one), so nothing was executed and the Idempotency-Key was released; retry with the same Idempotency-Key",
	}
	probOutcomeUnknown = problem{
		Type:   problemTypeBase + "outcome-unknown",
		Title:  "Outcome unknown",
		Status: http.StatusBadGateway,
		Detail: "the upstream failed after the request was sent, so it may have been executed; this response is stored and replayed for this Idempotency-Key; check the result before using a new key",
	}
)

// problemWording is a problem's title and detail as a handler words them
// for its own header names.
type problemWording struct {
	title, detail string
	// defaultDetail is the detail replaced: a problem given another
	// detail (withDetail) keeps it.
	defaultDetail string
}

// wordProblems words the problems that name a header for the handler's
// key_header and credential_header, once, so that answering one costs a
// map lookup, not building strings. It returns nil for the default
// headers, whose wording the problems already have.
func wordProblems(keyHeader, credentialHeader string) map[string]problemWording {
	if keyHeader == defaultKeyHeader && credentialHeader == defaultCredentialHeader {
		return nil
	}
	r := strings.NewReplacer(defaultKeyHeader, keyHeader)
	words := make(map[string]problemWording)
	for _, p := range []problem{
		probKeyMissing, probKeyMalformed, probKeyDuplicate, probBodyUnreadable, probBodyBudget, probKeyReused,
		probInProgress, probNotReplayable, probStoreUnavailable, probRecordUnreadable, probNotExecuted, probOutcomeUnknown,
	} {
		words[p.Type] = problemWording{title: r.Replace(p.Title), detail: r.Replace(p.Detail), defaultDetail: p.Detail}
	}
	p := probCredentialDuplicate
	r = strings.NewReplacer(defaultCredentialHeader, credentialHeader)
	words[p.Type] = problemWording{title: r.Replace(p.Title), detail: r.Replace(p.Detail), defaultDetail: p.Detail}
	return words
}

// worded returns p as words words it.
func (p problem) worded(words map[string]problemWording) problem {
	if w, ok := words[p.Type]; ok {
		p.Title = w.title
		if p.Detail == w.defaultDetail {
			p.Detail = w.detail
		}
	}
	return p
}

// withDetail returns a copy of p with another detail.
func (p problem) withDetail(detail string) problem {
	p.Detail = detail
	return p
}

// write sends p. retryAfter, when positive, is sent as Retry-After in
// whole seconds (rounded up, since a client that comes back early only
// meets the same answer again).
func (p problem) write(w http.ResponseWriter, retryAfterSeconds int) {
	resp := p.response()
	h := w.Header()
	for name, values := range resp.Header {
		h[name] = values
	}
	if retryAfterSeconds > 0 {
		h.Set("Retry-After", strconv.Itoa(retryAfterSeconds))
	}
	w.WriteHeader(resp.Status)
	_, _ = w.Write(resp.Body)
}

// response is p as a response to store.
func (p problem) response() *store.Response {
	body, _ := json.Marshal(p) // a struct of strings and an int always marshals
	return &store.Response{
		Status: p.Status,
		Header: http.Header{
			"Content-Type":   {"application/problem+json"},
			"Content-Length": {strconv.Itoa(len(body))},
			"Cache-Control":  {"no-store"},
		},
		Body:       body,
		Replayable: true,
		BodySize:   int64(len(body)),
	}
}
