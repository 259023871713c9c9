package idempotency

// The host a fingerprint takes. Two sites of one name on two ports
// (a.test:8001 and a.test:8002) are two sites, but a client that sends
// its Host without the port makes them look alike. Filling in the
// listener's port tells them apart, and would tell apart, as well, the
// instances of one site behind a load balancer, each listening on a
// port of its own, and the records of versions that took the Host as
// sent: a retry that crosses either would get 409 instead of its
// answer. So the port is filled in only where the ambiguity exists: in
// a process whose handlers on one set of records listen on more than
// one set of addresses (two servers, in Caddy's terms). A process with
// one server per store, the usual case, fingerprints the Host as sent.

import (
	"net"
	"net/http"
	"slices"
	"strings"
	"sync"
	"sync/atomic"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
)

// recordSites are the listener sets of the running handlers on one set
// of records.
type recordSites struct {
	// listeners counts the handlers on each listener set.
	listeners map[string]int
	// several is whether there are more than one: read on every request.
	several atomic.Bool
}

// runningSites holds the recordSites of each set of records
// (recordsOf) that a running handler uses, under its mutex.
var runningSites struct {
	sync.Mutex
	byRecords map[string]*recordSites
}

// listenerSet names the addresses that the server whose routes ctx
// provisions listens on, or "" outside a server.
func listenerSet(ctx caddy.Context) string {
	srv, ok := ctx.Value(caddyhttp.ServerCtxKey).(*caddyhttp.Server)
	if !ok || srv == nil {
		return ""
	}
	return strings.Join(slices.Sorted(slices.Values(srv.Listen)), " ")
}

// registerSite notes that h serves its records on listeners, until
// unregisterSite. The old and the new config of a reload list the same
// listener set once: a reload does not make a site look like two.
func (h *Handler) registerSite(listeners string) {
	if listeners == "" {
		return
	}
	runningSites.Lock()
	defer runningSites.Unlock()
	if runningSites.byRecords == nil {
		runningSites.byRecords = make(map[string]*recordSites)
	}
	rs := runningSites.byRecords[h.records]
	if rs == nil {
		rs = &recordSites{listeners: make(map[string]int)}
		runningSites.byRecords[h.records] = rs
	}
	rs.listeners[listeners]++
	rs.several.Store(len(rs.listeners) > 1)
	h.sites, h.listeners = rs, listeners
}

// unregisterSite undoes registerSite: h's config is unloaded. It keeps
// h.sites, which requests still in flight read.
func (h *Handler) unregisterSite() {
	runningSites.Lock()
	defer runningSites.Unlock()
	if h.listeners == "" {
		return
	}
	rs := h.sites
	if rs.listeners[h.listeners]--; rs.listeners[h.listeners] == 0 {
		delete(rs.listeners, h.listeners)
	}
	rs.several.Store(len(rs.listeners) > 1)
	if len(rs.listeners) == 0 {
		delete(runningSites.byRecords, h.records)
	}
	h.listeners = ""
}

// fillPort reports whether h's fingerprints fill the listener's port
// into a Host without one: whether its records are served on several
// listener sets by this process.
func (h *Handler) fillPort() bool {
	return h.sites != nil && h.sites.several.Load()
}

// siteHost is r's Host as the fingerprint and the log lines take it:
// lower-cased, as host names are case-insensitive, the port kept; and
// with fillPort, a Host without a port gets the port of the listener
// that the request came in on, unless that is 443 over TLS, the port a
// Host without one means there. A retry that names the port then
// matches one that did not, on the same listener.
func siteHost(r *http.Request, fillPort bool) string {
	host := strings.ToLower(r.Host)
	if !fillPort || hasPort(host) {
		return host
	}
	addr, ok := r.Context().Value(http.LocalAddrContextKey).(net.Addr)
	if !ok || addr == nil {
		return host
	}
	_, port, err := net.SplitHostPort(addr.String())
	if err != nil || port == "" || port == "443" && r.TLS != nil {
		return host
	}
	return host + ":" + port
}

// hasPort reports whether a Host names a port: a colon after the
// closing bracket of an IPv6 literal, if any.
func hasPort(host string) bool {
	colon := strings.LastIndexByte(host, ':')
	return colon >= 0 && colon > strings.LastIndexByte(host, ']')
}
