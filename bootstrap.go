package zero

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"strconv"
	"strings"
	"sync"
	"time"
)

// NCCLConfig says how to start one rank of an NCCL communicator (NewNCCL):
// which rank of how many, where rank 0 serves the NCCL unique id, and the
// timeouts. NCCLConfigFromEnv fills it from torchrun's environment.
type NCCLConfig struct {
	Rank      int // this process's rank in [0, World)
	World     int // number of ranks (processes, one GPU each)
	LocalRank int // the CUDA device ordinal on this host (torchrun's LOCAL_RANK)
	// MasterAddr and MasterPort are where rank 0 serves the NCCL unique id
	// to the other ranks over TCP. Unused with World 1.
	MasterAddr string
	MasterPort int // see MasterAddr
	// Device overrides the device (default: CUDA(LocalRank)).
	Device Device
	// BootstrapTimeout bounds the id exchange and ncclCommInitRank
	// (default 5 minutes).
	BootstrapTimeout time.Duration
	// Timeout bounds each collective batch: the watchdog aborts the
	// communicator when a batch has not completed this long after it was
	// enqueued (default DefaultTimeout). The clock starts at the enqueue, so
	// it must also cover the work queued before the batch on its stream
	// (without Overlap, the framework's backward kernels).
	Timeout time.Duration
	// Library is the NCCL shared library to dlopen (default: $ZERO_NCCL_LIBRARY,
	// else "libnccl.so.2" from the loader's search path).
	Library string
}

// NCCLConfigFromEnv reads torchrun's environment: RANK, WORLD_SIZE,
// LOCAL_RANK, MASTER_ADDR and MASTER_PORT (the last two may be absent when
// WORLD_SIZE is 1).
//
// The bootstrap port: torchrun's agent may already hold MASTER_PORT with its
// own TCP store (it says so with TORCHELASTIC_USE_AGENT_STORE=True); then
// the id is served on MASTER_PORT+1. ZERO_BOOTSTRAP_PORT overrides both.
func NCCLConfigFromEnv() (NCCLConfig, error) {
	return ncclConfigFrom(os.Getenv)
}

func ncclConfigFrom(getenv func(string) string) (NCCLConfig, error) {
	var c NCCLConfig
	num := func(name string, lo, hi int, required bool) (int, error) {
		v := strings.TrimSpace(getenv(name))
		if v == "" {
			if required {
				return 0, errorf(ErrConfig, "%s is not set; launch with torchrun, or set RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT", name)
			}
			return lo, nil
		}
		n, err := strconv.Atoi(v)
		if err != nil {
			return 0, errorf(ErrConfig, "%s=%q is not an integer", name, v)
		}
		if n < lo || n > hi {
			return 0, errorf(ErrConfig, "%s=%d is out of range; it must be in [%d, %d]", name, n, lo, hi)
		}
		return n, nil
	}
	var err error
	if c.World, err = num("WORLD_SIZE", 1, 1<<20, true); err != nil {
		return c, err
	}
	if c.Rank, err = num("RANK", 0, c.World-1, true); err != nil {
		return c, err
	}
	if c.LocalRank, err = num("LOCAL_RANK", 0, 1<<16, true); err != nil {
		return c, err
	}
	multi := c.World > 1
	c.MasterAddr = strings.TrimSpace(getenv("MASTER_ADDR"))
	if c.MasterAddr == "" {
		if multi {
			return c, errorf(ErrConfig, "MASTER_ADDR is not set; it names the host of rank 0 (WORLD_SIZE=%d)", c.World)
		}
		c.MasterAddr = "127.0.0.1"
	}
	if c.MasterPort, err = num("MASTER_PORT", 1, 65535, multi); err != nil {
		return c, err
	}
	if strings.EqualFold(strings.TrimSpace(getenv("TORCHELASTIC_USE_AGENT_STORE")), "true") {
		if c.MasterPort == 65535 {
			return c, errorf(ErrConfig, "MASTER_PORT=65535 is held by torchrun's store and MASTER_PORT+1 does not exist; set ZERO_BOOTSTRAP_PORT")
		}
		c.MasterPort++
	}
	if p := strings.TrimSpace(getenv("ZERO_BOOTSTRAP_PORT")); p != "" {
		if c.MasterPort, err = num("ZERO_BOOTSTRAP_PORT", 1, 65535, true); err != nil {
			return c, err
		}
	}
	c.Library = strings.TrimSpace(getenv("ZERO_NCCL_LIBRARY"))
	return c, nil
}

// check validates a config and fills in the defaults.
func (c *NCCLConfig) check() error {
	if c.World < 1 {
		return errorf(ErrConfig, "NCCLConfig.World %d; the world size must be at least 1", c.World)
	}
	if c.Rank < 0 || c.Rank >= c.World {
		return errorf(ErrConfig, "NCCLConfig.Rank %d; use a rank in [0, %d)", c.Rank, c.World)
	}
	if c.LocalRank < 0 {
		return errorf(ErrConfig, "NCCLConfig.LocalRank %d; use the device ordinal (≥ 0)", c.LocalRank)
	}
	if c.World > 1 {
		if c.MasterAddr == "" {
			return errorf(ErrConfig, "NCCLConfig.MasterAddr is empty; set the host of rank 0")
		}
		if c.MasterPort < 1 || c.MasterPort > 65535 {
			return errorf(ErrConfig, "NCCLConfig.MasterPort %d; use a TCP port in [1, 65535]", c.MasterPort)
		}
	}
	if c.BootstrapTimeout < 0 || c.Timeout < 0 {
		return errorf(ErrConfig, "NCCLConfig timeouts must not be negative")
	}
	if c.BootstrapTimeout == 0 {
		c.BootstrapTimeout = 5 * time.Minute
	}
	if c.Timeout == 0 {
		c.Timeout = DefaultTimeout
	}
	if c.Library == "" {
		c.Library = os.Getenv("ZERO_NCCL_LIBRARY")
	}
	return nil
}

// ---- the unique-id exchange ----------------------------------------------
//
// Rank 0 listens on MasterPort and serves a payload (the 128-byte
// ncclUniqueId) to the World−1 other ranks. A client sends
//	magic[8] "ZEROBOOT" | version u32 | rank u32 | world u32
// and gets
//	status u8 | length u32 | payload (status 0), or a message (status ≠ 0).
// Clients retry until the deadline, so the ranks may start in any order.

const (
	bootMagic   = "ZEROBOOT"
	bootVersion = 1
	bootOK      = 0
	bootBad     = 1 // wrong world size or rank: the client is from another job or misconfigured
	bootDup     = 2 // this rank was already served: two processes claim one rank
	maxBootBody = 1 << 16
)

// listenBootstrap opens rank 0's listener. addr "host:port"; an empty host
// listens on every interface.
func listenBootstrap(addr string) (net.Listener, error) {
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, errorf(ErrConfig, "rank 0 cannot listen on %s for the NCCL bootstrap: %v; free the port or set ZERO_BOOTSTRAP_PORT / MASTER_PORT", addr, err)
	}
	return ln, nil
}

// serveBootstrap serves payload to ranks 1..world-1 through ln, then closes
// ln. It returns when every rank got the payload, or ErrTimeout naming the
// ranks that did not come before the deadline.
func serveBootstrap(ln net.Listener, world int, payload []byte, timeout time.Duration) error {
	conns, err := serveBootstrapKeep(ln, world, payload, timeout)
	closeAll(conns)
	return err
}

// serveBootstrapKeep is serveBootstrap that keeps the connection to every
// rank it served open (index: the rank; nil for rank 0), for the abort
// relay.
func serveBootstrapKeep(ln net.Listener, world int, payload []byte, timeout time.Duration) ([]net.Conn, error) {
	defer ln.Close()
	deadline := time.Now().Add(timeout)
	served := make([]bool, world)
	conns := make([]net.Conn, world)
	left := world - 1
	if tl, ok := ln.(*net.TCPListener); ok {
		_ = tl.SetDeadline(deadline)
	}
	for left > 0 {
		conn, err := ln.Accept()
		if err != nil {
			var ne net.Error
			if (errors.As(err, &ne) && ne.Timeout()) || time.Now().After(deadline) {
				closeAll(conns)
				return nil, errorf(ErrTimeout, "rank 0 waited %v for ranks %s to fetch the NCCL id from %s; start every rank with the same MASTER_ADDR, MASTER_PORT and WORLD_SIZE", timeout, missingRanks(served), ln.Addr())
			}
			if errors.Is(err, net.ErrClosed) {
				closeAll(conns)
				return nil, errorf(ErrConfig, "rank 0: the bootstrap listener was closed: %v", err)
			}
			time.Sleep(10 * time.Millisecond) // a transient accept error (e.g. out of descriptors)
			continue
		}
		rank, ok := serveOne(conn, world, payload, served, deadline)
		if !ok {
			conn.Close()
			continue
		}
		_ = conn.SetDeadline(time.Time{})
		served[rank], conns[rank] = true, conn
		left--
	}
	return conns, nil
}

func closeAll(conns []net.Conn) {
	for _, c := range conns {
		if c != nil {
			c.Close()
		}
	}
}

// serveOne answers one client; it reports the rank it served.
func serveOne(conn net.Conn, world int, payload []byte, served []bool, deadline time.Time) (int, bool) {
	_ = conn.SetDeadline(minTime(deadline, time.Now().Add(10*time.Second)))
	var hello [len(bootMagic) + 12]byte
	if _, err := io.ReadFull(conn, hello[:]); err != nil || string(hello[:len(bootMagic)]) != bootMagic {
		return 0, false // not one of ours, or it went away: ignore it
	}
	version := binary.BigEndian.Uint32(hello[8:])
	rank := int(binary.BigEndian.Uint32(hello[12:]))
	w := int(binary.BigEndian.Uint32(hello[16:]))
	reply := func(status byte, body []byte) bool {
		var head [5]byte
		head[0] = status
		binary.BigEndian.PutUint32(head[1:], uint32(len(body)))
		_, err := conn.Write(append(head[:], body...))
		return err == nil
	}
	switch {
	case version != bootVersion:
		reply(bootBad, []byte(fmt.Sprintf("bootstrap protocol version %d, rank 0 speaks %d; build every rank from the same zero", version, bootVersion)))
		return 0, false
	case w != world || rank <= 0 || rank >= world:
		reply(bootBad, []byte(fmt.Sprintf("rank %d of world %d asked rank 0 of world %d; every rank needs the same WORLD_SIZE and a RANK in [1, %d)", rank, w, world, world)))
		return 0, false
	case served[rank]:
		reply(bootDup, []byte(fmt.Sprintf("rank %d was already served; two processes were started with RANK=%d", rank, rank)))
		return 0, false
	}
	return rank, reply(bootOK, payload)
}

// fetchBootstrap gets rank 0's payload. It retries while rank 0 is not up
// yet, until the timeout.
func fetchBootstrap(addr string, rank, world int, timeout time.Duration) ([]byte, error) {
	body, conn, err := fetchBootstrapKeep(addr, rank, world, timeout)
	if conn != nil {
		conn.Close()
	}
	return body, err
}

// fetchBootstrapKeep is fetchBootstrap that keeps the connection to rank 0
// open, for the abort relay.
func fetchBootstrapKeep(addr string, rank, world int, timeout time.Duration) ([]byte, net.Conn, error) {
	deadline := time.Now().Add(timeout)
	backoff := 20 * time.Millisecond
	var last error
	for {
		body, conn, retry, err := fetchOnce(addr, rank, world, deadline)
		if err == nil {
			_ = conn.SetDeadline(time.Time{})
			return body, conn, nil
		}
		if !retry {
			return nil, nil, err
		}
		last = err
		if time.Now().Add(backoff).After(deadline) {
			return nil, nil, errorf(ErrTimeout, "rank %d could not fetch the NCCL id from rank 0 at %s within %v (last error: %v); check MASTER_ADDR/MASTER_PORT and that rank 0 is running", rank, addr, timeout, last)
		}
		time.Sleep(backoff)
		backoff = min(2*backoff, time.Second)
	}
}

// fetchOnce makes one attempt; retry says whether another may succeed. On
// success the connection stays open.
func fetchOnce(addr string, rank, world int, deadline time.Time) (body []byte, conn net.Conn, retry bool, err error) {
	d := net.Dialer{Deadline: minTime(deadline, time.Now().Add(5*time.Second))}
	if conn, err = d.Dial("tcp", addr); err != nil {
		return nil, nil, true, err
	}
	defer func() {
		if err != nil {
			conn.Close()
			conn = nil
		}
	}()
	_ = conn.SetDeadline(minTime(deadline, time.Now().Add(10*time.Second)))
	var hello bytes.Buffer
	hello.WriteString(bootMagic)
	for _, v := range []int{bootVersion, rank, world} {
		_ = binary.Write(&hello, binary.BigEndian, uint32(v))
	}
	if _, err := conn.Write(hello.Bytes()); err != nil {
		return nil, conn, true, err
	}
	var head [5]byte
	if _, err := io.ReadFull(conn, head[:]); err != nil {
		return nil, conn, true, err // rank 0 closed on us (busy, restarting): try again
	}
	n := binary.BigEndian.Uint32(head[1:])
	if n > maxBootBody {
		return nil, conn, false, errorf(ErrConfig, "rank %d: bootstrap reply of %d bytes from %s; is MASTER_PORT another service?", rank, n, addr)
	}
	body = make([]byte, n)
	if _, err := io.ReadFull(conn, body); err != nil {
		return nil, conn, true, err
	}
	if head[0] != bootOK {
		return nil, conn, false, errorf(ErrConfig, "rank %d: rank 0 at %s refused: %s", rank, addr, body)
	}
	return body, conn, false, nil
}

func missingRanks(served []bool) string {
	var b strings.Builder
	n := 0
	for r := 1; r < len(served); r++ {
		if !served[r] {
			if n == 8 {
				b.WriteString(", …")
				break
			}
			if n > 0 {
				b.WriteString(", ")
			}
			b.WriteString(strconv.Itoa(r))
			n++
		}
	}
	return b.String()
}

func minTime(a, b time.Time) time.Time {
	if a.Before(b) {
		return a
	}
	return b
}

// ---- the abort relay ------------------------------------------------------
//
// NCCL's ncclCommAbort frees only the rank that calls it; its peers would
// wait in their collectives until their watchdogs time out. The bootstrap's
// connections stay open after the id exchange, a star around rank 0, and
// carry aborts: a rank that aborts sends
//	magic[4] "ZABT" | rank u32 | length u32 | reason
// to rank 0 (rank 0 to every rank), and rank 0 relays a rank's notice to
// every other rank. A closed connection is not a notice: at the end of a
// run ranks close in any order.

const (
	abortMagic     = "ZABT"
	maxAbortReason = 1 << 12
)

// abortRelay is one rank's end of the star.
type abortRelay struct {
	rank   int
	mu     sync.Mutex
	conns  []net.Conn // rank 0: one per other rank (by rank); the others: rank 0's alone
	sent   bool       // this rank has told the group already
	onPeer func(from int, reason string)
	wg     sync.WaitGroup
}

// newAbortRelay starts reading the connections; onPeer runs (once per
// notice, on a reader's goroutine) when another rank aborts.
func newAbortRelay(rank int, conns []net.Conn, onPeer func(from int, reason string)) *abortRelay {
	r := &abortRelay{rank: rank, conns: conns, onPeer: onPeer}
	for _, c := range conns {
		if c != nil {
			r.wg.Add(1)
			go r.read(c)
		}
	}
	return r
}

// abort tells every other rank that this one aborted, once.
func (r *abortRelay) abort(reason string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.sent {
		return
	}
	r.sent = true
	r.sendLocked(r.rank, reason, -1)
}

// sendLocked writes a notice from rank from to every connection but the one
// to rank skip.
func (r *abortRelay) sendLocked(from int, reason string, skip int) {
	if len(reason) > maxAbortReason {
		reason = reason[:maxAbortReason]
	}
	msg := make([]byte, 0, 12+len(reason))
	msg = append(msg, abortMagic...)
	msg = binary.BigEndian.AppendUint32(msg, uint32(from))
	msg = binary.BigEndian.AppendUint32(msg, uint32(len(reason)))
	msg = append(msg, reason...)
	for i, c := range r.conns {
		if c != nil && !(r.rank == 0 && i == skip) {
			_ = c.SetWriteDeadline(time.Now().Add(5 * time.Second))
			_, _ = c.Write(msg) // a rank that is gone needs no notice
		}
	}
}

// read waits for notices on c until it closes.
func (r *abortRelay) read(c net.Conn) {
	defer r.wg.Done()
	for {
		var head [12]byte
		if _, err := io.ReadFull(c, head[:]); err != nil || string(head[:4]) != abortMagic {
			return
		}
		from := int(binary.BigEndian.Uint32(head[4:]))
		n := binary.BigEndian.Uint32(head[8:])
		if n > maxAbortReason {
			return
		}
		reason := make([]byte, n)
		if _, err := io.ReadFull(c, reason); err != nil {
			return
		}
		r.mu.Lock()
		relay := r.rank == 0 && !r.sent
		if relay {
			r.sent = true
			r.sendLocked(from, string(reason), from)
		}
		r.mu.Unlock()
		r.onPeer(from, string(reason))
	}
}

// close closes the connections and waits for the readers.
func (r *abortRelay) close() {
	r.mu.Lock()
	closeAll(r.conns)
	r.mu.Unlock()
	r.wg.Wait()
}
