package zero

// pinnedAllocator is a device that can allocate page-locked host memory
// (the CUDA device: cudaHostAlloc).
type pinnedAllocator interface {
	allocPinned(count int, d DType) (Tensor, error)
	freePinned(t Tensor) error
}

// AllocPinned returns count zeroed elements of d in host memory that dev's
// copies can move asynchronously: page-locked (cudaHostAlloc, portable and
// mapped) for the CUDA device, so offloaded optimizer state, fp32 master
// weights and gradient shards copy at full PCIe speed while the GPU works.
// On the CPU device, "host" and "device" are both RAM: it is an ordinary
// aligned allocation, so the offload path runs unchanged on every machine.
// Free it with FreePinned.
func AllocPinned(dev Device, count int, d DType) (Tensor, error) {
	if count < 0 || !d.valid() {
		return Tensor{}, errorf(ErrConfig, "AllocPinned(%d, %v): need a count ≥ 0 and a dtype of fp32, bf16 or fp16", count, d)
	}
	switch x := dev.(type) {
	case *hostDevice:
		return x.Alloc(count, d)
	case pinnedAllocator:
		return x.allocPinned(count, d)
	case nil:
		return Tensor{}, errorf(ErrConfig, "AllocPinned: nil device; pass zero.CPU() or a device from zero.CUDA")
	}
	return Tensor{}, errorf(ErrDevice, "AllocPinned: device %s has no pinned host memory", dev.Name())
}

// FreePinned frees memory from AllocPinned on the same device.
func FreePinned(dev Device, t Tensor) error {
	switch x := dev.(type) {
	case *hostDevice:
		return x.Free(t)
	case pinnedAllocator:
		return x.freePinned(t)
	case nil:
		return errorf(ErrConfig, "FreePinned: nil device")
	}
	return errorf(ErrDevice, "FreePinned: device %s has no pinned host memory", dev.Name())
}
