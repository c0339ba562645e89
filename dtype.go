package zero

import (
	"fmt"
	"unsafe"
)

// DType is the element type of a gradient, a bucket or a communication
// buffer. The zero value means "unset" (in a Config: the default); the
// codes match ZERO_F32/ZERO_BF16/ZERO_F16 of elementwise.h.
type DType int

// The dtypes of gradients, buckets and buffers.
const (
	FP32 DType = iota + 1 // IEEE binary32
	BF16                  // bfloat16: fp32's exponent, 8 significant bits
	FP16                  // IEEE binary16
)

// Size is the bytes of one element.
func (d DType) Size() int {
	if d == FP32 {
		return 4
	}
	return 2
}

func (d DType) valid() bool { return d == FP32 || d == BF16 || d == FP16 }

// String names the dtype as "fp32", "bf16" or "fp16".
func (d DType) String() string {
	switch d {
	case FP32:
		return "fp32"
	case BF16:
		return "bf16"
	case FP16:
		return "fp16"
	case 0:
		return "unset"
	}
	return fmt.Sprintf("DType(%d)", int(d))
}

// ReduceOp combines values across ranks. The codes match elementwise.h.
type ReduceOp int

// The reductions every communicator supports.
const (
	OpSum ReduceOp = iota // Σ over ranks
	OpAvg                 // Σ over ranks / W (ncclAvg on NCCL)
	OpMax                 // max over ranks; a NaN wins
)

// String names the op as "sum", "avg" or "max".
func (o ReduceOp) String() string {
	switch o {
	case OpSum:
		return "sum"
	case OpAvg:
		return "avg"
	case OpMax:
		return "max"
	}
	return fmt.Sprintf("ReduceOp(%d)", int(o))
}

// Tensor is a flat view of elements in host or device memory. It keeps
// a reference to the Go slice it was made from, so the memory stays alive
// for as long as the engine holds the tensor in a queued operation.
type Tensor struct {
	ptr   uintptr
	count int
	dtype DType
	keep  any
}

// Float32s views a Go slice of fp32 values.
func Float32s(x []float32) Tensor {
	if len(x) == 0 {
		return Tensor{dtype: FP32}
	}
	return Tensor{ptr: uintptr(unsafe.Pointer(&x[0])), count: len(x), dtype: FP32, keep: x}
}

// Halfs views a Go slice of 16-bit values (raw bf16 or fp16 bits).
func Halfs(x []uint16, d DType) Tensor {
	if len(x) == 0 {
		return Tensor{dtype: d}
	}
	return Tensor{ptr: uintptr(unsafe.Pointer(&x[0])), count: len(x), dtype: d, keep: x}
}

// RawTensor views memory the framework owns and addresses by pointer: a host
// pointer for the CPU device, a device pointer (gorgonia's Uintptr(), a PJRT
// buffer's address) for the CUDA device. The caller keeps the memory alive.
func RawTensor(ptr uintptr, count int, d DType) Tensor {
	return Tensor{ptr: ptr, count: count, dtype: d}
}

// check refuses a tensor with an invalid dtype, or one that claims more
// bytes than the Go slice it views (Halfs with FP32, say): the engine would
// read or write past the slice. what names the tensor in the error.
func (t Tensor) check(what string) error {
	if t.count == 0 {
		return nil
	}
	if !t.dtype.valid() {
		return errorf(ErrDType, "%s has dtype %v; use FP32, BF16 or FP16", what, t.dtype)
	}
	var base uintptr
	var have int
	switch x := t.keep.(type) {
	case []float32:
		base, have = uintptr(unsafe.Pointer(unsafe.SliceData(x))), 4*len(x)
	case []uint16:
		base, have = uintptr(unsafe.Pointer(unsafe.SliceData(x))), 2*len(x)
	default:
		return nil // memory the caller addresses by pointer
	}
	if t.ptr < base || t.ptr-base+uintptr(t.Bytes()) > uintptr(have) {
		return errorf(ErrDType, "%s claims %d bytes (%d × %v) of a Go slice of %d bytes; view fp32 values with Float32s and 16-bit ones with Halfs(x, BF16 or FP16)", what, t.Bytes(), t.count, t.dtype, have)
	}
	return nil
}

// Ptr is the address of the first element.
func (t Tensor) Ptr() uintptr { return t.ptr }

// Len is the number of elements.
func (t Tensor) Len() int { return t.count }

// DType is the element type.
func (t Tensor) DType() DType { return t.dtype }

// Bytes is the size in bytes.
func (t Tensor) Bytes() int { return t.count * t.dtype.Size() }

// HostFloat32s views fp32 elements in host memory (a Go slice, the CPU
// device's buffers, a stage-3 view on the CPU device) as a Go slice, nil for
// another dtype. Device memory cannot be viewed so: copy it out instead.
func (t Tensor) HostFloat32s() []float32 {
	if t.dtype != FP32 {
		return nil
	}
	return t.hostFloats()
}

// HostHalfs views bf16 or fp16 elements in host memory as their 16-bit
// patterns, nil for fp32; as HostFloat32s, for host memory only.
func (t Tensor) HostHalfs() []uint16 {
	if t.dtype == FP32 || t.count == 0 {
		return nil
	}
	return unsafe.Slice((*uint16)(t.hostPtr()), t.count)
}

// slice returns elements [lo, lo+n) of t.
func (t Tensor) slice(lo, n int) Tensor {
	return Tensor{ptr: t.ptr + uintptr(lo*t.dtype.Size()), count: n, dtype: t.dtype, keep: t.keep}
}

// hostBytes views host memory as bytes. The address is read through memory
// rather than converted, because it may name memory Go did not allocate.
func (t Tensor) hostBytes() []byte {
	if t.count == 0 {
		return nil
	}
	return unsafe.Slice((*byte)(*(*unsafe.Pointer)(unsafe.Pointer(&t.ptr))), t.Bytes())
}

// hostPtr is the address as a pointer, for memory that Go did not allocate
// (pinned host memory); read through memory rather than converted.
func (t Tensor) hostPtr() unsafe.Pointer { return *(*unsafe.Pointer)(unsafe.Pointer(&t.ptr)) }

// hostFloats views host fp32 memory.
func (t Tensor) hostFloats() []float32 {
	if t.count == 0 {
		return nil
	}
	return unsafe.Slice((*float32)(*(*unsafe.Pointer)(unsafe.Pointer(&t.ptr))), t.count)
}

// hostTensor views b as a host tensor of dtype dt.
func hostTensor(b []byte, dt DType) Tensor {
	if len(b) == 0 {
		return Tensor{dtype: dt}
	}
	return Tensor{ptr: uintptr(unsafe.Pointer(&b[0])), count: len(b) / dt.Size(), dtype: dt, keep: b}
}
