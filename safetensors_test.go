package zero

import (
	"bytes"
	"cmp"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	randv2 "math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"slices"
	"strings"
	"testing"
	"time"
)

// The safetensors tests: exports read back by a reader of the test's own
// (and by Python's safetensors package, where it is installed), against
// the engine's state assembled per parameter; imports of files the test
// writes itself (and that Python wrote), against their values.

// stParam is a parameter of the tests' model.
type stParam struct {
	name   string
	shape  []int // nil: a vector of count
	count  int
	frozen bool
	group  int
}

// stModel has a matrix larger than a bucket, vectors, a single element,
// an empty parameter and a frozen one, in two groups.
var stModel = []stParam{
	{"embed.weight", []int{37, 9}, 333, false, 0},
	{"embed.frozen", []int{5, 3}, 15, true, 0},
	{"block.0.w", []int{16, 40}, 640, false, 0},
	{"block.0.b", nil, 40, false, 1},
	{"scale", nil, 1, false, 1},
	{"empty", []int{0}, 0, false, 0},
	{"head.weight", []int{3, 43}, 129, false, 0},
}

// stCase is one configuration of the export tests.
type stCase struct {
	world, stage int
	dtype        DType
	offload      bool
	opt          string // "adamw", "amsgrad", "sgd", "sgd-plain" (no momentum)
}

func (c stCase) String() string {
	return fmt.Sprintf("W%d/z%d/%v/offload=%v/%s", c.world, c.stage, c.dtype, c.offload, c.opt)
}

func (c stCase) config() Config {
	var groups []Optimizer
	switch c.opt {
	case "sgd", "sgd-plain":
		s := NewSGD(0.05)
		if c.opt == "sgd" {
			s.Momentum = 0.9
		}
		groups = []Optimizer{s, s}
	default:
		a := NewAdamW(0.01)
		a.AMSGrad = c.opt == "amsgrad"
		a.WeightDecay = 0.1
		b := NewAdamW(0.02)
		groups = []Optimizer{a, b}
	}
	cfg := Config{Stage: c.stage, BucketBytes: 512, Optimizer: OptimizerPolicy{Groups: groups},
		Offload: OffloadPolicy{Optimizer: c.offload}}
	if c.dtype == FP16 {
		cfg.Precision.LossScale = LossScale{Static: 1}
	}
	return cfg
}

// stValues are seeded random values for the model, rounded to dt: the
// same on every rank.
func stValues(seed uint64, dt DType) [][]float32 {
	rng := randv2.New(randv2.NewPCG(seed, 7))
	out := make([][]float32, len(stModel))
	for p, m := range stModel {
		out[p] = make([]float32, m.count)
		for i := range out[p] {
			out[p][i] = refDecode(dt, refEncode(dt, float32(rng.NormFloat64()*0.5)))
		}
	}
	return out
}

// stParams is the model's parameter list in dtype dt with memory holding
// values (nil: no Data).
func stParams(dt DType, values [][]float32) []Param {
	ps := make([]Param, len(stModel))
	for p, m := range stModel {
		ps[p] = Param{Name: m.name, Shape: m.shape, Count: m.count, DType: dt, Frozen: m.frozen, Group: m.group}
		if values != nil {
			ps[p].Data = toDType(values[p], dt)
		}
	}
	return ps
}

// stTrain builds engines for c from params(rank), takes steps steps of
// seeded random gradients, runs fn on every rank, and returns each rank's
// state after it.
func stTrain(t *testing.T, c stCase, seed uint64, steps int, params func(rank int) ([]Param, error), fn func(e *Engine, rank int) error) []ckptState {
	t.Helper()
	return stTrainWith(t, c, c.config(), seed, steps, params, fn)
}

// stTrainWith is stTrain with the engines built from cfg.
func stTrainWith(t *testing.T, c stCase, cfg Config, seed uint64, steps int, params func(rank int) ([]Param, error), fn func(e *Engine, rank int) error) []ckptState {
	t.Helper()
	comms, err := NewLocalGroup(c.world)
	if err != nil {
		t.Fatal(err)
	}
	out := make([]ckptState, c.world)
	errs := eachRank(c.world, func(rank int) error {
		defer comms[rank].Close()
		ps, err := params(rank)
		if err != nil {
			return err
		}
		e, err := New(cfg, comms[rank], ps)
		if err != nil {
			return err
		}
		defer e.Close()
		s := NewHostStream()
		defer s.Close()
		rng := randv2.New(randv2.NewPCG(seed, uint64(rank)+100))
		for range steps {
			if err := forward(e, s); err != nil {
				return err
			}
			for p := len(ps) - 1; p >= 0; p-- {
				if ps[p].Frozen {
					continue
				}
				g := make([]float32, ps[p].Count)
				for i := range g {
					g[i] = float32(rng.NormFloat64())
				}
				if _, err := e.GradReady(p, toDType(g, c.dtype), s); err != nil {
					return err
				}
			}
			if err := e.EndBackward(); err != nil {
				return err
			}
			if err := e.Step(); err != nil {
				return err
			}
		}
		if fn != nil {
			if err := fn(e, rank); err != nil {
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

// ---- a reader and a writer of the test's own -------------------------------------

type stEntry struct {
	DType   string `json:"dtype"`
	Shape   []int  `json:"shape"`
	Offsets []int  `json:"data_offsets"`
}

// stParsed is a safetensors file as the test reads it.
type stParsed struct {
	meta    map[string]string
	tensors map[string]stEntry
	data    []byte
	hdrLen  int
}

// parseSafetensors reads b as the format's description says, and checks
// what the format requires: the header's length a multiple of 8, its
// JSON, every tensor's bytes those of its shape, and the tensors covering
// the data back to back.
func parseSafetensors(b []byte) (stParsed, error) {
	var f stParsed
	if len(b) < 8 {
		return f, errors.New("shorter than 8 bytes")
	}
	n := int(binary.LittleEndian.Uint64(b))
	if n%8 != 0 || 8+n > len(b) {
		return f, fmt.Errorf("a header of %d bytes (not a multiple of 8, or past the end)", n)
	}
	f.hdrLen, f.data = n, b[8+n:]
	var all map[string]json.RawMessage
	if err := json.Unmarshal(b[8:8+n], &all); err != nil {
		return f, err
	}
	f.tensors = map[string]stEntry{}
	type span struct{ lo, hi int }
	var spans []span
	for k, v := range all {
		if k == "__metadata__" {
			if err := json.Unmarshal(v, &f.meta); err != nil {
				return f, err
			}
			continue
		}
		var e stEntry
		if err := json.Unmarshal(v, &e); err != nil {
			return f, err
		}
		size := map[string]int{"F32": 4, "BF16": 2, "F16": 2}[e.DType]
		elems := 1
		for _, d := range e.Shape {
			elems *= d
		}
		if size == 0 || len(e.Offsets) != 2 || e.Offsets[1]-e.Offsets[0] != elems*size || e.Offsets[1] > len(f.data) {
			return f, fmt.Errorf("tensor %q: %+v", k, e)
		}
		f.tensors[k] = e
		spans = append(spans, span{e.Offsets[0], e.Offsets[1]})
	}
	slices.SortFunc(spans, func(a, b span) int { return cmp.Or(a.lo-b.lo, a.hi-b.hi) })
	end := 0
	for _, s := range spans {
		if s.lo != end {
			return f, fmt.Errorf("a gap or an overlap at data byte %d", end)
		}
		end = s.hi
	}
	if end != len(f.data) {
		return f, fmt.Errorf("the tensors end at %d of %d data bytes", end, len(f.data))
	}
	return f, nil
}

func (f stParsed) bytesOf(name string) []byte {
	e := f.tensors[name]
	return f.data[e.Offsets[0]:e.Offsets[1]]
}

// stOut is a tensor the test writes.
type stOut struct {
	name  string
	dtype string
	shape []int
	data  []byte
}

// writeSafetensors writes tensors (in the given order) and meta as the
// format's description says: the header by encoding/json, padded with
// spaces to a multiple of 8.
func writeSafetensors(t *testing.T, path string, tensors []stOut, meta map[string]string) {
	t.Helper()
	hdr := map[string]any{}
	if meta != nil {
		hdr["__metadata__"] = meta
	}
	var data []byte
	for _, x := range tensors {
		shape := x.shape
		if shape == nil {
			shape = []int{}
		}
		hdr[x.name] = stEntry{DType: x.dtype, Shape: shape, Offsets: []int{len(data), len(data) + len(x.data)}}
		data = append(data, x.data...)
	}
	j, err := json.Marshal(hdr)
	if err != nil {
		t.Fatal(err)
	}
	for len(j)%8 != 0 {
		j = append(j, ' ')
	}
	out := binary.LittleEndian.AppendUint64(nil, uint64(len(j)))
	out = append(append(out, j...), data...)
	if err := os.WriteFile(path, out, 0o644); err != nil {
		t.Fatal(err)
	}
}

// le32 is x as little-endian fp32 bytes.
func le32(x []float32) []byte {
	b := make([]byte, 4*len(x))
	for i, v := range x {
		binary.LittleEndian.PutUint32(b[4*i:], math.Float32bits(v))
	}
	return b
}

// leDType is x rounded to d, as little-endian bytes.
func leDType(x []float32, d DType) []byte {
	if d == FP32 {
		return le32(x)
	}
	b := make([]byte, 2*len(x))
	for i, v := range x {
		binary.LittleEndian.PutUint16(b[2*i:], uint16(refEncode(d, v)))
	}
	return b
}

func shapeOf(m stParam) []int {
	if m.shape == nil {
		return []int{m.count}
	}
	return m.shape
}

// ---- export -----------------------------------------------------------------------

// TestSafetensorsExport: after two steps, ExportSafetensors writes one file
// whose header the test's own reader accepts (8-byte aligned, tensors
// covering the data) with every parameter by name and shape, as F32: a
// trained one's values the fp32 master bit for bit (a 16-bit model's
// master, not its rounded parameters), the frozen one rank 0's Data
// widened; with the optimizer, each state tensor under torch's name, bit
// for bit the engine's moments, amsgrad maximum or momentum, and the step
// count. Over world sizes 1-4, stages 1-3, fp32, bf16 and fp16, offload
// on and off, AdamW with and without amsgrad, SGD with and without
// momentum. CheckpointToSafetensors from a checkpoint saved at the same
// point writes the same tensors, byte for byte, but the frozen one, which
// a checkpoint does not hold; nothing else is left in the directory.
func TestSafetensorsExport(t *testing.T) {
	seed := seedFromEnv(t)
	for _, c := range []stCase{
		{2, 1, FP32, false, "amsgrad"},
		{3, 2, BF16, true, "adamw"},
		{2, 3, BF16, false, "sgd"},
		{4, 3, FP16, true, "amsgrad"},
		{1, 2, FP32, false, "sgd-plain"},
		{3, 3, FP32, true, "adamw"},
	} {
		dir := t.TempDir()
		file, plain, ckpt := filepath.Join(dir, "model.safetensors"), filepath.Join(dir, "plain.safetensors"), filepath.Join(dir, "ckpt")
		values := stValues(seed, c.dtype)
		states := stTrain(t, c, seed, 2, func(int) ([]Param, error) { return stParams(c.dtype, values), nil }, func(e *Engine, rank int) error {
			if err := e.Save(ckpt, SaveOptions{}); err != nil {
				return err
			}
			if err := e.ExportSafetensors(plain, ExportOptions{Metadata: map[string]string{"run": "test"}}); err != nil {
				return err
			}
			return e.ExportSafetensors(file, ExportOptions{Optimizer: true, Metadata: map[string]string{"run": "test"}})
		})
		if err := CheckpointToSafetensors(ckpt, filepath.Join(dir, "offline.safetensors"), ExportOptions{Optimizer: true, Metadata: map[string]string{"run": "test"}}); err != nil {
			t.Fatalf("%v: %v", c, err)
		}
		full, err := consolidate(states)
		if err != nil {
			t.Fatal(err)
		}
		want := map[string][]byte{} // name → bytes
		masterDiffers := false
		for p, m := range stModel {
			if m.frozen {
				want[m.name] = le32(values[p]) // widened exactly: values are dt's
				continue
			}
			want[m.name] = full["master"][p]
			for i, x := range states[0].params[p] {
				masterDiffers = masterDiffers || math.Float32bits(x) != binary.LittleEndian.Uint32(full["master"][p][4*i:])
			}
			steps := le32([]float32{float32(states[0].steps[p])})
			switch c.opt {
			case "adamw", "amsgrad":
				want[m.name+".exp_avg"], want[m.name+".exp_avg_sq"], want[m.name+".step"] = full["m"][p], full["v"][p], steps
				if c.opt == "amsgrad" && m.group == 0 { // the second group has no amsgrad
					want[m.name+".max_exp_avg_sq"] = full["vmax"][p]
				}
			case "sgd":
				want[m.name+".momentum_buffer"] = full["m"][p]
			}
		}
		if c.dtype != FP32 && !masterDiffers {
			t.Fatalf("%v: the master equals the rounded parameters: the test cannot tell them apart", c)
		}
		shapes := map[string][]int{}
		for _, m := range stModel {
			for name := range want {
				if name == m.name || strings.HasPrefix(name, m.name+".") {
					shapes[name] = shapeOf(m)
					if strings.HasSuffix(name, ".step") {
						shapes[name] = []int{}
					}
				}
			}
		}
		check := func(which, path string, want map[string][]byte) stParsed {
			b, err := os.ReadFile(path)
			if err != nil {
				t.Fatal(err)
			}
			f, err := parseSafetensors(b)
			if err != nil {
				t.Fatalf("%v: %s: %v", c, which, err)
			}
			if len(f.tensors) != len(want) {
				t.Fatalf("%v: %s holds %d tensors, want %d", c, which, len(f.tensors), len(want))
			}
			for name, w := range want {
				e, ok := f.tensors[name]
				switch {
				case !ok:
					t.Fatalf("%v: %s has no tensor %q", c, which, name)
				case e.DType != "F32" || !slices.Equal(e.Shape, shapes[name]):
					t.Fatalf("%v: %s: %q is %s %v, want F32 %v", c, which, name, e.DType, e.Shape, shapes[name])
				case !bytes.Equal(f.bytesOf(name), w):
					t.Fatalf("%v: %s: the values of %q differ from the engine's (byte %d)", c, which, name, firstByteDiff(f.bytesOf(name), w))
				}
			}
			if f.meta["format"] != "pt" || f.meta["zero.step"] != "2" || f.meta["run"] != "test" {
				t.Fatalf("%v: %s: metadata %v", c, which, f.meta)
			}
			return f
		}
		exported := check("the export", file, want)
		params := map[string][]byte{}
		for _, m := range stModel {
			params[m.name] = want[m.name]
		}
		check("the export without the optimizer", plain, params)
		offline := map[string][]byte{}
		for name, b := range want {
			if name != "embed.frozen" {
				offline[name] = b
			}
		}
		got := check("the export of the checkpoint", filepath.Join(dir, "offline.safetensors"), offline)
		for name := range offline {
			if !bytes.Equal(got.bytesOf(name), exported.bytesOf(name)) {
				t.Fatalf("%v: %q differs between the two exports", c, name)
			}
		}
		ents, _ := os.ReadDir(dir)
		if len(ents) != 4 {
			var names []string
			for _, e := range ents {
				names = append(names, e.Name())
			}
			t.Fatalf("%v: the directory holds %v; want the three files and the checkpoint", c, names)
		}
	}
}

// TestSafetensorsExportRefusals: an export refused before its file exists
// (a frozen parameter without memory; a rank that cannot open
// the file rank 0 created, as on another node's disk) returns ErrCheckpoint
// or ErrParam on every rank, leaves no file behind, and the engine goes on.
func TestSafetensorsExportRefusals(t *testing.T) {
	seed := seedFromEnv(t)
	c := stCase{2, 2, FP32, false, "adamw"}
	values := stValues(seed, FP32)
	dir := t.TempDir()
	file := filepath.Join(dir, "m.safetensors")
	errs := make([]error, 2)
	stTrain(t, c, seed, 1, func(rank int) ([]Param, error) {
		ps := stParams(FP32, values)
		ps[1].Data = Tensor{} // frozen without memory
		return ps, nil
	}, func(e *Engine, rank int) error {
		errs[rank] = e.ExportSafetensors(file, ExportOptions{})
		return nil
	})
	for rank, err := range errs {
		if !errors.Is(err, ErrParam) && !errors.Is(err, ErrCheckpoint) || errors.Is(err, ErrCollective) {
			t.Fatalf("frozen without memory: rank %d: %v", rank, err)
		}
	}
	if !strings.Contains(errs[0].Error(), "embed.frozen") {
		t.Fatalf("the error does not name the parameter: %v", errs[0])
	}
	// rank 1 writes through a file layer that sees none of rank 0's files
	stTrain(t, c, seed, 1, func(int) ([]Param, error) { return stParams(FP32, values), nil }, func(e *Engine, rank int) error {
		if rank == 1 {
			e.files = elsewhereFS{}
		}
		errs[rank] = e.ExportSafetensors(file, ExportOptions{})
		e.files = nil
		if err := e.ExportSafetensors(filepath.Join(dir, "after.safetensors"), ExportOptions{}); err != nil {
			return fmt.Errorf("the export after the refused one: %w", err)
		}
		return nil
	})
	if !errors.Is(errs[1], ErrCheckpoint) || !strings.Contains(errs[1].Error(), "every rank shares") || !errors.Is(errs[0], ErrCheckpoint) {
		t.Fatalf("a rank on another disk: %v / %v", errs[0], errs[1])
	}
	ents, _ := os.ReadDir(dir)
	if len(ents) != 1 || ents[0].Name() != "after.safetensors" {
		t.Fatalf("the refused exports left %d files behind", len(ents))
	}
}

// elsewhereFS is a file layer on a disk of its own: it opens nothing.
type elsewhereFS struct{ osFS }

func (elsewhereFS) OpenWrite(name string) (ckptFile, error) { return nil, os.ErrNotExist }

// ---- import -----------------------------------------------------------------------

// stFileFor writes the model's values into a file of the test's own
// writer: each parameter in dtype d (the frozen one too), the tensors in
// reverse order, and a tensor no parameter names.
func stFileFor(t *testing.T, path string, values [][]float32, d DType) {
	var out []stOut
	for p := len(stModel) - 1; p >= 0; p-- {
		m := stModel[p]
		out = append(out, stOut{m.name, stDType(d), shapeOf(m), leDType(values[p], d)})
	}
	out = append(out, stOut{"unused.bias", "F32", []int{2}, le32([]float32{1, 2})})
	writeSafetensors(t, path, out, map[string]string{"format": "pt"})
}

// TestSafetensorsImport: ImportSafetensors then New gives every rank the
// file's values, at stages 1-3 and world sizes 1-3: the parameters (FullParams)
// and the fp32 master, bit for bit, in the file's dtype or, with Convert,
// rounded to the parameter's (F32 into bf16, ties to even) or widened (F16
// into fp32); the frozen parameter in its Data. At stage 3 New reads
// through the Init ImportSafetensors set, and each rank's Init is asked
// for exactly its own shard's range of each parameter and nothing more.
// An export of the imported engine gives back the file's fp32 tensors bit
// for bit.
func TestSafetensorsImport(t *testing.T) {
	seed := seedFromEnv(t)
	for _, tc := range []struct {
		world, stage int
		file, model  DType
	}{
		{2, 1, FP32, FP32}, {3, 2, BF16, BF16}, {2, 3, FP32, FP32}, {3, 3, BF16, BF16},
		{1, 3, FP16, FP16}, {2, 3, FP32, BF16}, {2, 2, FP32, BF16}, {3, 3, FP16, FP32}, {2, 1, FP16, FP32},
	} {
		name := fmt.Sprintf("W%d/z%d/file %v/model %v", tc.world, tc.stage, tc.file, tc.model)
		dir := t.TempDir()
		src := filepath.Join(dir, "in.safetensors")
		values := stValues(seed, tc.file) // the file's values, exact in its dtype
		stFileFor(t, src, values, tc.file)
		want := make([][]float32, len(values)) // the parameters': rounded to the model dtype
		for p := range values {
			want[p] = make([]float32, len(values[p]))
			for i, v := range values[p] {
				want[p][i] = refDecode(tc.model, refEncode(tc.model, v))
			}
		}
		c := stCase{tc.world, tc.stage, tc.model, false, "adamw"}
		cfg := c.config()
		asked := make([][][2]int, tc.world) // per rank: the (parameter, offset) pairs Init was asked for, with counts
		counts := make([][]int, tc.world)
		out := filepath.Join(dir, "out.safetensors")
		var frozen []float32 // rank 0's frozen Data after the import
		states := stTrain(t, c, seed, 0, func(rank int) ([]Param, error) {
			ps := stParams(tc.model, nil)
			for p := range ps {
				if tc.stage < 3 || ps[p].Frozen {
					ps[p].Data = toDType(make([]float32, ps[p].Count), tc.model)
				}
			}
			err := ImportSafetensors(src, cfg, CPU(), ps, ImportOptions{Convert: tc.file != tc.model})
			if err != nil {
				return nil, err
			}
			for p := range ps {
				if tc.stage == 3 && !ps[p].Frozen && ps[p].Count > 0 {
					if ps[p].Init == nil || ps[p].Data.count != 0 {
						return nil, fmt.Errorf("stage 3: parameter %d has no Init, or Data", p)
					}
					init := ps[p].Init
					ps[p].Init = func(dst []float32, offset int) error {
						asked[rank] = append(asked[rank], [2]int{p, offset})
						counts[rank] = append(counts[rank], len(dst))
						return init(dst, offset)
					}
				}
			}
			if rank == 0 {
				frozen = make([]float32, ps[1].Count)
				for i := range frozen {
					if tc.model == FP32 {
						frozen[i] = ps[1].Data.HostFloat32s()[i]
					} else {
						frozen[i] = refDecode(tc.model, uint32(ps[1].Data.HostHalfs()[i]))
					}
				}
			}
			return ps, nil
		}, func(e *Engine, rank int) error {
			return e.ExportSafetensors(out, ExportOptions{})
		})
		for rank, st := range states {
			for p := range stModel {
				if stModel[p].frozen {
					continue
				}
				for i, x := range st.params[p] {
					if math.Float32bits(x) != math.Float32bits(want[p][i]) {
						t.Fatalf("%s rank %d: parameter %q element %d is %v, the file's %v rounded is %v", name, rank, stModel[p].name, i, x, values[p][i], want[p][i])
					}
				}
			}
			if tc.stage != 3 {
				continue
			}
			var wantAsked [][2]int
			var wantCounts []int
			for p := range stModel {
				if r := st.plan.shardRange(p, rank); r.Count > 0 {
					wantAsked, wantCounts = append(wantAsked, [2]int{p, r.ParamOffset}), append(wantCounts, r.Count)
				}
			}
			if !slices.Equal(asked[rank], wantAsked) || !slices.Equal(counts[rank], wantCounts) {
				t.Fatalf("%s rank %d: Init was asked for %v (counts %v), the rank's ranges are %v (%v)", name, rank, asked[rank], counts[rank], wantAsked, wantCounts)
			}
		}
		if !slices.EqualFunc(frozen, want[1], func(a, b float32) bool { return math.Float32bits(a) == math.Float32bits(b) }) {
			t.Fatalf("%s: the frozen parameter's Data %v, want %v", name, frozen, want[1])
		}
		full, err := consolidate(states)
		if err != nil {
			t.Fatal(err)
		}
		b, err := os.ReadFile(out)
		if err != nil {
			t.Fatal(err)
		}
		f, err := parseSafetensors(b)
		if err != nil {
			t.Fatal(err)
		}
		for p, m := range stModel {
			if !m.frozen && !bytes.Equal(full["master"][p], le32(want[p])) {
				t.Fatalf("%s: the master of %q is not the imported values", name, m.name)
			}
			if !bytes.Equal(f.bytesOf(m.name), le32(want[p])) {
				t.Fatalf("%s: the export of %q differs from the imported values", name, m.name)
			}
		}
	}
}

// TestSafetensorsParamOffload: at stage 3 with the parameter shard in
// page-locked host memory, ExportSafetensors writes the tensors of the same
// run without it byte for byte (the master, the optimizer's state), and
// ImportSafetensors then New gives every rank the state of the same import
// without it, bit for bit (parameters through FullParams, master, the
// model-dtype shard), with the optimizer on the device and offloaded, in
// fp32 and bf16.
func TestSafetensorsParamOffload(t *testing.T) {
	seed := seedFromEnv(t)
	for _, dt := range []DType{FP32, BF16} {
		for _, offload := range []bool{false, true} {
			c := stCase{2, 3, dt, offload, "amsgrad"}
			dir := t.TempDir()
			values := stValues(seed, dt)
			src := filepath.Join(dir, "in.safetensors")
			stFileFor(t, src, values, dt)
			var exports [2]stParsed
			var imported [2][]ckptState
			for i, onHost := range []bool{false, true} {
				cfg := c.config()
				cfg.Offload.Params = onHost
				file := filepath.Join(dir, fmt.Sprintf("out-%v.safetensors", onHost))
				stTrainWith(t, c, cfg, seed, 2, func(int) ([]Param, error) { return stParams(dt, values), nil }, func(e *Engine, rank int) error {
					if st := e.Stats(); (st.HostParamBytes > 0) != onHost {
						return fmt.Errorf("parameter shard on the host %v: %d host bytes of it", onHost, st.HostParamBytes)
					}
					return e.ExportSafetensors(file, ExportOptions{Optimizer: true})
				})
				b, err := os.ReadFile(file)
				if err != nil {
					t.Fatal(err)
				}
				if exports[i], err = parseSafetensors(b); err != nil {
					t.Fatal(err)
				}
				imported[i] = stTrainWith(t, c, cfg, seed, 0, func(int) ([]Param, error) {
					ps := stParams(dt, nil)
					for p := range ps {
						if ps[p].Frozen {
							ps[p].Data = toDType(make([]float32, ps[p].Count), dt)
						}
					}
					return ps, ImportSafetensors(src, cfg, CPU(), ps, ImportOptions{})
				}, nil)
			}
			name := fmt.Sprintf("%v offload=%v", dt, offload)
			if len(exports[0].tensors) < len(stModel) || !reflect.DeepEqual(exports[0].tensors, exports[1].tensors) ||
				!bytes.Equal(exports[0].data, exports[1].data) || !reflect.DeepEqual(exports[0].meta, exports[1].meta) {
				t.Fatalf("%s: the export with the parameter shard on the host differs from the one without", name)
			}
			for rank := range imported[0] {
				a, b := imported[0][rank], imported[1][rank]
				for sec, x := range a.state {
					if !bytes.Equal(x, b.state[sec]) {
						t.Fatalf("%s rank %d: the import with the parameter shard on the host differs from the one without in %s", name, rank, sec)
					}
				}
				for p := range a.params {
					if !slices.EqualFunc(a.params[p], b.params[p], func(x, y float32) bool { return math.Float32bits(x) == math.Float32bits(y) }) {
						t.Fatalf("%s rank %d: parameter %d reads differently with the parameter shard on the host", name, rank, p)
					}
				}
				for p, m := range stModel {
					if !m.frozen && !slices.Equal(imported[1][rank].params[p], values[p]) {
						t.Fatalf("%s rank %d: parameter %q reads other values than the file's", name, rank, m.name)
					}
				}
			}
		}
	}
}

// TestSafetensorsImportRefusals: a file that does not fit the parameters,
// or is damaged, is refused before anything is written (every parameter's
// Data and Init as they were, though the mismatch is in the last one),
// with ErrCheckpoint (and ErrDType for a dtype, ErrParam for the caller's
// memory) naming the tensor or the file.
func TestSafetensorsImportRefusals(t *testing.T) {
	seed := seedFromEnv(t)
	values := stValues(seed, FP32)
	dir := t.TempDir()
	good := filepath.Join(dir, "good.safetensors")
	stFileFor(t, good, values, FP32)
	raw, err := os.ReadFile(good)
	if err != nil {
		t.Fatal(err)
	}
	last := len(stModel) - 1
	rewrite := func(name string, f func([]byte) []byte) string {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, f(slices.Clone(raw)), 0o644); err != nil {
			t.Fatal(err)
		}
		return p
	}
	// the file with tensor q changed, as the test's writer writes it
	variantAt := func(name string, q int, edit func(*stOut)) string {
		var out []stOut
		for p := len(stModel) - 1; p >= 0; p-- {
			m := stModel[p]
			x := stOut{m.name, "F32", shapeOf(m), le32(values[p])}
			if p == q {
				edit(&x)
			}
			out = append(out, x)
		}
		path := filepath.Join(dir, name)
		writeSafetensors(t, path, out, nil)
		return path
	}
	variant := func(name string, edit func(*stOut)) string { return variantAt(name, last, edit) }
	hdr := int(binary.LittleEndian.Uint64(raw))
	// with element i of the last tensor's values, in dtype d, the bits v
	poisoned := func(name string, d DType, i int, v uint32) string {
		return variant(name, func(x *stOut) {
			x.dtype, x.data = stDType(d), leDType(values[last], d)
			if d == FP32 {
				binary.LittleEndian.PutUint32(x.data[4*i:], v)
			} else {
				binary.LittleEndian.PutUint16(x.data[2*i:], uint16(v))
			}
		})
	}
	strict, finite := ImportOptions{Strict: true}, ImportOptions{RequireFinite: true, Convert: true}
	for _, tc := range []struct {
		name  string
		file  string
		stage int
		edit  func([]Param)
		kinds []error
		says  string
		opt   ImportOptions
	}{
		{"a parameter the file lacks", good, 2, func(ps []Param) { ps[last].Name = "head.weights" }, []error{ErrCheckpoint}, `"head.weights"`, ImportOptions{}},
		{"another shape", good, 2, func(ps []Param) { ps[last].Shape = []int{43, 3} }, []error{ErrCheckpoint}, "head.weight", ImportOptions{}},
		{"another count", good, 3, func(ps []Param) { ps[last].Shape, ps[last].Count = nil, 128 }, []error{ErrCheckpoint}, "head.weight", ImportOptions{}},
		{"another dtype", variant("bf16.safetensors", func(x *stOut) { x.dtype, x.data = "BF16", leDType(values[last], BF16) }), 2, nil, []error{ErrCheckpoint, ErrDType}, "BF16", ImportOptions{}},
		{"a dtype zero does not take", variant("i32.safetensors", func(x *stOut) { x.dtype = "I32" }), 3, nil, []error{ErrCheckpoint, ErrDType}, "I32", ImportOptions{}},
		{"no Data at stage 2", good, 2, func(ps []Param) { ps[last].Data = Tensor{} }, []error{ErrParam}, "head.weight", ImportOptions{}},
		{"an Init of the caller's at stage 3", good, 3, func(ps []Param) { ps[last].Init = func([]float32, int) error { return nil } }, []error{ErrParam}, "head.weight", ImportOptions{}},
		{"truncated", rewrite("short.safetensors", func(b []byte) []byte { return b[:len(b)-1] }), 2, nil, []error{ErrCheckpoint}, "short.safetensors", ImportOptions{}},
		{"a header past the end", rewrite("long.safetensors", func(b []byte) []byte { binary.LittleEndian.PutUint64(b, uint64(len(b))); return b }), 2, nil, []error{ErrCheckpoint}, "long.safetensors", ImportOptions{}},
		{"a header that is not JSON", rewrite("json.safetensors", func(b []byte) []byte { b[8] = '['; return b }), 2, nil, []error{ErrCheckpoint}, "json.safetensors", ImportOptions{}},
		{"a tensor's bytes not its shape's", variant("span.safetensors", func(x *stOut) { x.shape = []int{3, 42} }), 2, nil, []error{ErrCheckpoint}, "head.weight", ImportOptions{}},
		{"bytes no tensor holds", rewrite("tail.safetensors", func(b []byte) []byte { return append(b, 0, 0, 0, 0) }), 2, nil, []error{ErrCheckpoint}, "tail.safetensors", ImportOptions{}},
		{"offsets that disagree with the shape", rewrite("gap.safetensors", func(b []byte) []byte {
			s := string(b[8 : 8+hdr])
			i := strings.Index(s, `"data_offsets":[0,`)
			if i < 0 {
				t.Fatal("no tensor at offset 0")
			}
			j := i + len(`"data_offsets":[`)
			copy(b[8+j:], "4")
			return b
		}), 2, nil, []error{ErrCheckpoint}, "gap.safetensors", ImportOptions{}},
		{"not a file", filepath.Join(dir, "none.safetensors"), 2, nil, []error{ErrCheckpoint}, "none.safetensors", ImportOptions{}},
		{"a tensor no parameter names, Strict", good, 2, nil, []error{ErrCheckpoint}, `"unused.bias"`, strict},
		{"a tensor no parameter names, Strict, stage 3", good, 3, nil, []error{ErrCheckpoint}, `"unused.bias"`, strict},
		{"a NaN, RequireFinite", poisoned("nan.safetensors", FP32, 5, 0x7fc00001), 2, nil, []error{ErrCheckpoint}, `"head.weight" holds NaN at element 5`, finite},
		{"-inf in bf16, RequireFinite", poisoned("ninf.safetensors", BF16, 128, 0xff80), 2, nil, []error{ErrCheckpoint}, `"head.weight" holds -Inf at element 128`, finite},
		{"+inf in fp16, RequireFinite", poisoned("inf.safetensors", FP16, 0, 0x7c00), 2, nil, []error{ErrCheckpoint}, `"head.weight" holds +Inf at element 0`, finite},
		{"a fp16 NaN in the frozen parameter at stage 3", variantAt("frozen.safetensors", 1, func(x *stOut) {
			x.dtype, x.data = "F16", leDType(values[1], FP16)
			binary.LittleEndian.PutUint16(x.data[2*14:], 0xfe01)
		}), 3, nil, []error{ErrCheckpoint}, `"embed.frozen" holds NaN at element 14`, finite},
	} {
		ps := stParams(FP32, make([][]float32, len(stModel)))
		for p := range ps {
			x := make([]float32, ps[p].Count)
			for i := range x {
				x[i] = -7
			}
			ps[p].Data = Float32s(x)
			if tc.stage == 3 && !ps[p].Frozen {
				ps[p].Data = Tensor{}
			}
		}
		if tc.edit != nil {
			tc.edit(ps)
		}
		before := slices.Clone(ps)
		err := ImportSafetensors(tc.file, Config{Stage: tc.stage}, CPU(), ps, tc.opt)
		t.Logf("%s: %v", tc.name, err)
		for _, k := range tc.kinds {
			if !errors.Is(err, k) {
				t.Fatalf("%s: %v, want %v", tc.name, err, k)
			}
		}
		if err == nil || !strings.Contains(err.Error(), tc.says) {
			t.Fatalf("%s: %v, want an error naming %s", tc.name, err, tc.says)
		}
		for p := range ps {
			if (ps[p].Init == nil) != (before[p].Init == nil) || ps[p].Data.ptr != before[p].Data.ptr || ps[p].Data.count != before[p].Data.count {
				t.Fatalf("%s: parameter %d changed", tc.name, p)
			}
			if ps[p].Data.count > 0 && slices.ContainsFunc(ps[p].Data.HostFloat32s(), func(v float32) bool { return v != -7 }) {
				t.Fatalf("%s: parameter %d's Data was written", tc.name, p)
			}
		}
	}
}

// TestSafetensorsImportStrictFinite: Strict takes a file whose every
// tensor a parameter names, RequireFinite one of finite values, each
// imported as without them; at stage 3, where New reads through the Init
// ImportSafetensors set, RequireFinite makes New refuse an inf or a NaN in
// what it reads, naming the tensor and the element, and without it the NaN
// arrives as it is.
func TestSafetensorsImportStrictFinite(t *testing.T) {
	seed := seedFromEnv(t)
	values := stValues(seed, FP32)
	path := filepath.Join(t.TempDir(), "model.safetensors")
	stFileFor(t, path, values, FP32) // with "unused.bias"
	ps := append(stParams(FP32, make([][]float32, len(stModel))), Param{Name: "unused.bias", Count: 2, DType: FP32, Frozen: true})
	for p := range ps {
		ps[p].Data = Float32s(make([]float32, ps[p].Count))
	}
	if err := ImportSafetensors(path, Config{Stage: 2}, CPU(), ps, ImportOptions{Strict: true, RequireFinite: true}); err != nil {
		t.Fatal(err)
	}
	for p := range stModel {
		if !slices.Equal(f32bits(ps[p].Data.HostFloat32s()), f32bits(values[p])) {
			t.Fatalf("parameter %d: %v, want the file's %v", p, ps[p].Data.HostFloat32s(), values[p])
		}
	}
	if got := ps[len(stModel)].Data.HostFloat32s(); !slices.Equal(got, []float32{1, 2}) {
		t.Fatalf("unused.bias: %v, want [1 2]", got)
	}

	values[len(stModel)-1][5] = float32(math.NaN())
	stFileFor(t, path, values, FP32)
	for _, require := range []bool{true, false} {
		ps := stParams(FP32, nil)
		for p := range ps {
			if ps[p].Frozen {
				ps[p].Data = Float32s(make([]float32, ps[p].Count))
			}
		}
		cfg := Config{Stage: 3, BucketBytes: 512, Optimizer: OptimizerPolicy{Groups: []Optimizer{NewSGD(0.1), NewSGD(0.1)}}}
		if err := ImportSafetensors(path, cfg, CPU(), ps, ImportOptions{RequireFinite: require}); err != nil {
			t.Fatalf("RequireFinite %v: %v; the Init checks, at New", require, err)
		}
		comms, err := NewLocalGroupTimeout(1, time.Minute)
		if err != nil {
			t.Fatal(err)
		}
		e, err := New(cfg, comms[0], ps)
		if require {
			if err == nil || !strings.Contains(err.Error(), `"head.weight" holds NaN at element 5`) {
				t.Fatalf("New: %v, want the NaN of head.weight refused", err)
			}
			comms[0].Close()
			continue
		}
		if err != nil {
			t.Fatal(err)
		}
		full, err := e.FullParams()
		e.Close()
		comms[0].Close()
		if err != nil {
			t.Fatal(err)
		}
		if got := full[len(stModel)-1][5]; !math.IsNaN(float64(got)) {
			t.Fatalf("without RequireFinite head.weight[5] is %v, want the file's NaN", got)
		}
	}
}

// ---- Python's safetensors ------------------------------------------------------------

// pyModel is the model of testdata/python.safetensors, which
// scripts/safetensors_check.py writes: its values are k/scale for integer
// k from one formula, exact in each tensor's dtype.
var pyModel = []struct {
	name  string
	dtype DType
	shape []int
	mod   int
	scale float32
}{
	{"embed.weight", FP32, []int{3, 5}, 20001, 4096},
	{"norm.weight", FP16, []int{7}, 2001, 512},
	{"head.weight", BF16, []int{2, 4}, 201, 32},
	{"scalar", FP32, []int{}, 20001, 4096},
	{"empty", FP32, []int{0}, 20001, 4096},
}

// pyValues are tensor t's values as the script computes them.
func pyValues(t int) []float32 {
	m := pyModel[t]
	n := 1
	for _, d := range m.shape {
		n *= d
	}
	x := make([]float32, n)
	for i := range x {
		v := (uint64(i)*2654435761 + uint64(t)*40503 + 12345) % (1 << 32)
		x[i] = float32(int(v%uint64(m.mod))-m.mod/2) / m.scale
	}
	return x
}

// importPython imports the Python-written file path into engines at stages
// 2 and 3 (each tensor into a parameter of its dtype; Align 1, so a tensor
// splits across the 2 ranks) and checks the values.
func importPython(t *testing.T, path string) {
	t.Helper()
	for _, stage := range []int{2, 3} {
		for _, dt := range []DType{FP32, FP16, BF16} {
			var ps []Param
			var idx []int
			for i, m := range pyModel {
				if m.dtype != dt {
					continue
				}
				n := len(pyValues(i))
				p := Param{Name: m.name, Shape: m.shape, Count: n, DType: dt}
				if len(m.shape) == 0 {
					p.Shape = nil // a scalar is one element
				}
				if stage < 3 {
					p.Data = toDType(make([]float32, n), dt)
				}
				ps, idx = append(ps, p), append(idx, i)
			}
			comms, err := NewLocalGroup(2)
			if err != nil {
				t.Fatal(err)
			}
			errs := eachRank(2, func(rank int) error {
				defer comms[rank].Close()
				mine := slices.Clone(ps)
				for i := range mine {
					if mine[i].Data.count > 0 {
						mine[i].Data = toDType(make([]float32, mine[i].Count), dt)
					}
				}
				if err := ImportSafetensors(path, Config{Stage: stage}, CPU(), mine, ImportOptions{}); err != nil {
					return err
				}
				e, err := New(Config{Stage: stage, BucketBytes: 64, Align: 1}, comms[rank], mine)
				if err != nil {
					return err
				}
				defer e.Close()
				full, err := e.FullParams()
				if err != nil {
					return err
				}
				for k, i := range idx {
					if want := pyValues(i); !slices.Equal(full[k], want) {
						return fmt.Errorf("%s: %v, want %v", pyModel[i].name, full[k], want)
					}
				}
				return nil
			})
			if err := errors.Join(errs...); err != nil {
				t.Fatalf("%s at stage %d, the %v tensors: %v", path, stage, dt, err)
			}
		}
	}
}

// TestSafetensorsPythonFile: testdata/python.safetensors, written by
// Python's safetensors (scripts/safetensors_check.py write), imports into
// zero with the values the script wrote: F32, F16 and BF16 tensors, a
// scalar, an empty one.
func TestSafetensorsPythonFile(t *testing.T) {
	importPython(t, "testdata/python.safetensors")
}

// TestSafetensorsPython runs Python's safetensors package (installed by
// scripts/install-safetensors.sh into ZERO_SAFETENSORS_PY, which .ci/run
// sets; without it the test skips, but in CI, where it fails): it reads an export of zero (the
// numpy API: names, shapes, dtypes and every value's bits as the engine's
// assembled state has them, and the metadata), and a file it writes
// imports into zero with its values; that file is the committed one, byte
// for byte.
func TestSafetensorsPython(t *testing.T) {
	pydir := os.Getenv("ZERO_SAFETENSORS_PY")
	if pydir == "" && os.Getenv("CI") == "true" {
		t.Fatal("ZERO_SAFETENSORS_PY is not set in CI: .ci/run installs Python's safetensors with scripts/install-safetensors.sh and sets it")
	}
	if pydir == "" {
		t.Skip("ZERO_SAFETENSORS_PY is not set: run scripts/install-safetensors.sh and set it to the folder it prints (.ci/run does)")
	}
	python := func(args ...string) []byte {
		t.Helper()
		cmd := exec.Command("python3", append([]string{"scripts/safetensors_check.py"}, args...)...)
		cmd.Env = append(os.Environ(), "PYTHONPATH="+pydir)
		var stderr bytes.Buffer
		cmd.Stderr = &stderr
		out, err := cmd.Output()
		if err != nil {
			t.Fatalf("python3 scripts/safetensors_check.py %s: %v\n%s", strings.Join(args, " "), err, stderr.String())
		}
		return out
	}
	seed := seedFromEnv(t)
	dir := t.TempDir()
	c := stCase{3, 3, BF16, true, "amsgrad"}
	file := filepath.Join(dir, "zero.safetensors")
	values := stValues(seed, c.dtype)
	states := stTrain(t, c, seed, 2, func(int) ([]Param, error) { return stParams(c.dtype, values), nil }, func(e *Engine, rank int) error {
		return e.ExportSafetensors(file, ExportOptions{Optimizer: true})
	})
	full, err := consolidate(states)
	if err != nil {
		t.Fatal(err)
	}
	var got struct {
		Metadata map[string]string `json:"metadata"`
		Tensors  map[string]struct {
			DType string `json:"dtype"`
			Shape []int  `json:"shape"`
			Hex   string `json:"hex"`
		} `json:"tensors"`
	}
	if err := json.Unmarshal(python("read", file), &got); err != nil {
		t.Fatal(err)
	}
	want := 0
	for p, m := range stModel {
		check := func(name string, b []byte, shape []int) {
			want++
			x, ok := got.Tensors[name]
			if !ok || x.DType != "float32" || !slices.Equal(x.Shape, shape) || x.Hex != fmt.Sprintf("%x", b) {
				t.Fatalf("Python reads %q as %s %v, want float32 %v with the engine's values", name, x.DType, x.Shape, shape)
			}
		}
		if m.frozen {
			check(m.name, le32(values[p]), shapeOf(m))
			continue
		}
		check(m.name, full["master"][p], shapeOf(m))
		check(m.name+".exp_avg", full["m"][p], shapeOf(m))
		check(m.name+".exp_avg_sq", full["v"][p], shapeOf(m))
		check(m.name+".step", le32([]float32{float32(states[0].steps[p])}), []int{})
		if m.group == 0 {
			check(m.name+".max_exp_avg_sq", full["vmax"][p], shapeOf(m))
		}
	}
	if len(got.Tensors) != want || got.Metadata["format"] != "pt" {
		t.Fatalf("Python reads %d tensors (want %d), metadata %v", len(got.Tensors), want, got.Metadata)
	}
	fresh := filepath.Join(dir, "python.safetensors")
	python("write", fresh)
	importPython(t, fresh)
	a, _ := os.ReadFile(fresh)
	b, _ := os.ReadFile("testdata/python.safetensors")
	if !bytes.Equal(a, b) {
		t.Fatalf("Python's safetensors writes another file than testdata/python.safetensors: run scripts/safetensors_check.py write testdata/python.safetensors")
	}
	t.Logf("Python's safetensors read %d tensors of zero's export and wrote a file zero imports", want)
}

// BenchmarkSafetensors exports and imports a model of 4M fp32 elements
// (ZERO_BENCH_ST_ELEMS to change; the largest parameter half of it) on 2
// in-process ranks at stage 3 with AdamW: the export with the optimizer
// state (the master and the moments, 16 bytes an element, written by
// every rank at its own ranges), from device memory and, with offload,
// from host memory; the import through Init into new engines. Metrics:
// MB/s of the file (the export's) or of the parameters it holds (the
// import's); extra-MiB/rank, the Go heap each rank allocates for
// it, beside param-MiB, the largest parameter's fp32 bytes: nothing is
// gathered, so the export's extra memory is one 8 MiB chunk per rank from
// device memory and none from host memory, and the import's one rank's
// range of a parameter (New's upload of Init's values).
func BenchmarkSafetensors(b *testing.B) {
	safetensorsRun(b, hostBench, CPU()) // benchenv_test.go; BenchmarkCUDASafetensors from GPU memory
}

// TestSafetensorsConvertingImportLarge: a converting import of a tensor
// larger than a chunk (3M elements: the import reads and converts it in
// two pieces) gives every element the reference rounding, BF16 widened
// into fp32 and F32 rounded into bf16, the last piece too.
func TestSafetensorsConvertingImportLarge(t *testing.T) {
	rng := testRNG(t)
	const n = 3 << 20
	values := make([]float32, n)
	for i := range values {
		values[i] = float32(rng.NormFloat64())
	}
	for _, tc := range []struct{ file, model DType }{{BF16, FP32}, {FP32, BF16}} {
		path := filepath.Join(t.TempDir(), "big.safetensors")
		writeSafetensors(t, path, []stOut{{"w", stDType(tc.file), []int{n}, leDType(values, tc.file)}}, nil)
		data := newTBuf(tc.model, n)
		ps := []Param{{Name: "w", Count: n, DType: tc.model, Data: data.t()}}
		if err := ImportSafetensors(path, Config{Stage: 2}, CPU(), ps, ImportOptions{Convert: true}); err != nil {
			t.Fatal(err)
		}
		for i, v := range values {
			want := refEncode(tc.model, refDecode(tc.file, refEncode(tc.file, v)))
			if got := data.bits(i); got != want {
				t.Fatalf("file %v, model %v: element %d of %d is %#x, want %#x", tc.file, tc.model, i, n, got, want)
			}
		}
	}
}
