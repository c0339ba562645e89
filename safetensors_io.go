package zero

import (
	"encoding/binary"
	"fmt"
	"io"
	"math"
	"slices"
	"strconv"
	"strings"
	"unsafe"
)

// Importing a model from a safetensors file (ImportSafetensors): each
// parameter's tensor found, checked and read into the parameters' memory.
// The exports, from an engine and from a checkpoint directory, are the
// checkpoint's (checkpoint.go). The format itself is safetensors.go's.

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
