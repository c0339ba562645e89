package zero

import (
	"errors"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
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

// toDType rounds x into a host tensor of d.
func toDType(x []float32, d DType) Tensor {
	if d == FP32 {
		return Float32s(x)
	}
	h := make([]uint16, len(x))
	for i, v := range x {
		h[i] = uint16(refEncode(d, v))
	}
	return Halfs(h, d)
}

// ckptState is what a resumed run must reproduce, bit for bit.
type ckptState struct {
	params [][]float32
	state  map[string][]byte
	steps  []int
	scaler scalerState
	step   int
}

func readCkptState(e *Engine) (ckptState, error) {
	st := ckptState{state: map[string][]byte{}, steps: slices.Clone(e.opt.steps), step: e.stepIndex}
	c := e.opt.checkpointState()
	st.scaler = c.Scaler
	for _, s := range e.opt.stateTensors() {
		b := make([]byte, s.t.Bytes())
		if len(b) > 0 {
			if err := s.dev.copy(s.s, hostTensor(b, s.t.dtype), s.t); err != nil {
				return st, err
			}
			if err := s.s.Sync(); err != nil {
				return st, err
			}
		}
		st.state[s.name] = b
	}
	var err error
	st.params, err = e.FullParams()
	return st, err
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

// ckptTrain builds engines for c on 2 ranks, loads from load (if set),
// trains steps [from, to), saves into save (if set) and returns each
// rank's state at the end. setGroupAt halves the rate before that step.
func ckptTrain(t *testing.T, c ckptCase, from, to int, load, save string) []ckptState {
	t.Helper()
	const world = 2
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
			ps[p] = Param{Name: fmt.Sprint("w", p), Count: n, DType: c.dtype, Data: toDType(x, c.dtype)}
		}
		e, err := New(c.config(), comms[rank], ps)
		if err != nil {
			return err
		}
		defer e.Close()
		s := NewHostStream()
		defer s.Close()
		if load != "" {
			client, err := e.Load(load, LoadOptions{})
			if err != nil {
				return err
			}
			if want := fmt.Sprintf("rank %d at step %d", rank, from); string(client) != want {
				return fmt.Errorf("client bytes %q, want %q", client, want)
			}
		}
		for st := from; st < to; st++ {
			if st == 2 { // a SetGroup before the save, kept by it
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
			if skipped := e.Stats().Skipped; skipped != (st == ckptOverflowStep) {
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
	copyDir := func() string {
		d := t.TempDir()
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
	for _, tc := range []struct {
		name   string
		damage func(string)
		want   string
	}{
		{"truncated", edit("rank-00001.bin", func(b []byte) []byte { return b[:len(b)-5] }), "rank-00001.bin"},
		{"flipped byte in a section", edit("rank-00000.bin", flip(100)), "rank-00000.bin"},
		{"flipped byte in the footer", edit("rank-00001.bin", func(b []byte) []byte { b[len(b)-40] ^= 1; return b }), "rank-00001.bin"},
		{"missing rank file", func(d string) { os.Remove(filepath.Join(d, "rank-00001.bin")) }, "rank-00001.bin"},
		{"incomplete", func(d string) { os.Remove(filepath.Join(d, ckptManifest)) }, "no checkpoint"},
		{"newer version", edit(ckptManifest, func(b []byte) []byte {
			return []byte(replaceOnce(string(b), `"version": 1`, `"version": 2`))
		}), "newer"},
		{"another model", edit(ckptManifest, func(b []byte) []byte {
			return []byte(replaceOnce(string(b), `"name": "w1"`, `"name": "x1"`))
		}), "parameter 1"},
		{"a setting that must match", edit(ckptManifest, func(b []byte) []byte {
			return []byte(replaceOnce(string(b), `"path": "Grads.PredivideFactor",
   "value": "1"`, `"path": "Grads.PredivideFactor",
   "value": "2"`))
		}), "Grads.PredivideFactor"},
	} {
		d := copyDir()
		tc.damage(d)
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
			_, lerr := e.Load(d, LoadOptions{})
			after, err := readCkptState(e)
			if err != nil {
				return fmt.Errorf("the engine after a refused load: %w", err)
			}
			if diff := before.diff(after); diff != "" {
				return fmt.Errorf("a refused load changed the engine: %s", diff)
			}
			return lerr
		})
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
