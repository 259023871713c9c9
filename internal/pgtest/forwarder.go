package pgtest

import (
	"io"
	"net"
	"sync"
	"sync/atomic"
	"testing"
)

// Forwarder relays TCP connections from a loopback port to a target,
// and can be cut: the network between Caddy and Postgres failing, which
// no setting of either can simulate. Cut, it resets every open connection
// and every new one, as a dead link or a firewall that rejects does.
// Muted, it loses what the target sends, as a host gone silent does: the
// statements in flight get no reply, and no error either.
type Forwarder struct {
	ln     net.Listener
	target string

	muted atomic.Bool

	mu    sync.Mutex
	cut   bool
	conns map[net.Conn]struct{}
	wg    sync.WaitGroup
}

// NewForwarder listens on a free port of 127.0.0.1 and relays to
// target until the test ends.
func NewForwarder(t testing.TB, target string) *Forwarder {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	f := &Forwarder{ln: ln, target: target, conns: make(map[net.Conn]struct{})}
	f.wg.Add(1)
	go f.accept()
	t.Cleanup(func() {
		ln.Close()
		f.Cut()
		f.wg.Wait()
	})
	return f
}

// Addr is the host:port to connect to instead of target.
func (f *Forwarder) Addr() string { return f.ln.Addr().String() }

// Cut resets every relayed connection and refuses new ones until Restore.
func (f *Forwarder) Cut() {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.cut = true
	for c := range f.conns {
		reset(c)
	}
}

// Mute drops what the target sends, on every connection, until Unmute.
func (f *Forwarder) Mute() { f.muted.Store(true) }

// Unmute relays what the target sends again. What was dropped meanwhile
// is lost.
func (f *Forwarder) Unmute() { f.muted.Store(false) }

// Restore relays new connections again.
func (f *Forwarder) Restore() {
	f.mu.Lock()
	f.cut = false
	f.mu.Unlock()
}

// reset closes c with a TCP RST rather than a FIN, so that the peer sees
// an error, not an orderly end of stream.
func reset(c net.Conn) {
	if tc, ok := c.(*net.TCPConn); ok {
		_ = tc.SetLinger(0)
	}
	_ = c.Close()
}

func (f *Forwarder) accept() {
	defer f.wg.Done()
	for {
		c, err := f.ln.Accept()
		if err != nil {
			return
		}
		f.mu.Lock()
		if f.cut {
			f.mu.Unlock()
			reset(c)
			continue
		}
		f.wg.Add(1)
		f.mu.Unlock()
		go f.relay(c)
	}
}

func (f *Forwarder) relay(client net.Conn) {
	defer f.wg.Done()
	server, err := net.Dial("tcp", f.target)
	if err != nil {
		reset(client)
		return
	}
	if !f.track(client, server) {
		return
	}
	defer f.untrack(client, server)
	done := make(chan struct{}, 2)
	pipe := func(dst, src net.Conn, from io.Reader) {
		_, _ = io.Copy(dst, from)
		// Either side ending ends both: a half-open relay would hide a
		// dead peer from the other.
		reset(dst)
		reset(src)
		done <- struct{}{}
	}
	go pipe(server, client, client)
	go pipe(client, server, mutedReader{server, &f.muted})
	<-done
	<-done
}

// track registers a relayed pair, unless the forwarder was cut meanwhile.
func (f *Forwarder) track(conns ...net.Conn) bool {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.cut {
		for _, c := range conns {
			reset(c)
		}
		return false
	}
	for _, c := range conns {
		f.conns[c] = struct{}{}
	}
	return true
}

func (f *Forwarder) untrack(conns ...net.Conn) {
	f.mu.Lock()
	defer f.mu.Unlock()
	for _, c := range conns {
		delete(f.conns, c)
	}
}

// mutedReader reads from r, and drops what it reads while muted is set.
type mutedReader struct {
	r     io.Reader
	muted *atomic.Bool
}

func (m mutedReader) Read(p []byte) (int, error) {
	for {
		n, err := m.r.Read(p)
		if n > 0 && m.muted.Load() {
			if err != nil {
				return 0, err
			}
			continue
		}
		return n, err
	}
}
