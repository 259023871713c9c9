package idempotency

// Sealed records: a completed response kept encrypted at rest, under a
// key that only a request with the caller's credential derives. Whoever
// holds the database, its backups and its _secret table, but not the
// caller's credential, reads no response; a record copied under another
// key or tenant, or with its columns changed, does not open.
//
// A record's key is HKDF-SHA256 (RFC 5869): extracted from the raw
// credential (or the route's scope) with a salt that the credential
// secret keys, then expanded with the record's Idempotency-Key. The
// stored credential_hash is an HMAC of the credential under the secret
// itself, a key that no step of this derivation uses, so it gives no
// way to the record's key. The raw credential is read, extracted and
// dropped in step 2 (identifyCaller), as it is hashed there.
//
// The handler seals (it alone holds the credential) below its replay
// cache, which holds opened responses: sealingStore, in the chain that
// wrapStore builds, seals what Complete stores and opens what Acquire
// finds, with the request's sealer, which the request's store calls
// carry in their context.

import (
	"context"
	"crypto/aes"
	"crypto/cipher"
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"encoding/binary"
	"fmt"
	"hash"
	"strings"
	"sync"
	"time"

	"github.com/caddy-idempotency/idempotency/store"
	"go.uber.org/zap"
)

// The labels that keep the derivation's keys apart from every other use
// of the secret and of the credential.
const (
	// sealSaltLabel, under the credential secret, is HKDF's salt.
	sealSaltLabel = "caddy-idempotency seal salt v1"
	// sealKeyInfo, followed by the Idempotency-Key, is HKDF's info.
	sealKeyInfo = "caddy-idempotency record key v1\x00"
	// sealADLabel starts the associated data of every sealed record.
	sealADLabel = "caddy-idempotency sealed record v1\x00"
)

// sealFormat is the first byte of a sealed body: the format of what
// follows, the nonce then AES-256-GCM's ciphertext and tag.
const sealFormat = 0x01

const (
	sealNonceSize = 12 // GCM's standard nonce: random per sealing
	sealTagSize   = 16
	sealOverhead  = 1 + sealNonceSize + sealTagSize
)

// errRecordUnreadable is the error of an Acquire that found a sealed
// record its request cannot open: sealed under another credential, or
// changed or moved since it was sealed.
var errRecordUnreadable = fmt.Errorf("%w: it does not open with this request's credential", store.ErrRecordUnreadable)

// sealSalt is HKDF's salt for a credential secret.
func sealSalt(secret []byte) []byte {
	m := hmac.New(sha256.New, secret)
	m.Write([]byte(sealSaltLabel))
	return m.Sum(nil)
}

// sealer seals and opens the record of one request.
type sealer struct {
	// prk is HKDF's pseudorandom key, extracted from the caller's raw
	// credential (or the route's scope) under the seal salt.
	prk [32]byte
	// table is the records' canonical name (sealTable), fp the
	// request's fingerprint: both are bound to what it seals.
	table string
	fp    [32]byte
	// seal: Complete seals the response. Without it, the sealer only
	// opens (seal off, in front of a shared store).
	seal bool
}

// aead returns the AEAD of the record of key.
func (s *sealer) aead(key string) (cipher.AEAD, error) {
	var k [32]byte
	s.recordKey(&k, key)
	block, err := aes.NewCipher(k[:])
	if err != nil {
		return nil, err
	}
	return cipher.NewGCM(block)
}

// expandState is what recordKey works with: a SHA-256 and buffers,
// pooled, so that deriving a record's key allocates nothing.
type expandState struct {
	h   hash.Hash
	buf []byte
	sum [sha256.Size]byte
}

var expandStates = sync.Pool{New: func() any { return &expandState{h: sha256.New()} }}

// recordKey sets k to the key of the record of key: HKDF-SHA256's Expand
// of the sealer's PRK, with the info sealKeyInfo || key, to 32 bytes.
// That is its first block, T(1) = HMAC-SHA256(PRK, info || 0x01), which
// this computes from HMAC's definition (RFC 2104) on a pooled SHA-256:
// crypto/hkdf builds an HMAC, two hashes and their pads for each record,
// some 3 µs of a first execution's 10 µs of sealing. TestRecordKeyIsHKDF
// holds the two equal.
func (s *sealer) recordKey(k *[32]byte, key string) {
	st := expandStates.Get().(*expandState)
	// The PRK, shorter than a block, is the HMAC key padded with zeros.
	buf := st.buf[:0]
	for i := range sha256.BlockSize {
		b := byte(0x36)
		if i < len(s.prk) {
			b ^= s.prk[i]
		}
		buf = append(buf, b)
	}
	buf = append(append(append(buf, sealKeyInfo...), key...), 1)
	st.h.Reset()
	st.h.Write(buf)
	inner := st.h.Sum(st.sum[:0])
	buf = buf[:sha256.BlockSize]
	for i := range buf {
		buf[i] ^= 0x36 ^ 0x5c
	}
	buf = append(buf, inner...)
	st.h.Reset()
	st.h.Write(buf)
	*k = [32]byte(st.h.Sum(st.sum[:0]))
	st.buf = buf
	if cap(buf) <= 4<<10 {
		// A rare huge key's buffer is not kept.
		expandStates.Put(st)
	}
}

// sealAD is the associated data of a sealed record: what the record is
// bound to. Expiry and lock columns change and are left out; each
// variable part is prefixed by its length, so that no two records' data
// run together alike.
func sealAD(table string, rk store.RecordKey, fp [32]byte, status int, replayable bool) []byte {
	ad := make([]byte, 0, len(sealADLabel)+1+2*binary.MaxVarintLen64+len(table)+len(rk.Key)+64+binary.MaxVarintLen64+1)
	ad = append(ad, sealADLabel...)
	ad = append(ad, sealFormat)
	ad = binary.AppendUvarint(ad, uint64(len(table)))
	ad = append(ad, table...)
	ad = append(ad, rk.CredentialHash[:]...)
	ad = binary.AppendUvarint(ad, uint64(len(rk.Key)))
	ad = append(ad, rk.Key...)
	ad = append(ad, fp[:]...)
	ad = binary.AppendUvarint(ad, uint64(status))
	if replayable {
		ad = append(ad, 1)
	} else {
		ad = append(ad, 0)
	}
	return ad
}

// sealResponse returns resp sealed for the record of rk: a new Response,
// so that resp (the recorder's buffer, which the replay cache may hold)
// is never written over. A response that is not replayable keeps no body
// and no headers, which are never replayed.
func (s *sealer) sealResponse(rk store.RecordKey, resp *store.Response) (*store.Response, error) {
	sealed := &store.Response{Status: resp.Status, Replayable: resp.Replayable, BodySize: resp.BodySize, Sealed: true}
	if !resp.Replayable {
		return sealed, nil
	}
	aead, err := s.aead(rk.Key)
	if err != nil {
		return nil, err
	}
	// The plain text is laid out where its ciphertext goes, after the
	// format byte and the nonce, and sealed in place: one buffer the
	// size of the response, not two.
	headers := store.EncodeHeaders(resp.Header)
	var n [binary.MaxVarintLen64]byte
	ln := binary.PutUvarint(n[:], uint64(len(headers)))
	const head = 1 + sealNonceSize
	blob := make([]byte, head+ln+len(headers)+len(resp.Body), head+ln+len(headers)+len(resp.Body)+sealTagSize)
	blob[0] = sealFormat
	nonce := blob[1:head]
	_, _ = rand.Read(nonce) // crypto/rand.Read never returns an error
	plain := blob[head:]
	plain = plain[copy(plain, n[:ln]):]
	plain = plain[copy(plain, headers):]
	copy(plain, resp.Body)
	sealed.Body = aead.Seal(blob[:head], nonce, blob[head:], sealAD(s.table, rk, s.fp, resp.Status, resp.Replayable))
	return sealed, nil
}

// open returns the response of rec, sealed for the record of rk, opened.
// Its fingerprint is the record's own: a retry opens the record of the
// request it repeats, and is told afterwards whether it is the same.
func (s *sealer) open(rk store.RecordKey, rec *store.Record) (*store.Response, error) {
	sealed := rec.Response
	resp := &store.Response{Status: sealed.Status, Replayable: sealed.Replayable, BodySize: sealed.BodySize}
	if !sealed.Replayable {
		// Sealed without a body: one that has a body was sealed
		// replayable, and its flag changed in the store.
		if len(sealed.Body) > 0 {
			return nil, fmt.Errorf("%w: marked not replayable, with a sealed body", errRecordUnreadable)
		}
		resp.Header = map[string][]string{}
		return resp, nil
	}
	blob := sealed.Body
	if len(blob) < sealOverhead || blob[0] != sealFormat {
		return nil, fmt.Errorf("%w: not a sealed body of a known format", errRecordUnreadable)
	}
	aead, err := s.aead(rk.Key)
	if err != nil {
		return nil, err
	}
	plain, err := aead.Open(nil, blob[1:1+sealNonceSize], blob[1+sealNonceSize:],
		sealAD(s.table, rk, rec.Fingerprint, sealed.Status, sealed.Replayable))
	if err != nil {
		return nil, errRecordUnreadable
	}
	n, w := binary.Uvarint(plain)
	if w <= 0 || n > uint64(len(plain)-w) {
		return nil, fmt.Errorf("%w: malformed sealed headers", errRecordUnreadable)
	}
	if resp.Header, err = store.DecodeHeaders(plain[w : w+int(n)]); err != nil {
		return nil, fmt.Errorf("%w: %w", errRecordUnreadable, err)
	}
	// The body's capacity ends at its end: an append reallocates.
	resp.Body = plain[w+int(n) : len(plain) : len(plain)]
	return resp, nil
}

// unreadable answers q, whose record is sealed and does not open with its
// credential (err says why): never executed again, since the request may
// have run, and logged as an error, since a record that does not open
// was sealed under another secret or changed in the store.
func (h *Handler) unreadable(q *request, err error) error {
	h.logger.Error("idempotency.record_unreadable", q.fields(zap.Error(err))...)
	return h.answer(q, verdict{result: resultUnreadable, prob: probRecordUnreadable})
}

// sealTable is the canonical name of the records that st holds, bound
// to what is sealed in them: "postgres:public.idempotency_keys" for the
// table idempotency_keys, named with its schema or without.
func sealTable(st store.Store) string {
	named, ok := store.As[store.Named](st)
	if !ok {
		return ""
	}
	_, backend, table, _ := named.StoreName()
	if table != "" && !strings.Contains(table, ".") && backend == "postgres" {
		table = "public." + table
	}
	return backend + ":" + table
}

// sealerKey is the context key of a request's sealer.
type sealerKey struct{}

// withSealer returns ctx carrying s for the store calls made under it.
func withSealer(ctx context.Context, s *sealer) context.Context {
	if s == nil {
		return ctx
	}
	return context.WithValue(ctx, sealerKey{}, s)
}

// sealingStore seals the responses that Complete stores and opens the
// sealed records that Acquire finds, with the sealer of the call's
// context. A sealed record without a sealer to open it is unreadable:
// it is never replayed as its sealed bytes.
type sealingStore struct{ store.Store }

func (s sealingStore) Unwrap() store.Store { return s.Store }

func (s sealingStore) Acquire(ctx context.Context, req store.AcquireRequest) (store.AcquireResult, error) {
	res, err := s.Store.Acquire(ctx, req)
	if err != nil || res.Record == nil || res.Record.Response == nil || !res.Record.Response.Sealed {
		return res, err
	}
	sl, _ := ctx.Value(sealerKey{}).(*sealer)
	if sl == nil {
		return store.AcquireResult{}, fmt.Errorf("%w: this handler does not open sealed records", errRecordUnreadable)
	}
	resp, err := sl.open(req.Key, res.Record)
	if err != nil {
		return store.AcquireResult{}, err
	}
	rec := *res.Record
	rec.Response = resp
	res.Record = &rec
	return res, nil
}

func (s sealingStore) Complete(ctx context.Context, key store.RecordKey, token store.LockToken, resp *store.Response, retention time.Duration) error {
	if sl, _ := ctx.Value(sealerKey{}).(*sealer); sl != nil && sl.seal {
		sealed, err := sl.sealResponse(key, resp)
		if err != nil {
			return err
		}
		resp = sealed
	}
	return s.Store.Complete(ctx, key, token, resp, retention)
}
