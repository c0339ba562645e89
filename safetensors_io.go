package zero

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"math"
	"math/rand/v2"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"unsafe"
)

// The model in safetensors files, both ways: the import (ImportSafetensors:
// each parameter's tensor found, checked and read into the parameters'
// memory) and the exports, from an engine's state (ExportSafetensors) and
// from a checkpoint directory (CheckpointToSafetensors), which read what
// the checkpoint's code (checkpoint.go) snapshots and finds. The format
// itself is safetensors.go's.

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

// ---- safetensors export -------------------------------------------------------

// ExportOptions are the choices of an export to safetensors.
type ExportOptions struct {
	// Optimizer adds each trained parameter's optimizer state, named as
	// torch names it: "<name>.exp_avg", "<name>.exp_avg_sq",
	// "<name>.max_exp_avg_sq" (amsgrad) and "<name>.step" (the steps
	// taken, a float32 scalar as torch keeps it) for AdamW;
	// "<name>.momentum_buffer" for SGD with momentum.
	Optimizer bool
	// Metadata goes into the header's __metadata__, beside zero's own
	// ("format": "pt", "zero.step": the steps taken); a key given here wins.
	Metadata map[string]string
}

// exportItem is one tensor of an export and where its values are: state
// ("master", "m", "v", "vmax": the shards; "step": the step count) of
// parameter p, or "data": a frozen parameter's memory.
type exportItem struct {
	p     int
	state string
}

// exportList lists an export's tensors in file order, every one F32: each
// parameter's values (the fp32 master; a frozen parameter's memory,
// widened, where withFrozen: a checkpoint holds no frozen values), then
// with opt.Optimizer its state by its group's kind.
func exportList(params []Param, groups []Optimizer, opt ExportOptions, withFrozen bool) ([]stTensor, []exportItem) {
	var ts []stTensor
	var items []exportItem
	add := func(name string, shape []int, p int, state string) {
		ts = append(ts, stTensor{Name: name, DType: "F32", Shape: shape})
		items = append(items, exportItem{p, state})
	}
	for p, q := range params {
		shape := q.Shape
		if len(shape) == 0 {
			shape = []int{q.Count}
		}
		if q.Frozen {
			if withFrozen {
				add(q.Name, shape, p, "data")
			}
			continue
		}
		add(q.Name, shape, p, "master")
		if !opt.Optimizer || q.Group < 0 || q.Group >= len(groups) {
			continue
		}
		switch g := groups[q.Group].(type) {
		case AdamW:
			add(q.Name+".exp_avg", shape, p, "m")
			add(q.Name+".exp_avg_sq", shape, p, "v")
			if g.AMSGrad {
				add(q.Name+".max_exp_avg_sq", shape, p, "vmax")
			}
			add(q.Name+".step", []int{}, p, "step")
		case SGD:
			if g.Momentum != 0 {
				add(q.Name+".momentum_buffer", shape, p, "m")
			}
		}
	}
	return ts, items
}

func exportMetadata(opt ExportOptions, step int) map[string]string {
	meta := map[string]string{"format": "pt", "zero.step": strconv.Itoa(step)}
	for k, v := range opt.Metadata {
		meta[k] = v
	}
	return meta
}

// exportPeerError is this rank's own error, or one that says another
// rank failed.
func exportPeerError(own error, what, file string) error {
	if own != nil {
		return own
	}
	return errorf(ErrCheckpoint, "%s (see that rank's error); %s is unchanged", what, file)
}

// exportPartial is the name an export is written under before its rename.
func exportPartial(file string, nonce uint32) string {
	return fmt.Sprintf("%s.partial-%08x", file, nonce)
}

// export writes the engine's parameters (and optionally the optimizer
// state) into file, a safetensors file; every rank calls it. Nothing is
// gathered: every rank computes the header alike and writes its own
// shard's ranges at their offsets, rank 0 the frozen parameters (from
// their memory, their only home) and the step counts. Rank 0 creates the
// file under a name of its own, with a random part every rank learns, and
// renames it into place once every rank has written and fsynced its part
// (a collective of the outcomes): a rank that cannot open that file is on
// a file system rank 0 does not share, and the export is refused.
func (ce *ckptJob) export(file string, opt ExportOptions) error {
	tensors, items := exportList(ce.params, ce.opt.currentGroups(), opt, true)
	h, head, err := layoutST(tensors, exportMetadata(opt, ce.step))
	if err != nil {
		return err // alike on every rank
	}
	var nonce float64
	var err0 error
	if ce.rank == 0 {
		n := rand.Uint32()
		nonce = float64(n)
		err0 = ce.createExport(exportPartial(file, n), head, h.Size(), items)
	}
	failed, vals, err := ce.shareOutcome(err0 != nil, nonce)
	if err != nil {
		return err
	}
	if failed {
		return exportPeerError(err0, "rank 0 could not create the export", file)
	}
	partial := exportPartial(file, uint32(vals[0]))
	errw := ce.writeExport(partial, h, items)
	failed, _, err = ce.shareOutcome(errw != nil)
	if err != nil {
		return err
	}
	if failed {
		if ce.rank == 0 {
			ce.fs.RemoveAll(partial) // best effort: it was never whole
		}
		return exportPeerError(errw, "a rank could not write its part of the export", file)
	}
	var errc error
	if ce.rank == 0 {
		if errc = ce.fs.Rename(partial, file); errc == nil {
			errc = ce.fs.SyncDir(filepath.Dir(file))
		}
		if errc != nil {
			errc = fmt.Errorf("%w: moving the export into place as %s: %w", ErrCheckpoint, file, errc)
		}
	}
	failed, _, err = ce.shareOutcome(errc != nil)
	if err != nil {
		return err
	}
	if failed {
		return exportPeerError(errc, "rank 0 could not move the export into place", file)
	}
	return nil
}

// createExport is rank 0's start of an export: the frozen parameters'
// memory checked, the file created with its header and its whole size.
func (ce *ckptJob) createExport(partial string, head []byte, size int64, items []exportItem) error {
	for _, it := range items {
		if q := ce.params[it.p]; it.state == "data" && q.Count > 0 && q.Data.count != q.Count {
			return errorf(ErrParam, "parameter %d (%q) is frozen and has no Data on rank 0: zero holds nothing else of it; give it its memory", it.p, q.Name)
		}
	}
	f, err := ce.fs.Create(partial)
	if err != nil {
		return fmt.Errorf("%w: %w", ErrCheckpoint, err)
	}
	if _, err = f.Write(head); err == nil {
		if err = f.Truncate(size); err == nil {
			err = f.Sync()
		}
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return fmt.Errorf("%w: creating %s: %w", ErrCheckpoint, partial, err)
	}
	return nil
}

// writeExport writes this rank's part of an export into partial: its
// shard's ranges of each state tensor, and on rank 0 the step counts and
// the frozen parameters; then fsyncs it.
func (ce *ckptJob) writeExport(partial string, h *stHeader, items []exportItem) error {
	f, err := ce.fs.OpenWrite(partial)
	if err != nil {
		return errorf(ErrCheckpoint, "rank %d cannot open %s, which rank 0 created (%v): export to a file system every rank shares", ce.rank, partial, err)
	}
	states := map[string]stateTensor{}
	for _, st := range ce.opt.stateTensors() {
		states[st.name] = st
	}
	steps := ce.opt.checkpointState().Steps
	var buf []byte
	chunk := func() []byte {
		if buf == nil {
			buf = make([]byte, ckptChunk)
		}
		return buf
	}
	synced := map[string]bool{}
	for i, it := range items {
		at := h.DataStart + h.Tensors[i].Begin
		q := ce.params[it.p]
		switch it.state {
		case "step":
			if ce.rank == 0 {
				var b [4]byte
				binary.LittleEndian.PutUint32(b[:], math.Float32bits(float32(steps[it.p])))
				_, err = f.WriteAt(b[:], at)
			}
		case "data":
			if ce.rank == 0 && q.Count > 0 {
				model := states["model"] // the engine's device and stream
				err = writeWidened(f, at, model.dev, model.s, q.Data, chunk())
			}
		default:
			r := ce.plan.shardRange(it.p, ce.rank)
			st, ok := states[it.state]
			if r.Count == 0 || !ok {
				continue
			}
			if !synced[st.name] { // the state's last writes
				synced[st.name] = true
				if err = st.s.Sync(); err != nil {
					break
				}
			}
			err = writeStateAt(f, at+int64(r.ParamOffset)*4, st, st.t.slice(r.ShardOffset, r.Count), chunk)
		}
		if err != nil {
			break
		}
	}
	if err == nil {
		err = f.Sync()
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil && !errors.Is(err, ErrCheckpoint) {
		err = fmt.Errorf("%w: writing %s: %w", ErrCheckpoint, partial, err)
	}
	return err
}

// writeStateAt writes part, a range of an fp32 state tensor, at offset
// at: from host memory in place, from a device through a chunk.
func writeStateAt(f ckptFile, at int64, st stateTensor, part Tensor, chunk func() []byte) error {
	if _, onHost := st.dev.(*hostDevice); onHost {
		_, err := f.WriteAt(part.hostBytes(), at)
		return err
	}
	buf := chunk()
	per := len(buf) / 4
	for lo := 0; lo < part.count; lo += per {
		n := min(per, part.count-lo)
		b := buf[:4*n]
		if err := st.dev.copy(st.s, hostTensor(b, FP32), part.slice(lo, n)); err != nil {
			return err
		}
		if err := st.s.Sync(); err != nil {
			return err
		}
		if _, err := f.WriteAt(b, at+int64(lo)*4); err != nil {
			return err
		}
	}
	return nil
}

// writeWidened writes data (memory on dev) as fp32 at offset at, through
// buf: copied to the host a piece at a time and widened there.
func writeWidened(f ckptFile, at int64, dev Device, s Stream, data Tensor, buf []byte) error {
	d := data.dtype
	per := len(buf) / (4 + d.Size())
	raw, wide := buf[:per*d.Size()], buf[per*d.Size():]
	for lo := 0; lo < data.count; lo += per {
		n := min(per, data.count-lo)
		src := raw[:n*d.Size()]
		if err := dev.copy(s, hostTensor(src, d), data.slice(lo, n)); err != nil {
			return err
		}
		if err := s.Sync(); err != nil {
			return err
		}
		out := src
		if d != FP32 {
			out = wide[:4*n]
			castHost(hostTensor(out, FP32).ptr, FP32, hostTensor(src, d).ptr, d, n, 1)
		}
		if _, err := f.WriteAt(out, at+int64(lo)*4); err != nil {
			return err
		}
	}
	return nil
}

// CheckpointToSafetensors writes the fp32 parameters (the master) of the
// checkpoint in dir (a checkpoint directory, or one whose latest names one)
// into file, one safetensors file, as Engine.ExportSafetensors does, with
// no engine and no GPU (DeepSpeed's zero_to_fp32.py): every rank file is
// checked whole against the manifest first, then each tensor is read from
// the rank files that hold its pieces and written in order, a chunk at a
// time. Frozen parameters are left out: a checkpoint holds no values of
// theirs. The file is written under a temporary name, fsynced and renamed.
func CheckpointToSafetensors(dir, file string, opt ExportOptions) error {
	return checkpointToSafetensors(osFS{}, dir, file, opt)
}

func checkpointToSafetensors(fsys ckptFS, dir, file string, opt ExportOptions) error {
	at, m, err := findCheckpoint(fsys, dir)
	if err != nil {
		return err
	}
	where := filepath.Join(at, ckptManifest)
	params := make([]Param, len(m.Params))
	for i, p := range m.Params {
		d, ok := dtypeNamed(p.DType)
		if !ok || p.Count < 0 || !shapeHolds(p.Shape, p.Count) {
			return errorf(ErrCheckpoint, "%s: parameter %d has the dtype %q, count %d and shape %v; the manifest is damaged", where, i, p.DType, p.Count, p.Shape)
		}
		params[i] = Param{Name: p.Name, Count: p.Count, Shape: p.Shape, DType: d, Group: p.Group, Frozen: p.Frozen}
	}
	if len(m.Optimizer.Steps) != len(params) {
		return errorf(ErrCheckpoint, "%s: %d step counts for %d parameters; the manifest is damaged", where, len(m.Optimizer.Steps), len(params))
	}
	if err := checkScalars(at, m.Optimizer); err != nil {
		return err
	}
	x, err := checkLayout(at, m, params)
	if err != nil {
		return err
	}
	ld := newLoader(newCkptJob(ckptSnapshot{fs: fsys, params: params}), at, m, x)
	defer ld.close()
	ranks := make([]int, m.Layout.World)
	for r := range ranks {
		ranks[r] = r
	}
	if err := ld.verifyRanks(ranks); err != nil {
		return err
	}
	groups := make([]Optimizer, len(m.Optimizer.Groups))
	for i, g := range m.Optimizer.Groups {
		switch {
		case g.AdamW != nil:
			groups[i] = *g.AdamW
		case g.SGD != nil:
			groups[i] = *g.SGD
		}
	}
	tensors, items := exportList(params, groups, opt, false)
	_, head, err := layoutST(tensors, exportMetadata(opt, m.Step))
	if err != nil { // the manifest's names: it is damaged
		return fmt.Errorf("%w: %s: %w; the manifest is damaged", ErrCheckpoint, where, err)
	}
	for _, it := range items {
		if it.state != "step" && !ld.has(it.state) {
			return errorf(ErrCheckpoint, "%s holds no %s state for %q; export without the optimizer", at, it.state, params[it.p].Name)
		}
	}
	tmp := file + ".tmp"
	f, err := fsys.Create(tmp)
	if err != nil {
		return fmt.Errorf("%w: %w", ErrCheckpoint, err)
	}
	_, err = f.Write(head)
	most := 0
	for _, q := range params {
		most = max(most, q.Count)
	}
	buf := ld.buffer(4 * int64(most))
	per := len(buf) / 4
	for i := 0; err == nil && i < len(items); i++ {
		it := items[i]
		if it.state == "step" {
			var b [4]byte
			binary.LittleEndian.PutUint32(b[:], math.Float32bits(float32(m.Optimizer.Steps[it.p])))
			_, err = f.Write(b[:])
			continue
		}
		st := stateTensor{name: it.state, t: Tensor{dtype: FP32}}
		for lo := 0; err == nil && lo < params[it.p].Count; lo += per {
			n := min(per, params[it.p].Count-lo)
			if err = ld.readParam(st, it.p, lo, n, buf[:4*n]); err == nil {
				_, err = f.Write(buf[:4*n])
			}
		}
	}
	if err == nil {
		err = f.Sync()
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = fsys.Rename(tmp, file)
	}
	if err == nil {
		err = fsys.SyncDir(filepath.Dir(file))
	}
	if err != nil {
		fsys.RemoveAll(tmp)
		if !errors.Is(err, ErrCheckpoint) {
			err = fmt.Errorf("%w: writing %s: %w", ErrCheckpoint, file, err)
		}
		return err
	}
	return nil
}
