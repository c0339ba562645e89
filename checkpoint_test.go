package zero

import (
	"bufio"
	"bytes"
	"cmp"
	"crypto/sha256"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"hash/crc32"
	"maps"
	"math"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// ckptCase is one configuration of the resume test.
type ckptCase struct {
	stage   int
	offload bool
	dtype   DType
	window  bool   // every step a coalesced window of 2 backwards
	sgd     bool   // SGD with momentum instead of AdamW (with amsgrad)
	oneSign bool   // gradients of one sign per element and step, magnitudes in [0.5, 1): no sum cancels
	seed    uint64 // mixed into ckptGrad's hash (0: the data of the tests before seeds)
}

func (c ckptCase) String() string {
	opt := "adamw"
	if c.sgd {
		opt = "sgd"
	}
	sign := ""
	if c.oneSign {
		sign = "/one-sign"
	}
	return fmt.Sprintf("z%d/%v/offload=%v/window=%v/%s%s", c.stage, c.dtype, c.offload, c.window, opt, sign)
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
// backward k on rank: hashed values in [−1, 1) (with c.oneSign, of a sign
// hashed from st, p and i alone and a magnitude in [0.5, 1), 23 bits of
// it hashed), times the loss scale; at the overflow step rank 1 puts an
// inf in parameter 2.
func ckptGrad(c ckptCase, st, k, rank, p, n int, scale float64) Tensor {
	x := make([]float32, n)
	salt := uint64(0)
	if c.seed != 0 {
		salt = mix64(c.seed)
	}
	for i := range x {
		h := mix64(salt ^ (uint64(st)<<48 | uint64(k)<<40 | uint64(rank)<<32 | uint64(p)<<24 | uint64(i)))
		x[i] = float32(float64(int32(h>>32))*0x1p-31) * float32(scale)
		if c.oneSign {
			v := 0.5 + float64(h>>41)*0x1p-24 // exact in fp32
			if mix64(salt^(1<<63|uint64(st)<<48|uint64(p)<<24|uint64(i)))&1 != 0 {
				v = -v
			}
			x[i] = float32(v) * float32(scale)
		}
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
// checkpoint loaded: ranks beyond it get loadOpt.NewRankClient's client
// bytes.
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
	// report, if set, checks each rank's LoadReport.
	report func(rank int, r LoadReport) error
	// accum is the backwards each rank takes a step (0: 2): rank r's
	// backward k is micro-batch r·accum+k of the step's global batch, whose
	// micro-batch j is ckptGrad's backward j%2 of rank j/2.
	accum int
	// afterStep, if set, runs on every rank after each Step.
	afterStep func(e *Engine, rank, st int) error
}

func ckptTrain(t *testing.T, c ckptCase, from, to int, load, save string) []ckptState {
	t.Helper()
	return ckptRun{c: c, from: from, to: to, load: load, save: save}.run(t)
}

func (cr ckptRun) run(t *testing.T) []ckptState {
	t.Helper()
	c, from, to, load, save := cr.c, cr.from, cr.to, cr.load, cr.save
	world, accum := cmp.Or(cr.world, 2), cmp.Or(cr.accum, 2)
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
			rep, err := e.Load(load, cr.loadOpt)
			if err != nil {
				return err
			}
			src := rank
			if cr.savedWorld > 0 && rank >= cr.savedWorld {
				src = cr.loadOpt.NewRankClient // a rank the saving run did not have
			}
			want := []byte(fmt.Sprintf("rank %d at step %d", src, from))
			if src == NoClient {
				want = nil
			}
			if from >= 0 && (!bytes.Equal(rep.Client, want) || want == nil && rep.Client != nil || rep.ClientRank != src) { // from < 0: any
				return fmt.Errorf("client bytes %q of saved rank %d, want %q of %d", rep.Client, rep.ClientRank, want, src)
			}
			if cr.report != nil {
				if err := cr.report(rank, rep); err != nil {
					return err
				}
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
				for k := range accum {
					if err := forward(e, s); err != nil {
						return err
					}
					j := rank*accum + k // the global batch's micro-batch
					for p := len(ps) - 1; p >= 0; p-- {
						if _, err := e.GradReady(p, ckptGrad(c, st, j%2, j/2, p, ps[p].Count, e.LossScale()), s); err != nil {
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
			if skipped := e.Stats().Skipped; skipped != (st == ckptOverflowStep && world*accum > 2) { // micro-batches 2 and 3 overflow
				return fmt.Errorf("step %d skipped %v", st, skipped)
			}
			if cr.afterStep != nil {
				if err := cr.afterStep(e, rank, st); err != nil {
					return fmt.Errorf("after step %d: %w", st, err)
				}
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
// model-dtype shard, step counts, loss scaler, step; client bytes of
// the ranks the saving run had, rank 0's beyond. Two more steps then give the
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
// loaded state (ckptReferenceRun), within twice the reference's bound. It
// returns the largest distance over its bound.
func checkReshardTraining(c ckptCase, world, from, to int, loaded, resumed []ckptState) (float64, error) {
	ref, err := ckptReferenceRun(c, world, from, to, loaded)
	if err != nil {
		return 0, err
	}
	end, err := consolidate(resumed)
	if err != nil {
		return 0, err
	}
	worst := 0.0
	for q := range ref.p {
		got := ckptF32s(end["master"][q])
		for i := range got {
			bound := 2 * ref.dp[q][i]
			if d := math.Abs(got[i] - ref.p[q][i]); d > bound {
				return 0, fmt.Errorf("parameter %d element %d: the master is %.9g, the float64 reference %.9g, %.3g apart, beyond the bound %.3g", q, i, got[i], ref.p[q][i], d, bound)
			} else if bound > 0 {
				worst = max(worst, d/bound)
			}
		}
	}
	return worst, nil
}

// ckptF32s are little-endian fp32 bytes as float64s.
func ckptF32s(b []byte) []float64 {
	x := make([]float64, len(b)/4)
	for i := range x {
		x[i] = float64(math.Float32frombits(binary.LittleEndian.Uint32(b[4*i:])))
	}
	return x
}

// ckptReference is a float64 run of ckptRun's steps from a loaded state:
// each step's mean gradient g[s] and the bound dg[s] on an engine's
// distance from it, and the master p after the last step with dp, the
// bound on an engine's distance from it to first order (checked with a
// factor 2).
type ckptReference struct {
	g, dg [][][]float64 // by step from the first: by parameter, by element
	p, dp [][]float64
}

// ckptReferenceRun runs steps [from, to) of the global batch of world
// ranks' two backwards (ckptGrad's) from the loaded state in float64: the
// mean of the batch's gradients, clipped, then AdamW (amsgrad, decoupled
// decay) or SGD (momentum) as torch defines them at the saved rate. The
// bounds follow the engine's roundings to first order, with a factor 2:
// the wire dtype's unit roundoff per rank added and per accumulation,
// relative to the mean of the gradients' magnitudes; the clip factor's
// error from the norm's (triangle inequality); fp32's roundoff in each
// update.
func ckptReferenceRun(c ckptCase, world, from, to int, loaded []ckptState) (ckptReference, error) {
	var ref ckptReference
	st, err := consolidate(loaded)
	if err != nil {
		return ref, err
	}
	f32 := ckptF32s
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
		ref.g, ref.dg = append(ref.g, g), append(ref.dg, dg)
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
	ref.p, ref.dp = p, dp
	return ref, nil
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
		errs, _ := refusedLoad(t, c, 2, from, nil)
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

// refusedLoad loads from into fresh engines of c on world ranks (fsys, if
// set, is every engine's file layer; the engines start as ckptRun's),
// within a bound, and returns each rank's error; a rank whose engine the
// load changed gets an error that says so instead. Where every rank was
// refused and its engine is usable, each then takes ckptRun's step 0 and
// the state after it is returned: the bits of a run that never tried.
func refusedLoad(t *testing.T, c ckptCase, world int, from string, fsys func(rank int) ckptFS) ([]error, []ckptState) {
	t.Helper()
	return refusedLoadAs(t, c, world, from, fsys, LoadOptions{}, ErrCheckpoint)
}

// refusedLoadAs is refusedLoad with the load's options, for a refusal of
// kind (ErrCheckpoint, ErrConfig).
func refusedLoadAs(t *testing.T, c ckptCase, world int, from string, fsys func(rank int) ckptFS, opt LoadOptions, kind error) ([]error, []ckptState) {
	t.Helper()
	comms, _ := NewLocalGroupTimeout(world, 20*time.Second)
	var errs []error
	var refused sync.WaitGroup
	refused.Add(world)
	var stepped atomic.Bool
	stepped.Store(true)
	states := make([]ckptState, world)
	within(t, 60*time.Second, func() {
		errs = eachRank(world, func(rank int) error {
			defer comms[rank].Close()
			ps := make([]Param, len(ckptSizes))
			for p, n := range ckptSizes {
				x := make([]float32, n)
				for i := range x {
					x[i] = float32(i%17)*0.03 - 0.2 + float32(p)*0.01
				}
				ps[p] = Param{Name: fmt.Sprint("w", p), Count: n, DType: c.dtype, Data: toDType(x, c.dtype)}
			}
			e, err := New(c.config(), comms[rank], ps)
			if err != nil {
				refused.Done()
				return err
			}
			defer e.Close()
			if fsys != nil {
				e.files = fsys(rank)
			}
			before, err := readCkptState(e)
			if err != nil {
				refused.Done()
				return err
			}
			_, lerr := e.Load(from, opt)
			if !errors.Is(lerr, kind) || errors.Is(lerr, ErrCollective) {
				stepped.Store(false) // fatal, or loaded: no step
			}
			refused.Done()
			if errors.Is(lerr, ErrCollective) {
				return lerr // the state is not readable any more
			}
			after, err := readCkptState(e)
			if err != nil {
				return fmt.Errorf("the engine after a refused load: %w", err)
			}
			if diff := before.diff(after); diff != "" {
				return fmt.Errorf("a refused load changed the engine: %s", diff)
			}
			refused.Wait() // every rank's outcome known: all step, or none
			if stepped.Load() {
				s := NewHostStream()
				defer s.Close()
				for k := range 2 {
					for p := len(ps) - 1; p >= 0; p-- {
						if _, err := e.GradReady(p, ckptGrad(c, 0, k, rank, p, ps[p].Count, e.LossScale()), s); err != nil {
							return err
						}
					}
					if err := e.EndBackward(); err != nil {
						return err
					}
				}
				if err := e.Step(); err != nil {
					return fmt.Errorf("the step after a refused load: %w", err)
				}
				if states[rank], err = readCkptState(e); err != nil {
					return err
				}
			}
			return lerr
		})
	})
	if !stepped.Load() {
		states = nil
	}
	return errs, states
}

// TestCheckpointSpecialFiles: a rank file that is a FIFO (whose plain open
// waits for a writer forever), a directory, or a symlink to /dev/zero, and
// a manifest or latest that is a symlink to /dev/zero (whose plain read
// never ends), are refused within a bound, naming the file and that it is
// not a regular file, with little memory, and the engine unchanged; so is
// a FIFO given to ImportSafetensors.
func TestCheckpointSpecialFiles(t *testing.T) {
	c := ckptCase{stage: 2, dtype: BF16}
	base := t.TempDir()
	ckptTrain(t, c, 0, 1, "", base)
	latest, err := os.ReadFile(filepath.Join(base, ckptLatest))
	if err != nil {
		t.Fatal(err)
	}
	at := filepath.Join(base, strings.TrimSpace(string(latest)))
	replace := func(name string, with func(string) error) func(string) {
		return func(d string) {
			p := filepath.Join(d, name)
			if err := os.Remove(p); err != nil {
				t.Fatal(err)
			}
			if err := with(p); err != nil {
				t.Fatal(err)
			}
		}
	}
	fifo := func(p string) error { return unix.Mkfifo(p, 0o644) }
	zeros := func(p string) error { return os.Symlink("/dev/zero", p) }
	dir := func(p string) error { return os.Mkdir(p, 0o755) }
	for _, tc := range []struct {
		name   string
		damage func(string)
		want   string
		parent bool
	}{
		{"rank file a FIFO", replace("rank-00001.bin", fifo), "rank-00001.bin", false},
		{"rank file a directory", replace("rank-00000.bin", dir), "rank-00000.bin", false},
		{"rank file a symlink to /dev/zero", replace("rank-00000.bin", zeros), "rank-00000.bin", false},
		{"manifest a symlink to /dev/zero", replace(ckptManifest, zeros), ckptManifest, false},
		{"manifest a FIFO", replace(ckptManifest, fifo), ckptManifest, false},
		{"latest a symlink to /dev/zero", func(d string) { zeros(filepath.Join(filepath.Dir(d), ckptLatest)) }, ckptLatest, true},
		{"latest a FIFO", func(d string) { fifo(filepath.Join(filepath.Dir(d), ckptLatest)) }, ckptLatest, true},
	} {
		d := filepath.Join(t.TempDir(), "ck")
		if err := os.CopyFS(d, os.DirFS(at)); err != nil {
			t.Fatal(err)
		}
		tc.damage(d)
		from := d
		if tc.parent {
			from = filepath.Dir(d)
		}
		before := heapAllocated()
		errs, _ := refusedLoad(t, c, 2, from, nil)
		grown := heapAllocated() - before
		t.Logf("%s: %v (%d bytes allocated)", tc.name, errs[0], grown)
		for rank, err := range errs {
			if !errors.Is(err, ErrCheckpoint) || errors.Is(err, ErrCollective) {
				t.Errorf("%s: rank %d: %v, want ErrCheckpoint and a usable engine", tc.name, rank, err)
			}
		}
		if err := errors.Join(errs...); err == nil || !strings.Contains(err.Error(), tc.want) || !strings.Contains(err.Error(), "not a regular file") {
			t.Errorf("%s: %v, want an error naming %s, not a regular file", tc.name, err, tc.want)
		}
		if grown > 64<<20 {
			t.Errorf("%s: %d bytes allocated by two engines and the refused load", tc.name, grown)
		}
	}
	f := filepath.Join(t.TempDir(), "model.safetensors")
	if err := fifo(f); err != nil {
		t.Fatal(err)
	}
	var ierr error
	within(t, 30*time.Second, func() {
		ierr = ImportSafetensors(f, Config{Stage: 2}, CPU(), []Param{{Name: "w", Count: 4, DType: FP32, Data: toDType(make([]float32, 4), FP32)}}, ImportOptions{})
	})
	if !errors.Is(ierr, ErrCheckpoint) || !strings.Contains(ierr.Error(), "not a regular file") {
		t.Errorf("ImportSafetensors of a FIFO: %v, want ErrCheckpoint, not a regular file", ierr)
	}
}

// hangingFS reads as the operating system's until its at-th read, which
// runs then calls abort: every later read blocks until release is closed,
// as on a device that stopped answering.
type hangingFS struct {
	osFS
	mu      sync.Mutex
	reads   int
	at      int
	abort   func()
	release chan struct{}
}

type hangingFile struct {
	ckptFile
	fs *hangingFS
}

func (h *hangingFS) Open(name string) (ckptFile, error) {
	f, err := h.osFS.Open(name)
	if err != nil {
		return nil, err
	}
	return hangingFile{f, h}, nil
}

func (f hangingFile) ReadAt(p []byte, off int64) (int, error) {
	h := f.fs
	h.mu.Lock()
	h.reads++
	n := h.reads
	h.mu.Unlock()
	switch {
	case n == h.at:
		defer h.abort()
	case n > h.at:
		<-h.release
	}
	return f.ckptFile.ReadAt(p, off)
}

// TestCheckpointAbortInterruptsLoad: an Abort while a load reads its files
// stops it before its next read (which would block for ever here): Load
// returns ErrAborted within a bound, and the peer's Load fails too.
func TestCheckpointAbortInterruptsLoad(t *testing.T) {
	c := ckptCase{stage: 2, dtype: BF16}
	dir := t.TempDir()
	ckptTrain(t, c, 0, 1, "", dir)
	for _, at := range []int{1, 3, 5} { // the trailer, the checks' reads, a section
		h := &hangingFS{at: at, release: make(chan struct{})}
		comms, _ := NewLocalGroupTimeout(2, 20*time.Second)
		var errs []error
		within(t, 60*time.Second, func() {
			errs = eachRank(2, func(rank int) error {
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
				if rank == 0 {
					e.files = h
					h.abort = func() { e.Abort(errors.New("stop the load")) }
				}
				_, err = e.Load(dir, LoadOptions{})
				return err
			})
		})
		close(h.release)
		if !errors.Is(errs[0], ErrAborted) {
			t.Errorf("read %d: rank 0: %v, want ErrAborted", at, errs[0])
		}
		if errs[1] == nil {
			t.Errorf("read %d: rank 1 loaded while rank 0 aborted", at)
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
// built from the saved parameters (fp32: the master is the parameters),
// its schedule starting from step 0 as a fresh engine's does;
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
		// a warmup: the rate of each step depends on the schedule's step,
		// which WeightsOnly starts afresh
		cfg.Optimizer.Schedule = NewLinearWarmup(4, 100)
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

// goldenCase is the run the golden checkpoints of every format version hold:
// fp16 with a loss scale moved by an overflow, coalesced windows, AdamW
// with amsgrad, ZeRO-2 on 2 ranks, saved after 3 steps.
var goldenCase = ckptCase{stage: 2, dtype: FP16, window: true}

// goldenDir is the golden checkpoint of format version v.
func goldenDir(v int) string { return fmt.Sprintf("testdata/checkpoint-v%d", v) }

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

// TestCheckpointGolden: the committed checkpoint of each format version
// (testdata/checkpoint-vN) loads, now and in every later version, into
// the state it was saved with (its digest, committed beside it), or is
// refused by its version with ErrCheckpoint. ZERO_WRITE_GOLDEN=1 writes the
// current version's anew (only when the format version changes: the older
// ones stay, under their own names).
func TestCheckpointGolden(t *testing.T) {
	for v := 1; v <= ckptVersion; v++ {
		dir := goldenDir(v)
		digests := filepath.Join(dir, "digest.json")
		if os.Getenv("ZERO_WRITE_GOLDEN") == "1" && v == ckptVersion {
			tmp := t.TempDir()
			saved := ckptTrain(t, goldenCase, 0, 3, "", tmp)
			latest, err := os.ReadFile(filepath.Join(tmp, ckptLatest))
			if err != nil {
				t.Fatal(err)
			}
			os.RemoveAll(dir)
			if err := os.Rename(filepath.Join(tmp, strings.TrimSpace(string(latest))), dir); err != nil {
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
		got := ckptTrain(t, goldenCase, 3, 3, dir, "")
		for rank := range got {
			if d := digestOf(got[rank]); !reflect.DeepEqual(d, want[rank]) {
				t.Errorf("version %d, rank %d: the golden checkpoint loads as\n%+v\nit was saved as\n%+v", v, rank, d, want[rank])
			}
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
	checkpointRun(b, hostBench) // benchenv_test.go; BenchmarkCUDACheckpoint from GPU memory
}

// ckptImage is a checkpoint directory read into memory, to be written
// back with some of it changed and every checksum recomputed: the
// manifest's own, each file's size and CRC32C in it, each footer's in its
// trailer, and each section's chunk CRCs. Only content is then wrong.
type ckptImage struct {
	m     ckptManifestData
	files []rankImage
}

// rankImage is a rank file: its footer and each section's bytes.
type rankImage struct {
	footer   ckptFooter
	sections map[string][]byte
}

func readCkptImage(t *testing.T, dir string) *ckptImage {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(dir, ckptManifest))
	if err != nil {
		t.Fatal(err)
	}
	im := &ckptImage{}
	if err := json.Unmarshal(b, &im.m); err != nil {
		t.Fatal(err)
	}
	for _, fi := range im.m.Files {
		im.files = append(im.files, readRankImage(t, filepath.Join(dir, fi.Name)))
	}
	return im
}

func readRankImage(t *testing.T, name string) rankImage {
	t.Helper()
	b, err := os.ReadFile(name)
	if err != nil {
		t.Fatal(err)
	}
	tr := b[len(b)-ckptTrailerLen:]
	at, n := binary.LittleEndian.Uint64(tr), binary.LittleEndian.Uint64(tr[8:])
	ri := rankImage{sections: map[string][]byte{}}
	if err := json.Unmarshal(b[at:at+n], &ri.footer); err != nil {
		t.Fatal(err)
	}
	for _, sec := range ri.footer.Sections {
		ri.sections[sec.Name] = slices.Clone(b[sec.Offset : sec.Offset+sec.Bytes])
	}
	return ri
}

// write writes the image into dir: each rank file's sections in its
// footer's order, packed, with their offsets and chunk CRCs recomputed,
// then forge (if set) edits the footer, then the footer, its trailer, and
// the manifest with every file's size and CRC32C, sealed.
func (im *ckptImage) write(t *testing.T, dir string, forge func(r int, f *ckptFooter)) {
	t.Helper()
	for r, ri := range im.files {
		var body []byte
		f := ri.footer
		f.Sections = nil
		for _, sec := range ri.footer.Sections {
			data, ok := ri.sections[sec.Name]
			if !ok {
				continue
			}
			sec.Offset, sec.Bytes, sec.CRC = int64(len(body)), int64(len(data)), nil
			for lo := 0; lo < len(data); lo += ckptChunk {
				sec.CRC = append(sec.CRC, crc32.Checksum(data[lo:min(lo+ckptChunk, len(data))], castagnoli))
			}
			f.Sections = append(f.Sections, sec)
			body = append(body, data...)
		}
		if forge != nil {
			forge(r, &f)
		}
		foot, err := json.Marshal(&f)
		if err != nil {
			t.Fatal(err)
		}
		var tr [ckptTrailerLen]byte
		binary.LittleEndian.PutUint64(tr[0:], uint64(len(body)))
		binary.LittleEndian.PutUint64(tr[8:], uint64(len(foot)))
		binary.LittleEndian.PutUint32(tr[16:], crc32.Checksum(foot, castagnoli))
		copy(tr[20:], ckptTrailerTag)
		whole := append(append(body, foot...), tr[:]...)
		if err := os.WriteFile(filepath.Join(dir, rankFileName(r)), whole, 0o644); err != nil {
			t.Fatal(err)
		}
		if r < len(im.m.Files) {
			im.m.Files[r].Bytes, im.m.Files[r].CRC = int64(len(whole)), crc32.Checksum(whole, castagnoli)
		}
	}
	data, err := sealManifest(&im.m)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, ckptManifest), data, 0o644); err != nil {
		t.Fatal(err)
	}
}

// TestCheckpointForgedContent: checkpoints whose checksums were all
// recomputed after a change, so that only their content is wrong, are
// refused before anything changes (ErrCheckpoint naming the file and what
// is wrong), the engine usable and unchanged: one more step gives the bits
// of a run that never tried the bad checkpoint. A rewrite that changes
// nothing loads (the rewriting is sound).
func TestCheckpointForgedContent(t *testing.T) {
	c := ckptCase{stage: 2, dtype: BF16}
	saved := func() string {
		base := t.TempDir()
		ckptTrain(t, c, 0, 2, "", base)
		latest, err := os.ReadFile(filepath.Join(base, ckptLatest))
		if err != nil {
			t.Fatal(err)
		}
		return filepath.Join(base, strings.TrimSpace(string(latest)))
	}
	at := saved()
	other := saved() // the same run saved again: another save, the same bits
	never := ckptTrain(t, c, 0, 1, "", "")
	member := func(b, i int, f func(*[2]int)) func(*ckptImage) {
		return func(im *ckptImage) { f(&im.m.Layout.Buckets[b].Members[i]) }
	}
	bucket := func(b int, f func(*ckptBucket)) func(*ckptImage) {
		return func(im *ckptImage) { f(&im.m.Layout.Buckets[b]) }
	}
	section := func(r int, name string, f func(*ckptSection)) func(int, *ckptFooter) {
		return func(rank int, ft *ckptFooter) {
			if rank != r {
				return
			}
			s, ok := ft.section(name)
			if !ok {
				t.Fatalf("no section %s", name)
			}
			f(s)
		}
	}
	for _, tc := range []struct {
		name  string
		edit  func(*ckptImage)
		forge func(int, *ckptFooter)
		file  string // the file the error names
		what  string // and what it says is wrong
		loads bool
	}{
		{name: "nothing changed", loads: true},
		{name: "a shard offset of -1000", edit: bucket(0, func(b *ckptBucket) { b.ShardOffset = -1000 }), file: ckptManifest, what: "bucket 0 has a shard"},
		{name: "a shard offset of +10^6", edit: bucket(1, func(b *ckptBucket) { b.ShardOffset += 1e6 }), file: ckptManifest, what: "bucket 1 has a shard"},
		{name: "a shard offset of 2^62", edit: bucket(2, func(b *ckptBucket) { b.ShardOffset = 1 << 62 }), file: ckptManifest, what: "bucket 2 has a shard"},
		{name: "a shard of 2^62", edit: bucket(0, func(b *ckptBucket) { b.Shard = 1 << 62 }), file: ckptManifest, what: "bucket 0 has a shard"},
		{name: "a member offset of 2^62", edit: member(0, 1, func(m *[2]int) { m[1] = 1 << 62 }), file: ckptManifest, what: "past the bucket"},
		{name: "a member offset of -1", edit: member(0, 0, func(m *[2]int) { m[1] = -1 }), file: ckptManifest, what: "bucket 0 places"},
		{name: "parameters 0 and 1 swapped in the layout", edit: func(im *ckptImage) {
			for b := range im.m.Layout.Buckets {
				for i, mb := range im.m.Layout.Buckets[b].Members {
					if mb[0] < 2 {
						im.m.Layout.Buckets[b].Members[i][0] = 1 - mb[0]
					}
				}
			}
		}, file: ckptManifest, what: "over the member before it"},
		{name: "parameters 0 and 1 swapped in the parameter list", edit: func(im *ckptImage) {
			im.m.Params[0], im.m.Params[1] = im.m.Params[1], im.m.Params[0]
		}, file: ckptManifest, what: "parameter 0"},
		{name: "a member moved inside its bucket", edit: member(0, 1, func(m *[2]int) { m[1] += 36 }), file: "rank-00000.bin", what: "other parameter ranges"},
		{name: "no buckets", edit: func(im *ckptImage) { im.m.Layout.Buckets = nil }, file: ckptManifest, what: "the buckets' shards hold 0 elements"},
		{name: "a parameter in two buckets", edit: func(im *ckptImage) {
			im.m.Layout.Buckets[0].Members = append(im.m.Layout.Buckets[0].Members, [2]int{1, 200})
		}, file: ckptManifest, what: "lies in another bucket too"},
		{name: "negative step counts", edit: func(im *ckptImage) { im.m.Optimizer.Steps[2] = -5 }, file: ckptManifest, what: "parameter 2 has taken -5"},
		{name: "a negative loss scale", edit: func(im *ckptImage) { im.m.Optimizer.Scaler.Scale = -1 }, file: ckptManifest, what: "a loss scale of -1"},
		{name: "a file named outside the checkpoint", edit: func(im *ckptImage) { im.m.Files[1].Name = "../rank-00001.bin" }, file: ckptManifest, what: "file 1 is"},
		{name: "a section offset of MaxInt64-10", forge: section(0, "m", func(s *ckptSection) { s.Offset = math.MaxInt64 - 10 }), file: "rank-00000.bin", what: `section "m"`},
		{name: "a master section of another dtype", forge: section(1, "master", func(s *ckptSection) { s.DType = "fp16" }), file: "rank-00001.bin", what: `section "master" holds "fp16"`},
		{name: "a master section 4 bytes long", edit: func(im *ckptImage) { im.files[0].sections["master"] = im.files[0].sections["master"][:4] }, file: "rank-00000.bin", what: `section "master" has 4 bytes`},
		{name: "a footer without its master section", edit: func(im *ckptImage) { delete(im.files[1].sections, "master") }, file: "rank-00001.bin", what: "no master section"},
		{name: "a section of another name", forge: section(0, "vmax", func(s *ckptSection) { s.Name = "w" }), file: "rank-00000.bin", what: `a section "w"`},
		{name: "a rank file of another save of this model", edit: func(im *ckptImage) {
			im.files[1] = readRankImage(t, filepath.Join(other, rankFileName(1)))
		}, file: "rank-00001.bin", what: "written by another save"},
		{name: "a rank file listed as another rank's", edit: func(im *ckptImage) { im.files[0].footer.Rank = 1 }, file: "rank-00000.bin", what: "rank 1 of 2"},
		{name: "the save's identity missing", edit: func(im *ckptImage) { im.m.Save = "" }, file: ckptManifest, what: "the save's identity"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			d := filepath.Join(t.TempDir(), "ck")
			if err := os.CopyFS(d, os.DirFS(at)); err != nil {
				t.Fatal(err)
			}
			im := readCkptImage(t, d)
			if tc.edit != nil {
				tc.edit(im)
			}
			im.write(t, d, tc.forge)
			if tc.loads {
				ckptRun{c: c, from: -1, to: -1, load: d}.run(t)
				return
			}
			errs, after := refusedLoad(t, c, 2, d, nil)
			for rank, err := range errs {
				if !errors.Is(err, ErrCheckpoint) || errors.Is(err, ErrCollective) {
					t.Fatalf("rank %d: %v, want ErrCheckpoint and an unchanged engine", rank, err)
				}
			}
			all := errors.Join(errs...).Error()
			if !strings.Contains(all, tc.file) || !strings.Contains(all, tc.what) {
				t.Errorf("%v; want an error naming %s and saying %q", errors.Join(errs...), tc.file, tc.what)
			}
			for rank := range after {
				if d := never[rank].diff(after[rank]); d != "" {
					t.Errorf("rank %d: the step after the refusal differs from a run that never tried: %s", rank, d)
				}
			}
			t.Logf("%v", errs[0])
		})
	}
}

// TestCheckpointLoadBoundsAllocation: manifests with a correct checksum
// that declare a layout far larger than their files (8,192 ranks, 3,000
// parameters, each spread over every rank) are refused, by Load's checks
// and by CheckpointToSafetensors, before anything is allocated for their
// numbers: the heap grows by at most 64 times the manifest plus 1 MiB
// (it grew by 4.4 GB when the loader listed every piece first).
func TestCheckpointLoadBoundsAllocation(t *testing.T) {
	const world, params, count = 8192, 3000, 8192
	build := func(overlap bool) ckptManifestData {
		m := ckptManifestData{Format: ckptFormat, Version: ckptVersion, Save: formatSaveID(1), Stage: 2,
			Optimizer: optCheckpoint{Kind: "adamw", Steps: make([]int, params), Scaler: scalerState{Scale: 1, LastOverflow: -1}}}
		m.Layout.World = world
		for p := range params {
			m.Params = append(m.Params, ckptParam{Name: fmt.Sprint("w", p), Count: count, DType: "fp32"})
			b := ckptBucket{Shard: 1, ShardOffset: p, Members: [][2]int{{p, 0}}}
			if overlap { // the issue's: every member in one bucket, all at 0
				if p > 0 {
					m.Layout.Buckets[0].Members = append(m.Layout.Buckets[0].Members, [2]int{p, 0})
					continue
				}
			}
			m.Layout.Buckets = append(m.Layout.Buckets, b)
			m.Layout.ShardElems++
		}
		for r := range world {
			m.Files = append(m.Files, ckptFileInfo{Name: rankFileName(r), Rank: r, Bytes: 1 << 30})
		}
		return m
	}
	for _, tc := range []struct {
		name    string
		overlap bool
		files   bool // every rank file there, 24 bytes long
	}{{"overlapping members", true, false}, {"files missing", false, false}, {"files shorter than listed", false, true}} {
		dir := t.TempDir()
		m := build(tc.overlap)
		data, err := sealManifest(&m)
		if err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(dir, ckptManifest), data, 0o644); err != nil {
			t.Fatal(err)
		}
		if tc.files {
			for r := range world {
				if err := os.WriteFile(filepath.Join(dir, rankFileName(r)), make([]byte, 24), 0o644); err != nil {
					t.Fatal(err)
				}
			}
		}
		limit := 64*uint64(len(data)) + 1<<20
		before := heapAllocs()
		err = checkpointToSafetensors(osFS{}, dir, filepath.Join(t.TempDir(), "out.safetensors"), ExportOptions{})
		grown := heapAllocs() - before
		t.Logf("%s: %d bytes of manifest, %d allocated: %v", tc.name, len(data), grown, err)
		if !errors.Is(err, ErrCheckpoint) {
			t.Errorf("%s: %v, want ErrCheckpoint", tc.name, err)
		}
		if grown > limit {
			t.Errorf("%s: %d bytes allocated for a %d-byte manifest, more than %d", tc.name, grown, len(data), limit)
		}
		// an engine's load runs the same checks on its own parameters
		ps := make([]Param, params)
		for p := range ps {
			ps[p] = Param{Name: fmt.Sprint("w", p), Count: count, DType: FP32}
		}
		before = heapAllocs()
		_, err = checkLayout(dir, m, ps)
		if err == nil {
			ld := newLoader(newCkptJob(ckptSnapshot{fs: osFS{}, params: ps, plan: newPlan(ps, 1<<20, 1, 64)}), dir, m, nil)
			ld.x, _ = checkLayout(dir, m, ps)
			err = ld.verify()
			ld.close()
		}
		if grown := heapAllocs() - before; !errors.Is(err, ErrCheckpoint) || grown > limit {
			t.Errorf("%s: the load's checks: %v, %d bytes allocated (at most %d)", tc.name, err, grown, limit)
		}
	}
}

// TestCheckpointTwoJobsOneDirectory: two jobs (two groups of two ranks)
// save into one directory at once, repeatedly. Each save either succeeds
// or is refused, on every rank of its job, with an error that says another
// save holds the directory; every checkpoint a save reported is there at
// the end, complete, with its job's client bytes, and latest names a
// complete one. (Before the lock, half the runs ended with no checkpoint
// at all, the errors blaming rename.)
func TestCheckpointTwoJobsOneDirectory(t *testing.T) {
	c := ckptCase{stage: 2, dtype: BF16}
	dir := t.TempDir()
	const saves = 8
	var mu sync.Mutex
	saved := map[string]int{} // client bytes of rank 0 → saves reported
	refused := 0
	job := func(name string) error {
		comms, _ := NewLocalGroupTimeout(2, 60*time.Second)
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
			for i := range saves {
				client := fmt.Sprintf("%s save %d rank %d", name, i, rank)
				err := e.Save(dir, SaveOptions{Client: []byte(client), Keep: 2 * saves})
				var outcome error
				switch {
				case err == nil:
					if rank == 0 {
						mu.Lock()
						saved[client]++
						mu.Unlock()
					}
				case errors.Is(err, ErrCheckpoint) && !errors.Is(err, ErrCollective) && (errors.Is(err, errLockHeld) || strings.Contains(err.Error(), "see that rank's error")):
					if rank == 0 {
						if !errors.Is(err, errLockHeld) {
							outcome = fmt.Errorf("save %d: rank 0 refused without naming the other writer: %w", i, err)
						}
						mu.Lock()
						refused++
						mu.Unlock()
					}
				default:
					outcome = fmt.Errorf("save %d: %w", i, err)
				}
				if outcome != nil {
					return outcome
				}
			}
			return nil
		})
		return errors.Join(errs...)
	}
	errs := eachRank(2, func(j int) error { return job(fmt.Sprint("job", j)) })
	if err := errors.Join(errs...); err != nil {
		t.Fatal(err)
	}
	// every reported save is there, complete, with its client bytes
	found := map[string]int{}
	ents, _ := os.ReadDir(dir)
	for _, e := range ents {
		if !e.IsDir() {
			continue
		}
		at := filepath.Join(dir, e.Name())
		_, m, err := findCheckpoint(osFS{}, at)
		if err != nil {
			t.Errorf("%s: %v", e.Name(), err)
			continue
		}
		rr, err := openRankFile(osFS{}, filepath.Join(at, rankFileName(0)), m.Files[0].Bytes, nil)
		if err != nil {
			t.Errorf("%s: %v", e.Name(), err)
			continue
		}
		sec, _ := rr.footer.section("client")
		b := make([]byte, sec.Bytes)
		if err := rr.read(sec, 0, b); err != nil {
			t.Error(err)
		}
		rr.close()
		found[string(b)]++
	}
	if !maps.Equal(found, saved) {
		t.Errorf("the directory holds the checkpoints %v; the saves reported %v", found, saved)
	}
	if _, _, err := findCheckpoint(osFS{}, dir); err != nil {
		t.Errorf("latest: %v", err)
	}
	if _, err := os.Stat(filepath.Join(dir, ckptLockName)); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("the lock is still there after every save returned: %v", err)
	}
	t.Logf("%d saves committed, %d refused", len(saved), refused)
}

// blockingFS is the operating system's file layer until the first
// creation of a rank file, where it says so on held and blocks for ever.
type blockingFS struct {
	osFS
	held chan<- struct{}
	once sync.Once
}

func (b *blockingFS) Create(name string) (ckptFile, error) {
	if strings.Contains(name, "rank-") {
		b.once.Do(func() { close(b.held) })
		select {}
	}
	return b.osFS.Create(name)
}

// TestCheckpointStaleLock: a lock whose holder is gone is broken by the
// next save: a process killed (SIGKILL) in the middle of a save, with the
// lock held, leaves the directory loadable (the checkpoint before) and
// the next save there succeeds; a lock from another host whose heartbeat
// stopped is broken after the lease; one whose heartbeat moves, or whose
// process on this host runs, is refused (ErrCheckpoint naming its holder).
func TestCheckpointStaleLock(t *testing.T) {
	c := ckptCase{stage: 2, dtype: BF16}
	if dir := os.Getenv("ZERO_LOCK_CHILD"); dir != "" { // the process killed mid-save
		held := make(chan struct{})
		go func() {
			<-held
			fmt.Println("holding the lock")
		}()
		ckptRun{c: c, from: 0, to: 1, edit: func(e *Engine) error {
			if e.Rank() == 0 { // rank 1 waits for it in the save's collective
				e.files = &blockingFS{held: held}
			}
			return nil
		}, save: dir}.run(t)
		t.Fatal("the save returned")
	}
	dir := t.TempDir()
	before := ckptTrain(t, c, 0, 2, "", dir)
	cmd := exec.Command(os.Args[0], "-test.run", "^TestCheckpointStaleLock$")
	cmd.Env = append(os.Environ(), "ZERO_LOCK_CHILD="+dir)
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	line := make(chan string, 1)
	go func() {
		sc := bufio.NewScanner(out)
		for sc.Scan() {
			if strings.Contains(sc.Text(), "holding the lock") {
				line <- sc.Text()
			}
		}
		close(line)
	}()
	select {
	case _, ok := <-line:
		if !ok {
			t.Fatal("the child ended without holding the lock")
		}
	case <-time.After(120 * time.Second):
		t.Fatal("the child did not take the lock within 120 s")
	}
	lock, err := os.ReadFile(filepath.Join(dir, ckptLockName))
	if err != nil {
		t.Fatalf("no lock while the child saves: %v", err)
	}
	cmd.Process.Kill()
	cmd.Wait()
	// the resume: the checkpoint before loads, and the next save succeeds
	resumed := ckptRun{c: c, from: 2, to: 3, load: dir, save: dir}.run(t)
	for rank := range resumed {
		if d := before[rank].diff(resumed[rank]); d == "" {
			t.Errorf("rank %d: the resumed step changed nothing", rank)
		}
	}
	if _, err := os.Stat(filepath.Join(dir, ckptLockName)); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("the killed save's lock is still there: %v", err)
	}
	t.Logf("broke the lock of the killed process: %s", lock)

	// a lock of another host: broken once its beat has stood still for
	// the lease; refused while the beat moves
	defer func(beat, lease time.Duration) { ckptLockBeat, ckptLockLease = beat, lease }(ckptLockBeat, ckptLockLease)
	ckptLockBeat, ckptLockLease = 20*time.Millisecond, 200*time.Millisecond
	other := saveLockData{Save: formatSaveID(7), Host: "elsewhere", Boot: "x", PID: 1, Start: 1}
	write := func(d saveLockData) {
		b, _ := json.Marshal(&d)
		if err := os.WriteFile(filepath.Join(dir, ckptLockName), b, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	saveOnce := func() []error {
		return refusedSave(t, c, dir)
	}
	write(other)
	if err := errors.Join(saveOnce()...); err != nil {
		t.Errorf("a lock of another host whose beat stopped: %v", err)
	}
	write(other)
	stop := make(chan struct{})
	go func() {
		for d := other; ; d.Beat++ {
			select {
			case <-stop:
				return
			case <-time.After(5 * time.Millisecond):
				write(d)
			}
		}
	}()
	errs := saveOnce()
	close(stop)
	if !errors.Is(errs[0], errLockHeld) || !strings.Contains(errs[0].Error(), "elsewhere") || errors.Is(errs[0], ErrCollective) {
		t.Errorf("a lock of another host whose beat moves: %v, want the holder named, ErrCheckpoint", errs[0])
	}
	// a lock of a running process of this host (this test's parent)
	me := thisProcess()
	parent := saveLockData{Save: formatSaveID(8), Host: me.Host, Boot: me.Boot, PID: os.Getppid(), Start: processStart(os.Getppid())}
	write(parent)
	if errs := saveOnce(); !errors.Is(errs[0], errLockHeld) {
		t.Errorf("a lock of a running process: %v, want it refused", errs[0])
	}
	os.Remove(filepath.Join(dir, ckptLockName))
}

// pausingFS is the operating system's file layer whose new files (a
// save's lock) stop in Write or in Close, as pauseIn says, until resume
// is closed; paused is closed when one stops.
type pausingFS struct {
	osFS
	pauseIn        string // "write" or "close"
	paused, resume chan struct{}
}

type pausingFile struct {
	ckptFile
	fs *pausingFS
}

func (p *pausingFS) CreateNew(name string) (ckptFile, error) {
	f, err := p.osFS.CreateNew(name)
	if err != nil {
		return nil, err
	}
	return pausingFile{f, p}, nil
}

func (f pausingFile) pause(in string) {
	if f.fs.pauseIn == in {
		close(f.fs.paused)
		<-f.fs.resume
	}
}

func (f pausingFile) Write(b []byte) (int, error) { f.pause("write"); return f.ckptFile.Write(b) }
func (f pausingFile) Close() error                { f.pause("close"); return f.ckptFile.Close() }

// TestCheckpointLockBeingWritten: a lock another save of this process is
// still writing (the file there, empty, or written and not yet closed)
// is that save's, held, not a dead save's to break; an unreadable lock
// that stays so for a lease is a dead writer's, and broken.
func TestCheckpointLockBeingWritten(t *testing.T) {
	for _, in := range []string{"write", "close"} {
		dir := t.TempDir()
		pfs := &pausingFS{pauseIn: in, paused: make(chan struct{}), resume: make(chan struct{})}
		first, second := formatSaveID(1), formatSaveID(2)
		var taken *saveLock
		var takeErr error
		done := make(chan struct{})
		go func() {
			defer close(done)
			taken, takeErr = acquireSaveLock(pfs, dir, first)
		}()
		<-pfs.paused
		refused := make(chan error, 1)
		go func() {
			l, err := acquireSaveLock(osFS{}, dir, second)
			if err == nil {
				l.release()
			}
			refused <- err
		}()
		time.Sleep(20 * time.Millisecond) // for the second save to read the lock mid-write (had it not, it finds it finished: held all the same)
		close(pfs.resume)
		<-done
		if takeErr != nil {
			t.Fatalf("paused in %s: the first save: %v", in, takeErr)
		}
		if err := <-refused; !errors.Is(err, errLockHeld) {
			t.Errorf("paused in %s: the second save while the first wrote its lock: %v, want it refused as held", in, err)
		}
		if err := checkSaveLock(osFS{}, dir, first); err != nil {
			t.Errorf("paused in %s: the first save's lock after the second tried: %v", in, err)
		}
		if err := taken.release(); err != nil {
			t.Fatal(err)
		}
	}

	defer func(beat, lease time.Duration) { ckptLockBeat, ckptLockLease = beat, lease }(ckptLockBeat, ckptLockLease)
	ckptLockBeat, ckptLockLease = 20*time.Millisecond, 200*time.Millisecond
	dir := t.TempDir()
	if err := os.WriteFile(filepath.Join(dir, ckptLockName), []byte(`{"save":"00`), 0o644); err != nil {
		t.Fatal(err)
	}
	l, err := acquireSaveLock(osFS{}, dir, formatSaveID(3))
	if err != nil {
		t.Fatalf("a lock its writer died writing: %v, want it broken after the lease", err)
	}
	if err := l.release(); err != nil {
		t.Fatal(err)
	}
}

// refusedSave saves engines of c into dir once, on two ranks, and returns
// each rank's error; a rank whose engine a refused save changed, or lost,
// gets an error that says so instead.
func refusedSave(t *testing.T, c ckptCase, dir string) []error {
	t.Helper()
	comms, _ := NewLocalGroupTimeout(2, 20*time.Second)
	var errs []error
	within(t, 60*time.Second, func() {
		errs = eachRank(2, func(rank int) error {
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
			err = e.Save(dir, SaveOptions{Keep: 100})
			if uerr := e.usable("after Save"); err != nil && uerr != nil {
				return fmt.Errorf("the engine after a refused save: %w (%w)", uerr, err)
			}
			return err
		})
	})
	return errs
}

// TestCheckpointLockIsTheSaves: a rank checks the directory's lock against
// its save's identity alone: a lock of its save taken by another process
// on another host (rank 0's, under MPI) is its own; one of another save,
// even taken by this very process, is not.
func TestCheckpointLockIsTheSaves(t *testing.T) {
	dir := t.TempDir()
	write := func(d saveLockData) {
		b, _ := json.Marshal(&d)
		if err := os.WriteFile(filepath.Join(dir, ckptLockName), b, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	id := formatSaveID(42)
	write(saveLockData{Save: id, Host: "rank0-node", Boot: "b", PID: 1234, Start: 99})
	if err := checkSaveLock(osFS{}, dir, id); err != nil {
		t.Errorf("its own save's lock, taken by rank 0's process elsewhere: %v", err)
	}
	me := thisProcess()
	me.Save = formatSaveID(43)
	write(me)
	if err := checkSaveLock(osFS{}, dir, id); !errors.Is(err, errLockHeld) || !errors.Is(err, ErrCheckpoint) {
		t.Errorf("another save's lock, of this process: %v, want it refused", err)
	}
	os.Remove(filepath.Join(dir, ckptLockName))
	if err := checkSaveLock(osFS{}, dir, id); !errors.Is(err, ErrCheckpoint) || !strings.Contains(err.Error(), "every rank shares") {
		t.Errorf("no lock (a rank that does not see rank 0's directory): %v, want it refused, naming the shared directory it needs", err)
	}
}

// TestCheckpointKeepPrunes: after each save, the directory holds the
// newest Keep complete checkpoints (2 at Keep 0), by step and then by the
// suffix of a second save at the same step, and no incomplete one.
func TestCheckpointKeepPrunes(t *testing.T) {
	c := ckptCase{stage: 2, dtype: BF16}
	for _, keep := range []int{0, 1, 3} {
		dir := t.TempDir()
		// an incomplete checkpoint no load takes: every save clears it
		if err := os.MkdirAll(filepath.Join(dir, ckptName(0, 5)), 0o755); err != nil {
			t.Fatal(err)
		}
		var names []string // every checkpoint saved, oldest first
		for _, at := range []int{1, 2, 2, 3, 4} {
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
				e.stepIndex = at // the name of the checkpoint: its step
				return e.Save(dir, SaveOptions{Keep: keep})
			})
			if err := errors.Join(errs...); err != nil {
				t.Fatal(err)
			}
			k := 0
			for slices.Contains(names, ckptName(at, k)) {
				k++
			}
			names = append(names, ckptName(at, k))
			want := names[max(0, len(names)-cmp.Or(keep, 2)):]
			var got []string
			ents, _ := os.ReadDir(dir)
			for _, e := range ents {
				if e.IsDir() {
					got = append(got, e.Name())
				}
			}
			slices.SortFunc(got, compareCkptNames)
			if !slices.Equal(got, want) {
				t.Fatalf("Keep %d after saving %v: the directory holds %v, want %v", keep, names, got, want)
			}
		}
	}
}

// TestCheckpointClientAcrossChunks: client bytes longer than a chunk (8
// MiB and more, written in pieces that cross chunk boundaries) come back
// whole from Load, and every chunk's own CRC in the rank file checks out
// when the sections are read without the whole file's check.
func TestCheckpointClientAcrossChunks(t *testing.T) {
	c := ckptCase{stage: 2, dtype: BF16}
	dir := t.TempDir()
	rng := testRNG(t)
	clients := make([][]byte, 2)
	for r := range clients {
		clients[r] = make([]byte, ckptChunk+ckptChunk/2+12345*(r+1))
		for i := range clients[r] {
			clients[r][i] = byte(rng.Uint32())
		}
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
		if err := e.Save(dir, SaveOptions{Client: clients[rank]}); err != nil {
			return err
		}
		rep, err := e.Load(dir, LoadOptions{})
		if err != nil {
			return err
		}
		if back := rep.Client; !bytes.Equal(back, clients[rank]) {
			return fmt.Errorf("rank %d: %d client bytes back, first difference at %d", rank, len(back), firstByteDiff(back, clients[rank]))
		}
		return nil
	})
	if err := errors.Join(errs...); err != nil {
		t.Fatal(err)
	}
	at, m, err := findCheckpoint(osFS{}, dir)
	if err != nil {
		t.Fatal(err)
	}
	for r, fi := range m.Files {
		rr, err := openRankFile(osFS{}, filepath.Join(at, fi.Name), fi.Bytes, nil)
		if err != nil {
			t.Fatal(err)
		}
		if err := rr.verify(); err != nil { // every chunk of every section
			t.Errorf("rank %d: %v", r, err)
		}
		sec, _ := rr.footer.section("client")
		if len(sec.CRC) != 2 {
			t.Errorf("rank %d: %d chunk checksums for %d client bytes, want 2", r, len(sec.CRC), sec.Bytes)
		}
		rr.close()
	}
}

// TestCheckpointSectionReadBounds: a read of a section that starts before
// it or runs past its end is refused, whether or not the file was checked
// whole (it would read the next section's bytes, or past the chunk list),
// and a read inside it is not.
func TestCheckpointSectionReadBounds(t *testing.T) {
	c := ckptCase{stage: 2, dtype: BF16}
	dir := t.TempDir()
	ckptTrain(t, c, 0, 1, "", dir)
	at, m, err := findCheckpoint(osFS{}, dir)
	if err != nil {
		t.Fatal(err)
	}
	for _, verified := range []bool{false, true} {
		rr, err := openRankFile(osFS{}, filepath.Join(at, m.Files[0].Name), m.Files[0].Bytes, nil)
		if err != nil {
			t.Fatal(err)
		}
		rr.verified = verified
		sec, _ := rr.footer.section("master")
		for _, rd := range []struct {
			off  int64
			n    int
			fits bool
		}{{0, 8, true}, {sec.Bytes - 8, 8, true}, {sec.Bytes - 4, 8, false}, {sec.Bytes, 1, false}, {-4, 8, false}, {sec.Bytes + 100, 4, false}} {
			err := rr.read(sec, rd.off, make([]byte, rd.n))
			if fits := err == nil; fits != rd.fits {
				t.Errorf("verified %v: a read of %d bytes at %d of a %d-byte section: %v", verified, rd.n, rd.off, sec.Bytes, err)
			}
			if err != nil && !errors.Is(err, ErrCheckpoint) {
				t.Errorf("verified %v: %v, want ErrCheckpoint", verified, err)
			}
		}
		rr.close()
	}
}

// TestCheckpointOverLongerLeftovers: files written over longer leftovers
// of a crashed run (a latest.tmp, an export's .tmp) hold exactly what was
// written: the load and the export are whole.
func TestCheckpointOverLongerLeftovers(t *testing.T) {
	c := ckptCase{stage: 2, dtype: BF16}
	dir := t.TempDir()
	junk := bytes.Repeat([]byte("leftover of a crashed run "), 200)
	if err := os.WriteFile(filepath.Join(dir, ckptLatest+".tmp"), junk, 0o644); err != nil {
		t.Fatal(err)
	}
	saved := ckptTrain(t, c, 0, 2, "", dir)
	loaded := ckptTrain(t, c, -1, -1, dir, "")
	for rank := range saved {
		if d := saved[rank].diff(loaded[rank]); d != "" {
			t.Errorf("rank %d: the load after a save over a longer latest.tmp: %s", rank, d)
		}
	}
	out := filepath.Join(t.TempDir(), "model.safetensors")
	if err := os.WriteFile(out+".tmp", bytes.Repeat(junk, 100), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := CheckpointToSafetensors(dir, out, ExportOptions{}); err != nil {
		t.Fatal(err)
	}
	f, size, err := openRegular(out)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if _, err := readSTHeader(f, size, out); err != nil {
		t.Errorf("the export over a longer leftover: %v", err)
	}
}

// TestCheckpointClientWhereTheShardLiesElsewhere: a rank of the saving run
// whose new shard, after a reshard, lies only in other ranks' files still
// gets its own client bytes (its own file holds them). The layouts are
// searched for such a rank, so the case cannot silently disappear.
func TestCheckpointClientWhereTheShardLiesElsewhere(t *testing.T) {
	c := ckptCase{stage: 2, dtype: BF16}
	ps := make([]Param, len(ckptSizes))
	for p, n := range ckptSizes {
		ps[p] = Param{Name: fmt.Sprint("w", p), Count: n, DType: c.dtype}
	}
	// the layout a plan writes, as a checked index
	index := func(world, bucket, align int) *ckptIndex {
		plan := newPlan(ps, bucket, world, align)
		m := ckptManifestData{Layout: ckptLayout{World: world, ShardElems: plan.ShardElems}}
		for r := range world {
			m.Files = append(m.Files, ckptFileInfo{Name: rankFileName(r), Rank: r, Bytes: ckptTrailerLen})
		}
		for _, bp := range plan.Buckets {
			b := ckptBucket{Shard: bp.Shard, ShardOffset: bp.ShardOffset}
			for _, p := range bp.Params {
				b.Members = append(b.Members, [2]int{p, plan.ParamOffset[p]})
			}
			m.Layout.Buckets = append(m.Layout.Buckets, b)
		}
		x, err := checkLayout("", m, ps)
		if err != nil {
			t.Fatal(err)
		}
		return x
	}
	var from, to reshardEnd
	rank := -1
search:
	for _, sw := range []int{2, 3, 4} {
		for _, sb := range []int{300, 1024, 4096} {
			x := index(sw, sb, 64)
			for _, nw := range []int{2, 3, 4} {
				for _, nb := range []int{300, 1024, 4096, 1 << 20} {
					plan := newPlan(ps, nb, nw, 8)
					for r := 0; r < min(sw, nw); r++ {
						own := false
						for p := range ps {
							if rg := plan.shardRange(p, r); rg.Count > 0 {
								x.each(p, rg.ParamOffset, rg.Count, func(src, _, _, _ int) error {
									own = own || src == r
									return nil
								})
							}
						}
						if !own {
							from, to, rank = reshardEnd{sw, 2, sb, 64, false}, reshardEnd{nw, 2, nb, 8, false}, r
							break search
						}
					}
				}
			}
		}
	}
	if rank < 0 {
		t.Fatal("no layout puts a rank's new shard only in other ranks' files")
	}
	t.Logf("%v → %v: rank %d's new shard lies only in other ranks' files", from, to, rank)
	dir := t.TempDir()
	from.run(t, ckptRun{c: c, from: 0, to: 2, save: dir})
	to.run(t, ckptRun{c: c, from: 2, to: 2, load: dir, savedWorld: from.world}) // checks every rank's client bytes
}

// TestLossScaleOfFormat1: a checkpoint of format version 1 saved the scale
// each backward carried; format 2 saves the scaler's, that of the step's
// mean loss. A format-1 fp16 scale X saved with Grads.AccumSteps 2 loads as
// a scaler at 2X, so each backward carries X again; the same X in a
// format-2 manifest loads as the scaler's X, each backward carrying X/2.
// At AccumSteps 0 (counted) both formats' X is what each backward carries.
// Loaded at another G', the scaler's S is the same (the saved G converts
// a format-1 X), and each backward carries S/G' (S where G' is counted).
func TestLossScaleOfFormat1(t *testing.T) {
	for _, c := range []struct {
		accum, load, version int
		want                 float64 // the scaler's S after the load of X = 96
	}{{2, 2, 1, 192}, {2, 2, 2, 96}, {0, 0, 1, 96}, {0, 0, 2, 96},
		{2, 4, 1, 192}, {2, 0, 1, 192}, {0, 4, 1, 96}, {4, 2, 1, 384}, {2, 4, 2, 96}, {4, 0, 2, 96}} {
		dir := t.TempDir()
		config := func(accum int) Config {
			return Config{Stage: 2, BucketBytes: 512, Grads: GradPolicy{AccumSteps: accum},
				Precision: PrecisionPolicy{LossScale: LossScale{Initial: 256, Hysteresis: 1}},
				Optimizer: OptimizerPolicy{Groups: []Optimizer{NewAdamW(0.01)}}}
		}
		train := func(load bool) []error {
			comms, _ := NewLocalGroupTimeout(2, 20*time.Second)
			return eachRank(2, func(rank int) error {
				ps, _ := smallModel(FP16, 0.5)
				cfg := config(c.accum)
				if load {
					cfg = config(c.load)
				}
				e, err := New(cfg, comms[rank], ps)
				if err != nil {
					return err
				}
				defer e.Close()
				if load {
					if _, err := e.Load(dir, LoadOptions{}); err != nil {
						return err
					}
					perBackward := c.want / float64(max(1, c.load))
					if s, got := e.opt.scaler.scale, e.LossScale(); s != c.want || got != perBackward {
						return fmt.Errorf("saved at AccumSteps %d in format %d, loaded at %d: the scaler's S is %v, each backward carries %v; want %v and %v", c.accum, c.version, c.load, s, got, c.want, perBackward)
					}
					return nil
				}
				s := NewHostStream()
				defer s.Close()
				for range max(1, c.accum) {
					for p := 2; p >= 0; p-- {
						g := newTBuf(FP16, ps[p].Count)
						for i := range g.len() {
							g.set(i, float32(0.25*e.LossScale()))
						}
						if _, err := e.GradReady(p, g.t(), s); err != nil {
							return err
						}
					}
					if err := e.EndBackward(); err != nil {
						return err
					}
				}
				if err := e.Step(); err != nil {
					return err
				}
				return e.Save(dir, SaveOptions{})
			})
		}
		everyRankIs(t, "the run saved", train(false), nil)
		manifests, err := filepath.Glob(filepath.Join(dir, "*", ckptManifest))
		if err != nil || len(manifests) != 1 {
			t.Fatalf("manifests %v: %v", manifests, err)
		}
		// rewritten as format c.version wrote it (no save identity below 2),
		// every checksum recomputed
		im := readCkptImage(t, filepath.Dir(manifests[0]))
		im.m.Version, im.m.Optimizer.Scaler.Scale = c.version, 96
		if c.version < 2 {
			im.m.Save = ""
		}
		im.write(t, filepath.Dir(manifests[0]), func(_ int, f *ckptFooter) {
			f.Version = c.version
			if c.version < 2 {
				f.Save = ""
			}
		})
		everyRankIs(t, fmt.Sprintf("AccumSteps %d, format %d, loaded at %d", c.accum, c.version, c.load), train(true), nil)
	}
}

// splitEnd is one side of a resume at another batch split: W ranks of G
// backwards a step (Grads.AccumSteps G), the window's dtype (0: fp32).
type splitEnd struct {
	world, accum int
	windowDType  DType
}

func (e splitEnd) String() string {
	return fmt.Sprintf("W%d×%d/window-dtype=%v", e.world, e.accum, cmp.Or(e.windowDType, FP32))
}

// run is ckptRun r on this end's engines; grads, if set, gets rank 0's
// reduced gradient (FullGrads) after each step st at grads[st].
func (e splitEnd) run(t *testing.T, r ckptRun, grads [][][]float32) []ckptState {
	t.Helper()
	r.world, r.accum = e.world, e.accum
	r.config = func(cfg *Config) { cfg.Grads.AccumSteps, cfg.Window.DType = e.accum, e.windowDType }
	if grads != nil {
		r.afterStep = func(e *Engine, rank, st int) error {
			full, err := e.FullGrads() // a collective: every rank
			if rank == 0 {
				grads[st] = full
			}
			return err
		}
	}
	return r.run(t)
}

// ulpsApart is how many steps of fp32 lie between a and b (0: equal).
func ulpsApart(a, b float32) int64 {
	key := func(x float32) int64 {
		u := int64(math.Float32bits(x))
		if u>>31 != 0 {
			return -(u & (1<<31 - 1))
		}
		return u
	}
	d := key(a) - key(b)
	return max(d, -d)
}

// TestResumeAtAnotherBatchSplit: a run of W=2 ranks with 2 backwards a
// step (Grads.AccumSteps 2), saved after 3 steps, resumes at W=1 with 4
// (AccumSteps 4), the same global batch of the same per-sample gradients
// split otherwise, and a run of W=1×4 resumes at W=2×2; at every stage,
// in fp32, with gradients of one sign per element (seeded). Against the
// run that never stopped (also with offload at stage 2):
//   - each step's reduced gradient (FullGrads) within 2 ulp: the four
//     terms lie in [0.5, 1), so the sum lies in [2, 4); summed in pairs and
//     then together (W=2×2: the wire's sum of two ranks' terms, or of two
//     local sums) it is off by at most 2^-24 + 2^-24 + 2^-23 = 1 ulp of the
//     sum, one term at a time (W=1×4) by at most 2^-24 + 2^-23 + 2^-23 =
//     1.25 ulp; both are multiples of an ulp, so at most 2 apart, and the
//     mean's 1/4 and 1/W are exact;
//   - each gradient within the float64 reference's bound, and the master
//     after 3 more steps within twice each run's bound from the float64
//     reference (ckptReferenceRun; the triangle inequality).
//
// Two more resumes change Window.DType (fp32 → bf16 at stage 1, whose own
// local sums follow it, with W=2×2 → W=1×4; bf16 → fp32 in a stage-2
// coalesced window at W=2×2), in bf16, where the bound on the gradients is
// the reference's. The report names the world size, the accumulation and
// the window dtype among the changed settings with both values, the
// checkpoint's step, world and stage, and the ranks the reshard added get
// rank 0's client bytes (ckptRun checks them).
func TestResumeAtAnotherBatchSplit(t *testing.T) {
	seed := uint64(testSeed(t))
	const at, steps = 3, 6
	w2, w1 := splitEnd{world: 2, accum: 2}, splitEnd{world: 1, accum: 4}
	type split struct {
		stage           int
		dtype           DType
		window, offload bool
		from, to        splitEnd
	}
	var cases []split
	for stage := 1; stage <= 3; stage++ {
		cases = append(cases, split{stage, FP32, false, false, w2, w1}, split{stage, FP32, false, false, w1, w2})
	}
	cases = append(cases, split{2, FP32, false, true, w2, w1},
		split{1, BF16, false, false, w2, splitEnd{world: 1, accum: 4, windowDType: BF16}},
		split{2, BF16, true, false, splitEnd{world: 2, accum: 2, windowDType: BF16}, w2})
	worstULP, worstParam, worstGrad := int64(0), 0.0, 0.0
	ulpCount := map[int64]int{}
	for _, sp := range cases {
		c := ckptCase{stage: sp.stage, dtype: sp.dtype, window: sp.window, offload: sp.offload, oneSign: true, seed: seed}
		name := fmt.Sprintf("%v %v→%v", c, sp.from, sp.to)
		dir := t.TempDir()
		wholeGrads, resumedGrads := make([][][]float32, steps), make([][][]float32, steps)
		whole := sp.from.run(t, ckptRun{c: c, from: 0, to: steps}, wholeGrads)
		saved := sp.from.run(t, ckptRun{c: c, from: 0, to: at, save: dir}, nil)
		report := func(rank int, r LoadReport) error {
			want := map[string][2]string{}
			for path, v := range map[string][2]string{"World": {fmt.Sprint(sp.from.world), fmt.Sprint(sp.to.world)},
				"Grads.AccumSteps": {fmt.Sprint(sp.from.accum), fmt.Sprint(sp.to.accum)},
				"Window.DType":     {cmp.Or(sp.from.windowDType, FP32).String(), cmp.Or(sp.to.windowDType, FP32).String()}} {
				if v[0] != v[1] {
					want[path] = v
				}
			}
			got := map[string][2]string{}
			for _, ch := range r.Changed {
				if ch.FromCheckpoint != strings.HasPrefix(ch.Path, "Optimizer.Groups[") {
					return fmt.Errorf("the report takes %s from the checkpoint: %v", ch.Path, ch.FromCheckpoint)
				}
				if !strings.HasPrefix(ch.Path, "Optimizer.") {
					got[ch.Path] = [2]string{ch.Saved, ch.Engine}
				}
			}
			if !maps.Equal(got, want) || r.Step != at || r.World != sp.from.world || r.Stage != sp.stage || r.Reshard.World != (sp.from.world != sp.to.world) {
				return fmt.Errorf("the report says step %d, world %d, stage %d, %+v, changed %v; want step %d, world %d, stage %d, changed %v",
					r.Step, r.World, r.Stage, r.Reshard, got, at, sp.from.world, sp.stage, want)
			}
			return nil
		}
		resumed := sp.to.run(t, ckptRun{c: c, from: at, to: steps, load: dir, savedWorld: sp.from.world, report: report}, resumedGrads)
		ref, err := ckptReferenceRun(c, 2, at, steps, saved)
		if err != nil {
			t.Fatal(err)
		}
		for st := at; st < steps; st++ {
			for q := range ckptSizes {
				for i, g := range ref.g[st-at][q] {
					a, b, dg := wholeGrads[st][q][i], resumedGrads[st][q][i], ref.dg[st-at][q][i]
					for _, x := range []float32{a, b} {
						if d := math.Abs(float64(x) - g); d > dg {
							t.Fatalf("%s: step %d, parameter %d, element %d: the reduced gradients are %.9g (uninterrupted) and %.9g (resumed), the float64 reference %.9g: %.3g apart, beyond the bound %.3g", name, st, q, i, a, b, g, d, dg)
						} else if dg > 0 {
							worstGrad = max(worstGrad, d/dg)
						}
					}
					if c.dtype != FP32 {
						continue
					}
					n := ulpsApart(a, b)
					ulpCount[n]++
					worstULP = max(worstULP, n)
					if n > 2 {
						t.Fatalf("%s: step %d, parameter %d, element %d: the reduced gradient is %.9g uninterrupted, %.9g resumed: %d ulp apart, beyond 2", name, st, q, i, a, b, n)
					}
				}
			}
		}
		cw, err := consolidate(whole)
		if err != nil {
			t.Fatal(err)
		}
		cr, err := consolidate(resumed)
		if err != nil {
			t.Fatal(err)
		}
		for q := range ckptSizes {
			a, b := ckptF32s(cw["master"][q]), ckptF32s(cr["master"][q])
			for i := range a {
				bound := 2 * (2 * ref.dp[q][i]) // each run within twice its bound of the reference
				if d := math.Abs(a[i] - b[i]); d > bound {
					t.Fatalf("%s: after step %d, parameter %d element %d: the master is %.9g uninterrupted, %.9g resumed: %.3g apart, beyond the bound %.3g", name, steps, q, i, a[i], b[i], d, bound)
				} else if bound > 0 {
					worstParam = max(worstParam, d/bound)
				}
			}
		}
		for _, run := range [][]ckptState{whole, resumed} {
			if _, err := checkReshardTraining(c, 2, at, steps, saved, run); err != nil {
				t.Fatalf("%s: %v", name, err)
			}
		}
	}
	t.Logf("fp32 reduced gradients, resumed against uninterrupted, by ulps apart: %v (at most %d; the bound is 2)", ulpCount, worstULP)
	t.Logf("the largest distance from the float64 reference: %.3g of the bound for a gradient; masters %.3g of the bound apart", worstGrad, worstParam)
}

// TestResumeLossScaleAtAnotherSplit: fp16 with a dynamic scale (256,
// window 2, hysteresis 2) at stage 2, W=2×2 (Grads.AccumSteps 2) saved
// after 3 steps, the overflow of step 1 having spent one hysteresis,
// resumes at W=1×4 (AccumSteps 4), and W=1×4 resumes at W=2×2. A saved
// scale S is the step's mean loss's (format 2, DeepSpeed's convention),
// so it needs no rescale at the new G: every step's S (Stats.LossScale)
// is DeepSpeed's (dsScaler fed the same overflows) and the uninterrupted
// run's, doubling after steps 4 and 6; each backward carries S/G of the
// engine's own G (Engine.LossScale), from the first backward after the
// load on; the scaler's state at the end is the uninterrupted run's; and
// every reduced gradient, unscaled, is within the float64 reference's
// bound of the mean of the batch (seeded data), as is the master.
func TestResumeLossScaleAtAnotherSplit(t *testing.T) {
	seed := uint64(testSeed(t))
	const at, steps = 3, 8
	w2, w1 := splitEnd{world: 2, accum: 2}, splitEnd{world: 1, accum: 4}
	c := ckptCase{stage: 2, dtype: FP16, seed: seed}
	ls := c.config().Precision.LossScale
	// DeepSpeed's S before each step, and after the last
	ds := newDSScaler(ls.Initial, ls.Window, ls.Hysteresis, ls.Min)
	want := make([]float64, steps+1)
	for st := range want {
		want[st] = ds.curScale
		ds.updateScale(st == ckptOverflowStep)
	}
	if want[at] != want[at+2]/2 || want[at+2] != want[at+4]/2 {
		t.Fatalf("DeepSpeed's scales %v do not double after steps %d and %d: the test does not cover it", want, at+2, at+4)
	}
	for _, sp := range [][2]splitEnd{{w2, w1}, {w1, w2}} {
		name := fmt.Sprintf("%v→%v", sp[0], sp[1])
		// scales records rank 0's S of each step and the scale each
		// backward carries in the next
		scales := func(s, next []float64) func(*Engine, int, int) error {
			return func(e *Engine, rank, st int) error {
				if rank == 0 {
					s[st], next[st] = e.Stats().LossScale, e.LossScale()
				}
				return nil
			}
		}
		var wholeS, wholeNext, resS, resNext [steps]float64
		wholeGrads, resGrads := make([][][]float32, steps), make([][][]float32, steps)
		withScales := func(r ckptRun, s, next []float64, grads [][][]float32) ckptRun {
			record := scales(s, next)
			r.afterStep = func(e *Engine, rank, st int) error {
				full, err := e.FullGrads()
				if rank == 0 {
					grads[st] = full
				}
				if err != nil {
					return err
				}
				return record(e, rank, st)
			}
			return r
		}
		run := func(end splitEnd, r ckptRun) []ckptState {
			r.world, r.accum = end.world, end.accum
			r.config = func(cfg *Config) { cfg.Grads.AccumSteps = end.accum }
			return r.run(t)
		}
		whole := run(sp[0], withScales(ckptRun{c: c, from: 0, to: steps}, wholeS[:], wholeNext[:], wholeGrads))
		dir := t.TempDir()
		saved := run(sp[0], ckptRun{c: c, from: 0, to: at, save: dir})
		resumedRun := withScales(ckptRun{c: c, from: at, to: steps, load: dir, savedWorld: sp[0].world}, resS[:], resNext[:], resGrads)
		resumedRun.edit = func(e *Engine) error {
			if got, g := e.LossScale(), float64(sp[1].accum); got != want[at]/g {
				return fmt.Errorf("the first backward after the load carries %v, want DeepSpeed's S/G = %v/%v", got, want[at], g)
			}
			return nil
		}
		resumed := run(sp[1], resumedRun)
		for st := 0; st < steps; st++ {
			if wholeS[st] != want[st] || wholeNext[st] != want[st+1]/float64(sp[0].accum) {
				t.Fatalf("%s: the uninterrupted run's step %d at scale %v, the next backwards carrying %v; DeepSpeed's: %v and %v/%d", name, st, wholeS[st], wholeNext[st], want[st], want[st+1], sp[0].accum)
			}
			if st >= at && (resS[st] != want[st] || resNext[st] != want[st+1]/float64(sp[1].accum)) {
				t.Fatalf("%s: the resumed run's step %d at scale %v, the next backwards carrying %v; DeepSpeed's: %v and %v/%d", name, st, resS[st], resNext[st], want[st], want[st+1], sp[1].accum)
			}
		}
		if a, b := whole[0].scaler, resumed[0].scaler; a != b {
			t.Fatalf("%s: the scaler ends as %+v resumed, %+v uninterrupted", name, b, a)
		}
		ref, err := ckptReferenceRun(c, 2, at, steps, saved)
		if err != nil {
			t.Fatal(err)
		}
		for st := at; st < steps; st++ {
			for q := range ckptSizes {
				for i, g := range ref.g[st-at][q] {
					for _, x := range []float64{float64(wholeGrads[st][q][i]) / (want[st] / float64(sp[0].accum)), float64(resGrads[st][q][i]) / (want[st] / float64(sp[1].accum))} {
						if d := math.Abs(x - g); d > ref.dg[st-at][q][i] {
							t.Fatalf("%s: step %d, parameter %d, element %d: the reduced gradient unscaled is %.9g, the float64 reference %.9g: %.3g apart, beyond the bound %.3g", name, st, q, i, x, g, d, ref.dg[st-at][q][i])
						}
					}
				}
			}
		}
		for _, r := range [][]ckptState{whole, resumed} {
			if _, err := checkReshardTraining(c, 2, at, steps, saved, r); err != nil {
				t.Fatalf("%s: %v", name, err)
			}
		}
		t.Logf("%s: the scales of steps %d to %d: %v, as DeepSpeed's", name, at+1, steps, resS[at:])
	}
}

// TestLoadReport: Load says what it did. Into the layout it was saved
// from, nothing is resharded; the optimizer groups' settings come from the
// checkpoint (the saved run halved its rate), listed with both values,
// unless KeepConfigGroups keeps the engine's. Another stage, bucket size,
// alignment or world size is named, and the parameters the report says
// were placed anew are those some element of which now lies on another
// rank or at another place of its shard, found element by element from
// the two plans. A settings record of another version lists a setting
// either side lacks with "none" for its value there.
func TestLoadReport(t *testing.T) {
	c := ckptCase{stage: 2, dtype: BF16}
	from := reshardEnd{2, 2, 1024, 0, false}
	dir := t.TempDir()
	from.run(t, ckptRun{c: c, from: 0, to: 3, save: dir})
	ps := make([]Param, len(ckptSizes))
	for p, n := range ckptSizes {
		ps[p] = Param{Name: fmt.Sprint("w", p), Count: n, DType: c.dtype}
	}
	// moved lists the parameters of which some element lies elsewhere in
	// plan b than in plan a
	moved := func(a, b *Plan) []string {
		place := func(pl *Plan, p, i int) [2]int {
			bp := pl.Buckets[pl.ParamBucket[p]]
			g := pl.ParamOffset[p] + i
			return [2]int{g / bp.Shard, bp.ShardOffset + g%bp.Shard}
		}
		var out []string
		for p, n := range ckptSizes {
			for i := range n {
				if place(a, p, i) != place(b, p, i) {
					out = append(out, ps[p].Name)
					break
				}
			}
		}
		return out
	}
	saved := newPlan(ps, from.bucket, from.world, 64)
	lr := c.config().Optimizer.Groups[0].(AdamW).LR
	for _, tc := range []struct {
		to      reshardEnd
		keep    bool // KeepConfigGroups
		reshard Reshard
	}{
		{from, false, Reshard{}},
		{from, true, Reshard{}},
		{reshardEnd{2, 3, 1024, 0, false}, false, Reshard{Stage: true}},
		{reshardEnd{2, 2, 300, 0, false}, false, Reshard{Buckets: true}},
		{reshardEnd{2, 2, 1024, 16, false}, false, Reshard{}},
		{reshardEnd{3, 2, 1024, 0, true}, false, Reshard{World: true}},
	} {
		name := fmt.Sprintf("%v→%v keep=%v", from, tc.to, tc.keep)
		want := tc.reshard
		want.Params = moved(saved, newPlan(ps, tc.to.bucket, tc.to.world, cmp.Or(tc.to.align, 64)))
		if sameLayout := tc.to.world == from.world && tc.to.bucket == from.bucket && tc.to.align == from.align; sameLayout != (len(want.Params) == 0) {
			t.Fatalf("%s: the plans place %v anew: the case does not cover what it should", name, want.Params)
		}
		check := func(rank int, r LoadReport) error {
			if r.Dir != filepath.Join(dir, ckptName(3, 0)) || r.Step != 3 || r.World != 2 || r.Stage != 2 {
				return fmt.Errorf("the report names %s, step %d, world %d, stage %d; want %s, 3, 2, 2", r.Dir, r.Step, r.World, r.Stage, filepath.Join(dir, ckptName(3, 0)))
			}
			if !reflect.DeepEqual(r.Reshard, want) {
				return fmt.Errorf("the report's reshard is %+v, want %+v", r.Reshard, want)
			}
			var groups []string
			for _, s := range groupsRecord(c.config().Optimizer.Groups) {
				groups = append(groups, s.Path)
			}
			if tc.keep {
				groups = nil
			}
			if !slices.Equal(r.FromCheckpoint, groups) {
				return fmt.Errorf("the report takes %v from the checkpoint, want %v", r.FromCheckpoint, groups)
			}
			wantChanged := []SettingChange{{Path: "Optimizer.Groups[0].LR", Saved: fmt.Sprint(lr / 2), Engine: fmt.Sprint(lr), FromCheckpoint: !tc.keep}}
			for _, s := range []struct {
				path   string
				a, b   any
				differ bool
			}{{"World", from.world, tc.to.world, tc.to.world != from.world}, {"Stage", from.stage, tc.to.stage, tc.to.stage != from.stage},
				{"BucketBytes", from.bucket, tc.to.bucket, tc.to.bucket != from.bucket}, {"Align", 64, cmp.Or(tc.to.align, 64), tc.to.align != from.align},
				{"Params.PrefetchBytes", from.bucket, tc.to.bucket, tc.to.bucket != from.bucket}, // its default is BucketBytes
				{"Offload.Optimizer", from.offload, tc.to.offload, tc.to.offload != from.offload}} {
				if s.differ {
					wantChanged = append(wantChanged, SettingChange{Path: s.path, Saved: fmt.Sprint(s.a), Engine: fmt.Sprint(s.b)})
				}
			}
			sortChanges := func(x []SettingChange) []SettingChange {
				x = slices.Clone(x)
				slices.SortFunc(x, func(a, b SettingChange) int { return strings.Compare(a.Path, b.Path) })
				return x
			}
			if got, want := sortChanges(r.Changed), sortChanges(wantChanged); !slices.Equal(got, want) {
				return fmt.Errorf("the report's changed settings are %+v, want %+v", got, want)
			}
			return nil
		}
		tc.to.run(t, ckptRun{c: c, from: 3, to: 3, load: dir, savedWorld: from.world, loadOpt: LoadOptions{KeepConfigGroups: tc.keep}, report: func(rank int, r LoadReport) error {
			if err := check(rank, r); err != nil {
				return fmt.Errorf("%s: %w", name, err)
			}
			return nil
		}})
	}
	// a record of another version: a setting it lacks, one this one lacks
	other := copyTree(t, filepath.Join(dir, ckptName(3, 0)))
	b, err := os.ReadFile(filepath.Join(other, ckptManifest))
	if err != nil {
		t.Fatal(err)
	}
	var m ckptManifestData
	if err := json.Unmarshal(b, &m); err != nil {
		t.Fatal(err)
	}
	m.Settings = slices.DeleteFunc(m.Settings, func(s ckptSetting) bool { return s.Path == "Params.LiveParamBytes" })
	m.Settings = append(m.Settings, ckptSetting{Path: "Params.Retired", Value: "7", Class: "reshard"})
	if b, err = sealManifest(&m); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(other, ckptManifest), b, 0o644); err != nil {
		t.Fatal(err)
	}
	from.run(t, ckptRun{c: c, from: 3, to: 3, load: other, report: func(rank int, r LoadReport) error {
		for _, want := range []SettingChange{{Path: "Params.LiveParamBytes", Saved: "none", Engine: "0"}, {Path: "Params.Retired", Saved: "7", Engine: "none"}} {
			if !slices.Contains(r.Changed, want) {
				return fmt.Errorf("the report's changed settings %+v lack %+v", r.Changed, want)
			}
		}
		return nil
	}})
}

// TestClientOfNewRanks: a checkpoint of 2 ranks loaded into 4 gives the
// ranks it adds saved rank 0's client bytes by default, rank 1's with
// LoadOptions.NewRankClient 1, none with NoClient (each checked by
// ckptRun, with the report's ClientRank); the saved ranks get their own
// whatever the option. A NewRankClient the checkpoint has no rank of is
// refused with ErrConfig on every rank before anything changes, and one
// more step gives the bits of a run that never tried.
func TestClientOfNewRanks(t *testing.T) {
	c := ckptCase{stage: 2, dtype: BF16}
	dir := t.TempDir()
	reshardEnd{2, 2, 1024, 0, false}.run(t, ckptRun{c: c, from: 0, to: 2, save: dir})
	to := reshardEnd{4, 2, 1024, 0, false}
	for _, n := range []int{0, 1, NoClient} {
		to.run(t, ckptRun{c: c, from: 2, to: 2, load: dir, savedWorld: 2, loadOpt: LoadOptions{NewRankClient: n}})
	}
	untouched := to.run(t, ckptRun{c: c, from: 0, to: 1})
	for _, n := range []int{2, -2} {
		errs, states := refusedLoadAs(t, c, 4, dir, nil, LoadOptions{NewRankClient: n}, ErrConfig)
		for rank, err := range errs {
			if !errors.Is(err, ErrConfig) || !strings.Contains(err.Error(), "NewRankClient") {
				t.Fatalf("NewRankClient %d: rank %d: %v, want ErrConfig naming LoadOptions.NewRankClient", n, rank, err)
			}
		}
		if d := sameConsolidated(untouched, states); states == nil || d != "" {
			t.Fatalf("NewRankClient %d: the step after the refused load differs from a run that never tried: %s", n, d)
		}
		t.Logf("NewRankClient %d: %v", n, errs[0])
	}
}

// ---- a checkpoint written from per-parameter state (WriteCheckpoint) ----

// readCheckpointState reads a checkpoint directory back into per-parameter
// state through the loader's own checks (every rank file verified whole),
// independently of WriteCheckpoint: what a user converting another
// framework's checkpoint would hand it. It returns rank 0's client bytes
// beside it.
func readCheckpointState(t *testing.T, dir string) (CheckpointState, []byte) {
	t.Helper()
	at, m, err := findCheckpoint(osFS{}, dir)
	if err != nil {
		t.Fatal(err)
	}
	st := CheckpointState{Step: m.Step, Stage: m.Stage, Scheduled: m.Optimizer.Scheduled,
		LossScale: LossScaleState{m.Optimizer.Scaler.Scale, m.Optimizer.Scaler.CurHysteresis, m.Optimizer.Scaler.Iter, m.Optimizer.Scaler.LastOverflow}}
	for _, p := range m.Params {
		d, _ := dtypeNamed(p.DType)
		st.Params = append(st.Params, Param{Name: p.Name, Shape: p.Shape, Count: p.Count, DType: d, Group: p.Group, Frozen: p.Frozen})
	}
	for _, g := range m.Optimizer.Groups {
		if g.AdamW != nil {
			st.Groups = append(st.Groups, made(*g.AdamW))
		} else {
			st.Groups = append(st.Groups, made(*g.SGD))
		}
	}
	classes := map[string]SettingClass{"match": ClassMatch, "reshard": ClassReshard, "local": ClassLocal}
	for _, s := range m.Settings {
		st.Settings = append(st.Settings, Setting{s.Path, s.Value, classes[s.Class]})
	}
	x, err := checkLayout(at, m, st.Params)
	if err != nil {
		t.Fatal(err)
	}
	ld := newLoader(newCkptJob(ckptSnapshot{fs: osFS{}, params: st.Params}), at, m, x)
	defer ld.close()
	ranks := make([]int, m.Layout.World)
	for r := range ranks {
		ranks[r] = r
	}
	if err := ld.verifyRanks(ranks); err != nil {
		t.Fatal(err)
	}
	st.Values = make([]ParamState, len(st.Params))
	for p, q := range st.Params {
		v := &st.Values[p]
		v.Steps = m.Optimizer.Steps[p]
		if q.Frozen || q.Count == 0 {
			continue
		}
		read := func(name string, d DType) []byte {
			if !ld.has(name) {
				return nil
			}
			b := make([]byte, q.Count*d.Size())
			if err := ld.readParam(stateTensor{name: name, t: Tensor{dtype: d}}, p, 0, q.Count, b); err != nil {
				t.Fatal(err)
			}
			return b
		}
		for _, s := range []struct {
			name string
			dst  *[]float32
		}{{"master", &v.Master}, {"m", &v.M}, {"v", &v.V}, {"vmax", &v.VMax}} {
			if b := read(s.name, FP32); b != nil {
				*s.dst = make([]float32, q.Count)
				copy(f32Bytes(*s.dst), b)
			}
		}
		b := read("model", q.DType)
		if q.DType == FP32 {
			x := make([]float32, q.Count)
			copy(f32Bytes(x), b)
			v.Model = Float32s(x)
		} else {
			h := make([]uint16, q.Count)
			for i := range h {
				h[i] = uint16(b[2*i]) | uint16(b[2*i+1])<<8
			}
			v.Model = Halfs(h, q.DType)
		}
	}
	client, err := ld.client(0) // the world of one's rank 0
	if err != nil {
		t.Fatal(err)
	}
	return st, client
}

// sameCheckpointState reports the first difference between two states,
// values compared by their bits.
func sameCheckpointState(a, b CheckpointState) string {
	switch {
	case !reflect.DeepEqual(a.Params, b.Params):
		return fmt.Sprintf("params %+v and %+v", a.Params, b.Params)
	case !reflect.DeepEqual(a.Groups, b.Groups):
		return fmt.Sprintf("groups %+v and %+v", a.Groups, b.Groups)
	case a.Step != b.Step || a.Scheduled != b.Scheduled || a.Stage != b.Stage || a.LossScale != b.LossScale:
		return fmt.Sprintf("step %d/%d, scheduled %d/%d, stage %d/%d, loss scale %+v/%+v", a.Step, b.Step, a.Scheduled, b.Scheduled, a.Stage, b.Stage, a.LossScale, b.LossScale)
	case !reflect.DeepEqual(a.Settings, b.Settings):
		return "settings"
	}
	for p := range a.Values {
		x, y := a.Values[p], b.Values[p]
		for _, s := range [][2][]float32{{x.Master, y.Master}, {x.M, y.M}, {x.V, y.V}, {x.VMax, y.VMax}} {
			if !slices.Equal(f32Bytes(s[0]), f32Bytes(s[1])) {
				return fmt.Sprintf("parameter %d's state", p)
			}
		}
		if x.Steps != y.Steps || x.Model.dtype != y.Model.dtype || !slices.Equal(x.Model.hostBytes(), y.Model.hostBytes()) {
			return fmt.Sprintf("parameter %d's steps or model values", p)
		}
	}
	return ""
}

// savedState trains c 3 steps on 2 ranks, saves, and reads the checkpoint
// back: the directory and the state read.
func savedState(t *testing.T, c ckptCase) (string, CheckpointState, []byte) {
	t.Helper()
	dir := t.TempDir()
	ckptTrain(t, c, 0, 3, "", dir)
	st, client := readCheckpointState(t, dir)
	return dir, st, client
}

// TestWriteCheckpointRoundTrip: the state read back from a Save (every
// stage, fp32, bf16 and fp16 whose scaler moved, AdamW with amsgrad and
// SGD with momentum, offload, windows), written by WriteCheckpoint, reads
// back the same, and loads into engines to the same bits as the Save:
// parameters, master, moments, the model-dtype shard, step counts, loss
// scaler, step; also with the model values left to be rounded from the
// master, and with the parameters in another order (found by name). Two
// more steps from either give the same bits, and the written checkpoint
// loads at other world sizes, stages and buckets as the Save does.
func TestWriteCheckpointRoundTrip(t *testing.T) {
	cases := []ckptCase{
		{stage: 1, dtype: FP32}, {stage: 2, dtype: BF16, sgd: true}, {stage: 3, dtype: FP16, offload: true},
		{stage: 2, dtype: FP16, window: true, sgd: true}, {stage: 3, dtype: BF16}, {stage: 1, dtype: FP16, offload: true, sgd: true},
	}
	for i, c := range cases {
		if testing.Short() && i%2 == 1 {
			continue
		}
		from, st, client := savedState(t, c)
		if string(client) != "rank 0 at step 3" || st.Step != 3 {
			t.Fatalf("%v: read back client %q at step %d", c, client, st.Step)
		}
		variants := map[string]func(CheckpointState) CheckpointState{
			"as read": func(s CheckpointState) CheckpointState { return s },
			"model rounded from the master": func(s CheckpointState) CheckpointState {
				s.Values = slices.Clone(s.Values)
				for p := range s.Values {
					s.Values[p].Model = Tensor{}
				}
				return s
			},
			"parameters reversed": func(s CheckpointState) CheckpointState {
				s.Params, s.Values = slices.Clone(s.Params), slices.Clone(s.Values)
				slices.Reverse(s.Params)
				slices.Reverse(s.Values)
				return s
			},
		}
		loadedSave := ckptRun{c: c, from: 3, to: 3, load: from}.run(t)
		resumedSave := ckptRun{c: c, from: 3, to: 5, load: from}.run(t)
		for name, variant := range variants {
			dir := t.TempDir()
			w := variant(st)
			if err := WriteCheckpoint(dir, w, SaveOptions{Client: client}); err != nil {
				t.Fatalf("%v %s: %v", c, name, err)
			}
			back, backClient := readCheckpointState(t, dir)
			if name != "model rounded from the master" {
				if d := sameCheckpointState(w, back); d != "" || string(backClient) != string(client) {
					t.Fatalf("%v %s: the written checkpoint reads back otherwise: %s (client %q)", c, name, d, backClient)
				}
			}
			loaded := ckptRun{c: c, from: 3, to: 3, load: dir, savedWorld: 1}.run(t)
			for rank := range loaded {
				if d := loadedSave[rank].diff(loaded[rank]); d != "" {
					t.Fatalf("%v %s rank %d: loads otherwise than the Save: %s", c, name, rank, d)
				}
			}
			resumed := ckptRun{c: c, from: 3, to: 5, load: dir, savedWorld: 1}.run(t)
			for rank := range resumed {
				if d := resumedSave[rank].diff(resumed[rank]); d != "" {
					t.Fatalf("%v %s rank %d: two steps from it differ from two steps from the Save: %s", c, name, rank, d)
				}
			}
		}
		// at other shapes it loads as the Save does
		dir := t.TempDir()
		if err := WriteCheckpoint(dir, st, SaveOptions{Client: client}); err != nil {
			t.Fatal(err)
		}
		for _, end := range []reshardEnd{{1, 3, 1024, 0, false}, {3, 1, 300, 16, c.offload}, {4, 2, 4096, 0, false}} {
			if testing.Short() && end.world != 3 {
				continue
			}
			want := end.run(t, ckptRun{c: c, from: 3, to: 3, load: from, savedWorld: 2})
			got := end.run(t, ckptRun{c: c, from: 3, to: 3, load: dir, savedWorld: 1})
			if d := sameConsolidated(want, got); d != "" {
				t.Fatalf("%v at %v: the written checkpoint loads otherwise than the Save: %s", c, end, d)
			}
		}
	}
}

// TestWriteCheckpointRefusals: bad input is refused with the error kind
// and a message that names what to change, before anything is written:
// the directory is not created.
func TestWriteCheckpointRefusals(t *testing.T) {
	_, adamw, _ := savedState(t, ckptCase{stage: 2, dtype: FP16})
	_, sgd, _ := savedState(t, ckptCase{stage: 2, dtype: BF16, sgd: true})
	edit := func(base CheckpointState, f func(s *CheckpointState)) CheckpointState {
		s := base
		s.Params, s.Values, s.Groups, s.Settings = slices.Clone(s.Params), slices.Clone(s.Values), slices.Clone(s.Groups), slices.Clone(s.Settings)
		f(&s)
		return s
	}
	for _, c := range []struct {
		name string
		st   CheckpointState
		kind error
		say  string
	}{
		{"no parameters", edit(adamw, func(s *CheckpointState) { s.Params, s.Values = nil, nil }), ErrParam, "no parameters"},
		{"an unnamed parameter", edit(adamw, func(s *CheckpointState) { s.Params[1].Name = "" }), ErrParam, "Params[1] has no name"},
		{"two names alike", edit(adamw, func(s *CheckpointState) { s.Params[2].Name = "w0" }), ErrParam, `both named "w0"`},
		{"shape and count disagree", edit(adamw, func(s *CheckpointState) { s.Params[0].Shape = []int{3, 7} }), ErrParam, "make them agree"},
		{"two dtypes", edit(adamw, func(s *CheckpointState) { s.Params[3].DType = BF16 }), ErrDType, "one dtype"},
		{"a group beyond the groups", edit(adamw, func(s *CheckpointState) { s.Params[2].Group = 1 }), ErrParam, "group 1"},
		{"no groups", edit(adamw, func(s *CheckpointState) { s.Groups = nil }), ErrConfig, "Groups is empty"},
		{"a literal group", edit(adamw, func(s *CheckpointState) { s.Groups[0] = AdamW{LR: 1} }), ErrConfig, "NewAdamW"},
		{"two kinds", edit(adamw, func(s *CheckpointState) { s.Groups = append(s.Groups, NewSGD(1)) }), ErrConfig, "one optimizer kind"},
		{"values missing", edit(adamw, func(s *CheckpointState) { s.Values = s.Values[:4] }), ErrParam, "4 Values for 5 Params"},
		{"a short master", edit(adamw, func(s *CheckpointState) { s.Values[2].Master = s.Values[2].Master[:10] }), ErrParam, `Values[2] ("w2") has 10 Master values`},
		{"no master", edit(adamw, func(s *CheckpointState) { s.Values[1].Master = nil }), ErrParam, "no Master"},
		{"no moments after steps", edit(adamw, func(s *CheckpointState) { s.Values[0].V = nil }), ErrParam, `Values[0] ("w0") has no V`},
		{"no momentum after steps", edit(sgd, func(s *CheckpointState) { s.Values[3].M = nil }), ErrParam, "no M"},
		{"SGD with a second moment", edit(sgd, func(s *CheckpointState) { s.Values[3].V = s.Values[3].Master }), ErrParam, "does not keep"},
		{"VMax without amsgrad", edit(adamw, func(s *CheckpointState) {
			g := s.Groups[0].(AdamW)
			g.AMSGrad = false
			s.Groups[0] = g
		}), ErrParam, "VMax values"},
		{"negative steps", edit(adamw, func(s *CheckpointState) { s.Values[4].Steps = -1 }), ErrParam, "-1 steps"},
		{"a frozen parameter with values", edit(adamw, func(s *CheckpointState) { s.Params[4].Frozen = true }), ErrParam, "frozen or empty"},
		{"model values of another dtype", edit(adamw, func(s *CheckpointState) { s.Values[2].Model = Float32s(s.Values[2].Master) }), ErrParam, "Model is 1000 fp32 values"},
		{"model values past their slice", edit(adamw, func(s *CheckpointState) {
			s.Values[1].Model = Tensor{ptr: s.Values[1].Model.ptr, count: 7, dtype: FP16, keep: make([]uint16, 3)}
		}), ErrParam, "claims"},
		{"a stage of 4", edit(adamw, func(s *CheckpointState) { s.Stage = 4 }), ErrConfig, "Stage 4"},
		{"negative steps taken", edit(adamw, func(s *CheckpointState) { s.Step = -1 }), ErrConfig, "Step -1"},
		{"no loss scale with fp16", edit(adamw, func(s *CheckpointState) { s.LossScale = LossScaleState{} }), ErrConfig, "LossScale.Scale 0"},
		{"an infinite loss scale", edit(adamw, func(s *CheckpointState) { s.LossScale.Scale = math.Inf(1) }), ErrConfig, "LossScale.Scale +Inf"},
		{"an overflow after the iteration", edit(adamw, func(s *CheckpointState) { s.LossScale.LastOverflow = s.LossScale.Iter + 1 }), ErrConfig, "last overflow"},
		{"a setting twice", edit(adamw, func(s *CheckpointState) { s.Settings = append(s.Settings, s.Settings[3]) }), ErrConfig, "Settings["},
	} {
		t.Run(c.name, func(t *testing.T) {
			dir := filepath.Join(t.TempDir(), "ckpt")
			err := WriteCheckpoint(dir, c.st, SaveOptions{})
			if !errors.Is(err, c.kind) || !strings.Contains(err.Error(), c.say) {
				t.Fatalf("got %v; want %v saying %q", err, c.kind, c.say)
			}
			if _, serr := os.Stat(dir); serr == nil {
				t.Fatalf("%v, and %s was created", err, dir)
			}
		})
	}
	if err := WriteCheckpoint(t.TempDir(), adamw, SaveOptions{Keep: -1}); !errors.Is(err, ErrConfig) {
		t.Errorf("Keep -1: %v, want ErrConfig", err)
	}
	// the zero scaler state is a scale of 1 where the model is not fp16
	s := edit(sgd, func(s *CheckpointState) { s.LossScale = LossScaleState{} })
	dir := t.TempDir()
	if err := WriteCheckpoint(dir, s, SaveOptions{}); err != nil {
		t.Fatal(err)
	}
	if back, _ := readCheckpointState(t, dir); back.LossScale != (LossScaleState{Scale: 1}) {
		t.Errorf("a bf16 model's zero loss scaler state was written as %+v, want a scale of 1", back.LossScale)
	}
}

// TestLoadRefusesAnotherModel: a checkpoint with a parameter the engine
// lacks, without one the engine has, or with one of another size, dtype
// or group is refused at every rank, naming the parameter, with every
// engine as it was (and usable).
func TestLoadRefusesAnotherModel(t *testing.T) {
	c := ckptCase{stage: 2, dtype: BF16}
	_, st, _ := savedState(t, c)
	for _, tc := range []struct {
		name string
		edit func(s *CheckpointState)
		say  string
	}{
		{"a parameter the engine lacks", func(s *CheckpointState) {
			s.Params = append(s.Params, Param{Name: "extra", Count: 5, DType: BF16})
			s.Values = append(s.Values, ParamState{Master: make([]float32, 5), M: make([]float32, 5), V: make([]float32, 5), VMax: make([]float32, 5)})
		}, `the checkpoint's parameter 5 ("extra", [] 5 bf16) is not one of the engine's`},
		{"a parameter the checkpoint lacks", func(s *CheckpointState) {
			s.Params, s.Values = s.Params[:4], s.Values[:4]
		}, `the engine's parameter 4 ("w4") is not in the checkpoint`},
		{"a parameter renamed", func(s *CheckpointState) { s.Params[1].Name = "v1" }, `parameter 1 ("w1") is not in the checkpoint`},
		{"another size", func(s *CheckpointState) {
			s.Params[2].Count = 999
			for _, x := range []*[]float32{&s.Values[2].Master, &s.Values[2].M, &s.Values[2].V, &s.Values[2].VMax} {
				*x = (*x)[:999]
			}
			s.Values[2].Model = Tensor{}
		}, `parameter 2 ("w2") is [] 999 bf16`},
		{"another group", func(s *CheckpointState) {
			s.Groups = append(s.Groups, s.Groups[0])
			s.Params[3].Group = 1
		}, `parameter 3 ("w3") is [] 129 bf16 (group 1`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s := st
			s.Params, s.Values, s.Groups = slices.Clone(s.Params), slices.Clone(s.Values), slices.Clone(s.Groups)
			tc.edit(&s)
			dir := t.TempDir()
			if err := WriteCheckpoint(dir, s, SaveOptions{}); err != nil {
				t.Fatal(err)
			}
			errs, after := refusedLoad(t, c, 2, dir, nil)
			for rank, err := range errs {
				if !errors.Is(err, ErrCheckpoint) || errors.Is(err, ErrCollective) || !strings.Contains(err.Error(), tc.say) {
					t.Errorf("rank %d: %v; want ErrCheckpoint, a usable engine and %q", rank, err, tc.say)
				}
			}
			if after == nil {
				t.Error("the engines did not step after the refusal")
			}
		})
	}
}

// TestWriteCheckpointCrash: a WriteCheckpoint that dies at any of its
// operations, followed by a power cut, leaves a directory that loads
// either the checkpoint that was there or the new one, bit for bit, and a
// later WriteCheckpoint there succeeds and leaves only complete
// checkpoints.
func TestWriteCheckpointCrash(t *testing.T) {
	c := ckptCase{stage: 1, dtype: FP16}
	base, st, _ := savedState(t, c)
	prev := ckptTrain(t, c, -1, -1, base, "")
	st.Step = 7 // the new checkpoint: the state with other values
	st.LossScale.Scale *= 2
	for p := range st.Values {
		st.Values[p].Model = Tensor{}
		for i := range st.Values[p].Master {
			st.Values[p].Master[i] += 0.25
		}
	}
	count := newCrashFS(0)
	if err := writeCheckpoint(count, copyTree(t, base), st, SaveOptions{Keep: 1}); err != nil {
		t.Fatal(err)
	}
	next := ckptTrain(t, c, -1, -1, func() string {
		d := t.TempDir()
		if err := WriteCheckpoint(d, st, SaveOptions{}); err != nil {
			t.Fatal(err)
		}
		return d
	}(), "")
	if next[0].diff(prev[0]) == "" {
		t.Fatal("the two checkpoints load alike: the test cannot tell them apart")
	}
	total, kept := count.ops, 0
	for at := 1; at <= total; at++ {
		dir := copyTree(t, base)
		fsys := newCrashFS(at)
		if err := writeCheckpoint(fsys, dir, st, SaveOptions{Keep: 1}); err == nil {
			t.Fatalf("crash at operation %d of %d: WriteCheckpoint returned nil", at, total)
		} else if !errors.Is(err, ErrCheckpoint) && !errors.Is(err, errCrashed) {
			t.Fatalf("crash at operation %d of %d: %v, want ErrCheckpoint", at, total, err)
		}
		if err := fsys.lose(); err != nil {
			t.Fatal(err)
		}
		got := ckptTrain(t, c, -1, -1, dir, "")
		isPrev, isNext := got[0].diff(prev[0]) == "" && got[1].diff(prev[1]) == "", got[0].diff(next[0]) == "" && got[1].diff(next[1]) == ""
		if !isPrev && !isNext {
			t.Fatalf("crash at operation %d of %d: the checkpoint loaded is neither the previous one nor the new one", at, total)
		}
		if isNext {
			kept++
		}
		if err := WriteCheckpoint(dir, st, SaveOptions{Keep: 1}); err != nil {
			t.Fatalf("crash at operation %d of %d: the WriteCheckpoint after it: %v", at, total, err)
		}
		ents, _ := os.ReadDir(dir)
		for _, e := range ents {
			if _, err := os.Stat(filepath.Join(dir, e.Name(), ckptManifest)); e.IsDir() && err != nil {
				t.Fatalf("crash at operation %d of %d: the WriteCheckpoint after it left %s, incomplete", at, total, e.Name())
			}
		}
	}
	if kept == 0 {
		t.Fatalf("no crash point kept the new checkpoint, not even the last of %d", total)
	}
	t.Logf("%d crash points of a WriteCheckpoint: the previous checkpoint loads after %d, the new one after %d", total, total-kept, kept)
}

// TestLoadFindsParametersByName: a checkpoint whose parameters are in
// another order than the engine's, each with a step count of its own,
// loads as the one in the engine's order: every parameter's state and
// step count go to the engine's parameter of its name.
func TestLoadFindsParametersByName(t *testing.T) {
	c := ckptCase{stage: 3, dtype: BF16}
	_, st, _ := savedState(t, c)
	for p := range st.Values {
		st.Values[p].Steps = 2 + p
	}
	inOrder, reversed := t.TempDir(), t.TempDir()
	if err := WriteCheckpoint(inOrder, st, SaveOptions{}); err != nil {
		t.Fatal(err)
	}
	st.Params, st.Values = slices.Clone(st.Params), slices.Clone(st.Values)
	slices.Reverse(st.Params)
	slices.Reverse(st.Values)
	if err := WriteCheckpoint(reversed, st, SaveOptions{}); err != nil {
		t.Fatal(err)
	}
	want := ckptRun{c: c, from: -1, to: 0, load: inOrder}.run(t)
	got := ckptRun{c: c, from: -1, to: 0, load: reversed}.run(t)
	for rank := range want {
		if !slices.Equal(want[rank].steps, []int{3, 4, 5, 6, 7}) {
			t.Fatalf("steps %v after a step from 2 to 6: the test does not tell the parameters apart", want[rank].steps)
		}
		if d := want[rank].diff(got[rank]); d != "" {
			t.Fatalf("rank %d: the checkpoint in another order loads otherwise: %s", rank, d)
		}
	}
}
