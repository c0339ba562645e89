package deepspeed

import (
	"encoding/binary"
	"fmt"
	"math"

	"zero"
)

// DType is the element type of a tensor in a PyTorch file.
type DType uint8

// The element types a checkpoint's tensors may have.
const (
	Float32 DType = iota + 1
	BFloat16
	Float16
	Float64
	Int64
	Int32
	Int16
	Int8
	Uint8
	Bool
)

var dtypeInfo = [...]struct {
	torch, storage, st string
	size               int
}{
	Float32:  {"float32", "FloatStorage", "F32", 4},
	BFloat16: {"bfloat16", "BFloat16Storage", "BF16", 2},
	Float16:  {"float16", "HalfStorage", "F16", 2},
	Float64:  {"float64", "DoubleStorage", "F64", 8},
	Int64:    {"int64", "LongStorage", "I64", 8},
	Int32:    {"int32", "IntStorage", "I32", 4},
	Int16:    {"int16", "ShortStorage", "I16", 2},
	Int8:     {"int8", "CharStorage", "I8", 1},
	Uint8:    {"uint8", "ByteStorage", "U8", 1},
	Bool:     {"bool", "BoolStorage", "BOOL", 1},
}

func (d DType) valid() bool { return d >= Float32 && int(d) < len(dtypeInfo) }

// Size is the bytes of one element.
func (d DType) Size() int {
	if !d.valid() {
		return 0
	}
	return dtypeInfo[d].size
}

// String is PyTorch's name of the dtype ("float32", "bfloat16", ...).
func (d DType) String() string {
	if !d.valid() {
		return fmt.Sprintf("DType(%d)", int(d))
	}
	return dtypeInfo[d].torch
}

// Floating reports whether d is a floating-point type.
func (d DType) Floating() bool { return d == Float32 || d == BFloat16 || d == Float16 || d == Float64 }

// Zero is the dtype as zero names it, for the three zero trains in.
func (d DType) Zero() (zero.DType, bool) {
	switch d {
	case Float32:
		return zero.FP32, true
	case BFloat16:
		return zero.BF16, true
	case Float16:
		return zero.FP16, true
	}
	return 0, false
}

// Tensor is a tensor's elements, row-major and little-endian, as a
// contiguous copy of what the file holds.
type Tensor struct {
	DType DType
	Shape []int
	Data  []byte
}

// Numel is the number of elements.
func (t Tensor) Numel() int { return len(t.Data) / max(t.DType.Size(), 1) }

// Float32s converts the elements to float32: exactly for float32, bfloat16
// and float16, rounded to nearest even from float64 (as PyTorch's .float()).
func (t Tensor) Float32s() ([]float32, error) {
	n := t.Numel()
	out := make([]float32, n)
	switch t.DType {
	case Float32:
		for i := range out {
			out[i] = math.Float32frombits(binary.LittleEndian.Uint32(t.Data[4*i:]))
		}
	case BFloat16:
		for i := range out {
			out[i] = math.Float32frombits(uint32(binary.LittleEndian.Uint16(t.Data[2*i:])) << 16)
		}
	case Float16:
		for i := range out {
			out[i] = halfToFloat(binary.LittleEndian.Uint16(t.Data[2*i:]))
		}
	case Float64:
		for i := range out {
			out[i] = float32(math.Float64frombits(binary.LittleEndian.Uint64(t.Data[8*i:])))
		}
	default:
		return nil, fmt.Errorf("a %v tensor is not floating-point", t.DType)
	}
	return out, nil
}

// Uint16s are the raw elements of a bfloat16 or float16 tensor.
func (t Tensor) Uint16s() ([]uint16, error) {
	if t.DType != BFloat16 && t.DType != Float16 {
		return nil, fmt.Errorf("a %v tensor is not 16-bit floating-point", t.DType)
	}
	out := make([]uint16, t.Numel())
	for i := range out {
		out[i] = binary.LittleEndian.Uint16(t.Data[2*i:])
	}
	return out, nil
}

// halfToFloat is IEEE binary16 to binary32, exact.
func halfToFloat(h uint16) float32 {
	sign := uint32(h>>15) << 31
	exp := uint32(h>>10) & 0x1f
	man := uint32(h) & 0x3ff
	switch {
	case exp == 0x1f: // inf, nan (payload kept)
		return math.Float32frombits(sign | 0xff<<23 | man<<13)
	case exp != 0:
		return math.Float32frombits(sign | (exp+112)<<23 | man<<13)
	case man == 0:
		return math.Float32frombits(sign)
	}
	// subnormal: normalise
	e := uint32(113)
	for man&0x400 == 0 {
		man <<= 1
		e--
	}
	return math.Float32frombits(sign | e<<23 | (man&0x3ff)<<13)
}

// float32Bytes is x as little-endian bytes.
func float32Bytes(x []float32) []byte {
	b := make([]byte, 4*len(x))
	for i, v := range x {
		binary.LittleEndian.PutUint32(b[4*i:], math.Float32bits(v))
	}
	return b
}

func numel(shape []int) int {
	n := 1
	for _, d := range shape {
		n *= d
	}
	return n
}

// roundTo rounds fp32 values to d (bfloat16 or float16, to nearest even,
// as PyTorch's copy_ into a 16-bit tensor does), or copies them for
// float32.
func roundTo(x []float32, d DType) Tensor {
	t := Tensor{DType: d, Data: make([]byte, len(x)*d.Size())}
	for i, v := range x {
		switch d {
		case Float32:
			binary.LittleEndian.PutUint32(t.Data[4*i:], math.Float32bits(v))
		case BFloat16:
			binary.LittleEndian.PutUint16(t.Data[2*i:], floatToBF16(v))
		case Float16:
			binary.LittleEndian.PutUint16(t.Data[2*i:], floatToHalf(v))
		}
	}
	return t
}

// floatToBF16 is binary32 to bfloat16, round to nearest even; a NaN stays
// a (quiet) NaN.
func floatToBF16(f float32) uint16 {
	u := math.Float32bits(f)
	if u&0x7fffffff > 0x7f800000 {
		return uint16(u>>16) | 0x40
	}
	return uint16((u + 0x7fff + (u>>16)&1) >> 16)
}

// floatToHalf is binary32 to binary16, round to nearest even, with
// subnormals, overflow to infinity and NaN kept a (quiet) NaN.
func floatToHalf(f float32) uint16 {
	u := math.Float32bits(f)
	sign := uint16(u>>16) & 0x8000
	a := u & 0x7fffffff
	switch {
	case a > 0x7f800000: // NaN
		return sign | 0x7e00 | uint16(a>>13)&0x3ff
	case a >= 0x477ff000: // rounds to ≥ 65520: infinity
		return sign | 0x7c00
	case a >= 0x38800000: // normal in binary16
		h := (a - 0x38000000) >> 13 // rebias 127→15
		rest := a & 0x1fff
		if rest > 0x1000 || (rest == 0x1000 && h&1 == 1) {
			h++
		}
		return sign | uint16(h)
	case a < 0x33000000: // below half the smallest subnormal: ±0
		return sign
	}
	// subnormal in binary16: the value is m·2^(e-150) with the implicit
	// bit; the result counts units of 2^-24
	e := a >> 23
	m := a&0x7fffff | 0x800000
	shift := 126 - e // 2^(e-127-23) / 2^-24 = 2^(e-126); m >> (126-e)
	h := m >> shift
	rest := m & (1<<shift - 1)
	half := uint32(1) << (shift - 1)
	if rest > half || (rest == half && h&1 == 1) {
		h++
	}
	return sign | uint16(h)
}
