package deepspeed

import (
	"os"
	"path/filepath"
	"strings"
)

// The universal layout (ds_to_universal, 0.19) of a checkpoint: the model
// files copied from it (mp_rank_00_model_states.pt, or every rank's
// zero_pp_rank_*_model_states.pt at stage 3), zero/optimizer_state.pt (the
// optimizer's groups, the loss scaler, the clipping), and per trainable
// parameter a folder zero/NAME holding fp32.pt, exp_avg.pt and
// exp_avg_sq.pt ({'param': the whole tensor, fp32}) and step.pt (a scalar
// tensor). At stage 3 those files hold the bare tensor, flat, and there is
// no step.pt: the steps are those of rank 0's optimizer state, which
// optimizer_state.pt carries. Nothing in it depends on the world size it
// was saved at.

// universal reads the universal layout in r.dir.
func (r *reader) universal(files *checkpointFiles) (*State, error) {
	var models []*torchFile
	if r.stage3 {
		for rank := range len(files.z3models) {
			f, err := openTorchFile(files.z3models[rank])
			if err != nil {
				return nil, err
			}
			models = append(models, f)
		}
	} else {
		f, err := openTorchFile(files.model)
		if err != nil {
			return nil, err
		}
		models = append(models, f)
	}
	s, err := r.modelStates(models[0])
	if err != nil {
		return nil, inFile(err, models[0].name)
	}
	if r.stage3 && len(models) != s.World {
		return nil, errorf(ErrInconsistent, r.dir, "%d model-states files for a data-parallel world of %d; a rank's file is missing", len(models), s.World)
	}
	optPath := filepath.Join(r.dir, "zero", "optimizer_state.pt")
	of, err := openTorchFile(optPath)
	if err != nil {
		return nil, err
	}
	zs, _ := field(of.root, "zero_stage")
	stage, ok := zs.(enumValue)
	if !ok || stage.value < 1 || stage.value > 3 || (stage.value == 3) != r.stage3 {
		return nil, errorf(ErrInconsistent, optPath, "zero_stage %s beside the model files of a ZeRO-%s checkpoint", describe(zs), map[bool]string{true: "3", false: "1/2"}[r.stage3])
	}
	s.Stage = stage.value
	// the optimizer's settings are the model file's config and this file's groups
	config, _ := field(models[0].root, "ds_config")
	if r.stage3 {
		if err := r.plainLayout3(config); err != nil { // ds_to_universal reads such a run as a plain one: wrongly
			return nil, err
		}
	}
	o := &optimFile{config: config, state: of.root}
	if c, _ := field(of.root, "clip_grad"); c != nil {
		if o.clip, ok = number(c); !ok {
			return nil, errorf(ErrInconsistent, optPath, "clip_grad %s", describe(c))
		}
	}
	ls, _ := field(of.root, "loss_scaler")
	if o.scaler, ok = ls.(*pyObject); !ok {
		return nil, errorf(ErrInconsistent, optPath, "loss_scaler is %s", describe(ls))
	}
	if err := r.common(s, o); err != nil {
		return nil, err
	}
	pgs, _ := field(of.root, "param_groups")
	groups, ok := list(pgs)
	if !ok || len(groups) == 0 {
		return nil, errorf(ErrInconsistent, optPath, "param_groups %s", describe(pgs))
	}
	for g, pg := range groups {
		a, err := adamGroup(pg)
		if err != nil {
			return nil, errorf(ErrUnsupported, optPath, "optimizer group %d: %v", g, err)
		}
		s.Groups = append(s.Groups, Group{AdamW: a, Step: -1})
	}
	byName := map[string]any{}
	for _, e := range r.module {
		byName[e.key] = e.val
	}
	trainable := map[string]bool{}
	for k, shapes := range r.shapes {
		g := k // ZeRO-1/2: one param_shapes dict per group
		if r.stage3 {
			if g, err = groupListing(groups, k); err != nil {
				return nil, inFile(err, optPath)
			}
		} else if k >= len(groups) {
			return nil, errorf(ErrInconsistent, r.dir, "param_shapes has %d groups, the optimizer %d", len(r.shapes), len(groups))
		}
		for _, e := range shapes {
			if trainable[e.key] {
				return nil, errorf(ErrInconsistent, r.dir, "parameter %s in param_shapes twice", e.key)
			}
			trainable[e.key] = true
			p, err := r.universalParam(e.key, []int(e.val.(torchSize)), g)
			if err != nil {
				return nil, err
			}
			if p.Step < 0 {
				if p.Step, err = r.subGroupStep(of, k); err != nil {
					return nil, err
				}
			}
			if s.Groups[g].Step < 0 {
				s.Groups[g].Step = p.Step
			} else if s.Groups[g].Step != p.Step {
				return nil, errorf(ErrInconsistent, r.dir, "parameters of group %d have taken %d and %d steps", g, s.Groups[g].Step, p.Step)
			}
			if r.stage3 {
				p.Model = roundTo(p.Master, modelDType(config))
				p.Model.Shape = p.Shape
			} else {
				mv, ok := byName[p.Name]
				if !ok {
					return nil, errorf(ErrInconsistent, r.dir, "parameter %s of param_shapes is not in the module's state_dict", p.Name)
				}
				if p.Model, err = r.tensor(models[0], mv, p.Name, p.Shape); err != nil {
					return nil, err
				}
			}
			s.Params = append(s.Params, p)
		}
	}
	for g, grp := range s.Groups {
		if grp.Step < 0 {
			return nil, errorf(ErrInconsistent, optPath, "optimizer group %d holds no parameter", g)
		}
	}
	s.ModelDType = modelDType(config)
	if r.stage3 {
		err = r.extras3(s, models)
	} else {
		err = r.extras12(s, models[0], trainable)
	}
	if err != nil {
		return nil, err
	}
	if s.Scaler, err = lossScaler(o.scaler); err != nil {
		return nil, errorf(ErrInconsistent, optPath, "loss_scaler: %v", err)
	}
	return s, nil
}

// groupListing is the index of the optimizer group whose params list k.
func groupListing(groups []any, k int) (int, error) {
	found := -1
	for g, pg := range groups {
		ids, _ := field(pg, "params")
		idl, ok := ints(ids)
		if !ok {
			return 0, errorf(ErrInconsistent, "", "optimizer group %d lists %s", g, describe(ids))
		}
		for _, id := range idl {
			if id == k {
				if found >= 0 {
					return 0, errorf(ErrInconsistent, "", "optimizer groups %d and %d both list sub-group %d", found, g, k)
				}
				found = g
			}
		}
	}
	if found < 0 {
		return 0, errorf(ErrInconsistent, "", "no optimizer group lists sub-group %d", k)
	}
	return found, nil
}

// universalParam reads zero/NAME: the fp32 master, the moments, the step.
func (r *reader) universalParam(name string, shape []int, g int) (Param, error) {
	p := Param{Name: name, Shape: shape, Group: g}
	if name == "" || name == "." || name == ".." || strings.ContainsAny(name, `/\`) || name == "optimizer_state.pt" {
		return p, errorf(ErrInconsistent, r.dir, "parameter name %q is not a folder name of the universal layout", name)
	}
	dir := filepath.Join(r.dir, "zero", name)
	for _, c := range []struct {
		file string
		dst  *[]float32
	}{{"fp32.pt", &p.Master}, {"exp_avg.pt", &p.ExpAvg}, {"exp_avg_sq.pt", &p.ExpAvgSq}} {
		path := filepath.Join(dir, c.file)
		if _, err := os.Stat(path); err != nil && c.file != "fp32.pt" {
			return p, errorf(ErrUnsupported, path, "no %s: not Adam's state", c.file)
		}
		f, err := openTorchFile(path)
		if err != nil {
			return p, err
		}
		// {'param': tensor} in its shape, or (stage 3) the bare flat tensor
		v := f.root
		if d, ok := field(f.root, "param"); ok {
			v = d
		}
		tv, ok := v.(*tensorView)
		if !ok || tv.st.dtype != Float32 {
			return p, errorf(ErrInconsistent, path, "holds %s, not an fp32 tensor", describe(v))
		}
		want := shape
		if len(tv.shape) == 1 && len(shape) != 1 {
			want = []int{numel(shape)}
		}
		t, err := r.tensor(f, tv, name, want)
		if err != nil {
			return p, err
		}
		*c.dst, _ = t.Float32s()
	}
	path := filepath.Join(dir, "step.pt")
	if _, err := os.Stat(path); err != nil && r.stage3 {
		p.Step = -1 // stage 3 keeps the steps in optimizer_state.pt
		return p, nil
	}
	f, err := openTorchFile(path)
	if err != nil {
		return p, err
	}
	if p.Step, err = r.step(f, f.root); err != nil {
		return p, errorf(ErrInconsistent, path, "step: %v", err)
	}
	return p, nil
}

// subGroupStep is the step of stage 3's sub-group k, from the optimizer
// state ds_to_universal copies into optimizer_state.pt.
func (r *reader) subGroupStep(of *torchFile, k int) (int, error) {
	sd, _ := field(of.root, "optimizer_state_dict")
	st, _ := field(sd, "state")
	states, ok := intKeyed(st)
	if !ok {
		return 0, errorf(ErrInconsistent, of.name, "no optimizer_state_dict.state to take ZeRO-3's steps from")
	}
	ps, ok := states[k]
	if !ok {
		return 0, errorf(ErrInconsistent, of.name, "no optimizer state for sub-group %d", k)
	}
	v, _ := field(ps, "step")
	n, err := r.step(of, v)
	if err != nil {
		return 0, errorf(ErrInconsistent, of.name, "sub-group %d's step: %v", k, err)
	}
	return n, nil
}
