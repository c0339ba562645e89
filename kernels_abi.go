package zero

// The plain Go side of the Go↔C kernel interface: types that cross into C
// as they are. Their layouts are checked against kernels.h at compile time
// in kernels.go; they live in a file without cgo so that a build with cgo
// off fails first on cgo_required.go's message, not on these names.

// segment is one gradient of a batched kernel call: its address, its element
// count, and the offset (in elements) of its first element in the flat
// destination. It has the memory layout of zero_seg in kernels.h and holds
// only integers, so a []segment may be passed to C as a pointer to its first
// element.
type segment struct {
	ptr    uintptr
	count  int64
	offset int64
}

// optRange is one range of an optimizer pass: zero_opt_range of
// elementwise.h, field for field.
type optRange struct {
	offset, count                                    int64
	decay, step, beta1c, beta2, beta2c, bc2sqrt, eps float32
	flags                                            int32
}

// optBuffers are the fp32 shard buffers of an optimizer pass (0: absent)
// and the model-dtype copy of the new parameters.
type optBuffers struct {
	p, g, m, v, vmax, buf, out uintptr
	outType                    DType
}

// optKind is the optimizer a fused pass runs.
type optKind int

const (
	optAdamW optKind = iota + 1
	optSGD
)

// optTensors are the buffers of an optimizer pass: the fp32 master shard p,
// its gradient g, the moments (AdamW: m, v and vmax with amsgrad; SGD: m is
// the momentum buffer, absent without momentum), and out, the model-dtype
// copy of the new parameters.
type optTensors struct {
	p, g, m, v, vmax, out Tensor
}

// slice is elements [off, off+n) of every buffer present.
func (b optTensors) slice(off, n int) optTensors {
	sl := func(t Tensor) Tensor {
		if t.ptr == 0 {
			return t
		}
		return t.slice(off, n)
	}
	return optTensors{p: sl(b.p), g: sl(b.g), m: sl(b.m), v: sl(b.v), vmax: sl(b.vmax), out: sl(b.out)}
}
