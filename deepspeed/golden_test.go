package deepspeed

import (
	"bufio"
	"bytes"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"encoding/json"
	"errors"
	"io/fs"
	"math"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

const golden = "testdata/golden"

// TestGoldenDigest holds the golden files to SHA256SUMS: each listed file
// has its digest, and every file there is listed.
func TestGoldenDigest(t *testing.T) {
	f, err := os.Open(filepath.Join(golden, "SHA256SUMS"))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	listed := map[string]bool{}
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		sum, name, ok := strings.Cut(sc.Text(), "  ")
		if !ok {
			t.Fatalf("SHA256SUMS line %q", sc.Text())
		}
		b, err := os.ReadFile(filepath.Join(golden, name))
		if err != nil {
			t.Errorf("%s: %v", name, err)
			continue
		}
		h := sha256.Sum256(b)
		if hex.EncodeToString(h[:]) != sum {
			t.Errorf("%s: sha256 %x, SHA256SUMS says %s", name, h, sum)
		}
		listed[name] = true
	}
	if len(listed) < 200 {
		t.Fatalf("SHA256SUMS lists %d files", len(listed))
	}
	filepath.WalkDir(golden, func(path string, d fs.DirEntry, err error) error {
		if err != nil || d.IsDir() {
			return err
		}
		rel, _ := filepath.Rel(golden, path)
		if rel != "SHA256SUMS" && rel != "README.md" && !listed[rel] {
			t.Errorf("%s is not in SHA256SUMS", rel)
		}
		return nil
	})
}

// goldenRun is a run's golden.json, the parts the tests read.
type goldenRun struct {
	Stage      int    `json:"stage"`
	DType      string `json:"dtype"`
	World      int    `json:"world_size"`
	Checkpoint struct {
		GlobalSteps   int         `json:"global_steps"`
		SkippedSteps  int         `json:"skipped_steps"`
		GlobalSamples int         `json:"global_samples"`
		LR            []float64   `json:"lr"`
		LastBatch     int         `json:"scheduler_last_batch_iteration"`
		AdamSteps     [][]float64 `json:"adam_step_per_group"`
		LossScale     float64     `json:"loss_scale"`
		CurIter       *int        `json:"loss_scaler_cur_iter"`
		LastOverflow  *int        `json:"loss_scaler_last_overflow_iter"`
		CurHysteresis *int        `json:"loss_scaler_cur_hysteresis"`
	} `json:"checkpoint"`
	Params []struct {
		Name      string `json:"name"`
		Shape     []int  `json:"shape"`
		Trainable bool   `json:"trainable"`
	} `json:"params"`
	Groups [][]string `json:"param_groups"`
}

func readGolden(t *testing.T, run string) goldenRun {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(golden, run, "golden.json"))
	if err != nil {
		t.Fatal(err)
	}
	var g goldenRun
	if err := json.Unmarshal(b, &g); err != nil {
		t.Fatal(err)
	}
	return g
}

// readST reads a safetensors file, independently of WriteSafetensors.
func readST(t *testing.T, path string) map[string]Tensor {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	n := binary.LittleEndian.Uint64(b)
	var h map[string]json.RawMessage
	if err := json.Unmarshal(b[8:8+n], &h); err != nil {
		t.Fatal(err)
	}
	data := b[8+n:]
	names := map[string]DType{}
	for d := Float32; d.valid(); d++ {
		names[dtypeInfo[d].st] = d
	}
	out := map[string]Tensor{}
	for k, v := range h {
		if k == "__metadata__" {
			continue
		}
		var e struct {
			DType   string   `json:"dtype"`
			Shape   []int    `json:"shape"`
			Offsets [2]int64 `json:"data_offsets"`
		}
		if err := json.Unmarshal(v, &e); err != nil {
			t.Fatal(err)
		}
		out[k] = Tensor{names[e.DType], e.Shape, data[e.Offsets[0]:e.Offsets[1]]}
	}
	return out
}

var goldenRuns = []string{"z1-fp32", "z1-bf16", "z1-fp16", "z2-fp32", "z2-bf16", "z2-fp16", "z3-fp32", "z3-bf16", "z3-fp16", "mlp-z2-fp16"}

// TestReadGolden reads each golden checkpoint (ZeRO-1, 2 and 3) and holds
// every tensor to DeepSpeed's own, bit for bit: the fp32 master, exp_avg
// and exp_avg_sq to what the engine held in memory (safe_get_full_*), the
// model-dtype parameters to its module's (gathered at ZeRO-3, where the
// reader rounds them from the master); and the counters to golden.json.
func TestReadGolden(t *testing.T) {
	for _, run := range goldenRuns {
		t.Run(run, func(t *testing.T) {
			g := readGolden(t, run)
			s, err := Read(filepath.Join(golden, run, "ckpt"))
			if err != nil {
				t.Fatal(err)
			}
			want := readST(t, filepath.Join(golden, run, "state_step3.safetensors"))
			if s.Stage != g.Stage || s.World != g.World || s.DSVersion != "0.19.8" {
				t.Errorf("stage %d world %d version %q, want %d %d 0.19.8", s.Stage, s.World, s.DSVersion, g.Stage, g.World)
			}
			if s.ModelDType.String() != map[string]string{"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}[g.DType] {
				t.Errorf("model dtype %v for a %s run", s.ModelDType, g.DType)
			}
			if len(s.Params) != len(g.Params) {
				t.Fatalf("%d parameters, golden has %d", len(s.Params), len(g.Params))
			}
			compared := 0
			for _, gp := range g.Params {
				p, ok := s.Param(gp.Name)
				if !ok {
					t.Errorf("parameter %s missing", gp.Name)
					continue
				}
				if !sameShape(p.Shape, gp.Shape) || p.Frozen == gp.Trainable {
					t.Errorf("%s: shape %v frozen %v, golden %v trainable %v", gp.Name, p.Shape, p.Frozen, gp.Shape, gp.Trainable)
				}
				compared += sameTensor(t, gp.Name+" (model dtype)", p.Model, want["param/"+gp.Name])
				if p.Frozen {
					continue
				}
				compared += sameTensor(t, gp.Name+" fp32", f32Tensor(p.Shape, p.Master), want["fp32/"+gp.Name])
				compared += sameTensor(t, gp.Name+" exp_avg", f32Tensor(p.Shape, p.ExpAvg), want["exp_avg/"+gp.Name])
				compared += sameTensor(t, gp.Name+" exp_avg_sq", f32Tensor(p.Shape, p.ExpAvgSq), want["exp_avg_sq/"+gp.Name])
				if g.Groups[p.Group][indexOf(g.Groups[p.Group], p.Name)] != p.Name {
					t.Errorf("%s in group %d, golden groups %v", p.Name, p.Group, g.Groups)
				}
			}
			if compared != len(want) {
				t.Errorf("compared %d tensors of the %d DeepSpeed wrote", compared, len(want))
			}
			c := g.Checkpoint
			if s.GlobalSteps != c.GlobalSteps || s.SkippedSteps != c.SkippedSteps || s.GlobalSamples != c.GlobalSamples {
				t.Errorf("steps %d/%d/%d, golden %d/%d/%d", s.GlobalSteps, s.SkippedSteps, s.GlobalSamples, c.GlobalSteps, c.SkippedSteps, c.GlobalSamples)
			}
			if s.Scheduler.LastBatchIteration != c.LastBatch || s.Scheduler.Type != "WarmupLR" {
				t.Errorf("scheduler %+v, golden last_batch_iteration %d", s.Scheduler, c.LastBatch)
			}
			for i, grp := range s.Groups {
				if grp.AdamW.LR != c.LR[i] || float64(grp.Step) != c.AdamSteps[i][0] {
					t.Errorf("group %d: lr %v step %d, golden %v %v", i, grp.AdamW.LR, grp.Step, c.LR[i], c.AdamSteps[i])
				}
				if grp.AdamW.Beta1 != 0.9 || grp.AdamW.Beta2 != 0.999 || grp.AdamW.Eps != 1e-8 || grp.AdamW.WeightDecay != []float64{0.01, 0}[i] {
					t.Errorf("group %d: %+v", i, grp.AdamW)
				}
			}
			if s.Scaler.Scale != c.LossScale || s.Scaler.Dynamic != (g.DType == "fp16") {
				t.Errorf("loss scaler %+v, golden scale %v", s.Scaler, c.LossScale)
			}
			if c.CurIter != nil && (s.Scaler.Iter != *c.CurIter || s.Scaler.LastOverflow != *c.LastOverflow || s.Scaler.CurHysteresis != *c.CurHysteresis) {
				t.Errorf("loss scaler %+v, golden iter %d last overflow %d hysteresis %d", s.Scaler, *c.CurIter, *c.LastOverflow, *c.CurHysteresis)
			}
			if s.Scaler.Dynamic && (s.Scaler.Window != 2 || s.Scaler.Hysteresis != 2 || s.Scaler.Factor != 2) {
				t.Errorf("dynamic scaler settings %+v, the config has window 2, hysteresis 2", s.Scaler)
			}
			if s.ClipGrad != 1 {
				t.Errorf("clip %v", s.ClipGrad)
			}
			var cfg map[string]any
			if err := json.Unmarshal(s.Config, &cfg); err != nil || cfg["gradient_clipping"] != 1.0 {
				t.Errorf("config %s (%v)", s.Config, err)
			}
		})
	}
}

func indexOf(xs []string, x string) int {
	for i, v := range xs {
		if v == x {
			return i
		}
	}
	return 0
}

func f32Tensor(shape []int, x []float32) Tensor { return Tensor{Float32, shape, float32Bytes(x)} }

// sameTensor reports a difference in dtype, shape or any bit; 1 when compared.
func sameTensor(t *testing.T, what string, got, want Tensor) int {
	t.Helper()
	if want.Data == nil {
		t.Errorf("%s: DeepSpeed's golden file has no such tensor", what)
		return 0
	}
	if got.DType != want.DType || !sameShape(got.Shape, want.Shape) {
		t.Errorf("%s: %v %v, DeepSpeed's %v %v", what, got.DType, got.Shape, want.DType, want.Shape)
		return 1
	}
	if !bytes.Equal(got.Data, want.Data) {
		g, _ := got.Float32s()
		w, _ := want.Float32s()
		for i := range g {
			if math.Float32bits(g[i]) != math.Float32bits(w[i]) {
				t.Errorf("%s: element %d is %v, DeepSpeed's %v (and maybe more)", what, i, g[i], w[i])
				break
			}
		}
	}
	return 1
}

// TestConvertMatchesZeroToFP32: the safetensors file written from each
// golden checkpoint, and from its universal layout, is byte for byte
// zero_to_fp32's.
func TestConvertMatchesZeroToFP32(t *testing.T) {
	for _, run := range goldenRuns {
		t.Run(run, func(t *testing.T) {
			for _, src := range []string{"ckpt", "ckpt/global_step3_universal"} {
				s, err := Read(filepath.Join(golden, run, src))
				if err != nil {
					t.Fatal(err)
				}
				out := filepath.Join(t.TempDir(), "model.safetensors")
				if err := WriteSafetensors(out, FP32Tensors(s), map[string]string{"format": "pt"}); err != nil {
					t.Fatal(err)
				}
				convertedLikeZeroToFP32(t, run, src, out)
			}
		})
	}
}

// convertedLikeZeroToFP32 holds the file at out to the run's zero_to_fp32
// output, byte for byte, and names the tensors that differ.
func convertedLikeZeroToFP32(t *testing.T, run, src, out string) {
	t.Helper()
	got, _ := os.ReadFile(out)
	want, err := os.ReadFile(filepath.Join(golden, run, "zero_to_fp32", "model.safetensors"))
	if err != nil {
		t.Fatal(err)
	}
	if bytes.Equal(got, want) {
		return
	}
	t.Errorf("from %s: %d bytes, zero_to_fp32 wrote %d; they differ", src, len(got), len(want))
	w := readST(t, filepath.Join(golden, run, "zero_to_fp32", "model.safetensors"))
	g := readST(t, out)
	for name, wt := range w {
		sameTensor(t, name, g[name], wt)
	}
	if len(g) != len(w) {
		t.Errorf("%d tensors, zero_to_fp32 wrote %d", len(g), len(w))
	}
}

// TestConvertOptimizer: the moments the converter adds are DeepSpeed's.
func TestConvertOptimizer(t *testing.T) {
	for _, run := range []string{"z1-bf16", "z2-fp16"} {
		t.Run(run, func(t *testing.T) {
			s, err := Read(filepath.Join(golden, run, "ckpt"))
			if err != nil {
				t.Fatal(err)
			}
			ts, meta := OptimizerTensors(s)
			out := filepath.Join(t.TempDir(), "opt.safetensors")
			if err := WriteSafetensors(out, append(FP32Tensors(s), ts...), meta); err != nil {
				t.Fatal(err)
			}
			got := readST(t, out)
			want := readST(t, filepath.Join(golden, run, "state_step3.safetensors"))
			n := 0
			for name, w := range want {
				if kind, param, ok := strings.Cut(name, "/"); ok && strings.HasPrefix(kind, "exp_avg") {
					n += sameTensor(t, name, got[param+"."+kind], w)
				}
			}
			if n != 10 {
				t.Errorf("compared %d moments, want 10", n)
			}
			if st := got["gain.step"]; len(st.Shape) != 0 || st.DType != Float32 {
				t.Errorf("gain.step is %v %v", st.DType, st.Shape)
			} else if x, _ := st.Float32s(); x[0] != 3 {
				t.Errorf("gain.step %v, want 3", x)
			}
			var m struct {
				Groups []struct {
					Step   int      `json:"step"`
					Params []string `json:"params"`
				} `json:"groups"`
			}
			if err := json.Unmarshal([]byte(meta["deepspeed_optimizer"]), &m); err != nil || len(m.Groups) != 2 || m.Groups[1].Step != 3 || len(m.Groups[1].Params) != 3 {
				t.Errorf("metadata %s (%v)", meta["deepspeed_optimizer"], err)
			}
		})
	}
}

func isKind(err, kind error) bool { return err != nil && errors.Is(err, kind) }

// TestReadUniversal: each golden checkpoint's universal layout
// (ds_to_universal) reads into the State its checkpoint reads into, every
// tensor bit for bit (so DeepSpeed's own, by TestReadGolden), every
// counter and setting equal.
func TestReadUniversal(t *testing.T) {
	for _, run := range goldenRuns {
		t.Run(run, func(t *testing.T) {
			want, err := Read(filepath.Join(golden, run, "ckpt"))
			if err != nil {
				t.Fatal(err)
			}
			got, err := Read(filepath.Join(golden, run, "ckpt", "global_step3_universal"))
			if err != nil {
				t.Fatal(err)
			}
			sameState(t, got, want)
		})
	}
}

// sameState reports every difference between two States but Dir.
func sameState(t *testing.T, got, want *State) {
	t.Helper()
	if got.Stage != want.Stage || got.World != want.World || got.ModelDType != want.ModelDType || got.DSVersion != want.DSVersion {
		t.Errorf("stage %d world %d dtype %v version %s; want %d %d %v %s", got.Stage, got.World, got.ModelDType, got.DSVersion, want.Stage, want.World, want.ModelDType, want.DSVersion)
	}
	if got.Scaler != want.Scaler || got.Scheduler != want.Scheduler || got.ClipGrad != want.ClipGrad ||
		got.GlobalSteps != want.GlobalSteps || got.SkippedSteps != want.SkippedSteps || got.GlobalSamples != want.GlobalSamples {
		t.Errorf("scalars %+v %+v %v %d %d %d; want %+v %+v %v %d %d %d", got.Scaler, got.Scheduler, got.ClipGrad, got.GlobalSteps, got.SkippedSteps, got.GlobalSamples,
			want.Scaler, want.Scheduler, want.ClipGrad, want.GlobalSteps, want.SkippedSteps, want.GlobalSamples)
	}
	if len(got.Groups) != len(want.Groups) {
		t.Fatalf("%d groups, want %d", len(got.Groups), len(want.Groups))
	}
	for i := range got.Groups {
		if got.Groups[i] != want.Groups[i] {
			t.Errorf("group %d: %+v, want %+v", i, got.Groups[i], want.Groups[i])
		}
	}
	if !bytes.Equal(got.Config, want.Config) {
		t.Errorf("config %s, want %s", got.Config, want.Config)
	}
	if len(got.Params) != len(want.Params) || len(got.Buffers) != len(want.Buffers) {
		t.Fatalf("%d parameters %d buffers, want %d %d", len(got.Params), len(got.Buffers), len(want.Params), len(want.Buffers))
	}
	for i, w := range want.Params {
		g := got.Params[i]
		if g.Name != w.Name || !sameShape(g.Shape, w.Shape) || g.Group != w.Group || g.Frozen != w.Frozen || g.Step != w.Step {
			t.Errorf("parameter %d: %s %v group %d frozen %v step %d; want %s %v %d %v %d", i, g.Name, g.Shape, g.Group, g.Frozen, g.Step, w.Name, w.Shape, w.Group, w.Frozen, w.Step)
			continue
		}
		sameTensor(t, w.Name+" model", g.Model, w.Model)
		if !w.Frozen {
			sameTensor(t, w.Name+" fp32", f32Tensor(g.Shape, g.Master), f32Tensor(w.Shape, w.Master))
			sameTensor(t, w.Name+" exp_avg", f32Tensor(g.Shape, g.ExpAvg), f32Tensor(w.Shape, w.ExpAvg))
			sameTensor(t, w.Name+" exp_avg_sq", f32Tensor(g.Shape, g.ExpAvgSq), f32Tensor(w.Shape, w.ExpAvgSq))
		}
	}
	for i, w := range want.Buffers {
		if got.Buffers[i].Name != w.Name {
			t.Errorf("buffer %d: %s, want %s", i, got.Buffers[i].Name, w.Name)
		}
		sameTensor(t, w.Name, got.Buffers[i].Tensor, w.Tensor)
	}
}
