package idempotency

// Reading request bodies (step 3 of docs/how-it-works.md) under a budget: a protected
// request holds its whole body in memory from its first byte until it
// is done, so the sum over the requests in flight is bounded, not only
// each one.

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"sync"
	"sync/atomic"
)

// initialBodyBuffer is the most that is allocated for a body before its
// bytes arrive: a declared Content-Length costs nothing until it is sent.
// It is also the size of the chunks a larger body is read in.
const initialBodyBuffer = 64 << 10

// defaultBodyBudget bounds the request bodies that the handlers of a
// process hold at once, by default. Sized for the traffic of one
// instance, not for the host: 64 bodies of the default max_request_body
// at once, or some ten thousand of a few KiB, which is more than one
// instance's upstreams run concurrently; a fraction of the host's memory
// would scale it with what other processes need too. Memory use stays
// near it plus the garbage collector's headroom.
const defaultBodyBudget = 64 << 20

// bodyBudgetFloor is the smallest budget that admits one body of max
// bytes: it is read in chunks of initialBodyBuffer, one of them for
// seeing its end.
func bodyBudgetFloor(max int64) int64 { return max + 2*initialBodyBuffer }

// bodyBudget is the bytes of buffered request bodies allowed at once,
// and those reserved now.
type bodyBudget struct {
	limit int64
	used  atomic.Int64
}

// bodyBudgets holds one budget per size, for the whole process: handlers
// whose budgets have the same size share one (with the default, every
// handler of the process does), across config reloads too, so that a
// reload neither forgets the bodies in flight nor doubles the bound.
// Sizes are a handful per process; their budgets are a few words each.
var bodyBudgets sync.Map // int64 → *bodyBudget

func bodyBudgetOf(limit int64) *bodyBudget {
	b, _ := bodyBudgets.LoadOrStore(limit, &bodyBudget{limit: limit})
	return b.(*bodyBudget)
}

// bufferedBodyBytes is the sum of the budgets' reservations, for the
// metric.
func bufferedBodyBytes() float64 {
	var n int64
	bodyBudgets.Range(func(_, b any) bool {
		n += b.(*bodyBudget).used.Load()
		return true
	})
	return float64(n)
}

// reserve takes n bytes of the budget, unless that would exceed it.
func (b *bodyBudget) reserve(n int64) bool {
	for {
		used := b.used.Load()
		if used+n > b.limit {
			return false
		}
		if b.used.CompareAndSwap(used, used+n) {
			return true
		}
	}
}

func (b *bodyBudget) release(n int64) { b.used.Add(-n) }

// firstRead is the most that a body is read into before its buffer is
// allocated and reserved: a body whose headers declare a large length
// holds nothing of the budget until its bytes arrive. Small bodies,
// most of them, arrive whole in it, and are then copied into a buffer
// of their size.
const firstRead = 512

// firstReads recycles the buffers of first reads, which a request that
// sends no body keeps while it waits: they are not the budget's, so each
// is small, less than the connection's own buffers.
var firstReads = sync.Pool{New: func() any { return new([firstRead]byte) }}

// bodyChunks recycles the chunks that large bodies are read into, which
// are copied into one buffer of the body's size once it has arrived:
// without the pool every large body would leave its size in garbage, and
// the heap grow by as much before a collection.
var bodyChunks = sync.Pool{New: func() any { return new([initialBodyBuffer]byte) }}

// readBody reads the request body up to MaxRequestBody. The problem it
// returns, if any, is the client's error (nothing has been stored yet),
// or the body budget's, a 503. With a problem, the bytes are those read
// so far: shadow mode hands them on, followed by the rest of the body.
// held is the part of the budget that the body holds, which the caller
// releases once it is done with the body.
//
// The budget is reserved as the body's buffers are allocated, which they
// are as its bytes arrive: a client that declares a large body and sends
// nothing holds none of it (its first read waits in a pooled buffer of
// firstRead bytes), and one that sends it slowly holds what it sent,
// plus a chunk. A body that ends within the first read is copied into a
// buffer of its size; a larger one is read on into a first buffer of
// its declared size (at most a chunk), then in pooled chunks that are
// copied, once it is whole, into a buffer of exactly its size.
func (h *Handler) readBody(r *http.Request) (body []byte, held int64, prob *problem) {
	tooLarge := func(limit int64) *problem {
		p := probBodyTooLarge.withDetail(fmt.Sprintf(
			"the request body is larger than the %d bytes this endpoint accepts; nothing was executed", limit))
		return &p
	}
	if r.ContentLength > h.MaxRequestBody {
		return nil, 0, tooLarge(h.MaxRequestBody)
	}
	if r.Body == nil || r.Body == http.NoBody {
		return []byte{}, 0, nil
	}
	// +1 to see EOF without growing, or a body over the limit.
	limit := h.MaxRequestBody + 1
	size := int64(512)
	if r.ContentLength >= 0 {
		size = r.ContentLength + 1
	}
	size = min(size, initialBodyBuffer, limit)
	overBudget := func() *problem {
		h.metrics.bodyBudgetRefusals.Inc()
		p := probBodyBudget
		return &p
	}
	lr := io.LimitedReader{R: r.Body, N: limit}
	stage := firstReads.Get().(*[firstRead]byte)
	n, err := fill(&lr, stage[:min(size, firstRead)])
	if err != nil {
		// The whole body, or all of it that will come.
		size = int64(n)
	}
	if !h.bodyBudget.reserve(size) {
		firstReads.Put(stage)
		return nil, 0, overBudget()
	}
	held = size
	first := make([]byte, size)
	copy(first, stage[:n])
	firstReads.Put(stage)
	if err == nil {
		var m int
		m, err = fill(&lr, first[n:])
		n += m
	}
	body = first[:n]
	var chunks []*[initialBodyBuffer]byte
	last := 0 // bytes in the last chunk
	for err == nil {
		if !h.bodyBudget.reserve(initialBodyBuffer) {
			prob = overBudget()
			break
		}
		held += initialBodyBuffer
		c := bodyChunks.Get().(*[initialBodyBuffer]byte)
		chunks = append(chunks, c)
		last, err = fill(&lr, c[:])
	}
	if len(chunks) > 0 {
		whole := make([]byte, len(body)+(len(chunks)-1)*initialBodyBuffer+last)
		n := copy(whole, body)
		for i, c := range chunks {
			if i == len(chunks)-1 {
				n += copy(whole[n:], c[:last])
			} else {
				n += copy(whole[n:], c[:])
			}
			bodyChunks.Put(c)
		}
		h.bodyBudget.release(held - int64(len(whole)))
		body, held = whole, int64(len(whole))
	}
	if prob != nil {
		return body, held, prob
	}
	if err != io.EOF {
		// io.ErrUnexpectedEOF is the body's own: the client ended it
		// before its Content-Length or its last chunk. It is not a
		// shorter request.
		//
		// A request_body limit around this handler (or any
		// http.MaxBytesReader) is a body too large too.
		var mbe *http.MaxBytesError
		if errors.As(err, &mbe) {
			return body, held, tooLarge(mbe.Limit)
		}
		p := probBodyUnreadable
		var ne net.Error
		if errors.As(err, &ne) && ne.Timeout() {
			p.Status = http.StatusRequestTimeout
		}
		return body, held, &p
	}
	if int64(len(body)) > h.MaxRequestBody {
		return body, held, tooLarge(h.MaxRequestBody)
	}
	return body, held, nil
}

// fill reads into buf until it is full (nil), the body ends (io.EOF) or
// the body fails. Unlike io.ReadFull, which reports a body that ends
// before buf is full as io.ErrUnexpectedEOF, it keeps that error for a
// body that was cut short.
func fill(r io.Reader, buf []byte) (int, error) {
	n := 0
	for n < len(buf) {
		m, err := r.Read(buf[n:])
		n += m
		if err != nil {
			return n, err
		}
	}
	return n, nil
}

func (h *Handler) provisionBodyBudget() {
	if h.RequestBodyBudget == 0 {
		h.RequestBodyBudget = max(defaultBodyBudget, bodyBudgetFloor(h.MaxRequestBody))
	}
	h.bodyBudget = bodyBudgetOf(h.RequestBodyBudget)
}

func (h *Handler) validateBodyBudget() error {
	if floor := bodyBudgetFloor(h.MaxRequestBody); h.RequestBodyBudget < floor {
		return fmt.Errorf("request_body_budget (%d bytes) must be at least max_request_body plus 128KiB (%d bytes), so that a body of the largest size fits", h.RequestBodyBudget, floor)
	}
	return nil
}

// restoreBody hands the request body on to the next handler after
// readBody consumed it. When readBody stopped early (bodyErr is set),
// body is the part it read, and the rest still waits in the original
// body.
func restoreBody(r *http.Request, body []byte, bodyErr *problem) {
	if bodyErr != nil {
		r.Body = struct {
			io.Reader
			io.Closer
		}{io.MultiReader(bytes.NewReader(body), r.Body), r.Body}
	} else {
		r.Body = io.NopCloser(bytes.NewReader(body))
		r.ContentLength = int64(len(body))
		r.TransferEncoding = nil
	}
}
