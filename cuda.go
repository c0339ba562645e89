//go:build cuda

package zero

/*
#cgo LDFLAGS: -ldl -lpthread
#include <stdlib.h>
#include "elementwise.h"
#include "zero_cuda.h"
*/
import "C"

import (
	_ "embed"
	"errors"
	"fmt"
	"runtime"
	"sync"
	"sync/atomic"
	"time"
	"unsafe"
)

// zeroKernels is csrc/kernels.cu compiled ahead of time (make cuda):
// SASS for sm_80 and sm_90, PTX for newer GPUs. Each device loads it once.
//
//go:embed zero_kernels.fatbin
var zeroKernels []byte

func init() {
	C.zc_set_fatbin(unsafe.Pointer(&zeroKernels[0]), C.uint64_t(len(zeroKernels)))
}

// loadDriver loads libcuda.so.1 (or ZERO_CUDA_LIBRARY) and checks its
// version; a missing or too old driver is an error wrapping ErrNoCUDA.
func loadDriver(op string) error {
	var msg [1024]C.char
	code := C.zc_driver_load(nil, &msg[0], C.int(len(msg)))
	switch code {
	case 0:
		return nil
	case C.ZC_ERR_NO_DRIVER:
		return fmt.Errorf("%w: %s: no usable NVIDIA driver: %s; run on a host with the NVIDIA driver (libcuda.so.1), or set ZERO_CUDA_LIBRARY to its path: %w", ErrNoCUDA, op, C.GoString(&msg[0]), cudaErr("dlopen", -1, code))
	case C.ZC_ERR_OLD_DRIVER:
		return fmt.Errorf("%w: %s: %s; update the NVIDIA driver: %w", ErrNoCUDA, op, C.GoString(&msg[0]), cudaErr("cuDriverGetVersion", -1, code))
	}
	return fmt.Errorf("%w: %s: %s: %w", ErrNoCUDA, op, C.GoString(&msg[0]), cudaErr("cuInit", -1, code))
}

// currentContext and setContext read and set the calling OS thread's
// CUDA context (tests; the caller must hold the thread).
func currentContext() (uintptr, error) {
	var c C.uintptr_t
	if code := C.zc_context_current(&c); code != 0 {
		return 0, cudaErr("cuCtxGetCurrent", -1, code)
	}
	return uintptr(c), nil
}

func setContext(c uintptr) error {
	if code := C.zc_context_set(C.uintptr_t(c)); code != 0 {
		return cudaErr("cuCtxSetCurrent", -1, code)
	}
	return nil
}

// DriverVersion returns the CUDA version the NVIDIA driver supports, as
// cuDriverGetVersion does (12040 for CUDA 12.4); zero needs 12000 or more.
func DriverVersion() (int, error) {
	if err := loadDriver("DriverVersion"); err != nil {
		return 0, err
	}
	var v C.int
	C.zc_driver_version(&v)
	return int(v), nil
}

// CUDADeviceCount returns the number of CUDA devices this process sees.
func CUDADeviceCount() (int, error) {
	if err := loadDriver("CUDADeviceCount"); err != nil {
		return 0, err
	}
	var n C.int
	if code := C.zc_device_count(&n); code != 0 {
		return 0, cudaErr("cuDeviceGetCount", -1, code)
	}
	return int(n), nil
}

var cudaDevices struct {
	sync.Mutex
	m map[int]*cudaDevice
}

// CUDA returns the CUDA device with the given ordinal (built with -tags
// cuda; see cuda_stub.go otherwise). The same ordinal always gives the same
// Device. A host without a usable driver gives an error wrapping ErrNoCUDA;
// an ordinal the process does not see, one wrapping ErrDevice (and the CUDA
// error, if any).
//
// zero never allocates or owns the framework's tensors. A Go stack that
// keeps its tensors in CUDA memory and exposes their addresses hands them
// over as they are:
//
//	dev, _ := zero.CUDA(0)                       // the framework's device ordinal
//	stream, _ := zero.CUDAStream(handle, dev)    // its cudaStream_t, as a uintptr
//	grad := zero.RawTensor(ptr, n, zero.BF16)    // its device pointer, as a uintptr
//	ev, err := engine.GradReady(i, grad, stream) // read on that stream, in its order
//
// With gorgonia, ptr is a CUDA-backed tensor's Uintptr() and the stream the
// one its CUDA engine runs on; with a PJRT client, ptr is the buffer's device
// pointer (PJRT_Buffer_UnsafePointer / OpaqueDeviceMemoryDataPointer) and the
// stream the one the client exposes for the device, or a zero stream
// (Device.NewStream, StreamHandle) with events handed back and forth. The
// rules: the memory stays alive and unchanged until the returned event fires
// (work the framework enqueues later on the same stream is ordered after it
// anyway), the stream belongs to the same device, and RawTensor's dtype is
// the tensor's. Host Go slices (Float32s, Halfs) may be copied to and from
// the device (cudaMemcpyDefault), but kernels refuse them with ErrStream: a
// kernel that reads pageable host memory would kill the CUDA context.
func CUDA(ordinal int) (Device, error) {
	n, err := CUDADeviceCount()
	if err != nil {
		return nil, err
	}
	if ordinal < 0 || ordinal >= n {
		return nil, errorf(ErrDevice, "CUDA(%d): this process sees %d CUDA device(s); use an ordinal in [0, %d) (check CUDA_VISIBLE_DEVICES)", ordinal, n, n)
	}
	cudaDevices.Lock()
	defer cudaDevices.Unlock()
	if d := cudaDevices.m[ordinal]; d != nil {
		return d, nil
	}
	var name [256]C.char
	var major, minor, sms C.int
	var mem C.uint64_t
	if code := C.zc_device_props(C.int(ordinal), &name[0], C.int(len(name)), &major, &minor, &mem, &sms); code != 0 {
		return nil, fmt.Errorf("%w: %w", ErrDevice, cudaErr("cuDeviceGetAttribute", ordinal, code))
	}
	d := &cudaDevice{ordinal: ordinal, model: C.GoString(&name[0]), major: int(major), minor: int(minor), totalMem: uint64(mem), sms: int(sms)}
	if cudaDevices.m == nil {
		cudaDevices.m = map[int]*cudaDevice{}
	}
	cudaDevices.m[ordinal] = d
	return d, nil
}

type cudaDevice struct {
	ordinal      int
	model        string
	major, minor int
	totalMem     uint64
	sms          int

	flags pinnedWords // flags that streams wait on for foreign events

	mu     sync.Mutex
	sumsqs []*sumsqScratch // idle, so the norm allocates nothing per step
}

func (d *cudaDevice) getSumsq() *sumsqScratch {
	d.mu.Lock()
	defer d.mu.Unlock()
	if n := len(d.sumsqs); n > 0 {
		sc := d.sumsqs[n-1]
		d.sumsqs = d.sumsqs[:n-1]
		return sc
	}
	return nil
}

func (d *cudaDevice) putSumsq(sc *sumsqScratch) {
	d.mu.Lock()
	d.sumsqs = append(d.sumsqs, sc)
	d.mu.Unlock()
}

// pinnedWords hands out single fp32-sized words of pinned, device-mapped
// host memory, allocated a page at a time and never freed.
type pinnedWords struct {
	mu   sync.Mutex
	free []Tensor
}

func (p *pinnedWords) get(d *cudaDevice) (Tensor, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if len(p.free) == 0 {
		page, _, err := d.allocPinned(1024, FP32)
		if err != nil {
			return Tensor{}, err
		}
		for i := range page.count {
			p.free = append(p.free, page.slice(i, 1))
		}
	}
	t := p.free[len(p.free)-1]
	p.free = p.free[:len(p.free)-1]
	return t, nil
}

func (p *pinnedWords) put(t Tensor) {
	p.mu.Lock()
	p.free = append(p.free, t)
	p.mu.Unlock()
}

// sumsqScratch is the device memory of one sum of squares (partial sums)
// and the pinned double its result lands in.
type sumsqScratch struct {
	part, out Tensor
}

func cudaErr(op string, dev int, code C.int) error {
	return &CUDAError{
		Code:   int(code),
		Name:   C.GoString(C.zc_error_name(code)),
		Text:   C.GoString(C.zc_error_string(code)),
		Op:     op,
		Device: dev,
	}
}

func (d *cudaDevice) err(op string, code C.int) error {
	if code == 0 {
		return nil
	}
	return cudaErr(op, d.ordinal, code)
}

func (d *cudaDevice) Name() string {
	return fmt.Sprintf("cuda:%d (%s, sm_%d%d)", d.ordinal, d.model, d.major, d.minor)
}

func (d *cudaDevice) dev() C.int { return C.int(d.ordinal) }

// memoryStats reads every GPU's memory from NVML; nil when NVML
// is not there (a container without the driver's NVML library).
func (d *cudaDevice) memoryStats() []GPUMemory {
	ms, err := systemNVML.Memory()
	if err != nil {
		return nil
	}
	return ms
}

// cdtype maps a DType to the codes of elementwise.h explicitly, so the two
// numberings may differ.
func cdtype(t DType) C.int {
	switch t {
	case FP32:
		return C.ZERO_F32
	case BF16:
		return C.ZERO_BF16
	case FP16:
		return C.ZERO_F16
	}
	return -1
}

func cop(op ReduceOp) C.int {
	switch op {
	case OpSum:
		return C.ZERO_SUM
	case OpAvg:
		return C.ZERO_AVG
	case OpMax:
		return C.ZERO_MAX
	}
	return -1
}

func (d *cudaDevice) Alloc(count int, t DType) (Tensor, error) {
	if count < 0 || !t.valid() {
		return Tensor{}, errorf(ErrConfig, "Alloc(%d, %v): need a count ≥ 0 and a dtype of fp32, bf16 or fp16", count, t)
	}
	if count == 0 {
		return Tensor{dtype: t}, nil
	}
	var p C.uintptr_t
	if code := C.zc_malloc(d.dev(), C.uint64_t(count*t.Size()), &p); code != 0 {
		return Tensor{}, d.err(fmt.Sprintf("Alloc(%d × %v)", count, t), code)
	}
	return Tensor{ptr: uintptr(p), count: count, dtype: t}, nil
}

func (d *cudaDevice) Free(t Tensor) error {
	if t.ptr == 0 {
		return nil
	}
	if t.keep != nil {
		return errorf(ErrConfig, "Free: tensor at %#x is Go memory, not from %s", t.ptr, d.Name())
	}
	if quarantined(t.ptr, t.Bytes()) {
		return nil
	}
	return d.err("Free", C.zc_free(d.dev(), C.uintptr_t(t.ptr)))
}

func (d *cudaDevice) allocPinned(count int, t DType) (Tensor, bool, error) {
	if count == 0 {
		return Tensor{dtype: t}, true, nil
	}
	var p C.uintptr_t
	if code := C.zc_host_alloc(d.dev(), C.uint64_t(count*t.Size()), &p); code != 0 {
		return Tensor{}, false, d.err(fmt.Sprintf("AllocPinned(%d × %v)", count, t), code)
	}
	return Tensor{ptr: uintptr(p), count: count, dtype: t}, true, nil
}

func (d *cudaDevice) freePinned(t Tensor) error {
	if t.ptr == 0 {
		return nil
	}
	if quarantined(t.ptr, t.Bytes()) {
		return nil
	}
	return d.err("FreePinned", C.zc_host_free(d.dev(), C.uintptr_t(t.ptr)))
}

// memInfo returns the device's free and total memory (cudaMemGetInfo).
func (d *cudaDevice) memInfo() (free, total uint64, err error) {
	var f, t C.uint64_t
	if code := C.zc_mem_info(d.dev(), &f, &t); code != 0 {
		return 0, 0, d.err("cudaMemGetInfo", code)
	}
	return uint64(f), uint64(t), nil
}

// ---- streams and events ----------------------------------------------------

type cudaStream struct {
	dev        *cudaDevice
	h          uintptr
	owned      bool
	closed     atomic.Bool
	foreignErr atomic.Pointer[error] // the first error of a foreign event waited on
}

func (d *cudaDevice) NewStream() (Stream, error) {
	var h C.uintptr_t
	if code := C.zc_stream_create(d.dev(), &h); code != 0 {
		return nil, d.err("NewStream", code)
	}
	return &cudaStream{dev: d, h: uintptr(h), owned: true}, nil
}

// CUDAStream wraps a stream the framework owns: handle is its cudaStream_t
// as an integer (0 is the legacy default stream), dev the device it belongs
// to. Close on the returned Stream synchronises it but does not destroy it.
func CUDAStream(handle uintptr, dev Device) (Stream, error) {
	d, ok := dev.(*cudaDevice)
	if !ok {
		return nil, errorf(ErrStream, "CUDAStream: device %v is not a CUDA device; pass one from zero.CUDA", deviceName(dev))
	}
	return &cudaStream{dev: d, h: handle}, nil
}

// StreamHandle returns the cudaStream_t of a CUDA stream as an integer, to
// hand to a framework or a library.
func StreamHandle(s Stream) (uintptr, error) {
	cs, ok := s.(*cudaStream)
	if !ok {
		return 0, errorf(ErrStream, "StreamHandle: a %T has no CUDA handle", s)
	}
	return cs.h, nil
}

func deviceName(d Device) string {
	if d == nil {
		return "<nil>"
	}
	return d.Name()
}

func (d *cudaDevice) streamOf(s Stream) (*cudaStream, error) {
	cs, ok := s.(*cudaStream)
	if !ok {
		return nil, errorf(ErrStream, "%s got a %T; pass a stream from its NewStream or zero.CUDAStream", d.Name(), s)
	}
	if cs.dev != d {
		return nil, errorf(ErrStream, "%s got a stream of %s; use a stream of the same device", d.Name(), cs.dev.Name())
	}
	if cs.closed.Load() {
		return nil, errorf(ErrClosed, "enqueue on a closed stream of %s", d.Name())
	}
	return cs, nil
}

// checkStream says whether s is a stream of this device.
func (d *cudaDevice) checkStream(s Stream) error {
	_, err := d.streamOf(s)
	return err
}

func (s *cudaStream) record(timing bool) (*cudaEvent, error) {
	if s.closed.Load() {
		return nil, errorf(ErrClosed, "Record on a closed stream of %s", s.dev.Name())
	}
	var h C.uintptr_t
	t := C.int(0)
	if timing {
		t = 1
	}
	if code := C.zc_record(s.dev.dev(), C.uintptr_t(s.h), t, &h); code != 0 {
		return nil, s.dev.err("cudaEventRecord", code)
	}
	return newCUDAEvent(s.dev, uintptr(h), timing), nil
}

// Record records a timed event on the stream.
func (s *cudaStream) Record() (Event, error) { return s.record(true) }

// recordTimed re-records reuse, a timed event of this device, or records a
// new timed one.
func (s *cudaStream) recordTimed(reuse Event) (Event, error) {
	e, ok := reuse.(*cudaEvent)
	if !ok || !e.timing || e.dev != s.dev {
		return s.record(true)
	}
	if s.closed.Load() {
		return nil, errorf(ErrClosed, "Record on a closed stream of %s", s.dev.Name())
	}
	h := C.uintptr_t(e.h)
	code := C.zc_record(s.dev.dev(), C.uintptr_t(s.h), 1, &h)
	runtime.KeepAlive(e)
	if code != 0 {
		return nil, s.dev.err("cudaEventRecord", code)
	}
	return e, nil
}

// recordUntimed re-records reuse, an untimed event of this device, or
// records a new untimed one.
func (s *cudaStream) recordUntimed(reuse Event) (Event, error) {
	e, ok := reuse.(*cudaEvent)
	if !ok || e.timing || e.dev != s.dev {
		return s.record(false)
	}
	if s.closed.Load() {
		return nil, errorf(ErrClosed, "Record on a closed stream of %s", s.dev.Name())
	}
	h := C.uintptr_t(e.h)
	code := C.zc_record(s.dev.dev(), C.uintptr_t(s.h), 0, &h)
	runtime.KeepAlive(e)
	if code != 0 {
		return nil, s.dev.err("cudaEventRecord", code)
	}
	return e, nil
}

func (s *cudaStream) Wait(e Event) error {
	if e == nil {
		return nil
	}
	if s.closed.Load() {
		return errorf(ErrClosed, "Wait on a closed stream of %s", s.dev.Name())
	}
	ce, ok := e.(*cudaEvent)
	if !ok {
		return s.waitForeign(e)
	}
	code := C.zc_stream_wait(s.dev.dev(), C.uintptr_t(s.h), C.uintptr_t(ce.h))
	runtime.KeepAlive(ce)
	return s.dev.err("cuStreamWaitEvent", code)
}

// waitForeign makes the stream wait for an event of another device (a host
// stream's, say) without blocking the caller: the stream waits on a word of
// pinned memory, which a goroutine sets once the event has fired. An error
// of the work before the event cannot fail a CUDA stream; it is kept and
// returned by this stream's next Sync.
func (s *cudaStream) waitForeign(e Event) error {
	flag, err := s.dev.flags.get(s.dev)
	if err != nil {
		return err
	}
	if code := C.zc_stream_wait_flag(s.dev.dev(), C.uintptr_t(s.h), C.uintptr_t(flag.ptr)); code != 0 {
		s.dev.flags.put(flag)
		return s.dev.err("cuStreamWaitValue32", code)
	}
	done, err := s.record(false)
	if err != nil {
		return err // the flag stays out of the pool: the wait may still read it
	}
	go func() {
		if err := e.Sync(); err != nil {
			s.foreignErr.CompareAndSwap(nil, &err)
		}
		atomic.StoreUint32((*uint32)(flag.hostPtr()), 1)
		done.Sync() // the stream has read the flag: it can be reused
		atomic.StoreUint32((*uint32)(flag.hostPtr()), 0)
		s.dev.flags.put(flag)
	}()
	return nil
}

func (s *cudaStream) Sync() error {
	if s.closed.Load() {
		return errorf(ErrClosed, "Sync on a closed stream of %s", s.dev.Name())
	}
	if err := s.dev.err("cuStreamSynchronize", C.zc_stream_sync(s.dev.dev(), C.uintptr_t(s.h))); err != nil {
		return err
	}
	if p := s.foreignErr.Load(); p != nil {
		return *p
	}
	return nil
}

func (s *cudaStream) Close() error {
	if s.closed.Swap(true) {
		return nil
	}
	err := s.dev.err("cudaStreamSynchronize", C.zc_stream_sync(s.dev.dev(), C.uintptr_t(s.h)))
	if s.owned {
		if e := s.dev.err("cudaStreamDestroy", C.zc_stream_destroy(s.dev.dev(), C.uintptr_t(s.h))); err == nil {
			err = e
		}
	}
	return err
}

// cudaEvent is a recorded cudaEvent_t. The handle is destroyed when the
// event is garbage (cudaEventDestroy of a pending event is allowed: CUDA
// releases it once it fires).
type cudaEvent struct {
	dev    *cudaDevice
	h      uintptr
	timing bool
}

type cudaEventHandle struct {
	dev    C.int
	h      C.uintptr_t
	timing bool
}

// timedEventsCollected counts the timed events the garbage collector
// destroyed: a steady state recycles its own (stopwatch) and adds none.
var timedEventsCollected atomic.Int64

func newCUDAEvent(d *cudaDevice, h uintptr, timing bool) *cudaEvent {
	e := &cudaEvent{dev: d, h: h, timing: timing}
	runtime.AddCleanup(e, func(x cudaEventHandle) {
		if x.timing {
			timedEventsCollected.Add(1)
		}
		C.zc_event_destroy(x.dev, x.h)
	}, cudaEventHandle{d.dev(), C.uintptr_t(h), timing})
	return e
}

func (e *cudaEvent) Sync() error {
	code := C.zc_event_sync(e.dev.dev(), C.uintptr_t(e.h))
	runtime.KeepAlive(e)
	return e.dev.err("cudaEventSynchronize", code)
}

func (e *cudaEvent) Done() bool {
	code := C.zc_event_query(e.dev.dev(), C.uintptr_t(e.h))
	runtime.KeepAlive(e)
	return code != 600 // cudaErrorNotReady; an error counts as done (Sync reports it)
}

func (e *cudaEvent) elapsedSince(start Event) (time.Duration, error) {
	s, ok := start.(*cudaEvent)
	if !ok {
		return 0, errorf(ErrStream, "Elapsed: events of different devices")
	}
	if !s.timing || !e.timing {
		return 0, errorf(ErrStream, "Elapsed: an event recorded without timing")
	}
	if err := s.Sync(); err != nil {
		return 0, err
	}
	if err := e.Sync(); err != nil {
		return 0, err
	}
	var ms C.float
	code := C.zc_event_elapsed(e.dev.dev(), C.uintptr_t(s.h), C.uintptr_t(e.h), &ms)
	runtime.KeepAlive(s)
	runtime.KeepAlive(e)
	if code != 0 {
		return 0, e.dev.err("cudaEventElapsedTime", code)
	}
	return time.Duration(float64(ms) * float64(time.Millisecond)), nil
}

// ---- kernels -------------------------------------------------------------------

// deviceOnly rejects Go slices (Float32s, Halfs) as kernel operands: a kernel
// that dereferences pageable host memory kills the CUDA context.
func (d *cudaDevice) deviceOnly(op string, ts ...Tensor) error {
	for _, t := range ts {
		if t.keep != nil && t.count > 0 {
			return errorf(ErrStream, "%s on %s: a tensor is a Go slice in host memory; kernels need device memory (Alloc, or RawTensor of a device pointer) or AllocPinned memory", op, d.Name())
		}
	}
	return nil
}

func (d *cudaDevice) zero(s Stream, t Tensor) error {
	cs, err := d.streamOf(s)
	if err != nil {
		return err
	}
	code := C.zc_memzero(d.dev(), C.uintptr_t(cs.h), C.uintptr_t(t.ptr), C.uint64_t(t.Bytes()))
	runtime.KeepAlive(t.keep)
	return d.err("zero", code)
}

func (d *cudaDevice) copy(s Stream, dst, src Tensor) error {
	if dst.Bytes() != src.Bytes() {
		return errorf(ErrGradSize, "copy of %d bytes into %d bytes", src.Bytes(), dst.Bytes())
	}
	cs, err := d.streamOf(s)
	if err != nil {
		return err
	}
	code := C.zc_memcpy(d.dev(), C.uintptr_t(cs.h), C.uintptr_t(dst.ptr), C.uintptr_t(src.ptr), C.uint64_t(src.Bytes()))
	runtime.KeepAlive(dst.keep)
	runtime.KeepAlive(src.keep)
	return d.err("copy", code)
}

// copyDirected is copy through the direction-named driver calls
// (cuMemcpyDtoHAsync with toHost, cuMemcpyHtoDAsync without), where copy
// lets unified addressing find the direction: the yardstick the GPU
// runner times the engine's copies of page-locked memory against
// (BenchmarkCUDAOffloadCopy).
func (d *cudaDevice) copyDirected(s Stream, dst, src Tensor, toHost bool) error {
	if dst.Bytes() != src.Bytes() {
		return errorf(ErrGradSize, "copy of %d bytes into %d bytes", src.Bytes(), dst.Bytes())
	}
	cs, err := d.streamOf(s)
	if err != nil {
		return err
	}
	dir := C.int(0)
	if toHost {
		dir = 1
	}
	code := C.zc_memcpy_directed(d.dev(), C.uintptr_t(cs.h), C.uintptr_t(dst.ptr), C.uintptr_t(src.ptr), C.uint64_t(src.Bytes()), dir)
	runtime.KeepAlive(dst.keep)
	runtime.KeepAlive(src.keep)
	return d.err("copyDirected", code)
}

// kernelInfo is one kernel of the fatbin as the driver loaded it on a
// device: what its compiled code costs each thread and block.
type kernelInfo struct {
	Name        string `json:"name"`
	Regs        int    `json:"registers"`      // per thread
	LocalBytes  int    `json:"local_bytes"`    // per thread: spills and stack
	SharedBytes int    `json:"shared_bytes"`   // static, per block
	ConstBytes  int    `json:"const_bytes"`    // per module
	MaxThreads  int    `json:"max_threads"`    // the largest block it launches with
	PTX         int    `json:"ptx_version"`    // major*10+minor
	Binary      int    `json:"binary_version"` // the SASS run: major*10+minor
}

// kernels loads every kernel of the fatbin on d and reads its attributes
// (cuFuncGetAttribute): the GPU runner records them, so no CUDA toolkit is
// needed to know the registers and spills of the code the driver runs.
func (d *cudaDevice) kernels() ([]kernelInfo, error) {
	n := int(C.zc_kernel_count())
	out := make([]kernelInfo, n)
	var name [64]C.char
	var attrs [C.ZC_KATTR_N]C.int
	for id := range out {
		if code := C.zc_kernel_info(d.dev(), C.int(id), &name[0], C.int(len(name)), &attrs[0]); code != 0 {
			return nil, d.err("kernel "+C.GoString(&name[0]), code)
		}
		out[id] = kernelInfo{Name: C.GoString(&name[0]), Regs: int(attrs[C.ZC_KATTR_REGS]), LocalBytes: int(attrs[C.ZC_KATTR_LOCAL]),
			SharedBytes: int(attrs[C.ZC_KATTR_SHARED]), ConstBytes: int(attrs[C.ZC_KATTR_CONST]),
			MaxThreads: int(attrs[C.ZC_KATTR_MAX_THREADS]), PTX: int(attrs[C.ZC_KATTR_PTX]), Binary: int(attrs[C.ZC_KATTR_BINARY])}
	}
	return out, nil
}

// cSegments checks a batch and lays it out as zc_seg descriptors.
// The C layout of a batch is built in a pooled slice: the launchers copy
// it before they return, and a gradient's path allocates nothing.
var segScratch = sync.Pool{New: func() any { return new([]segment) }}

func (d *cudaDevice) cSegments(op string, segs []flatPiece, buf *[]segment) ([]segment, DType, error) {
	src := segs[0].Src.dtype
	if cap(*buf) < len(segs) {
		*buf = make([]segment, len(segs))
	}
	out := (*buf)[:len(segs)]
	for i, sg := range segs {
		if sg.Src.dtype != src {
			return nil, 0, errorf(ErrDType, "%s: segment %d is %v, segment 0 is %v; batch gradients of one dtype", op, i, sg.Src.dtype, src)
		}
		if sg.Src.keep != nil && sg.Src.count > 0 {
			return nil, 0, d.deviceOnly(op, sg.Src)
		}
		out[i] = segment{ptr: sg.Src.ptr, count: int64(sg.Src.count), offset: int64(sg.Offset)}
	}
	if !src.valid() {
		return nil, 0, errorf(ErrDType, "%s: dtype %v; use fp32, bf16 or fp16", op, src)
	}
	return out, src, nil
}

// Compile-time checks that segment and zc_seg have the same layout.
var (
	_ [unsafe.Sizeof(segment{}) - C.sizeof_zc_seg]byte
	_ [C.sizeof_zc_seg - unsafe.Sizeof(segment{})]byte
)

func (d *cudaDevice) flatten(s Stream, dst Tensor, segs []flatPiece, scale float32) error {
	if len(segs) == 0 {
		return nil
	}
	cs, err := d.streamOf(s)
	if err != nil {
		return err
	}
	if err := d.deviceOnly("flatten", dst); err != nil {
		return err
	}
	if !dst.dtype.valid() {
		return errorf(ErrDType, "flatten into %v; use fp32, bf16 or fp16", dst.dtype)
	}
	buf := segScratch.Get().(*[]segment)
	defer segScratch.Put(buf)
	c, src, err := d.cSegments("flatten", segs, buf)
	if err != nil {
		return err
	}
	code := C.zc_flatten(d.dev(), C.uintptr_t(cs.h), C.uintptr_t(dst.ptr), cdtype(dst.dtype),
		(*C.zc_seg)(unsafe.Pointer(&c[0])), C.int(len(c)), cdtype(src), C.float(scale))
	return d.err("flatten", code)
}

func (d *cudaDevice) accumulate(s Stream, acc Tensor, segs []flatPiece, first bool, scale float32, flag Tensor) error {
	if len(segs) == 0 {
		return nil
	}
	cs, err := d.streamOf(s)
	if err != nil {
		return err
	}
	if !acc.dtype.valid() || (flag.ptr != 0 && flag.dtype != FP32) {
		return errorf(ErrDType, "accumulate into %v with a %v flag; use an fp32, bf16 or fp16 accumulator and an fp32 flag",
			acc.dtype, flag.dtype)
	}
	if err := d.deviceOnly("accumulate", acc, flag); err != nil {
		return err
	}
	buf := segScratch.Get().(*[]segment)
	defer segScratch.Put(buf)
	c, src, err := d.cSegments("accumulate", segs, buf)
	if err != nil {
		return err
	}
	f := C.int(0)
	if first {
		f = 1
	}
	code := C.zc_accumulate(d.dev(), C.uintptr_t(cs.h), C.uintptr_t(acc.ptr), cdtype(acc.dtype),
		(*C.zc_seg)(unsafe.Pointer(&c[0])), C.int(len(c)), cdtype(src), f, C.float(scale), C.uintptr_t(flag.ptr), 0)
	return d.err("accumulate", code)
}

func (d *cudaDevice) cast(s Stream, dst, src Tensor, scale float32) error {
	if dst.count != src.count {
		return errorf(ErrGradSize, "cast of %d elements into %d", src.count, dst.count)
	}
	if !dst.dtype.valid() || !src.dtype.valid() {
		return errorf(ErrDType, "cast of %v into %v; use fp32, bf16 or fp16", src.dtype, dst.dtype)
	}
	cs, err := d.streamOf(s)
	if err != nil {
		return err
	}
	if err := d.deviceOnly("cast", dst, src); err != nil {
		return err
	}
	code := C.zc_cast(d.dev(), C.uintptr_t(cs.h), C.uintptr_t(dst.ptr), cdtype(dst.dtype), C.uintptr_t(src.ptr),
		cdtype(src.dtype), C.int64_t(src.count), C.float(scale))
	return d.err("cast", code)
}

func (d *cudaDevice) optimize(s Stream, kind optKind, b optTensors, ranges []optRange, gscale float32) error {
	if len(ranges) == 0 {
		return nil
	}
	cs, err := d.streamOf(s)
	if err != nil {
		return err
	}
	if err := d.deviceOnly("optimize", b.p, b.g, b.m, b.v, b.vmax, b.out); err != nil {
		return err
	}
	code := C.zc_optimize(d.dev(), C.uintptr_t(cs.h), cbool(kind == optSGD), C.uintptr_t(b.p.ptr), C.uintptr_t(b.g.ptr),
		C.uintptr_t(b.m.ptr), C.uintptr_t(b.v.ptr), C.uintptr_t(b.vmax.ptr), C.uintptr_t(b.out.ptr), cdtype(b.out.dtype),
		(*C.zero_opt_range)(unsafe.Pointer(&ranges[0])), C.int(len(ranges)), C.float(gscale))
	return d.err("optimize", code)
}

func (d *cudaDevice) unflatten(s Stream, flat Tensor, segs []flatPiece) error {
	if len(segs) == 0 {
		return nil
	}
	cs, err := d.streamOf(s)
	if err != nil {
		return err
	}
	if err := d.deviceOnly("unflatten", flat); err != nil {
		return err
	}
	buf := segScratch.Get().(*[]segment)
	defer segScratch.Put(buf)
	c, src, err := d.cSegments("unflatten", segs, buf)
	if err != nil {
		return err
	}
	if src != flat.dtype {
		return errorf(ErrDType, "unflatten of %v into %v; one dtype", flat.dtype, src)
	}
	code := C.zc_unflatten(d.dev(), C.uintptr_t(cs.h), C.uintptr_t(flat.ptr), cdtype(flat.dtype), (*C.zc_seg)(unsafe.Pointer(&c[0])), C.int(len(c)))
	return d.err("unflatten", code)
}

// copyScaled copies fp32 between a Go slice and device memory, times
// scale. Kernels cannot touch a Go slice, so a scale other than 1 runs on
// the device through a temporary buffer, freed once the stream has synced.
func (d *cudaDevice) copyScaled(s Stream, dst, src Tensor, scale float32) error {
	if dst.dtype != FP32 || src.dtype != FP32 {
		return errorf(ErrDType, "copyScaled of %v into %v; it copies fp32", src.dtype, dst.dtype)
	}
	if dst.count != src.count {
		return errorf(ErrGradSize, "copyScaled of %d elements into %d", src.count, dst.count)
	}
	hostDst, hostSrc := dst.keep != nil, src.keep != nil
	switch {
	case scale == 1:
		return d.copy(s, dst, src)
	case !hostDst && !hostSrc:
		return d.cast(s, dst, src, scale)
	}
	tmp, err := d.Alloc(src.count, FP32)
	if err != nil {
		return err
	}
	if hostDst {
		err = d.cast(s, tmp, src, scale)
		if err == nil {
			err = d.copy(s, dst, tmp)
		}
	} else {
		err = d.copy(s, tmp, src)
		if err == nil {
			err = d.cast(s, dst, tmp, scale)
		}
	}
	serr := s.Sync()
	if err == nil {
		err = serr
	}
	freeSynced(d, tmp, err == nil, s)
	return err
}

// sumSquares writes the sum of squares of x to *out, in one pass over the
// whole tensor: not the norm's order (norm.go), kept as the benchmarks'
// and tests' reference for the chunked kernels. The result comes back
// through a pinned double and an explicit sync of s (not of the device);
// the scratch memory comes from a pool, so a step allocates nothing.
func (d *cudaDevice) sumSquares(s Stream, x Tensor, out *float64) error {
	if x.dtype != FP32 {
		return errorf(ErrDType, "sumSquares of %v; it takes the fp32 shard", x.dtype)
	}
	cs, err := d.streamOf(s)
	if err != nil {
		return err
	}
	if err := d.deviceOnly("sumSquares", x); err != nil {
		return err
	}
	sc := d.getSumsq()
	if sc == nil {
		sc = &sumsqScratch{}
		if sc.part, err = d.Alloc(2*(C.ZC_SUMSQ_MAX_BLOCKS+1), FP32); err != nil {
			return err
		}
		if sc.out, _, err = d.allocPinned(2, FP32); err != nil {
			d.Free(sc.part)
			return err
		}
	}
	code := C.zc_sumsq(d.dev(), C.uintptr_t(cs.h), C.uintptr_t(x.ptr), C.int64_t(x.count), C.uintptr_t(sc.part.ptr), C.uintptr_t(sc.out.ptr))
	if err := d.err("sumSquares", code); err != nil {
		return err
	}
	if err := cs.Sync(); err != nil {
		return err
	}
	*out = *(*float64)(sc.out.hostPtr())
	d.putSumsq(sc)
	return nil
}

// ---- the norm's chunk sums of squares --------------------------------------------

// zcChunk is the accumulate kernels' chunk (ZC_CHUNK elements, a block's):
// block k of a one-segment landing sums the norm's chunk k, so it must be
// normChunk (TestCUDANormChunkIsTheKernelsBlock).
const zcChunk = C.ZC_CHUNK

// zcThreads is the threads of a block every launcher starts, the spin
// kernel's excepted.
const zcThreads = C.ZC_THREADS

// Compile-time checks that chunkRange and zc_crange have the same layout.
var (
	_ [unsafe.Sizeof(chunkRange{}) - C.sizeof_zc_crange]byte
	_ [C.sizeof_zc_crange - unsafe.Sizeof(chunkRange{})]byte
)

// checkSums is checkParts for the kernels: the float64 sums must also be
// 8-byte aligned, as a GPU faults on a double at any other address.
func checkSums(op string, sums Tensor, n int) error {
	if err := checkParts(op, sums, n); err != nil {
		return err
	}
	if sums.ptr%8 != 0 {
		return errorf(ErrGradSize, "%s: sums at %#x; float64s need an 8-byte aligned address (slice the fp32 tensor at an even element)", op, sums.ptr)
	}
	return nil
}

// accumulateSquares is accumulate of the one segment seg that also writes
// the sums of squares of the values it stored, chunk k (seg's elements
// [k·normChunk, (k+1)·normChunk)) into the float64 at parts' words 2k, 2k+1:
// block k of the launch sums what it stored, read back from L2. The bits are
// chunkSquares' for the same values.
func (d *cudaDevice) accumulateSquares(s Stream, acc Tensor, seg flatPiece, first bool, scale float32, flag, parts Tensor) error {
	const op = "accumulateSquares"
	cs, err := d.streamOf(s)
	if err != nil {
		return err
	}
	if !acc.dtype.valid() || !seg.Src.dtype.valid() || (flag.ptr != 0 && flag.dtype != FP32) {
		return errorf(ErrDType, "%s of %v into %v with a %v flag; use an fp32, bf16 or fp16 source and accumulator and an fp32 flag",
			op, seg.Src.dtype, acc.dtype, flag.dtype)
	}
	if seg.Offset < 0 || seg.Offset+seg.Src.count > acc.count {
		return errorf(ErrGradSize, "%s of %d elements at %d into %d", op, seg.Src.count, seg.Offset, acc.count)
	}
	if err := checkSums(op, parts, chunksOf(seg.Src.count)); err != nil {
		return err
	}
	if err := d.deviceOnly(op, acc, seg.Src, flag, parts); err != nil {
		return err
	}
	if seg.Src.count == 0 {
		return nil
	}
	buf := segScratch.Get().(*[]segment)
	defer segScratch.Put(buf)
	if cap(*buf) < 1 {
		*buf = make([]segment, 1)
	}
	c := (*buf)[:1]
	c[0] = segment{ptr: seg.Src.ptr, count: int64(seg.Src.count), offset: int64(seg.Offset)}
	code := C.zc_accumulate(d.dev(), C.uintptr_t(cs.h), C.uintptr_t(acc.ptr), cdtype(acc.dtype),
		(*C.zc_seg)(unsafe.Pointer(&c[0])), 1, cdtype(seg.Src.dtype), cbool(first), C.float(scale), C.uintptr_t(flag.ptr),
		C.uintptr_t(parts.ptr))
	return d.err(op, code)
}

// chunkSquares writes the sums of squares of x (fp32, bf16 or fp16, read as
// it is: no widened copy) per chunk of normChunk elements into parts, the
// bits accumulateSquares gives for the same values.
func (d *cudaDevice) chunkSquares(s Stream, x, parts Tensor) error {
	const op = "chunkSquares"
	cs, err := d.streamOf(s)
	if err != nil {
		return err
	}
	if !x.dtype.valid() {
		return errorf(ErrDType, "%s of %v; use fp32, bf16 or fp16", op, x.dtype)
	}
	if err := checkSums(op, parts, chunksOf(x.count)); err != nil {
		return err
	}
	if err := d.deviceOnly(op, x, parts); err != nil {
		return err
	}
	code := C.zc_chunk_squares(d.dev(), C.uintptr_t(cs.h), C.uintptr_t(x.ptr), cdtype(x.dtype), C.int64_t(x.count), C.uintptr_t(parts.ptr))
	return d.err(op, code)
}

// sumChunks writes outs[i] (a float64, two fp32 words) = the sum of parts'
// float64s ranges[i].lo..hi-1, one block per range, in zc_sumsq_final's
// order: thread t adds the range's sums t, t+256, ... in order, then a fixed
// tree over the 256 threads. Valid once s has synced.
func (d *cudaDevice) sumChunks(s Stream, parts Tensor, ranges []chunkRange, outs Tensor) error {
	const op = "sumChunks"
	cs, err := d.streamOf(s)
	if err != nil {
		return err
	}
	// the ranges as the kernel reads them (chunkRange's fields are device.go's)
	var cr []C.zc_crange
	if len(ranges) > 0 {
		cr = unsafe.Slice((*C.zc_crange)(unsafe.Pointer(&ranges[0])), len(ranges))
	}
	top := 0
	for _, r := range cr {
		if r.lo < 0 || r.lo > r.hi {
			return errorf(ErrGradSize, "%s: range [%d, %d); pass lo ≤ hi, both ≥ 0", op, r.lo, r.hi)
		}
		top = max(top, int(r.hi))
	}
	if err := errors.Join(checkSums(op, parts, top), checkSums(op, outs, len(cr))); err != nil {
		return err
	}
	if err := d.deviceOnly(op, parts, outs); err != nil {
		return err
	}
	if len(cr) == 0 {
		return nil
	}
	code := C.zc_sum_chunks(d.dev(), C.uintptr_t(cs.h), C.uintptr_t(parts.ptr), &cr[0], C.int(len(cr)), C.uintptr_t(outs.ptr))
	return d.err(op, code)
}

// reduce is the in-process reduce-scatter: for each output j,
// dsts[j][i] = op over k of srcs[k][j·count + i], in rank order (one launch).
func (d *cudaDevice) reduce(s Stream, dsts, srcs []uintptr, dt DType, op ReduceOp, count int) error {
	cs, err := d.streamOf(s)
	if err != nil {
		return err
	}
	if len(dsts) == 0 || len(srcs) == 0 || count == 0 {
		return nil
	}
	cd, csrc := cPtrs(dsts), cPtrs(srcs)
	return d.err(fmt.Sprintf("reduce(%d × %d × %v, %v)", len(srcs), count, dt, op),
		C.zc_reduce(d.dev(), C.uintptr_t(cs.h), &cd[0], C.int(len(cd)), &csrc[0], C.int(len(csrc)), cdtype(dt), cop(op), C.int64_t(count)))
}

// allReduce is the fused in-place all-reduce of the in-process group over
// bufs (one launch).
func (d *cudaDevice) allReduce(s Stream, bufs []uintptr, dt DType, op ReduceOp, count int) error {
	cs, err := d.streamOf(s)
	if err != nil {
		return err
	}
	if len(bufs) == 0 || count == 0 {
		return nil
	}
	cb := cPtrs(bufs)
	return d.err(fmt.Sprintf("allReduce(%d × %d × %v, %v)", len(bufs), count, dt, op),
		C.zc_allreduce(d.dev(), C.uintptr_t(cs.h), &cb[0], C.int(len(cb)), cdtype(dt), cop(op), C.int64_t(count)))
}

func cPtrs(p []uintptr) []C.uintptr_t {
	out := make([]C.uintptr_t, len(p))
	for i, v := range p {
		out[i] = C.uintptr_t(v)
	}
	return out
}

// cudaSpin enqueues a kernel that keeps s busy for about d (tests).
func cudaSpin(s Stream, d time.Duration) error {
	cs, ok := s.(*cudaStream)
	if !ok {
		return errorf(ErrStream, "cudaSpin: a %T is not a CUDA stream", s)
	}
	return cs.dev.err("spin", C.zc_spin(cs.dev.dev(), C.uintptr_t(cs.h), C.int64_t(d.Nanoseconds())))
}
