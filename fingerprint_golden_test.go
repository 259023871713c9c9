package idempotency

import (
	"context"
	"crypto/tls"
	"encoding/hex"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
)

// goldenFingerprint is the fingerprint of r as a handler on one listener
// set takes it.
func goldenFingerprint(r *http.Request, body string) string {
	fp := fingerprint(headOf(r), []byte(body))
	return hex.EncodeToString(fp[:])
}

// TestFingerprintGolden pins the fingerprints of ordinary requests as
// released versions computed them. Instances of two versions share a
// table during a rolling upgrade, and a retry that reaches the other
// version must find its record: a request with none of the inputs that
// a later version frames keeps these values.
func TestFingerprintGolden(t *testing.T) {
	req := func(method, target, host, localAddr string, tlsConn bool, header http.Header, body string) *http.Request {
		r := httptest.NewRequest(method, target, strings.NewReader(body))
		r.Host = host
		for name, values := range header {
			r.Header[name] = values
		}
		addr, err := net.ResolveTCPAddr("tcp", localAddr)
		if err != nil {
			t.Fatal(err)
		}
		r = r.WithContext(context.WithValue(r.Context(), http.LocalAddrContextKey, addr))
		if tlsConn {
			r.TLS = &tls.ConnectionState{}
		} else {
			r.TLS = nil
		}
		return r
	}
	for _, c := range []struct {
		name string
		r    *http.Request
		body string
		want string
	}{
		{
			name: "JSON behind a load balancer (listener on 8080, Host without a port)",
			r: req("POST", "/v1/charges?expand=customer", "api.example.com", "10.0.0.5:8080", false,
				http.Header{"Content-Type": {"application/json; charset=utf-8"}, "Authorization": {"Bearer a"}, "Idempotency-Key": {"order-0001"}}, ""),
			body: `{ "amount": 1000, "currency": "eur" }`,
			want: "d412c3511a118c802231820ba1d7631e90ee36c42454a504defa53bf1147746b",
		},
		{
			name: "form over TLS on 443",
			r: req("POST", "/v1/refunds", "API.Example.com", "10.0.0.5:443", true,
				http.Header{"Content-Type": {"application/x-www-form-urlencoded"}, "Accept-Encoding": {"gzip"}}, ""),
			body: "charge=ch_1&amount=500",
			want: "81d82dc9b57033080905c1efefac3d7564b64c635557945e6f86a9ea5de93922",
		},
		{
			name: "empty body, Host with its port",
			r:    req("PATCH", "/v1/orders/42/cancel", "api.example.com:8443", "127.0.0.1:8443", true, nil, ""),
			body: "",
			want: "31fd49ebb8a5c00b1ab96c819f42baced0ecfe24fa66afaf0490fee747f85780",
		},
		{
			name: "webhook with a signature header, plain HTTP on 80",
			r: req("POST", "/webhooks/stripe", "hooks.example.com", "10.0.0.5:80", false,
				http.Header{"Content-Type": {"application/json"}, "Stripe-Signature": {"t=1,v1=ab"}}, ""),
			body: `{"id":"evt_1","type":"charge.succeeded"}`,
			want: "1334ad4ad9e2f90cf50eef4ae4ccfb2878b30a1e5988097011552a47a1e2b303",
		},
	} {
		if got := goldenFingerprint(c.r, c.body); got != c.want {
			t.Errorf("%s: fingerprint %s, want %s as released", c.name, got, c.want)
		}
	}
}
