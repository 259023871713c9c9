// Command upstream is the benchmark's trivial upstream: it reads the
// request body and answers 200 with the same ~1 KiB JSON charge response,
// as cheaply as net/http allows, so that the rows measure Caddy and the
// idempotency handler, not the upstream.
//
//	upstream -listen 127.0.0.1:9001
//
// A request with X-Bench-Response-Size: <n> gets an n-byte body instead
// (the memory row of the scale benchmark).
package main

import (
	"flag"
	"io"
	"log"
	"net/http"
	"strconv"
	"sync"

	"github.com/caddy-idempotency/idempotency/bench/load"
)

func main() {
	listen := flag.String("listen", "127.0.0.1:9001", "address to listen on")
	flag.Parse()

	body := load.ResponseBody(load.ResponseBodySize)
	length := strconv.Itoa(len(body))
	var (
		mu  sync.Mutex
		big []byte
	)
	handler := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body)
		h := w.Header()
		h["Content-Type"] = []string{"application/json"}
		out, n := body, length
		if s := r.Header.Get("X-Bench-Response-Size"); s != "" {
			size, err := strconv.Atoi(s)
			if err != nil || size < 2 || size > 64<<20 {
				http.Error(w, "bad X-Bench-Response-Size", http.StatusBadRequest)
				return
			}
			mu.Lock()
			if len(big) != size {
				big = load.ResponseBody(size)
			}
			out, n = big, s
			mu.Unlock()
		}
		h["Content-Length"] = []string{n}
		w.WriteHeader(http.StatusOK)
		_, _ = w.Write(out)
	})
	log.Fatal(http.ListenAndServe(*listen, handler))
}
