package idempotency

// Webhooks: a sender that signs its deliveries and retries until a 2xx,
// as Stripe's, with stripe-go's own signing and verification.

import (
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/caddy-idempotency/idempotency/internal/canonjson"
	"github.com/caddy-idempotency/idempotency/internal/pgtest"
	"github.com/caddy-idempotency/idempotency/store/storetest"
	"github.com/stripe/stripe-go/v82"
	"github.com/stripe/stripe-go/v82/webhook"
)

func TestJSONPointer(t *testing.T) {
	for _, tc := range []struct {
		ptr, body, want string
		err             error
	}{
		{"/id", `{"id":"evt_123456789","object":"event"}`, "evt_123456789", nil},
		{"/id", `{"object":"event","data":{"id":"x"},"id":"evt_123456789"}`, "evt_123456789", nil},
		{"/data/object/id", `{"data":{"object":{"id":"pi_123456789"}}}`, "pi_123456789", nil},
		{"/a~1b/m~0n", `{"a/b":{"m~n":"escaped-key"}}`, "escaped-key", nil},
		{"/list/1", `{"list":["first-one","second-one"]}`, "second-one", nil},
		{"/n", `{"n":12345678.50}`, "12345678.50", nil}, // as written
		{"/id", `{"id":"evt_1", "id":"evt_2"}`, "", errKeyJSONTwice},
		{"/id", `{"id":"evt_1", "Id":"evt_2"}`, "", errKeyJSONTwice},
		{"/id", `{"ID":"evt_123456789"}`, "", errKeyJSONMissing}, // RFC 6901 matches exactly
		{"/a/b", `{"a":{"b":"x1234567"},"a":{"b":"y1234567"}}`, "", errKeyJSONTwice},
		{"/a/b", `{"a":{"b":"x1234567","b":"y1234567"}}`, "", errKeyJSONTwice},
		{"/a/b", `{"a":{"b":"x1234567","c":{"b":1}},"A":{}}`, "", errKeyJSONTwice},
		{"/a/1/b", `{"a":[0,{"b":"x1234567"},{"b":"y1234567"}]}`, "x1234567", nil},
		{"/a/0/b", `{"a":[{"b":"x1234567"}],"a":[]}`, "", errKeyJSONTwice},
		{"/a/0", `{"a":["x1234567",{"k":[1]}],"b":1,"a":1}`, "", errKeyJSONTwice},
		{"/a/b", `{"a":{"b":"x1234567","c":[{"b":2}]},"c":{"a":2}}`, "x1234567", nil},
		{"/id", `{"object":"event"}`, "", errKeyJSONMissing},
		{"/id", `not json`, "", errKeyJSONMissing},
		{"/id", `{"id":"evt_1"} trailing`, "", errKeyJSONMissing},
		{"/id", `{"id":"evt_1"`, "", errKeyJSONMissing},
		{"/list/2", `{"list":["a","b"]}`, "", errKeyJSONMissing},
		{"/list/01", `{"list":["a","b"]}`, "", errKeyJSONMissing},
		{"/list/-", `{"list":["a","b"]}`, "", errKeyJSONMissing},
		{"/id", `["evt_1"]`, "", errKeyJSONMissing},
		{"/id", `{"id":{"v":"evt_123456789"}}`, "", errKeyJSONType},
		{"/id", `{"id":true}`, "", errKeyJSONType},
		{"/id", `{"id":null}`, "", errKeyJSONType},
	} {
		ptr, err := parseJSONPointer(tc.ptr)
		if err != nil {
			t.Fatalf("%s: %v", tc.ptr, err)
		}
		got, err := jsonPointerValue([]byte(tc.body), ptr)
		if got != tc.want || err != tc.err {
			t.Errorf("%s in %s = %q, %v; want %q, %v", tc.ptr, tc.body, got, err, tc.want, tc.err)
		}
	}
	for _, bad := range []string{"", "id", "/a~", "/a~2", "#/id"} {
		if _, err := parseJSONPointer(bad); err == nil {
			t.Errorf("pointer %q accepted", bad)
		}
	}
}

// Each refusal, from a Caddyfile and from JSON, names what conflicts.
func TestWebhookConfigRefusals(t *testing.T) {
	for _, tc := range []struct {
		name, block string
		h           Handler
		want        []string
	}{
		{"scope with credential", "scope stripe\n\t\tcredential {http.auth.user.id}",
			Handler{Scope: "stripe", Credential: "{http.auth.user.id}"}, []string{"scope", "credential"}},
		{"scope with credential_header", "scope stripe\n\t\tcredential_header X-Api-Key",
			Handler{Scope: "stripe", CredentialHeader: "X-Api-Key"}, []string{"scope", "credential_header"}},
		{"key_json with key_header", "key_json /id\n\t\tkey_header webhook-id",
			Handler{KeyJSON: "/id", KeyHeader: "webhook-id"}, []string{"key_json", "key_header"}},
		{"bad pointer", "key_json id", Handler{KeyJSON: "id"}, []string{"key_json", "RFC 6901"}},
		{"bad escape", "key_json /a~2", Handler{KeyJSON: "/a~2"}, []string{"key_json", "RFC 6901"}},
		{"bad status", "store_status 2xx 600", Handler{StoreStatus: []string{"2xx", "600"}}, []string{"store_status", "600"}},
		{"bad class", "store_status 2XXX", Handler{StoreStatus: []string{"2XXX"}}, []string{"store_status"}},
	} {
		t.Run("Caddyfile "+tc.name, func(t *testing.T) {
			cfg := fmt.Sprintf("http://127.0.0.1:8080 {\n\tidempotency {\n\t\t%s\n\t}\n\treverse_proxy 127.0.0.1:9\n}\n", tc.block)
			_, _, err := adaptCaddyfile(cfg)
			if err == nil {
				t.Fatalf("accepted:\n%s", cfg)
			}
			for _, w := range tc.want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("error does not name %s: %v", w, err)
				}
			}
		})
		t.Run("JSON "+tc.name, func(t *testing.T) {
			h := tc.h
			err := provisionAndValidate(t, &h)
			if err == nil {
				t.Fatalf("accepted: %+v", tc.h)
			}
			for _, w := range tc.want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("error does not name %s: %v", w, err)
				}
			}
		})
	}
	// What the refusals must not catch: the JSON names, and a scope with
	// a key header of its own.
	var h Handler
	if err := json.Unmarshal([]byte(`{"scope":"stripe","key_json":"/id","store_status":["2xx","409"]}`), &h); err != nil {
		t.Fatal(err)
	}
	if err := provisionAndValidate(t, &h); err != nil {
		t.Errorf("webhook JSON config refused: %v", err)
	}
	if !h.storeStatus.stores(204) || !h.storeStatus.stores(409) || h.storeStatus.stores(500) || h.storeStatus.stores(502) {
		t.Errorf("store_status [2xx 409] stores the wrong statuses")
	}
	h = Handler{Scope: "github", KeyHeader: "X-GitHub-Delivery"}
	if err := provisionAndValidate(t, &h); err != nil {
		t.Errorf("scope with key_header refused: %v", err)
	}
}

// A scope's hash is keyed by the secret and never a credential's: not
// even the credential whose value is the scope's name.
func TestScopeHash(t *testing.T) {
	c := newCredentialHasher([]byte(strings.Repeat("s", 32)))
	other := newCredentialHasher([]byte(strings.Repeat("t", 32)))
	if scopeHash(c, "stripe") == c.hash("stripe") || scopeHash(c, "stripe") == c.hash(scopeKeyLabel+"stripe") {
		t.Error("a scope hashes like a credential")
	}
	if scopeHash(c, "stripe") == scopeHash(other, "stripe") || scopeHash(c, "stripe") == scopeHash(c, "github") {
		t.Error("scope hashes do not depend on the secret and the name")
	}
}

// stripeReceiver is a webhook endpoint as Stripe's docs write one: it
// verifies each delivery with webhook.ConstructEvent, and counts the
// events it processed. failFirst fails the first n deliveries of an
// event with 500.
type stripeReceiver struct {
	secret string
	mu     sync.Mutex
	counts map[string]int
	fail   map[string]int
	// unverified counts deliveries whose signature did not verify: a
	// body changed by one byte.
	unverified int
	gate       chan struct{} // if set, each delivery waits for it to close
	*httptest.Server
}

func newStripeReceiver(t *testing.T) *stripeReceiver {
	rc := &stripeReceiver{secret: "whsec_" + pgtest.RandomHex(16), counts: map[string]int{}, fail: map[string]int{}}
	rc.Server = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		ev, err := webhook.ConstructEvent(body, r.Header.Get("Stripe-Signature"), rc.secret)
		rc.mu.Lock()
		if err != nil {
			rc.unverified++
			rc.mu.Unlock()
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		rc.counts[ev.ID]++
		n := rc.counts[ev.ID]
		failing := rc.fail[ev.ID] >= n
		gate := rc.gate
		rc.mu.Unlock()
		if gate != nil {
			<-gate
		}
		if failing {
			http.Error(w, "database unavailable", http.StatusInternalServerError)
			return
		}
		w.Header().Set("Content-Type", "application/json")
		fmt.Fprintf(w, `{"received":%q,"delivery":%d}`, ev.ID, n)
	}))
	t.Cleanup(rc.Close)
	return rc
}

func (rc *stripeReceiver) count(id string) int {
	rc.mu.Lock()
	defer rc.mu.Unlock()
	return rc.counts[id]
}

// stripeEvent is an event body as Stripe sends one.
func stripeEvent(id string) []byte {
	return fmt.Appendf(nil, `{"id":%q,"object":"event","api_version":%q,"created":%d,"type":"payment_intent.succeeded","data":{"object":{"id":"pi_%s","object":"payment_intent","amount":2000}}}`,
		id, stripe.APIVersion, time.Now().Unix(), pgtest.RandomHex(6))
}

// deliver sends an event as Stripe does: signed anew for each delivery,
// with the delivery's own timestamp.
func (rc *stripeReceiver) deliver(t testing.TB, s *site, body []byte, at time.Time) reply {
	t.Helper()
	signed := webhook.GenerateTestSignedPayload(&webhook.UnsignedPayload{Payload: body, Secret: rc.secret, Timestamp: at})
	return s.Do(t, call{Path: "/webhooks/stripe", Cred: noCred, Body: body,
		Header: map[string]string{"Stripe-Signature": signed.Header}})
}

func stripeSite(t *testing.T, sb storeBackend, upstream string, extra string) *site {
	port := freeTCPPort(t)
	return siteFromCaddyfile(t, port, fmt.Sprintf(`http://127.0.0.1:%d {
	idempotency /webhooks/stripe* {
		%s
		scope        stripe
		key_json     /id
		store_status 2xx
		%s
	}
	reverse_proxy %s
}
`, port, sb.Block(), extra, strings.TrimPrefix(upstream, "http://")))
}

func TestStripeWebhook(t *testing.T) {
	eachStore(t, func(t *testing.T, sb storeBackend) {
		rc := newStripeReceiver(t)
		s := stripeSite(t, sb, rc.URL, "")
		start := time.Now()

		t.Run("delivered three times, processed once", func(t *testing.T) {
			id := "evt_" + pgtest.RandomHex(12)
			body := stripeEvent(id)
			first := rc.deliver(t, s, body, start)
			if first.Status != http.StatusOK || first.replayed() {
				t.Fatalf("first delivery: %s", first)
			}
			for i := 1; i <= 2; i++ {
				again := rc.deliver(t, s, body, start.Add(time.Duration(i)*time.Minute))
				wantReplayOf(t, again, first)
			}
			if n := rc.count(id); n != 1 {
				t.Errorf("event processed %d times, want 1", n)
			}
			t.Logf("%s: 3 deliveries, %d processed, 2 replayed", sb.Name, rc.count(id))
		})

		t.Run("failed twice, reached three times, then replayed", func(t *testing.T) {
			id := "evt_" + pgtest.RandomHex(12)
			rc.mu.Lock()
			rc.fail[id] = 2
			rc.mu.Unlock()
			body := stripeEvent(id)
			for i := range 2 {
				r := rc.deliver(t, s, body, start.Add(time.Duration(i)*time.Minute))
				if r.Status != http.StatusInternalServerError || r.replayed() {
					t.Fatalf("delivery %d: %s, want the upstream's 500, not stored", i+1, r)
				}
			}
			third := rc.deliver(t, s, body, start.Add(3*time.Minute))
			if third.Status != http.StatusOK || third.replayed() {
				t.Fatalf("third delivery: %s", third)
			}
			fourth := rc.deliver(t, s, body, start.Add(4*time.Minute))
			wantReplayOf(t, fourth, third)
			if n := rc.count(id); n != 3 {
				t.Errorf("event reached the upstream %d times, want 3", n)
			}
			t.Logf("%s: 4 deliveries, %d reached the upstream (2 failed, released), 1 replayed", sb.Name, rc.count(id))
			released := 0
			for _, l := range s.moduleLogLines(t) {
				if l["msg"] == "idempotency.release" && l["key"] == id {
					if l["status"] != float64(500) {
						t.Errorf("release line without the status: %v", l)
					}
					released++
				}
			}
			if released != 2 {
				t.Errorf("%d release lines for the event, want 2", released)
			}
		})

		t.Run("12 concurrent deliveries, processed once", func(t *testing.T) {
			id := "evt_" + pgtest.RandomHex(12)
			body := stripeEvent(id)
			gate := make(chan struct{})
			rc.mu.Lock()
			rc.gate = gate
			rc.mu.Unlock()
			replies := make(chan reply, 12)
			var wg sync.WaitGroup
			for i := range 12 {
				wg.Go(func() { replies <- rc.deliver(t, s, body, start.Add(time.Duration(i)*time.Second)) })
			}
			storetest.WaitFor(t, 10*time.Second, "the first delivery to reach the upstream", func() bool { return rc.count(id) == 1 })
			// The others get 409 while the first runs.
			storetest.WaitFor(t, 10*time.Second, "11 deliveries refused as in progress", func() bool { return len(replies) == 11 })
			close(gate)
			wg.Wait()
			close(replies)
			rc.mu.Lock()
			rc.gate = nil
			rc.mu.Unlock()
			ok, inProgress := 0, 0
			for r := range replies {
				switch r.Status {
				case http.StatusOK:
					ok++
				case http.StatusConflict:
					wantRetryAfter(t, r)
					inProgress++
				default:
					t.Errorf("concurrent delivery: %s", r)
				}
			}
			if ok != 1 || inProgress != 11 {
				t.Errorf("%d processed and %d in progress, want 1 and 11", ok, inProgress)
			}
			// The sender's retry of a 409 gets the stored answer.
			if r := rc.deliver(t, s, body, start.Add(time.Minute)); r.Status != http.StatusOK || !r.replayed() {
				t.Errorf("retry after 409: %s, want a replay", r)
			}
			if n := rc.count(id); n != 1 {
				t.Errorf("event processed %d times, want 1", n)
			}
			t.Logf("%s: 12 concurrent deliveries and a retry, %d processed", sb.Name, rc.count(id))
		})

		t.Run("event without id", func(t *testing.T) {
			body := []byte(fmt.Sprintf(`{"object":"event","api_version":%q}`, stripe.APIVersion))
			p := wantProblem(t, rc.deliver(t, s, body, start), http.StatusBadRequest)
			if !strings.HasSuffix(p.Type, "#key-missing") || !strings.Contains(p.Detail, "/id") {
				t.Errorf("problem %+v, want #key-missing naming /id", p)
			}
			body = []byte(`{"id":{"nested":"evt_123456789"}}`)
			p = wantProblem(t, rc.deliver(t, s, body, start), http.StatusBadRequest)
			if !strings.HasSuffix(p.Type, "#key-malformed") {
				t.Errorf("problem %+v, want #key-malformed", p)
			}
			body = []byte(`{"id":"evt_1"}`) // shorter than 8
			p = wantProblem(t, rc.deliver(t, s, body, start), http.StatusBadRequest)
			if !strings.HasSuffix(p.Type, "#key-malformed") {
				t.Errorf("problem %+v, want #key-malformed", p)
			}
		})
		rc.mu.Lock()
		defer rc.mu.Unlock()
		if rc.unverified != 0 {
			t.Errorf("%d deliveries reached the upstream changed: their signatures did not verify", rc.unverified)
		}
	})
}

// With wait, concurrent deliveries of one event each get the first
// delivery's answer.
func TestStripeWebhookWait(t *testing.T) {
	eachStore(t, func(t *testing.T, sb storeBackend) {
		rc := newStripeReceiver(t)
		ws := stripeSite(t, sb, rc.URL, "wait 10s")
		start := time.Now()
		id := "evt_" + pgtest.RandomHex(12)
		body := stripeEvent(id)
		gate := make(chan struct{})
		rc.mu.Lock()
		rc.gate = gate
		rc.mu.Unlock()
		replies := make(chan reply, 12)
		var wg sync.WaitGroup
		for i := range 12 {
			wg.Go(func() { replies <- rc.deliver(t, ws, body, start.Add(time.Duration(i)*time.Second)) })
		}
		storetest.WaitFor(t, 10*time.Second, "the first delivery to reach the upstream", func() bool { return rc.count(id) == 1 })
		time.Sleep(100 * time.Millisecond) // the others find it in progress, and wait
		close(gate)
		wg.Wait()
		close(replies)
		rc.mu.Lock()
		rc.gate = nil
		rc.mu.Unlock()
		replayed := 0
		for r := range replies {
			if r.Status != http.StatusOK {
				t.Errorf("waiting delivery: %s", r)
			}
			if r.replayed() {
				replayed++
			}
		}
		if n := rc.count(id); n != 1 || replayed != 11 {
			t.Errorf("event processed %d times, %d replays; want 1 and 11", n, replayed)
		}
		t.Logf("%s: 12 concurrent deliveries with wait, %d processed, %d replayed", sb.Name, rc.count(id), replayed)
	})
}

// docs/configuration.md's senders on one table: Stripe (key in the body) and three
// that send it in a header, each delivery with a new signature. The same
// key string under each scope is another event, executed once.
func TestWebhookScopesShareATable(t *testing.T) {
	headerSenders := []struct{ scope, keyHeader, sigHeader string }{
		{"github", "X-GitHub-Delivery", "X-Hub-Signature-256"},
		{"shopify", "X-Shopify-Event-Id", "X-Shopify-Hmac-Sha256"},
		{"standard", "webhook-id", "webhook-signature"},
	}
	eachStore(t, func(t *testing.T, sb storeBackend) {
		rc := newStripeReceiver(t)
		up := newUpstream(t)
		port := freeTCPPort(t)
		var routes strings.Builder
		for _, hs := range headerSenders {
			fmt.Fprintf(&routes, `
	idempotency /webhooks/%s* {
		%s
		scope        %s
		key_header   %s
		store_status 2xx
	}`, hs.scope, sb.Block(), hs.scope, hs.keyHeader)
		}
		s := siteFromCaddyfile(t, port, fmt.Sprintf(`http://127.0.0.1:%d {
	idempotency /webhooks/stripe* {
		%s
		scope        stripe
		key_json     /id
		store_status 2xx
	}%s
	handle /webhooks/stripe* {
		reverse_proxy %s
	}
	reverse_proxy %s
}
`, port, sb.Block(), routes.String(), strings.TrimPrefix(rc.URL, "http://"), up.Addr()))
		id := "evt_" + pgtest.RandomHex(12)
		event := stripeEvent(id)
		for i := range 2 {
			if r := rc.deliver(t, s, event, time.Now()); r.Status != http.StatusOK || r.replayed() != (i == 1) {
				t.Errorf("Stripe delivery %d: %s", i+1, r)
			}
			for _, hs := range headerSenders {
				r := s.Do(t, call{Path: "/webhooks/" + hs.scope, Key: id, KeyHeader: hs.keyHeader, Cred: noCred,
					Body: []byte(`{"type":"order.created"}`), Header: map[string]string{hs.sigHeader: "v1," + pgtest.RandomHex(16)}})
				if r.Status != http.StatusCreated || r.replayed() != (i == 1) {
					t.Errorf("%s delivery %d: %s", hs.scope, i+1, r)
				}
			}
		}
		if n := rc.count(id); n != 1 {
			t.Errorf("Stripe event processed %d times, want 1", n)
		}
		wantCount(t, up, len(headerSenders))
		if sb.Name == "postgres" {
			if n := pgCount(t, sb); n != 1+len(headerSenders) {
				t.Errorf("%d records, want %d: one per scope", n, 1+len(headerSenders))
			}
		}
	})
}

// A body nested deeper than the canonicaliser goes is still read for its
// key: the fingerprint hashes it raw, so its redeliveries, the same
// bytes, replay. Only past encoding/json's own limit (10,000 levels) is
// it not JSON to key_json: 400 #key-missing, nothing executed.
func TestKeyJSONDeepBody(t *testing.T) {
	eachStore(t, func(t *testing.T, sb storeBackend) {
		rc := newStripeReceiver(t)
		s := stripeSite(t, sb, rc.URL, "")
		start := time.Now()
		nested := func(id string, depth int) []byte {
			ev := stripeEvent(id)
			deep := strings.Repeat("[", depth) + strings.Repeat("]", depth)
			return append(append(ev[:len(ev)-1:len(ev)-1], `,"deep":`+deep...), '}')
		}

		id := "evt_" + pgtest.RandomHex(12)
		body := nested(id, canonjson.MaxDepth+100)
		first := rc.deliver(t, s, body, start)
		if first.Status != http.StatusOK || first.replayed() {
			t.Fatalf("first delivery of a body %d levels deep: %s", canonjson.MaxDepth+100, first)
		}
		wantReplayOf(t, rc.deliver(t, s, body, start.Add(time.Minute)), first)
		if n := rc.count(id); n != 1 {
			t.Errorf("event processed %d times, want 1", n)
		}

		id = "evt_" + pgtest.RandomHex(12)
		p := wantProblem(t, rc.deliver(t, s, nested(id, 10_001), start), http.StatusBadRequest)
		if !strings.HasSuffix(p.Type, "#key-missing") {
			t.Errorf("problem %+v, want #key-missing", p)
		}
		if n := rc.count(id); n != 0 {
			t.Errorf("event processed %d times, want 0", n)
		}
	})
}

// A member named twice anywhere on key_json's way, or under names that
// differ only in case (encoding/json matches names case-insensitively,
// and the last one wins), is one that parsers read differently: a
// last-wins receiver would take the other key, so the one body would be
// processed under two keys. At each level of a three-level pointer, the
// request is refused as #key-malformed and reaches nothing; the same
// body without the duplicate executes, so the refusals are the
// duplicate's.
func TestKeyJSONNamedTwiceAtEveryLevel(t *testing.T) {
	bodies := []struct{ name, body string }{
		{"data twice", `{"data":{"object":{"id":"evt_AAAAAAAA"}},"data":{"object":{"id":"evt_BBBBBBBB"}}}`},
		{"object twice", `{"data":{"object":{"id":"evt_AAAAAAAA"},"object":{"id":"evt_BBBBBBBB"}}}`},
		{"id twice", `{"data":{"object":{"id":"evt_AAAAAAAA","id":"evt_BBBBBBBB"}}}`},
		{"Data after data", `{"data":{"object":{"id":"evt_AAAAAAAA"}},"Data":{"object":{"id":"evt_BBBBBBBB"}}}`},
		{"OBJECT after object", `{"data":{"object":{"id":"evt_AAAAAAAA"},"OBJECT":{"id":"evt_BBBBBBBB"}}}`},
		{"ID after id", `{"data":{"object":{"id":"evt_AAAAAAAA","ID":"evt_BBBBBBBB"}}}`},
		{"id before a nested sibling", `{"data":{"object":{"id":"evt_AAAAAAAA","x":{"y":[1,{"z":2}]},"id":"evt_BBBBBBBB"}}}`},
		{"object after an array", `{"data":{"object":{"id":"evt_AAAAAAAA"},"list":[{"object":1},[2]],"object":{"id":"evt_BBBBBBBB"}}}`},
	}
	eachStore(t, func(t *testing.T, sb storeBackend) {
		up := newUpstream(t)
		s := protectedSite(t, sb, up.Addr(), "scope sender", "key_json /data/object/id")
		for _, b := range bodies {
			p := wantProblem(t, s.Do(t, call{Cred: noCred, Body: []byte(b.body)}), http.StatusBadRequest)
			if !strings.HasSuffix(p.Type, "#key-malformed") || !strings.Contains(p.Detail, "more than once") {
				t.Errorf("%s: problem %+v, want #key-malformed saying the member is there more than once", b.name, p)
			}
		}
		wantCount(t, up, 0)
		once := `{"data":{"object":{"id":"evt_AAAAAAAA","x":{"id":"other"}},"other":{"object":1}},"id":"top"}`
		wantExecuted(t, s.Do(t, call{Cred: noCred, Body: []byte(once)}), http.StatusCreated)
		wantCount(t, up, 1)
	})
}
