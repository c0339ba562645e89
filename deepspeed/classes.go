package deepspeed

import (
	"github.com/nlpodyssey/gopickle/types"
)

// The allow-list: every class a DeepSpeed 0.19 checkpoint's pickles name
// (the GLOBAL opcodes of the golden files under testdata/golden: the
// ZeRO-1/2/3 checkpoints in fp32, bf16 and fp16 and their universal
// layout). Each becomes a Go value that holds data and runs nothing; any
// other class is refused before the unpickler sees it (prescan) and again
// by findClass.
var allowList = map[string]map[string]bool{
	"collections": {"OrderedDict": true},
	"torch": {
		"Size": true, "Tensor": true,
		"FloatStorage": true, "BFloat16Storage": true, "HalfStorage": true, "DoubleStorage": true,
		"LongStorage": true, "IntStorage": true, "ShortStorage": true, "CharStorage": true,
		"ByteStorage": true, "BoolStorage": true,
		"float32": true, "bfloat16": true, "float16": true,
	},
	"torch._utils":                       {"_rebuild_tensor_v2": true},
	"torch._tensor":                      {"_rebuild_from_type_v2": true},
	"deepspeed.runtime.fp16.loss_scaler": {"LossScaler": true, "DynamicLossScaler": true},
	"deepspeed.runtime.zero.config":      {"ZeroStageEnum": true},
	"deepspeed.utils.tensor_fragment":    {"fragment_address": true},
}

func allowed(module, name string) bool { return allowList[module][name] }

// findClass is the unpickler's find_class. gopickle answers
// collections.OrderedDict itself (an empty ordered map); everything else
// reaches here, and only the allow-list gets a value.
func findClass(module, name string) (any, error) {
	if !allowed(module, name) {
		return nil, errorf(ErrUnsafe, "", "pickle: class %s.%s is not one a DeepSpeed checkpoint holds; refused, nothing of it built", module, name)
	}
	switch module {
	case "torch":
		switch name {
		case "Size":
			return sizeClass{}, nil
		case "Tensor":
			return tensorClass{}, nil
		case "float32":
			return torchDType(Float32), nil
		case "bfloat16":
			return torchDType(BFloat16), nil
		case "float16":
			return torchDType(Float16), nil
		}
		for d := Float32; d.valid(); d++ {
			if dtypeInfo[d].storage == name {
				return storageClass{d}, nil
			}
		}
	case "torch._utils":
		return rebuildTensor{}, nil
	case "torch._tensor":
		return rebuildFromType{}, nil
	case "deepspeed.runtime.zero.config":
		return enumClass{module + "." + name}, nil
	}
	return objectClass{module + "." + name}, nil
}

// storageClass is torch.FloatStorage and its kin: a persistent id's type.
type storageClass struct{ dtype DType }

// torchDType is a torch.dtype object (the fp16 loss scaler keeps one).
type torchDType DType

// tensorClass is torch.Tensor, the only type _rebuild_from_type_v2 may
// rebuild into.
type tensorClass struct{}

// sizeClass is torch.Size: called with a tuple of ints.
type sizeClass struct{}

// torchSize is a torch.Size.
type torchSize []int

func (sizeClass) Call(args ...any) (any, error) {
	if len(args) != 1 {
		return nil, errorf(ErrFormat, "", "pickle: torch.Size takes one tuple, got %d arguments", len(args))
	}
	dims, ok := ints(args[0])
	if !ok {
		return nil, errorf(ErrFormat, "", "pickle: torch.Size of %s", describe(args[0]))
	}
	for _, d := range dims {
		if d < 0 {
			return nil, errorf(ErrFormat, "", "pickle: torch.Size with a negative dimension %v", dims)
		}
	}
	return torchSize(dims), nil
}

// enumClass is an IntEnum (ZeroStageEnum): called with its value.
type enumClass struct{ name string }

// enumValue is a member of an IntEnum.
type enumValue struct {
	class string
	value int
}

func (c enumClass) Call(args ...any) (any, error) {
	if len(args) != 1 {
		return nil, errorf(ErrFormat, "", "pickle: %s takes one value, got %d", c.name, len(args))
	}
	v, ok := args[0].(int)
	if !ok {
		return nil, errorf(ErrFormat, "", "pickle: %s of %s", c.name, describe(args[0]))
	}
	return enumValue{c.name, v}, nil
}

// objectClass is a plain Python class pickled by its __dict__ (the loss
// scalers, fragment_address): NEWOBJ with no arguments, then BUILD.
type objectClass struct{ name string }

// pyObject is an instance of an objectClass: its attributes.
type pyObject struct {
	class string
	attrs map[string]any
}

func (c objectClass) PyNew(args ...any) (any, error) {
	if len(args) != 0 {
		return nil, errorf(ErrFormat, "", "pickle: %s built with %d arguments (its pickles take none)", c.name, len(args))
	}
	return &pyObject{class: c.name, attrs: map[string]any{}}, nil
}

func (o *pyObject) PyDictSet(key, value any) error {
	k, ok := key.(string)
	if !ok {
		return errorf(ErrFormat, "", "pickle: %s attribute named by %s", o.class, describe(key))
	}
	o.attrs[k] = value
	return nil
}

// rebuildTensor is torch._utils._rebuild_tensor_v2(storage, offset, size,
// stride, requires_grad, backward_hooks[, metadata]).
type rebuildTensor struct{}

// tensorView is a tensor as the pickle describes it: a strided view of a
// storage, copied out only when the reader asks for it.
type tensorView struct {
	st     *storage
	offset int
	shape  []int
	stride []int
	numel  int
}

func (rebuildTensor) Call(args ...any) (any, error) {
	if len(args) != 6 && len(args) != 7 {
		return nil, errorf(ErrFormat, "", "pickle: _rebuild_tensor_v2 with %d arguments", len(args))
	}
	st, ok := args[0].(*storage)
	if !ok {
		return nil, errorf(ErrFormat, "", "pickle: a tensor over %s, not a storage", describe(args[0]))
	}
	offset, ok1 := args[1].(int)
	shape, ok2 := ints(args[2])
	stride, ok3 := ints(args[3])
	_, ok4 := args[4].(bool)
	if !ok1 || !ok2 || !ok3 || !ok4 || len(shape) != len(stride) || offset < 0 {
		return nil, errorf(ErrFormat, "", "pickle: a tensor with offset %s, size %s, stride %s", describe(args[1]), describe(args[2]), describe(args[3]))
	}
	// backward hooks would be code to run: only an empty OrderedDict is taken
	if h, ok := args[5].(*types.OrderedDict); !ok || h.Len() != 0 {
		return nil, errorf(ErrUnsafe, "", "pickle: a tensor with backward hooks (%s); refused", describe(args[5]))
	}
	if len(args) == 7 && args[6] != nil {
		if m, ok := args[6].(*types.Dict); !ok || m.Len() != 0 {
			return nil, errorf(ErrFormat, "", "pickle: a tensor with metadata %s", describe(args[6]))
		}
	}
	elems := len(st.data) / st.dtype.Size()
	n := 1
	for i, d := range shape {
		if d < 0 || stride[i] < 0 {
			return nil, errorf(ErrFormat, "", "pickle: a tensor of size %v, stride %v", shape, stride)
		}
		if d == 0 {
			n = 0
		}
	}
	if n != 0 {
		// the last element must lie in the storage, and the elements must
		// be no more than the storage's: more would be overlapping views,
		// which no checkpoint writes and which would let a small file
		// demand a large copy
		last := offset
		for i, d := range shape {
			if n > elems/d {
				return nil, errorf(ErrFormat, "", "pickle: a tensor of size %v holds more elements than its storage's %d", shape, elems)
			}
			n *= d
			if stride[i] > 0 && d-1 > (elems-1-last)/stride[i] {
				return nil, errorf(ErrFormat, "", "pickle: a tensor of size %v, stride %v at offset %d reaches past its storage of %d elements", shape, stride, offset, elems)
			}
			last += (d - 1) * stride[i]
		}
		if last >= elems {
			return nil, errorf(ErrFormat, "", "pickle: a tensor at offset %d of a storage of %d elements", offset, elems)
		}
	}
	return &tensorView{st: st, offset: offset, shape: shape, stride: stride, numel: n}, nil
}

// rebuildFromType is torch._tensor._rebuild_from_type_v2(func, type, args,
// state): a tensor with Python attributes (ZeRO-3's ds_id). Only
// _rebuild_tensor_v2 into torch.Tensor is taken; the attributes are kept
// out of the tensor.
type rebuildFromType struct{}

func (rebuildFromType) Call(args ...any) (any, error) {
	if len(args) != 4 {
		return nil, errorf(ErrFormat, "", "pickle: _rebuild_from_type_v2 with %d arguments", len(args))
	}
	_, okf := args[0].(rebuildTensor)
	_, okt := args[1].(tensorClass)
	a, oka := args[2].(*types.Tuple)
	_, oks := args[3].(*types.Dict)
	if !okf || !okt || !oka || !oks {
		return nil, errorf(ErrUnsafe, "", "pickle: _rebuild_from_type_v2(%s, %s, ...) is not a plain tensor rebuilt; refused", describe(args[0]), describe(args[1]))
	}
	return rebuildTensor{}.Call(*a...)
}

// ints reads a tuple or list of ints.
func ints(v any) ([]int, bool) {
	var xs []any
	switch v := v.(type) {
	case *types.Tuple:
		xs = *v
	case *types.List:
		xs = *v
	case torchSize:
		return v, true
	default:
		return nil, false
	}
	out := make([]int, len(xs))
	for i, x := range xs {
		n, ok := x.(int)
		if !ok {
			return nil, false
		}
		out[i] = n
	}
	return out, true
}

// materialize copies the view's elements out, row-major.
func (v *tensorView) materialize() Tensor {
	es := v.st.dtype.Size()
	out := make([]byte, v.numel*es)
	t := Tensor{DType: v.st.dtype, Shape: append([]int(nil), v.shape...), Data: out}
	if v.numel == 0 {
		return t
	}
	if v.contiguous() {
		copy(out, v.st.data[v.offset*es:(v.offset+v.numel)*es])
		return t
	}
	idx := make([]int, len(v.shape))
	for k := 0; k < v.numel; k++ {
		src := v.offset
		for i := range idx {
			src += idx[i] * v.stride[i]
		}
		copy(out[k*es:(k+1)*es], v.st.data[src*es:(src+1)*es])
		for i := len(idx) - 1; i >= 0; i-- {
			if idx[i]++; idx[i] < v.shape[i] {
				break
			}
			idx[i] = 0
		}
	}
	return t
}

func (v *tensorView) contiguous() bool {
	want := 1
	for i := len(v.shape) - 1; i >= 0; i-- {
		if v.shape[i] != 1 && v.stride[i] != want {
			return false
		}
		want *= v.shape[i]
	}
	return true
}
