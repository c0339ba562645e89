package main

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"testing"

	"zero"
)

// writeConfig writes a DeepSpeed config into a temporary file.
func writeConfig(t *testing.T, text string) string {
	t.Helper()
	path := filepath.Join(t.TempDir(), "ds_config.json")
	if err := os.WriteFile(path, []byte(text), 0o644); err != nil {
		t.Fatal(err)
	}
	return path
}

// TestDeepSpeedEqualsFlags: a DeepSpeed config that says what the flags
// say (the stage, 64-element buckets, AdamW lr 0.01 with decay 0.01, no
// clipping, a global batch of 24) trains to the same bits as the flags.
func TestDeepSpeedEqualsFlags(t *testing.T) {
	for _, stage := range []int{1, 2, 3} {
		c := traced()
		c.stage, c.steps = stage, 6
		want, err := run(nil, c)
		if err != nil {
			t.Fatal(err)
		}
		c.deepspeed = writeConfig(t, fmt.Sprintf(`{"zero_optimization": {"stage": %d, "reduce_bucket_size": 64},
			"optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.01}},
			"gradient_clipping": 0, "train_batch_size": 24}`, stage))
		c.lr, c.weightDecay, c.batch = 0.5, 0.5, 8 // the file's settings win over the flags
		got, err := run(nil, c)
		if err != nil {
			t.Fatal(err)
		}
		for st := range want.params {
			for p := range want.params[st] {
				for i, w := range want.params[st][p] {
					if math.Float64bits(got.params[st][p][i]) != math.Float64bits(w) {
						t.Fatalf("stage %d, step %d, tensor %d[%d]: %v from the DeepSpeed config, %v from the flags", stage, st, p, i, got.params[st][p][i], w)
					}
				}
			}
		}
	}
}

// TestDeepSpeedHFConfig: the Hugging Face Trainer's bf16 ZeRO-2 config,
// its "auto" values filled from the flags, trains: it prints every notice
// and the settings it took, its WarmupLR starts at rate 0 (the first step
// leaves the parameters as they were), and the loss falls.
func TestDeepSpeedHFConfig(t *testing.T) {
	c := traced()
	c.deepspeed = filepath.Join("..", "..", "testdata", "deepspeed", "hf_ds_config_zero2_bf16.json")
	c.dtype, c.steps, c.accum, c.warmup = zero.BF16, 12, 2, 3
	var out bytes.Buffer
	res, err := run(&out, c)
	if err != nil {
		t.Fatal(err)
	}
	text := out.String()
	for _, want := range []string{"notice zero_optimization.contiguous_gradients", "notice steps_per_print", "settings:",
		"Optimizer.Schedule = WarmupLR (match)", "Optimizer.Schedule.WarmupSteps = 3 (match)", "Optimizer.Groups[0].LR = 0.01 (match)",
		"Grads.AccumSteps = 2 (reshard)", "Precision.ShardDType = bf16", "Offload.Optimizer = true", "ZeRO-2, offloaded"} {
		if !strings.Contains(text, want) {
			t.Errorf("the output has no %q:\n%s", want, text)
		}
	}
	for p := range res.params[0] {
		for i := range res.params[0][p] {
			if res.params[1][p][i] != res.params[0][p][i] {
				t.Fatalf("tensor %d[%d] moved in step 1 (%v to %v): WarmupLR's first rate is warmup_min_lr, 0", p, i, res.params[0][p][i], res.params[1][p][i])
			}
		}
	}
	if last, first := res.loss[len(res.loss)-1], res.loss[1]; !(last < first) {
		t.Errorf("loss %v: it does not fall", res.loss)
	}
	t.Log(text)
}

// TestDeepSpeedFP16: an fp16 config trains with DeepSpeed's dynamic loss
// scale: the first steps overflow at 2^16 and are skipped, the scale
// falls, and then the loss does.
func TestDeepSpeedFP16(t *testing.T) {
	c := traced()
	c.deepspeed = writeConfig(t, `{"zero_optimization": {"stage": 2}, "fp16": {"enabled": true, "hysteresis": 1},
		"optimizer": {"type": "AdamW", "params": {"lr": 0.01}}, "train_micro_batch_size_per_gpu": 12}`)
	c.steps = 16
	var out bytes.Buffer
	res, err := run(&out, c)
	if err != nil {
		t.Fatal(err)
	}
	skipped, firstApplied := 0, -1
	for st, s := range res.stats {
		if s.Skipped {
			skipped++
		} else if firstApplied < 0 {
			firstApplied = st
		}
	}
	if skipped == 0 || firstApplied < 0 || !strings.Contains(out.String(), "scale 65536  skipped: overflow") {
		t.Fatalf("%d skipped steps, first applied %d:\n%s", skipped, firstApplied, out.String())
	}
	if last := res.loss[len(res.loss)-1]; !(last < res.loss[firstApplied]) {
		t.Errorf("loss %v: it does not fall after the scale settles", res.loss)
	}
}

// TestDeepSpeedRefused: a config with keys zero cannot honour fails before
// training, naming every one: the Trainer docs' ZeRO-Infinity config
// offloads to NVMe (its tuning keys are taken with notices).
func TestDeepSpeedRefused(t *testing.T) {
	c := defaultConfig()
	c.deepspeed = filepath.Join("..", "..", "testdata", "deepspeed", "hf_docs_zero3_nvme.json")
	_, err := run(nil, c)
	var ds *zero.DeepSpeedError
	want := []string{"zero_optimization.aio", "zero_optimization.offload_optimizer.device", "zero_optimization.offload_param.device"}
	if !errors.As(err, &ds) || !slices.Equal(ds.Paths(), want) {
		t.Fatalf("%v, want %q refused", err, want)
	}
}

// TestDeepSpeedBatchFromFile: the batch sizes and accumulation steps come
// from the file; the flags fill only its "auto" values (from the file's
// own batch sizes where they decide it, as DeepSpeed derives a missing
// one); a flag set on the command line that the file overrules gets a
// notice; and a split of the flags that does not divide is refused naming
// the flags, those left at their defaults said to be so.
func TestDeepSpeedBatchFromFile(t *testing.T) {
	for _, tc := range []struct {
		name, file string
		batch      int
		given      []string // flags set on the command line
		world      int
		out, err   string
	}{
		{"micro auto, decided by the file", `"train_batch_size": 16, "gradient_accumulation_steps": 2, "train_micro_batch_size_per_gpu": "auto"`,
			24, nil, 2, "global batch 16 in 2 backward(s) per step", ""},
		{"all auto, from the flags", `"train_batch_size": "auto", "gradient_accumulation_steps": "auto", "train_micro_batch_size_per_gpu": "auto"`,
			12, []string{"batch", "accum"}, 2, "global batch 12 in 3 backward(s) per step", ""},
		{"an -accum the file overrules", `"train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 2`,
			24, []string{"accum"}, 2, "notice gradient_accumulation_steps: override 3 not used: the file sets 2", ""},
		{"flags that do not split", `"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto"`,
			24, []string{"world"}, 5, "", "-batch 24 (the default) does not split into -world 5 ranks"},
	} {
		c := defaultConfig()
		c.deepspeed = writeConfig(t, `{"zero_optimization": {"stage": 2}, `+tc.file+`}`)
		c.batch, c.world, c.steps, c.accum = tc.batch, tc.world, 2, 3
		c.given = map[string]bool{}
		for _, f := range tc.given {
			c.given[f] = true
		}
		var out bytes.Buffer
		_, err := run(&out, c)
		if tc.err != "" {
			if err == nil || !strings.Contains(err.Error(), tc.err) {
				t.Errorf("%s: %v, want %q", tc.name, err, tc.err)
			}
			continue
		}
		if err != nil {
			t.Errorf("%s: %v", tc.name, err)
			continue
		}
		if !strings.Contains(out.String(), tc.out) {
			t.Errorf("%s: the output has no %q:\n%s", tc.name, tc.out, out.String())
		}
	}
}

// TestDeepSpeedMalformedBatch: a config whose micro-batch is 0, below 0 or
// not a number fails before training, naming the key (it divided by zero).
func TestDeepSpeedMalformedBatch(t *testing.T) {
	for _, micro := range []string{`0`, `-3`, `"x"`} {
		c := defaultConfig()
		c.deepspeed = writeConfig(t, `{"zero_optimization": {"stage": 2}, "train_batch_size": 8, "train_micro_batch_size_per_gpu": `+micro+`}`)
		var err error
		func() {
			defer func() {
				if p := recover(); p != nil {
					t.Fatalf("micro-batch %s: panic %v", micro, p)
				}
			}()
			_, err = run(nil, c)
		}()
		var ds *zero.DeepSpeedError
		if !errors.As(err, &ds) || len(ds.Problems) != 1 || ds.Problems[0].Path != "train_micro_batch_size_per_gpu" {
			t.Errorf("micro-batch %s: %v, want train_micro_batch_size_per_gpu alone", micro, err)
		}
	}
}

// goldenMLP is DeepSpeed's run of this command's model (its MLP of -in 4
// -hidden 16, fp16, ZeRO-2 at W=2, 3 steps), made by
// scripts/deepspeed_golden.py, with its config file.
var goldenMLP = filepath.Join("..", "..", "deepspeed", "testdata", "golden", "mlp-z2-fp16")

// convertGolden converts a golden DeepSpeed run's checkpoint into a zero
// checkpoint with deepspeed/cmd/convert -zero, as the README says; the
// deepspeed module is a module of its own, so the go tool runs it there.
func convertGolden(t *testing.T, run string) string {
	t.Helper()
	out := filepath.Join(t.TempDir(), "zero")
	cmd := exec.Command(filepath.Join(runtime.GOROOT(), "bin", "go"), "run", "./cmd/convert", filepath.Join("testdata", "golden", run, "ckpt"), "-zero", out)
	cmd.Dir = filepath.Join("..", "..", "deepspeed")
	if b, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("%v: %v\n%s", cmd.Args, err, b)
	}
	return out
}

// TestResumeDeepSpeed: a DeepSpeed run of this command's model, converted,
// continues with its own config file (-deepspeed CONFIG -resume OUT, the
// two commands the README shows): with no step left (-steps 3) the fp32
// parameters exported are DeepSpeed's master weights bit for bit
// (zero_to_fp32's file), and steps 4 and 5 run at DeepSpeed's loss scale
// (512, its window of 2 then doubling it) and its warmup's rates at the
// schedule's t (index 2, then 3: the warmup's end).
func TestResumeDeepSpeed(t *testing.T) {
	zdir := convertGolden(t, "mlp-z2-fp16")
	config := filepath.Join(goldenMLP, "ds_config.json")
	dir := t.TempDir()
	export := filepath.Join(dir, "model.safetensors")
	var so, se bytes.Buffer
	if code := mainArgs([]string{"-deepspeed", config, "-resume", zdir, "-steps", "3", "-export", export}, &so, &se); code != 0 {
		t.Fatalf("exit %d: %s", code, se.String())
	}
	_, got, _ := readExport(t, export)
	_, want, _ := readExport(t, filepath.Join(goldenMLP, "zero_to_fp32", "model.safetensors"))
	if len(got) != 4 || len(want) != 4 {
		t.Fatalf("exported %d tensors, zero_to_fp32 wrote %d", len(got), len(want))
	}
	for name, w := range want {
		g := got[name]
		if len(g) != len(w) {
			t.Fatalf("%s: %d values exported, DeepSpeed's %d", name, len(g), len(w))
		}
		for i := range w {
			if math.Float32bits(g[i]) != math.Float32bits(w[i]) {
				t.Fatalf("%s[%d]: %v exported, DeepSpeed's master %v", name, i, g[i], w[i])
			}
		}
	}
	metrics := filepath.Join(dir, "metrics.jsonl")
	so.Reset()
	if code := mainArgs([]string{"-deepspeed", config, "-resume", zdir, "-steps", "5", "-metrics", metrics}, &so, &se); code != 0 {
		t.Fatalf("exit %d: %s", code, se.String())
	}
	if !strings.Contains(so.String(), "resumed from "+zdir+" after step 3") {
		t.Errorf("the output does not say where it resumed:\n%s", so.String())
	}
	b, err := os.ReadFile(metrics)
	if err != nil {
		t.Fatal(err)
	}
	lines := strings.Split(strings.TrimSpace(string(b)), "\n")
	if len(lines) != 2 {
		t.Fatalf("%d steps in the metrics, want steps 4 and 5:\n%s", len(lines), b)
	}
	for k, want := range []stepMetrics{{Step: 4, LR: 0.01 * math.Log(3) / math.Log(4), LossScale: 512}, {Step: 5, LR: 0.01, LossScale: 512}} {
		var m stepMetrics
		if err := json.Unmarshal([]byte(lines[k]), &m); err != nil {
			t.Fatal(err)
		}
		if m.Step != want.Step || m.LossScale != want.LossScale || m.Skipped || math.Abs(m.LR-want.LR) > 1e-15 || m.Loss == nil {
			t.Errorf("step %d: %s; want step %d at rate %v, loss scale %v, not skipped", 4+k, lines[k], want.Step, want.LR, want.LossScale)
		}
	}
}

// TestResumeDeepSpeedRefusals: a converted DeepSpeed run of another model
// (the golden Net: fc1, fc2, gain and a frozen tensor) is refused, naming
// the parameter and this command's model; one resumed with another global
// batch than its samples per step is refused, naming both.
func TestResumeDeepSpeedRefusals(t *testing.T) {
	config := filepath.Join(goldenMLP, "ds_config.json")
	for _, c := range []struct {
		run  string
		args []string
		say  []string
	}{
		{"z2-fp16", nil, []string{`the engine's parameter 0 ("W1") is not in the checkpoint, whose parameters are "fc1.weight"`,
			"cmd/train's model is the MLP of -in 4 -hidden 16: W1 [16 4] (group 0), b1 [16] (group 1), W2 [1 16] (group 0), b2 [1] (group 1)"}},
		{"mlp-z2-fp16", []string{"-world", "4"}, []string{"DeepSpeed 0.19.8's run after 3 steps and 24 samples, not 16 a step as this run's global batch 16"}},
	} {
		zdir := convertGolden(t, c.run)
		var so, se bytes.Buffer
		args := append([]string{"-deepspeed", config, "-resume", zdir, "-steps", "5"}, c.args...)
		if code := mainArgs(args, &so, &se); code != 1 {
			t.Errorf("%s %v: exit %d, want 1: %s", c.run, c.args, code, se.String())
		}
		for _, say := range c.say {
			if !strings.Contains(se.String(), say) {
				t.Errorf("%s %v: %q does not say %q", c.run, c.args, se.String(), say)
			}
		}
	}
}
