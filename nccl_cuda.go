//go:build cuda

package zero

/*
#include <stdlib.h>
#include "zero_cuda.h"
*/
import "C"

import (
	"fmt"
	"net"
	"os"
	"strconv"
	"sync"
	"time"
	"unsafe"
)

// ncclInProgress is ncclResult_t's "not finished yet" of a non-blocking
// communicator; from zc_nccl_batch and zc_nccl_init it means the deadline
// passed.
const ncclInProgress = 7

// NCCLVersion loads NCCL (library as in NCCLConfig.Library; "" means
// $ZERO_NCCL_LIBRARY, else libnccl.so.2) and returns its version code, e.g.
// 22707 for 2.27.7. It needs no GPU.
func NCCLVersion(library string) (int, error) {
	if library == "" {
		library = getenvNCCLLibrary()
	}
	if err := loadNCCL(library); err != nil {
		return 0, err
	}
	var v C.int
	if code := C.zc_nccl_version(&v); code != 0 {
		return 0, ncclErr("ncclGetVersion", -1, 0, code)
	}
	return int(v), nil
}

// loadNCCL dlopens NCCL once per process.
func loadNCCL(library string) error {
	var cpath *C.char
	if library != "" {
		cpath = C.CString(library)
		defer C.free(unsafe.Pointer(cpath))
	}
	var msg [1024]C.char
	if code := C.zc_nccl_load(cpath, &msg[0], C.int(len(msg))); code != 0 {
		name := library
		if name == "" {
			name = "libnccl.so.2"
		}
		return errorf(ErrNCCL, "cannot load NCCL (%s): %s; install it (pip install nvidia-nccl-cu12, or use PyTorch's) and put its lib folder on LD_LIBRARY_PATH, or set ZERO_NCCL_LIBRARY to the library's path", name, C.GoString(&msg[0]))
	}
	return nil
}

// probeNCCL dlopens a library and resolves NCCL's symbols without keeping
// it (tests); it returns the loader's message.
func probeNCCL(library string) (string, error) {
	cpath := C.CString(library)
	defer C.free(unsafe.Pointer(cpath))
	var msg [1024]C.char
	if code := C.zc_nccl_probe(cpath, &msg[0], C.int(len(msg))); code != 0 {
		return C.GoString(&msg[0]), errorf(ErrNCCL, "%s: %s", library, C.GoString(&msg[0]))
	}
	return "", nil
}

// ncclLoaded says whether NCCL was loaded in this process.
func ncclLoaded() bool { return C.zc_nccl_loaded() != 0 }

func ncclErr(op string, rank int, comm uintptr, code C.int) error {
	e := &NCCLError{Code: int(code), Name: ncclResultName(int(code)), Text: C.GoString(C.zc_nccl_error_string(code)), Op: op, Rank: rank}
	var last [1024]C.char
	C.zc_nccl_last_error(C.uintptr_t(comm), &last[0], C.int(len(last)))
	e.Last = C.GoString(&last[0])
	return e
}

// NewNCCLFromEnv is NewNCCL with the config of NCCLConfigFromEnv (torchrun's
// environment).
func NewNCCLFromEnv() (Comm, error) {
	cfg, err := NCCLConfigFromEnv()
	if err != nil {
		return nil, err
	}
	return NewNCCL(cfg)
}

// NewNCCL starts this process's rank of an NCCL communicator: one rank per
// GPU, one process per rank, on one host or many.
//
// Rank 0 makes the ncclUniqueId and serves it over TCP on MasterPort; the
// other ranks fetch it (retrying until BootstrapTimeout) and every rank then
// joins with ncclCommInitRankConfig. The communicator is non-blocking, so no
// NCCL call blocks past its deadline. Collectives are enqueued from one C
// call per batch (ncclGroupStart … ncclGroupEnd on one OS thread, as NCCL's
// group state is per thread). A watchdog goroutine polls
// ncclCommGetAsyncError and the completion of every batch; on an error, or a
// batch older than Timeout, it aborts the communicator (ncclCommAbort), and
// every later call returns the reason.
//
// OpAvg is ncclAvg: NCCL divides the sum by the world size, exact when the
// world size is a power of two; the engine's pre-division (PredivideFactor)
// is fused into its flatten and accumulate kernels instead.
//
// NCCL is loaded with dlopen when NewNCCL first runs, so a binary built with
// -tags cuda starts on a host without NCCL and NewNCCL returns an error
// wrapping ErrNCCL.
func NewNCCL(cfg NCCLConfig) (Comm, error) {
	if err := cfg.check(); err != nil {
		return nil, err
	}
	if err := loadNCCL(cfg.Library); err != nil {
		return nil, err
	}
	dev := cfg.Device
	if dev == nil {
		ordinal, err := localDevice(cfg.LocalRank)
		if err != nil {
			return nil, err
		}
		if dev, err = CUDA(ordinal); err != nil {
			return nil, err
		}
	}
	d, ok := dev.(*cudaDevice)
	if !ok {
		return nil, errorf(ErrDevice, "NewNCCL: device %s is not a CUDA device", deviceName(dev))
	}
	id, conns, err := ncclBootstrap(&cfg)
	if err != nil {
		return nil, err
	}
	closeConns := true
	defer func() {
		if closeConns {
			closeAll(conns)
		}
	}()
	var h C.uintptr_t
	cid := (*C.char)(C.CBytes(id))
	defer C.free(unsafe.Pointer(cid))
	code := C.zc_nccl_init(d.dev(), cid, C.int(cfg.World), C.int(cfg.Rank), C.int64_t(cfg.BootstrapTimeout.Milliseconds()), &h)
	if code == ncclInProgress {
		return nil, fmt.Errorf("%w: %w: rank %d: ncclCommInitRank did not finish within %v; a rank did not join (check WORLD_SIZE and that every rank runs)", ErrNCCL, ErrTimeout, cfg.Rank, cfg.BootstrapTimeout)
	}
	if code != 0 {
		return nil, ncclErr(fmt.Sprintf("ncclCommInitRank(world %d)", cfg.World), cfg.Rank, 0, code)
	}
	c := &ncclComm{dev: d, rank: cfg.Rank, world: cfg.World, h: uintptr(h), timeout: cfg.Timeout,
		stop: make(chan struct{}), stopped: make(chan struct{})}
	c.collectives = collectives{world: cfg.World, issue: func(s Stream, x collective) error {
		return c.batch(s, ncclOp{kind: x.kind, dtype: x.send.dtype, op: x.op, root: x.root, send: x.send, recv: x.recv,
			count: min(x.send.count, x.recv.count), payload: x.payload()})
	}}
	closeConns = false
	c.relay = newAbortRelay(cfg.Rank, conns, func(from int, reason string) {
		c.mu.Lock()
		defer c.mu.Unlock()
		c.abortLocked(errorf(ErrPeerFailed, "rank %d aborted: %s", from, reason))
	})
	go c.watchdog(watchdogPoll(cfg.Timeout))
	return c, nil
}

// ncclBootstrap returns the unique id, made by rank 0 and served to the
// others, fetched by the others, and the connections the abort relay keeps:
// rank 0's to every other rank, each other rank's to rank 0.
func ncclBootstrap(cfg *NCCLConfig) ([]byte, []net.Conn, error) {
	addr := net.JoinHostPort(cfg.MasterAddr, strconv.Itoa(cfg.MasterPort))
	if cfg.Rank != 0 {
		id, conn, err := fetchBootstrapKeep(addr, cfg.Rank, cfg.World, cfg.BootstrapTimeout)
		if err != nil {
			return nil, nil, err
		}
		if len(id) != 128 {
			conn.Close()
			return nil, nil, errorf(ErrConfig, "rank %d: rank 0 at %s sent %d bytes, not a 128-byte NCCL id", cfg.Rank, addr, len(id))
		}
		return id, []net.Conn{conn}, nil
	}
	var ln net.Listener
	if cfg.World > 1 {
		var err error
		// listen before making the id, so a busy port fails at once
		if ln, err = listenBootstrap(net.JoinHostPort("", strconv.Itoa(cfg.MasterPort))); err != nil {
			return nil, nil, err
		}
	}
	id := make([]byte, 128)
	if code := C.zc_nccl_unique_id((*C.char)(unsafe.Pointer(&id[0]))); code != 0 {
		if ln != nil {
			ln.Close()
		}
		return nil, nil, ncclErr("ncclGetUniqueId", 0, 0, code)
	}
	var conns []net.Conn
	if ln != nil {
		var err error
		if conns, err = serveBootstrapKeep(ln, cfg.World, id, cfg.BootstrapTimeout); err != nil {
			return nil, nil, err
		}
	}
	return id, conns, nil
}

func watchdogPoll(timeout time.Duration) time.Duration {
	return min(max(timeout/50, time.Millisecond), 100*time.Millisecond)
}

type ncclComm struct {
	dev     *cudaDevice
	rank    int
	world   int
	timeout time.Duration

	mu         sync.Mutex
	h          uintptr
	failed     error // set once aborted: every later call returns it
	closed     bool
	pending    []ncclPending
	idleEvents []Event         // fired batch events, to record again
	cops       [4]C.zc_nccl_op // the C form of a batch, reused

	relay   *abortRelay // tells the other ranks of an abort, and hears theirs
	stop    chan struct{}
	stopped chan struct{}
	collectives
	counters
}

// ncclPending is a batch enqueued and not yet seen finished. It keeps the
// batch's first op, to name it if the batch times out: nothing is
// formatted while all goes well.
type ncclPending struct {
	done  *cudaEvent
	at    time.Time
	first ncclOp
	n     int
	bufs  [8]Tensor // every op's send and recv, quarantined if the batch is aborted
}

func (p ncclPending) String() string {
	if p.n > 1 {
		return fmt.Sprintf("%v and %d more", p.first, p.n-1)
	}
	return p.first.String()
}

// asyncErr is the reason the communicator was aborted, if it was: an
// aborted collective's event still fires, and the engine asks here.
func (c *ncclComm) asyncErr() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.failed
}

func (c *ncclComm) Rank() int              { return c.rank }
func (c *ncclComm) Size() int              { return c.world }
func (c *ncclComm) Device() Device         { return c.dev }
func (c *ncclComm) Counters() CommCounters { return c.snapshot() }

// ncclOp is one collective of a batch.
type ncclOp struct {
	kind       CollectiveKind
	dtype      DType
	op         ReduceOp
	root       int
	send, recv Tensor
	count      int // NCCL's count (see zc_nccl_op)
	payload    int
}

func (o ncclOp) String() string {
	switch o.kind {
	case KindAllGather, KindBroadcast:
		return fmt.Sprintf("%v(%d × %v)", o.kind, o.count, o.dtype)
	}
	return fmt.Sprintf("%v(%d × %v, %v)", o.kind, o.count, o.dtype, o.op)
}

// batch enqueues ops from one C call (ncclGroupStart … ncclGroupEnd) and
// records their completion for the watchdog. Every op names its own stream
// through s (one stream per batch here).
func (c *ncclComm) batch(s Stream, ops ...ncclOp) error {
	cs, err := c.dev.streamOf(s)
	if err != nil {
		return err
	}
	if len(ops) > len(c.cops) {
		return errorf(ErrConfig, "an NCCL batch of %d collectives; at most %d", len(ops), len(c.cops))
	}
	for _, o := range ops {
		if err := c.dev.deviceOnly(o.kind.String(), o.send, o.recv); err != nil {
			return err
		}
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	p := ncclPending{first: ops[0], n: len(ops)}
	for i, o := range ops {
		p.bufs[2*i], p.bufs[2*i+1] = o.send, o.recv
	}
	if c.failed != nil {
		return c.failed
	}
	if c.closed {
		return errorf(ErrClosed, "rank %d: %v on a closed NCCL communicator", c.rank, p)
	}
	for i, o := range ops {
		c.cops[i] = C.zc_nccl_op{kind: C.int32_t(o.kind), dtype: C.int32_t(cdtype(o.dtype)), op: C.int32_t(cop(o.op)),
			root: C.int32_t(o.root), send: C.uintptr_t(o.send.ptr), recv: C.uintptr_t(o.recv.ptr),
			count: C.uint64_t(o.count), stream: C.uintptr_t(cs.h)}
	}
	// ncclGroupStart and ncclGroupEnd must run on one OS thread: they do,
	// inside this one C call (a goroutine may move between Go calls).
	code := C.zc_nccl_batch(c.dev.dev(), C.uintptr_t(c.h), &c.cops[0], C.int(len(ops)), C.int64_t(c.timeout.Milliseconds()))
	switch {
	case code == ncclInProgress:
		quarantine.add(p.bufs[:]...) // it may be under way
		c.abortLocked(fmt.Errorf("%w: %w: rank %d: %v was not enqueued within %v; a peer is not taking part (aborted the communicator)", ErrNCCL, ErrTimeout, c.rank, p, c.timeout))
		return c.failed
	case code == 4 || code == 5: // ncclInvalidArgument, ncclInvalidUsage: the communicator is still good
		return ncclErr(p.String(), c.rank, c.h, code)
	case code != 0:
		quarantine.add(p.bufs[:]...) // part of the batch may be enqueued
		c.abortLocked(ncclErr(p.String(), c.rank, c.h, code))
		return c.failed
	}
	for _, o := range ops {
		c.add(o.kind, o.payload, c.world)
	}
	// The batch's completion event comes from the communicator's pool: the
	// watchdog gives it back once it has seen it fire.
	var reuse Event
	if n := len(c.idleEvents); n > 0 {
		reuse, c.idleEvents = c.idleEvents[n-1], c.idleEvents[:n-1]
	}
	ev, err := cs.recordUntimed(reuse)
	if err != nil {
		return err
	}
	p.done, p.at = ev.(*cudaEvent), time.Now()
	c.pending = append(c.pending, p)
	return nil
}

// watchdog polls the communicator until Close: an asynchronous NCCL error,
// or a batch that has not finished within the timeout, aborts it.
func (c *ncclComm) watchdog(poll time.Duration) {
	defer close(c.stopped)
	t := time.NewTicker(poll)
	defer t.Stop()
	for {
		select {
		case <-c.stop:
			return
		case <-t.C:
		}
		c.mu.Lock()
		if c.failed != nil || c.closed {
			c.mu.Unlock()
			return
		}
		c.checkLocked()
		failed := c.failed
		c.mu.Unlock()
		if failed != nil && c.relay != nil { // the peers need not wait for their own timeouts
			c.relay.abort(failed.Error())
		}
	}
}

func (c *ncclComm) checkLocked() {
	var state C.int
	if code := C.zc_nccl_async_error(C.uintptr_t(c.h), &state); code != 0 {
		c.abortLocked(ncclErr("ncclCommGetAsyncError", c.rank, c.h, code))
		return
	}
	if state != 0 && state != ncclInProgress {
		c.abortLocked(ncclErr("asynchronous error (watchdog)", c.rank, c.h, state))
		return
	}
	done := 0
	for done < len(c.pending) && c.pending[done].done.Done() {
		c.idleEvents = append(c.idleEvents, c.pending[done].done)
		done++
	}
	if done > 0 { // shift in place: the slice keeps its capacity
		n := copy(c.pending, c.pending[done:])
		clear(c.pending[n:])
		c.pending = c.pending[:n]
	}
	if len(c.pending) > 0 {
		if age := time.Since(c.pending[0].at); age > c.timeout {
			c.abortLocked(fmt.Errorf("%w: %w: rank %d: %v has not finished after %v (timeout %v); a peer failed or stopped issuing collectives (watchdog aborted the communicator)",
				ErrNCCL, ErrTimeout, c.rank, c.pending[0], age.Round(time.Millisecond), c.timeout))
		}
	}
}

// abortLocked aborts the communicator once; reason is what later calls return.
func (c *ncclComm) abortLocked(reason error) {
	if c.failed != nil {
		return
	}
	c.failed = reason
	// The batches not seen finished may still write into their buffers
	// (peers' copies among them): those are never freed.
	for _, p := range c.pending {
		quarantine.add(p.bufs[:]...)
	}
	if c.h != 0 {
		C.zc_nccl_abort(c.dev.dev(), C.uintptr_t(c.h))
		c.h = 0
	}
	c.pending = nil
}

// abort aborts the communicator from outside (Engine.Abort, AbortComm,
// tests) and tells the other ranks through the relay, so their collectives
// fail at once instead of at their watchdog's timeout.
func (c *ncclComm) abort(reason error) {
	c.mu.Lock()
	c.abortLocked(fmt.Errorf("%w: rank %d aborted its communicator: %w", ErrAborted, c.rank, reason)) // this rank's own: not a peer's failure
	c.mu.Unlock()
	if c.relay != nil {
		c.relay.abort(reason.Error())
	}
}

// Close stops the watchdog and destroys the communicator (flushing its
// pending work, within the timeout); after an abort it only stops the
// watchdog. Peers' later collectives fail or time out.
func (c *ncclComm) Close() error {
	c.mu.Lock()
	if c.closed {
		c.mu.Unlock()
		return nil
	}
	c.closed = true
	c.mu.Unlock()
	close(c.stop)
	<-c.stopped
	if c.relay != nil {
		c.relay.close()
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.failed != nil || c.h == 0 {
		return nil
	}
	h := c.h
	c.h = 0
	c.pending = nil
	code := C.zc_nccl_destroy(c.dev.dev(), C.uintptr_t(h), C.int64_t(c.timeout.Milliseconds()))
	if code == ncclInProgress {
		return fmt.Errorf("%w: %w: rank %d: ncclCommFinalize did not finish within %v; aborted the communicator", ErrNCCL, ErrTimeout, c.rank, c.timeout)
	}
	if code != 0 {
		return ncclErr("ncclCommDestroy", c.rank, 0, code)
	}
	return nil
}

// localDevice is the ordinal of this process's GPU: LOCAL_RANK where the
// process sees every GPU of the host, and 0 where the launcher gave it one
// (CUDA_VISIBLE_DEVICES set per process, as Slurm and some torchrun setups
// do): there the only device is ordinal 0, whatever LOCAL_RANK says.
func localDevice(localRank int) (int, error) {
	n, err := CUDADeviceCount()
	if err != nil {
		return 0, err
	}
	return pickLocalDevice(localRank, n), nil
}

func pickLocalDevice(localRank, visible int) int {
	if visible == 1 {
		return 0
	}
	return localRank
}

func getenvNCCLLibrary() string { return os.Getenv("ZERO_NCCL_LIBRARY") }
