package load

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"strconv"
	"strings"
	"time"
)

// KeyLen is the length of every key Key returns.
const KeyLen = len("bench-") + 8 + len("-") + 12

// Key returns the idempotency key of operation seq of the run named run
// (8 characters): all keys of a run have the same length, so that every
// request of a row has the same size.
func Key(run string, seq int64) string {
	return fmt.Sprintf("bench-%-8.8s-%012d", run, seq)
}

// ChargeBody returns the ~500-byte JSON charge request sent under key: the
// key is part of the body, so every request of a row is a new request.
func ChargeBody(key string, size int) []byte {
	var b bytes.Buffer
	fmt.Fprintf(&b, `{"amount":129900,"currency":"eur","confirm":true,"capture_method":"automatic",`+
		`"description":"Order %s","customer":"cus_Q4mYf3kLx2","payment_method":"pm_card_visa",`+
		`"metadata":{"order_id":"%s","source":"web","campaign":null,"cart_items":3},`+
		`"shipping":{"name":"Zoe Mueller","address":{"line1":"Hauptstrasse 5",`+
		`"line2":null,"city":"Berlin","state":"BE","postal_code":"10115","country":"DE"}},`+
		`"receipt_email":"zoe@example.com","padding":"`, key, key)
	for b.Len() < size-2 {
		b.WriteByte('x')
	}
	b.WriteString(`"}`)
	return b.Bytes()
}

// RequestBodySize is the size of the benchmark's charge request.
const RequestBodySize = 500

// HTTPTarget describes the requests of one HTTP row.
type HTTPTarget struct {
	Addr       string // host:port
	Path       string
	Credential string // Authorization value
	Run        string // key namespace of this row
	// Keys, when > 0, makes operation seq use key seq % Keys (a replay
	// of keys preloaded by operations 0 to Keys-1); otherwise every
	// operation sends a new key.
	Keys     int64
	BodySize int
	// NoKey sends no Idempotency-Key (baseline and respond rows).
	NoKey bool
	// ExtraHeaders are added as they are ("Name: value" lines).
	ExtraHeaders []string
	// Expect is the status every answer must have (0: any 2xx).
	Expect int
	// Replay: every answer must (true) or must not (false) carry
	// Idempotent-Replay: true. Nil: not checked.
	Replay *bool
}

// NewHTTPOp returns an Op that sends requests over one keep-alive
// connection of its own. It is a minimal HTTP/1.1 client, so that the load
// generator spends as little of the shared CPUs as it can: it writes a
// request prepared as bytes and parses only what it checks.
func (t HTTPTarget) NewHTTPOp() (Op, error) {
	c := &httpClient{t: t}
	return c.do, nil
}

type httpClient struct {
	t    HTTPTarget
	conn net.Conn
	br   *bufio.Reader
	req  []byte
	// body holds the body when it does not depend on the key (no key).
	body []byte
}

func (c *httpClient) dial(ctx context.Context) error {
	var d net.Dialer
	conn, err := d.DialContext(ctx, "tcp", c.t.Addr)
	if err != nil {
		return err
	}
	c.conn = conn
	if c.br == nil {
		c.br = bufio.NewReaderSize(conn, 16<<10)
	} else {
		c.br.Reset(conn)
	}
	return nil
}

func (c *httpClient) close() {
	if c.conn != nil {
		c.conn.Close()
		c.conn = nil
	}
}

func (c *httpClient) build(seq int64) []byte {
	t := &c.t
	var key string
	var body []byte
	if !t.NoKey {
		if t.Keys > 0 {
			seq %= t.Keys
		}
		key = Key(t.Run, seq)
		body = ChargeBody(key, t.BodySize)
	} else {
		if c.body == nil {
			c.body = ChargeBody(Key(t.Run, 0), t.BodySize)
		}
		body = c.body
	}
	b := c.req[:0]
	b = append(b, "POST "...)
	b = append(b, t.Path...)
	b = append(b, " HTTP/1.1\r\nHost: "...)
	// The host without the port: the host takes part in the fingerprint,
	// and the rows that replay keys completed by another row's Caddy (on
	// another port) must send the same requests.
	host := t.Addr
	if h, _, err := net.SplitHostPort(t.Addr); err == nil {
		host = h
	}
	b = append(b, host...)
	b = append(b, "\r\nUser-Agent: idempotency-bench\r\nContent-Type: application/json\r\nAuthorization: "...)
	b = append(b, t.Credential...)
	if key != "" {
		b = append(b, "\r\nIdempotency-Key: "...)
		b = append(b, key...)
	}
	for _, h := range t.ExtraHeaders {
		b = append(b, "\r\n"...)
		b = append(b, h...)
	}
	b = append(b, "\r\nContent-Length: "...)
	b = strconv.AppendInt(b, int64(len(body)), 10)
	b = append(b, "\r\n\r\n"...)
	b = append(b, body...)
	c.req = b
	return b
}

func (c *httpClient) do(ctx context.Context, seq int64) error {
	req := c.build(seq)
	for attempt := 0; ; attempt++ {
		if c.conn == nil {
			if err := c.dial(ctx); err != nil {
				return err
			}
		}
		if dl, ok := ctx.Deadline(); ok {
			_ = c.conn.SetDeadline(dl)
		} else {
			_ = c.conn.SetDeadline(time.Now().Add(30 * time.Second))
		}
		status, replayed, keep, err := c.roundTrip(req)
		if err != nil {
			c.close()
			// A keep-alive connection the server closed between two
			// requests: retry once on a new one, before anything was read.
			if attempt == 0 && status == 0 && ctx.Err() == nil && errors.Is(err, errStale) {
				continue
			}
			return err
		}
		if !keep {
			c.close()
		}
		if c.t.Expect != 0 && status != c.t.Expect || c.t.Expect == 0 && (status < 200 || status > 299) {
			return fmt.Errorf("status %d", status)
		}
		if c.t.Replay != nil && replayed != *c.t.Replay {
			return fmt.Errorf("status %d with Idempotent-Replay %v, want %v", status, replayed, *c.t.Replay)
		}
		return nil
	}
}

var errStale = errors.New("connection closed before the response")

// roundTrip writes req and reads the response, discarding its body.
func (c *httpClient) roundTrip(req []byte) (status int, replayed, keep bool, err error) {
	if _, err := c.conn.Write(req); err != nil {
		return 0, false, false, fmt.Errorf("%w: %v", errStale, err)
	}
	line, err := c.br.ReadSlice('\n')
	if err != nil {
		if err == io.EOF {
			err = errStale
		}
		return 0, false, false, err
	}
	// HTTP/1.1 200 OK
	if len(line) < 12 || !bytes.HasPrefix(line, []byte("HTTP/1.")) {
		return 0, false, false, fmt.Errorf("malformed status line %q", line)
	}
	status, err = strconv.Atoi(string(line[9:12]))
	if err != nil {
		return 0, false, false, fmt.Errorf("malformed status line %q", line)
	}
	contentLength, chunked := int64(-1), false
	keep = true
	for {
		line, err := c.br.ReadSlice('\n')
		if err != nil {
			return status, false, false, err
		}
		line = bytes.TrimRight(line, "\r\n")
		if len(line) == 0 {
			break
		}
		name, value, ok := bytes.Cut(line, []byte(":"))
		if !ok {
			continue
		}
		value = bytes.TrimSpace(value)
		switch {
		case asciiEqualFold(name, "Content-Length"):
			contentLength, _ = strconv.ParseInt(string(value), 10, 64)
		case asciiEqualFold(name, "Transfer-Encoding"):
			chunked = asciiEqualFold(value, "chunked")
		case asciiEqualFold(name, "Connection"):
			keep = !asciiEqualFold(value, "close")
		case asciiEqualFold(name, "Idempotent-Replay"):
			replayed = string(value) == "true"
		}
	}
	switch {
	case chunked:
		err = c.discardChunked()
	case contentLength >= 0:
		_, err = c.br.Discard(int(contentLength))
	case status == 204 || status == 304:
	default:
		_, err = io.Copy(io.Discard, c.br)
		keep = false
	}
	return status, replayed, keep, err
}

func (c *httpClient) discardChunked() error {
	for {
		line, err := c.br.ReadSlice('\n')
		if err != nil {
			return err
		}
		sz, _, _ := strings.Cut(strings.TrimSpace(string(line)), ";")
		n, err := strconv.ParseInt(sz, 16, 64)
		if err != nil {
			return fmt.Errorf("malformed chunk size %q", line)
		}
		if n == 0 {
			// Trailers, then the blank line.
			for {
				line, err := c.br.ReadSlice('\n')
				if err != nil {
					return err
				}
				if len(bytes.TrimRight(line, "\r\n")) == 0 {
					return nil
				}
			}
		}
		if _, err := c.br.Discard(int(n) + 2); err != nil {
			return err
		}
	}
}

func asciiEqualFold(b []byte, s string) bool {
	if len(b) != len(s) {
		return false
	}
	for i := 0; i < len(b); i++ {
		x, y := b[i], s[i]
		if 'A' <= x && x <= 'Z' {
			x += 'a' - 'A'
		}
		if 'A' <= y && y <= 'Z' {
			y += 'a' - 'A'
		}
		if x != y {
			return false
		}
	}
	return true
}

// ResponseBodySize is the size of the benchmark's charge response.
const ResponseBodySize = 1024

// ResponseBody returns the ~1 KiB JSON charge response that the upstream
// sends and that the respond row answers with. It is one flat object:
// Caddy's respond scans its body for placeholders, and nested braces
// would cost it lookups that a real response body would not need.
func ResponseBody(size int) []byte {
	var b bytes.Buffer
	b.WriteString(`{"id":"ch_3PqRsT2eZvKYlo2C1a2b3c4d","object":"charge","amount":129900,"amount_captured":129900,` +
		`"amount_refunded":0,"balance_transaction":"txn_3PqRsT2eZvKYlo2C0x9y8z7w","captured":true,"created":1717171717,` +
		`"currency":"eur","customer":"cus_Q4mYf3kLx2","description":"Order","livemode":false,"paid":true,` +
		`"payment_intent":"pi_3PqRsT2eZvKYlo2C1q2w3e4r","payment_method":"pm_1PqRsT2eZvKYlo2Cabcdef","refunded":false,` +
		`"status":"succeeded","receipt_url":"https://pay.example.com/receipts/acct_1Nv0FGQ9RKHgCVdK/ch_3PqRsT2eZvKYlo2C1a2b3c4d",` +
		`"outcome_network_status":"approved_by_network","outcome_risk_level":"normal","outcome_risk_score":32,` +
		`"outcome_seller_message":"Payment complete.","outcome_type":"authorized","card_brand":"visa","card_last4":"4242",` +
		`"card_exp_month":8,"card_exp_year":2027,"card_funding":"credit","card_country":"US","padding":"`)
	for b.Len() < size-2 {
		b.WriteByte('x')
	}
	b.WriteString(`"}`)
	return b.Bytes()
}
