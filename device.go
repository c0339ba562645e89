package zero

import (
	"errors"
	"runtime"
	"sync"
	"sync/atomic"
	"unsafe"

	"golang.org/x/sys/unix"
)

// Device is where buffers live and kernels run: the host (the default) or,
// with -tags cuda, a GPU. The engine talks to memory and kernels only
// through it, so the CUDA path slots in behind the same calls.
type Device interface {
	// Name says which device this is, for messages: "cpu", "cuda:0 (…)".
	Name() string
	// NewStream returns a new stream of this device.
	NewStream() (Stream, error)
	// Alloc returns count zeroed elements of d, aligned to 64 bytes.
	Alloc(count int, d DType) (Tensor, error)
	// Free releases memory from Alloc; freeing a zero Tensor does nothing.
	Free(t Tensor) error

	// checkStream says whether s is a stream of this device.
	checkStream(s Stream) error
	// memoryStats reads the device memory from NVML (nil on the host).
	memoryStats() []GPUMemory

	// The kernels below enqueue on s and return at once.
	zero(s Stream, t Tensor) error
	copy(s Stream, dst, src Tensor) error
	flatten(s Stream, dst Tensor, segs []flatPiece, scale float32) error
	accumulate(s Stream, acc Tensor, segs []flatPiece, first bool, scale float32, flag Tensor) error
	cast(s Stream, dst, src Tensor, scale float32) error
	// copyScaled copies fp32 elements between host memory (a Go slice)
	// and the device's, times scale; the copy is done when s syncs.
	copyScaled(s Stream, dst, src Tensor, scale float32) error
	// accumulateSquares is accumulate of the one segment seg that also
	// writes the sum of squares of the values it stored, per chunk of
	// normChunk elements from seg.Offset, into parts (see checkParts):
	// what chunkSquares gives afterwards, bit for bit.
	accumulateSquares(s Stream, acc Tensor, seg flatPiece, first bool, scale float32, flag, parts Tensor) error
	// chunkSquares writes the chunk sums of squares of x (any dtype, its
	// values widened to fp32) into parts, chunk k from element k·normChunk.
	chunkSquares(s Stream, x, parts Tensor) error
	// sumChunks writes into outs (float64s, as parts) the sum of the chunk
	// sums ranges[i] of parts, for every i, in the device's fixed order.
	sumChunks(s Stream, parts Tensor, ranges []chunkRange, outs Tensor) error
	// optimize runs one fused optimizer pass over the ranges of the fp32
	// master shard b.p: AdamW or SGD (elementwise.h), the gradient scaled
	// by gscale, the new parameters cast into b.out.
	optimize(s Stream, kind optKind, b optTensors, ranges []optRange, gscale float32) error
	// unflatten copies flat buffer elements into the segments' memory:
	// seg.Src[i] = flat[seg.Offset+i], in flat's dtype.
	unflatten(s Stream, flat Tensor, segs []flatPiece) error
}

// GPUMemory is one GPU's memory as NVML reports it, in bytes (NVML is
// compiled only with -tags cuda).
type GPUMemory struct {
	Index int    // NVML's device index
	Name  string // e.g. "NVIDIA H100 80GB HBM3"
	UUID  string // "GPU-…"
	Total uint64 // bytes of device memory
	Used  uint64 // bytes in use, by every process
	Free  uint64 // bytes free
}

// chunkRange is a run [lo, hi) of a parts tensor's chunk sums.
type chunkRange struct{ lo, hi int }

// checkParts says whether parts can hold n float64s: chunk sums of squares
// live in fp32 tensors of two words per float64, as the device allocates
// no other element type.
func checkParts(op string, parts Tensor, n int) error {
	if parts.dtype != FP32 || parts.count < 2*n {
		return errorf(ErrGradSize, "%s: %d %v elements for %d sums; pass an fp32 tensor of 2 elements per sum", op, parts.count, parts.dtype, n)
	}
	return nil
}

// flatPiece places a source tensor at Offset elements into a flat buffer.
type flatPiece struct {
	Src    Tensor // the elements to place
	Offset int    // where the first one goes, in elements of the buffer
}

// Segment was a flatPiece, exported though no exported API takes one.
//
// Deprecated: nothing outside the package can use it; it goes at the next
// release.
type Segment = flatPiece

// CPU returns the host device: buffers in RAM, kernels in host C, streams
// run by goroutines.
func CPU() Device { return hostDev }

var hostDev = &hostDevice{}

type hostDevice struct {
	mu    sync.Mutex
	maps  map[uintptr][]byte // aligned address -> whole mapping
	count atomic.Uint64
}

func (*hostDevice) Name() string { return "cpu" }

func (*hostDevice) NewStream() (Stream, error) { return NewHostStream(), nil }

// staggerStep offsets successive allocations by an odd multiple of 64 bytes,
// so buffers of different ranks do not sit at the same address modulo a
// large power of two (cache-set and 4K aliasing cost 16-32% on the fused
// all-reduce here).
const staggerStep = 17 * 64

// staggerAllocs is switched off only by the benchmark that measures it.
var staggerAllocs = true

func (h *hostDevice) Alloc(count int, d DType) (Tensor, error) {
	if count < 0 || !d.valid() {
		return Tensor{}, errorf(ErrConfig, "Alloc(%d, %v): need a count ≥ 0 and a dtype of fp32, bf16 or fp16", count, d)
	}
	if count == 0 {
		return Tensor{dtype: d}, nil
	}
	stagger := 0
	if staggerAllocs {
		stagger = int(h.count.Add(1)%64) * staggerStep
	}
	size := count*d.Size() + stagger
	mem, err := unix.Mmap(-1, 0, size, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
	if errors.Is(err, unix.ENOMEM) {
		return Tensor{}, errorf(ErrOutOfMemory, "Alloc: mmap of %d bytes: %v; lower BucketBytes, StagingBuffers or the model size, or free host memory", size, err)
	}
	if err != nil {
		return Tensor{}, errorf(ErrConfig, "Alloc: mmap of %d bytes: %v; lower BucketBytes or the model size", size, err)
	}
	_ = unix.Madvise(mem, unix.MADV_HUGEPAGE) // best effort: THP may be off
	ptr := uintptr(unsafe.Pointer(&mem[stagger]))
	h.mu.Lock()
	if h.maps == nil {
		h.maps = map[uintptr][]byte{}
	}
	h.maps[ptr] = mem
	h.mu.Unlock()
	return Tensor{ptr: ptr, count: count, dtype: d}, nil
}

func (h *hostDevice) Free(t Tensor) error {
	if t.ptr == 0 {
		return nil
	}
	h.mu.Lock()
	mem, ok := h.maps[t.ptr]
	delete(h.maps, t.ptr)
	h.mu.Unlock()
	if !ok {
		return errorf(ErrConfig, "Free: tensor at %#x was not allocated by the cpu device", t.ptr)
	}
	if quarantined(uintptr(unsafe.Pointer(&mem[0])), len(mem)) {
		return nil
	}
	return unix.Munmap(mem)
}

func (*hostDevice) memoryStats() []GPUMemory { return nil }

func (*hostDevice) checkStream(s Stream) error {
	hs, err := hostStreamOf(s)
	if err != nil {
		return err
	}
	return hs.usable()
}

func hostStreamOf(s Stream) (*HostStream, error) {
	hs, ok := s.(*HostStream)
	if !ok {
		return nil, errorf(ErrStream, "the cpu device got a %T; pass a stream made by zero.CPU().NewStream()", s)
	}
	return hs, nil
}

// launch runs fn in stream order. fn keeps the Go memory behind its
// tensors alive (keepAlive) until it has run.
func (h *hostDevice) launch(s Stream, fn func() error) error {
	hs, err := hostStreamOf(s)
	if err != nil {
		return err
	}
	return hs.Launch(fn)
}

func (h *hostDevice) zero(s Stream, t Tensor) error {
	return h.launch(s, func() error {
		clear(t.hostBytes())
		keepAlive(t)
		return nil
	})
}

func (h *hostDevice) copy(s Stream, dst, src Tensor) error {
	if dst.Bytes() != src.Bytes() {
		return errorf(ErrGradSize, "copy of %d bytes into %d bytes", src.Bytes(), dst.Bytes())
	}
	return h.launch(s, func() error {
		copy(dst.hostBytes(), src.hostBytes())
		keepAlive(dst, src)
		return nil
	})
}

// segmentsOf lays segs out as the kernels' descriptors.
func segmentsOf(segs []flatPiece) []segment {
	out := make([]segment, len(segs))
	for i, sg := range segs {
		out[i] = segment{ptr: sg.Src.ptr, count: int64(sg.Src.count), offset: int64(sg.Offset)}
	}
	return out
}

func (h *hostDevice) flatten(s Stream, dst Tensor, segs []flatPiece, scale float32) error {
	if len(segs) == 0 {
		return nil
	}
	cs := segmentsOf(segs)
	return h.launch(s, func() error {
		flattenHost(dst.ptr, dst.dtype, cs, segs[0].Src.dtype, scale)
		keepAliveSegments(segs)
		keepAlive(dst)
		return nil
	})
}

func (h *hostDevice) accumulate(s Stream, acc Tensor, segs []flatPiece, first bool, scale float32, flag Tensor) error {
	if len(segs) == 0 {
		return nil
	}
	if !acc.dtype.valid() || (flag.ptr != 0 && flag.dtype != FP32) {
		return errorf(ErrDType, "accumulate into %v with a %v flag; use an fp32, bf16 or fp16 accumulator and an fp32 flag",
			acc.dtype, flag.dtype)
	}
	cs := segmentsOf(segs)
	return h.launch(s, func() error {
		accumulateHost(acc.ptr, acc.dtype, cs, segs[0].Src.dtype, first, scale, flag.ptr)
		keepAliveSegments(segs)
		keepAlive(acc, flag)
		return nil
	})
}

func (h *hostDevice) cast(s Stream, dst, src Tensor, scale float32) error {
	if dst.count != src.count {
		return errorf(ErrGradSize, "cast of %d elements into %d", src.count, dst.count)
	}
	return h.launch(s, func() error {
		castHost(dst.ptr, dst.dtype, src.ptr, src.dtype, src.count, scale)
		keepAlive(dst, src)
		return nil
	})
}

func (h *hostDevice) copyScaled(s Stream, dst, src Tensor, scale float32) error {
	if dst.dtype != FP32 || src.dtype != FP32 {
		return errorf(ErrDType, "copyScaled of %v into %v; it copies fp32", src.dtype, dst.dtype)
	}
	return h.cast(s, dst, src, scale)
}

func (h *hostDevice) accumulateSquares(s Stream, acc Tensor, seg flatPiece, first bool, scale float32, flag, parts Tensor) error {
	if !acc.dtype.valid() || (flag.ptr != 0 && flag.dtype != FP32) {
		return errorf(ErrDType, "accumulateSquares into %v with a %v flag; use an fp32, bf16 or fp16 accumulator and an fp32 flag",
			acc.dtype, flag.dtype)
	}
	if seg.Offset < 0 || seg.Offset+seg.Src.count > acc.count {
		return errorf(ErrGradSize, "accumulateSquares of %d elements at %d into %d", seg.Src.count, seg.Offset, acc.count)
	}
	if err := checkParts("accumulateSquares", parts, chunksOf(seg.Src.count)); err != nil {
		return err
	}
	cs := segmentsOf([]flatPiece{seg})[0]
	return h.launch(s, func() error {
		accumulateSquaresHost(acc.ptr, acc.dtype, cs, seg.Src.dtype, first, scale, flag.ptr, parts.ptr)
		keepAlive(acc, seg.Src, flag, parts)
		return nil
	})
}

func (h *hostDevice) chunkSquares(s Stream, x, parts Tensor) error {
	if !x.dtype.valid() {
		return errorf(ErrDType, "chunkSquares of %v; use fp32, bf16 or fp16", x.dtype)
	}
	if err := checkParts("chunkSquares", parts, chunksOf(x.count)); err != nil {
		return err
	}
	return h.launch(s, func() error {
		chunkSquaresHost(x.ptr, x.dtype, x.count, parts.ptr)
		keepAlive(x, parts)
		return nil
	})
}

// sumChunks adds each range's chunk sums in chunk order.
func (h *hostDevice) sumChunks(s Stream, parts Tensor, ranges []chunkRange, outs Tensor) error {
	top := 0
	for _, r := range ranges {
		if r.lo < 0 || r.lo > r.hi {
			return errorf(ErrGradSize, "sumChunks: range [%d, %d)", r.lo, r.hi)
		}
		top = max(top, r.hi)
	}
	if err := errors.Join(checkParts("sumChunks", parts, top), checkParts("sumChunks", outs, len(ranges))); err != nil {
		return err
	}
	rs := append([]chunkRange(nil), ranges...) // the caller reuses its slice
	return h.launch(s, func() error {
		sums, out := float64s(parts), float64s(outs)
		for i, r := range rs {
			total := 0.0
			for _, x := range sums[r.lo:r.hi] {
				total += x
			}
			out[i] = total
		}
		keepAlive(parts, outs)
		return nil
	})
}

// float64s views host memory of fp32 words as float64s (chunk sums).
func float64s(t Tensor) []float64 {
	if t.count < 2 {
		return nil
	}
	return unsafe.Slice((*float64)(t.hostPtr()), t.count/2)
}

func (h *hostDevice) optimize(s Stream, kind optKind, b optTensors, ranges []optRange, gscale float32) error {
	if len(ranges) == 0 {
		return nil
	}
	bufs := optBuffers{p: b.p.ptr, g: b.g.ptr, m: b.m.ptr, v: b.v.ptr, vmax: b.vmax.ptr, buf: b.m.ptr, out: b.out.ptr, outType: b.out.dtype}
	rs := append([]optRange(nil), ranges...) // the caller reuses its slice
	n := b.p.count
	return h.launch(s, func() error {
		if kind == optAdamW {
			adamwHost(bufs, rs, gscale, n)
		} else {
			sgdHost(bufs, rs, gscale, n)
		}
		keepAlive(b.p, b.g, b.m, b.v, b.vmax, b.out)
		return nil
	})
}

func (h *hostDevice) unflatten(s Stream, flat Tensor, segs []flatPiece) error {
	if len(segs) == 0 {
		return nil
	}
	for i, sg := range segs {
		if sg.Src.dtype != flat.dtype {
			return errorf(ErrDType, "unflatten: segment %d is %v, the flat buffer %v", i, sg.Src.dtype, flat.dtype)
		}
	}
	cs := segmentsOf(segs)
	return h.launch(s, func() error {
		unflattenHost(flat.ptr, flat.dtype, cs)
		keepAliveSegments(segs)
		keepAlive(flat)
		return nil
	})
}

// keepAlive marks the Go memory behind tensors as used until this point,
// so it is not collected while a queued kernel still reads it.
func keepAlive(ts ...Tensor) {
	for _, t := range ts {
		runtime.KeepAlive(t.keep)
	}
}

func keepAliveSegments(segs []flatPiece) {
	for _, sg := range segs {
		runtime.KeepAlive(sg.Src.keep)
	}
}

// ---- memory and queued work -----------------------------------------------------

// freeAfter returns t to dev once the work enqueued so far on every one of
// streams has finished, without blocking the caller: a free in stream
// order, on every device. A function that allocates scratch memory, uses
// it on a stream and returns (on success or on any error, a refused
// collective with a copy into it still queued) frees it with this, so no
// order of defers can unmap memory that queued work still writes. CUDA's
// cuMemFree is not relied on to wait. Memory it cannot order after the
// work (a stream that failed to record) is left allocated instead.
func freeAfter(dev Device, t Tensor, streams ...Stream) {
	if t.ptr == 0 || len(streams) == 0 {
		return
	}
	on := streams[0]
	for _, o := range streams[1:] { // on waits for the others' work first
		ev, err := record(o)
		if err == nil {
			err = on.Wait(ev)
		}
		if err != nil && !drained(o) {
			quarantine.add(t)
			return
		}
	}
	if hs, ok := on.(*HostStream); ok {
		if hs.ranAll() { // the usual case, after a Sync: at once, as before
			dev.Free(t)
			return
		}
		// a control item runs even after the stream failed, in its order
		if _, err := hs.enqueue(hostOp{control: true, fn: func() error {
			dev.Free(t) // a failure here is the caller's bug, not the stream's
			return nil
		}}); err == nil {
			return
		}
	} else if ev, err := record(on); err == nil {
		if ev.Done() {
			if ev.Sync() == nil {
				dev.Free(t)
			} else {
				quarantine.add(t) // the device failed: whether the work ran is unknown
			}
			return
		}
		go func() {
			if ev.Sync() == nil {
				dev.Free(t)
			} else {
				quarantine.add(t)
			}
		}()
		return
	}
	if drained(on) { // closed: its Close drained it
		dev.Free(t)
		return
	}
	quarantine.add(t)
}

// freeSynced frees t at once where the caller's Sync of the streams that
// used it succeeded after its last use (nothing queued can still touch
// it), and in stream order (freeAfter) otherwise: on CUDA a free in stream
// order waits for an event recorded after the Sync, and scratch held that
// long would count in the next allocation's high-water mark.
func freeSynced(dev Device, t Tensor, synced bool, streams ...Stream) {
	if synced {
		dev.Free(t)
		return
	}
	freeAfter(dev, t, streams...)
}

// drained waits for s's work and reports whether none of it can still run:
// a host stream's Sync returns only then; a closed stream was drained by
// its Close; another stream whose Sync failed may still hold work.
func drained(s Stream) bool {
	err := s.Sync()
	_, host := s.(*HostStream)
	return err == nil || host || errors.Is(err, ErrClosed)
}

// quarantine holds the memory that a failed collective may still write or
// read after it returned: NCCL aborted mid-flight, an MPI transfer that
// cannot be cancelled, the in-process group's
// peer still copying after this rank's wait timed out, a CUDA group's
// collective enqueued in part. Unmapping such memory could crash the
// process (or corrupt the next allocation there), so every device's Free
// leaves an allocation that holds any of it allocated: a leak, counted,
// and only on those failures.
var quarantine memQuarantine

type memQuarantine struct {
	mu     sync.Mutex
	spans  [][2]uintptr // [lo, hi) of each buffer
	keep   []any        // the Go memory behind some, kept from the collector
	leaked atomic.Int64 // bytes Free left allocated
}

// add quarantines the buffers ts (their Go memory too).
func (q *memQuarantine) add(ts ...Tensor) {
	q.mu.Lock()
	defer q.mu.Unlock()
	for _, t := range ts {
		if t.ptr == 0 {
			continue
		}
		q.spans = append(q.spans, [2]uintptr{t.ptr, t.ptr + uintptr(max(t.Bytes(), 1))})
		if t.keep != nil {
			q.keep = append(q.keep, t.keep)
		}
	}
}

// quarantined reports whether the allocation [ptr, ptr+n) holds
// quarantined memory (which its device's Free must leave allocated), and
// counts it as leaked if so.
func quarantined(ptr uintptr, n int) bool { return quarantine.keeps(ptr, n) }

// keeps is quarantined.
func (q *memQuarantine) keeps(ptr uintptr, n int) bool {
	q.mu.Lock()
	defer q.mu.Unlock()
	for _, sp := range q.spans {
		if sp[0] < ptr+uintptr(n) && ptr < sp[1] {
			q.leaked.Add(int64(n))
			return true
		}
	}
	return false
}
