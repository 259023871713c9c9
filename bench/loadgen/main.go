// Command loadgen is the benchmark's HTTP load generator: a fixed number
// of keep-alive connections, each sending one request after the other for
// a fixed duration, every request under a new Idempotency-Key (or, with
// -keys, replaying keys that an earlier run completed).
//
//	loadgen -addr 127.0.0.1:8080 -c 32 -d 10s               # first executions
//	loadgen -addr 127.0.0.1:8080 -count 1000 -run r1         # complete keys 0..999 of run r1
//	loadgen -addr 127.0.0.1:8080 -keys 1000 -run r1 -replay  # replay them
//
// It prints one line of JSON: requests, errors, seconds, rps and latency
// percentiles in nanoseconds.
package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"strings"
	"time"

	"github.com/caddy-idempotency/idempotency/bench/load"
)

func main() {
	var (
		addr     = flag.String("addr", "127.0.0.1:8080", "host:port of the server")
		path     = flag.String("path", "/v1/charges", "request path")
		cred     = flag.String("credential", "Bearer sk_test_bench_tenant_0001", "Authorization value")
		run      = flag.String("run", "r0000000", "key namespace (8 characters): keys are bench-<run>-<seq>")
		conc     = flag.Int("c", 32, "concurrency: connections, each with one request in flight")
		dur      = flag.Duration("d", 10*time.Second, "measured duration")
		warmup   = flag.Duration("warmup", 2*time.Second, "unmeasured warmup before the measured duration")
		count    = flag.Int64("count", 0, "send exactly this many requests (keys 0..count-1) instead of running for -d")
		keys     = flag.Int64("keys", 0, "replay: cycle through keys 0..keys-1 of -run, completed earlier")
		noKey    = flag.Bool("nokey", false, "send no Idempotency-Key (baseline rows)")
		replay   = flag.String("replay", "", "check Idempotent-Replay on every answer: true or false (default: not checked)")
		expect   = flag.Int("expect", 200, "status every answer must have (0: any 2xx)")
		bodySize = flag.Int("body", load.RequestBodySize, "request body size in bytes")
		headers  = flag.String("H", "", "extra request headers, as 'Name: value' separated by '\\n'")
	)
	flag.Parse()

	t := load.HTTPTarget{
		Addr: *addr, Path: *path, Credential: *cred, Run: *run,
		Keys: *keys, BodySize: *bodySize, NoKey: *noKey, Expect: *expect,
	}
	if *headers != "" {
		t.ExtraHeaders = strings.Split(*headers, `\n`)
	}
	switch *replay {
	case "":
	case "true", "false":
		v := *replay == "true"
		t.Replay = &v
	default:
		fmt.Fprintln(os.Stderr, "loadgen: -replay must be true or false")
		os.Exit(2)
	}

	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	defer stop()
	res, err := load.Run(ctx, load.Config{Concurrency: *conc, Warmup: *warmup, Duration: *dur, Count: *count},
		func(int) (load.Op, error) { return t.NewHTTPOp() })
	if err != nil {
		fmt.Fprintln(os.Stderr, "loadgen:", err)
		os.Exit(1)
	}
	out, _ := json.Marshal(res)
	fmt.Println(string(out))
	if res.Errors > 0 {
		fmt.Fprintf(os.Stderr, "loadgen: %d errors, the first: %s\n", res.Errors, res.FirstError)
	}
}
