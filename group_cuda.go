//go:build cuda

package zero

/*
#include "zero_cuda.h"
*/
import "C"

import (
	"fmt"
	"runtime"
	"sync/atomic"
	"time"
)

// NewCUDALocalGroup returns n communicators for n ranks of one process on
// one CUDA device, each driven by its own goroutine and its own streams.
// This is how multi-rank GPU behaviour is tested on one GPU: NCCL refuses
// two ranks on one device.
//
// A collective is a rendezvous of the ranks' calls on the host: each rank
// records an event on its stream and waits; the last rank to arrive makes
// its stream wait on every other rank's event, enqueues the whole
// collective there (the reduce kernels of csrc/kernels.cu, or copies), records
// a completion event, and makes every other rank's stream wait on it. So each
// call returns once the work is enqueued, every stream is ordered after the
// collective, and the result does not depend on which rank came last:
// reductions run in rank order, as in the CPU group, and give its bits.
func NewCUDALocalGroup(n int, dev Device) ([]Comm, error) {
	return NewCUDALocalGroupTimeout(n, dev, DefaultTimeout)
}

// NewCUDALocalGroupTimeout is NewCUDALocalGroup with a bound on how long a
// collective waits for a peer that failed or left.
func NewCUDALocalGroupTimeout(n int, dev Device, timeout time.Duration) ([]Comm, error) {
	if n < 1 || n > C.ZC_MAX_RANKS {
		return nil, errorf(ErrConfig, "NewCUDALocalGroup(%d): the world size must be in [1, %d]", n, C.ZC_MAX_RANKS)
	}
	if timeout <= 0 {
		return nil, errorf(ErrConfig, "NewCUDALocalGroup: timeout %v; give a positive duration", timeout)
	}
	d, ok := dev.(*cudaDevice)
	if !ok {
		return nil, errorf(ErrDevice, "NewCUDALocalGroup: device %s is not a CUDA device; pass one from zero.CUDA", deviceName(dev))
	}
	g := &cudaGroup{n: n, dev: d, timeout: timeout, slots: make([]cudaSlot, n),
		phase: newCUDAPhase(n), abortLatch: newAbortLatch()}
	comms := make([]Comm, n)
	for r := range comms {
		c := &cudaLocalComm{g: g, rank: r}
		c.collectives = collectives{world: n, issue: func(s Stream, x collective) error {
			return c.ownErr(c.collective(s, x.args(), x.payload(), x.send, x.recv))
		}}
		comms[r] = c
	}
	return comms, nil
}

type cudaGroup struct {
	n       int
	dev     *cudaDevice
	timeout time.Duration

	abortLatch // its mu also guards the rendezvous
	slots      []cudaSlot
	arrived    int
	phase      *cudaPhase
}

func newCUDAPhase(n int) *cudaPhase {
	return &cudaPhase{came: make([]bool, n), done: make(chan struct{})}
}

// cudaPhase is one rendezvous: done closes when the last rank has enqueued
// the collective (or failed to).
type cudaPhase struct {
	claimed bool   // every rank arrived; the last one enqueues for all (under cudaGroup.mu)
	came    []bool // per rank: arrived (what a timeout names; under cudaGroup.mu)
	done    chan struct{}
	err     error
}

type cudaSlot struct {
	a      collArgs
	stream *cudaStream
	ready  *cudaEvent
}

type cudaLocalComm struct {
	g       *cudaGroup
	rank    int
	closed  atomic.Bool           // this rank closed its communicator
	aborted atomic.Pointer[error] // why this rank aborted the group, if it did
	collectives
	counters
}

func (c *cudaLocalComm) Rank() int              { return c.rank }
func (c *cudaLocalComm) Size() int              { return c.g.n }
func (c *cudaLocalComm) Device() Device         { return c.g.dev }
func (c *cudaLocalComm) Counters() CommCounters { return c.snapshot() }

func (c *cudaLocalComm) Close() error {
	c.closed.Store(true)
	c.g.abort(errorf(ErrPeerFailed, "rank %d closed its communicator", c.rank))
	return nil
}

func (c *cudaLocalComm) abort(reason error) {
	c.aborted.CompareAndSwap(nil, &reason)
	c.g.abort(fmt.Errorf("%w: %w", ErrPeerFailed, reason))
}

// ownErr is what this rank sees of a failed collective: ErrAborted once it
// aborted the group itself, not a peer's failure.
func (c *cudaLocalComm) ownErr(err error) error {
	if reason := c.aborted.Load(); err != nil && reason != nil {
		return fmt.Errorf("%w: rank %d aborted its group: %w", ErrAborted, c.rank, *reason)
	}
	return err
}

// collective publishes this rank's call and meets the peers; the last to
// arrive enqueues the work for all (see NewCUDALocalGroup).
func (c *cudaLocalComm) collective(s Stream, a collArgs, payload int, ts ...Tensor) error {
	g := c.g
	cs, err := g.dev.streamOf(s)
	if err != nil {
		return err
	}
	if err := g.dev.deviceOnly(a.kind.String(), ts...); err != nil {
		return err
	}
	if c.closed.Load() {
		return errorf(ErrClosed, "rank %d closed its communicator", c.rank)
	}
	if err := g.abortErr(); err != nil {
		return err
	}
	ready, err := cs.record(false)
	if err != nil {
		return err
	}
	c.add(a.kind, payload, g.n)

	g.mu.Lock()
	if g.reason != nil {
		g.mu.Unlock()
		return g.reason
	}
	ph := g.phase
	g.slots[c.rank] = cudaSlot{a: a, stream: cs, ready: ready}
	ph.came[c.rank] = true
	g.arrived++
	if g.arrived == g.n {
		slots := append([]cudaSlot(nil), g.slots...)
		g.arrived = 0
		ph.claimed = true
		g.phase = newCUDAPhase(g.n)
		g.mu.Unlock()
		var enqueued bool
		enqueued, ph.err = g.run(c.rank, slots)
		if ph.err != nil {
			if enqueued { // part of it is queued; the others' streams are not ordered after it
				for _, o := range slots {
					quarantine.add(o.a.buffers(g.n)...)
				}
			}
			g.abort(ph.err)
		}
		close(ph.done)
		return ph.err
	}
	g.mu.Unlock()

	timer := time.NewTimer(g.timeout)
	defer timer.Stop()
	select {
	case <-ph.done:
		return ph.err
	case <-g.aborted:
	case <-timer.C:
		g.mu.Lock()
		if !ph.claimed {
			var missing, there []int
			for r, ok := range ph.came {
				if ok {
					there = append(there, r)
				} else {
					missing = append(missing, r)
				}
			}
			g.abortLocked(errorf(ErrTimeout, "%v on rank %d: %s did not arrive within %v (%s did); %s failed, returned early or issued fewer collectives",
				a, c.rank, ranksText(missing), g.timeout, ranksText(there), ranksText(missing)))
		}
		g.mu.Unlock()
	}
	// Once every rank has arrived, the last one is enqueuing work on every
	// rank's stream, which must stay alive until it is done; that never
	// waits on a peer, so waiting for it cannot hang.
	g.mu.Lock()
	claimed := ph.claimed
	g.mu.Unlock()
	if claimed {
		<-ph.done
		return ph.err
	}
	return g.abortErr()
}

// run enqueues one collective for every rank on the stream of rank last;
// enqueued says whether any of it may have been enqueued.
func (g *cudaGroup) run(last int, slots []cudaSlot) (enqueued bool, err error) {
	a := slots[last].a
	for _, o := range slots {
		oa := o.a
		if oa.kind != a.kind || oa.op != a.op || oa.root != a.root || oa.dtype != a.dtype || oa.count != a.count {
			calls := make([]collArgs, len(slots))
			for i := range slots {
				calls[i] = slots[i].a
			}
			return false, errorf(ErrCollectiveMismatch, "%s; every rank must issue the same collectives in the same order", callsText(calls))
		}
	}
	d, L := g.dev, slots[last].stream
	for r, o := range slots {
		if r != last {
			if err := L.Wait(o.ready); err != nil {
				return false, err
			}
		}
	}
	if err := g.work(L, slots); err != nil {
		return true, err
	}
	done, err := L.record(false)
	if err != nil {
		return true, err
	}
	for r, o := range slots {
		if r != last && o.stream != L {
			if code := C.zc_stream_wait(d.dev(), C.uintptr_t(o.stream.h), C.uintptr_t(done.h)); code != 0 {
				return true, d.err("cudaStreamWaitEvent", code)
			}
		}
	}
	runtime.KeepAlive(done) // the waits above use its handle
	return true, nil
}

// work enqueues the collective's kernels and copies on L.
func (g *cudaGroup) work(L *cudaStream, slots []cudaSlot) error {
	d, n, a := g.dev, g.n, slots[0].a
	size := uintptr(a.dtype.Size())
	h := C.uintptr_t(L.h)
	switch a.kind {
	case KindAllReduce:
		bufs := make([]uintptr, n)
		for r, o := range slots {
			bufs[r] = o.a.send
		}
		return d.allReduce(L, bufs, a.dtype, a.op, a.count)
	case KindReduceScatter:
		dsts := make([]uintptr, n)
		srcs := make([]uintptr, n)
		for r, o := range slots {
			dsts[r] = o.a.recv
			srcs[r] = o.a.send
		}
		return d.reduce(L, dsts, srcs, a.dtype, a.op, a.count/n)
	case KindAllGather:
		bytes := uintptr(a.count) * size
		for r, dst := range slots {
			for k, src := range slots {
				to := dst.a.recv + uintptr(k)*bytes
				if to == src.a.send || bytes == 0 {
					continue
				}
				if code := C.zc_memcpy(d.dev(), h, C.uintptr_t(to), C.uintptr_t(src.a.send), C.uint64_t(bytes)); code != 0 {
					return d.err(fmt.Sprintf("AllGather(%d × %v): copy rank %d → rank %d", a.count, a.dtype, k, r), code)
				}
			}
		}
	case KindBroadcast:
		bytes := uintptr(a.count) * size
		root := slots[a.root].a.send
		for r, o := range slots {
			if o.a.recv == root || bytes == 0 {
				continue
			}
			if code := C.zc_memcpy(d.dev(), h, C.uintptr_t(o.a.recv), C.uintptr_t(root), C.uint64_t(bytes)); code != 0 {
				return d.err(fmt.Sprintf("Broadcast(%d × %v): copy to rank %d", a.count, a.dtype, r), code)
			}
		}
	}
	return nil
}
