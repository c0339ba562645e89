package main

import (
	"bytes"
	"errors"
	"fmt"
	"math"
	"os"
	"path/filepath"
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
// training, naming every one: the Trainer's ZeRO-3 test config offloads the
// parameters (its tuning keys are taken with notices).
func TestDeepSpeedRefused(t *testing.T) {
	c := defaultConfig()
	c.deepspeed = filepath.Join("..", "..", "testdata", "deepspeed", "hf_ds_config_zero3.json")
	_, err := run(nil, c)
	var ds *zero.DeepSpeedError
	if !errors.As(err, &ds) || len(ds.Problems) != 1 || ds.Problems[0].Path != "zero_optimization.offload_param" {
		t.Fatalf("%v, want zero_optimization.offload_param refused alone", err)
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
