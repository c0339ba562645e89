package zero

import (
	"bytes"
	"errors"
	"fmt"
	"math/rand"
	"net"
	"strings"
	"sync"
	"testing"
	"time"
)

// freeLoopbackPort returns a TCP port on 127.0.0.1 that was free a moment ago.
func freeLoopbackPort(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	ln.Close()
	return addr
}

// TestBootstrapExchange: rank 0 serves the id to N−1 clients; the clients
// start before rank 0 listens and retry until it does.
func TestBootstrapExchange(t *testing.T) {
	for _, world := range []int{2, 4, 9} {
		addr := freeLoopbackPort(t)
		payload := make([]byte, 128)
		rand.New(rand.NewSource(int64(world))).Read(payload)
		got := make([][]byte, world)
		errs := make([]error, world)
		var wg sync.WaitGroup
		for r := 1; r < world; r++ {
			wg.Add(1)
			go func() {
				defer wg.Done()
				got[r], errs[r] = fetchBootstrap(addr, r, world, 10*time.Second)
			}()
		}
		time.Sleep(100 * time.Millisecond) // the clients are already retrying
		ln, err := listenBootstrap(addr)
		if err != nil {
			t.Fatal(err)
		}
		if err := serveBootstrap(ln, world, payload, 10*time.Second); err != nil {
			t.Fatalf("world %d: serve: %v", world, err)
		}
		wg.Wait()
		for r := 1; r < world; r++ {
			if errs[r] != nil {
				t.Fatalf("world %d rank %d: %v", world, r, errs[r])
			}
			if !bytes.Equal(got[r], payload) {
				t.Fatalf("world %d rank %d got a different id", world, r)
			}
		}
	}
}

func TestBootstrapWorldOne(t *testing.T) {
	ln, err := listenBootstrap("127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	if err := serveBootstrap(ln, 1, []byte("id"), time.Second); err != nil {
		t.Fatalf("world 1 serves nobody and returns at once: %v", err)
	}
}

// TestBootstrapServerTimeout: a rank that never comes makes rank 0 fail with
// ErrTimeout naming it, within the timeout.
func TestBootstrapServerTimeout(t *testing.T) {
	ln, err := listenBootstrap("127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	done := make(chan error, 1)
	go func() { _, err := fetchBootstrap(addr, 1, 3, 5*time.Second); done <- err }()
	start := time.Now()
	err = serveBootstrap(ln, 3, []byte("id"), 400*time.Millisecond)
	if !errors.Is(err, ErrTimeout) || !strings.Contains(err.Error(), "ranks 2 ") {
		t.Fatalf("serve with rank 2 missing: %v; want ErrTimeout naming rank 2", err)
	}
	if d := time.Since(start); d > 3*time.Second {
		t.Fatalf("serve took %v with a 400ms timeout", d)
	}
	if err := <-done; err != nil {
		t.Fatalf("rank 1 came in time and should have its id: %v", err)
	}
}

// TestBootstrapClientTimeout: nobody listens; the client gives up at its
// deadline with ErrTimeout.
func TestBootstrapClientTimeout(t *testing.T) {
	addr := freeLoopbackPort(t)
	start := time.Now()
	_, err := fetchBootstrap(addr, 1, 2, 300*time.Millisecond)
	if !errors.Is(err, ErrTimeout) || !strings.Contains(err.Error(), addr) {
		t.Fatalf("fetch from nobody: %v; want ErrTimeout naming %s", err, addr)
	}
	if d := time.Since(start); d > 3*time.Second {
		t.Fatalf("fetch took %v with a 300ms timeout", d)
	}
}

// TestBootstrapRejects: a client of another world size, a duplicate rank and
// a stranger are refused without disturbing the exchange.
func TestBootstrapRejects(t *testing.T) {
	ln, err := listenBootstrap("127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	served := make(chan error, 1)
	go func() { served <- serveBootstrap(ln, 3, []byte("the-id"), 10*time.Second) }()

	if _, err := fetchBootstrap(addr, 1, 4, 5*time.Second); !errors.Is(err, ErrConfig) || !strings.Contains(err.Error(), "WORLD_SIZE") {
		t.Fatalf("world 4 asking a world-3 rank 0: %v; want ErrConfig about WORLD_SIZE", err)
	}
	if _, err := fetchBootstrap(addr, 3, 3, 5*time.Second); !errors.Is(err, ErrConfig) {
		t.Fatalf("rank 3 of world 3: %v; want ErrConfig", err)
	}
	// a stranger that sends garbage and hangs up
	if c, err := net.Dial("tcp", addr); err == nil {
		c.Write([]byte("GET / HTTP/1.0\r\n\r\n"))
		c.Close()
	}
	if id, err := fetchBootstrap(addr, 1, 3, 5*time.Second); err != nil || string(id) != "the-id" {
		t.Fatalf("rank 1: %q, %v", id, err)
	}
	if _, err := fetchBootstrap(addr, 1, 3, 5*time.Second); !errors.Is(err, ErrConfig) || !strings.Contains(err.Error(), "RANK=1") {
		t.Fatalf("a second rank 1: %v; want ErrConfig naming RANK=1", err)
	}
	if id, err := fetchBootstrap(addr, 2, 3, 5*time.Second); err != nil || string(id) != "the-id" {
		t.Fatalf("rank 2: %q, %v", id, err)
	}
	if err := <-served; err != nil {
		t.Fatalf("serve: %v", err)
	}
}

func TestBootstrapPortBusy(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	if _, err := listenBootstrap(ln.Addr().String()); !errors.Is(err, ErrConfig) || !strings.Contains(err.Error(), "MASTER_PORT") {
		t.Fatalf("listen on a busy port: %v; want ErrConfig naming MASTER_PORT", err)
	}
}

func TestNCCLConfigFromEnv(t *testing.T) {
	base := map[string]string{"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "MASTER_ADDR": "10.0.0.7", "MASTER_PORT": "29500"}
	with := func(kv ...string) func(string) string {
		m := map[string]string{}
		for k, v := range base {
			m[k] = v
		}
		for i := 0; i < len(kv); i += 2 {
			if kv[i+1] == "<unset>" {
				delete(m, kv[i])
			} else {
				m[kv[i]] = kv[i+1]
			}
		}
		return func(k string) string { return m[k] }
	}
	c, err := ncclConfigFrom(with())
	if err != nil {
		t.Fatal(err)
	}
	if c.Rank != 1 || c.World != 4 || c.LocalRank != 1 || c.MasterAddr != "10.0.0.7" || c.MasterPort != 29500 {
		t.Fatalf("parsed %+v", c)
	}
	if c, _ := ncclConfigFrom(with("TORCHELASTIC_USE_AGENT_STORE", "True")); c.MasterPort != 29501 {
		t.Fatalf("under torchrun's agent store the bootstrap port is MASTER_PORT+1, got %d", c.MasterPort)
	}
	if c, _ := ncclConfigFrom(with("TORCHELASTIC_USE_AGENT_STORE", "True", "ZERO_BOOTSTRAP_PORT", "40000")); c.MasterPort != 40000 {
		t.Fatalf("ZERO_BOOTSTRAP_PORT overrides, got %d", c.MasterPort)
	}
	if c, err := ncclConfigFrom(with("WORLD_SIZE", "1", "RANK", "0", "MASTER_ADDR", "<unset>", "MASTER_PORT", "<unset>")); err != nil || c.MasterAddr == "" {
		t.Fatalf("world 1 needs no master: %+v, %v", c, err)
	}
	for _, tc := range []struct {
		env  []string
		name string
	}{
		{[]string{"RANK", "<unset>"}, "RANK"},
		{[]string{"WORLD_SIZE", "<unset>"}, "WORLD_SIZE"},
		{[]string{"LOCAL_RANK", "<unset>"}, "LOCAL_RANK"},
		{[]string{"MASTER_ADDR", "<unset>"}, "MASTER_ADDR"},
		{[]string{"MASTER_PORT", "<unset>"}, "MASTER_PORT"},
		{[]string{"RANK", "x"}, "RANK"},
		{[]string{"RANK", "4"}, "RANK"},
		{[]string{"RANK", "-1"}, "RANK"},
		{[]string{"WORLD_SIZE", "0"}, "WORLD_SIZE"},
		{[]string{"WORLD_SIZE", "four"}, "WORLD_SIZE"},
		{[]string{"LOCAL_RANK", "-2"}, "LOCAL_RANK"},
		{[]string{"MASTER_PORT", "70000"}, "MASTER_PORT"},
		{[]string{"MASTER_PORT", "http"}, "MASTER_PORT"},
		{[]string{"ZERO_BOOTSTRAP_PORT", "0"}, "ZERO_BOOTSTRAP_PORT"},
	} {
		_, err := ncclConfigFrom(with(tc.env...))
		if !errors.Is(err, ErrConfig) || !strings.Contains(err.Error(), tc.name) {
			t.Errorf("env %v: %v; want ErrConfig naming %s", tc.env, err, tc.name)
		}
	}
}

func TestNCCLConfigCheck(t *testing.T) {
	for _, c := range []NCCLConfig{
		{World: 0},
		{World: 2, Rank: 2, MasterAddr: "h", MasterPort: 1},
		{World: 2, Rank: 0, MasterPort: 1},
		{World: 2, Rank: 0, MasterAddr: "h"},
		{World: 1, LocalRank: -1},
		{World: 1, Timeout: -time.Second},
	} {
		if err := c.check(); !errors.Is(err, ErrConfig) {
			t.Errorf("%+v: %v; want ErrConfig", c, err)
		}
	}
	c := NCCLConfig{World: 1}
	if err := c.check(); err != nil || c.Timeout != DefaultTimeout || c.BootstrapTimeout <= 0 {
		t.Fatalf("defaults: %+v, %v", c, err)
	}
}

// fakeRelayComm stands for a rank's communicator on the abort relay: it
// records the peer aborts it hears.
type fakeRelayComm struct {
	heard chan string
}

// TestAbortRelay: over the bootstrap's connections, kept open after the id
// exchange, an abort by any rank (rank 0 or another) reaches every other
// rank within a second, once, naming who aborted and why; closing the
// connections at the end of a run is no abort.
func TestAbortRelay(t *testing.T) {
	const world = 4
	for _, aborter := range []int{0, 2} {
		addr := freeLoopbackPort(t)
		conns := make([][]net.Conn, world)
		errs := make([]error, world)
		var wg sync.WaitGroup
		for r := 1; r < world; r++ {
			wg.Add(1)
			go func() {
				defer wg.Done()
				var c net.Conn
				_, c, errs[r] = fetchBootstrapKeep(addr, r, world, 10*time.Second)
				conns[r] = []net.Conn{c}
			}()
		}
		ln, err := listenBootstrap(addr)
		if err != nil {
			t.Fatal(err)
		}
		if conns[0], err = serveBootstrapKeep(ln, world, []byte("id"), 10*time.Second); err != nil {
			t.Fatal(err)
		}
		wg.Wait()
		for _, err := range errs {
			if err != nil {
				t.Fatal(err)
			}
		}
		fakes := make([]fakeRelayComm, world)
		relays := make([]*abortRelay, world)
		for r := range world {
			fakes[r] = fakeRelayComm{heard: make(chan string, world)}
			relays[r] = newAbortRelay(r, conns[r], func(from int, reason string) {
				fakes[r].heard <- fmt.Sprintf("rank %d: %s", from, reason)
			})
		}
		start := time.Now()
		relays[aborter].abort("out of patience")
		want := fmt.Sprintf("rank %d: out of patience", aborter)
		for r := range world {
			if r == aborter {
				continue
			}
			select {
			case got := <-fakes[r].heard:
				if got != want {
					t.Errorf("aborter %d: rank %d heard %q, want %q", aborter, r, got, want)
				}
			case <-time.After(time.Second):
				t.Fatalf("aborter %d: rank %d heard nothing within a second", aborter, r)
			}
		}
		t.Logf("aborter %d: every rank heard within %v", aborter, time.Since(start))
		for _, r := range relays {
			r.close()
		}
		for r := range world {
			select {
			case got := <-fakes[r].heard:
				t.Errorf("aborter %d: rank %d heard %q more", aborter, r, got)
			default:
			}
		}
	}
}
