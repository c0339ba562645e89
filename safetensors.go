package zero

import (
	"encoding/binary"
	"encoding/json"
	"fmt"
	"io"
	"math"
	"slices"
	"strconv"
	"strings"
)

// Safetensors, the format the rest of the ecosystem reads models in: an
// 8-byte little-endian length N, N bytes of a JSON header (for each
// tensor its dtype, shape and [begin, end) byte offsets into the data,
// and an optional "__metadata__" object of strings), then the data:
// every tensor back to back, row-major, little-endian, covering it with
// no gap. The header is padded with spaces to a multiple of 8 bytes, so
// the data starts 8-byte aligned. Written here from the format's
// definition; the tests hold it to Python's safetensors package.

const (
	stAlign     = 8
	stMaxHeader = 100 << 20 // the reference reader refuses larger headers
	stMetadata  = "__metadata__"
)

// stSizes are the element sizes of the format's dtypes; zero reads and
// writes F32, BF16 and F16, and names the others when it meets them.
var stSizes = map[string]int{"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1,
	"U64": 8, "U32": 4, "U16": 2, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}

// stDType is the format's name of d.
func stDType(d DType) string {
	switch d {
	case BF16:
		return "BF16"
	case FP16:
		return "F16"
	}
	return "F32"
}

// dtypeOfST is the DType of a format dtype zero takes.
func dtypeOfST(s string) (DType, bool) {
	switch s {
	case "F32":
		return FP32, true
	case "BF16":
		return BF16, true
	case "F16":
		return FP16, true
	}
	return 0, false
}

// stTensor is one tensor of a safetensors file: Begin and End are byte
// offsets into the data.
type stTensor struct {
	Name       string
	DType      string
	Shape      []int
	Begin, End int64
}

func (t stTensor) elems() int64 {
	n := int64(1)
	for _, d := range t.Shape {
		n *= int64(d)
	}
	return n
}

// stHeader is a file's header: its tensors, its metadata, and where the
// data starts (8 + the header's length).
type stHeader struct {
	Tensors   []stTensor
	Metadata  map[string]string
	DataStart int64
	byName    map[string]int
}

func (h *stHeader) find(name string) (stTensor, bool) {
	i, ok := h.byName[name]
	if !ok {
		return stTensor{}, false
	}
	return h.Tensors[i], true
}

// Size is the whole file's size.
func (h *stHeader) Size() int64 {
	end := int64(0)
	for _, t := range h.Tensors {
		end = max(end, t.End)
	}
	return h.DataStart + end
}

// layoutST places tensors back to back in their order (setting their
// offsets) and returns the header: the bytes that open the file (length
// and JSON, padded), the same on every rank that lists the same tensors.
func layoutST(tensors []stTensor, meta map[string]string) (*stHeader, []byte, error) {
	var b strings.Builder
	b.WriteByte('{')
	if len(meta) > 0 {
		m, err := json.Marshal(meta) // keys sorted
		if err != nil {
			return nil, nil, err
		}
		b.WriteString(`"` + stMetadata + `":`)
		b.Write(m)
	}
	h := &stHeader{Metadata: meta, byName: map[string]int{}}
	off := int64(0)
	for i, t := range tensors {
		size, ok := stSizes[t.DType]
		if !ok {
			return nil, nil, errorf(ErrDType, "safetensors: tensor %q of dtype %q", t.Name, t.DType)
		}
		if _, dup := h.byName[t.Name]; dup || t.Name == stMetadata || t.Name == "" {
			return nil, nil, errorf(ErrParam, "safetensors: the tensor name %q is empty, reserved or given twice; give every parameter a name of its own", t.Name)
		}
		t.Begin = off
		t.End = off + t.elems()*int64(size)
		off = t.End
		h.byName[t.Name] = i
		h.Tensors = append(h.Tensors, t)
		if b.Len() > 1 {
			b.WriteByte(',')
		}
		name, _ := json.Marshal(t.Name)
		b.Write(name)
		b.WriteString(`:{"dtype":"` + t.DType + `","shape":[`)
		for k, d := range t.Shape {
			if k > 0 {
				b.WriteByte(',')
			}
			b.WriteString(strconv.Itoa(d))
		}
		fmt.Fprintf(&b, `],"data_offsets":[%d,%d]}`, t.Begin, t.End)
	}
	b.WriteByte('}')
	for b.Len()%stAlign != 0 {
		b.WriteByte(' ')
	}
	out := make([]byte, 8, 8+b.Len())
	binary.LittleEndian.PutUint64(out, uint64(b.Len()))
	out = append(out, b.String()...)
	h.DataStart = int64(len(out))
	return h, out, nil
}

// readSTHeader reads and checks the header of a file of size bytes: every
// tensor's dtype known, its bytes its shape's, and the tensors covering
// the data with no gap and no overlap, as the format requires.
func readSTHeader(f io.ReaderAt, size int64, name string) (*stHeader, error) {
	bad := func(format string, args ...any) error {
		return fmt.Errorf("%w: %s: %s; the file is damaged or not a safetensors file", ErrCheckpoint, name, fmt.Sprintf(format, args...))
	}
	var lb [8]byte
	if size < 8 {
		return nil, bad("%d bytes, too short for a header", size)
	}
	if _, err := f.ReadAt(lb[:], 0); err != nil {
		return nil, bad("reading its header: %v", err)
	}
	n := binary.LittleEndian.Uint64(lb[:])
	if n > stMaxHeader || int64(n) > size-8 {
		return nil, bad("a header of %d bytes in a file of %d", n, size)
	}
	raw := make([]byte, n)
	if _, err := f.ReadAt(raw, 8); err != nil {
		return nil, bad("reading its header: %v", err)
	}
	var entries map[string]json.RawMessage
	if err := json.Unmarshal(raw, &entries); err != nil {
		return nil, bad("its header: %v", err)
	}
	h := &stHeader{DataStart: 8 + int64(n), byName: map[string]int{}}
	for key, v := range entries {
		if key == stMetadata {
			if err := json.Unmarshal(v, &h.Metadata); err != nil {
				return nil, bad("its %s is not an object of strings: %v", stMetadata, err)
			}
			continue
		}
		var e struct {
			DType   string  `json:"dtype"`
			Shape   []int   `json:"shape"`
			Offsets []int64 `json:"data_offsets"`
		}
		if err := json.Unmarshal(v, &e); err != nil {
			return nil, bad("tensor %q: %v", key, err)
		}
		t := stTensor{Name: key, DType: e.DType, Shape: e.Shape}
		size, ok := stSizes[e.DType]
		if !ok {
			return nil, bad("tensor %q has the unknown dtype %q", key, e.DType)
		}
		if len(e.Offsets) != 2 || e.Offsets[0] < 0 || e.Offsets[1] < e.Offsets[0] {
			return nil, bad("tensor %q has the data offsets %v", key, e.Offsets)
		}
		t.Begin, t.End = e.Offsets[0], e.Offsets[1]
		n := int64(size)
		for _, d := range e.Shape {
			if d < 0 || d > 0 && n > math.MaxInt64/int64(d) {
				return nil, bad("tensor %q has the shape %v", key, e.Shape)
			}
			n *= int64(d)
		}
		if n != t.End-t.Begin {
			return nil, bad("tensor %q of shape %v and dtype %s spans %d bytes, not %d", key, e.Shape, e.DType, t.End-t.Begin, n)
		}
		h.Tensors = append(h.Tensors, t)
	}
	slices.SortFunc(h.Tensors, func(a, b stTensor) int {
		if a.Begin != b.Begin {
			return int(min(max(a.Begin-b.Begin, -1), 1))
		}
		return int(min(max(a.End-b.End, -1), 1))
	})
	end := int64(0)
	for i, t := range h.Tensors {
		if t.Begin != end {
			return nil, bad("tensor %q starts at data byte %d, where %d is next", t.Name, t.Begin, end)
		}
		end = t.End
		h.byName[t.Name] = i
	}
	if h.DataStart+end != size {
		return nil, bad("its tensors end at byte %d of %d", h.DataStart+end, size)
	}
	return h, nil
}
