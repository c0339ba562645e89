package deepspeed

import (
	"encoding/json"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"regexp"
	"sort"
	"strconv"
	"strings"

	"zero"
)

// A DeepSpeed ZeRO-1/2 checkpoint (engine.save_checkpoint, 0.19) is a
// directory DIR/TAG (TAG in DIR/latest, e.g. global_step3) holding
//   - mp_rank_00_model_states.pt: the module's state_dict (model dtype),
//     param_shapes (per optimizer group, name → shape, in the order of the
//     flat groups), frozen_param_shapes/_fragments (stage 2), the buffers'
//     names, the scheduler's state, the step counters and the config;
//   - per data-parallel rank r, [bf16_]zero_pp_rank_r_mp_rank_00_optim_states.pt:
//     its partition of each group's flat fp32 master, without the tail
//     padding (single_partition_of_fp32_groups), torch's optimizer
//     state_dict over those partitions (padded), the loss scaler, the
//     paddings and the partition count.
// Each group's parameters lie back to back in one flat buffer (with the
// param_alignment_paddings after each), padded at the end to a multiple
// of 2·W, and rank r holds elements [r·P, (r+1)·P) with P = padded/W.
// This is how zero_to_fp32.py reads it; Read reads the same, and checks
// every length and mapping the files carry against that layout.

var (
	optimFileRE = regexp.MustCompile(`^(bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$`)
	modelFileRE = regexp.MustCompile(`^mp_rank_(\d+)_model_states\.pt$`)
	z3ModelRE   = regexp.MustCompile(`^zero_pp_rank_(\d+)_mp_rank_(\d+)_model_states\.pt$`)
)

// Read reads a DeepSpeed ZeRO checkpoint (stage 1, 2 or 3): dir is the
// directory save_checkpoint was given (its latest file names the tag), the
// tag directory itself, or the universal layout ds_to_universal made of
// one (its output folder). What zero cannot continue is refused with
// ErrUnsupported, naming it; files that disagree with each other or with
// their names give ErrInconsistent; damaged files ErrFormat. On any error
// no State is returned.
func Read(dir string) (*State, error) {
	tagDir, err := resolveTag(dir)
	if err != nil {
		return nil, err
	}
	files, err := listCheckpoint(tagDir)
	if err != nil {
		return nil, err
	}
	r := &reader{dir: tagDir, stage3: files.model == ""}
	if st, err := os.Stat(filepath.Join(tagDir, "zero", "optimizer_state.pt")); err == nil && st.Mode().IsRegular() {
		return r.universal(files)
	}
	if len(files.optim) == 0 {
		return nil, errorf(ErrUnsupported, tagDir, "no *_optim_states.pt files: not a ZeRO checkpoint (stage 0 keeps the optimizer in the model file)")
	}
	modelFile := files.model
	if r.stage3 {
		modelFile = files.z3models[0]
	}
	model, err := openTorchFile(modelFile)
	if err != nil {
		return nil, err
	}
	s, err := r.modelStates(model)
	if err != nil {
		return nil, inFile(err, modelFile)
	}
	if len(files.optim) != s.World {
		return nil, errorf(ErrInconsistent, tagDir, "%d optimizer files for a data-parallel world of %d (dp_world_size); a rank's file is missing or left from another save", len(files.optim), s.World)
	}
	ranks := make([]*optimFile, s.World)
	for rank, path := range files.optim {
		f, err := openTorchFile(path)
		if err != nil {
			return nil, err
		}
		o, err := r.optimFile(f, rank, files.bf16)
		if err != nil {
			return nil, inFile(err, path)
		}
		ranks[rank] = o
	}
	if r.stage3 {
		if len(files.z3models) != s.World {
			return nil, errorf(ErrInconsistent, tagDir, "%d model-states files for a data-parallel world of %d; a rank's file is missing or left from another save", len(files.z3models), s.World)
		}
		models := []*torchFile{model}
		for rank := 1; rank < s.World; rank++ {
			f, err := openTorchFile(files.z3models[rank])
			if err != nil {
				return nil, err
			}
			models = append(models, f)
		}
		err = r.assemble3(s, ranks, models)
	} else {
		err = r.assemble(s, ranks, model)
	}
	if err != nil {
		return nil, err
	}
	return s, nil
}

// resolveTag finds the tag directory: dir/latest's tag, or dir itself.
func resolveTag(dir string) (string, error) {
	latest := filepath.Join(dir, "latest")
	st, err := os.Stat(latest)
	if err != nil {
		if _, err := os.Stat(dir); err != nil {
			return "", &Error{Kind: ErrInconsistent, File: dir, Msg: err.Error()}
		}
		return dir, nil
	}
	if !st.Mode().IsRegular() || st.Size() > 4096 {
		return "", errorf(ErrInconsistent, latest, "not a tag file (a regular file naming the checkpoint's directory)")
	}
	b, err := os.ReadFile(latest)
	if err != nil {
		return "", &Error{Kind: ErrInconsistent, File: latest, Msg: err.Error()}
	}
	tag := strings.TrimSpace(string(b))
	if tag == "" || tag == "." || tag == ".." || strings.ContainsAny(tag, `/\`) {
		return "", errorf(ErrInconsistent, latest, "tag %q is not a directory name", tag)
	}
	return filepath.Join(dir, tag), nil
}

type checkpointFiles struct {
	model    string         // mp_rank_00_model_states.pt (stages 1, 2)
	z3models map[int]string // zero_pp_rank_R_mp_rank_00_model_states.pt (stage 3), by rank
	optim    map[int]string // by rank
	bf16     bool           // the optimizer files carry the bf16_ prefix
}

// listCheckpoint sorts a tag directory's files, refusing the layouts
// zero cannot continue before opening any.
func listCheckpoint(dir string) (*checkpointFiles, error) {
	ents, err := os.ReadDir(dir)
	if err != nil {
		return nil, &Error{Kind: ErrInconsistent, File: dir, Msg: err.Error()}
	}
	c := &checkpointFiles{optim: map[int]string{}, z3models: map[int]string{}}
	prefixes := map[bool]bool{}
	for _, e := range ents {
		name := e.Name()
		switch {
		case strings.HasPrefix(name, "layer_"):
			return nil, errorf(ErrUnsupported, dir, "%s: a pipeline-parallel checkpoint (layer files); zero has data parallelism only", name)
		case strings.HasPrefix(name, "expp_rank_") || strings.Contains(name, "expert"):
			return nil, errorf(ErrUnsupported, dir, "%s: a mixture-of-experts checkpoint (expert-parallel files); zero has data parallelism only", name)
		}
		if m := optimFileRE.FindStringSubmatch(name); m != nil {
			if m[3] != "00" {
				return nil, errorf(ErrUnsupported, dir, "%s: a tensor-parallel checkpoint (model-parallel rank %s); zero has data parallelism only", name, m[3])
			}
			rank, err := strconv.Atoi(m[2])
			if err != nil || rank > 1<<20 {
				return nil, errorf(ErrInconsistent, dir, "%s: rank %s", name, m[2])
			}
			if _, dup := c.optim[rank]; dup {
				return nil, errorf(ErrInconsistent, dir, "two optimizer files for rank %d (with and without the bf16_ prefix)", rank)
			}
			c.optim[rank] = filepath.Join(dir, name)
			prefixes[m[1] != ""] = true
			c.bf16 = m[1] != ""
			continue
		}
		if m := modelFileRE.FindStringSubmatch(name); m != nil {
			if m[1] != "00" {
				return nil, errorf(ErrUnsupported, dir, "%s: a tensor-parallel checkpoint (model-parallel rank %s); zero has data parallelism only", name, m[1])
			}
			c.model = filepath.Join(dir, name)
			continue
		}
		if m := z3ModelRE.FindStringSubmatch(name); m != nil {
			if m[2] != "00" {
				return nil, errorf(ErrUnsupported, dir, "%s: a tensor-parallel checkpoint (model-parallel rank %s); zero has data parallelism only", name, m[2])
			}
			rank, err := strconv.Atoi(m[1])
			if err != nil || rank > 1<<20 {
				return nil, errorf(ErrInconsistent, dir, "%s: rank %s", name, m[1])
			}
			c.z3models[rank] = filepath.Join(dir, name)
		}
	}
	switch {
	case len(prefixes) > 1:
		return nil, errorf(ErrInconsistent, dir, "optimizer files with and without the bf16_ prefix: files of two saves")
	case c.model != "" && len(c.z3models) > 0:
		return nil, errorf(ErrInconsistent, dir, "both mp_rank_00_model_states.pt (ZeRO-1/2) and zero_pp_rank_*_model_states.pt (ZeRO-3): files of two saves")
	case c.model == "" && len(c.z3models) == 0:
		return nil, errorf(ErrInconsistent, dir, "no mp_rank_00_model_states.pt: not a DeepSpeed checkpoint directory (give the directory save_checkpoint wrote, or its global_stepN)")
	}
	for r := range len(c.optim) {
		if _, ok := c.optim[r]; !ok {
			return nil, errorf(ErrInconsistent, dir, "no optimizer file for rank %d (ranks 0..%d expected)", r, len(c.optim)-1)
		}
	}
	for r := range len(c.z3models) {
		if _, ok := c.z3models[r]; !ok {
			return nil, errorf(ErrInconsistent, dir, "no model-states file for rank %d (ranks 0..%d expected)", r, len(c.z3models)-1)
		}
	}
	return c, nil
}

// reader carries what the files say as it goes.
type reader struct {
	dir       string
	stage3    bool
	world     int
	shapes    [][]kv // per group: name → torchSize
	module    []kv
	buffers   []string
	frozen    []kv // frozen_param_shapes
	fragments any  // frozen_param_fragments
	config    any
}

// modelStates reads mp_rank_00_model_states.pt (at stage 3, rank 0's
// zero_pp_rank_0_mp_rank_00_model_states.pt).
func (r *reader) modelStates(f *torchFile) (*State, error) {
	s := &State{Dir: r.dir, Shared: map[string]string{}}
	root := f.root
	if _, ok := entries(root); !ok {
		return nil, errorf(ErrInconsistent, "", "not a model-states file (its pickle holds %s, not a dict)", describe(root))
	}
	module, ok := field(root, "module")
	if r.module, ok = entries(module); !ok {
		return nil, errorf(ErrInconsistent, "", "not a model-states file: no module state_dict")
	}
	if v, _ := field(root, "ds_version"); v != nil {
		s.DSVersion, _ = v.(string)
	}
	if dims, ok := field(root, "checkpoint_parallel_dimensions"); ok && dims != nil {
		for _, k := range []string{"pp_degree", "tp_degree"} {
			if d, _ := field(dims, k); d != nil {
				if n, ok := d.(int); !ok || n != 1 {
					return nil, errorf(ErrUnsupported, "", "%s %s: zero has data parallelism only", k, describe(d))
				}
			}
		}
	}
	if v, _ := field(root, "mp_world_size"); v != nil && v != 1 {
		return nil, errorf(ErrUnsupported, "", "mp_world_size %s: a tensor-parallel checkpoint; zero has data parallelism only", describe(v))
	}
	w, _ := field(root, "dp_world_size")
	world, ok := w.(int)
	if !ok || world < 1 || world > 1<<20 {
		return nil, errorf(ErrInconsistent, "", "dp_world_size %s", describe(w))
	}
	s.World, r.world = world, world
	ps, _ := field(root, "param_shapes")
	groups, ok := list(ps)
	if !ok || len(groups) == 0 {
		return nil, errorf(ErrUnsupported, "", "param_shapes %s: not a ZeRO checkpoint", describe(ps))
	}
	for g, grp := range groups {
		es, ok := entries(grp)
		if !ok {
			return nil, errorf(ErrInconsistent, "", "param_shapes[%d] is %s", g, describe(grp))
		}
		for _, e := range es {
			if _, ok := e.val.(torchSize); !ok {
				return nil, errorf(ErrInconsistent, "", "param_shapes[%d][%q] is %s, not a torch.Size", g, e.key, describe(e.val))
			}
		}
		r.shapes = append(r.shapes, es)
	}
	if bn, _ := field(root, "buffer_names"); bn != nil {
		names, ok := list(bn)
		if !ok {
			return nil, errorf(ErrInconsistent, "", "buffer_names %s", describe(bn))
		}
		for _, n := range names {
			name, ok := n.(string)
			if !ok {
				return nil, errorf(ErrInconsistent, "", "buffer_names holds %s", describe(n))
			}
			r.buffers = append(r.buffers, name)
		}
	}
	if fs, _ := field(root, "frozen_param_shapes"); fs != nil {
		if r.frozen, ok = entries(fs); !ok {
			return nil, errorf(ErrInconsistent, "", "frozen_param_shapes %s", describe(fs))
		}
		r.fragments, _ = field(root, "frozen_param_fragments")
		s.frozenListed = true
	}
	if sp, _ := field(root, "shared_params"); sp != nil {
		es, ok := entries(sp)
		if !ok {
			return nil, errorf(ErrInconsistent, "", "shared_params %s", describe(sp))
		}
		for _, e := range es {
			src, ok := e.val.(string)
			if !ok {
				return nil, errorf(ErrInconsistent, "", "shared_params[%q] is %s", e.key, describe(e.val))
			}
			s.Shared[e.key] = src
		}
	}
	for _, c := range []struct {
		key string
		dst *int
	}{{"global_steps", &s.GlobalSteps}, {"skipped_steps", &s.SkippedSteps}, {"global_samples", &s.GlobalSamples}} {
		if v, _ := field(root, c.key); v != nil {
			n, ok := v.(int)
			if !ok || n < 0 {
				return nil, errorf(ErrInconsistent, "", "%s %s", c.key, describe(v))
			}
			*c.dst = n
		}
	}
	s.Scheduler.LastBatchIteration = -1
	if sch, _ := field(root, "lr_scheduler"); sch != nil {
		v, ok := field(sch, "last_batch_iteration")
		n, isInt := v.(int)
		if !ok || !isInt {
			return nil, errorf(ErrUnsupported, "", "lr_scheduler %s: only DeepSpeed's schedules (last_batch_iteration) are read", describe(sch))
		}
		s.Scheduler.LastBatchIteration = n
	}
	return s, nil
}

// optimFile is what one rank's optimizer file holds, checked.
type optimFile struct {
	rank     int
	stage    int
	fp32     []*tensorView // per group: the partition without its tail padding
	paddings []int         // group_paddings
	align    [][]int       // param_alignment_paddings (nil: none)
	slices   [][]kv        // param_slice_mappings
	state    any           // base_optimizer_state
	scaler   *pyObject
	clip     float64
	config   any
	file     *torchFile
}

func (r *reader) optimFile(f *torchFile, rank int, bf16Name bool) (*optimFile, error) {
	root := f.root
	sd, ok := field(root, "optimizer_state_dict")
	if !ok {
		return nil, errorf(ErrInconsistent, "", "not an optimizer-states file: no optimizer_state_dict (its pickle holds %s)", describe(root))
	}
	o := &optimFile{rank: rank, file: f}
	o.config, _ = field(root, "ds_config")
	zs, _ := field(sd, "zero_stage")
	stage, ok := zs.(enumValue)
	if !ok {
		return nil, errorf(ErrInconsistent, "", "zero_stage %s: not a ZeRO optimizer file", describe(zs))
	}
	switch {
	case stage.value == 3 && !r.stage3:
		return nil, errorf(ErrInconsistent, "", "a ZeRO-3 optimizer file beside a ZeRO-1/2 model file: files of two saves")
	case (stage.value == 1 || stage.value == 2) && r.stage3:
		return nil, errorf(ErrInconsistent, "", "a ZeRO-%d optimizer file beside ZeRO-3 model files: files of two saves", stage.value)
	case stage.value < 1 || stage.value > 3:
		return nil, errorf(ErrUnsupported, "", "zero_stage %d", stage.value)
	}
	o.stage = stage.value
	pc, _ := field(sd, "partition_count")
	counts, ok := ints(pc)
	if n, isInt := pc.(int); isInt {
		counts, ok = []int{n}, true
	}
	if !ok || len(counts) == 0 {
		return nil, errorf(ErrInconsistent, "", "partition_count %s", describe(pc))
	}
	for _, c := range counts {
		if c != counts[0] {
			return nil, errorf(ErrUnsupported, "", "partition counts %v differ between groups (expert parallelism); zero has one data-parallel group", counts)
		}
	}
	if counts[0] != r.world {
		return nil, errorf(ErrInconsistent, "", "partition_count %d, but the model file's dp_world_size is %d", counts[0], r.world)
	}
	if bf16Name != configBool(o.config, "bf16", "enabled") {
		return nil, errorf(ErrInconsistent, "", "the file's name says bf16 %v, its config's bf16.enabled %v: not what its name says", bf16Name, !bf16Name)
	}
	masterKey := "single_partition_of_fp32_groups"
	if r.stage3 {
		masterKey = "fp32_flat_groups"
	}
	fp, _ := field(sd, masterKey)
	parts, ok := list(fp)
	if !ok || len(parts) != len(r.shapes) {
		return nil, errorf(ErrInconsistent, "", "%s is %s for %d parameter groups", masterKey, describe(fp), len(r.shapes))
	}
	for g, p := range parts {
		t, ok := p.(*tensorView)
		if !ok || len(t.shape) != 1 {
			return nil, errorf(ErrInconsistent, "", "single_partition_of_fp32_groups[%d] is %s, not a flat tensor", g, describe(p))
		}
		if t.st.dtype != Float32 {
			return nil, errorf(ErrUnsupported, "", "the master weights of group %d are %v: zero keeps an fp32 master (the run set a 16-bit master)", g, t.st.dtype)
		}
		o.fp32 = append(o.fp32, t)
	}
	ls, _ := field(sd, "loss_scaler")
	if o.scaler, ok = ls.(*pyObject); !ok {
		return nil, errorf(ErrInconsistent, "", "loss_scaler is %s", describe(ls))
	}
	if r.stage3 {
		// ZeRO-3 keeps torch's state_dict of the flat groups under this key
		o.state, _ = field(sd, "optimizer_state_dict")
		return o, nil
	}
	gp, _ := field(sd, "group_paddings")
	if o.paddings, ok = ints(gp); !ok || len(o.paddings) != len(r.shapes) {
		return nil, errorf(ErrInconsistent, "", "group_paddings %s for %d groups", describe(gp), len(r.shapes))
	}
	if ap, _ := field(sd, "param_alignment_paddings"); ap != nil {
		gs, ok := list(ap)
		if !ok || len(gs) != len(r.shapes) {
			return nil, errorf(ErrInconsistent, "", "param_alignment_paddings %s for %d groups", describe(ap), len(r.shapes))
		}
		for g, x := range gs {
			p, ok := ints(x)
			if !ok || len(p) != len(r.shapes[g]) {
				return nil, errorf(ErrInconsistent, "", "param_alignment_paddings[%d] %s for %d parameters", g, describe(x), len(r.shapes[g]))
			}
			o.align = append(o.align, p)
		}
	}
	if sm, _ := field(sd, "param_slice_mappings"); sm != nil {
		gs, ok := list(sm)
		if !ok || len(gs) != len(r.shapes) {
			return nil, errorf(ErrInconsistent, "", "param_slice_mappings %s for %d groups", describe(sm), len(r.shapes))
		}
		for g, x := range gs {
			es, ok := entries(x)
			if !ok {
				return nil, errorf(ErrInconsistent, "", "param_slice_mappings[%d] is %s", g, describe(x))
			}
			o.slices = append(o.slices, es)
		}
	}
	o.state, _ = field(sd, "base_optimizer_state")
	if c, _ := field(sd, "clip_grad"); c != nil {
		if o.clip, ok = number(c); !ok {
			return nil, errorf(ErrInconsistent, "", "clip_grad %s", describe(c))
		}
	}
	return o, nil
}

// assemble checks the ranks against each other and the layout, and
// fills s's parameters, groups, scaler and config.
func (r *reader) assemble(s *State, ranks []*optimFile, model *torchFile) error {
	first := ranks[0]
	s.Stage = first.stage
	for _, o := range ranks[1:] {
		if o.stage != s.Stage {
			return errorf(ErrInconsistent, r.dir, "rank 0 is a ZeRO-%d file, rank %d a ZeRO-%d file: files of two saves", s.Stage, o.rank, o.stage)
		}
	}
	if err := r.common(s, first); err != nil {
		return err
	}

	byName := map[string]any{}
	for _, e := range r.module {
		byName[e.key] = e.val
	}
	trainable := map[string]bool{}
	for g, shapes := range r.shapes {
		lay, err := r.layout(g, ranks)
		if err != nil {
			return err
		}
		master, err := r.concatMaster(g, ranks, lay)
		if err != nil {
			return err
		}
		moments, step, err := r.moments(s, g, ranks, lay)
		if err != nil {
			return err
		}
		for i, e := range shapes {
			if trainable[e.key] {
				return errorf(ErrInconsistent, r.dir, "parameter %s in param_shapes twice", e.key)
			}
			trainable[e.key] = true
			shape := []int(e.val.(torchSize))
			n := numel(shape)
			off := lay.offsets[i]
			p := Param{Name: e.key, Shape: shape, Group: g, Step: step,
				Master:   master[off : off+n : off+n],
				ExpAvg:   moments[0][off : off+n : off+n],
				ExpAvgSq: moments[1][off : off+n : off+n]}
			mv, ok := byName[e.key]
			if !ok {
				return errorf(ErrInconsistent, r.dir, "parameter %s of param_shapes is not in the module's state_dict", e.key)
			}
			if p.Model, err = r.tensor(model, mv, e.key, shape); err != nil {
				return err
			}
			if s.ModelDType == 0 {
				s.ModelDType = p.Model.DType
			} else if p.Model.DType != s.ModelDType {
				return errorf(ErrInconsistent, r.dir, "parameter %s is %v in the module, others %v", e.key, p.Model.DType, s.ModelDType)
			}
			s.Params = append(s.Params, p)
		}
	}
	if want := modelDType(first.config); s.ModelDType != want {
		return errorf(ErrInconsistent, r.dir, "the module's parameters are %v, but the config trains in %v", s.ModelDType, want)
	}
	if err := r.extras12(s, model, trainable); err != nil {
		return err
	}
	return r.scaler(s, ranks)
}

// extras12 reads a ZeRO-1/2 model file's buffers and frozen parameters:
// those frozen_param_shapes lists (stage 2, with their fragments) or, at
// stage 1, every other entry of the module's state_dict.
func (r *reader) extras12(s *State, model *torchFile, trainable map[string]bool) error {
	byName := map[string]any{}
	for _, e := range r.module {
		byName[e.key] = e.val
	}
	isBuffer := map[string]bool{}
	for _, name := range r.buffers {
		v, ok := byName[name]
		if !ok {
			return errorf(ErrInconsistent, r.dir, "buffer %s is not in the module's state_dict", name)
		}
		t, err := r.tensor(model, v, name, nil)
		if err != nil {
			return err
		}
		isBuffer[name] = true
		s.Buffers = append(s.Buffers, NamedTensor{name, t})
	}
	// frozen: listed (stage 2, with their fragments) or, at stage 1, every
	// other entry of the module's state_dict
	listed := map[string]torchSize{}
	for _, e := range r.frozen {
		sz, ok := e.val.(torchSize)
		if !ok {
			return errorf(ErrInconsistent, r.dir, "frozen_param_shapes[%q] is %s", e.key, describe(e.val))
		}
		listed[e.key] = sz
	}
	for _, e := range r.module {
		if trainable[e.key] || isBuffer[e.key] {
			continue
		}
		if _, shared := s.Shared[e.key]; shared {
			continue
		}
		src, shape := e.val, []int(nil)
		if sz, ok := listed[e.key]; ok {
			frag, ok := field(r.fragments, e.key)
			if !ok {
				return errorf(ErrInconsistent, r.dir, "frozen parameter %s has no entry in frozen_param_fragments", e.key)
			}
			src, shape = frag, sz
			delete(listed, e.key)
		} else if s.frozenListed {
			return errorf(ErrInconsistent, r.dir, "%s is in the module's state_dict but neither a parameter, a buffer nor a frozen parameter of the checkpoint", e.key)
		}
		t, err := r.tensor(model, src, e.key, shape)
		if err != nil {
			return err
		}
		s.Params = append(s.Params, Param{Name: e.key, Shape: t.Shape, Group: -1, Frozen: true, Model: t})
	}
	if len(listed) > 0 {
		return errorf(ErrInconsistent, r.dir, "frozen parameters %v are not in the module's state_dict", sortedKeys(listed))
	}
	return nil
}

// common reads what every stage keeps alike: the optimizer's kind, the
// config, the schedule's type, the clipping.
func (r *reader) common(s *State, first *optimFile) error {
	if err := r.optimizerKind(first); err != nil {
		return err
	}
	for _, k := range []string{"offload_optimizer", "offload_param"} {
		if off, _ := configString(first.config, "zero_optimization", k, "device"); off == "nvme" {
			return errorf(ErrUnsupported, r.dir, "zero_optimization.%s.device nvme: the state is in swap files beside the checkpoint, not in it", k)
		}
	}
	cfg := 1 << 16
	js, ok := toJSON(first.config, &cfg)
	if !ok {
		return errorf(ErrInconsistent, r.dir, "ds_config is not a plain JSON value")
	}
	if s.Config, _ = json.Marshal(js); s.Config == nil {
		return errorf(ErrInconsistent, r.dir, "ds_config cannot be written as JSON")
	}
	if t, ok := configString(first.config, "scheduler", "type"); ok {
		s.Scheduler.Type = t
	}
	s.ClipGrad = first.clip
	if v, ok := configValue(first.config, "gradient_clipping"); ok && first.clip == 0 {
		s.ClipGrad, _ = number(v)
	}
	return nil
}

// layout is one group's flat layout.
type layout struct {
	offsets  []int // each parameter's offset in the flat group
	unpadded int   // the parameters and their alignment paddings
	part     int   // P: each rank's partition
}

func (r *reader) layout(g int, ranks []*optimFile) (layout, error) {
	w := len(ranks)
	shapes := r.shapes[g]
	align := ranks[0].align
	var l layout
	off := 0
	for i, e := range shapes {
		l.offsets = append(l.offsets, off)
		n := numel([]int(e.val.(torchSize)))
		off += n
		if align != nil {
			if align[g][i] < 0 || align[g][i] > 1<<10 {
				return l, errorf(ErrInconsistent, r.dir, "param_alignment_paddings[%d][%d] = %d", g, i, align[g][i])
			}
			off += align[g][i]
		}
		if off > 1<<40 {
			return l, errorf(ErrInconsistent, r.dir, "group %d's shapes add up to more than 2^40 elements", g)
		}
	}
	l.unpadded = off
	a := 2 * w
	padded := (off + a - 1) / a * a
	l.part = padded / w
	for _, o := range ranks {
		if o.align != nil && align != nil {
			for i := range align[g] {
				if o.align[g][i] != align[g][i] {
					return l, errorf(ErrInconsistent, r.dir, "ranks 0 and %d disagree on group %d's alignment paddings", o.rank, g)
				}
			}
		}
		lean := min(max(l.unpadded-o.rank*l.part, 0), l.part)
		if got := o.fp32[g].numel; got != lean {
			return l, errorf(ErrInconsistent, r.dir, "rank %d's file holds %d master elements of group %d; rank %d of %d holds %d of its %d (param_shapes): not rank %d's file, or not this model's", o.rank, got, g, o.rank, w, lean, l.unpadded, o.rank)
		}
		if o.paddings[g] != l.part-lean {
			return l, errorf(ErrInconsistent, r.dir, "rank %d's group_paddings[%d] is %d, the layout gives %d", o.rank, g, o.paddings[g], l.part-lean)
		}
		if o.slices != nil {
			if err := r.checkSlices(g, o, l); err != nil {
				return l, err
			}
		}
	}
	return l, nil
}

// checkSlices holds a rank's param_slice_mappings (which parameter
// fragments its partition holds, and where) to the layout: a file
// renamed to another rank's name fails here even where the sizes agree.
func (r *reader) checkSlices(g int, o *optimFile, l layout) error {
	lo, hi := o.rank*l.part, (o.rank+1)*l.part
	var want []kv
	for i, e := range r.shapes[g] {
		n := numel([]int(e.val.(torchSize)))
		s, t := max(l.offsets[i], lo), min(l.offsets[i]+n, hi)
		if s < t {
			want = append(want, kv{e.key, [2]int{s - lo, t - s}})
		}
	}
	got := o.slices[g]
	bad := len(got) != len(want)
	for i := 0; !bad && i < len(got); i++ {
		fa, _ := got[i].val.(*pyObject)
		start, _ := field(fa, "start")
		n, _ := field(fa, "numel")
		w := want[i].val.([2]int)
		bad = got[i].key != want[i].key || start != w[0] || n != w[1]
	}
	if bad {
		return errorf(ErrInconsistent, r.dir, "rank %d's param_slice_mappings for group %d are not rank %d's partition of the layout param_shapes gives: not rank %d's file, or not this model's", o.rank, g, o.rank, o.rank)
	}
	return nil
}

// concatMaster joins the ranks' partitions of group g's fp32 master.
func (r *reader) concatMaster(g int, ranks []*optimFile, l layout) ([]float32, error) {
	out := make([]float32, 0, l.unpadded)
	for _, o := range ranks {
		t, err := r.tensor(o.file, o.fp32[g], fmt.Sprintf("rank %d's master of group %d", o.rank, g), nil)
		if err != nil {
			return nil, err
		}
		x, _ := t.Float32s()
		out = append(out, x...)
	}
	return out, nil
}

// flatState reads rank o's Adam state of its flat tensor k (torch's
// state id k, the k-th flat tensor the file holds): the two moments, want
// elements each, the step, and the index and settings of the optimizer
// group that lists it.
func (r *reader) flatState(o *optimFile, k, want int) (m [2][]float32, step, group int, a zero.AdamW, err error) {
	if _, elastic := list(o.state); elastic {
		return m, 0, 0, a, errorf(ErrUnsupported, r.dir, "an elastic checkpoint (zero_optimization.elastic_checkpoint: true) is not read yet; save with elastic_checkpoint false")
	}
	st, _ := field(o.state, "state")
	pgs, _ := field(o.state, "param_groups")
	states, ok1 := intKeyed(st)
	groups, ok2 := list(pgs)
	if !ok1 || !ok2 {
		return m, 0, 0, a, errorf(ErrInconsistent, r.dir, "rank %d's optimizer state is not torch's state_dict", o.rank)
	}
	group = -1
	for g, pg := range groups {
		ids, _ := field(pg, "params")
		idl, ok := ints(ids)
		if !ok {
			return m, 0, 0, a, errorf(ErrInconsistent, r.dir, "rank %d's optimizer group %d lists %s", o.rank, g, describe(ids))
		}
		for _, id := range idl {
			if id == k {
				if group >= 0 {
					return m, 0, 0, a, errorf(ErrInconsistent, r.dir, "rank %d's optimizer groups %d and %d both list flat tensor %d", o.rank, group, g, k)
				}
				group = g
			}
		}
	}
	if group < 0 {
		return m, 0, 0, a, errorf(ErrInconsistent, r.dir, "rank %d's optimizer groups do not list flat tensor %d", o.rank, k)
	}
	ps, ok := states[k]
	if !ok {
		return m, 0, 0, a, errorf(ErrUnsupported, r.dir, "rank %d's optimizer has no state for flat tensor %d: the checkpoint was saved before the first step", o.rank, k)
	}
	for i, key := range []string{"exp_avg", "exp_avg_sq"} {
		v, ok := field(ps, key)
		if !ok {
			return m, 0, 0, a, errorf(ErrUnsupported, r.dir, "rank %d's optimizer state of flat tensor %d has no %s: not Adam's", o.rank, k, key)
		}
		tv, ok := v.(*tensorView)
		if !ok || tv.st.dtype != Float32 || len(tv.shape) != 1 || tv.numel != want {
			return m, 0, 0, a, errorf(ErrInconsistent, r.dir, "rank %d's %s of flat tensor %d is %s, not %d fp32 elements (its partition)", o.rank, key, k, describe(v), want)
		}
		t, err := r.tensor(o.file, tv, key, nil)
		if err != nil {
			return m, 0, 0, a, err
		}
		m[i], _ = t.Float32s()
	}
	sv, _ := field(ps, "step")
	if step, err = r.step(o.file, sv); err != nil {
		return m, 0, 0, a, errorf(ErrInconsistent, r.dir, "rank %d's step of flat tensor %d: %v", o.rank, k, err)
	}
	if a, err = adamGroup(groups[group]); err != nil {
		return m, 0, 0, a, errorf(ErrUnsupported, r.dir, "rank %d's optimizer group %d: %v", o.rank, group, err)
	}
	return m, step, group, a, nil
}

// groupState keeps one optimizer group's settings and step, which every
// rank and every flat tensor of the group must agree on.
func (r *reader) groupState(s *State, g int, a zero.AdamW, step int, rank int) error {
	for len(s.Groups) <= g {
		s.Groups = append(s.Groups, Group{Step: -1})
	}
	grp := &s.Groups[g]
	if grp.Step < 0 {
		grp.AdamW, grp.Step = a, step
		return nil
	}
	if grp.Step != step {
		return errorf(ErrInconsistent, r.dir, "group %d's step is %d on rank %d and %d elsewhere", g, step, rank, grp.Step)
	}
	if grp.AdamW != a {
		return errorf(ErrInconsistent, r.dir, "rank %d disagrees with rank 0 on group %d's hyperparameters", rank, g)
	}
	return nil
}

// moments reads group g's Adam state from every rank (ZeRO-1/2: rank r's
// flat tensor g is its padded partition of group g) and joins the ranks'
// partitions.
func (r *reader) moments(s *State, g int, ranks []*optimFile, l layout) ([2][]float32, int, error) {
	var m [2][]float32
	for _, o := range ranks {
		x, step, group, a, err := r.flatState(o, g, l.part)
		if err != nil {
			return m, 0, err
		}
		if group != g {
			return m, 0, errorf(ErrInconsistent, r.dir, "rank %d's optimizer group %d lists flat tensor %d, not %d", o.rank, group, g, g)
		}
		if err := r.groupState(s, g, a, step, o.rank); err != nil {
			return m, 0, err
		}
		m[0] = append(m[0], x[0]...)
		m[1] = append(m[1], x[1]...)
	}
	return m, s.Groups[g].Step, nil
}

// step reads torch's step: a scalar tensor (float32 since torch 1.12) or
// a number, a whole count ≥ 0.
func (r *reader) step(f *torchFile, v any) (int, error) {
	var x float64
	switch s := v.(type) {
	case int:
		x = float64(s)
	case float64:
		x = s
	case *tensorView:
		if s.numel != 1 || len(s.shape) != 0 {
			return 0, fmt.Errorf("a tensor of shape %v", s.shape)
		}
		t, err := r.tensor(f, s, "step", nil)
		if err != nil {
			return 0, err
		}
		xs, err := t.Float32s()
		if err != nil {
			return 0, err
		}
		x = float64(xs[0])
	default:
		return 0, fmt.Errorf("%s", describe(v))
	}
	if x < 0 || x != math.Trunc(x) || x > 1<<40 {
		return 0, fmt.Errorf("%v steps", x)
	}
	return int(x), nil
}

// adamGroup reads a torch Adam/AdamW param group's hyperparameters.
func adamGroup(pg any) (zero.AdamW, error) {
	get := func(k string) (float64, error) {
		v, _ := field(pg, k)
		x, ok := number(v)
		if !ok || math.IsInf(x, 0) || math.IsNaN(x) {
			return 0, fmt.Errorf("%s is %s", k, describe(v))
		}
		return x, nil
	}
	a := zero.NewAdamW(0)
	var err error
	if a.LR, err = get("lr"); err != nil {
		return a, err
	}
	if a.Eps, err = get("eps"); err != nil {
		return a, err
	}
	if a.WeightDecay, err = get("weight_decay"); err != nil {
		return a, err
	}
	bv, _ := field(pg, "betas")
	betas, ok := list(bv)
	if !ok || len(betas) != 2 {
		return a, fmt.Errorf("betas is %s", describe(bv))
	}
	b1, ok1 := number(betas[0])
	b2, ok2 := number(betas[1])
	if !ok1 || !ok2 || !(b1 >= 0 && b1 < 1) || !(b2 >= 0 && b2 < 1) {
		return a, fmt.Errorf("betas is %s", describe(bv))
	}
	a.Beta1, a.Beta2 = b1, b2
	for _, k := range []string{"amsgrad", "maximize"} {
		if v, _ := field(pg, k); v == true {
			return a, fmt.Errorf("%s is on, which zero's AdamW does not read from a DeepSpeed checkpoint", k)
		}
	}
	return a, nil
}

// optimizerKind refuses an optimizer zero does not have: zero's AdamW is
// torch's AdamW (decoupled decay), which Adam is too where no group
// decays.
func (r *reader) optimizerKind(o *optimFile) error {
	typ, ok := configString(o.config, "optimizer", "type")
	if !ok {
		return errorf(ErrUnsupported, r.dir, "the config names no optimizer (a client optimizer): zero cannot tell which optimizer made the state; name it in the config's optimizer section")
	}
	switch strings.ToLower(typ) {
	case "adamw":
		return nil
	case "adam":
		wMode := true
		if v, ok := configValue(o.config, "optimizer", "params", "adam_w_mode"); ok {
			wMode = v == true
		}
		if wMode {
			return nil
		}
		pgs, _ := field(o.state, "param_groups")
		groups, _ := list(pgs)
		for g, pg := range groups {
			if wd, _ := field(pg, "weight_decay"); wd != 0 && wd != 0.0 {
				return errorf(ErrUnsupported, r.dir, "optimizer Adam with adam_w_mode false adds weight decay %v (group %d) to the gradient (L2); zero's AdamW decays the weights", wd, g)
			}
		}
		return nil
	}
	return errorf(ErrUnsupported, r.dir, "optimizer %s: zero continues Adam/AdamW runs only", typ)
}

// scaler reads the loss scaler (the same on every rank).
func (r *reader) scaler(s *State, ranks []*optimFile) error {
	var first LossScaler
	for _, o := range ranks {
		ls, err := lossScaler(o.scaler)
		if err != nil {
			return errorf(ErrInconsistent, r.dir, "rank %d's loss_scaler: %v", o.rank, err)
		}
		if o.rank == 0 {
			first = ls
		} else if ls != first {
			return errorf(ErrInconsistent, r.dir, "ranks 0 and %d disagree on the loss scaler", o.rank)
		}
	}
	s.Scaler = first
	return nil
}

func lossScaler(o *pyObject) (LossScaler, error) {
	var ls LossScaler
	num := func(k string) (float64, error) {
		v, _ := field(o, k)
		x, ok := number(v)
		if !ok {
			return 0, fmt.Errorf("%s is %s", k, describe(v))
		}
		return x, nil
	}
	integer := func(k string) (int, error) {
		v, _ := field(o, k)
		n, ok := v.(int)
		if !ok {
			return 0, fmt.Errorf("%s is %s", k, describe(v))
		}
		return n, nil
	}
	var err error
	if ls.Scale, err = num("cur_scale"); err != nil {
		return ls, err
	}
	if o.class == "deepspeed.runtime.fp16.loss_scaler.LossScaler" {
		// a static scale keeps no counters (cur_iter None)
		if v, _ := field(o, "cur_iter"); v != nil {
			if ls.Iter, err = integer("cur_iter"); err != nil {
				return ls, err
			}
		}
		return ls, nil
	}
	if ls.Iter, err = integer("cur_iter"); err != nil {
		return ls, err
	}
	ls.Dynamic = true
	for _, c := range []struct {
		k   string
		dst *int
	}{{"last_overflow_iter", &ls.LastOverflow}, {"cur_hysteresis", &ls.CurHysteresis}, {"scale_window", &ls.Window}, {"delayed_shift", &ls.Hysteresis}} {
		if *c.dst, err = integer(c.k); err != nil {
			return ls, err
		}
	}
	if ls.Factor, err = num("scale_factor"); err != nil {
		return ls, err
	}
	if ls.MinScale, err = num("min_scale"); err != nil {
		return ls, err
	}
	v, _ := field(o, "consecutive_hysteresis")
	ls.Consecutive = v == true
	return ls, nil
}

// tensor materializes a tensor the files hold, checking its shape when
// one is expected; the copy counts against its file's budget.
func (r *reader) tensor(f *torchFile, v any, what string, shape []int) (Tensor, error) {
	tv, ok := v.(*tensorView)
	if !ok {
		return Tensor{}, errorf(ErrInconsistent, f.name, "%s is %s, not a tensor", what, describe(v))
	}
	if shape != nil && !sameShape(tv.shape, shape) {
		return Tensor{}, errorf(ErrInconsistent, f.name, "%s has shape %v, param_shapes says %v", what, tv.shape, shape)
	}
	n := int64(tv.numel) * int64(tv.st.dtype.Size())
	if n > f.budget {
		return Tensor{}, errorf(ErrFormat, f.name, "its tensors add up to more than the file holds (views of one storage taken many times)")
	}
	f.budget -= n
	return tv.materialize(), nil
}

func sameShape(a, b []int) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return true
}

// configValue is config[k0][k1]..., ok when present.
func configValue(config any, keys ...string) (any, bool) {
	v := config
	for _, k := range keys {
		var ok bool
		if v, ok = field(v, k); !ok {
			return nil, false
		}
	}
	return v, true
}

func configString(config any, keys ...string) (string, bool) {
	v, ok := configValue(config, keys...)
	s, isStr := v.(string)
	return s, ok && isStr
}

func configBool(config any, keys ...string) bool {
	v, _ := configValue(config, keys...)
	return v == true
}

// modelDType is the dtype the config trains in.
func modelDType(config any) DType {
	switch {
	case configBool(config, "bf16", "enabled"), configBool(config, "bfloat16", "enabled"):
		return BFloat16
	case configBool(config, "fp16", "enabled"):
		return Float16
	}
	return Float32
}

// sortedKeys is for messages that list names deterministically.
func sortedKeys[V any](m map[string]V) []string {
	out := make([]string, 0, len(m))
	for k := range m {
		out = append(out, k)
	}
	sort.Strings(out)
	return out
}
