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
		"Grads.AccumSteps = 2 (match)", "Precision.ShardDType = bf16", "Offload.Optimizer = true", "ZeRO-2, offloaded"} {
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
// training, naming every one.
func TestDeepSpeedRefused(t *testing.T) {
	c := defaultConfig()
	c.deepspeed = filepath.Join("..", "..", "testdata", "deepspeed", "hf_ds_config_zero3.json")
	_, err := run(nil, c)
	var ds *zero.DeepSpeedError
	if !errors.As(err, &ds) || len(ds.Problems) != 3 || !strings.Contains(err.Error(), "zero_optimization.sub_group_size") {
		t.Fatalf("%v, want the three refused keys (offload_param is mapped)", err)
	}
}
