package zero

import (
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
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

func (d *failingDevice) flatten(s Stream, dst Tensor, segs []Segment, scale float32) error {
	if err := d.hit(dst); err != nil {
		return err
	}
	return d.Device.flatten(s, dst, segs, scale)
}

func (d *failingDevice) accumulate(s Stream, acc Tensor, segs []Segment, first bool, scale float32, flag Tensor) error {
	if err := d.hit(acc); err != nil {
		return err
	}
	return d.Device.accumulate(s, acc, segs, first, scale, flag)
}

func (d *failingDevice) accumulateSquares(s Stream, acc Tensor, seg Segment, first bool, scale float32, flag, parts Tensor) error {
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

func (d *failingDevice) unflatten(s Stream, flat Tensor, segs []Segment) error {
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
