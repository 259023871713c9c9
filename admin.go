package idempotency

// Records through Caddy's admin API (admin.api.idempotency): the stores
// of the running config, memory store included, which the CLI cannot
// reach, under the same selectors as the CLI.
//
//	GET  /idempotency/stores
//	GET  /idempotency/records?store=&key=|key_prefix=&credential_id=|scope=&limit=&body=1
//	POST /idempotency/records   {"store", "key"|"key_prefix", "credential_id"|"credential"|"scope", "limit", "body"}
//	POST /idempotency/release   {"store", "key", "credential_id"|"credential"|"scope", "force"}
//
// A raw credential is accepted in a POST body only: Caddy's admin API
// logs the URI and the headers of every request it receives.

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/caddy-idempotency/idempotency/store"
	"github.com/caddyserver/caddy/v2"
)

func init() {
	caddy.RegisterModule(adminAPI{})
}

// Bounds of a listing. A listing with bodies holds each record's
// response in memory several times over (the store's copy, the record,
// base64 in the JSON answer), so it lists fewer records, and one such
// listing runs at a time (bodyListings): an admin client, even one
// granted only reads of /idempotency/, cannot make Caddy hold more than
// adminMaxBodyLimit responses for it.
const (
	adminDefaultLimit = 100
	adminMaxLimit     = 1000
	adminMaxBodyLimit = 10
	adminTimeout      = 30 * time.Second
)

var bodyListings sync.Mutex

// storeUser is a provisioned handler and the store it uses, as the admin
// API finds them.
type storeUser struct {
	h     *Handler
	store store.Inspector
	// cache is the handler's replay cache, or nil.
	cache *replayCache
	// group is the same for every handler whose store holds the same
	// records: the memory store, or a Postgres database and table.
	group string
	// name is how an operator names the store, before disambiguation:
	// "memory" or "postgres:<table>".
	name     string
	backend  string
	table    string
	database string // host:port/dbname, without credentials
}

// runningStores are the stores of the handlers of the loaded configs:
// during a reload, of the old and the new, which share their records.
var runningStores struct {
	sync.Mutex
	users map[*Handler]storeUser
}

// registerStore makes h's store, if it is an Inspector, reachable
// through the admin API until h's config is unloaded (Cleanup).
func (h *Handler) registerStore() {
	s, ok := store.As[store.Inspector](h.store)
	if !ok {
		return
	}
	u := storeUser{h: h, store: s, cache: h.cache, group: h.records}
	if n, ok := store.As[store.Named](h.store); ok {
		u.name, u.backend, u.table, u.database = n.StoreName()
	} else {
		// A store without a name of its own is named after its type.
		u.name = fmt.Sprintf("%T", store.Innermost(h.store))
		if m, ok := store.Innermost(h.store).(caddy.Module); ok {
			u.name = m.CaddyModule().ID.Name()
		}
		u.backend = u.name
	}
	runningStores.Lock()
	if runningStores.users == nil {
		runningStores.users = make(map[*Handler]storeUser)
	}
	runningStores.users[h] = u
	runningStores.Unlock()
}

// unregisterStore takes the handler's store off the running config's
// (unless another handler uses it): its config is unloaded.
func (h *Handler) unregisterStore() {
	runningStores.Lock()
	delete(runningStores.users, h)
	runningStores.Unlock()
}

// adminStore is one store of the running config and its handlers.
type adminStore struct {
	Name     string `json:"store"`
	Backend  string `json:"backend"`
	Table    string `json:"table,omitempty"`
	Database string `json:"database,omitempty"`
	Handlers int    `json:"handlers"`

	users []storeUser
}

// adminStores groups the running handlers by store. Two Postgres stores
// with the same table in different databases are named with their
// database too.
func adminStores() []*adminStore {
	runningStores.Lock()
	groups := make(map[string]*adminStore)
	for _, u := range runningStores.users {
		s := groups[u.group]
		if s == nil {
			s = &adminStore{Name: u.name, Backend: u.backend, Table: u.table, Database: u.database}
			groups[u.group] = s
		}
		s.users = append(s.users, u)
		s.Handlers++
	}
	runningStores.Unlock()
	names := make(map[string]int)
	for _, s := range groups {
		names[s.Name]++
	}
	out := make([]*adminStore, 0, len(groups))
	for _, s := range groups {
		if names[s.Name] > 1 {
			s.Name += "@" + s.Database
		}
		out = append(out, s)
	}
	slices.SortFunc(out, func(a, b *adminStore) int { return cmp.Compare(a.Name, b.Name) })
	return out
}

// adminAPI serves the records of the running stores on Caddy's admin
// endpoint.
type adminAPI struct{}

// CaddyModule returns the Caddy module information.
func (adminAPI) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{
		ID:  "admin.api.idempotency",
		New: func() caddy.Module { return new(adminAPI) },
	}
}

// Routes implements caddy.AdminRouter.
func (a *adminAPI) Routes() []caddy.AdminRoute {
	return []caddy.AdminRoute{{Pattern: "/idempotency/", Handler: caddy.AdminHandlerFunc(a.serve)}}
}

func (a *adminAPI) serve(w http.ResponseWriter, r *http.Request) error {
	ctx, cancel := context.WithTimeout(r.Context(), adminTimeout)
	defer cancel()
	switch r.URL.Path {
	case "/idempotency/stores":
		if r.Method != http.MethodGet {
			return adminError(http.StatusMethodNotAllowed, errors.New("GET only"))
		}
		return writeAdminJSON(w, adminStores())
	case "/idempotency/records":
		if r.Method != http.MethodGet && r.Method != http.MethodPost {
			return adminError(http.StatusMethodNotAllowed, errors.New("GET or POST only"))
		}
		sel, err := parseAdminSelector(r)
		if err != nil {
			return err
		}
		return a.records(ctx, w, sel)
	case "/idempotency/release":
		if r.Method != http.MethodPost {
			return adminError(http.StatusMethodNotAllowed, errors.New("POST only"))
		}
		sel, err := parseAdminSelector(r)
		if err != nil {
			return err
		}
		return a.release(ctx, w, sel)
	}
	return adminError(http.StatusNotFound, fmt.Errorf("no such resource: %s (want /idempotency/stores, /idempotency/records or /idempotency/release)", r.URL.Path))
}

// adminSelector names records as the CLI does.
type adminSelector struct {
	Store        string `json:"store"`
	Key          string `json:"key"`
	KeyPrefix    string `json:"key_prefix"`
	CredentialID string `json:"credential_id"`
	Credential   string `json:"credential"`
	Scope        string `json:"scope"`
	Limit        int    `json:"limit"`
	Body         bool   `json:"body"`
	Force        bool   `json:"force"`
}

// parseAdminSelector reads the selector from a POST's JSON body, or else
// from the query string, which must not carry a raw credential.
func parseAdminSelector(r *http.Request) (adminSelector, error) {
	var sel adminSelector
	if r.Method == http.MethodPost {
		body, err := io.ReadAll(io.LimitReader(r.Body, 64<<10))
		if err != nil {
			return sel, adminError(http.StatusBadRequest, err)
		}
		if len(strings.TrimSpace(string(body))) > 0 {
			dec := json.NewDecoder(strings.NewReader(string(body)))
			dec.DisallowUnknownFields()
			if err := dec.Decode(&sel); err != nil {
				return sel, adminError(http.StatusBadRequest, fmt.Errorf("the request body: %v", err))
			}
			return sel, nil
		}
	}
	// A malformed query (Go drops a pair with a ';') would silently
	// drop a selector, and list records that the caller did not ask for.
	q, err := url.ParseQuery(r.URL.RawQuery)
	if err != nil {
		return sel, adminError(http.StatusBadRequest, fmt.Errorf("the query string: %v", err))
	}
	if q.Has("credential") {
		return sel, adminError(http.StatusBadRequest, errors.New("a raw credential goes in a POST body, never in the URL, which Caddy's admin API logs: POST {\"credential\": ...} to this endpoint, or use credential_id"))
	}
	for name := range q {
		switch name {
		case "store", "key", "key_prefix", "credential_id", "scope", "limit", "body", "force":
		default:
			return sel, adminError(http.StatusBadRequest, fmt.Errorf("unknown parameter %q", name))
		}
	}
	sel.Store, sel.Key, sel.KeyPrefix, sel.CredentialID, sel.Scope = q.Get("store"), q.Get("key"), q.Get("key_prefix"), q.Get("credential_id"), q.Get("scope")
	if v := q.Get("limit"); v != "" {
		if sel.Limit, err = strconv.Atoi(v); err != nil {
			return sel, adminError(http.StatusBadRequest, fmt.Errorf("limit %q: not a number", v))
		}
	}
	for name, p := range map[string]*bool{"body": &sel.Body, "force": &sel.Force} {
		if v := q.Get(name); v != "" {
			if *p, err = strconv.ParseBool(v); err != nil {
				return sel, adminError(http.StatusBadRequest, fmt.Errorf("%s %q: want 1 or 0", name, v))
			}
		}
	}
	return sel, nil
}

// resolve finds the store the selector names and turns it into a filter.
func (sel adminSelector) resolve(ctx context.Context) (*adminStore, store.RecordFilter, error) {
	var f store.RecordFilter
	stores := adminStores()
	names := make([]string, len(stores))
	for i, s := range stores {
		names[i] = s.Name
	}
	var st *adminStore
	switch {
	case len(stores) == 0:
		return nil, f, adminError(http.StatusNotFound, errors.New("the running config has no idempotency handler"))
	case sel.Store == "" && len(stores) > 1:
		return nil, f, adminError(http.StatusBadRequest, fmt.Errorf("several stores run: name one with store (%s)", strings.Join(names, ", ")))
	case sel.Store == "":
		st = stores[0]
	default:
		i := slices.Index(names, sel.Store)
		if i < 0 {
			return nil, f, adminError(http.StatusNotFound, fmt.Errorf("no running store %q (running: %s)", sel.Store, strings.Join(names, ", ")))
		}
		st = stores[i]
	}

	switch {
	case sel.Key != "" && sel.KeyPrefix != "":
		return nil, f, adminError(http.StatusBadRequest, errors.New("give key or key_prefix, not both"))
	case sel.Key != "":
		key, err := parseKey(sel.Key)
		if err != nil {
			return nil, f, adminError(http.StatusBadRequest, fmt.Errorf("key: %v", err))
		}
		f.Key = key
	default:
		f.KeyPrefix = sel.KeyPrefix
	}
	switch {
	case given(sel.CredentialID, sel.Credential, sel.Scope) > 1:
		return nil, f, adminError(http.StatusBadRequest, errors.New("give one of credential_id, credential and scope"))
	case sel.Scope != "":
		// A webhook route's scope, hashed as each handler hashes it.
		prefixes, err := hashedUnderEach(ctx, st, func(c *credentialHasher) [32]byte { return scopeHash(c, sel.Scope) })
		if err != nil {
			return nil, f, err
		}
		f.CredentialPrefixes = prefixes
	case sel.CredentialID != "":
		prefix, err := parseCredentialID(sel.CredentialID)
		if err != nil {
			return nil, f, adminError(http.StatusBadRequest, err)
		}
		f.CredentialPrefixes = [][]byte{prefix}
	case sel.Credential != "":
		prefixes, err := hashedUnderEach(ctx, st, func(c *credentialHasher) [32]byte { return c.hash(sel.Credential) })
		if err != nil {
			return nil, f, err
		}
		f.CredentialPrefixes = prefixes
	}
	maxLimit, defLimit := adminMaxLimit, adminDefaultLimit
	if sel.Body {
		maxLimit, defLimit = adminMaxBodyLimit, adminMaxBodyLimit
	}
	switch {
	case sel.Limit < 0 || sel.Limit > maxLimit:
		if sel.Body {
			return nil, f, adminError(http.StatusBadRequest, fmt.Errorf("with body, limit must be 1 to %d: each record's response is held in memory", maxLimit))
		}
		return nil, f, adminError(http.StatusBadRequest, fmt.Errorf("limit must be 1 to %d", maxLimit))
	case sel.Limit == 0:
		f.Limit = defLimit
	default:
		f.Limit = sel.Limit
	}
	f.WithResponse = sel.Body
	for _, u := range st.users {
		f.LockTimeout = max(f.LockTimeout, time.Duration(u.h.LockTimeout))
	}
	return st, f, nil
}

func (a *adminAPI) records(ctx context.Context, w http.ResponseWriter, sel adminSelector) error {
	st, f, err := sel.resolve(ctx)
	if err != nil {
		return err
	}
	if f.WithResponse {
		bodyListings.Lock()
		defer bodyListings.Unlock()
	}
	f.Limit++ // one more, to tell whether the list is cut
	recs, err := st.users[0].store.InspectRecords(ctx, f)
	if err != nil {
		return adminError(http.StatusServiceUnavailable, fmt.Errorf("%s: %v", st.Name, err))
	}
	f.Limit--
	out := struct {
		Store     string       `json:"store"`
		Records   []recordJSON `json:"records"`
		Truncated bool         `json:"truncated,omitempty"`
	}{Store: st.Name, Records: []recordJSON{}}
	if len(recs) > f.Limit {
		recs, out.Truncated = recs[:f.Limit], true
	}
	for _, ir := range recs {
		rec := newRecordJSON(ir, f.WithResponse)
		if resp := ir.Record.Response; f.WithResponse && resp != nil && resp.Sealed && sel.Credential != "" {
			if opened := openForAdmin(ctx, st, sel.Credential, ir); opened != nil {
				rec.Response = &responseJSON{opened.Header, opened.Body}
			}
		}
		out.Records = append(out.Records, rec)
	}
	return writeAdminJSON(w, out)
}

// hashedUnderEach returns what hash gives under the secret of each
// handler of st, each once: each handler hashes under its own
// credential_secret, or the store's, and a credential or a scope is any
// of them.
func hashedUnderEach(ctx context.Context, st *adminStore, hash func(*credentialHasher) [32]byte) ([][]byte, error) {
	var sums [][]byte
	for _, u := range st.users {
		hasher, err := u.h.credKey.get(ctx)
		if err != nil {
			return nil, adminError(http.StatusServiceUnavailable, fmt.Errorf("the credential secret: %v", err))
		}
		sum := hash(hasher)
		if !slices.ContainsFunc(sums, func(p []byte) bool { return string(p) == string(sum[:]) }) {
			sums = append(sums, sum[:])
		}
	}
	return sums, nil
}

// openForAdmin opens the sealed response of ir with the raw credential,
// under the secret of each handler of st in turn; nil if none opens it
// (a scope's record, or another credential's).
func openForAdmin(ctx context.Context, st *adminStore, credential string, ir store.InspectedRecord) *store.Response {
	for _, u := range st.users {
		hasher, err := u.h.credKey.get(ctx)
		if err != nil {
			continue
		}
		sl := &sealer{prk: hasher.seal.hash(credential), table: u.h.sealTable}
		if resp, err := sl.open(ir.Key, &ir.Record); err == nil {
			return resp
		}
	}
	return nil
}

// release deletes one record (releaseRecord, as the CLI does): without
// force, only an in-progress record whose lease has ended (its owner
// died, and no retry took it over), which cannot be running; with force,
// any. It also drops the record from the replay
// caches of this process's handlers, so that its key executes at once
// here; other instances' caches keep a completed record until it
// expires or is evicted.
func (a *adminAPI) release(ctx context.Context, w http.ResponseWriter, sel adminSelector) error {
	if sel.Key == "" || sel.KeyPrefix != "" {
		return adminError(http.StatusBadRequest, errors.New("release needs key (not key_prefix)"))
	}
	if sel.CredentialID == "" && sel.Credential == "" && sel.Scope == "" {
		return adminError(http.StatusBadRequest, errors.New("release needs credential_id (as the log lines print it), credential or scope"))
	}
	st, f, err := sel.resolve(ctx)
	if err != nil {
		return err
	}
	rec, err := releaseRecord(ctx, st.users[0].store, f, sel.Force)
	switch {
	case errors.Is(err, store.ErrNoRecord):
		return adminError(http.StatusNotFound, fmt.Errorf("%s: no record of key %q for this credential", st.Name, f.Key))
	case errors.Is(err, errAmbiguous):
		return adminError(http.StatusConflict, fmt.Errorf("%s: several credentials match with key %q; nothing deleted: give a longer credential_id (a credential_hash of /idempotency/records) or credential", st.Name, f.Key))
	case errors.Is(err, errCompleted):
		return adminError(http.StatusConflict, fmt.Errorf("the record of key %q is %s, not in progress: its retries are replayed; nothing deleted (force deletes it, and the next request with the key executes again)", f.Key, rec.Record.Status))
	case errors.Is(err, errLeaseLive):
		return adminError(http.StatusConflict, fmt.Errorf("the record of key %q is in progress under a live lease (%s): its request may still be running, and its owner renews the lease while it runs; nothing deleted (force deletes it: the next request with the key then executes, possibly while the first one still runs, whose response is then not stored)", f.Key, lockState(rec)))
	case errors.Is(err, errChanged):
		return adminError(http.StatusConflict, fmt.Errorf("the record of key %q changed meanwhile (completed, renewed or released); nothing deleted: look at it again", f.Key))
	case err != nil:
		return adminError(http.StatusServiceUnavailable, fmt.Errorf("%s: %v", st.Name, err))
	}
	for _, u := range st.users {
		if u.cache != nil {
			u.cache.evict(rec.Key)
		}
		forgetLiveLock(u.group, rec.Key)
	}
	return writeAdminJSON(w, struct {
		Store    string     `json:"store"`
		Released recordJSON `json:"released"`
	}{st.Name, newRecordJSON(rec, false)})
}

// evict drops the cached copy of key's record, if there is one.
func (c *replayCache) evict(key store.RecordKey) {
	c.mu.Lock()
	if e := c.entries[key]; e != nil {
		c.remove(e)
	}
	c.mu.Unlock()
}

func adminError(status int, err error) error {
	return caddy.APIError{HTTPStatus: status, Err: err}
}

func writeAdminJSON(w http.ResponseWriter, v any) error {
	w.Header().Set("Content-Type", "application/json")
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	return enc.Encode(v)
}

// Interface guards
var (
	_ caddy.AdminRouter = (*adminAPI)(nil)
)
