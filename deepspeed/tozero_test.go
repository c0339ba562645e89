package deepspeed

import (
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"strings"
	"testing"

	"zero"
)

// shape is an engine a converted checkpoint is loaded into: world size,
// stage, bucket bytes (0: the config's), and the backwards each rank takes
// per step (1: rank r takes DeepSpeed's rank r's gradient, W must be 2;
// 2: every rank takes both, so that the mean over W·2 backwards is
// DeepSpeed's over its two ranks).
type shape struct{ world, stage, bucket, backwards int }

func (sh shape) String() string {
	return fmt.Sprintf("W%d/z%d/bucket%d/G%d", sh.world, sh.stage, sh.bucket, sh.backwards)
}

// engineFor builds one rank's engine for a golden run's model: the
// config zero.ReadDeepSpeed maps from the run's own (its precision, loss
// scaling, clipping and schedule), at sh's stage and bucket size, with
// the checkpoint's two groups (Load restores their settings), every
// parameter by its name and shape, the frozen one with DeepSpeed's value
// as its memory (a zero checkpoint holds none).
func engineFor(s *State, comm zero.Comm, sh shape) (*zero.Engine, []zero.Param, error) {
	ds, err := zero.ReadDeepSpeed(s.Config, zero.DeepSpeedOptions{World: comm.Size()})
	if err != nil {
		return nil, nil, err
	}
	cfg := ds.Config
	cfg.Stage = sh.stage
	if sh.bucket > 0 {
		cfg.BucketBytes = sh.bucket
	}
	cfg.Params.NoBroadcast = true // the load fills every rank
	if sh.backwards != 1 {
		cfg.Grads.AccumSteps = 0 // counted: DeepSpeed's G is 1
	}
	cfg.Optimizer.Groups = nil
	for _, g := range s.Groups {
		cfg.Optimizer.Groups = append(cfg.Optimizer.Groups, g.AdamW)
	}
	var params []zero.Param
	for _, p := range s.Params {
		q := zero.Param{Name: p.Name, Count: numel(p.Shape), Shape: p.Shape, DType: ds.DType, Group: max(p.Group, 0), Frozen: p.Frozen}
		if ds.DType == zero.FP32 {
			x := make([]float32, q.Count)
			if p.Frozen {
				x, _ = p.Model.Float32s()
			}
			q.Data = zero.Float32s(x)
		} else {
			h := make([]uint16, q.Count)
			if p.Frozen {
				h, _ = p.Model.Uint16s()
			}
			q.Data = zero.Halfs(h, ds.DType)
		}
		params = append(params, q)
	}
	e, err := zero.New(cfg, comm, params)
	return e, params, err
}

// loadInto is every Load of a converted checkpoint in these tests.
func loadInto(e *zero.Engine, dir string) ([]byte, error) {
	r, err := e.Load(dir, zero.LoadOptions{})
	return r.Client, err
}

// converted writes run's golden checkpoint (src: "ckpt" or the universal
// layout) as a zero checkpoint and returns its directory and the state.
func converted(t *testing.T, run, src string) (string, *State) {
	t.Helper()
	s, err := Read(filepath.Join(golden, run, src))
	if err != nil {
		t.Fatal(err)
	}
	dir := filepath.Join(t.TempDir(), "zero")
	if err := WriteZero(s, dir); err != nil {
		t.Fatal(err)
	}
	return dir, s
}

// engineState is what a rank-0 view of an engine holds after a load or a
// step: the export's tensors (master, moments, steps), the parameters'
// model-dtype values (FullParams, as fp32) and the loss scale.
type engineState struct {
	export map[string]Tensor
	params map[string][]float32
	scale  float64
}

// snapshot reads e's state; every rank calls it (the export and, at
// stage 3, FullParams are collectives); rank 0's is returned.
func snapshot(t *testing.T, e *zero.Engine, params []zero.Param, file string) (engineState, error) {
	if err := e.ExportSafetensors(file, zero.ExportOptions{Optimizer: true}); err != nil {
		return engineState{}, err
	}
	full, err := e.FullParams()
	if err != nil || e.Rank() != 0 {
		return engineState{}, err
	}
	st := engineState{export: readST(t, file), params: map[string][]float32{}, scale: e.LossScale()}
	for i, q := range params {
		st.params[q.Name] = full[i]
	}
	return st, nil
}

// TestWriteZeroGolden: each golden checkpoint (ZeRO-1, 2 and 3, fp32,
// bf16 and fp16; from its global_step3 and from its universal layout)
// converted to a zero checkpoint loads into an engine at the saved world
// size and stage with DeepSpeed's master weights, exp_avg and exp_avg_sq
// bit for bit (as DeepSpeed held them in memory), Adam's step, the
// model-dtype parameters, the loss scale, and DeepSpeed's counters as rank
// 0's client bytes.
func TestWriteZeroGolden(t *testing.T) {
	for _, run := range goldenRuns {
		for _, src := range []string{"ckpt", "ckpt/global_step3_universal"} {
			t.Run(run+"/"+filepath.Base(src), func(t *testing.T) {
				g := readGolden(t, run)
				dir, s := converted(t, run, src)
				st, err := ZeroState(s)
				if err != nil {
					t.Fatal(err)
				}
				c := g.Checkpoint
				wantScaler := zero.LossScaleState{Scale: c.LossScale, LastOverflow: -1}
				if c.CurIter != nil {
					wantScaler = zero.LossScaleState{Scale: c.LossScale, CurHysteresis: *c.CurHysteresis, Iter: *c.CurIter, LastOverflow: *c.LastOverflow}
				}
				if st.Step != c.GlobalSteps || st.Scheduled != c.LastBatch+1 || st.Stage != g.Stage || st.LossScale != wantScaler {
					t.Errorf("step %d, scheduled %d, stage %d, scaler %+v; want %d, %d, %d, %+v", st.Step, st.Scheduled, st.Stage, st.LossScale, c.GlobalSteps, c.LastBatch+1, g.Stage, wantScaler)
				}
				for i, grp := range st.Groups {
					// the config's base rate, from which the schedule goes on
					if a := grp.(zero.AdamW); a.LR != 0.01 || a.WeightDecay != []float64{0.01, 0}[i] {
						t.Errorf("group %d: %+v; want the config's rate 0.01 and the group's decay", i, a)
					}
				}
				want := readST(t, filepath.Join(golden, run, "state_step3.safetensors"))
				got, client := loadedState(t, s, dir, shape{2, g.Stage, 0, 1})
				compareLoaded(t, s, g, want, got)
				var cs ClientState
				if err := json.Unmarshal(client, &cs); err != nil || cs != (ClientState{"0.19.8", 3, 24, 0}) {
					t.Errorf("client bytes %s (%v), want DeepSpeed's counters", client, err)
				}
			})
		}
	}
}

// loadedState loads dir into engines of sh and returns rank 0's state
// and client bytes.
func loadedState(t *testing.T, s *State, dir string, sh shape) (engineState, []byte) {
	t.Helper()
	var out engineState
	var client []byte
	file := filepath.Join(t.TempDir(), "loaded.safetensors")
	err := zero.RunLocal(sh.world, func(comm zero.Comm) error {
		e, params, err := engineFor(s, comm, sh)
		if err != nil {
			return err
		}
		defer e.Close()
		c, err := loadInto(e, dir)
		if err != nil {
			return err
		}
		st, err := snapshot(t, e, params, file)
		if comm.Rank() == 0 {
			out, client = st, c
		}
		return err
	})
	if err != nil {
		t.Fatalf("%v: %v", sh, err)
	}
	return out, client
}

// compareLoaded holds a loaded engine's state to DeepSpeed's at the
// checkpoint, bit for bit.
func compareLoaded(t *testing.T, s *State, g goldenRun, want map[string]Tensor, got engineState) {
	t.Helper()
	for _, p := range s.Params {
		model, _ := want["param/"+p.Name].Float32s()
		if !sameBits(got.params[p.Name], model) {
			t.Errorf("%s: the model-dtype values differ from DeepSpeed's", p.Name)
		}
		if p.Frozen {
			continue
		}
		for _, k := range [][2]string{{"", "fp32/"}, {".exp_avg", "exp_avg/"}, {".exp_avg_sq", "exp_avg_sq/"}} {
			sameTensor(t, p.Name+k[0], got.export[p.Name+k[0]], want[k[1]+p.Name])
		}
		step, _ := got.export[p.Name+".step"].Float32s()
		if len(step) != 1 || float64(step[0]) != g.Checkpoint.AdamSteps[p.Group][0] {
			t.Errorf("%s: %v steps, DeepSpeed's %v", p.Name, step, g.Checkpoint.AdamSteps[p.Group])
		}
	}
	if got.scale != g.Checkpoint.LossScale {
		t.Errorf("loss scale %v, DeepSpeed's %v", got.scale, g.Checkpoint.LossScale)
	}
}

func sameBits(a, b []float32) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if math.Float32bits(a[i]) != math.Float32bits(b[i]) {
			return false
		}
	}
	return true
}

// TestWriteZeroRefusals: what zero's scaler cannot follow is refused
// (ErrUnsupported) before anything is written; zero's own refusal of a
// state comes back with zero's kind; a failed write leaves no checkpoint.
func TestWriteZeroRefusals(t *testing.T) {
	base, err := Read(filepath.Join(golden, "z2-fp16", "ckpt"))
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		name string
		edit func(s *State)
		kind error
		say  string
	}{
		{"consecutive hysteresis", func(s *State) { s.Scaler.Consecutive = true }, ErrUnsupported, "consecutive_hysteresis true"},
		{"a scale factor of 4", func(s *State) { s.Scaler.Factor = 4 }, ErrUnsupported, "scale_factor 4"},
		{"a float64 model", func(s *State) { s.ModelDType = Float64 }, ErrUnsupported, "float64"},
		{"a model value of another size", func(s *State) { s.Params[0].Model.Data = s.Params[0].Model.Data[:4] }, ErrInconsistent, "holds 2 float16 values"},
		{"a short master", func(s *State) { s.Params[0].Master = s.Params[0].Master[:3] }, zero.ErrParam, "Master values"},
		{"a scheduler before its start", func(s *State) { s.Scheduler.LastBatchIteration = -2 }, zero.ErrConfig, "Scheduled -1"},
	} {
		t.Run(c.name, func(t *testing.T) {
			s := *base
			s.Params = append([]Param(nil), base.Params...)
			c.edit(&s)
			dir := filepath.Join(t.TempDir(), "out")
			err := WriteZero(&s, dir)
			if !errors.Is(err, c.kind) || !strings.Contains(err.Error(), c.say) {
				t.Fatalf("got %v; want %v saying %q", err, c.kind, c.say)
			}
			if _, serr := os.Stat(dir); serr == nil {
				t.Errorf("%v, and %s was made", err, dir)
			}
		})
	}
}

// TestLoadRefusesAnotherModel: a converted checkpoint loaded into an
// engine whose model lacks one of its parameters, has one it lacks, or has
// one with another shape is refused on every rank (zero.ErrCheckpoint,
// naming the parameter), and the engine is as it was: its export before
// and after the refused load are the same.
func TestLoadRefusesAnotherModel(t *testing.T) {
	dir, s := converted(t, "z2-fp16", "ckpt")
	for _, c := range []struct {
		name string
		edit func(ps []Param) []Param
		say  string
	}{
		{"the engine lacks one", func(ps []Param) []Param {
			return slices.DeleteFunc(ps, func(p Param) bool { return p.Name == "gain" })
		}, `the checkpoint's parameter 4 ("gain", [7] 7 fp16) is not one of the engine's`},
		{"the checkpoint lacks one", func(ps []Param) []Param {
			return append(ps, Param{Name: "extra", Shape: []int{3}, Group: 1})
		}, `the engine's parameter 6 ("extra") is not in the checkpoint`},
		{"another shape", func(ps []Param) []Param {
			for i := range ps {
				if ps[i].Name == "fc1.weight" {
					ps[i].Shape = []int{8, 24}
				}
			}
			return ps
		}, `("fc1.weight") is [24 8] 192 fp16 (group 0, frozen false) in the checkpoint, the engine's is [8 24] 192`},
	} {
		t.Run(c.name, func(t *testing.T) {
			m := *s
			m.Params = c.edit(slices.Clone(s.Params))
			file := filepath.Join(t.TempDir(), "state.safetensors")
			err := zero.RunLocal(2, func(comm zero.Comm) error {
				e, params, err := engineFor(&m, comm, shape{2, 2, 0, 1})
				if err != nil {
					return err
				}
				defer e.Close()
				before, err := snapshot(t, e, params, file)
				if err != nil {
					return err
				}
				_, lerr := loadInto(e, dir)
				if !errors.Is(lerr, zero.ErrCheckpoint) || errors.Is(lerr, zero.ErrCollective) || !strings.Contains(fmt.Sprint(lerr), c.say) {
					return fmt.Errorf("rank %d: %v; want ErrCheckpoint saying %q", comm.Rank(), lerr, c.say)
				}
				after, err := snapshot(t, e, params, file)
				if err != nil {
					return err
				}
				if comm.Rank() == 0 && !reflect.DeepEqual(before, after) {
					return errors.New("the refused load changed the engine")
				}
				return nil
			})
			if err != nil {
				t.Fatal(err)
			}
		})
	}
}
