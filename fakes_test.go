package zero

import (
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"
)

// The fakes that several test files share: a host device that keeps a
// ledger of the engine's allocations, one that fails a chosen call, a
// communicator on another device, one that counts the collectives issued
// through it, and a stream of no device. A fake that only one test file
// uses (faultyComm, leavingComm, abortingComm, …) stays in that file.

// countingDevice is the host device (or another, newCountingDeviceOn) with
// a ledger of the engine's live allocations and their high-water mark, and
// one of its page-locked host memory (offload's). Freed memory stays
// mapped until release, so a buffer freed too early is reported by onFree
// instead of crashing the test; freeAtOnce frees it at once instead, for a
// test that reads the device's own figures (NVML).
type countingDevice struct {
	Device
	mu         sync.Mutex
	live       map[uintptr]int
	cur        int // live bytes
	peak       int // the most live bytes since newCountingDevice
	frees      atomic.Int32
	allocs     atomic.Int32 // allocations ever made
	freed      []Tensor
	onFree     func(Tensor)
	freeAtOnce bool
	host       struct {
		live      map[uintptr]int
		cur, peak int
	} // allocPinned's ledger
}

func newCountingDevice() *countingDevice { return newCountingDeviceOn(CPU()) }

// newCountingDeviceOn counts the allocations made on base.
func newCountingDeviceOn(base Device) *countingDevice {
	d := &countingDevice{Device: base, live: map[uintptr]int{}}
	d.host.live = map[uintptr]int{}
	return d
}

func (d *countingDevice) Alloc(n int, dt DType) (Tensor, error) {
	t, err := d.Device.Alloc(n, dt)
	d.allocs.Add(1)
	if err == nil && t.ptr != 0 {
		d.mu.Lock()
		d.live[t.ptr] = t.Bytes()
		d.cur += t.Bytes()
		d.peak = max(d.peak, d.cur)
		d.mu.Unlock()
	}
	return t, err
}

// allocPinned and freePinned count the host memory of an offloading
// engine apart from the device's.
func (d *countingDevice) allocPinned(n int, dt DType) (Tensor, bool, error) {
	t, locked, err := d.Device.(pinnedAllocator).allocPinned(n, dt)
	if err == nil && t.ptr != 0 {
		d.mu.Lock()
		d.host.live[t.ptr] = t.Bytes()
		d.host.cur += t.Bytes()
		d.host.peak = max(d.host.peak, d.host.cur)
		d.mu.Unlock()
	}
	return t, locked, err
}

func (d *countingDevice) freePinned(t Tensor) error {
	d.mu.Lock()
	n, ok := d.host.live[t.ptr]
	delete(d.host.live, t.ptr)
	d.host.cur -= n
	d.mu.Unlock()
	if !ok {
		return fmt.Errorf("freePinned of %#x, which is not live", t.ptr)
	}
	return d.Device.(pinnedAllocator).freePinned(t)
}

// pinned reports whether t lies in page-locked host memory this device
// handed out and has not taken back.
func (d *countingDevice) pinned(t Tensor) bool {
	d.mu.Lock()
	defer d.mu.Unlock()
	for p, n := range d.host.live {
		if t.ptr >= p && t.ptr < p+uintptr(n) {
			return true
		}
	}
	return false
}

// peaks returns the high-water marks of live device and host bytes.
func (d *countingDevice) peaks() (device, host int) {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.peak, d.host.peak
}

// liveCount is how many device allocations are live.
func (d *countingDevice) liveCount() int {
	d.mu.Lock()
	defer d.mu.Unlock()
	return len(d.live)
}

func (d *countingDevice) Free(t Tensor) error {
	if t.ptr == 0 {
		return nil
	}
	if d.onFree != nil {
		d.onFree(t)
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	if _, ok := d.live[t.ptr]; !ok {
		return fmt.Errorf("free of %#x, which is not live", t.ptr)
	}
	d.cur -= d.live[t.ptr]
	delete(d.live, t.ptr)
	d.frees.Add(1)
	if d.freeAtOnce {
		return d.Device.Free(t)
	}
	d.freed = append(d.freed, t)
	return nil
}

func (d *countingDevice) liveBytes() int {
	d.mu.Lock()
	defer d.mu.Unlock()
	n := 0
	for _, b := range d.live {
		n += b
	}
	return n
}

func (d *countingDevice) release() {
	for _, t := range d.freed {
		d.Device.Free(t)
	}
}

// onDevice gives a communicator another device (of the same kind).
type onDevice struct {
	Comm
	dev Device
}

func (c onDevice) Device() Device { return c.dev }

var errInjected = errors.New("injected device failure")

// failingDevice is the host device whose n-th call (allocations and
// kernels, counted from arm on) fails with errInjected, before it does
// anything. It notes which call was the optimizer pass: the step's commit
// point.
type failingDevice struct {
	Device
	armed                     bool
	calls, failAt, optimizeAt int
	used                      []Tensor // the operands of the armed calls that ran
}

func (d *failingDevice) hit(operands ...Tensor) error {
	if !d.armed {
		return nil
	}
	d.calls++
	if d.calls == d.failAt {
		return errInjected
	}
	d.used = append(d.used, operands...)
	return nil
}

// uses reports whether x overlaps an operand of an armed call.
func (d *failingDevice) uses(x Tensor) bool {
	for _, u := range d.used {
		if u.ptr < x.ptr+uintptr(x.Bytes()) && x.ptr < u.ptr+uintptr(u.Bytes()) {
			return true
		}
	}
	return false
}

func (d *failingDevice) NewStream() (Stream, error) {
	if err := d.hit(); err != nil {
		return nil, err
	}
	return d.Device.NewStream()
}

func (d *failingDevice) Alloc(n int, dt DType) (Tensor, error) {
	if err := d.hit(); err != nil {
		return Tensor{}, err
	}
	return d.Device.Alloc(n, dt)
}

func (d *failingDevice) zero(s Stream, t Tensor) error {
	if err := d.hit(t); err != nil {
		return err
	}
	return d.Device.zero(s, t)
}

func (d *failingDevice) copy(s Stream, dst, src Tensor) error {
	if err := d.hit(dst, src); err != nil {
		return err
	}
	return d.Device.copy(s, dst, src)
}

func (d *failingDevice) flatten(s Stream, dst Tensor, segs []flatPiece, scale float32) error {
	if err := d.hit(dst); err != nil {
		return err
	}
	return d.Device.flatten(s, dst, segs, scale)
}

func (d *failingDevice) accumulate(s Stream, acc Tensor, segs []flatPiece, first bool, scale float32, flag Tensor) error {
	if err := d.hit(acc); err != nil {
		return err
	}
	return d.Device.accumulate(s, acc, segs, first, scale, flag)
}

func (d *failingDevice) accumulateSquares(s Stream, acc Tensor, seg flatPiece, first bool, scale float32, flag, parts Tensor) error {
	if err := d.hit(acc, parts); err != nil {
		return err
	}
	return d.Device.accumulateSquares(s, acc, seg, first, scale, flag, parts)
}

func (d *failingDevice) chunkSquares(s Stream, x, parts Tensor) error {
	if err := d.hit(x, parts); err != nil {
		return err
	}
	return d.Device.chunkSquares(s, x, parts)
}

func (d *failingDevice) sumChunks(s Stream, parts Tensor, ranges []chunkRange, outs Tensor) error {
	if err := d.hit(parts, outs); err != nil {
		return err
	}
	return d.Device.sumChunks(s, parts, ranges, outs)
}

func (d *failingDevice) cast(s Stream, dst, src Tensor, scale float32) error {
	if err := d.hit(dst, src); err != nil {
		return err
	}
	return d.Device.cast(s, dst, src, scale)
}

func (d *failingDevice) copyScaled(s Stream, dst, src Tensor, scale float32) error {
	if err := d.hit(dst, src); err != nil {
		return err
	}
	return d.Device.copyScaled(s, dst, src, scale)
}

func (d *failingDevice) optimize(s Stream, kind optKind, b optTensors, ranges []optRange, gscale float32) error {
	if err := d.hit(b.p, b.g, b.m, b.v, b.vmax, b.out); err != nil {
		return err
	}
	if d.armed {
		d.optimizeAt = d.calls
	}
	return d.Device.optimize(s, kind, b, ranges, gscale)
}

func (d *failingDevice) unflatten(s Stream, flat Tensor, segs []flatPiece) error {
	if err := d.hit(flat); err != nil {
		return err
	}
	return d.Device.unflatten(s, flat, segs)
}

// fakeStream is a stream that belongs to no device: engines and
// collectives refuse it with ErrStream.
type fakeStream struct{ Stream }

// countingComm counts the collectives issued through it.
type countingComm struct {
	Comm
	calls int
}

func (c *countingComm) AllReduce(s Stream, t Tensor, op ReduceOp) error {
	c.calls++
	return c.Comm.AllReduce(s, t, op)
}

func (c *countingComm) AllGather(s Stream, send, recv Tensor) error {
	c.calls++
	return c.Comm.AllGather(s, send, recv)
}

func (c *countingComm) Broadcast(s Stream, t Tensor, root int) error {
	c.calls++
	return c.Comm.Broadcast(s, t, root)
}

// queuedDevice is the host device with a ledger of the work queued on its
// streams, to catch memory freed while queued work still uses it: every
// kernel, and every collective issued through a queuedComm, counts its
// buffers as in use until it has run. A Free of memory that queued work
// still uses is recorded (early) and the memory stays mapped, instead of
// crashing the test; release unmaps it at the end. Streams it makes start
// held by a gate (and, with gateEach, so does each kernel and collective),
// which opens once a Sync or Close waits on that stream or a Free is
// called: a free that does not wait for the work comes while it is queued.
type queuedDevice struct {
	Device
	mu      sync.Mutex
	pending map[*queuedWork]bool
	early   []string
	kept    []Tensor
	freed   atomic.Int64 // Free calls
	// failKernel makes the call of that kernel ("cast", "copy", ...) after
	// the first failSkip fail with errInjected, before it enqueues anything.
	failKernel string
	failSkip   int
	gateEach   bool
}

type queuedWork struct {
	what string
	ts   []Tensor
}

func newQueuedDevice() *queuedDevice {
	return &queuedDevice{Device: CPU(), pending: map[*queuedWork]bool{}}
}

// hold queues a gate on s that opens once something waits on s or a Free
// comes (or after 20 s, so a test that waits for neither fails on time).
func (d *queuedDevice) hold(s Stream) {
	hs := s.(*HostStream)
	gate := make(chan struct{})
	if _, err := hs.enqueue(hostOp{control: true, fn: func() error { <-gate; return nil }}); err != nil {
		return
	}
	frees := d.freed.Load()
	go func() {
		defer close(gate)
		for deadline := time.Now().Add(20 * time.Second); time.Now().Before(deadline); time.Sleep(50 * time.Microsecond) {
			if hs.waitedOn() || d.freed.Load() > frees {
				return
			}
		}
	}()
}

func (d *queuedDevice) NewStream() (Stream, error) {
	s, err := d.Device.NewStream()
	if err == nil {
		d.hold(s)
	}
	return s, err
}

// track counts ts in use from before enqueue until the work it enqueues on
// s has run.
func (d *queuedDevice) track(what string, s Stream, enqueue func() error, ts ...Tensor) error {
	d.mu.Lock()
	if what == d.failKernel && d.failSkip > 0 {
		d.failSkip--
	} else if what == d.failKernel {
		d.failKernel = ""
		d.mu.Unlock()
		return errInjected
	}
	w := &queuedWork{what, ts}
	d.pending[w] = true
	gate := d.gateEach
	d.mu.Unlock()
	if gate {
		d.hold(s)
	}
	done := func() error {
		d.mu.Lock()
		delete(d.pending, w)
		d.mu.Unlock()
		return nil
	}
	if err := enqueue(); err != nil {
		done()
		return err
	}
	if hs, ok := s.(*HostStream); !ok {
		done()
	} else if _, err := hs.enqueue(hostOp{control: true, fn: done}); err != nil {
		done()
	}
	return nil
}

func (d *queuedDevice) Free(t Tensor) error {
	if t.ptr == 0 {
		return nil
	}
	defer d.freed.Add(1)
	d.mu.Lock()
	defer d.mu.Unlock()
	for w := range d.pending {
		for _, u := range w.ts {
			if u.ptr < t.ptr+uintptr(t.Bytes()) && t.ptr < u.ptr+uintptr(u.Bytes()) {
				d.early = append(d.early, fmt.Sprintf("%d bytes at %#x freed while a queued %s still uses them", t.Bytes(), t.ptr, w.what))
				d.kept = append(d.kept, t)
				return nil
			}
		}
	}
	return d.Device.Free(t)
}

// earlyFrees lists the frees that came while queued work used the memory.
func (d *queuedDevice) earlyFrees() []string {
	d.mu.Lock()
	defer d.mu.Unlock()
	return append([]string(nil), d.early...)
}

// release unmaps what Free kept; every stream must be drained.
func (d *queuedDevice) release() {
	d.mu.Lock()
	defer d.mu.Unlock()
	for _, t := range d.kept {
		d.Device.Free(t)
	}
	d.kept = nil
}

func (d *queuedDevice) zero(s Stream, t Tensor) error {
	return d.track("zero", s, func() error { return d.Device.zero(s, t) }, t)
}

func (d *queuedDevice) copy(s Stream, dst, src Tensor) error {
	return d.track("copy", s, func() error { return d.Device.copy(s, dst, src) }, dst, src)
}

func (d *queuedDevice) cast(s Stream, dst, src Tensor, scale float32) error {
	return d.track("cast", s, func() error { return d.Device.cast(s, dst, src, scale) }, dst, src)
}

func (d *queuedDevice) copyScaled(s Stream, dst, src Tensor, scale float32) error {
	return d.track("copyScaled", s, func() error { return d.Device.copyScaled(s, dst, src, scale) }, dst, src)
}

func (d *queuedDevice) flatten(s Stream, dst Tensor, segs []flatPiece, scale float32) error {
	return d.track("flatten", s, func() error { return d.Device.flatten(s, dst, segs, scale) }, dst)
}

func (d *queuedDevice) accumulate(s Stream, acc Tensor, segs []flatPiece, first bool, scale float32, flag Tensor) error {
	return d.track("accumulate", s, func() error { return d.Device.accumulate(s, acc, segs, first, scale, flag) }, acc, flag)
}

func (d *queuedDevice) accumulateSquares(s Stream, acc Tensor, seg flatPiece, first bool, scale float32, flag, parts Tensor) error {
	return d.track("accumulateSquares", s, func() error { return d.Device.accumulateSquares(s, acc, seg, first, scale, flag, parts) }, acc, flag, parts)
}

func (d *queuedDevice) chunkSquares(s Stream, x, parts Tensor) error {
	return d.track("chunkSquares", s, func() error { return d.Device.chunkSquares(s, x, parts) }, x, parts)
}

func (d *queuedDevice) sumChunks(s Stream, parts Tensor, ranges []chunkRange, outs Tensor) error {
	return d.track("sumChunks", s, func() error { return d.Device.sumChunks(s, parts, ranges, outs) }, parts, outs)
}

func (d *queuedDevice) optimize(s Stream, kind optKind, b optTensors, ranges []optRange, gscale float32) error {
	return d.track("optimize", s, func() error { return d.Device.optimize(s, kind, b, ranges, gscale) }, b.p, b.g, b.m, b.v, b.vmax, b.out)
}

func (d *queuedDevice) unflatten(s Stream, flat Tensor, segs []flatPiece) error {
	return d.track("unflatten", s, func() error { return d.Device.unflatten(s, flat, segs) }, flat)
}

// queuedComm is a communicator on a queuedDevice whose collectives the
// device's ledger counts. before, if set, runs before each collective is
// issued (a peer's Abort during the call).
type queuedComm struct {
	Comm
	dev    *queuedDevice
	before func()
}

func (c *queuedComm) Device() Device { return c.dev }

func (c *queuedComm) issue(what string, s Stream, call func() error, ts ...Tensor) error {
	if c.before != nil {
		c.before()
	}
	return c.dev.track(what, s, call, ts...)
}

func (c *queuedComm) AllReduce(s Stream, t Tensor, op ReduceOp) error {
	return c.issue("all-reduce", s, func() error { return c.Comm.AllReduce(s, t, op) }, t)
}

func (c *queuedComm) ReduceScatter(s Stream, send, recv Tensor, op ReduceOp) error {
	return c.issue("reduce-scatter", s, func() error { return c.Comm.ReduceScatter(s, send, recv, op) }, send, recv)
}

func (c *queuedComm) AllGather(s Stream, send, recv Tensor) error {
	return c.issue("all-gather", s, func() error { return c.Comm.AllGather(s, send, recv) }, send, recv)
}

func (c *queuedComm) Broadcast(s Stream, t Tensor, root int) error {
	return c.issue("broadcast", s, func() error { return c.Comm.Broadcast(s, t, root) }, t)
}
