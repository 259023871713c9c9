package idempotency

import (
	"io"
	"net/http"
	"strconv"
	"strings"

	"github.com/caddy-idempotency/idempotency/store"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
)

// recorder streams a response to the client as the next handler produces
// it, and keeps a copy of the status, headers and body for the store.
//
// It differs from caddyhttp's buffering recorder in three ways that the
// idempotency guarantee depends on: it never delays the client (no
// buffering), it caps its copy at a fixed size (the client still gets the
// whole body), and it keeps accepting the body after the client has gone,
// so that the upstream is read to the end and a complete response is
// stored for the client's retry.
type recorder struct {
	caddyhttp.ResponseWriterWrapper

	limit int64

	wroteHeader bool
	status      int
	// header is a snapshot taken at WriteHeader: the live map is shared
	// with the handlers around us, which keep changing it afterwards
	// (encode adds Content-Encoding, deferred header ops run late).
	header http.Header
	body   []byte
	size   int64
	// overflow means the body outgrew limit: the copy was dropped and
	// the record will be completed as not replayable.
	overflow bool
	// clientGone is set by the first failed write to the client; from
	// then on the body is only recorded.
	clientGone bool
}

func newRecorder(w http.ResponseWriter, limit int64) *recorder {
	return &recorder{
		ResponseWriterWrapper: caddyhttp.ResponseWriterWrapper{ResponseWriter: w},
		limit:                 limit,
	}
}

// WriteHeader records the final status and a snapshot of the headers.
// Informational responses (103 Early Hints) pass through unrecorded: they
// are not the response a replay must reproduce.
func (rec *recorder) WriteHeader(status int) {
	if rec.wroteHeader {
		return
	}
	if status >= 100 && status < 200 && status != http.StatusSwitchingProtocols {
		rec.ResponseWriter.WriteHeader(status)
		return
	}
	rec.wroteHeader = true
	rec.status = status
	rec.header = rec.ResponseWriter.Header().Clone()
	if cl := rec.header.Get("Content-Length"); cl != "" {
		// A declared length is a promise, not bytes: at most a first
		// chunk is allocated for it, and append grows the copy with what
		// arrives.
		if n, err := strconv.ParseInt(cl, 10, 64); err == nil && n >= 0 && n <= rec.limit {
			rec.body = make([]byte, 0, min(n, initialBodyBuffer))
		}
	}
	rec.ResponseWriter.WriteHeader(status)
}

// Write sends p to the client and records it. It reports success even
// when the client has gone, so that the next handler (reverse_proxy's
// copy loop) reads its upstream to the end instead of aborting: the
// complete response is what the client's retry must get.
func (rec *recorder) Write(p []byte) (int, error) {
	if !rec.wroteHeader {
		rec.WriteHeader(http.StatusOK)
	}
	rec.record(p)
	if !rec.clientGone {
		if _, err := rec.ResponseWriter.Write(p); err != nil {
			rec.clientGone = true
		}
	}
	return len(p), nil
}

func (rec *recorder) record(p []byte) {
	rec.size += int64(len(p))
	if rec.overflow {
		return
	}
	if rec.size > rec.limit {
		rec.overflow = true
		rec.body = nil
		return
	}
	rec.body = append(rec.body, p...)
}

// ReadFrom is overridden because the promoted one from
// ResponseWriterWrapper would bypass Write, and with it the recording
// (http.ServeContent and file_server send bodies this way).
func (rec *recorder) ReadFrom(r io.Reader) (int64, error) {
	return io.Copy(writerOnly{rec}, r)
}

// writerOnly hides recorder's ReadFrom from io.Copy, which would
// otherwise call it again.
type writerOnly struct{ io.Writer }

// FlushError passes a flush through so that streamed responses reach the
// client as they are produced. http.ResponseController calls it.
func (rec *recorder) FlushError() error {
	if !rec.wroteHeader {
		rec.WriteHeader(http.StatusOK)
	}
	if rec.clientGone {
		return nil
	}
	return http.NewResponseController(rec.ResponseWriter).Flush()
}

// Flush implements http.Flusher for handlers that type-assert it.
func (rec *recorder) Flush() { _ = rec.FlushError() }

// trailerPrefix prefixes the trailers among a stored response's headers.
// A colon never appears in a field name, so no header can be taken for a
// trailer, nor a trailer for a header.
const trailerPrefix = "Trailer:"

// headerLineBytes is what a header line adds to its name and value as it
// is sent: ": " and the line's end. Headers count against the limit as
// they are sent, a line per value: by their names and values alone,
// two million empty values (the 8 MB of header lines that Go's
// transport accepts) counted as one name, and a record of them took
// 10 MB.
const headerLineBytes = len(": \r\n")

// response returns what the store keeps: headers minus excluded ones,
// trailers, and the body, unless headers, trailers and body together
// outgrew the limit or the response switched protocols.
func (rec *recorder) response(excluded map[string]struct{}) *store.Response {
	status := rec.status
	header := rec.header
	if !rec.wroteHeader {
		// A handler that returns without writing answers 200 with no
		// body; that is what the client got, so that is what a replay
		// gives.
		status = http.StatusOK
		header = rec.ResponseWriter.Header().Clone()
	} else {
		rec.addTrailers(header)
	}
	size := rec.size
	hop := connectionNamed(header)
	for name, values := range header {
		sent := strings.TrimPrefix(name, trailerPrefix) // a trailer's line has no prefix
		canonical := http.CanonicalHeaderKey(sent)
		if _, skip := excluded[canonical]; skip || hop[canonical] {
			delete(header, name)
			continue
		}
		for _, v := range values {
			size += int64(len(sent) + headerLineBytes + len(v))
		}
	}
	// A 101 handed the connection to another protocol: what followed
	// went past the recorder, and a replayed 101 would open no tunnel.
	replayable := !rec.overflow && size <= rec.limit && status != http.StatusSwitchingProtocols
	resp := &store.Response{
		Status:     status,
		Header:     header,
		BodySize:   rec.size,
		Replayable: replayable,
	}
	if replayable {
		resp.Body = rec.body
		if resp.Body == nil {
			resp.Body = []byte{}
		}
	}
	return resp
}

// connectionNamed returns the headers that the Connection fields of
// header name: hop-by-hop too (RFC 9110 7.6.1), they describe the first
// connection, not the response, so they are never stored. Nil for a
// response without them, the usual case.
func connectionNamed(header http.Header) map[string]bool {
	var named map[string]bool
	for _, v := range header["Connection"] {
		for _, name := range strings.Split(v, ",") {
			if name = strings.TrimSpace(name); name != "" {
				if named == nil {
					named = make(map[string]bool)
				}
				named[http.CanonicalHeaderKey(name)] = true
			}
		}
	}
	return named
}

// addTrailers files the trailers the next handler set after the body
// into header, under trailerPrefix: those declared by the Trailer header
// when the header was written, and those set with http.TrailerPrefix.
func (rec *recorder) addTrailers(header http.Header) {
	live := rec.ResponseWriter.Header()
	for _, v := range header["Trailer"] {
		for _, name := range strings.Split(v, ",") {
			name = http.CanonicalHeaderKey(strings.TrimSpace(name))
			if values := live[name]; name != "" && len(values) > 0 {
				header[trailerPrefix+name] = append([]string(nil), values...)
			}
		}
	}
	for name, values := range live {
		if after, ok := strings.CutPrefix(name, http.TrailerPrefix); ok && after != "" && len(values) > 0 {
			key := trailerPrefix + http.CanonicalHeaderKey(after)
			header[key] = append(header[key], values...)
		}
	}
}

// Interface guards
var (
	_ http.ResponseWriter = (*recorder)(nil)
	_ http.Flusher        = (*recorder)(nil)
	_ io.ReaderFrom       = (*recorder)(nil)
)
