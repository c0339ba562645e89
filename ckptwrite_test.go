package zero

import (
	"errors"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"strings"
	"testing"
)

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
	classes := map[string]SettingClass{"match": MustMatch, "reshard": MatchRanks, "local": RankLocal}
	for _, s := range m.Settings {
		st.Settings = append(st.Settings, Setting{s.Path, s.Value, classes[s.Class]})
	}
	x, err := checkLayout(at, m, st.Params)
	if err != nil {
		t.Fatal(err)
	}
	ld := newLoader(&ckptEngine{fs: osFS{}, params: st.Params}, at, m, x)
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
	client, err := ld.client()
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
