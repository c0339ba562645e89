package deepspeed

// A ZeRO-3 checkpoint (stage3.py, 0.19) holds, per data-parallel rank r,
//   - zero_pp_rank_r_mp_rank_00_model_states.pt: the buffers, each
//     parameter as an empty tensor, param_shapes (one dict per sub-group),
//     and each frozen parameter's partition (frozen_param_fragments);
//   - [bf16_]zero_pp_rank_r_mp_rank_00_optim_states.pt: fp32_flat_groups,
//     one flat fp32 tensor per sub-group, and torch's state_dict over them.
// In a sub-group's flat tensor every parameter of n elements takes
// ceil(n/W) elements on every rank, at the same offset; rank r holds its
// elements [r·ceil(n/W), (r+1)·ceil(n/W)), the last rank's tail padding.
// This is how zero_to_fp32.py reads it. The model-dtype parameters are not
// in the checkpoint: DeepSpeed's step makes them by rounding the fp32
// master to the model dtype, and so does the reader.

// assemble3 fills s from a ZeRO-3 checkpoint's files.
func (r *reader) assemble3(s *State, ranks []*optimFile, models []*torchFile) error {
	first := ranks[0]
	s.Stage = 3
	if err := r.common(s, first); err != nil {
		return err
	}
	if err := r.plainLayout3(first.config); err != nil {
		return err
	}
	s.ModelDType = modelDType(first.config)
	w := len(ranks)
	trainable := map[string]bool{}
	for k, shapes := range r.shapes {
		offs := make([]int, len(shapes))
		total := 0
		for i, e := range shapes {
			offs[i] = total
			total += (numel([]int(e.val.(torchSize))) + w - 1) / w
			if total > 1<<40 {
				return errorf(ErrInconsistent, r.dir, "sub-group %d's shapes add up to more than 2^40 elements", k)
			}
		}
		var master, m, v [][]float32
		g := -1
		for _, o := range ranks {
			if got := o.fp32[k].numel; got != total {
				return errorf(ErrInconsistent, r.dir, "rank %d's file holds %d master elements of sub-group %d; param_shapes gives %d per rank at W=%d: not this model's, or not this world's", o.rank, got, k, total, w)
			}
			t, err := r.tensor(o.file, o.fp32[k], "fp32_flat_groups", nil)
			if err != nil {
				return err
			}
			x, _ := t.Float32s()
			master = append(master, x)
			mom, step, group, a, err := r.flatState(o, k, total)
			if err != nil {
				return err
			}
			if g >= 0 && group != g {
				return errorf(ErrInconsistent, r.dir, "ranks put sub-group %d in optimizer groups %d and %d", k, g, group)
			}
			g = group
			if err := r.groupState(s, g, a, step, o.rank); err != nil {
				return err
			}
			m, v = append(m, mom[0]), append(v, mom[1])
		}
		for i, e := range shapes {
			if trainable[e.key] {
				return errorf(ErrInconsistent, r.dir, "parameter %s in param_shapes twice", e.key)
			}
			trainable[e.key] = true
			shape := []int(e.val.(torchSize))
			n := numel(shape)
			pn := (n + w - 1) / w
			p := Param{Name: e.key, Shape: shape, Group: g, Step: s.Groups[g].Step,
				Master:   gather3(master, offs[i], pn, n),
				ExpAvg:   gather3(m, offs[i], pn, n),
				ExpAvgSq: gather3(v, offs[i], pn, n)}
			p.Model = roundTo(p.Master, s.ModelDType)
			p.Model.Shape = shape
			s.Params = append(s.Params, p)
		}
	}
	for g, grp := range s.Groups {
		if grp.Step < 0 {
			return errorf(ErrInconsistent, r.dir, "optimizer group %d holds no sub-group", g)
		}
	}
	if err := r.extras3(s, models); err != nil {
		return err
	}
	return r.scaler(s, ranks)
}

// plainLayout3 refuses a ZeRO-3 run whose config partitions the state in
// a layout of its own: ZeRO++'s hierarchical partitioning (hpZ) or MiCS's
// shard groups.
func (r *reader) plainLayout3(config any) error {
	for _, c := range []struct {
		key, what string
		most      float64 // the largest value that keeps the plain layout
	}{
		{"zero_hpz_partition_size", "ZeRO++ hierarchical partitioning", 1},
		{"mics_shard_size", "MiCS", 0},
	} {
		v, _ := configValue(config, "zero_optimization", c.key)
		if n, ok := number(v); ok && n > c.most {
			return errorf(ErrUnsupported, r.dir, "zero_optimization.%s %v: %s partitions the state in a layout zero does not read", c.key, n, c.what)
		}
	}
	return nil
}

// extras3 reads a ZeRO-3 checkpoint's buffers (rank 0's model file) and
// frozen parameters (each rank's partition, from its model file).
func (r *reader) extras3(s *State, models []*torchFile) error {
	byName := map[string]any{}
	for _, e := range r.module {
		byName[e.key] = e.val
	}
	for _, name := range r.buffers {
		v, ok := byName[name]
		if !ok {
			return errorf(ErrInconsistent, r.dir, "buffer %s is not in the module's state_dict", name)
		}
		t, err := r.tensor(models[0], v, name, nil)
		if err != nil {
			return err
		}
		s.Buffers = append(s.Buffers, NamedTensor{name, t})
	}
	for _, e := range r.frozen {
		sz, ok := e.val.(torchSize)
		if !ok {
			return errorf(ErrInconsistent, r.dir, "frozen_param_shapes[%q] is %s", e.key, describe(e.val))
		}
		n := numel(sz)
		pn := (n + len(models) - 1) / len(models)
		var data []byte
		var dt DType
		for rank, f := range models {
			frags, _ := field(f.root, "frozen_param_fragments")
			fv, ok := field(frags, e.key)
			if !ok {
				return errorf(ErrInconsistent, r.dir, "rank %d's model states hold no fragment of frozen parameter %s", rank, e.key)
			}
			t, err := r.tensor(f, fv, "frozen parameter "+e.key, []int{pn})
			if err != nil {
				return err
			}
			if rank > 0 && t.DType != dt {
				return errorf(ErrInconsistent, r.dir, "frozen parameter %s is %v on rank 0 and %v on rank %d", e.key, dt, t.DType, rank)
			}
			dt = t.DType
			data = append(data, t.Data...)
		}
		s.Params = append(s.Params, Param{Name: e.key, Shape: []int(sz), Group: -1, Frozen: true,
			Model: Tensor{DType: dt, Shape: []int(sz), Data: data[:n*dt.Size()]}})
	}
	return nil
}

// gather3 joins a parameter's pieces: pn elements at off in each rank's
// flat tensor, the first n of them.
func gather3(parts [][]float32, off, pn, n int) []float32 {
	out := make([]float32, 0, pn*len(parts))
	for _, p := range parts {
		out = append(out, p[off:off+pn]...)
	}
	return out[:n:n]
}
