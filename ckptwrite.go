package zero

import (
	"fmt"
	"math"
	"math/rand/v2"
	"path/filepath"
	"slices"
	"unsafe"
)

// A checkpoint written from per-parameter state, with no engine: how
// another framework's training state (DeepSpeed's, read by the deepspeed
// module) becomes a zero checkpoint that Load reshards into any plan. It
// is written as the one rank of a world of one, every trained parameter
// in one bucket, in Save's format and through Save's commit: the
// directory's lock, a partial directory renamed into place, the manifest
// last, then latest.

// CheckpointState is a model's training state, parameter by parameter, as
// WriteCheckpoint writes it.
type CheckpointState struct {
	// Params describe the model as the engines that load it register it:
	// Name (every one named, and unique: Load finds parameters by name),
	// Count, Shape (optional), DType (one for every parameter), Group and
	// Frozen. Data and Init are not read.
	Params []Param
	// Values are each parameter's state, in Params' order. A frozen or
	// empty parameter's stays empty: a checkpoint holds nothing of it.
	Values []ParamState
	// Groups are the optimizer groups' settings as SetGroup sets them
	// (NewAdamW or NewSGD, every group of one kind). With a schedule,
	// their rates are the base rates it works from.
	Groups []Optimizer
	// Step is the number of steps the run had taken, skipped ones
	// included: Load sets the engine's step count to it.
	Step int
	// Scheduled is the number of steps applied (skipped ones not): the
	// schedule's t, from which it continues.
	Scheduled int
	// LossScale is the loss scaler's state. With fp16 it must be given;
	// with fp32 and bf16 the zero value is a scale of 1.
	LossScale LossScaleState
	// Stage is recorded for the reader (1, 2 or 3; 0 records 1): Load
	// takes the checkpoint at any stage.
	Stage int
	// Settings are recorded in the manifest, and Load refuses an engine
	// whose settings that must match differ from them, as for a Save:
	// give the Engine.Settings of the run that made the state. Nil
	// records none.
	Settings []Setting
}

// ParamState is one trained parameter's state; every slice given holds
// the parameter's Count elements.
type ParamState struct {
	Master []float32 // the fp32 master weights
	// M and V are AdamW's moments (exp_avg, exp_avg_sq); M is SGD's
	// momentum buffer; VMax AdamW's running maximum of V with AMSGrad.
	// Nil is zeros, which only a parameter that has taken no step has.
	M, V, VMax []float32
	// Model is the parameter's value in the model dtype, in host memory
	// (Float32s, or Halfs for BF16 and FP16). Empty: the master rounded
	// to the nearest, ties to even, as a Step makes it.
	Model Tensor
	Steps int // the optimizer steps this parameter has taken
}

// LossScaleState is the dynamic loss scaler's state, DeepSpeed's
// DynamicLossScaler's in its terms.
type LossScaleState struct {
	Scale         float64 // S, the scale of the step's mean loss (cur_scale; Stats.LossScale)
	CurHysteresis int     // overflows still absorbed before the scale halves (cur_hysteresis)
	Iter          int     // the steps the scaler has seen (cur_iter)
	LastOverflow  int     // the Iter of the last overflow, -1 for none (last_overflow_iter)
}

// WriteCheckpoint writes st as a checkpoint into dir, as a Save of a
// world of one would: dir/step-N (N is st.Step) with its manifest, and
// dir/latest naming it; Engine.Load takes it at any world size, stage and
// bucket size, matching parameters by name. opt.Client is returned by the
// Load of rank 0 (nil on the others); opt.Keep prunes older checkpoints
// as Save does. Everything is checked before anything is written: bad
// input is refused with ErrParam (the parameters and their values) or
// ErrConfig (the groups, steps, scaler, stage and settings), naming what
// to change; a failure to write is ErrCheckpoint, and leaves no partial
// checkpoint that a Load would take.
func WriteCheckpoint(dir string, st CheckpointState, opt SaveOptions) error {
	return writeCheckpoint(osFS{}, dir, st, opt)
}

func writeCheckpoint(fsys ckptFS, dir string, st CheckpointState, opt SaveOptions) error {
	keep := opt.Keep
	if keep == 0 {
		keep = 2
	}
	if keep < 0 {
		return errorf(ErrConfig, "SaveOptions.Keep %d; keep at least 1 checkpoint (0 keeps 2)", keep)
	}
	m, sections, err := st.manifest()
	if err != nil {
		return err
	}
	if err := fsys.MkdirAll(dir); err != nil {
		return fmt.Errorf("%w: %w", ErrCheckpoint, err)
	}
	m.Save = formatSaveID(rand.Uint64() >> 16)
	lock, err := acquireSaveLock(fsys, dir, m.Save)
	if err != nil {
		return err
	}
	defer lock.release()
	ce := newCkptJob(ckptSnapshot{fs: fsys, world: 1, step: st.Step})
	k, err := ce.freshName(dir)
	if err != nil {
		return err
	}
	name := ckptName(st.Step, k)
	partial := filepath.Join(dir, ckptPartial+name)
	size, crc, err := st.writeRankFile(fsys, partial, m, sections, opt.Client)
	if err == nil {
		err = checkSaveLock(fsys, dir, m.Save)
	}
	if err != nil {
		fsys.RemoveAll(partial) // best effort: it was never complete
		return err
	}
	m.Files = []ckptFileInfo{{Name: rankFileName(0), Rank: 0, Bytes: size, CRC: crc}}
	if err := ce.commit(dir, name, partial, m); err != nil {
		return err
	}
	if err := ce.prune(dir, name, keep); err != nil {
		return errorf(ErrCheckpoint, "%s is written and %s names it, but removing older checkpoints failed: %v; remove them by hand", filepath.Join(dir, name), ckptLatest, err)
	}
	if err := lock.release(); err != nil {
		return errorf(ErrCheckpoint, "%s is written and %s names it, but giving back the lock failed: %v; the next save breaks it", filepath.Join(dir, name), ckptLatest, err)
	}
	return nil
}

// stateSection is one state section of the file WriteCheckpoint writes:
// its name and dtype, and each parameter's values (nil: zeros).
type stateSection struct {
	name  string
	dtype DType
	of    func(v *ParamState) []float32 // nil for the model section
}

// manifest checks st whole and describes it: the manifest of a world of
// one whose single bucket holds the trained parameters back to back, and
// the sections its rank file holds.
func (st *CheckpointState) manifest() (ckptManifestData, []stateSection, error) {
	var m ckptManifestData
	model, err := checkParams(st.Params)
	if err != nil {
		return m, nil, err
	}
	for i, p := range st.Params {
		if p.Name == "" {
			return m, nil, errorf(ErrParam, "CheckpointState.Params[%d] has no name; a checkpoint finds parameters by name: name every one", i)
		}
	}
	if len(st.Groups) == 0 {
		return m, nil, errorf(ErrConfig, "CheckpointState.Groups is empty; give the optimizer groups' settings (zero.NewAdamW or zero.NewSGD, as the run had them)")
	}
	if err := (&OptimizerPolicy{Groups: st.Groups}).check(st.Params); err != nil {
		return m, nil, err
	}
	if len(st.Values) != len(st.Params) {
		return m, nil, errorf(ErrParam, "CheckpointState has %d Values for %d Params; give one ParamState per parameter, in Params' order", len(st.Values), len(st.Params))
	}
	stage := st.Stage
	if stage == 0 {
		stage = 1
	}
	scaler := scalerState{Scale: st.LossScale.Scale, CurHysteresis: st.LossScale.CurHysteresis, Iter: st.LossScale.Iter, LastOverflow: st.LossScale.LastOverflow}
	if scaler == (scalerState{}) && model != FP16 {
		scaler.Scale = 1
	}
	switch {
	case stage < 1 || stage > 3:
		return m, nil, errorf(ErrConfig, "CheckpointState.Stage %d; give 1, 2 or 3 (0 records 1)", st.Stage)
	case st.Step < 0 || st.Scheduled < 0:
		return m, nil, errorf(ErrConfig, "CheckpointState.Step %d, Scheduled %d; the steps taken and applied are 0 or more", st.Step, st.Scheduled)
	case !(scaler.Scale > 0) || math.IsInf(scaler.Scale, 0):
		return m, nil, errorf(ErrConfig, "CheckpointState.LossScale.Scale %v; give the loss scale of the step's mean loss, finite and > 0 (DeepSpeed's cur_scale; it must be given for an fp16 model)", st.LossScale.Scale)
	case scaler.CurHysteresis < 0 || scaler.Iter < 0 || scaler.LastOverflow < -1 || scaler.LastOverflow > scaler.Iter:
		return m, nil, errorf(ErrConfig, "CheckpointState.LossScale: hysteresis %d, iteration %d, last overflow %d; give counters ≥ 0 and a last overflow from -1 (none) to the iteration", scaler.CurHysteresis, scaler.Iter, scaler.LastOverflow)
	}
	seen := map[string]bool{}
	for i, s := range st.Settings {
		if s.Path == "" || seen[s.Path] || s.Class < ClassMatch || s.Class > ClassLocal {
			return m, nil, errorf(ErrConfig, "CheckpointState.Settings[%d] is %q (%v), empty, repeated or of no class; give an engine's settings record (Engine.Settings), or none", i, s.Path, s.Class)
		}
		seen[s.Path] = true
	}
	sections, err := st.checkValues(model)
	if err != nil {
		return m, nil, err
	}
	opt := optCheckpoint{Kind: "adamw", Scheduled: st.Scheduled, Scaler: scaler}
	if st.Groups[0].kind() == optSGD {
		opt.Kind = "sgd"
	}
	for _, g := range st.Groups {
		switch g := g.(type) {
		case AdamW:
			opt.Groups = append(opt.Groups, optGroup{AdamW: &g})
		case SGD:
			opt.Groups = append(opt.Groups, optGroup{SGD: &g})
		}
	}
	m = ckptManifestData{Format: ckptFormat, Version: ckptVersion, Step: st.Step, Stage: stage, Optimizer: opt, Layout: ckptLayout{World: 1}}
	var bucket ckptBucket
	for p, q := range st.Params {
		m.Params = append(m.Params, ckptParam{Name: q.Name, Shape: slices.Clone(q.Shape), Count: q.Count, DType: q.DType.String(), Group: q.Group, Frozen: q.Frozen})
		m.Optimizer.Steps = append(m.Optimizer.Steps, st.Values[p].Steps)
		if !q.Frozen && q.Count > 0 {
			bucket.Members = append(bucket.Members, [2]int{p, bucket.Shard})
			bucket.Shard += q.Count
		}
	}
	if bucket.Shard > 0 {
		m.Layout.Buckets = []ckptBucket{bucket}
	}
	m.Layout.ShardElems = bucket.Shard
	for _, s := range st.Settings {
		m.Settings = append(m.Settings, ckptSetting{s.Path, s.Value, s.Class.String()})
	}
	return m, sections, nil
}

// checkValues checks every parameter's values against its parameter and
// group, and returns the sections they fill: the master, the state the
// groups keep (AdamW's moments, and VMax where a group has AMSGrad; SGD's
// momentum where a group has one) and the model-dtype values.
func (st *CheckpointState) checkValues(model DType) ([]stateSection, error) {
	adamw := st.Groups[0].kind() == optAdamW
	momentum, amsgrad := adamw, false
	for _, g := range st.Groups {
		switch g := g.(type) {
		case AdamW:
			amsgrad = amsgrad || g.AMSGrad
		case SGD:
			momentum = momentum || g.Momentum != 0
		}
	}
	for p, q := range st.Params {
		v := &st.Values[p]
		at := fmt.Sprintf("CheckpointState.Values[%d] (%q)", p, q.Name)
		if v.Steps < 0 {
			return nil, errorf(ErrParam, "%s has taken %d steps; give 0 or more", at, v.Steps)
		}
		if q.Frozen || q.Count == 0 {
			if v.Master != nil || v.M != nil || v.V != nil || v.VMax != nil || v.Model.count != 0 || v.Steps != 0 {
				return nil, errorf(ErrParam, "%s: the parameter is frozen or empty, and a checkpoint holds nothing of it (the engine has its values in Param.Data); leave its ParamState empty", at)
			}
			continue
		}
		var groupMomentum, groupAMSGrad bool
		switch g := st.Groups[q.Group].(type) {
		case AdamW:
			groupMomentum, groupAMSGrad = true, g.AMSGrad
		case SGD:
			groupMomentum = g.Momentum != 0
		}
		for _, x := range []struct {
			name     string
			vals     []float32
			kept     bool // the parameter's group keeps this state
			required bool // ... and it must be given
		}{
			{"Master", v.Master, true, true},
			{"M", v.M, groupMomentum, groupMomentum && v.Steps > 0},
			{"V", v.V, adamw, adamw && v.Steps > 0},
			{"VMax", v.VMax, groupAMSGrad, groupAMSGrad && v.Steps > 0},
		} {
			switch {
			case x.vals == nil && x.required:
				return nil, errorf(ErrParam, "%s has no %s, and the parameter has taken %d steps (only a parameter that has taken none has zeros there); give its %d values", at, x.name, v.Steps, q.Count)
			case x.vals != nil && !x.kept:
				return nil, errorf(ErrParam, "%s has %s values, which its group %d (%T) does not keep; leave them nil", at, x.name, q.Group, st.Groups[q.Group])
			case x.vals != nil && len(x.vals) != q.Count:
				return nil, errorf(ErrParam, "%s has %d %s values for a parameter of %d elements; give %d", at, len(x.vals), x.name, q.Count, q.Count)
			}
		}
		if t := v.Model; t.count != 0 {
			if t.dtype != model || t.count != q.Count {
				return nil, errorf(ErrParam, "%s: Model is %d %v values; the parameter's are %d %v (or leave Model empty: the master rounded)", at, t.count, t.dtype, q.Count, model)
			}
			if err := t.check(at + ".Model"); err != nil {
				return nil, fmt.Errorf("%w: %w", ErrParam, err)
			}
		}
	}
	out := []stateSection{{"master", FP32, func(v *ParamState) []float32 { return v.Master }}}
	if momentum {
		out = append(out, stateSection{"m", FP32, func(v *ParamState) []float32 { return v.M }})
	}
	if adamw {
		out = append(out, stateSection{"v", FP32, func(v *ParamState) []float32 { return v.V }})
	}
	if amsgrad {
		out = append(out, stateSection{"vmax", FP32, func(v *ParamState) []float32 { return v.VMax }})
	}
	return append(out, stateSection{"model", model, nil}), nil
}

// writeRankFile writes the file of rank 0 into partial: each section's
// values parameter by parameter (the trained ones, in order: the shard of
// a world of one), then the client bytes; it returns its size and CRC.
func (st *CheckpointState) writeRankFile(fsys ckptFS, partial string, m ckptManifestData, sections []stateSection, client []byte) (int64, uint32, error) {
	footer := ckptFooter{Save: m.Save, Rank: 0, World: 1, ShardElems: int64(m.Layout.ShardElems)}
	for _, b := range m.Layout.Buckets {
		for _, mb := range b.Members {
			footer.Segments = append(footer.Segments, ckptSegment{int64(mb[0]), 0, int64(st.Params[mb[0]].Count), int64(mb[1])})
		}
	}
	name := filepath.Join(partial, rankFileName(0))
	return createRankFile(fsys, name, footer, nil, client, func(w *rankWriter) error {
		buf := make([]byte, min(ckptChunk, max(4*m.Layout.ShardElems, 4)))
		for _, sec := range sections {
			if err := st.writeSection(w, sec, buf); err != nil {
				return err
			}
		}
		return nil
	})
}

// writeSection writes one section: the trained parameters' values in
// order, from the caller's memory where they are there as they are
// stored, through buf where they are zeros or the master rounded.
func (st *CheckpointState) writeSection(w *rankWriter, sec stateSection, buf []byte) error {
	w.begin(sec.name, sec.dtype)
	defer w.end()
	size := sec.dtype.Size()
	per := len(buf) / size
	for p, q := range st.Params {
		if q.Frozen || q.Count == 0 {
			continue
		}
		v := &st.Values[p]
		switch {
		case sec.of != nil && sec.of(v) != nil:
			if err := w.add(f32Bytes(sec.of(v))); err != nil {
				return err
			}
		case sec.of == nil && v.Model.count != 0:
			if err := w.add(v.Model.hostBytes()); err != nil {
				return err
			}
		case sec.of == nil && sec.dtype == FP32:
			if err := w.add(f32Bytes(v.Master)); err != nil {
				return err
			}
		default: // zeros, or the master rounded, a buffer at a time
			for lo := 0; lo < q.Count; lo += per {
				n := min(per, q.Count-lo)
				b := buf[:n*size]
				if sec.of != nil {
					clear(b)
				} else {
					castHost(uintptr(unsafe.Pointer(&b[0])), sec.dtype, uintptr(unsafe.Pointer(&v.Master[lo])), FP32, n, 1)
				}
				if err := w.add(b); err != nil {
					return err
				}
			}
		}
	}
	return nil
}

// f32Bytes views x's memory as bytes.
func f32Bytes(x []float32) []byte {
	if len(x) == 0 {
		return nil
	}
	return unsafe.Slice((*byte)(unsafe.Pointer(&x[0])), 4*len(x))
}
