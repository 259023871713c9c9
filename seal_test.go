package idempotency

import (
	"bytes"
	"crypto/hkdf"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/caddy-idempotency/idempotency/internal/pgtest"
	"github.com/caddy-idempotency/idempotency/store"
	"github.com/caddy-idempotency/idempotency/stores/postgres"
)

// storeRowsText is every row of sb's tables (its records, its _secret
// and _primaries, the migrations' bookkeeping) as Postgres writes a row
// as text, bytea in hex: what a copy of the database shows.
func storeRowsText(t *testing.T, sb storeBackend) string {
	t.Helper()
	var all strings.Builder
	tables := pgtest.Query(t, sb.DSN, `SELECT quote_ident(tablename) FROM pg_tables
		WHERE schemaname = current_schema() AND (tablename LIKE $1 || '%' OR tablename = $2)`, sb.Table, postgres.MigrationsTable)
	for _, tr := range tables {
		for _, row := range pgtest.Query(t, sb.DSN, `SELECT r::text FROM `+tr[0]+` AS r`) {
			fmt.Fprintln(&all, row[0])
		}
	}
	return all.String()
}

// readable reports which of the secrets text shows, as they are or in
// hex (bytea's output).
func readable(text string, secrets ...string) []string {
	var found []string
	for _, s := range secrets {
		if strings.Contains(text, s) || strings.Contains(text, hex.EncodeToString([]byte(s))) {
			found = append(found, s)
		}
	}
	return found
}

// A Postgres store's tables hold no byte of a response's body or
// headers that reads without the caller's credential, and a retry on
// another instance of the table replays it byte for byte. Catches a
// record stored in the clear, or sealed where a second instance cannot
// open it.
func TestPostgresRecordsAreSealedAtRest(t *testing.T) {
	sb := postgresBackend(t)
	up := newUpstream(t)
	ports := [2]int{freeTCPPort(t), freeTCPPort(t)}
	var sites string
	for _, port := range ports {
		sites += fmt.Sprintf("http://127.0.0.1:%d {\n\tidempotency {\n\t\t%s\n\t}\n\treverse_proxy %s\n}\n", port, sb.Block(), up.Addr())
	}
	srv := startCaddyfile(t, sites)
	a, b := newSiteClient(t, srv, ports[0]), newSiteClient(t, srv, ports[1])

	c := call{Key: newKey(), Body: payBody()}
	first := a.Do(t, c)
	wantExecuted(t, first, http.StatusCreated)
	sized := call{Key: newKey(), Body: payBody(), Header: map[string]string{"X-Test-Size": "3000"}}
	big := a.Do(t, sized)
	wantExecuted(t, big, http.StatusCreated)
	sb.waitCompleted(t, c.Key)
	sb.waitCompleted(t, sized.Key)

	text := storeRowsText(t, sb)
	id := first.Header.Get("X-Execution-Id")
	if found := readable(text, id, `"execution":`, "X-Multi", "/pay/"+id, "application/json",
		string(big.Body[:64]), big.Header.Get("X-Execution-Id")); len(found) > 0 {
		t.Fatalf("the store's tables show %q of the responses", found)
	}
	// The key and the status stay in the clear: operators find records
	// by them.
	if !strings.Contains(text, c.Key) || !strings.Contains(text, "201") {
		t.Fatalf("the record of %s is not in the tables", c.Key)
	}

	wantReplayOf(t, b.Do(t, c), first)
	wantReplayOf(t, a.Do(t, c), first)
	wantReplayOf(t, b.Do(t, sized), big)
	wantCount(t, up, 2)
}

// A sealed record copied under another key of the same tenant, or under
// another tenant's record, does not open: the retry is answered 500
// #record-unreadable, logged, and nothing executes again. Catches a
// record bound to nothing but its credential, and an unreadable record
// executed again.
func TestSealedRecordCopiedElsewhereIsRefused(t *testing.T) {
	sb := postgresBackend(t)
	up := newUpstream(t)
	// Without the replay cache, which holds what this instance completed
	// and would answer without a look at the table.
	s := protectedSite(t, sb, up.Addr(), "replay_cache off")

	source := call{Key: newKey(), Body: payBody()}
	wantExecuted(t, s.Do(t, source), http.StatusCreated)
	sameTenant := call{Key: newKey(), Body: payBody()}
	wantExecuted(t, s.Do(t, sameTenant), http.StatusCreated)
	otherTenant := call{Key: newKey(), Body: payBody(), Cred: "Bearer tenant-b"}
	wantExecuted(t, s.Do(t, otherTenant), http.StatusCreated)
	for _, k := range []string{source.Key, sameTenant.Key, otherTenant.Key} {
		sb.waitCompleted(t, k)
	}

	table := pgtest.QuoteIdent(sb.Table)
	for _, target := range []call{sameTenant, otherTenant} {
		pgtest.Exec(t, sb.DSN, `UPDATE `+table+` AS t SET response_body = s.response_body,
			response_header_bytes = s.response_header_bytes, response_status = s.response_status
			FROM `+table+` AS s WHERE s.key = $1 AND t.key = $2`, source.Key, target.Key)
		if p := wantProblem(t, s.Do(t, target), http.StatusInternalServerError); !strings.HasSuffix(p.Type, "#record-unreadable") {
			t.Errorf("%s: problem type = %q", target.Key, p.Type)
		}
	}
	wantCount(t, up, 3)

	var lines int
	for _, l := range s.moduleLogLines(t) {
		if l["msg"] == "idempotency.record_unreadable" && l["level"] == "error" {
			lines++
		}
	}
	if lines != 2 {
		t.Errorf("%d idempotency.record_unreadable error lines, want 2", lines)
	}
}

// seal off stores in the clear, as before sealing, and a handler with
// seal on replays such a record (records written before sealing); a
// handler with seal off opens a sealed one (a rolling change of the
// option). Catches a sealed-only reader, and seal off ignored.
func TestSealOffStoresInTheClearAndEitherOpensBoth(t *testing.T) {
	sb := postgresBackend(t)
	up := newUpstream(t)
	on, off := freeTCPPort(t), freeTCPPort(t)
	srv := startCaddyfile(t, fmt.Sprintf(`http://127.0.0.1:%d {
	idempotency {
		%s
	}
	reverse_proxy %s
}
http://127.0.0.1:%d {
	idempotency {
		%s
		seal off
	}
	reverse_proxy %s
}
`, on, sb.Block(), up.Addr(), off, sb.Block(), up.Addr()))
	sealed, clear := newSiteClient(t, srv, on), newSiteClient(t, srv, off)

	plain := call{Key: newKey(), Body: payBody()}
	first := clear.Do(t, plain)
	wantExecuted(t, first, http.StatusCreated)
	sb.waitCompleted(t, plain.Key)
	if found := readable(storeRowsText(t, sb), first.Header.Get("X-Execution-Id")); len(found) == 0 {
		t.Fatalf("seal off: the response is not in the clear")
	}
	wantReplayOf(t, sealed.Do(t, plain), first)

	c := call{Key: newKey(), Body: payBody()}
	second := sealed.Do(t, c)
	wantExecuted(t, second, http.StatusCreated)
	sb.waitCompleted(t, c.Key)
	wantReplayOf(t, clear.Do(t, c), second)
	wantCount(t, up, 2)
}

// The memory store seals with seal on, and replays byte for byte.
func TestMemoryStoreSealOn(t *testing.T) {
	up := newUpstream(t)
	s := protectedSite(t, storeBackend{Name: "memory"}, up.Addr(), "seal on")
	c := call{Key: newKey(), Body: payBody(), Header: map[string]string{"X-Test-Extra": "1"}}
	first := s.Do(t, c)
	wantExecuted(t, first, http.StatusCreated)
	wantReplayOf(t, s.Do(t, c), first)
	wantCount(t, up, 1)
}

// What a sealed record is bound to: opened with anything else, it does
// not open. Sealing leaves the response it seals as it was (the replay
// cache may hold it), and seals it afresh each time.
func TestSealBindsTheRecord(t *testing.T) {
	hasher := secretHasher(bytes.Repeat([]byte("s"), 32))
	sl := &sealer{prk: hasher.seal.hash("Bearer tenant-a"), table: "postgres:public.keys", fp: [32]byte{1}, seal: true}
	rk := store.RecordKey{CredentialHash: hasher.hash("Bearer tenant-a"), Key: "k1"}
	resp := &store.Response{Status: 201, Header: http.Header{"X-A": {"1"}}, Body: []byte(`{"secret":"x"}`), Replayable: true, BodySize: 14}
	body := bytes.Clone(resp.Body)
	sealed, err := sl.sealResponse(rk, resp)
	if err != nil {
		t.Fatal(err)
	}
	again, _ := sl.sealResponse(rk, resp)
	if !bytes.Equal(resp.Body, body) || len(resp.Header) != 1 {
		t.Fatal("sealing changed the response it sealed")
	}
	if bytes.Equal(sealed.Body, again.Body) {
		t.Fatal("two sealings of one response are alike: the nonce is not fresh")
	}
	if bytes.Contains(sealed.Body, body) || sealed.Header != nil || !sealed.Sealed {
		t.Fatalf("sealed = %+v", sealed)
	}
	rec := func(r *store.Response) *store.Record { return &store.Record{Fingerprint: sl.fp, Response: r} }
	opened, err := sl.open(rk, rec(sealed))
	if err != nil || !bytes.Equal(opened.Body, body) || opened.Header.Get("X-A") != "1" || opened.Status != 201 {
		t.Fatalf("open = %+v, %v", opened, err)
	}

	otherTenant := *sl
	otherTenant.prk = hasher.seal.hash("Bearer tenant-b")
	otherTable := *sl
	otherTable.table = "postgres:public.other"
	otherKey := rk
	otherKey.Key = "k2"
	otherHash := rk
	otherHash.CredentialHash[0] ^= 1
	status := *sealed
	status.Status = 200
	unreplayable := *sealed
	unreplayable.Replayable = false
	for name, tc := range map[string]struct {
		sl  *sealer
		rk  store.RecordKey
		rec *store.Record
	}{
		"another tenant's credential": {&otherTenant, rk, rec(sealed)},
		"another table":               {&otherTable, rk, rec(sealed)},
		"another key":                 {sl, otherKey, rec(sealed)},
		"another credential hash":     {sl, otherHash, rec(sealed)},
		"another fingerprint":         {sl, rk, &store.Record{Fingerprint: [32]byte{2}, Response: sealed}},
		"another status":              {sl, rk, rec(&status)},
	} {
		if _, err := tc.sl.open(tc.rk, tc.rec); err == nil {
			t.Errorf("%s: the record opened", name)
		}
	}
	// A record marked not replayable has no body to open; one with a
	// sealed body had its flag changed in the store.
	if _, err := sl.open(rk, rec(&unreplayable)); err == nil {
		t.Error("marked not replayable, with a sealed body: opened")
	}
	unreplayable.Body = nil
	if r, err := sl.open(rk, rec(&unreplayable)); err != nil || r.Body != nil || len(r.Header) != 0 {
		t.Errorf("not replayable: %+v, %v", r, err)
	}
}

// openedBody is the body of a sealed record of sb, as a request with the
// credential cred opens it (fpHex: its fingerprint column, in hex).
func openedBody(t testing.TB, sb storeBackend, cred, key, fpHex string, status int, replayable bool, sealedBody []byte) []byte {
	t.Helper()
	hasher := secretHasher(storeSecret(t, sb))
	fp, err := hex.DecodeString(fpHex)
	if err != nil || len(fp) != 32 {
		t.Fatalf("fingerprint %q", fpHex)
	}
	sl := &sealer{prk: hasher.seal.hash(cred), table: "postgres:public." + sb.Table}
	rk := store.RecordKey{CredentialHash: hasher.hash(cred), Key: key}
	resp, err := sl.open(rk, &store.Record{Fingerprint: [32]byte(fp),
		Response: &store.Response{Status: status, Replayable: replayable, Body: sealedBody, Sealed: true}})
	if err != nil {
		t.Fatalf("opening the record of %s: %v", key, err)
	}
	return resp.Body
}

// BenchmarkSeal seals and opens responses of 1, 16 and 256 KiB, and
// reports the cost per KiB (µs/KiB) of each, and of copying the same
// bytes (copy), the least that any store of the response costs, as a
// ratio (x_copy): what sealing adds to storing a response, by size.
func BenchmarkSeal(b *testing.B) {
	hasher := secretHasher(bytes.Repeat([]byte("s"), 32))
	sl := &sealer{prk: hasher.seal.hash("Bearer sk_test_bench"), table: "postgres:public.idempotency_keys", seal: true}
	rk := store.RecordKey{CredentialHash: hasher.hash("Bearer sk_test_bench"), Key: "bench-key-0001"}
	for _, kib := range []int{1, 16, 256} {
		resp := &store.Response{Status: 201, Replayable: true, BodySize: int64(kib << 10),
			Header: http.Header{"Content-Type": {"application/json"}, "Location": {"/v1/charges/ch_1"}},
			Body:   bytes.Repeat([]byte("x"), kib<<10)}
		sealed, err := sl.sealResponse(rk, resp)
		if err != nil {
			b.Fatal(err)
		}
		rec := &store.Record{Fingerprint: sl.fp, Response: sealed}
		// Copies timed for 100ms, beside the sub-benchmarks: a nested
		// testing.Benchmark would wait for the running one.
		var copyNs float64
		{
			var dst []byte
			n, start := 0, time.Now()
			for ; time.Since(start) < 100*time.Millisecond; n++ {
				dst = append(dst[:0:0], resp.Body...)
			}
			copyNs = float64(time.Since(start).Nanoseconds()) / float64(n)
			_ = dst
		}
		report := func(b *testing.B) {
			perOp := float64(b.Elapsed().Nanoseconds()) / float64(b.N)
			b.ReportMetric(perOp/1000/float64(kib), "µs/KiB")
			b.ReportMetric(perOp/copyNs, "x_copy")
		}
		b.Run(fmt.Sprintf("seal/%dKiB", kib), func(b *testing.B) {
			b.ReportAllocs()
			for b.Loop() {
				if _, err := sl.sealResponse(rk, resp); err != nil {
					b.Fatal(err)
				}
			}
			report(b)
		})
		b.Run(fmt.Sprintf("open/%dKiB", kib), func(b *testing.B) {
			b.ReportAllocs()
			for b.Loop() {
				if _, err := sl.open(rk, rec); err != nil {
					b.Fatal(err)
				}
			}
			report(b)
		})
	}
}

// BenchmarkFirstExecutionSealed runs first executions of a 1 KiB
// response with seal off and seal on (the memory store, which keeps the
// sealed record as Postgres would, without the network), alternately in
// one run, and reports each one's ns/op and their ratio (on/off): what
// sealing adds to the handler's own cost of a first execution.
func BenchmarkFirstExecutionSealed(b *testing.B) {
	off, on := newFirstExecutionBench(b, 1<<10), newFirstExecutionBench(b, 1<<10)
	// As Provision sets them for seal on.
	on.rb.h.sealing, on.rb.h.opening = true, true
	var tOff, tOn time.Duration
	b.ReportAllocs()
	for b.Loop() {
		start := time.Now()
		off.run(b)
		mid := time.Now()
		on.run(b)
		tOn += time.Since(mid)
		tOff += mid.Sub(start)
	}
	b.ReportMetric(float64(tOff.Nanoseconds())/float64(b.N), "off_ns/op")
	b.ReportMetric(float64(tOn.Nanoseconds())/float64(b.N), "on_ns/op")
	b.ReportMetric(float64(tOn)/float64(tOff), "on/off")
}

// A record that the store cannot give (its headers' column changed into
// something that does not decode, or its replayable flag cleared over a
// sealed body) is answered 500 #record-unreadable, and never executed
// again, even under on_store_error fail_open, which executes on a store
// error: the store answered. Catches a decoding error taken for an
// outage, which executed the key on every retry under fail_open.
func TestUnreadableRecordIsNeverExecutedAgain(t *testing.T) {
	sb := postgresBackend(t)
	up := newUpstream(t)
	s := protectedSite(t, sb, up.Addr(), "replay_cache off", "on_store_error fail_open")
	table := pgtest.QuoteIdent(sb.Table)
	for name, change := range map[string]string{
		"headers NULL":         `response_header_bytes = NULL, response_headers = NULL`,
		"headers malformed":    `response_header_bytes = '\x01ffffffff'::bytea`,
		"headers of no format": `response_header_bytes = '\x03'::bytea`,
		"replayable cleared":   `replayable = false`,
	} {
		t.Run(name, func(t *testing.T) {
			c := call{Key: newKey(), Body: payBody()}
			wantExecuted(t, s.Do(t, c), http.StatusCreated)
			sb.waitCompleted(t, c.Key)
			before := up.Count()
			pgtest.Exec(t, sb.DSN, `UPDATE `+table+` SET `+change+` WHERE key = $1`, c.Key)
			for range 3 {
				if p := wantProblem(t, s.Do(t, c), http.StatusInternalServerError); !strings.HasSuffix(p.Type, "#record-unreadable") {
					t.Fatalf("problem type %q", p.Type)
				}
			}
			if n := up.Count(); n != before {
				t.Fatalf("the key executed %d more times", n-before)
			}
		})
	}
}

// A record's key is HKDF-SHA256's Expand of the sealer's PRK with the
// info sealKeyInfo || Idempotency-Key, as records sealed since v0.2.0
// were: recordKey computes it by HMAC's definition, which a slip in a pad
// or in the info's order would make another key, and every sealed record
// unreadable. Keys of every length a request may bring, the pooled
// buffer's limit either side.
func TestRecordKeyIsHKDF(t *testing.T) {
	for _, n := range []int{0, 1, 31, 32, 64, 255, 4 << 10, 5 << 10} {
		for range 20 {
			var sl sealer
			rand.Read(sl.prk[:])
			key := strings.Repeat("k", n)
			if n > 0 {
				key = rand.Text()[:1] + key[1:]
			}
			want, err := hkdf.Expand(sha256.New, sl.prk[:], sealKeyInfo+key, 32)
			if err != nil {
				t.Fatal(err)
			}
			var got [32]byte
			sl.recordKey(&got, key)
			if !bytes.Equal(got[:], want) {
				t.Fatalf("key of %d bytes: recordKey %x, HKDF %x", n, got, want)
			}
		}
	}
}
