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
	"unsafe"
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

// ImportOptions are the choices of ImportSafetensors.
type ImportOptions struct {
	// Convert takes a tensor of another of F32, BF16 and F16 than its
	// parameter's dtype, rounded to the nearest value of the parameter's
	// dtype (ties to even); without it such a tensor is refused.
	Convert bool
	// Strict refuses a file that holds a tensor no parameter names, as
	// torch's load_state_dict(strict=True) refuses unexpected keys (a
	// parameter without its tensor is refused always); without it such
	// tensors are ignored.
	Strict bool
	// RequireFinite refuses a tensor that holds an inf or a NaN, naming it
	// and the element. Parameters read into Data are checked before any is
	// written, which reads their tensors twice; a stage-3 Init checks the
	// ranges it reads, so New fails on them.
	RequireFinite bool
}

// ImportSafetensors makes params, the parameters you will give New with
// cfg on a communicator of device dev, start from the tensors of the
// safetensors file name (a published model's weights, or an export),
// found by parameter name. It checks every parameter first (a tensor of
// its name, its shape, or its element count where Param.Shape is not
// given, and its dtype) and refuses the first mismatch with ErrCheckpoint
// (ErrDType too for a dtype) naming the parameter and the tensor, before
// anything is written. Tensors no parameter names are ignored, unless
// opt.Strict; values are not checked, unless opt.RequireFinite.
//
// At stage 3 a trained parameter without Data gets an Init that reads
// this rank's ranges from the file when New calls it: the full model never
// exists on any rank (New casts the values to the model dtype, an exact
// copy when the file holds that dtype). Everywhere else (stages 1 and 2,
// frozen parameters, or Data given) the values are read into Param.Data,
// a chunk at a time: at stages 1 and 2 each rank holds the whole model
// anyway. It writes nothing but params and their Data.
func ImportSafetensors(name string, cfg Config, dev Device, params []Param, opt ImportOptions) error {
	if dev == nil {
		dev = CPU()
	}
	f, size, err := openRegular(name)
	if err != nil {
		return fmt.Errorf("%w: %w; pass a safetensors file", ErrCheckpoint, err)
	}
	defer f.Close()
	h, err := readSTHeader(f, size, name)
	if err != nil {
		return err
	}
	// every check before anything is written
	srcs := make([]stTensor, len(params))
	for i, p := range params {
		t, err := h.importable(name, i, p, opt)
		if err != nil {
			return err
		}
		srcs[i] = t
		if p.Count == 0 {
			continue
		}
		switch {
		case cfg.Stage == 3 && !p.Frozen && p.Data.count == 0:
			if p.Init != nil {
				return errorf(ErrParam, "parameter %d (%q) has an Init; ImportSafetensors sets it from %s: leave it nil", i, p.Name, name)
			}
		case p.Data.count == 0:
			return errorf(ErrParam, "parameter %d (%q) has no Data to import %s into: at stages 1 and 2, and for frozen parameters, give Data", i, p.Name, name)
		case p.Data.count != p.Count || p.Data.dtype != p.DType:
			return errorf(ErrParam, "parameter %d (%q) has Data of %d %v elements for %d %v; give its own memory", i, p.Name, p.Data.count, p.Data.dtype, p.Count, p.DType)
		}
	}
	if opt.Strict {
		if err := h.onlyNamed(name, params); err != nil {
			return err
		}
	}
	if opt.RequireFinite { // the tensors read into Data, before any is written
		var buf []byte
		for i, p := range params {
			if p.Count == 0 || cfg.Stage == 3 && !p.Frozen && p.Data.count == 0 {
				continue
			}
			if buf == nil {
				buf = make([]byte, ckptChunk)
			}
			src := stReader{path: name, t: srcs[i], start: h.DataStart, size: size}
			if err := src.checkFinite(f, 0, p.Count, buf); err != nil {
				return err
			}
		}
	}
	var s Stream
	defer func() {
		if s != nil {
			s.Close()
		}
	}()
	var buf, conv []byte
	for i := range params {
		p := &params[i]
		if p.Count == 0 {
			continue
		}
		src := stReader{path: name, t: srcs[i], start: h.DataStart, size: size, finite: opt.RequireFinite}
		if cfg.Stage == 3 && !p.Frozen && p.Data.count == 0 {
			p.Init = src.init
			continue
		}
		if s == nil {
			if s, err = dev.NewStream(); err != nil {
				return err
			}
		}
		if buf == nil { // a chunk, or the largest tensor where that is less
			n := int64(0)
			for _, q := range params {
				n = max(n, 4*int64(q.Count)) // 4: the widest dtype
			}
			n = min(n, ckptChunk)
			buf, conv = make([]byte, n), make([]byte, n)
		}
		if err := src.fill(f, dev, s, p.Data, buf, conv); err != nil {
			return err
		}
	}
	return nil
}

// importable checks that the file's tensor of p's name can be p's values.
func (h *stHeader) importable(file string, i int, p Param, opt ImportOptions) (stTensor, error) {
	if p.Name == "" {
		return stTensor{}, errorf(ErrParam, "parameter %d has no name; ImportSafetensors finds tensors by name", i)
	}
	t, ok := h.find(p.Name)
	if !ok {
		names := make([]string, 0, 4)
		for _, x := range h.Tensors[:min(len(h.Tensors), 4)] {
			names = append(names, strconv.Quote(x.Name))
		}
		return t, errorf(ErrCheckpoint, "%s has no tensor %q for parameter %d (it holds %d tensors: %s…); name the parameter as the file does, or import another file",
			file, p.Name, i, len(h.Tensors), strings.Join(names, ", "))
	}
	shapeOK := t.elems() == int64(p.Count)
	if len(p.Shape) > 0 {
		shapeOK = slices.Equal(p.Shape, t.Shape)
	}
	if !shapeOK {
		mine := fmt.Sprintf("%d elements", p.Count)
		if len(p.Shape) > 0 {
			mine = fmt.Sprintf("the shape %v", p.Shape)
		}
		return t, errorf(ErrCheckpoint, "%s: tensor %q has the shape %v, parameter %d has %s; import a file of this model",
			file, t.Name, t.Shape, i, mine)
	}
	d, ok := dtypeOfST(t.DType)
	switch {
	case !ok:
		return t, fmt.Errorf("%w: %w: %s: tensor %q is %s; zero imports F32, BF16 and F16: convert the file", ErrCheckpoint, ErrDType, file, t.Name, t.DType)
	case d != p.DType && !opt.Convert:
		return t, fmt.Errorf("%w: %w: %s: tensor %q is %s, parameter %d is %v; give the parameter that dtype, or set ImportOptions.Convert to round it",
			ErrCheckpoint, ErrDType, file, t.Name, t.DType, i, p.DType)
	}
	return t, nil
}

// onlyNamed refuses the tensors of the file no parameter names.
func (h *stHeader) onlyNamed(file string, params []Param) error {
	named := map[string]bool{}
	for _, p := range params {
		named[p.Name] = true
	}
	var extra []string
	for _, t := range h.Tensors {
		if !named[t.Name] {
			extra = append(extra, strconv.Quote(t.Name))
		}
	}
	if len(extra) == 0 {
		return nil
	}
	more := ""
	if len(extra) > 4 {
		extra, more = extra[:4], ", …"
	}
	return errorf(ErrCheckpoint, "%s holds %d tensor(s) no parameter names (%s%s) and ImportOptions.Strict refuses them; register them as parameters (Frozen if they do not train), or drop Strict to ignore them",
		file, len(extra), strings.Join(extra, ", "), more)
}

// stReader reads one tensor of a file checked by readSTHeader.
type stReader struct {
	path        string
	t           stTensor
	start, size int64 // the data's start, the file's size when checked
	finite      bool  // ImportOptions.RequireFinite: init refuses an inf or a NaN
}

// checkFinite refuses an inf or a NaN among elements [from, from+n) of the
// tensor, read a chunk at a time through buf.
func (r stReader) checkFinite(f io.ReaderAt, from, n int, buf []byte) error {
	d := r.dtype()
	per := len(buf) / d.Size()
	for lo := 0; lo < n; lo += per {
		k := min(per, n-lo)
		raw := buf[:k*d.Size()]
		if err := r.read(f, from+lo, raw); err != nil {
			return err
		}
		if err := r.finiteIn(raw, from+lo); err != nil {
			return err
		}
	}
	return nil
}

// finiteIn refuses an inf or a NaN in raw, the tensor's elements from
// element at on, in the file's dtype.
func (r stReader) finiteIn(raw []byte, at int) error {
	d := r.dtype()
	// an inf or a NaN has every exponent bit set; a NaN's mantissa is not 0
	var exp, man, sign uint32
	switch d {
	case FP32:
		exp, man, sign = 0x7f800000, 0x007fffff, 0x80000000
	case BF16:
		exp, man, sign = 0x7f80, 0x007f, 0x8000
	default:
		exp, man, sign = 0x7c00, 0x03ff, 0x8000
	}
	for i := 0; i < len(raw); i += d.Size() {
		x := uint32(binary.LittleEndian.Uint16(raw[i:]))
		if d == FP32 {
			x = binary.LittleEndian.Uint32(raw[i:])
		}
		if x&exp != exp {
			continue
		}
		v := math.Inf(1)
		switch {
		case x&man != 0:
			v = math.NaN()
		case x&sign != 0:
			v = math.Inf(-1)
		}
		return errorf(ErrCheckpoint, "%s: tensor %q holds %v at element %d, and ImportOptions.RequireFinite refuses it; import a file without it, or drop RequireFinite",
			r.path, r.t.Name, v, at+i/d.Size())
	}
	return nil
}

func (r stReader) dtype() DType { d, _ := dtypeOfST(r.t.DType); return d }

// read reads elements [from, from+len(dst)/size) of the tensor into dst,
// in the file's dtype.
func (r stReader) read(f io.ReaderAt, from int, dst []byte) error {
	at := r.start + r.t.Begin + int64(from)*int64(r.dtype().Size())
	if _, err := f.ReadAt(dst, at); err != nil {
		return fmt.Errorf("%w: %s: reading tensor %q: %v; the file changed or is damaged", ErrCheckpoint, r.path, r.t.Name, err)
	}
	return nil
}

// init is the tensor as a stage-3 Init: this rank's elements, widened to
// fp32 a chunk at a time (New rounds them to the model dtype).
func (r stReader) init(dst []float32, offset int) error {
	f, size, err := openRegular(r.path)
	if err != nil {
		return fmt.Errorf("%w: %w", ErrCheckpoint, err)
	}
	defer f.Close()
	if size != r.size {
		return errorf(ErrCheckpoint, "%s changed since ImportSafetensors read its header; import it again", r.path)
	}
	d := r.dtype()
	out := unsafe.Slice((*byte)(unsafe.Pointer(unsafe.SliceData(dst))), 4*len(dst))
	if d == FP32 {
		if err := r.read(f, offset, out); err != nil || !r.finite {
			return err
		}
		return r.finiteIn(out, offset)
	}
	per := ckptChunk / d.Size()
	buf := make([]byte, min(len(dst), per)*d.Size())
	for lo := 0; lo < len(dst); lo += per {
		n := min(per, len(dst)-lo)
		if err := r.read(f, offset+lo, buf[:n*d.Size()]); err != nil {
			return err
		}
		if r.finite {
			if err := r.finiteIn(buf[:n*d.Size()], offset+lo); err != nil {
				return err
			}
		}
		castHost(hostTensor(out[4*lo:4*(lo+n)], FP32).ptr, FP32, hostTensor(buf, d).ptr, d, n, 1)
	}
	return nil
}

// fill reads the whole tensor into data (the parameter's memory on dev),
// a chunk at a time through buf, converted through conv where the
// dtypes differ.
func (r stReader) fill(f io.ReaderAt, dev Device, s Stream, data Tensor, buf, conv []byte) error {
	from := r.dtype()
	to := data.dtype
	per := len(buf) / max(from.Size(), to.Size())
	_, onHost := dev.(*hostDevice)
	for lo := 0; lo < data.count; lo += per {
		n := min(per, data.count-lo)
		part := data.slice(lo, n)
		raw := buf[:n*from.Size()]
		if onHost && from == to {
			raw = part.hostBytes() // straight into the parameter
		}
		if err := r.read(f, lo, raw); err != nil {
			return err
		}
		if onHost && from == to {
			continue
		}
		out := raw
		if from != to {
			out = conv[:n*to.Size()]
			castHost(hostTensor(out, to).ptr, to, hostTensor(raw, from).ptr, from, n, 1)
		}
		if err := dev.copy(s, part, hostTensor(out, to)); err != nil {
			return err
		}
		if err := s.Sync(); err != nil {
			return err
		}
	}
	return nil
}
