package idempotency

import (
	"context"
	"crypto/tls"
	"fmt"
	"net"
	"net/http"
	"net/http/httptest"
	"testing"
)

func TestSiteHost(t *testing.T) {
	req := func(host, local string, tlsConn bool) *http.Request {
		r := httptest.NewRequest("POST", "/pay", nil)
		r.Host = host
		if local != "" {
			addr, err := net.ResolveTCPAddr("tcp", local)
			if err != nil {
				t.Fatal(err)
			}
			r = r.WithContext(context.WithValue(r.Context(), http.LocalAddrContextKey, addr))
		}
		r.TLS = nil
		if tlsConn {
			r.TLS = &tls.ConnectionState{}
		}
		return r
	}
	for _, c := range []struct {
		host, local string
		tls         bool
		want, fill  string
	}{
		{"A.Test", "127.0.0.1:18312", false, "a.test", "a.test:18312"},
		{"a.test:18311", "127.0.0.1:18312", false, "a.test:18311", "a.test:18311"},
		{"a.test", "127.0.0.1:443", true, "a.test", "a.test"},
		{"a.test", "127.0.0.1:443", false, "a.test", "a.test:443"},
		{"a.test", "127.0.0.1:80", false, "a.test", "a.test:80"},
		{"a.test", "127.0.0.1:8443", true, "a.test", "a.test:8443"},
		{"[::1]", "[::1]:18312", false, "[::1]", "[::1]:18312"},
		{"[::1]:8080", "[::1]:18312", false, "[::1]:8080", "[::1]:8080"},
		{"a.test", "", false, "a.test", "a.test"},
	} {
		if got := siteHost(req(c.host, c.local, c.tls), false); got != c.want {
			t.Errorf("siteHost(%q on %s, tls %v) = %q, want %q", c.host, c.local, c.tls, got, c.want)
		}
		if got := siteHost(req(c.host, c.local, c.tls), true); got != c.fill {
			t.Errorf("siteHost(%q on %s, tls %v), port filled in, = %q, want %q", c.host, c.local, c.tls, got, c.fill)
		}
	}
}

// The port is filled in only while the records are served on more than
// one listener set; a reload, whose old and new configs serve the same
// listeners for a while, is one.
func TestSiteRegistry(t *testing.T) {
	records := "test records " + randomHex(6)
	newHandler := func(listeners string) *Handler {
		h := &Handler{records: records}
		h.registerSite(listeners)
		return h
	}
	a := newHandler(":18311")
	reloaded := newHandler(":18311")
	if a.fillPort() || reloaded.fillPort() {
		t.Fatal("one listener set, twice (a reload): the port is filled in")
	}
	b := newHandler(":18312")
	if !a.fillPort() || !b.fillPort() {
		t.Fatal("two listener sets on one set of records: the port is not filled in")
	}
	other := &Handler{records: records + " other"}
	other.registerSite(":18313")
	if other.fillPort() {
		t.Error("a handler on other records fills the port in")
	}
	b.unregisterSite()
	if a.fillPort() {
		t.Error("the second listener set is gone, the port is still filled in")
	}
	a.unregisterSite()
	a.unregisterSite() // a second Cleanup counts for nothing
	runningSites.Lock()
	if n := runningSites.byRecords[records].listeners[":18311"]; n != 1 {
		t.Errorf("%d handlers counted on :18311, want the reloaded one", n)
	}
	runningSites.Unlock()
	reloaded.unregisterSite()
	other.unregisterSite()
	outside := &Handler{records: records}
	outside.registerSite("")
	if outside.fillPort() {
		t.Error("a handler outside a server fills the port in")
	}
	runningSites.Lock()
	defer runningSites.Unlock()
	if _, left := runningSites.byRecords[records]; left {
		t.Error("the records' entry outlives their handlers")
	}
}

// Two sites of one name on two ports, sharing a store, never answer with
// each other's responses, even to a client that sends its Host without
// the port; on each, the Host with and without its port is one site.
func TestSitesOfOneNameOnTwoPorts(t *testing.T) {
	eachStore(t, func(t *testing.T, sb storeBackend) {
		up := newUpstream(t)
		port1, port2 := freeTCPPort(t), freeTCPPort(t)
		site := func(port int) string {
			return fmt.Sprintf(`http://a.test:%d {
	idempotency {
		%s
	}
	reverse_proxy %s
}
`, port, sb.Block(), up.Addr())
		}
		s1 := siteFromCaddyfile(t, port1, site(port1)+site(port2))
		s2 := newSiteClient(t, s1.caddyServer, port2)
		c := call{Key: newKey(), Body: payBody()}
		first := doHost(t, s1, c, "a.test")
		wantExecuted(t, first, http.StatusCreated)
		wantReplayOf(t, doHost(t, s1, c, fmt.Sprintf("a.test:%d", port1)), first)
		wantProblem(t, doHost(t, s2, c, "a.test"), http.StatusConflict)
		wantProblem(t, doHost(t, s2, c, fmt.Sprintf("a.test:%d", port2)), http.StatusConflict)
		wantCount(t, up, 1)

		// Site two's own record, under another key.
		c2 := call{Key: newKey(), Body: payBody()}
		second := doHost(t, s2, c2, fmt.Sprintf("A.test:%d", port2))
		wantExecuted(t, second, http.StatusCreated)
		wantReplayOf(t, doHost(t, s2, c2, "a.test"), second)
		wantProblem(t, doHost(t, s1, c2, "a.test"), http.StatusConflict)
		wantCount(t, up, 2)
	})
}
