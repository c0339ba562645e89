package zero

import "golang.org/x/sys/unix"

// Page-locked host memory: the one place that knows which devices have it
// and how much of what it handed out is locked.

// pinnedAllocator is a device with host memory its copies move
// asynchronously: the CUDA device (cuMemHostAlloc, always locked) and the
// host device (mmap, locked with mlock where RLIMIT_MEMLOCK allows).
type pinnedAllocator interface {
	// allocPinned returns count zeroed elements of d and whether they are
	// page-locked.
	allocPinned(count int, d DType) (t Tensor, locked bool, err error)
	freePinned(t Tensor) error
}

// mlockHost page-locks host memory. Tests replace it to refuse, as a low
// RLIMIT_MEMLOCK does.
var mlockHost = unix.Mlock

func (h *hostDevice) allocPinned(count int, d DType) (Tensor, bool, error) {
	t, err := h.Alloc(count, d)
	if err != nil || t.ptr == 0 {
		return t, false, err
	}
	return t, mlockHost(t.hostBytes()) == nil, nil
}

func (h *hostDevice) freePinned(t Tensor) error { return h.Free(t) } // munmap unlocks

// pinnedOf is dev's page-locked memory, or an error naming op.
func pinnedOf(op string, dev Device) (pinnedAllocator, error) {
	if dev == nil {
		return nil, errorf(ErrConfig, "%s: nil device; pass zero.CPU() or a device from zero.CUDA", op)
	}
	if p, ok := dev.(pinnedAllocator); ok {
		return p, nil
	}
	return nil, errorf(ErrDevice, "%s: device %s has no page-locked host memory; use zero.CPU() or a device from zero.CUDA", op, dev.Name())
}

// AllocPinned returns count zeroed elements of d in host memory that dev's
// copies can move asynchronously: page-locked (cudaHostAlloc, portable and
// mapped) for the CUDA device, so offloaded optimizer state, fp32 master
// weights and gradient shards copy at full PCIe speed while the GPU works.
// On the CPU device, "host" and "device" are both RAM: it is an aligned
// allocation, locked where RLIMIT_MEMLOCK allows, so the offload path runs
// unchanged on every machine. Free it with FreePinned.
func AllocPinned(dev Device, count int, d DType) (Tensor, error) {
	if count < 0 || !d.valid() {
		return Tensor{}, errorf(ErrConfig, "AllocPinned(%d, %v): need a count ≥ 0 and a dtype of fp32, bf16 or fp16", count, d)
	}
	p, err := pinnedOf("AllocPinned", dev)
	if err != nil {
		return Tensor{}, err
	}
	t, _, err := p.allocPinned(count, d)
	return t, err
}

// FreePinned frees memory from AllocPinned on the same device.
func FreePinned(dev Device, t Tensor) error {
	p, err := pinnedOf("FreePinned", dev)
	if err != nil {
		return err
	}
	return p.freePinned(t)
}

// hostMemory allocates an offloading engine's host memory, page-locked
// where it can, and counts the bytes it holds and how many are locked. One
// serves every component that offloads (the optimizer's offload, stage 3's
// parameter shard), so Stats.HostBytes is one count.
type hostMemory struct {
	dev    pinnedAllocator
	bytes  int64           // held
	locked int64           // of which page-locked
	pinned map[uintptr]int // locked bytes of each allocation
}

func newHostMemory(dev Device) (*hostMemory, error) {
	p, err := pinnedOf("Offload", dev)
	if err != nil {
		return nil, err
	}
	return &hostMemory{dev: p, pinned: map[uintptr]int{}}, nil
}

func (m *hostMemory) Alloc(count int, d DType) (Tensor, error) {
	t, locked, err := m.dev.allocPinned(count, d)
	if err != nil || t.ptr == 0 {
		return t, err
	}
	m.bytes += int64(t.Bytes())
	if locked {
		m.pinned[t.ptr] = t.Bytes()
		m.locked += int64(t.Bytes())
	}
	return t, nil
}

// report fills the step's host figures: every byte held, and the part
// of it that is page-locked.
func (m *hostMemory) report(st *Stats) error {
	st.HostBytes, st.HostPinnedBytes = m.bytes, m.locked
	return nil
}

func (m *hostMemory) Free(t Tensor) error {
	if t.ptr == 0 {
		return nil
	}
	m.bytes -= int64(t.Bytes())
	m.locked -= int64(m.pinned[t.ptr])
	delete(m.pinned, t.ptr)
	return m.dev.freePinned(t)
}
