package idempotency

import (
	"bytes"
	"compress/gzip"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"strings"

	"github.com/caddy-idempotency/idempotency/store"
)

// replayCoding decides how a stored response may be replayed to r, whose
// Accept-Encoding may differ from the original request's: as stored, or
// decoded from gzip (gunzip), or not at all (a 406 problem). A client
// never gets a content coding it did not accept. gzip, by far the
// commonest, is decoded as it is sent; any other coding, or a client that
// refuses identity as well, gets 406. A response stored without a coding
// is replayed as is, whatever the request says: RFC 9110 lets a server
// ignore a refusal of identity, and refusing the stored result would help
// no one.
func replayCoding(r *http.Request, resp *store.Response) (gunzip bool, prob *problem) {
	coding := strings.Join(resp.Header.Values("Content-Encoding"), ",")
	if coding == "" || acceptsEncoding(r.Header, coding) {
		return false, nil
	}
	if isGzip(coding) && acceptsEncoding(r.Header, "identity") {
		return true, nil
	}
	p := probEncodingNotAcceptable.withDetail(fmt.Sprintf(
		"the stored response to this request's key is encoded with %q, which this request's Accept-Encoding does not accept; retry accepting it", coding))
	return false, &p
}

// acceptsEncoding reports whether the Accept-Encoding of a request with
// header h accepts the content coding coding (a list, for a response
// coded more than once: each must be accepted). As RFC 9110 12.5.3 has
// it: no Accept-Encoding at all accepts any coding; a coding is accepted
// if listed with a q above 0, or else if "*" is; identity is accepted
// unless refused (identity;q=0, or *;q=0 without identity listed).
func acceptsEncoding(h http.Header, coding string) bool {
	values, present := h["Accept-Encoding"]
	if !present {
		return true
	}
	for _, c := range strings.Split(coding, ",") {
		c = normalCoding(c)
		if c == "" {
			continue
		}
		q, star := -1.0, -1.0
		for _, v := range values {
			for _, elem := range strings.Split(v, ",") {
				name, params, _ := strings.Cut(elem, ";")
				name = normalCoding(name)
				if name != c && name != "*" {
					continue
				}
				w, ok := qValue(params)
				if !ok {
					continue
				}
				if name == c {
					q = max(q, w)
				} else {
					star = max(star, w)
				}
			}
		}
		switch {
		case q >= 0:
			if q == 0 {
				return false
			}
		case star >= 0:
			if star == 0 {
				return false
			}
		case c != "identity":
			return false
		}
	}
	return true
}

// normalCoding is a content coding's name as compared: lower case, with
// x-gzip and x-compress meaning gzip and compress (RFC 9110 8.4.1).
func normalCoding(s string) string {
	s = strings.ToLower(strings.TrimSpace(s))
	if s == "x-gzip" || s == "x-compress" {
		return s[2:]
	}
	return s
}

// qValue returns the weight in an Accept-Encoding element's parameters:
// 1 without one, false for a malformed one (the element is ignored).
func qValue(params string) (float64, bool) {
	for _, p := range strings.Split(params, ";") {
		name, value, _ := strings.Cut(p, "=")
		if !strings.EqualFold(strings.TrimSpace(name), "q") {
			continue
		}
		q, err := strconv.ParseFloat(strings.TrimSpace(value), 64)
		if err != nil || q < 0 || q > 1 {
			return 0, false
		}
		return q, true
	}
	return 1, true
}

func isGzip(coding string) bool { return normalCoding(coding) == "gzip" }

// copyGunzipped sends the gzip body decoded, as it is decoded: the
// decoded size is not bounded by the stored one.
func copyGunzipped(w io.Writer, body []byte) error {
	zr, err := gzip.NewReader(bytes.NewReader(body))
	if err != nil {
		return err
	}
	if _, err := io.Copy(w, zr); err != nil {
		return err
	}
	return zr.Close()
}
