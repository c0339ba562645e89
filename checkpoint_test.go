package zero

import (
	"bytes"
	"cmp"
	"crypto/sha256"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"maps"
	"math"
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// ckptCase is one configuration of the resume test.
type ckptCase struct {
	stage   int
	offload bool
	dtype   DType
	window  bool // every step a coalesced window of 2 backwards
	sgd     bool // SGD with momentum instead of AdamW (with amsgrad)
}

func (c ckptCase) String() string {
	opt := "adamw"
	if c.sgd {
		opt = "sgd"
	}
	return fmt.Sprintf("z%d/%v/offload=%v/window=%v/%s", c.stage, c.dtype, c.offload, c.window, opt)
}

var ckptSizes = []int{300, 7, 1000, 129, 64}

func (c ckptCase) config() Config {
	var opt Optimizer = func() AdamW { a := NewAdamW(1e-2); a.AMSGrad = true; a.WeightDecay = 0.01; return a }()
	if c.sgd {
		s := NewSGD(1e-2)
		s.Momentum = 0.9
		opt = s
	}
	cfg := Config{Stage: c.stage, BucketBytes: 1024, Overlap: true, Optimizer: OptimizerPolicy{Groups: []Optimizer{opt}, Clip: 5},
		Offload: OffloadPolicy{Optimizer: c.offload}}
	if c.dtype == FP16 {
		cfg.Precision.LossScale = LossScale{Initial: 256, Window: 2, Hysteresis: 2, Min: 1}
	}
	return cfg
}

// ckptGrad is the gradient of parameter p, element i, at step st,
// backward k on rank: hashed values in [−1, 1), times the loss scale; at
// the overflow step rank 1 puts an inf in parameter 2.
func ckptGrad(c ckptCase, st, k, rank, p, n int, scale float64) Tensor {
	x := make([]float32, n)
	for i := range x {
		h := mix64(uint64(st)<<48 | uint64(k)<<40 | uint64(rank)<<32 | uint64(p)<<24 | uint64(i))
		x[i] = float32(float64(int32(h>>32))*0x1p-31) * float32(scale)
	}
	if st == ckptOverflowStep && rank == 1 && p == 2 {
		x[3] = float32(math.Inf(1))
	}
	return toDType(x, c.dtype)
}

const ckptOverflowStep = 1

func mix64(h uint64) uint64 {
	h += 0x9e3779b97f4a7c15
	h = (h ^ h>>30) * 0xbf58476d1ce4e5b9
	h = (h ^ h>>27) * 0x94d049bb133111eb
	return h ^ h>>31
}

func (a ckptState) diff(b ckptState) string {
	for name, x := range a.state {
		if y, ok := b.state[name]; !ok || !slices.Equal(x, y) {
			if ok || slices.ContainsFunc(x, func(v byte) bool { return v != 0 }) {
				return "state " + name
			}
		}
	}
	for p := range a.params {
		for i := range a.params[p] {
			if math.Float32bits(a.params[p][i]) != math.Float32bits(b.params[p][i]) {
				return fmt.Sprintf("parameter %d element %d: %v and %v", p, i, a.params[p][i], b.params[p][i])
			}
		}
	}
	switch {
	case !slices.Equal(a.steps, b.steps):
		return fmt.Sprintf("steps %v and %v", a.steps, b.steps)
	case a.scaler != b.scaler:
		return fmt.Sprintf("loss scaler %+v and %+v", a.scaler, b.scaler)
	case a.step != b.step:
		return fmt.Sprintf("step %d and %d", a.step, b.step)
	}
	return ""
}

// ckptRun is one run of the checkpoint tests: engines for c on world
// ranks (0: 2), a load from load (if set) with loadOpt, then edit (if
// set), steps [from, to), a save into save (if set). A run that does not
// load halves the rate before step 2. initial, if set, gives each
// parameter's values. savedWorld, if set, is the world size of the
// checkpoint loaded: ranks beyond it get no client bytes.
type ckptRun struct {
	c          ckptCase
	world      int
	savedWorld int
	from, to   int
	load, save string
	loadOpt    LoadOptions
	config     func(*Config)
	edit       func(*Engine) error
	initial    [][]float32
}

func ckptTrain(t *testing.T, c ckptCase, from, to int, load, save string) []ckptState {
	t.Helper()
	return ckptRun{c: c, from: from, to: to, load: load, save: save}.run(t)
}

func (cr ckptRun) run(t *testing.T) []ckptState {
	t.Helper()
	c, from, to, load, save := cr.c, cr.from, cr.to, cr.load, cr.save
	world := cmp.Or(cr.world, 2)
	comms, err := NewLocalGroup(world)
	if err != nil {
		t.Fatal(err)
	}
	out := make([]ckptState, world)
	errs := eachRank(world, func(rank int) error {
		defer comms[rank].Close()
		ps := make([]Param, len(ckptSizes))
		for p, n := range ckptSizes {
			x := make([]float32, n)
			for i := range x {
				x[i] = float32(i%17)*0.03 - 0.2 + float32(p)*0.01
			}
			if cr.initial != nil {
				copy(x, cr.initial[p])
			}
			ps[p] = Param{Name: fmt.Sprint("w", p), Count: n, DType: c.dtype, Data: toDType(x, c.dtype)}
		}
		cfg := c.config()
		if cr.config != nil {
			cr.config(&cfg)
		}
		e, err := New(cfg, comms[rank], ps)
		if err != nil {
			return err
		}
		defer e.Close()
		s := NewHostStream()
		defer s.Close()
		if load != "" {
			client, err := e.Load(load, cr.loadOpt)
			if err != nil {
				return err
			}
			want := []byte(fmt.Sprintf("rank %d at step %d", rank, from))
			if cr.savedWorld > 0 && rank >= cr.savedWorld {
				want = nil // a rank the saving run did not have
			}
			if from >= 0 && (!bytes.Equal(client, want) || want == nil && client != nil) { // from < 0: any
				return fmt.Errorf("client bytes %q, want %q", client, want)
			}
		}
		if cr.edit != nil {
			if err := cr.edit(e); err != nil {
				return err
			}
		}
		for st := from; st < to; st++ {
			if st == 2 && cr.load == "" { // a SetGroup before the save, kept by it
				g := e.opt.currentGroups()[0]
				switch o := g.(type) {
				case AdamW:
					o.LR /= 2
					g = o
				case SGD:
					o.LR /= 2
					g = o
				}
				if err := e.SetGroup(0, g); err != nil {
					return err
				}
			}
			backwards := func() error {
				for k := range 2 {
					if err := forward(e, s); err != nil {
						return err
					}
					for p := len(ps) - 1; p >= 0; p-- {
						if _, err := e.GradReady(p, ckptGrad(c, st, k, rank, p, ps[p].Count, e.LossScale()), s); err != nil {
							return err
						}
					}
					if err := e.EndBackward(); err != nil {
						return err
					}
				}
				return nil
			}
			if c.window {
				err = e.Coalesce(backwards)
			} else {
				err = backwards()
			}
			if err == nil {
				err = e.Step()
			}
			if err != nil {
				return fmt.Errorf("step %d: %w", st, err)
			}
			if skipped := e.Stats().Skipped; skipped != (st == ckptOverflowStep && world > 1) { // rank 1 overflows
				return fmt.Errorf("step %d skipped %v", st, skipped)
			}
		}
		if save != "" {
			if err := e.Save(save, SaveOptions{Client: []byte(fmt.Sprintf("rank %d at step %d", rank, to))}); err != nil {
				return err
			}
		}
		out[rank], err = readCkptState(e)
		return err
	})
	for rank, err := range errs {
		if err != nil {
			t.Fatalf("%v rank %d: %v", c, rank, err)
		}
	}
	return out
}

// TestCheckpointResume: a run saved after 3 steps and resumed in new
// engines ends with the bits of the run that never stopped (parameters,
// master, moments, step counts, loss scaler), at every stage, with and
// without offload, in fp32, bf16 and fp16 (whose dynamic scale overflowed
// before the save), with and without coalesced windows, AdamW (amsgrad)
// and SGD (momentum), a SetGroup before the save; and the state right
// after the load is the saved one.
func TestCheckpointResume(t *testing.T) {
	const steps, at = 5, 3
	for _, stage := range []int{1, 2, 3} {
		for _, dt := range []DType{FP32, BF16, FP16} {
			for _, offload := range []bool{false, true} {
				for _, window := range []bool{false, true} {
					for _, sgd := range []bool{false, true} {
						c := ckptCase{stage: stage, dtype: dt, offload: offload, window: window, sgd: sgd}
						if testing.Short() && (window != sgd || offload == window) {
							continue
						}
						dir := t.TempDir()
						whole := ckptTrain(t, c, 0, steps, "", "")
						saved := ckptTrain(t, c, 0, at, "", dir)
						loaded := ckptTrain(t, c, at, at, dir, "")
						resumed := ckptTrain(t, c, at, steps, dir, "")
						for rank := range whole {
							if d := saved[rank].diff(loaded[rank]); d != "" {
								t.Fatalf("%v rank %d: the loaded state differs from the saved one: %s", c, rank, d)
							}
							if d := whole[rank].diff(resumed[rank]); d != "" {
								t.Fatalf("%v rank %d: the resumed run differs from the one that never stopped: %s", c, rank, d)
							}
						}
						if sc := saved[0].scaler; dt == FP16 && (sc.LastOverflow < 0 || sc.Scale == 256 && sc.CurHysteresis == 2) {
							t.Fatalf("%v: the scaler %+v saw no overflow or never moved: the test does not cover it", c, sc)
						}
					}
				}
			}
		}
	}
}

// TestCheckpointParamOffload: a stage-3 checkpoint saved with the
// parameter shard in page-locked host memory (Offload.Params) resumes
// without it, and one saved without it resumes with it, bit for bit the
// run that never stopped (parameters, master, moments, step counts, loss
// scaler), with the optimizer on the device and offloaded, in fp32, bf16
// and fp16; and it reshards, with the setting on either side, to another
// world size, bucket size and stage (2 and 1, which keep no shard), the
// state assembled parameter by parameter the saved one.
func TestCheckpointParamOffload(t *testing.T) {
	const steps, at = 5, 3
	onHost := func(on bool) func(*Config) { return func(cfg *Config) { cfg.Offload.Params = on } }
	for _, dt := range []DType{FP32, BF16, FP16} {
		for _, offload := range []bool{false, true} {
			for _, saveOnHost := range []bool{false, true} {
				c := ckptCase{stage: 3, dtype: dt, offload: offload, window: dt == BF16}
				name := fmt.Sprintf("%v saved with parameter offload %v", c, saveOnHost)
				dir := t.TempDir()
				whole := ckptRun{c: c, from: 0, to: steps, config: onHost(!saveOnHost)}.run(t)
				saved := ckptRun{c: c, from: 0, to: at, save: dir, config: onHost(saveOnHost)}.run(t)
				loaded := ckptRun{c: c, from: at, to: at, load: dir, config: onHost(!saveOnHost)}.run(t)
				resumed := ckptRun{c: c, from: at, to: steps, load: dir, config: onHost(!saveOnHost)}.run(t)
				for rank := range whole {
					if d := saved[rank].diff(loaded[rank]); d != "" {
						t.Fatalf("%s, loaded without: the loaded state differs from the saved one: %s", name, d)
					}
					if d := whole[rank].diff(resumed[rank]); d != "" {
						t.Fatalf("%s, resumed without: the resumed run differs from the one that never stopped: %s", name, d)
					}
				}
			}
		}
	}
	for _, r := range []struct {
		from, to             reshardEnd
		fromOnHost, toOnHost bool
	}{
		{reshardEnd{2, 3, 1024, 0, false}, reshardEnd{3, 3, 300, 16, true}, true, true},
		{reshardEnd{4, 3, 512, 8, true}, reshardEnd{2, 3, 4096, 0, false}, true, false},
		{reshardEnd{2, 3, 1024, 0, false}, reshardEnd{2, 2, 1024, 0, true}, true, false},
		{reshardEnd{2, 1, 1024, 0, false}, reshardEnd{3, 3, 300, 0, false}, false, true},
	} {
		c := ckptCase{dtype: BF16, window: r.from.stage != r.to.stage}
		name := fmt.Sprintf("%v (parameter offload %v) → %v (parameter offload %v)", r.from, r.fromOnHost, r.to, r.toOnHost)
		dir := t.TempDir()
		with := func(e reshardEnd, on bool) ckptRun {
			return ckptRun{c: ckptCase{stage: e.stage, dtype: c.dtype, offload: e.offload, window: c.window}, world: e.world,
				config: func(cfg *Config) { cfg.BucketBytes, cfg.Align, cfg.Offload.Params = e.bucket, e.align, on }}
		}
		save := with(r.from, r.fromOnHost)
		save.from, save.to, save.save = 0, at, dir
		saved := save.run(t)
		load := with(r.to, r.toOnHost)
		load.from, load.to, load.load, load.savedWorld = at, at, dir, r.from.world
		loaded := load.run(t)
		if d := sameConsolidated(saved, loaded); d != "" {
			t.Fatalf("%s: the loaded state differs from the saved one: %s", name, d)
		}
	}
}

// sameConsolidated reports the first difference between two runs' state,
// parameter by parameter (whatever their world size, stage or buckets):
// each state tensor's bits, the parameters, the step counts, the loss
// scaler and the step.
func sameConsolidated(a, b []ckptState) string {
	ca, err := consolidate(a)
	if err != nil {
		return err.Error()
	}
	cb, err := consolidate(b)
	if err != nil {
		return err.Error()
	}
	names := slices.Sorted(maps.Keys(ca))
	if !slices.Equal(names, slices.Sorted(maps.Keys(cb))) {
		return fmt.Sprintf("state tensors %v and %v", names, slices.Sorted(maps.Keys(cb)))
	}
	for _, name := range names {
		for p := range ca[name] {
			if i := firstByteDiff(ca[name][p], cb[name][p]); i >= 0 {
				size := a[0].dtypes[name].Size()
				return fmt.Sprintf("%s of parameter %d, element %d", name, p, i/size)
			}
		}
	}
	for p := range a[0].params {
		for i := range a[0].params[p] {
			if math.Float32bits(a[0].params[p][i]) != math.Float32bits(b[0].params[p][i]) {
				return fmt.Sprintf("parameter %d element %d: %v and %v", p, i, a[0].params[p][i], b[0].params[p][i])
			}
		}
	}
	switch {
	case !slices.Equal(a[0].steps, b[0].steps):
		return fmt.Sprintf("steps %v and %v", a[0].steps, b[0].steps)
	case a[0].scaler != b[0].scaler:
		return fmt.Sprintf("loss scaler %+v and %+v", a[0].scaler, b[0].scaler)
	case a[0].step != b[0].step:
		return fmt.Sprintf("step %d and %d", a[0].step, b[0].step)
	}
	return ""
}

// reshardEnd is one side of a reshard: the engines that save, or load.
type reshardEnd struct {
	world, stage, bucket, align int
	offload                     bool
}

func (e reshardEnd) String() string {
	return fmt.Sprintf("W%d/z%d/bucket%d/align%d/offload=%v", e.world, e.stage, e.bucket, e.align, e.offload)
}

// run is ckptRun r on this end's engines.
func (e reshardEnd) run(t *testing.T, r ckptRun) []ckptState {
	t.Helper()
	r.c.stage, r.c.offload, r.world = e.stage, e.offload, e.world
	r.config = func(cfg *Config) { cfg.BucketBytes, cfg.Align = e.bucket, e.align }
	return r.run(t)
}

// TestCheckpointReshard: a checkpoint saved at one world size, stage,
// bucket size, alignment and offload loads into engines of another
// (2→4, 4→2, 4→3, 1→2, 2→1 at every stage with offload on and off; every
// pair of stages; other buckets and alignments; offload switched; some
// at once) with the state, assembled parameter by parameter, bit for bit
// the saved one: parameters, master, moments, amsgrad's maximum, the
// model-dtype shard, step counts, loss scaler, step; client bytes for
// the ranks the saving run had, nil beyond. Two more steps then give the
// bits of the unresharded run at the same world size (the same
// arithmetic: windows make the stages' sums alike), and at another world
// size stay within a bound derived from the float64 reference.
func TestCheckpointReshard(t *testing.T) {
	const at, steps = 3, 5
	type pair struct{ from, to reshardEnd }
	var pairs []pair
	end := func(w, stage int, offload bool) reshardEnd { return reshardEnd{w, stage, 1024, 0, offload} }
	for _, ws := range [][2]int{{2, 4}, {4, 2}, {4, 3}, {1, 2}, {2, 1}} {
		for stage := 1; stage <= 3; stage++ {
			for _, off := range []bool{false, true} {
				pairs = append(pairs, pair{end(ws[0], stage, off), end(ws[1], stage, off)})
			}
		}
	}
	for from := 1; from <= 3; from++ {
		for to := 1; to <= 3; to++ {
			if from != to {
				pairs = append(pairs, pair{end(2, from, false), end(2, to, from == 3)})
			}
		}
	}
	for stage := 1; stage <= 3; stage++ {
		pairs = append(pairs,
			pair{end(2, stage, false), end(2, stage, true)},
			pair{end(2, stage, true), end(2, stage, false)},
			pair{end(2, stage, false), reshardEnd{2, stage, 300, 0, false}},
			pair{reshardEnd{2, stage, 4096, 0, true}, reshardEnd{2, stage, 1024, 64, false}},
		)
	}
	pairs = append(pairs,
		pair{reshardEnd{2, 1, 1024, 0, false}, reshardEnd{3, 3, 300, 16, true}},
		pair{reshardEnd{3, 3, 300, 16, true}, reshardEnd{2, 1, 4096, 0, false}},
		pair{reshardEnd{4, 2, 512, 8, true}, reshardEnd{1, 3, 2048, 0, false}},
	)
	dtypes := []DType{FP32, BF16, FP16}
	worst := 0.0
	for i, pr := range pairs {
		c := ckptCase{dtype: dtypes[i%3], sgd: i%4 == 3, window: pr.from.stage != pr.to.stage}
		if pr.from.world != pr.to.world && c.dtype == FP16 {
			c.dtype = BF16 // the reference does not follow fp16's moving scale
		}
		if testing.Short() && i%3 != 0 {
			continue
		}
		opt := "adamw"
		if c.sgd {
			opt = "sgd"
		}
		name := fmt.Sprintf("%v/window=%v/%s %v→%v", c.dtype, c.window, opt, pr.from, pr.to)
		dir := t.TempDir()
		saved := pr.from.run(t, ckptRun{c: c, from: 0, to: at, save: dir})
		loaded := pr.to.run(t, ckptRun{c: c, from: at, to: at, load: dir, savedWorld: pr.from.world})
		if d := sameConsolidated(saved, loaded); d != "" {
			t.Fatalf("%s: the loaded state differs from the saved one: %s", name, d)
		}
		resumed := pr.to.run(t, ckptRun{c: c, from: at, to: steps, load: dir, savedWorld: pr.from.world})
		if pr.from.world == pr.to.world {
			plain := pr.from.run(t, ckptRun{c: c, from: at, to: steps, load: dir})
			if d := sameConsolidated(plain, resumed); d != "" {
				t.Fatalf("%s: two steps after the reshard differ from two steps without it: %s", name, d)
			}
			continue
		}
		ratio, err := checkReshardTraining(c, pr.to.world, at, steps, loaded, resumed)
		if err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		worst = max(worst, ratio)
	}
	t.Logf("%d reshards; after a change of world size the master's distance from the float64 reference is at most %.3g of its bound", len(pairs), worst)
}

// checkReshardTraining compares the master of resumed (steps [from, to)
// on world ranks after the load) with a float64 reference run from the
// loaded state: the mean of every rank's two backwards' gradients,
// clipped, then AdamW (amsgrad, decoupled decay) or SGD (momentum) as
// torch defines them at the saved rate. The bound follows the engine's
// roundings to first order, with a factor 2: the wire dtype's unit
// roundoff per rank added and per accumulation, relative to the mean of
// the gradients' magnitudes; the clip factor's error from the norm's
// (triangle inequality); fp32's roundoff in each update. It returns the
// largest distance over its bound.
func checkReshardTraining(c ckptCase, world, from, to int, loaded, resumed []ckptState) (float64, error) {
	st, err := consolidate(loaded)
	if err != nil {
		return 0, err
	}
	end, err := consolidate(resumed)
	if err != nil {
		return 0, err
	}
	f32 := func(b []byte) []float64 {
		x := make([]float64, len(b)/4)
		for i := range x {
			x[i] = float64(math.Float32frombits(binary.LittleEndian.Uint32(b[4*i:])))
		}
		return x
	}
	np := len(ckptSizes)
	p, m, v, vmax := make([][]float64, np), make([][]float64, np), make([][]float64, np), make([][]float64, np)
	dp, dm, dv, dvmax := make([][]float64, np), make([][]float64, np), make([][]float64, np), make([][]float64, np)
	for q := range np {
		p[q], m[q] = f32(st["master"][q]), f32(st["m"][q])
		if c.sgd {
			v[q], vmax[q] = make([]float64, len(p[q])), make([]float64, len(p[q]))
		} else {
			v[q], vmax[q] = f32(st["v"][q]), f32(st["vmax"][q])
		}
		dp[q], dm[q], dv[q], dvmax[q] = make([]float64, len(p[q])), make([]float64, len(p[q])), make([]float64, len(p[q])), make([]float64, len(p[q]))
	}
	steps := slices.Clone(loaded[0].steps)
	u32, u := unitRoundoff(FP32), unitRoundoff(c.dtype)
	cfg := c.config()
	for s := from; s < to; s++ {
		g, dg := make([][]float64, np), make([][]float64, np)
		norm2, dnorm2 := 0.0, 0.0
		for q, n := range ckptSizes {
			g[q], dg[q] = make([]float64, n), make([]float64, n)
			abs := make([]float64, n)
			for r := range world {
				for k := range 2 {
					t := ckptGrad(c, s, k, r, q, n, 1)
					for i := range n {
						x := float64(refDecode(c.dtype, tensorBits(t, i)))
						g[q][i] += x
						abs[i] += math.Abs(x)
					}
				}
			}
			for i := range n {
				g[q][i] /= float64(2 * world)
				dg[q][i] = 2 * float64(world+3) * u * abs[i] / float64(2*world)
				norm2 += g[q][i] * g[q][i]
				dnorm2 += dg[q][i] * dg[q][i]
			}
		}
		norm := math.Sqrt(norm2)
		coef, rho := 1.0, 0.0
		if norm > cfg.Optimizer.Clip {
			coef, rho = norm/cfg.Optimizer.Clip, math.Sqrt(dnorm2)/norm+4*u32
		}
		for q := range np {
			steps[q]++
			for i := range g[q] {
				gi := g[q][i] / coef
				dgi := dg[q][i]/coef + math.Abs(gi)*rho
				if c.sgd {
					o := cfg.Optimizer.Groups[0].(SGD)
					lr := o.LR / 2
					if steps[q] == 1 {
						m[q][i], dm[q][i] = gi, dgi
					} else {
						m[q][i] = o.Momentum*m[q][i] + gi
						dm[q][i] = o.Momentum*dm[q][i] + dgi + 2*u32*math.Abs(m[q][i])
					}
					p[q][i] -= lr * m[q][i]
					dp[q][i] += lr*dm[q][i] + 2*u32*math.Abs(p[q][i])
					continue
				}
				o := cfg.Optimizer.Groups[0].(AdamW)
				lr := o.LR / 2
				t := float64(steps[q])
				bc1, bc2 := 1-math.Pow(o.Beta1, t), 1-math.Pow(o.Beta2, t)
				p[q][i] *= 1 - lr*o.WeightDecay
				m[q][i] = o.Beta1*m[q][i] + (1-o.Beta1)*gi
				dm[q][i] = o.Beta1*dm[q][i] + (1-o.Beta1)*dgi + 2*u32*math.Abs(m[q][i])
				v[q][i] = o.Beta2*v[q][i] + (1-o.Beta2)*gi*gi
				dv[q][i] = o.Beta2*dv[q][i] + (1-o.Beta2)*(2*math.Abs(gi)*dgi+dgi*dgi) + 2*u32*v[q][i]
				vmax[q][i] = max(vmax[q][i], v[q][i])
				dvmax[q][i] = max(dvmax[q][i], dv[q][i])
				root := math.Sqrt(vmax[q][i] / bc2)
				dRoot := math.Sqrt(dvmax[q][i] / bc2) // |√a − √b| ≤ √|a − b|
				if vmax[q][i] > 0 {
					dRoot = min(dRoot, dvmax[q][i]/bc2/(2*root))
				}
				den := root + o.Eps
				dDen := dRoot + 4*u32*den
				ratio := m[q][i] / den
				dRatio := dm[q][i]/den + math.Abs(m[q][i])*dDen/(den*den)
				p[q][i] -= lr / bc1 * ratio
				dp[q][i] = dp[q][i]*(1-lr*o.WeightDecay) + lr/bc1*(dRatio+8*u32*math.Abs(ratio)) + 4*u32*math.Abs(p[q][i])
			}
		}
	}
	worst := 0.0
	for q := range np {
		got := f32(end["master"][q])
		for i := range got {
			bound := 2 * dp[q][i]
			if d := math.Abs(got[i] - p[q][i]); d > bound {
				return 0, fmt.Errorf("parameter %d element %d: the master is %.9g, the float64 reference %.9g, %.3g apart, beyond the bound %.3g", q, i, got[i], p[q][i], d, bound)
			} else if bound > 0 {
				worst = max(worst, d/bound)
			}
		}
	}
	return worst, nil
}

// tensorBits is element i of a host tensor as raw bits.
func tensorBits(t Tensor, i int) uint32 {
	if t.dtype == FP32 {
		return math.Float32bits(t.HostFloat32s()[i])
	}
	return uint32(t.HostHalfs()[i])
}

// TestCheckpointRefusals: each damaged or foreign checkpoint is refused
// with ErrCheckpoint naming the file, and the engine is unchanged.
func TestCheckpointRefusals(t *testing.T) {
	c := ckptCase{stage: 2, dtype: BF16}
	base := t.TempDir()
	ckptTrain(t, c, 0, 2, "", base)
	latest, err := os.ReadFile(filepath.Join(base, ckptLatest))
	if err != nil {
		t.Fatal(err)
	}
	at := filepath.Join(base, string(latest[:len(latest)-1]))
	copyDir := func() string { // into a directory of its own, with no latest
		d := filepath.Join(t.TempDir(), "ck")
		if err := os.Mkdir(d, 0o755); err != nil {
			t.Fatal(err)
		}
		ents, _ := os.ReadDir(at)
		for _, e := range ents {
			b, err := os.ReadFile(filepath.Join(at, e.Name()))
			if err != nil {
				t.Fatal(err)
			}
			if err := os.WriteFile(filepath.Join(d, e.Name()), b, 0o644); err != nil {
				t.Fatal(err)
			}
		}
		return d
	}
	edit := func(name string, f func([]byte) []byte) func(string) {
		return func(d string) {
			p := filepath.Join(d, name)
			b, err := os.ReadFile(p)
			if err != nil {
				t.Fatal(err)
			}
			if err := os.WriteFile(p, f(b), 0o644); err != nil {
				t.Fatal(err)
			}
		}
	}
	flip := func(at int) func([]byte) []byte {
		return func(b []byte) []byte { b[at] ^= 0x10; return b }
	}
	// edits the manifest's values and seals it again: a consistent manifest
	// of something else
	reseal := func(f func(*ckptManifestData)) func(string) {
		return edit(ckptManifest, func(b []byte) []byte {
			var m ckptManifestData
			if err := json.Unmarshal(b, &m); err != nil {
				t.Fatal(err)
			}
			f(&m)
			out, err := sealManifest(&m)
			if err != nil {
				t.Fatal(err)
			}
			return out
		})
	}
	// flips the lowest bit of the byte after key: a digit becomes another
	flipAfter := func(key string) func([]byte) []byte {
		return func(b []byte) []byte {
			i := strings.Index(string(b), key)
			if i < 0 {
				t.Fatalf("no %q", key)
			}
			b[i+len(key)] ^= 1
			return b
		}
	}
	pointer := func(f func([]byte) []byte) func(string) {
		return func(d string) {
			p := filepath.Join(filepath.Dir(d), ckptLatest)
			if err := os.WriteFile(p, f([]byte(filepath.Base(d)+"\n")), 0o644); err != nil {
				t.Fatal(err)
			}
		}
	}
	for _, tc := range []struct {
		name   string
		damage func(string)
		want   string
		parent bool // load the parent directory, through latest
	}{
		{"rank file truncated", edit("rank-00001.bin", func(b []byte) []byte { return b[:len(b)-5] }), "rank-00001.bin", false},
		{"rank file with a flipped byte in a section", edit("rank-00000.bin", flip(100)), "rank-00000.bin", false},
		{"rank file with a flipped byte in the footer", edit("rank-00001.bin", func(b []byte) []byte { b[len(b)-40] ^= 1; return b }), "rank-00001.bin", false},
		{"rank file missing", func(d string) { os.Remove(filepath.Join(d, "rank-00001.bin")) }, "rank-00001.bin", false},
		{"manifest truncated", edit(ckptManifest, func(b []byte) []byte { return b[:len(b)/2] }), ckptManifest, false},
		{"manifest with a flipped byte", edit(ckptManifest, flipAfter(`"step": `)), ckptManifest, false},
		{"manifest missing: incomplete", func(d string) { os.Remove(filepath.Join(d, ckptManifest)) }, "no checkpoint", false},
		{"latest truncated", pointer(func(b []byte) []byte { return b[:len(b)-3] }), ckptLatest, true},
		{"latest with a flipped byte", pointer(func(b []byte) []byte { b[0] ^= 1; return b }), ckptLatest, true},
		{"latest missing", func(string) {}, "no checkpoint", true},
		{"a newer version", reseal(func(m *ckptManifestData) { m.Version = ckptVersion + 1 }), "newer", false},
		{"another model", reseal(func(m *ckptManifestData) { m.Params[1].Name = "x1" }), "parameter 1", false},
		{"another shape", reseal(func(m *ckptManifestData) { m.Params[2].Count++ }), "parameter 2", false},
		{"another dtype", reseal(func(m *ckptManifestData) { m.Params[0].DType = "fp16" }), "parameter 0", false},
		{"a setting that must match", reseal(func(m *ckptManifestData) {
			for i := range m.Settings {
				if m.Settings[i].Path == "Grads.PredivideFactor" {
					m.Settings[i].Value = "2"
				}
			}
		}), "Grads.PredivideFactor", false},
	} {
		d := copyDir()
		tc.damage(d)
		from := d
		if tc.parent {
			from = filepath.Dir(d)
		}
		comms, _ := NewLocalGroup(2)
		errs := eachRank(2, func(rank int) error {
			defer comms[rank].Close()
			ps := make([]Param, len(ckptSizes))
			for p, n := range ckptSizes {
				ps[p] = Param{Name: fmt.Sprint("w", p), Count: n, DType: c.dtype, Data: toDType(make([]float32, n), c.dtype)}
			}
			e, err := New(c.config(), comms[rank], ps)
			if err != nil {
				return err
			}
			defer e.Close()
			before, err := readCkptState(e)
			if err != nil {
				return err
			}
			_, lerr := e.Load(from, LoadOptions{})
			after, err := readCkptState(e)
			if err != nil {
				return fmt.Errorf("the engine after a refused load: %w", err)
			}
			if diff := before.diff(after); diff != "" {
				return fmt.Errorf("a refused load changed the engine: %s", diff)
			}
			return lerr
		})
		t.Logf("%s: %v", tc.name, errs[0])
		for rank, err := range errs {
			if !errors.Is(err, ErrCheckpoint) || errors.Is(err, ErrCollective) {
				t.Errorf("%s: rank %d: %v, want ErrCheckpoint and a usable engine", tc.name, rank, err)
			}
		}
		if err := errs[0]; err != nil && !strings.Contains(err.Error(), tc.want) && !strings.Contains(errs[1].Error(), tc.want) {
			t.Errorf("%s: %v / %v, want an error naming %q", tc.name, errs[0], errs[1], tc.want)
		}
	}
}

func replaceOnce(s, old, new string) string {
	if !strings.Contains(s, old) {
		panic("no " + old + " in the manifest")
	}
	return strings.Replace(s, old, new, 1)
}

// TestCheckpointLoadOptions: WeightsOnly gives the run of a fresh engine
// built from the saved parameters (fp32: the master is the parameters);
// KeepConfigGroups gives the run of a full load followed by SetGroup to
// the engine's own group, with the moments and steps restored.
func TestCheckpointLoadOptions(t *testing.T) {
	c := ckptCase{stage: 2, dtype: FP32}
	dir := t.TempDir()
	saved := ckptTrain(t, c, 0, 3, "", dir)
	faster := func(cfg *Config) {
		a := NewAdamW(3e-2)
		a.AMSGrad = true
		cfg.Optimizer.Groups = []Optimizer{a}
	}
	weights := ckptRun{c: c, from: 3, to: 5, load: dir, loadOpt: LoadOptions{WeightsOnly: true}, config: faster}.run(t)
	fresh := ckptRun{c: c, from: 3, to: 5, config: faster, initial: saved[0].params}.run(t)
	for rank := range weights {
		if d := fresh[rank].diff(weights[rank]); d != "" {
			t.Errorf("WeightsOnly rank %d: the run differs from a fresh engine's from the saved parameters: %s", rank, d)
		}
	}
	kept := ckptRun{c: c, from: 3, to: 5, load: dir, loadOpt: LoadOptions{KeepConfigGroups: true}, config: faster}.run(t)
	set := ckptRun{c: c, from: 3, to: 5, load: dir, config: faster, edit: func(e *Engine) error {
		if g := e.opt.currentGroups()[0].(AdamW); g.LR != 1e-2/2 {
			return fmt.Errorf("after a full load the rate is %v, want the saved %v", g.LR, 1e-2/2)
		}
		a := NewAdamW(3e-2)
		a.AMSGrad = true
		return e.SetGroup(0, a)
	}}.run(t)
	for rank := range kept {
		if d := set[rank].diff(kept[rank]); d != "" {
			t.Errorf("KeepConfigGroups rank %d: the run differs from a load and SetGroup: %s", rank, d)
		}
		if d := saved[rank].diff(kept[rank]); d == "" {
			t.Errorf("KeepConfigGroups rank %d: two more steps changed nothing", rank)
		}
	}
}

// crashFS is the operating system's file layer until its at-th operation
// that changes anything (a create, write, fsync, close, rename, mkdir or
// removal): that one and every later one fail, as in a process that died
// there. lose then undoes what a power cut may: data written since a
// file's last fsync is torn (half of it kept), and the creations and
// renames that no fsync of their directory has made durable are undone.
type crashFS struct {
	osFS
	mu      sync.Mutex
	ops, at int
	synced  map[string]int64 // files written since their last fsync: their size at it
	pending []dirOp          // directory entries not yet durable, oldest first
}

type dirOp struct {
	dir, from, to string // from "" for a creation
	replaced      []byte // the file a rename replaced, which an undo brings back
}

var errCrashed = errors.New("crashed")

func newCrashFS(at int) *crashFS { return &crashFS{at: at, synced: map[string]int64{}} }

// op counts an operation and reports whether it fails.
func (c *crashFS) op() error {
	c.ops++
	if c.at > 0 && c.ops >= c.at {
		return errCrashed
	}
	return nil
}

func (c *crashFS) locked(f func() error) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if err := c.op(); err != nil {
		return err
	}
	return f()
}

func (c *crashFS) MkdirAll(dir string) error {
	return c.locked(func() error {
		if _, err := os.Stat(dir); err == nil {
			return nil
		}
		c.pending = append(c.pending, dirOp{dir: filepath.Dir(dir), to: dir})
		return os.MkdirAll(dir, 0o755)
	})
}

func (c *crashFS) Create(name string) (ckptFile, error) {
	var f ckptFile
	err := c.locked(func() error {
		var err error
		if f, err = c.osFS.Create(name); err != nil {
			return err
		}
		c.synced[name] = 0
		c.pending = append(c.pending, dirOp{dir: filepath.Dir(name), to: name})
		return nil
	})
	return crashFile{f, c, name}, err
}

func (c *crashFS) Rename(from, to string) error {
	return c.locked(func() error {
		replaced, _ := os.ReadFile(to)
		if err := os.Rename(from, to); err != nil {
			return err
		}
		for name, size := range c.synced { // the files keep their state under the new name
			if name == from || strings.HasPrefix(name, from+"/") {
				delete(c.synced, name)
				c.synced[to+strings.TrimPrefix(name, from)] = size
			}
		}
		c.pending = append(c.pending, dirOp{dir: filepath.Dir(to), from: from, to: to, replaced: replaced})
		return nil
	})
}

func (c *crashFS) RemoveAll(name string) error {
	return c.locked(func() error { return os.RemoveAll(name) })
}

func (c *crashFS) SyncDir(dir string) error {
	return c.locked(func() error {
		c.pending = slices.DeleteFunc(c.pending, func(o dirOp) bool { return o.dir == dir })
		return c.osFS.SyncDir(dir)
	})
}

type crashFile struct {
	ckptFile
	c    *crashFS
	name string
}

func (f crashFile) Write(p []byte) (int, error) {
	n := 0
	err := f.c.locked(func() error {
		var err error
		n, err = f.ckptFile.Write(p)
		return err
	})
	return n, err
}

func (f crashFile) Sync() error {
	return f.c.locked(func() error {
		delete(f.c.synced, f.name)
		return f.ckptFile.Sync()
	})
}

func (f crashFile) Close() error {
	err := f.c.locked(func() error { return nil })
	if cerr := f.ckptFile.Close(); err == nil {
		err = cerr
	}
	return err
}

// lose applies the power cut: torn unsynced data, then the undurable
// directory entries undone, newest first.
func (c *crashFS) lose() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	for name, size := range c.synced {
		st, err := os.Stat(name)
		if err != nil {
			continue // removed, or inside a directory since removed
		}
		if err := os.Truncate(name, size+(st.Size()-size)/2); err != nil {
			return err
		}
	}
	for i := len(c.pending) - 1; i >= 0; i-- {
		o := c.pending[i]
		var err error
		if o.from == "" {
			err = os.RemoveAll(o.to)
		} else if _, serr := os.Stat(o.to); serr == nil {
			if err = os.Rename(o.to, o.from); err == nil && o.replaced != nil {
				err = os.WriteFile(o.to, o.replaced, 0o644)
			}
		}
		if err != nil {
			return err
		}
	}
	return nil
}

// TestCheckpointCrash: a save that dies at any of its operations (every
// create, write, fsync, close, rename, mkdir and removal, on any rank),
// followed by a power cut, leaves a directory that loads either the
// previous checkpoint or the new one, bit for bit: the previous one until
// the new one's latest pointer is durable, the new one from then on; and
// the next save succeeds there and leaves nothing incomplete behind.
func TestCheckpointCrash(t *testing.T) {
	c := ckptCase{stage: 3, dtype: BF16, offload: true}
	base := t.TempDir()
	prev := ckptTrain(t, c, 0, 2, "", base)
	// the engines that save: trained one step further than prev
	const world = 2
	comms, err := NewLocalGroup(world)
	if err != nil {
		t.Fatal(err)
	}
	engines := make([]*Engine, world)
	next := make([]ckptState, world)
	errs := eachRank(world, func(rank int) error {
		ps := make([]Param, len(ckptSizes))
		for p, n := range ckptSizes {
			ps[p] = Param{Name: fmt.Sprint("w", p), Count: n, DType: c.dtype, Data: toDType(make([]float32, n), c.dtype)}
		}
		e, err := New(c.config(), comms[rank], ps)
		if err != nil {
			return err
		}
		engines[rank] = e
		if _, err := e.Load(base, LoadOptions{}); err != nil {
			return err
		}
		s := NewHostStream()
		defer s.Close()
		if err := forward(e, s); err != nil {
			return err
		}
		for p := len(ps) - 1; p >= 0; p-- {
			if _, err := e.GradReady(p, ckptGrad(c, 2, 0, rank, p, ps[p].Count, e.LossScale()), s); err != nil {
				return err
			}
		}
		if err := e.EndBackward(); err != nil {
			return err
		}
		if err := e.Step(); err != nil {
			return err
		}
		next[rank], err = readCkptState(e)
		return err
	})
	defer func() {
		for rank, e := range engines {
			if e != nil {
				e.Close()
			}
			comms[rank].Close()
		}
	}()
	for rank, err := range errs {
		if err != nil {
			t.Fatalf("rank %d: %v", rank, err)
		}
	}
	if next[0].diff(prev[0]) == "" {
		t.Fatal("the step changed nothing: the test cannot tell the checkpoints apart")
	}
	// Keep 1: the previous checkpoint is removed once the new one is
	// complete, so some crash points come after the commit
	save := func(dir string, fsys ckptFS) []error {
		return eachRank(world, func(rank int) error {
			engines[rank].files = fsys
			defer func() { engines[rank].files = nil }()
			return engines[rank].Save(dir, SaveOptions{Client: []byte(fmt.Sprintf("rank %d at step %d", rank, 3)), Keep: 1})
		})
	}
	// a save that does not crash: how many operations it takes
	count := newCrashFS(0)
	if err := errors.Join(save(copyTree(t, base), count)...); err != nil {
		t.Fatal(err)
	}
	total, sawNew, kept := count.ops, false, 0
	for at := 1; at <= total; at++ {
		dir := copyTree(t, base)
		fsys := newCrashFS(at)
		errs := save(dir, fsys)
		if errors.Join(errs...) == nil {
			t.Fatalf("crash at operation %d of %d: every rank's Save returned nil", at, total)
		}
		if err := fsys.lose(); err != nil {
			t.Fatal(err)
		}
		got := ckptTrain(t, c, -1, -1, dir, "")
		isPrev, isNext := got[0].diff(prev[0]) == "" && got[1].diff(prev[1]) == "", got[0].diff(next[0]) == "" && got[1].diff(next[1]) == ""
		switch {
		case !isPrev && !isNext:
			t.Fatalf("crash at operation %d of %d: the checkpoint loaded is neither the previous one nor the new one", at, total)
		case isPrev && sawNew:
			t.Fatalf("crash at operation %d of %d: the previous checkpoint came back after an earlier crash had kept the new one", at, total)
		}
		sawNew = sawNew || isNext
		if isNext {
			kept++
		}
		// the next save there succeeds and leaves only complete checkpoints
		if err := errors.Join(save(dir, nil)...); err != nil {
			t.Fatalf("crash at operation %d of %d: the save after it: %v", at, total, err)
		}
		ents, _ := os.ReadDir(dir)
		for _, e := range ents {
			if _, err := os.Stat(filepath.Join(dir, e.Name(), ckptManifest)); e.IsDir() && err != nil {
				t.Fatalf("crash at operation %d of %d: the save after it left %s, incomplete", at, total, e.Name())
			}
		}
	}
	if !sawNew {
		t.Fatalf("no crash point kept the new checkpoint, not even the last of %d", total)
	}
	t.Logf("%d crash points of a save on %d ranks: the previous checkpoint loads after %d, the new one after %d", total, world, total-kept, kept)
}

// copyTree copies the checkpoint directory src into a new one.
func copyTree(t *testing.T, src string) string {
	dst := t.TempDir()
	err := filepath.WalkDir(src, func(p string, d os.DirEntry, err error) error {
		if err != nil {
			return err
		}
		to := filepath.Join(dst, strings.TrimPrefix(p, src))
		if d.IsDir() {
			return os.MkdirAll(to, 0o755)
		}
		b, err := os.ReadFile(p)
		if err != nil {
			return err
		}
		return os.WriteFile(to, b, 0o644)
	})
	if err != nil {
		t.Fatal(err)
	}
	return dst
}

// goldenCase is the run the golden checkpoint of format version 1 holds:
// fp16 with a loss scale moved by an overflow, coalesced windows, AdamW
// with amsgrad, ZeRO-2 on 2 ranks, saved after 3 steps.
var goldenCase = ckptCase{stage: 2, dtype: FP16, window: true}

const goldenDir = "testdata/checkpoint-v1"

// goldenDigest is what a load of the golden checkpoint must give: a
// SHA-256 of each state tensor and of the parameters, and the rest as is.
type goldenDigest struct {
	State  map[string]string `json:"state"`
	Params string            `json:"params"`
	Steps  []int             `json:"steps"`
	Scaler scalerState       `json:"scaler"`
	Step   int               `json:"step"`
}

func digestOf(s ckptState) goldenDigest {
	d := goldenDigest{State: map[string]string{}, Steps: s.steps, Scaler: s.scaler, Step: s.step}
	for name, b := range s.state {
		d.State[name] = fmt.Sprintf("%x", sha256.Sum256(b))
	}
	h := sha256.New()
	for _, p := range s.params {
		for _, v := range p {
			binary.Write(h, binary.LittleEndian, math.Float32bits(v))
		}
	}
	d.Params = fmt.Sprintf("%x", h.Sum(nil))
	return d
}

// TestCheckpointGolden: the committed checkpoint of format version 1
// loads, now and in every later version, into the state it was saved
// with (its digest, committed beside it), or is refused by its version
// with ErrCheckpoint. ZERO_WRITE_GOLDEN=1 writes it anew (only when the
// format version changes: the old one stays, under its own name).
func TestCheckpointGolden(t *testing.T) {
	digests := filepath.Join(goldenDir, "digest.json")
	if os.Getenv("ZERO_WRITE_GOLDEN") == "1" {
		tmp := t.TempDir()
		saved := ckptTrain(t, goldenCase, 0, 3, "", tmp)
		latest, err := os.ReadFile(filepath.Join(tmp, ckptLatest))
		if err != nil {
			t.Fatal(err)
		}
		os.RemoveAll(goldenDir)
		if err := os.Rename(filepath.Join(tmp, strings.TrimSpace(string(latest))), goldenDir); err != nil {
			t.Fatal(err)
		}
		out, _ := json.MarshalIndent([]goldenDigest{digestOf(saved[0]), digestOf(saved[1])}, "", " ")
		if err := os.WriteFile(digests, append(out, '\n'), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	b, err := os.ReadFile(digests)
	if err != nil {
		t.Fatal(err)
	}
	var want []goldenDigest
	if err := json.Unmarshal(b, &want); err != nil {
		t.Fatal(err)
	}
	got := ckptTrain(t, goldenCase, 3, 3, goldenDir, "")
	for rank := range got {
		if d := digestOf(got[rank]); !reflect.DeepEqual(d, want[rank]) {
			t.Errorf("rank %d: the golden checkpoint loads as\n%+v\nit was saved as\n%+v", rank, d, want[rank])
		}
	}
}

// BenchmarkCheckpoint saves and loads one rank's state (ZeRO-2, fp32
// parameters, AdamW: master, m, v and the model-dtype shard, 4 × 4 bytes
// an element; 4M elements by default, ZERO_BENCH_CKPT_ELEMS to change)
// beside a plain sequential write and read of the same bytes in 8 MiB
// pieces to the same disk, the read into memory of their size (a load
// lands every byte in the state). Both sides are fsynced and replace the previous
// copy only once the new one is whole (the plain file is written beside
// it and renamed over it, as a save with Keep 1 removes the checkpoint
// before it); the page cache of every file is dropped before each read.
// Metrics: MB/s of each, and x-write and x-read, the ratios of the plain
// file's median time to the checkpoint's over the iterations (medians: a
// shared disk's stalls land on either side); the Go heap a save or a load
// allocates (extra-MiB). The directory is ZERO_BENCH_DIR, or the system's
// temporary one.
func BenchmarkCheckpoint(b *testing.B) {
	elems := 4 << 20
	if v, err := strconv.Atoi(os.Getenv("ZERO_BENCH_CKPT_ELEMS")); err == nil && v > 0 {
		elems = v
	}
	root, err := os.MkdirTemp(os.Getenv("ZERO_BENCH_DIR"), "zero-ckpt-bench")
	if err != nil {
		b.Fatal(err)
	}
	defer os.RemoveAll(root)
	comms, err := NewLocalGroup(1)
	if err != nil {
		b.Fatal(err)
	}
	defer comms[0].Close()
	sizes := []int{elems / 2, elems / 4, elems / 4}
	ps := make([]Param, len(sizes))
	for p, n := range sizes {
		ps[p] = Param{Name: fmt.Sprint("w", p), Count: n, DType: FP32, Data: Float32s(make([]float32, n))}
	}
	e, err := New(Config{Stage: 2, BucketBytes: 32 << 20, Optimizer: OptimizerPolicy{Groups: []Optimizer{NewAdamW(1e-3)}}}, comms[0], ps)
	if err != nil {
		b.Fatal(err)
	}
	defer e.Close()
	dir := filepath.Join(root, "ckpt")
	if err := e.Save(dir, SaveOptions{Keep: 1}); err != nil { // allocates the moments' files once
		b.Fatal(err)
	}
	bytes := int64(0)
	filepath.WalkDir(dir, func(p string, d os.DirEntry, err error) error {
		if err == nil && strings.HasSuffix(p, ".bin") {
			st, _ := os.Stat(p)
			bytes += st.Size()
		}
		return nil
	})
	plain := filepath.Join(root, "plain")
	buf, dst := make([]byte, ckptChunk), make([]byte, bytes)
	var tSave, tLoad, tWrite, tRead []time.Duration
	var allocSave, allocLoad uint64
	timed := func(into *[]time.Duration, f func() error) {
		t0 := time.Now()
		if err := f(); err != nil {
			b.Fatal(err)
		}
		*into = append(*into, time.Since(t0))
	}
	b.SetBytes(bytes)
	b.ResetTimer()
	for range b.N {
		a := heapAllocated()
		timed(&tSave, func() error { return e.Save(dir, SaveOptions{Keep: 1}) })
		allocSave += heapAllocated() - a
		if err := dropCache(dir); err != nil {
			b.Fatal(err)
		}
		a = heapAllocated()
		timed(&tLoad, func() error { _, err := e.Load(dir, LoadOptions{}); return err })
		allocLoad += heapAllocated() - a
		timed(&tWrite, func() error { return writePlain(plain, buf, bytes) })
		if err := dropCache(plain); err != nil {
			b.Fatal(err)
		}
		timed(&tRead, func() error { return readPlain(plain, dst) })
	}
	median := func(d []time.Duration) float64 {
		s := slices.Clone(d)
		slices.Sort(s)
		return s[len(s)/2].Seconds()
	}
	mbs := func(d []time.Duration) float64 { return float64(bytes) / median(d) / 1e6 }
	b.ReportMetric(mbs(tSave), "save-MB/s")
	b.ReportMetric(mbs(tLoad), "load-MB/s")
	b.ReportMetric(mbs(tWrite), "write-MB/s")
	b.ReportMetric(mbs(tRead), "read-MB/s")
	b.ReportMetric(median(tWrite)/median(tSave), "x-write")
	b.ReportMetric(median(tRead)/median(tLoad), "x-read")
	b.ReportMetric(float64(allocSave)/float64(b.N)/(1<<20), "save-extra-MiB")
	b.ReportMetric(float64(allocLoad)/float64(b.N)/(1<<20), "load-extra-MiB")
	b.ReportMetric(float64(bytes)/(1<<20), "state-MiB")
}

// writePlain writes n bytes beside name in pieces of buf, fsynced, and
// renames the file over name (the directory fsynced).
func writePlain(name string, buf []byte, n int64) error {
	f, err := os.Create(name + ".new")
	if err != nil {
		return err
	}
	for off := int64(0); off < n; off += int64(len(buf)) {
		if _, err := f.Write(buf[:min(int64(len(buf)), n-off)]); err != nil {
			f.Close()
			return err
		}
	}
	if err := f.Sync(); err != nil {
		f.Close()
		return err
	}
	if err := f.Close(); err != nil {
		return err
	}
	if err := os.Rename(name+".new", name); err != nil {
		return err
	}
	return osFS{}.SyncDir(filepath.Dir(name))
}

// readPlain reads name front to back into dst, in pieces of 8 MiB: the
// bytes land in memory of their size, as a load's land in the state.
func readPlain(name string, dst []byte) error {
	f, err := os.Open(name)
	if err != nil {
		return err
	}
	defer f.Close()
	for off := 0; off < len(dst); {
		n, err := f.Read(dst[off:min(off+ckptChunk, len(dst))])
		off += n
		if err == io.EOF {
			return nil
		} else if err != nil {
			return err
		}
	}
	return nil
}

// dropCache asks the kernel to drop the cached pages of every file under
// path (they are fsynced), so the next read comes from the disk.
func dropCache(path string) error {
	return filepath.WalkDir(path, func(p string, d os.DirEntry, err error) error {
		if err != nil || d.IsDir() {
			return err
		}
		f, err := os.Open(p)
		if err != nil {
			return err
		}
		defer f.Close()
		return unix.Fadvise(int(f.Fd()), 0, 0, unix.FADV_DONTNEED)
	})
}
