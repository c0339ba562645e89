package zero

import (
	"errors"
	"fmt"
	"math"
	"os"
	"reflect"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"
)

// TestSettingsClasses: every exported leaf of Config, LossScale, AdamW and
// SGD carries a class (a tag "match", "reshard" or "local:<reason>"), so a
// new setting cannot be left out of the cross-rank key by accident.
func TestSettingsClasses(t *testing.T) {
	var walk func(rt reflect.Type, at string)
	walk = func(rt reflect.Type, at string) {
		for i := range rt.NumField() {
			f := rt.Field(i)
			if !f.IsExported() {
				continue
			}
			path := at + f.Name
			if _, tagged := f.Tag.Lookup("zero"); !tagged && f.Type.Kind() == reflect.Struct {
				walk(f.Type, path+".")
				continue
			}
			if _, ok := classOf(f); !ok {
				t.Errorf("%s has no class: tag it zero:\"match\", zero:\"reshard\" or zero:\"local:<why it changes neither the collectives nor the bits>\"", path)
			}
		}
	}
	for _, v := range []any{Config{}, AdamW{}, SGD{}} {
		walk(reflect.TypeOf(v), reflect.TypeOf(v).Name()+".")
	}
	// the record holds every leaf of a config with both optimizer kinds
	rec := settingsRecord(Config{Optimizer: OptimizerPolicy{Groups: []Optimizer{NewAdamW(1)}}}, nil, 1)
	rec = append(rec, groupsRecord([]Optimizer{NewSGD(1)})...)
	for _, want := range []string{"Stage", "Precision.LossScale.Hysteresis", "Optimizer.Groups[0].AMSGrad", "Optimizer.Groups[0].Nesterov", "Offload.Optimizer", "Params.LiveParamBytes"} {
		if !slices.ContainsFunc(rec, func(s Setting) bool { return s.Path == want }) {
			t.Errorf("the record has no %s", want)
		}
	}
}

// settingsBase is a config that sets something in every group, over params
// with memory, with AdamW or SGD groups.
func settingsBase(sgd bool) (Config, []Param) {
	groups := []Optimizer{with(NewAdamW(0.01), func(o *AdamW) { o.WeightDecay = 0.01 }), NewAdamW(0.02)}
	if sgd {
		groups = []Optimizer{with(NewSGD(0.1), func(o *SGD) { o.Momentum, o.Nesterov = 0.9, true }),
			with(NewSGD(0.1), func(o *SGD) { o.Momentum, o.Dampening, o.WeightDecay = 0.5, 0.5, 0.1 })}
	}
	cfg := Config{Stage: 2, BucketBytes: 4096,
		Precision: PrecisionPolicy{CommDType: FP16},
		Grads:     GradPolicy{PredivideFactor: 1, AccumSteps: 2},
		Optimizer: OptimizerPolicy{Groups: groups, Clip: 1},
	}
	params := []Param{{Name: "w", Count: 1024, DType: FP16, Shape: []int{32, 32}}, {Name: "b", Count: 32, DType: FP16, Group: 1}}
	for p := range params {
		params[p].Data = Halfs(make([]uint16, params[p].Count), FP16)
	}
	return cfg, params
}

// settingPath walks v (addressable) along path ("Optimizer.Groups[1].LR"),
// calling set on the leaf; an interface element is changed through a copy.
func settingPath(v reflect.Value, path string, set func(reflect.Value)) {
	name, rest, _ := strings.Cut(path, ".")
	index := -1
	if i := strings.IndexByte(name, '['); i >= 0 {
		index, _ = strconv.Atoi(name[i+1 : len(name)-1])
		name = name[:i]
	}
	f := v.FieldByName(name)
	if index >= 0 {
		f = f.Index(index)
		if f.Kind() == reflect.Interface {
			c := reflect.New(f.Elem().Type()).Elem()
			c.Set(f.Elem())
			if rest == "" {
				set(c)
			} else {
				settingPath(c, rest, set)
			}
			f.Set(c)
			return
		}
	}
	if rest == "" {
		set(f)
		return
	}
	settingPath(f, rest, set)
}

// alternatives are values to try for a leaf, in order, until one gives a
// config that resolves and differs.
func alternatives(v reflect.Value) []any {
	switch x := v.Interface().(type) {
	case int:
		return []any{x + 1, x + 2}
	case float64:
		if x == 0 {
			return []any{0.5, 2.0, 1024.0}
		}
		return []any{x * 2, x / 2, x + 0.5}
	case bool:
		return []any{!x}
	case DType:
		return []any{FP32, BF16, FP16}
	case Reduction:
		return []any{Sum, Mean}
	}
	return nil
}

// TestSettingsMismatch: every shared setting, found in the record by
// reflection (every leaf of every group, each optimizer group, the loss
// scaling, the parameters), set differently on one rank, gives both ranks
// ErrPlanMismatch from New naming its path and both values, at once; the
// rank-local ones may differ.
func TestSettingsMismatch(t *testing.T) {
	covered := map[string]bool{}
	for _, sgd := range []bool{false, true} {
		base, params := settingsBase(sgd)
		resolved := base
		if _, err := resolved.resolve(params); err != nil {
			t.Fatal(err)
		}
		baseRec := settingsRecord(resolved, params, 2)
		for _, s := range baseRec {
			if s.Class == ClassLocal || s.Path == "World" {
				continue
			}
			field := regexp.MustCompile(`\[\d+\]`).ReplaceAllString(s.Path, "[]")
			cfg, ps := base, slices.Clone(params)
			cfg.Optimizer.Groups = slices.Clone(base.Optimizer.Groups)
			changed := false
			if strings.HasPrefix(s.Path, "Model[") {
				p, _ := strconv.Atoi(s.Path[len("Model["):strings.IndexByte(s.Path, ']')])
				switch s.Path[strings.IndexByte(s.Path, '.')+1:] {
				case "Name":
					ps[p].Name, changed = ps[p].Name+"x", true
				case "Count":
					ps[p].Count, ps[p].Shape, ps[p].Data, changed = ps[p].Count+1, nil, Halfs(make([]uint16, ps[p].Count+1), FP16), true
				case "Shape":
					ps[p].Shape, changed = []int{ps[p].Count, 1}, true
				case "Group":
					ps[p].Group, changed = 1-ps[p].Group, true
				case "Frozen":
					ps[p].Frozen, changed = !ps[p].Frozen, true
				case "DType":
					continue // one dtype per engine: "mixed dtypes" in TestConfigErrors
				}
			} else if s.Path == "Optimizer.Groups" {
				continue
			} else if s.Path == "Optimizer.Schedule" {
				cfg.Optimizer.Schedule, changed = rampLR{Every: 2}, true
			} else {
				var leaf reflect.Value
				settingPath(reflect.ValueOf(&cfg).Elem(), s.Path, func(v reflect.Value) { leaf = v })
				for _, alt := range alternatives(leaf) {
					try := cfg
					try.Optimizer.Groups = slices.Clone(cfg.Optimizer.Groups)
					settingPath(reflect.ValueOf(&try).Elem(), s.Path, func(v reflect.Value) { v.Set(reflect.ValueOf(alt).Convert(v.Type())) })
					r := try
					r.Optimizer.Groups = slices.Clone(try.Optimizer.Groups)
					if _, err := r.resolve(ps); err != nil {
						continue
					}
					if got := settingsRecord(r, ps, 2); !slices.Equal(got, baseRec) {
						cfg, changed = try, true
						break
					}
				}
			}
			if !changed {
				t.Logf("%s: no legal value differs here; the field is covered elsewhere", s.Path)
				continue
			}
			covered[field] = true
			comms, _ := NewLocalGroupTimeout(2, 5*time.Second)
			started := time.Now()
			errs := eachRank(2, func(r int) error {
				c, p := base, params
				if r == 1 {
					c, p = cfg, ps
				}
				e, err := New(c, comms[r], p)
				if err == nil {
					e.Close()
				}
				return err
			})
			for r, err := range errs {
				if !errors.Is(err, ErrPlanMismatch) || !strings.Contains(err.Error(), s.Path+": rank 0 has ") {
					t.Errorf("%s differs: rank %d: %v, want ErrPlanMismatch naming it", s.Path, r, err)
				}
			}
			if d := time.Since(started); d > 2*time.Second {
				t.Errorf("%s differs: the ranks took %v to refuse", s.Path, d)
			}
		}
		// the groups themselves: one more on rank 1
		cfg := base
		cfg.Optimizer.Groups = append(slices.Clone(base.Optimizer.Groups), base.Optimizer.Groups[0])
		comms, _ := NewLocalGroupTimeout(2, 5*time.Second)
		errs := eachRank(2, func(r int) error {
			c := base
			if r == 1 {
				c = cfg
			}
			_, err := New(c, comms[r], params)
			return err
		})
		everyRankIs(t, "a third group on rank 1", errs, ErrPlanMismatch)
		covered["Optimizer.Groups"] = true
		// the kind of the groups: all SGD on rank 1
		other, _ := settingsBase(!sgd)
		comms, _ = NewLocalGroupTimeout(2, 5*time.Second)
		errs = eachRank(2, func(r int) error {
			c := base
			if r == 1 {
				c = other
			}
			_, err := New(c, comms[r], params)
			if err == nil || !strings.Contains(err.Error(), "Optimizer.Groups[0]: rank 0 has ") {
				return fmt.Errorf("groups of another kind on rank 1: %v, want ErrPlanMismatch naming Optimizer.Groups[0]", err)
			}
			return nil
		})
		everyRankIs(t, "groups of another kind", errs, nil)
		covered["Optimizer.Groups[]"] = true

		// Rank-local settings may differ.
		comms, _ = NewLocalGroupTimeout(2, 5*time.Second)
		errs = eachRank(2, func(r int) error {
			c := base
			if r == 1 {
				c.Overlap, c.StagingBuffers, c.Offload.Optimizer = true, 5, true
			}
			e, err := New(c, comms[r], params)
			if err == nil {
				err = e.Close()
			}
			return err
		})
		everyRankIs(t, "Overlap, StagingBuffers and Offload differ", errs, nil)
	}
	// every shared field of the record was perturbed at least once
	base, params := settingsBase(false)
	rec := settingsRecord(base, params, 1)
	rec = append(rec, groupsRecord([]Optimizer{NewSGD(1)})...)
	for _, s := range rec {
		field := regexp.MustCompile(`\[\d+\]`).ReplaceAllString(s.Path, "[]")
		if s.Class != ClassLocal && s.Path != "World" && field != "Model[].DType" && !covered[field] {
			t.Errorf("%s was never perturbed", field)
		}
	}
}

// TestUnsetIsNotZero: an optimizer literal, whose unset fields cannot be
// told from zeros, is refused with the constructor to use; every field set
// to 0 through the constructor's value is kept as 0 (or, where 0 is not
// legal, refused naming the field), never replaced by a default; LR 0 is
// legal in New and SetGroup, and AdamW with betas of 0 trains as PyTorch's.
func TestUnsetIsNotZero(t *testing.T) {
	_, params := settingsBase(false)
	comms, _ := NewLocalGroup(1)
	for name, o := range map[string]Optimizer{"AdamW literal": AdamW{LR: 0.01}, "SGD literal": SGD{LR: 0.1}} {
		cfg := Config{Stage: 2, BucketBytes: 4096, Optimizer: OptimizerPolicy{Groups: []Optimizer{o, o}}}
		if _, err := New(cfg, comms[0], params); !errors.Is(err, ErrConfig) || !strings.Contains(err.Error(), "zero.New") {
			t.Errorf("%s: %v, want ErrConfig naming the constructor", name, err)
		}
	}
	for _, made := range []Optimizer{NewAdamW(0.01), NewSGD(0.1)} {
		rv := reflect.ValueOf(made)
		for i := range rv.NumField() {
			f := rv.Type().Field(i)
			if !f.IsExported() || f.Type.Kind() != reflect.Float64 {
				continue
			}
			c := reflect.New(rv.Type()).Elem()
			c.Set(rv)
			c.Field(i).SetFloat(0)
			o := c.Interface().(Optimizer)
			cfg := Config{Stage: 2, BucketBytes: 4096, Optimizer: OptimizerPolicy{Groups: []Optimizer{o, o}}}
			e, err := New(cfg, comms[0], params)
			if err != nil {
				if !errors.Is(err, ErrConfig) || !strings.Contains(err.Error(), f.Name) {
					t.Errorf("%T.%s = 0: %v, want it kept or refused naming the field", made, f.Name, err)
				}
				continue
			}
			for _, s := range e.Settings() {
				if s.Path == "Optimizer.Groups[0]."+f.Name && s.Value != "0" {
					t.Errorf("%T.%s set to 0 reads back as %s", made, f.Name, s.Value)
				}
			}
			e.Close()
		}
	}

	// AdamW with betas of 0 and SetGroup to LR 0, against float64
	zeroBetas := with(NewAdamW(0.01), func(o *AdamW) { o.Beta1, o.Beta2 = 0, 0 })
	sizes := []int{300, 7, 1000}
	grad := func(st, k, rank, p, j int) float64 { return float64(1+(j+st)%5) / 64 * float64(rank+1) }
	init := func(p, j int) float32 { return float32(j%9) / 8 }
	tr := runOpt(t, optCase{
		cfg:   Config{Stage: 2, BucketBytes: 1024, Optimizer: OptimizerPolicy{Groups: []Optimizer{zeroBetas}}},
		sizes: sizes, dt: FP32, backwards: 1, steps: 3, grad: grad, init: init,
		before: func(e *Engine, st int) error {
			if st == 2 {
				return e.SetGroup(0, with(zeroBetas, func(o *AdamW) { o.LR = 0 }))
			}
			return nil
		},
	})
	for p, n := range sizes {
		for j := range n {
			theta, m, v := float64(init(p, j)), 0.0, 0.0
			for st := range 3 {
				ref := refAdamW{lr: 0.01, b1: 0, b2: 0, eps: 1e-8}
				if st == 2 {
					ref.lr = 0
				}
				ref.step(&theta, &m, &v, float64(1+(j+st)%5)/64*1.5, st+1)
				closeTo(t, fmt.Sprintf("betas 0, step %d: master %d[%d]", st, p, j), tr.master[st][p][j], theta, 1e-6, 1e-7)
			}
		}
	}
}

// TestSetGroupAcrossRanks: a SetGroup made on one rank only is refused at
// the next Step on every rank, naming the setting and both values, with
// nothing changed and the window kept; once the other rank makes the same
// change, Step takes the window with the new settings.
func TestSetGroupAcrossRanks(t *testing.T) {
	comms, _ := NewLocalGroupTimeout(2, 5*time.Second)
	var refused [2]error
	errs := eachRank(2, func(rank int) error {
		ps, mine := smallModel(FP32, 0.5)
		e, err := New(Config{Stage: 2, BucketBytes: 512, Optimizer: OptimizerPolicy{Groups: []Optimizer{NewSGD(0.25)}}}, comms[rank], ps)
		if err != nil {
			return err
		}
		defer e.Close()
		s := NewHostStream()
		defer s.Close()
		if err := backward(e, s, constGrads(ps[:3], 1)); err != nil {
			return err
		}
		if rank == 0 {
			if err := e.SetGroup(0, NewSGD(0.5)); err != nil {
				return err
			}
		}
		before := snapshotState(e, mine)
		refused[rank] = e.Step()
		if after := snapshotState(e, mine); !after.equal(before) {
			return fmt.Errorf("the refused Step changed the state")
		}
		if rank == 1 {
			if err := e.SetGroup(0, NewSGD(0.5)); err != nil {
				return err
			}
		}
		if err := e.Step(); err != nil {
			return err
		}
		if st := e.Stats(); st.Backwards != 1 {
			return fmt.Errorf("the step took %d backwards, want the kept window's 1", st.Backwards)
		}
		for j := range ps[0].Count { // 0.5 + j%7/8 − 0.5·1
			if want := 0.5 + float32(j%7)/8 - 0.5; mine[0].val(j) != want {
				return fmt.Errorf("param 0[%d] = %v, want %v (LR 0.5 on the mean gradient 1)", j, mine[0].val(j), want)
			}
		}
		return nil
	})
	everyRankIs(t, "SetGroup on both ranks", errs, nil)
	for r, err := range refused {
		if !errors.Is(err, ErrPlanMismatch) || !strings.Contains(err.Error(), "Optimizer.Groups[0].LR: rank 0 has 0.5, rank 1 has 0.25") {
			t.Errorf("rank %d: Step after SetGroup on rank 0 only: %v, want ErrPlanMismatch naming the rate", r, err)
		}
	}
}

// TestConfigChecksComeFirst: every refused setting is refused before New
// runs a collective or allocates a byte, with a message that names the
// setting: the loss scaling, the bounds of StagingBuffers and Align, shapes
// and duplicate names, a tensor that claims more than its memory.
func TestConfigChecksComeFirst(t *testing.T) {
	base, params := settingsBase(false)
	for name, tc := range map[string]struct {
		edit func(c *Config, p []Param)
		want string
	}{
		"LossScale":      {func(c *Config, p []Param) { c.Precision.LossScale.Static = -1 }, "Precision.LossScale.Static"},
		"StagingBuffers": {func(c *Config, p []Param) { c.StagingBuffers = 1 << 30 }, "StagingBuffers"},
		"Align":          {func(c *Config, p []Param) { c.Align = 1 << 40 }, "Align"},
		"Clip":           {func(c *Config, p []Param) { c.Optimizer.Clip = math.Inf(1) }, "Optimizer.Clip"},
		"LR":             {func(c *Config, p []Param) { c.Optimizer.Groups = []Optimizer{NewAdamW(-1), NewAdamW(1)} }, "Optimizer.Groups[0].LR"},
		"Shape":          {func(c *Config, p []Param) { p[0].Shape = []int{3, 3} }, "shape [3 3]"},
		"Name":           {func(c *Config, p []Param) { p[1].Name = p[0].Name }, "named"},
		"Halfs(x, FP32)": {func(c *Config, p []Param) {
			c.Precision.CommDType, p[1].DType, p[0].DType = FP32, FP32, FP32
			p[1].Data = Halfs(make([]uint16, 32), FP32)
			p[0].Data = Float32s(make([]float32, 1024))
		}, "Halfs"},
		"Window.DType":     {func(c *Config, p []Param) { c.Window.DType = BF16 }, "Window.DType"},
		"Grads.AccumSteps": {func(c *Config, p []Param) { c.Grads.AccumSteps = -1 }, "Grads.AccumSteps"},
	} {
		cfg, ps := base, slices.Clone(params)
		tc.edit(&cfg, ps)
		comms, _ := NewLocalGroup(1)
		dev := newCountingDevice()
		c := &countingComm{Comm: onDevice{comms[0], dev}}
		_, err := New(cfg, c, ps)
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: %v, want an error naming %s", name, err, tc.want)
		}
		if c.calls != 0 || dev.liveBytes() != 0 || dev.allocs.Load() != 0 {
			t.Errorf("%s: refused after %d collectives and %d allocations", name, c.calls, dev.allocs.Load())
		}
	}
}

// rampLR multiplies a group's rate by t+1, every Every steps up to 4×: a
// schedule for the tests.
type rampLR struct {
	Every int `zero:"match"`
}

func (r rampLR) At(t int, base Optimizer) Optimizer {
	f := float64(min(t/max(r.Every, 1)+1, 4))
	switch o := base.(type) {
	case SGD:
		o.LR *= f
		return o
	case AdamW:
		o.LR *= f
		return o
	}
	return base
}

// TestScheduleDrivesTheGroups: a schedule's rate is the one each step runs
// with, counted in steps taken (a skipped step does not advance it), on
// top of SetGroup's base; a schedule that gives settings of another kind is
// refused at New.
func TestScheduleDrivesTheGroups(t *testing.T) {
	sizes := []int{300, 7}
	init := func(p, j int) float32 { return 0 }
	grad := func(st, k, rank, p, j int) float64 {
		if st == 2 && rank == 1 && p == 0 && j == 3 {
			return math.Inf(1) // step 2 skips
		}
		return 0.25
	}
	tr := runOpt(t, optCase{
		cfg:   Config{Stage: 2, BucketBytes: 1024, Optimizer: OptimizerPolicy{Groups: []Optimizer{NewSGD(0.5)}, Schedule: rampLR{Every: 1}}},
		sizes: sizes, dt: FP32, backwards: 1, steps: 5, grad: grad, init: init,
		before: func(e *Engine, st int) error {
			if st == 4 {
				return e.SetGroup(0, NewSGD(1))
			}
			return nil
		},
	})
	// rates: step 0 ×1, step 1 ×2, step 2 skipped, step 3 ×3, step 4 (base 1) ×4
	want, p := 0.0, 0.0
	for st, lr := range []float64{0.5, 1, 0, 1.5, 4} {
		p -= lr * 0.25
		if st == 2 {
			if !tr.stats[0][st].Skipped {
				t.Fatalf("step 2 did not skip")
			}
		}
		want = p
		closeTo(t, fmt.Sprintf("step %d", st), tr.master[st][0][0], want, 1e-6, 1e-7)
	}
	comms, _ := NewLocalGroup(1)
	bad := Config{Stage: 2, BucketBytes: 1024, Optimizer: OptimizerPolicy{Groups: []Optimizer{NewAdamW(0.1)}, Schedule: badSchedule{}}}
	ps := []Param{{Name: "a", Count: 4, DType: FP32, Data: Float32s(make([]float32, 4))}}
	if _, err := New(bad, comms[0], ps); !errors.Is(err, ErrConfig) || !strings.Contains(err.Error(), "Optimizer.Schedule") {
		t.Fatalf("a schedule that gives SGD for an AdamW group: %v, want ErrConfig naming it", err)
	}
}

// badSchedule gives SGD whatever the group.
type badSchedule struct{}

func (badSchedule) At(int, Optimizer) Optimizer { return NewSGD(1) }

// TestAlignBounds: Align as its doc states it (config.go: "default 64, at
// most 65536"): the documented maximum is taken, and a step at it gives
// the mean; one more, or a negative Align, is ErrConfig naming Align and
// its range; 0 is the documented default.
func TestAlignBounds(t *testing.T) {
	src, err := os.ReadFile("config.go")
	if err != nil {
		t.Fatal(err)
	}
	m := regexp.MustCompile(`Align is the shard granularity in elements \(default (\d+), at most (\d+)\)`).FindSubmatch(src)
	if m == nil {
		t.Fatal("config.go no longer documents Align's default and maximum as this test reads them")
	}
	def, _ := strconv.Atoi(string(m[1]))
	most, _ := strconv.Atoi(string(m[2]))
	if def != 64 || most != 65536 {
		t.Fatalf("Align documented as default %d, at most %d; the README and this test say 64 and 65536", def, most)
	}
	params := []Param{{Name: "w", Count: 5, DType: FP32}}
	for _, c := range []struct {
		align, padded int // padded: the bucket's elements at W = 2, 0 for a refusal
	}{{most, 2 * most}, {0, 2 * def}, {1, 6}, {most + 1, 0}, {-1, 0}} {
		errs := onEngines(2, 10*time.Second, Config{Stage: 2, BucketBytes: 1 << 20, Align: c.align}, params, func(e *Engine, s *HostStream) error {
			if got := e.Plan().Buckets[0].Padded; got != c.padded {
				return fmt.Errorf("the bucket holds %d elements, want %d", got, c.padded)
			}
			if err := backward(e, s, constGrads(params, 1)); err != nil {
				return err
			}
			if err := e.Step(); err != nil {
				return err
			}
			full, err := e.FullGrads()
			if err != nil {
				return err
			}
			return wantAll(full, 1)
		})
		for r, err := range errs {
			switch {
			case c.padded > 0 && err != nil:
				t.Errorf("Align %d: rank %d: %v", c.align, r, err)
			case c.padded == 0 && (!errors.Is(err, ErrConfig) || !strings.Contains(fmt.Sprint(err), fmt.Sprintf("Align %d; set a shard granularity of 1 to %d elements", c.align, most))):
				t.Errorf("Align %d: rank %d: %v, want ErrConfig naming Align and 1 to %d", c.align, r, err, most)
			}
		}
	}
}
