package idempotency

import (
	"net/http"
	"strings"
	"time"

	"github.com/caddy-idempotency/idempotency/store"
	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
)

// Step 6 (docs/how-it-works.md): what a request gets for a record of its key
// that it does not own (a replay, a conflict, a refusal), decided once for
// enforcement and shadow mode alike, and the replay of a stored response.

// decision is the verdict on a request whose key has a record that the
// request does not own, with the line that logs it: enforcement answers
// it, shadow mode logs it and executes the request instead (existing).
type decision struct {
	verdict
	msg string // the log line's message, at info level
	// The line's own fields, after the request's, held as values: a
	// replay builds no slice of fields unless its line is written.
	extra  [2]zap.Field
	nextra int
	gunzip bool    // a replay: decode the stored gzip body (replayCoding)
	age    float64 // a replay: the record's age, in seconds
	// counts is the counter that enforcing the decision adds one to.
	counts prometheus.Counter
}

// decide is what q gets for the record rec of its key, which it does not
// own.
func (h *Handler) decide(q *request, rec *store.Record) decision {
	// An expired record is absent. A store never answers one, but one
	// that raced the record's re-execution would: the request then gets
	// the answer of the record in progress, never one of the expired
	// record's (a replay, a mismatch). TTL, unlike ExpiresAt, needs no
	// clocks to agree.
	if rec.TTL <= 0 {
		return decided(resultInProgress, probInProgress, h.retrySecs, "idempotency.in_progress", zap.Bool("expired", true))
	}
	if rec.Fingerprint != q.fp {
		return decided(resultMismatch, h.mismatchProblem(), 0, "idempotency.mismatch",
			zap.String("original_method", rec.Method), zap.String("original_path", rec.Path))
	}
	if rec.Status != store.StatusCompleted || rec.Response == nil {
		return decided(resultInProgress, probInProgress, h.retrySecs, "idempotency.in_progress",
			zap.Float64("lock_age_seconds", time.Since(rec.LockedAt).Seconds()))
	}
	resp := rec.Response
	if !resp.Replayable {
		d := decided(resultRejected, probNotReplayable, 0, "idempotency.not_replayable",
			zap.Int("original_status", resp.Status), zap.Int64("original_size", resp.BodySize))
		d.counts = h.metrics.notReplayable
		return d
	}
	gunzip, prob := replayCoding(q.r, resp)
	if prob != nil {
		return decided(resultRejected, *prob, 0, "idempotency.not_acceptable",
			zap.Int("original_status", resp.Status), zap.Strings("content_encoding", resp.Header.Values("Content-Encoding")))
	}
	age := time.Since(rec.CreatedAt).Seconds()
	d := decided(resultReplayed, problem{}, 0, "idempotency.replay",
		zap.Int("original_status", resp.Status), zap.Float64("age_seconds", age))
	d.gunzip, d.age = gunzip, age
	return d
}

// decided is a decision logged with the fields extra (two at most).
func decided(result string, p problem, retryAfter int, msg string, extra ...zap.Field) decision {
	d := decision{verdict: verdict{result, p, retryAfter}, msg: msg}
	d.nextra = copy(d.extra[:], extra)
	return d
}

// write writes d's line for the request q: the fields lead, those of the
// request, then d's own.
func (d *decision) write(c *zapcore.CheckedEntry, q *request, lead ...zap.Field) {
	f := make([]zap.Field, 0, len(lead)+5+d.nextra)
	f = q.appendFields(append(f, lead...))
	c.Write(append(f, d.extra[:d.nextra]...)...)
}

// replay sends the stored response resp as the answer to r, its body
// decoded from gzip if gunzip is set (see replayCoding).
//
// It starts from the headers that handlers around this one have already
// set on this request (a `header` directive's values, a Set-Cookie that
// the record never holds): they belong to this response. The stored
// headers replace those of the same names, since they were in the map
// when the original response was recorded, unless the next handler
// removed them. Assign, never Add, or values would be doubled. Server is
// the exception: the stored response says who produced it (reverse_proxy
// removes Caddy's in favour of Via), so it comes from the record or not
// at all.
//
// The values are copied, all in one allocation: the stored ones may be
// shared with other replays (the replay cache). Each header gets a full
// slice expression, so that a handler appending to one reallocates
// instead of writing over its neighbour.
func (h *Handler) replay(w http.ResponseWriter, r *http.Request, resp *store.Response, gunzip bool) {
	hdr := w.Header()
	delete(hdr, "Server")
	n := 0
	var trailers []string
	for name, values := range resp.Header {
		if t, ok := strings.CutPrefix(name, trailerPrefix); ok {
			trailers = append(trailers, t)
			continue
		}
		n += len(values)
	}
	all := make([]string, 0, n+2)
	for name, values := range resp.Header {
		if strings.HasPrefix(name, trailerPrefix) {
			continue
		}
		all = append(all, values...)
		hdr[name] = all[len(all)-len(values) : len(all) : len(all)]
	}
	all = append(all, "true", "true")
	hdr["Idempotent-Replay"] = all[n : n+1 : n+1]
	hdr["Idempotent-Replayed"] = all[n+1 : n+2 : n+2]
	if len(trailers) > 0 {
		// Declared, so that the body is sent chunked (a length would
		// leave no room for trailers) and the trailers follow it.
		hdr["Trailer"] = []string{strings.Join(trailers, ", ")}
		delete(hdr, "Content-Length")
	}
	if gunzip {
		delete(hdr, "Content-Encoding")
		delete(hdr, "Content-Length")
	}
	w.WriteHeader(resp.Status)
	if gunzip {
		if err := copyGunzipped(w, resp.Body); err != nil {
			// The client has part of a body: abort the response
			// rather than end it as though it were whole.
			h.logger.Error("idempotency.replay_decode", zap.String("host", logHost(r)), zap.String("path", clientPath(r)), zap.Error(err))
			panic(http.ErrAbortHandler)
		}
	} else {
		_, _ = w.Write(resp.Body)
	}
	for _, name := range trailers {
		hdr[name] = append([]string(nil), resp.Header[trailerPrefix+name]...)
	}
}
