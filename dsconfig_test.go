package zero

import (
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"math"
	"os"
	"path/filepath"
	"reflect"
	"regexp"
	"runtime/metrics"
	"slices"
	"sort"
	"strings"
	"testing"
	"time"
)

// dsDefaults is what a DeepSpeed config that says nothing but the stage
// and the precision gives, from DeepSpeed's own defaults (runtime/constants.py,
// runtime/zero/config.py, ops/adam/fused_adam.py at edaa7221), written out
// here apart from the mapping: reduce_bucket_size 5e8 elements, overlap_comm
// on at stage 3 only, stage3_prefetch_bucket_size 5e7, stage3_max_live_parameters
// 1e9, gradient_clipping 1.0, one backward per step, communication and
// accumulation in the model dtype, fp16's dynamic scale 2^16 / 1000 / 2 / 1,
// no overflow check in fp32, bf16's check_grad_overflow on.
func dsDefaults(stage int, dt DType) Config {
	n := dt.Size()
	c := Config{Stage: stage, BucketBytes: 500_000_000 * n, Overlap: stage == 3,
		Precision: PrecisionPolicy{CommDType: dt, ShardDType: dt, KeepNonFinite: dt == FP32},
		Grads:     GradPolicy{PredivideFactor: 1, AccumSteps: 1},
		Optimizer: OptimizerPolicy{Clip: 1},
		Params:    ParamPolicy{PrefetchBytes: 50_000_000 * n, LiveParamBytes: 1_000_000_000 * n}}
	if dt == FP16 {
		c.Precision.LossScale = LossScale{Initial: 65536, Window: 1000, Hysteresis: 2, Min: 1}
	}
	return c
}

func adamW(lr, b1, b2, eps, wd float64) AdamW {
	o := NewAdamW(lr)
	o.Beta1, o.Beta2, o.Eps, o.WeightDecay = b1, b2, eps, wd
	return o
}

// hfOverrides are what the Hugging Face Trainer would fill in for 2 ranks,
// 4 samples per device, 2 accumulation steps, lr 5e-5, a 10-step warmup,
// bf16 on, fp16 off, a model of hidden size 1024 (reduce_bucket_size
// hidden², stage3_prefetch_bucket_size 0.9·hidden², persistence 10·hidden).
var hfOverrides = map[string]any{
	"fp16.enabled": false, "bf16.enabled": true, "bfloat16.enabled": true,
	"optimizer.params.lr": 5e-5, "optimizer.params.betas": []float64{0.9, 0.999}, "optimizer.params.eps": 1e-8,
	"optimizer.params.weight_decay": 0.0, "scheduler.params.warmup_min_lr": 0, "scheduler.params.warmup_max_lr": 5e-5,
	"scheduler.params.warmup_num_steps": 10, "gradient_accumulation_steps": 2, "gradient_clipping": 1.0,
	"train_batch_size": 16, "train_micro_batch_size_per_gpu": 4,
	"zero_optimization.reduce_bucket_size": 1024 * 1024, "zero_optimization.stage3_prefetch_bucket_size": 943718,
	"zero_optimization.stage3_param_persistence_threshold": 10240, "scheduler.params.total_num_steps": 100,
	"zero_optimization.stage3_gather_16bit_weights_on_model_save": true,
}

// hfOverridesG1 are hfOverrides for one backward a step: what the Trainer
// fills in with gradient_accumulation_steps 1 (a global batch of 8).
var hfOverridesG1 = func() map[string]any {
	m := maps.Clone(hfOverrides)
	m["gradient_accumulation_steps"], m["train_batch_size"] = 1, 8
	return m
}()

// dsPublished are published configs, transcribed verbatim into
// testdata/deepspeed (testdata/deepspeed/SOURCES.md names each source and
// commit), each with what it maps to or the keys zero refuses.
var dsPublished = []struct {
	file      string
	source    string
	want      func() Config // nil: refused or malformed
	dtype     DType
	micro     int
	global    int
	refused   []string // exactly the keys refused (or invalid)
	malformed string   // where the JSON breaks
	notices   []string // notice paths that must be among the notices
	// strict: exactly the keys refused with DeepSpeedOptions.Strict (nil:
	// as without it)
	strict    []string
	overrides map[string]any // nil: hfOverrides
}{
	{file: "hf_ds_config_zero2.json", source: "huggingface/transformers tests/deepspeed/ds_config_zero2.json",
		want: func() Config {
			c := dsDefaults(2, FP32)
			c.BucketBytes, c.Overlap, c.Grads.AccumSteps, c.Offload.Optimizer = 200_000_000*4, true, 2, true
			c.Optimizer.Groups = []Optimizer{adamW(5e-5, 0.9, 0.999, 1e-8, 0)}
			c.Optimizer.Schedule = NewWarmupLR(0, 5e-5, 10)
			return c
		}, dtype: FP32, micro: 4, global: 16,
		notices: []string{"fp16.loss_scale", "zero_optimization.allgather_bucket_size", "zero_optimization.contiguous_gradients", "steps_per_print", "wall_clock_breakdown"}},
	{file: "hf_ds_config_zero2_bf16.json", source: "huggingface/transformers tests/deepspeed/ds_config_zero2_bf16.json",
		want: func() Config {
			c := dsDefaults(2, BF16)
			c.BucketBytes, c.Overlap, c.Grads.AccumSteps, c.Offload.Optimizer = 200_000_000*2, true, 2, true
			c.Optimizer.Groups = []Optimizer{adamW(5e-5, 0.9, 0.999, 1e-8, 0)}
			c.Optimizer.Schedule = NewWarmupLR(0, 5e-5, 10)
			return c
		}, dtype: BF16, micro: 4, global: 16, notices: []string{"data_types.grad_accum_dtype"}},
	{file: "hf_ds_config_zero3.json", source: "huggingface/transformers tests/deepspeed/ds_config_zero3.json",
		want: func() Config {
			c := dsDefaults(3, FP32) // fp16 off (the Trainer's override), no bf16 section
			c.BucketBytes, c.Params.PrefetchBytes, c.Grads.AccumSteps = 1024*1024*4, 943718*4, 2
			c.Offload.Optimizer, c.Offload.Params = true, true
			c.Optimizer.Groups = []Optimizer{adamW(5e-5, 0.9, 0.999, 1e-8, 0)}
			c.Optimizer.Schedule = NewWarmupLR(0, 5e-5, 10)
			return c
		}, dtype: FP32, micro: 4, global: 16,
		notices: []string{"zero_optimization.stage3_max_reuse_distance", "zero_optimization.stage3_param_persistence_threshold", "zero_optimization.sub_group_size", "zero_optimization.offload_param.pin_memory"},
		strict: []string{"zero_optimization.stage3_max_reuse_distance",
			"zero_optimization.stage3_param_persistence_threshold", "zero_optimization.sub_group_size"}},
	{file: "hf_docs_zero3.json", source: "https://github.com/huggingface/transformers/blob/019da1e8268a76436582cccc51c03638d267aa5b/docs/source/en/deepspeed.md (the ZeRO-3 block)",
		want: func() Config {
			c := dsDefaults(3, FP32)
			c.BucketBytes, c.Params.PrefetchBytes = 1024*1024*4, 943718*4
			c.Offload.Optimizer, c.Offload.Params = true, true
			return c
		}, dtype: FP32, notices: []string{"zero_optimization.stage3_max_reuse_distance", "zero_optimization.stage3_param_persistence_threshold", "zero_optimization.sub_group_size", "zero_optimization.offload_param.pin_memory"},
		strict: []string{"zero_optimization.stage3_max_reuse_distance", "zero_optimization.stage3_param_persistence_threshold", "zero_optimization.sub_group_size"}},
	{file: "accelerate_zero_stage1.json", source: "https://github.com/huggingface/accelerate/blob/1703b79a797dab765996764707186def7533d8fd/examples/deepspeed_config_templates/zero_stage1_config.json",
		want: func() Config {
			c := dsDefaults(1, FP16)
			c.BucketBytes, c.Overlap = 1024*1024*2, true
			c.Optimizer.Groups = []Optimizer{adamW(5e-5, 0.9, 0.999, 1e-8, 0)}
			c.Optimizer.Schedule = NewWarmupDecayLR(100, 0, 5e-5, 10)
			return c
		}, dtype: FP16, micro: 4, global: 8, overrides: hfOverridesG1,
		notices: []string{"optimizer.params.torch_adam", "zero_optimization.allgather_bucket_size", "zero_optimization.allgather_partitions", "fp16.enabled"},
		strict:  []string{"optimizer.params.torch_adam", "zero_optimization.allgather_bucket_size"}},
	{file: "accelerate_zero_stage2_offload.json", source: "https://github.com/huggingface/accelerate/blob/1703b79a797dab765996764707186def7533d8fd/examples/deepspeed_config_templates/zero_stage2_offload_config.json",
		want: func() Config {
			c := dsDefaults(2, FP16)
			c.BucketBytes, c.Overlap, c.Offload.Optimizer = 1024*1024*2, true, true
			c.Optimizer.Groups = []Optimizer{adamW(5e-5, 0.9, 0.999, 1e-8, 0)}
			c.Optimizer.Schedule = NewWarmupDecayLR(100, 0, 5e-5, 10)
			return c
		}, dtype: FP16, micro: 4, global: 8, overrides: hfOverridesG1,
		notices: []string{"optimizer.params.torch_adam", "zero_optimization.allgather_bucket_size", "zero_optimization.offload_optimizer.pin_memory"},
		strict:  []string{"optimizer.params.torch_adam", "zero_optimization.allgather_bucket_size"}},
	{file: "accelerate_zero_stage3.json", source: "https://github.com/huggingface/accelerate/blob/1703b79a797dab765996764707186def7533d8fd/examples/deepspeed_config_templates/zero_stage3_config.json",
		want: func() Config {
			c := dsDefaults(3, FP16)
			c.BucketBytes, c.Params.PrefetchBytes = 1024*1024*2, 943718*2
			c.Optimizer.Groups = []Optimizer{adamW(5e-5, 0.9, 0.999, 1e-8, 0)}
			c.Optimizer.Schedule = NewWarmupDecayLR(100, 0, 5e-5, 10)
			return c
		}, dtype: FP16, micro: 4, global: 8, overrides: hfOverridesG1,
		notices: []string{"zero_optimization.stage3_max_reuse_distance", "zero_optimization.stage3_param_persistence_threshold", "zero_optimization.sub_group_size",
			"zero_optimization.stage3_gather_16bit_weights_on_model_save"},
		strict: []string{"zero_optimization.stage3_max_reuse_distance", "zero_optimization.stage3_param_persistence_threshold", "zero_optimization.sub_group_size"}},
	{file: "llamafactory_ds_z3_config.json", source: "https://github.com/hiyouga/LLaMA-Factory/blob/a0d44c650a9a38c1ec6c8fc48a7daeacca9900a9/examples/deepspeed/ds_z3_config.json",
		want: func() Config {
			c := dsDefaults(3, BF16)
			c.BucketBytes, c.Overlap, c.Params.PrefetchBytes, c.Grads.AccumSteps = 1024*1024*2, false, 943718*2, 2
			return c
		}, dtype: BF16, micro: 4, global: 16,
		notices: []string{"zero_optimization.stage3_max_reuse_distance", "zero_optimization.stage3_param_persistence_threshold", "zero_optimization.sub_group_size",
			"zero_allow_untested_optimizer", "fp16.loss_scale_window", "optimizer"},
		strict: []string{"zero_optimization.stage3_max_reuse_distance", "zero_optimization.stage3_param_persistence_threshold", "zero_optimization.sub_group_size"}},
	{file: "openinstruct_stage3_no_offloading_accelerate.json", source: "https://github.com/allenai/open-instruct/blob/138e86b689a5d75db68476bfa5c9ca38c4ae4c2e/configs/ds_configs/stage3_no_offloading_accelerate.conf",
		want: func() Config {
			c := dsDefaults(3, BF16)
			c.BucketBytes, c.Params.PrefetchBytes, c.Grads.AccumSteps = 1024*1024*2, 943718*2, 2
			return c
		}, dtype: BF16, micro: 4, global: 16,
		notices: []string{"zero_optimization.stage3_max_reuse_distance", "zero_optimization.stage3_param_persistence_threshold", "zero_optimization.sub_group_size", "steps_per_print"},
		strict:  []string{"zero_optimization.stage3_max_reuse_distance", "zero_optimization.stage3_param_persistence_threshold", "zero_optimization.sub_group_size"}},
	{file: "openinstruct_stage3_no_offloading.json", source: "https://github.com/allenai/open-instruct/blob/138e86b689a5d75db68476bfa5c9ca38c4ae4c2e/configs/ds_configs/stage3_no_offloading.conf",
		want: func() Config {
			c := dsDefaults(3, BF16)
			c.BucketBytes, c.Params.PrefetchBytes, c.Grads.AccumSteps = 1024*1024*2, 943718*2, 2
			c.Optimizer.Groups = []Optimizer{adamW(5e-5, 0.9, 0.999, 1e-8, 0)}
			c.Optimizer.Schedule = NewWarmupDecayLR(100, 0, 5e-5, 10)
			return c
		}, dtype: BF16, micro: 4, global: 16,
		notices: []string{"zero_optimization.stage3_max_reuse_distance", "zero_optimization.stage3_param_persistence_threshold", "zero_optimization.sub_group_size"},
		strict:  []string{"zero_optimization.stage3_max_reuse_distance", "zero_optimization.stage3_param_persistence_threshold", "zero_optimization.sub_group_size"}},
	{file: "hf_docs_zero2.json", source: "huggingface/transformers docs/source/en/deepspeed.md, ZeRO-2 (a comma missing)",
		malformed: "line 14, column 9"},
	{file: "hf_docs_zero3_nvme.json", source: "huggingface/transformers docs/source/en/deepspeed.md, ZeRO-3/Infinity",
		refused: []string{"zero_optimization.aio", "zero_optimization.offload_optimizer.device", "zero_optimization.offload_param.device"},
		strict: []string{"zero_optimization.aio", "zero_optimization.offload_optimizer.device", "zero_optimization.offload_param.device",
			"zero_optimization.stage3_max_reuse_distance", "zero_optimization.stage3_param_persistence_threshold", "zero_optimization.sub_group_size"}},
	{file: "ds_getting_started.json", source: "deepspeedai/DeepSpeed docs/_tutorials/getting-started.md",
		want: func() Config {
			c := dsDefaults(1, FP16)
			c.Optimizer.Groups = []Optimizer{adamW(0.00015, 0.9, 0.999, 1e-8, 0)}
			return c
		}, dtype: FP16, micro: 4, global: 8, notices: []string{"zero_optimization", "gradient_clipping"}},
	{file: "ds_zero_stage1.json", source: "deepspeedai/DeepSpeed docs/_tutorials/zero.md, ZeRO-1",
		want: func() Config { return dsDefaults(1, FP32) }, dtype: FP32, notices: []string{"optimizer", "gradient_accumulation_steps"}},
	{file: "ds_zero_stage2.json", source: "deepspeedai/DeepSpeed docs/_tutorials/zero.md, ZeRO-2",
		want: func() Config {
			c := dsDefaults(2, FP32)
			c.Overlap = true
			return c
		}, dtype: FP32, notices: []string{"zero_optimization.reduce_scatter", "zero_optimization.allgather_bucket_size"}},
	{file: "ds_zero_stage3.json", source: "deepspeedai/DeepSpeed docs/_tutorials/zero.md, ZeRO-3",
		want: func() Config {
			c := dsDefaults(3, FP32)
			c.BucketBytes, c.Params.PrefetchBytes = 10_000_000*4, 10_000_000*4
			c.Offload.Optimizer, c.Offload.Params = true, true
			return c
		}, dtype: FP32, notices: []string{"zero_optimization.stage3_max_reuse_distance", "zero_optimization.stage3_param_persistence_threshold", "zero_optimization.sub_group_size"},
		strict: []string{"zero_optimization.stage3_max_reuse_distance",
			"zero_optimization.stage3_param_persistence_threshold", "zero_optimization.sub_group_size"}},
	{file: "ds_zero_offload.json", source: "deepspeedai/DeepSpeed docs/_tutorials/zero-offload.md (a trailing comma)",
		malformed: "line 6, column 9"},
	{file: "ds_cifar10.json", source: "deepspeedai/DeepSpeed docs/_tutorials/cifar-10.md",
		refused: []string{"zero_optimization.stage"}},
	{file: "ds_bert_pretraining.json", source: "deepspeedai/DeepSpeed docs/_tutorials/bert-pretraining.md",
		refused: []string{"optimizer.params.bias_correction", "optimizer.params.max_grad_norm", "zero_optimization.stage"}},
	{file: "ds_onebit_adam.json", source: "deepspeedai/DeepSpeed docs/_tutorials/onebit-adam.md",
		refused: []string{"optimizer.type", "zero_optimization.stage"}},
	{file: "ds_one_cycle.json", source: "deepspeedai/DeepSpeed docs/_tutorials/one-cycle.md (the fragment in braces)",
		refused: []string{"zero_optimization.stage"}},
	{file: "ds_megatron_bs8_zero2.json", source: "deepspeedai/DeepSpeed tests/model/Megatron_GPT2/ds_config_func_bs8_zero2.json",
		want: func() Config {
			c := dsDefaults(2, FP16)
			c.BucketBytes = 7_000_000 * 2
			return c
		}, dtype: FP16, micro: 4, global: 8, notices: []string{"activation_checkpointing", "steps_per_print", "zero_optimization.allgather_bucket_size"}},
	{file: "ds_megatron_bs4_zero2_offload.json", source: "deepspeedai/DeepSpeed tests/model/Megatron_GPT2/ds_config_func_bs4_zero2_offload.json",
		want: func() Config {
			c := dsDefaults(2, FP16)
			c.BucketBytes, c.Offload.Optimizer = 7_000_000*2, true
			return c
		}, dtype: FP16, micro: 2, global: 4, notices: []string{"zero_optimization.cpu_offload"}},
	{file: "ds_megatron_scheduler.json", source: "deepspeedai/DeepSpeed tests/model/Megatron_GPT2/ds_config_func_scheduler.json",
		want: func() Config {
			c := dsDefaults(2, FP16)
			c.Optimizer.Schedule = NewWarmupLR(0, 0.001, 10)
			return c
		}, dtype: FP16, micro: 2, global: 4},
	{file: "ds_megatron_perf_bs16.json", source: "deepspeedai/DeepSpeed tests/model/Megatron_GPT2/ds_config_perf_bs16.json",
		want: func() Config { return dsDefaults(1, FP16) }, dtype: FP16, micro: 8, global: 16, notices: []string{"disable_allgather"}},
	{file: "ds_torch_compile_z3.json", source: "deepspeedai/DeepSpeed tests/torch_compile/ds_config_z3.json",
		want: func() Config {
			c := dsDefaults(3, BF16)
			c.Overlap = false
			c.Optimizer.Groups = []Optimizer{adamW(0.001, 0.8, 0.999, 1e-8, 3e-7)}
			c.Optimizer.Schedule = NewWarmupLR(0, 0.001, 1000)
			return c
		}, dtype: BF16, micro: 4, global: 8, notices: []string{"zero_optimization.contiguous_gradients", "zero_optimization.reduce_scatter"}},
}

// TestDeepSpeedPublishedConfigs: every published config maps to the
// expected settings field by field (the settings record's paths), dtype
// and batch sizes, or is refused naming exactly the keys zero cannot
// honour, or, where the published text is not JSON, says where it breaks.
func TestDeepSpeedPublishedConfigs(t *testing.T) {
	if len(dsPublished) < 10 {
		t.Fatalf("%d published configs; the issue asks for ten or more", len(dsPublished))
	}
	for _, c := range dsPublished {
		t.Run(c.file, func(t *testing.T) {
			path, over := filepath.Join("testdata", "deepspeed", c.file), c.overrides
			if over == nil {
				over = hfOverrides
			}
			strict := c.strict
			if strict == nil {
				strict = c.refused
			}
			if _, err := ReadDeepSpeedFile(path, DeepSpeedOptions{World: 2, Overrides: over, Strict: true}); c.malformed == "" {
				var ds *DeepSpeedError
				if errors.As(err, &ds) != (strict != nil) || ds != nil && !slices.Equal(ds.Paths(), strict) {
					t.Errorf("Strict: %v, want refused %q", err, strict)
				}
			}
			got, err := ReadDeepSpeedFile(path, DeepSpeedOptions{World: 2, Overrides: over})
			switch {
			case c.malformed != "":
				var ds *DeepSpeedError
				if !errors.Is(err, ErrConfig) || errors.As(err, &ds) || !strings.Contains(err.Error(), c.malformed) {
					t.Fatalf("%v, want a malformed-JSON ErrConfig at %s", err, c.malformed)
				}
			case c.refused != nil:
				var ds *DeepSpeedError
				if !errors.As(err, &ds) || !errors.Is(err, ErrConfig) {
					t.Fatalf("%v, want a *DeepSpeedError wrapping ErrConfig", err)
				}
				if !slices.Equal(ds.Paths(), c.refused) {
					t.Fatalf("refused %q, want %q\n%v", ds.Paths(), c.refused, err)
				}
			default:
				if err != nil {
					t.Fatal(err)
				}
				want := c.want()
				diffConfigs(t, got.Config, want)
				if got.DType != c.dtype || got.MicroBatch != c.micro || got.GlobalBatch != c.global {
					t.Errorf("dtype %v, batches %d/%d; want %v, %d/%d", got.DType, got.MicroBatch, got.GlobalBatch, c.dtype, c.micro, c.global)
				}
				for _, n := range c.notices {
					if !slices.ContainsFunc(got.Notices, func(x DeepSpeedNotice) bool { return x.Path == n }) {
						t.Errorf("no notice for %s; notices: %v", n, got.Notices)
					}
				}
				// and it runs: two ranks build their engines from it
				buildsEngines(t, got)
			}
		})
	}
}

// diffConfigs compares two configs setting by setting, then as values.
func diffConfigs(t *testing.T, got, want Config) {
	t.Helper()
	g, w := settingsRecord(got, nil, 2), settingsRecord(want, nil, 2)
	idx := map[string]string{}
	for _, s := range g {
		idx[s.Path] = s.Value
	}
	for _, s := range w {
		if v, ok := idx[s.Path]; !ok || v != s.Value {
			t.Errorf("%s = %q, want %q", s.Path, v, s.Value)
		}
	}
	if len(g) != len(w) {
		t.Errorf("%d settings, want %d", len(g), len(w))
	}
	if !reflect.DeepEqual(got, want) {
		t.Errorf("configs differ:\n got %+v\nwant %+v", got, want)
	}
}

// buildsEngines builds an engine on each of 2 ranks from a mapped config
// (buckets and budgets cut down to a small model) and takes one step.
func buildsEngines(t *testing.T, c DeepSpeedConfig) {
	t.Helper()
	cfg := c.Config
	cfg.BucketBytes = 64 * c.DType.Size()
	if len(cfg.Optimizer.Groups) == 0 {
		cfg.Optimizer.Groups = []Optimizer{NewAdamW(0.01)}
	}
	errs := dsEngines(t, cfg, c.DType, []int{50, 3}, func(rank int, e *Engine, s *HostStream, ps []Param) error {
		for range max(1, cfg.Grads.AccumSteps) {
			if err := dsBackward(e, s, ps, func(p, j int) float64 { return 0.01 * float64(j%7) }); err != nil {
				return err
			}
		}
		return e.Step()
	})
	everyRankIs(t, "engines from the mapped config", errs, nil)
}

// dsEngines builds an engine per rank on 2 in-process ranks, over
// parameters of sizes in dt (each rank its own memory, all ones), and runs
// fn on each.
func dsEngines(t *testing.T, cfg Config, dt DType, sizes []int, fn func(rank int, e *Engine, s *HostStream, ps []Param) error) []error {
	t.Helper()
	comms, err := NewLocalGroupTimeout(2, 20*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	return eachRank(2, func(rank int) error {
		ps := make([]Param, len(sizes))
		for p, n := range sizes {
			b := newTBuf(dt, n)
			for j := range n {
				b.set(j, 1)
			}
			ps[p] = Param{Name: fmt.Sprint("p", p), Count: n, DType: dt, Data: b.t()}
		}
		e, err := New(cfg, comms[rank], ps)
		if err != nil {
			return err
		}
		defer e.Close()
		s := NewHostStream()
		defer s.Close()
		return fn(rank, e, s, ps)
	})
}

// dsBackward hands over one backward: element j of parameter p's gradient
// is g(p, j) times the engine's loss scale.
func dsBackward(e *Engine, s *HostStream, ps []Param, g func(p, j int) float64) error {
	if err := forward(e, s); err != nil {
		return err
	}
	for p := len(ps) - 1; p >= 0; p-- {
		b := newTBuf(ps[p].DType, ps[p].Count)
		for j := range ps[p].Count {
			b.set(j, float32(g(p, j)*e.LossScale()))
		}
		if _, err := e.GradReady(p, b.t(), s); err != nil {
			return err
		}
	}
	return e.EndBackward()
}

// dsRead maps a config given as JSON text for 2 ranks, failing the test on
// an error.
func dsRead(t *testing.T, text string) DeepSpeedConfig {
	t.Helper()
	c, err := ReadDeepSpeed([]byte(text), DeepSpeedOptions{World: 2})
	if err != nil {
		t.Fatalf("%s\n%v", text, err)
	}
	return c
}

// setting is the value of path in an engine's settings record.
func setting(e *Engine, path string) string {
	for _, s := range e.Settings() {
		if s.Path == path {
			return s.Value
		}
	}
	return "none"
}

// TestDeepSpeedKeysChangeTheEngine: each mapped key changes the engine as
// DeepSpeed's setting would, seen in the engine itself (its plan, stats,
// steps, loss scale and settings), against float64 references where it
// changes the arithmetic.
func TestDeepSpeedKeysChangeTheEngine(t *testing.T) {
	z := func(stage int, more string) string {
		return fmt.Sprintf(`{"zero_optimization": {"stage": %d%s}`, stage, more)
	}
	run := func(t *testing.T, text string, sizes []int, fn func(rank int, e *Engine, s *HostStream, ps []Param) error) DeepSpeedConfig {
		t.Helper()
		c := dsRead(t, text)
		everyRankIs(t, text, dsEngines(t, c.Config, c.DType, sizes, fn), nil)
		return c
	}
	ones := func(p, j int) float64 { return 1 }

	t.Run("stage", func(t *testing.T) {
		for stage := 1; stage <= 3; stage++ {
			run(t, z(stage, `}, "gradient_clipping": 0, "optimizer": {"type": "SGD", "params": {"lr": 0.5}}}`), []int{64, 8}, func(rank int, e *Engine, s *HostStream, ps []Param) error {
				if got := setting(e, "Stage"); got != fmt.Sprint(stage) {
					return fmt.Errorf("stage %s", got)
				}
				shard := e.ParamMemory().ShardBytes
				if (stage == 3) != (shard > 0) || stage == 3 && shard*2 != int64(e.Plan().FullElems*4) {
					return fmt.Errorf("stage %d: a parameter shard of %d bytes, %d elements in all", stage, shard, e.Plan().FullElems)
				}
				if err := dsBackward(e, s, ps, ones); err != nil {
					return err
				}
				if err := e.Step(); err != nil {
					return err
				}
				full, err := e.FullParams()
				if err == nil && full[0][0] != 0.5 { // 1 − 0.5·1
					err = fmt.Errorf("stage %d: parameter %v after one SGD step, want 0.5", stage, full[0][0])
				}
				return err
			})
		}
	})
	t.Run("reduce_bucket_size in elements of the model dtype", func(t *testing.T) {
		// three parameters of 64 elements, zero's default alignment
		for _, c := range []struct{ elems, buckets int }{{128, 2}, {192, 1}} {
			run(t, fmt.Sprintf(`{"bf16": {"enabled": true}, "zero_optimization": {"stage": 2, "reduce_bucket_size": %d}}`, c.elems), []int{64, 64, 64},
				func(rank int, e *Engine, s *HostStream, ps []Param) error {
					if n := len(e.Plan().Buckets); n != c.buckets {
						return fmt.Errorf("reduce_bucket_size %d elements of bf16: %d buckets, want %d", c.elems, n, c.buckets)
					}
					return nil
				})
		}
	})
	t.Run("overlap_comm and stage-3 budgets", func(t *testing.T) {
		run(t, z(3, `, "overlap_comm": false, "stage3_prefetch_bucket_size": 1000, "stage3_max_live_parameters": 3000}, "bf16": {"enabled": true}}`), []int{8},
			func(rank int, e *Engine, s *HostStream, ps []Param) error {
				for path, want := range map[string]string{"Overlap": "false", "Params.PrefetchBytes": "2000", "Params.LiveParamBytes": "6000"} {
					if got := setting(e, path); got != want {
						return fmt.Errorf("%s = %s, want %s", path, got, want)
					}
				}
				return nil
			})
		run(t, z(3, `}}`), []int{8}, func(rank int, e *Engine, s *HostStream, ps []Param) error {
			if got := setting(e, "Overlap"); got != "true" {
				return fmt.Errorf("stage 3 without overlap_comm: Overlap %s, want DeepSpeed's true", got)
			}
			return nil
		})
	})
	t.Run("offload_optimizer", func(t *testing.T) {
		for _, dev := range []string{"cpu", "none"} {
			run(t, z(2, fmt.Sprintf(`, "offload_optimizer": {"device": %q, "pin_memory": true}}, "optimizer": {"type": "AdamW"}}`, dev)), []int{64},
				func(rank int, e *Engine, s *HostStream, ps []Param) error {
					if err := dsBackward(e, s, ps, ones); err != nil {
						return err
					}
					if err := e.Step(); err != nil {
						return err
					}
					if host := e.Stats().HostBytes; (dev == "cpu") != (host > 0) {
						return fmt.Errorf("device %s: %d host bytes", dev, host)
					}
					return nil
				})
		}
	})
	t.Run("gradient_clipping", func(t *testing.T) {
		// a gradient of 3 in each of 16 elements: norm 12; clipped to 2 it is 0.5 each
		for _, c := range []struct {
			clip string
			want float64
		}{{`"gradient_clipping": 2,`, 1 - 0.5}, {`"gradient_clipping": 0,`, 1 - 3}, {``, 1 - 3.0/12}} {
			run(t, `{`+c.clip+` "zero_optimization": {"stage": 2}, "optimizer": {"type": "SGD", "params": {"lr": 1}}}`, []int{16},
				func(rank int, e *Engine, s *HostStream, ps []Param) error {
					if err := dsBackward(e, s, ps, func(p, j int) float64 { return 3 }); err != nil {
						return err
					}
					if err := e.Step(); err != nil {
						return err
					}
					full, err := e.FullParams()
					if err == nil && math.Abs(float64(full[0][5])-c.want) > 1e-6 {
						err = fmt.Errorf("%q: %v, want %v", c.clip, full[0][5], c.want)
					}
					return err
				})
		}
	})
	t.Run("gradient_accumulation_steps", func(t *testing.T) {
		run(t, z(2, `}, "gradient_accumulation_steps": 2, "optimizer": {"type": "SGD", "params": {"lr": 1}}, "gradient_clipping": 0}`), []int{16},
			func(rank int, e *Engine, s *HostStream, ps []Param) error {
				if err := dsBackward(e, s, ps, func(p, j int) float64 { return 1 }); err != nil {
					return err
				}
				if err := e.Step(); !errors.Is(err, ErrProtocol) {
					return fmt.Errorf("Step after 1 of 2 backwards: %v, want ErrProtocol", err)
				}
				if err := dsBackward(e, s, ps, func(p, j int) float64 { return 3 }); err != nil {
					return err
				}
				if err := e.Step(); err != nil {
					return err
				}
				full, err := e.FullParams()
				if err == nil && full[0][0] != -1 { // 1 − (1+3)/2
					err = fmt.Errorf("the mean of 2 backwards: %v, want -1", full[0][0])
				}
				return err
			})
	})
	t.Run("AdamW and Adam params", func(t *testing.T) {
		for _, typ := range []string{"AdamW", "Adam", "adam"} {
			text := z(2, `}, "gradient_clipping": 0, "optimizer": {"type": "`+typ+`", "params": {"lr": 0.01, "betas": [0.8, 0.99], "eps": 1e-6, "weight_decay": 0.1}}}`)
			run(t, text, []int{16}, func(rank int, e *Engine, s *HostStream, ps []Param) error {
				ref := refAdamW{lr: 0.01, b1: 0.8, b2: 0.99, eps: 1e-6, wd: 0.1}
				p, m, v := 1.0, 0.0, 0.0
				for st := 1; st <= 3; st++ {
					g := 0.5 * float64(st)
					if err := dsBackward(e, s, ps, func(int, int) float64 { return g }); err != nil {
						return err
					}
					if err := e.Step(); err != nil {
						return err
					}
					ref.step(&p, &m, &v, g, st)
				}
				full, err := e.FullParams()
				if err == nil && math.Abs(float64(full[0][3])-p) > 1e-6 {
					err = fmt.Errorf("%s: %v after 3 steps, want %v", typ, full[0][3], p)
				}
				return err
			})
		}
	})
	t.Run("SGD params", func(t *testing.T) {
		text := z(2, `}, "gradient_clipping": 0, "optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9, "dampening": 0.25, "weight_decay": 0.01}}}`)
		run(t, text, []int{16}, func(rank int, e *Engine, s *HostStream, ps []Param) error {
			p, buf := 1.0, 0.0
			for st := 1; st <= 3; st++ {
				g := float64(st)
				if err := dsBackward(e, s, ps, func(int, int) float64 { return g }); err != nil {
					return err
				}
				if err := e.Step(); err != nil {
					return err
				}
				d := g + 0.01*p // torch.optim.SGD
				if st == 1 {
					buf = d
				} else {
					buf = 0.9*buf + (1-0.25)*d
				}
				p -= 0.1 * buf
			}
			full, err := e.FullParams()
			if err == nil && math.Abs(float64(full[0][0])-p) > 1e-6 {
				err = fmt.Errorf("%v after 3 steps, want %v", full[0][0], p)
			}
			return err
		})
	})
	t.Run("fp16 loss scaling", func(t *testing.T) {
		overflows := []bool{true, true, false, false, true, true, true, false, false, false}
		for _, c := range []struct{ fp16 string }{
			{`"initial_scale_power": 5, "loss_scale_window": 2, "hysteresis": 2, "min_loss_scale": 8`},
			{`"initial_scale_power": 4, "loss_scale_window": 3, "hysteresis": 1, "min_loss_scale": 4`},
		} {
			var power, window, hyst int
			var minScale float64
			fmt.Sscanf(strings.NewReplacer(`"`, "", ",", "").Replace(c.fp16), "initial_scale_power: %d loss_scale_window: %d hysteresis: %d min_loss_scale: %g", &power, &window, &hyst, &minScale)
			run(t, z(2, `}, "fp16": {"enabled": true, `+c.fp16+`}, "optimizer": {"type": "AdamW"}}`), []int{16},
				func(rank int, e *Engine, s *HostStream, ps []Param) error {
					sim := newDSScaler(math.Ldexp(1, power), window, hyst, minScale)
					for st, over := range overflows {
						if got := e.LossScale(); got != sim.curScale {
							return fmt.Errorf("%s, step %d: scale %v, want %v", c.fp16, st, got, sim.curScale)
						}
						if err := dsBackward(e, s, ps, func(p, j int) float64 {
							if over && j == 3 {
								return math.Inf(1)
							}
							return 0.01
						}); err != nil {
							return err
						}
						if err := e.Step(); err != nil {
							return err
						}
						if e.Stats().Skipped != over {
							return fmt.Errorf("step %d: skipped %v", st, e.Stats().Skipped)
						}
						sim.updateScale(over)
					}
					return nil
				})
		}
		run(t, z(2, `}, "fp16": {"enabled": true, "loss_scale": 128}, "optimizer": {"type": "AdamW"}}`), []int{16},
			func(rank int, e *Engine, s *HostStream, ps []Param) error {
				if got := e.LossScale(); got != 128 {
					return fmt.Errorf("static loss_scale 128: scale %v", got)
				}
				return nil
			})
	})
	t.Run("bf16 check_grad_overflow", func(t *testing.T) {
		for _, check := range []bool{true, false} {
			run(t, z(2, fmt.Sprintf(`}, "bf16": {"enabled": true, "check_grad_overflow": %v}, "gradient_clipping": 0, "optimizer": {"type": "SGD", "params": {"lr": 1}}}`, check)), []int{16},
				func(rank int, e *Engine, s *HostStream, ps []Param) error {
					if err := dsBackward(e, s, ps, func(p, j int) float64 { return math.Inf(1) * float64(j/15) }); err != nil {
						return err
					}
					if err := e.Step(); err != nil {
						return err
					}
					if e.Stats().Skipped != check {
						return fmt.Errorf("check_grad_overflow %v: skipped %v", check, e.Stats().Skipped)
					}
					return nil
				})
		}
	})
	t.Run("communication_data_type", func(t *testing.T) {
		payload := map[string]int64{}
		for _, comm := range []string{"", `"communication_data_type": "fp32",`} {
			run(t, `{`+comm+` "bf16": {"enabled": true}, "zero_optimization": {"stage": 2}}`, []int{64},
				func(rank int, e *Engine, s *HostStream, ps []Param) error {
					if err := dsBackward(e, s, ps, ones); err != nil {
						return err
					}
					if err := e.Step(); err != nil {
						return err
					}
					if rank == 0 {
						payload[comm] = e.Stats().Collectives[KindReduceScatter].PayloadBytes
					}
					return nil
				})
		}
		if payload[""] == 0 || payload[`"communication_data_type": "fp32",`] != 2*payload[""] {
			t.Errorf("reduce-scatter payload %v: fp32 on the wire should move twice bf16's bytes", payload)
		}
	})
	t.Run("data_types.grad_accum_dtype", func(t *testing.T) {
		// a 16-bit shard saves exactly 2 bytes an element
		inUse := map[string]int64{}
		var shard int
		for _, acc := range []string{"", `"data_types": {"grad_accum_dtype": "fp32"},`} {
			run(t, `{`+acc+` "bf16": {"enabled": true}, "zero_optimization": {"stage": 2, "reduce_bucket_size": 64}}`, []int{64, 64, 64, 64},
				func(rank int, e *Engine, s *HostStream, ps []Param) error {
					if err := dsBackward(e, s, ps, ones); err != nil {
						return err
					}
					if err := e.Step(); err != nil {
						return err
					}
					if rank == 0 {
						inUse[acc], shard = e.Stats().GradBytesInUse, e.Plan().ShardElems
					}
					return nil
				})
		}
		if saved := inUse[`"data_types": {"grad_accum_dtype": "fp32"},`] - inUse[""]; saved != int64(2*shard) || saved <= 0 {
			t.Errorf("gradient bytes in use %v, shard %d elements: DeepSpeed's default (a bf16 shard) should save %d bytes", inUse, shard, 2*shard)
		}
	})
	t.Run("gradient_allreduce_op, gradient_predivide_factor, prescale_gradients", func(t *testing.T) {
		for _, c := range []struct {
			keys     string
			sum      bool
			predivid string
		}{{``, false, "1"}, {`"gradient_allreduce_op": "sum",`, true, "1"}, {`"gradient_predivide_factor": 4,`, false, "4"}, {`"prescale_gradients": true,`, false, "2"}} {
			run(t, `{`+c.keys+` "zero_optimization": {"stage": 2}}`, []int{16},
				func(rank int, e *Engine, s *HostStream, ps []Param) error {
					if got := setting(e, "Grads.PredivideFactor"); got != c.predivid {
						return fmt.Errorf("%q: predivide %s, want %s", c.keys, got, c.predivid)
					}
					if err := dsBackward(e, s, ps, func(p, j int) float64 { return float64(1 + rank) }); err != nil {
						return err
					}
					if err := e.Step(); err != nil {
						return err
					}
					full, err := e.FullGrads()
					want := float32(1.5) // the mean of 1 and 2
					if c.sum {
						want = 3
					}
					if err == nil && full[0][0] != want {
						err = fmt.Errorf("%q: gradient %v, want %v", c.keys, full[0][0], want)
					}
					return err
				})
		}
	})
	t.Run("scheduler", func(t *testing.T) {
		c := run(t, z(2, `}, "optimizer": {"type": "AdamW", "params": {"lr": 0.1}}, "scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 50, "warmup_num_steps": 5, "warmup_type": "linear"}}}`), []int{16},
			func(rank int, e *Engine, s *HostStream, ps []Param) error {
				for path, want := range map[string]string{"Optimizer.Schedule": "WarmupDecayLR", "Optimizer.Schedule.TotalSteps": "50",
					"Optimizer.Schedule.MaxLR": "0.001", "Optimizer.Schedule.Warmup": "linear"} {
					if got := setting(e, path); got != want {
						return fmt.Errorf("%s = %s, want %s", path, got, want)
					}
				}
				return nil
			})
		if _, ok := c.Config.Optimizer.Schedule.(WarmupDecayLR); !ok {
			t.Errorf("schedule %T", c.Config.Optimizer.Schedule)
		}
	})
}

// TestDeepSpeedOneCycle: DeepSpeed's OneCycle tutorial config maps field by
// field; with Adam, DeepSpeed's momentum cycle sets the second beta to
// 0.99, and with SGD it cycles nothing.
func TestDeepSpeedOneCycle(t *testing.T) {
	raw, err := os.ReadFile(filepath.Join("testdata", "deepspeed", "ds_one_cycle.json"))
	if err != nil {
		t.Fatal(err)
	}
	var doc map[string]any
	if err := json.Unmarshal(raw, &doc); err != nil {
		t.Fatal(err)
	}
	doc["zero_optimization"] = map[string]any{"stage": 2}
	want := NewOneCycle(0.0001, 0.0010)
	want.FirstStepSize, want.SecondStepSize, want.FirstStairCount, want.SecondStairCount = 1000, 1000, 500, 500
	want.DecayStepSize, want.DecayLRRate, want.MinMom, want.MaxMom, want.DecayMomRate = 1000, 0.001, 0.85, 0.99, 0
	for _, opt := range []string{"", "Adam", "SGD"} {
		if opt != "" {
			doc["optimizer"] = map[string]any{"type": opt, "params": map[string]any{"lr": 0.1, "betas": []float64{0.9, 0.999}}}
			if opt == "SGD" {
				doc["optimizer"] = map[string]any{"type": opt, "params": map[string]any{"lr": 0.1, "momentum": 0.9}}
			}
		}
		text, _ := json.Marshal(doc)
		c := dsRead(t, string(text))
		w := want
		if opt == "SGD" {
			w.CycleMomentum = false
		}
		if !reflect.DeepEqual(c.Config.Optimizer.Schedule, w) {
			t.Errorf("%s: %+v, want %+v", opt, c.Config.Optimizer.Schedule, w)
		}
		if opt == "Adam" {
			if a := c.Config.Optimizer.Groups[0].(AdamW); a.Beta2 != 0.99 || a.Beta1 != 0.9 {
				t.Errorf("Adam with OneCycle: betas (%v, %v), want (0.9, 0.99)", a.Beta1, a.Beta2)
			}
		}
		if !slices.ContainsFunc(c.Notices, func(n DeepSpeedNotice) bool { return n.Path == "scheduler.params.cycle_momentum" }) {
			t.Errorf("%q: no notice on the momentum cycle: %v", opt, c.Notices)
		}
	}
}

// TestDeepSpeedNothingSilent: every key of a config is mapped, noticed or
// refused; none goes unsaid. The config holds every key of the issue's
// lists, each accepted or refused as the issue says.
func TestDeepSpeedNothingSilent(t *testing.T) {
	mappedKeys := []string{"train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "gradient_clipping",
		"optimizer.type", "optimizer.params.lr", "optimizer.params.betas", "optimizer.params.eps", "optimizer.params.weight_decay",
		"scheduler.type", "scheduler.params.", "fp16.enabled", "bf16.enabled", "bfloat16.enabled", "fp16.loss_scale",
		"fp16.initial_scale_power", "fp16.loss_scale_window", "fp16.hysteresis", "fp16.min_loss_scale",
		"zero_optimization.stage", "zero_optimization.reduce_bucket_size", "zero_optimization.overlap_comm",
		"zero_optimization.stage3_prefetch_bucket_size", "zero_optimization.stage3_max_live_parameters",
		"zero_optimization.offload_optimizer.device", "communication_data_type", "data_types.grad_accum_dtype",
		"gradient_predivide_factor", "prescale_gradients", "gradient_allreduce_op", "optimizer.params.adam_w_mode"}
	accepted := `{
		"train_batch_size": 16, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2,
		"steps_per_print": 10, "wall_clock_breakdown": true, "tensorboard": {"enabled": true}, "wandb": {"enabled": false},
		"flops_profiler": {"enabled": true}, "activation_checkpointing": {"partition_activations": true},
		"zero_allow_untested_optimizer": true, "communication_data_type": "fp32", "data_types": {"grad_accum_dtype": "fp32"},
		"gradient_predivide_factor": 2, "prescale_gradients": false, "gradient_allreduce_op": "mean",
		"bf16": {"enabled": true, "immediate_grad_update": true},
		"optimizer": {"type": "AdamW", "params": {"lr": 0.001, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1, "torch_adam": false, "adam_w_mode": true}},
		"scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 100, "warmup_num_steps": 10}},
		"zero_optimization": {"stage": 3, "contiguous_gradients": true, "reduce_scatter": true, "reduce_bucket_size": 1000,
			"allgather_bucket_size": 1000, "overlap_comm": true, "stage3_prefetch_bucket_size": 500, "stage3_max_live_parameters": 100000,
			"stage3_param_persistence_threshold": 0, "round_robin_gradients": false,
			"offload_optimizer": {"device": "cpu", "pin_memory": true}, "offload_param": {"device": "none"}}
	}`
	c := dsRead(t, accepted)
	accounted(t, accepted, c.Notices, nil, mappedKeys)

	refusedText := `{
		"zero_optimization": {"stage": 0, "reduce_scatter": false, "allgather_bucket_size": 7, "stage3_param_persistence_threshold": 100,
			"offload_param": {"device": "cpu"}, "sub_group_size": 1e9, "round_robin_gradients": true},
		"optimizer": {"type": "Adam", "params": {"lr": 0.1, "weight_decay": 0.1, "adam_w_mode": false, "torch_adam": true}},
		"fp16": {"enabled": true, "consecutive_hysteresis": true}
	}`
	// the keys that only tune DeepSpeed's implementation are refused only
	// with Strict
	tuningKeys := []string{"optimizer.params.torch_adam", "zero_optimization.allgather_bucket_size", "zero_optimization.round_robin_gradients",
		"zero_optimization.stage3_param_persistence_threshold", "zero_optimization.sub_group_size"}
	var ds *DeepSpeedError
	for _, strict := range []bool{false, true} {
		_, err := ReadDeepSpeed([]byte(refusedText), DeepSpeedOptions{World: 2, Strict: strict})
		if !errors.As(err, &ds) {
			t.Fatalf("%v, want a *DeepSpeedError", err)
		}
		wantRefused := []string{"fp16.consecutive_hysteresis", "optimizer.params.adam_w_mode",
			"zero_optimization.reduce_scatter", "zero_optimization.stage"}
		if strict {
			wantRefused = append(wantRefused, tuningKeys...)
			slices.Sort(wantRefused)
		}
		if !slices.Equal(ds.Paths(), wantRefused) {
			t.Errorf("Strict %v: refused %q, want %q", strict, ds.Paths(), wantRefused)
		}
		for _, p := range ds.Problems {
			if !p.Refused || p.Text == "" {
				t.Errorf("%s: refused %v, %q: want a refusal that says what to do", p.Path, p.Refused, p.Text)
			}
		}
	}
	for _, name := range []string{"Lamb", "OneBitAdam", "Lion", "Adagrad", "Muon"} {
		_, err := ReadDeepSpeed([]byte(`{"zero_optimization": {"stage": 2}, "optimizer": {"type": "`+name+`"}}`), DeepSpeedOptions{World: 1})
		if !errors.As(err, &ds) || !slices.Equal(ds.Paths(), []string{"optimizer.type"}) || !strings.Contains(err.Error(), name) {
			t.Errorf("optimizer %s: %v, want optimizer.type refused", name, err)
		}
	}
}

// accounted fails unless every leaf of the JSON text is a notice, a
// problem, or among the mapped keys (a prefix ending in "." covers a
// section).
func accounted(t *testing.T, text string, notices []DeepSpeedNotice, problems []DeepSpeedProblem, mapped []string) {
	t.Helper()
	var doc map[string]any
	if err := json.Unmarshal([]byte(text), &doc); err != nil {
		t.Fatal(err)
	}
	said := map[string]bool{}
	for _, n := range notices {
		said[n.Path] = true
	}
	for _, p := range problems {
		said[p.Path] = true
	}
	var walk func(m map[string]any, at string)
	walk = func(m map[string]any, at string) {
		for k, v := range m {
			path := at + k
			if said[path] || slices.ContainsFunc(mapped, func(x string) bool { return x == path || strings.HasSuffix(x, ".") && strings.HasPrefix(path, x) }) {
				continue
			}
			if sub, ok := v.(map[string]any); ok {
				walk(sub, path+".")
				continue
			}
			t.Errorf("%s is neither mapped, noticed nor refused", path)
		}
	}
	walk(doc, "")
}

// TestDeepSpeedBadInput: malformed JSON, wrong types, values out of range,
// "auto" without an override, inconsistent batch sizes and unknown keys
// are ErrConfig naming the key's path (a line and column for malformed
// JSON), all of a file's problems at once; overrides fill "auto" and an
// override that the file's own value makes unused is a notice.
func TestDeepSpeedBadInput(t *testing.T) {
	for _, c := range []struct {
		text  string
		paths []string // nil: no DeepSpeedError
		in    string   // in the message
	}{
		{"{\n  \"zero_optimization\": {\"stage\": 2,}\n}", nil, "line 2, column 36"},
		{`[1, 2]`, nil, "the top level is a list"},
		{`{"a": 1} {"b": 2}`, nil, "more than one JSON value"},
		{`{"zero_optimization": {"stage": "two"}}`, []string{"zero_optimization.stage"}, `the string "two"; give a number`},
		{`{"zero_optimization": {"stage": 4}}`, []string{"zero_optimization.stage"}, "out of range"},
		{`{"zero_optimization": {"stage": 2.5}}`, []string{"zero_optimization.stage"}, "whole number"},
		{`{"zero_optimization": {"stage": 2, "reduce_bucket_size": -5, "overlap_comm": "yes"}}`, []string{"zero_optimization.overlap_comm", "zero_optimization.reduce_bucket_size"}, "true or false"},
		{`{"zero_optimization": {"stage": 2}, "gradient_clipping": "auto", "optimizer": {"type": "AdamW", "params": {"lr": "auto"}}}`,
			[]string{"gradient_clipping", "optimizer.params.lr"}, `"auto" with no override`},
		{`{"zero_optimization": {"stage": 2}, "train_batch_size": 10, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2}`,
			[]string{"train_batch_size"}, "10 is not train_micro_batch_size_per_gpu 2 × gradient_accumulation_steps 2 × world size 2"},
		{`{"zero_optimization": {"stage": 2, "stage_3_prefetch": 1}, "gradeint_clipping": 1}`, []string{"gradeint_clipping", "zero_optimization.stage_3_prefetch"}, "typo"},
		{`{"zero_optimization": {"stage": 2}, "optimizer": {"type": "AdamW", "params": {"betas": [0.9], "eps": 0}}}`, []string{"optimizer.params.betas", "optimizer.params.eps"}, "two numbers"},
		{`{"zero_optimization": {"stage": 2}, "fp16": {"enabled": true, "min_loss_scale": 1e9}}`, []string{"fp16.min_loss_scale"}, "above the initial scale"},
		{`{"zero_optimization": {"stage": 2}, "fp16": {"enabled": true}, "bf16": {"enabled": true}}`, []string{"fp16.enabled"}, "both enabled"},
		{`{"zero_optimization": {"stage": 2}, "communication_data_type": "int8"}`, []string{"communication_data_type"}, `"int8"`},
		{`{"zero_optimization": {"stage": 2}, "bf16": {"enabled": true}, "communication_data_type": "fp16"}`, []string{"communication_data_type"}, "model dtype or fp32"},
		{`{"zero_optimization": {"stage": 2}, "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 0, "warmup_type": "cubic"}}}`,
			[]string{"scheduler.params.warmup_num_steps", "scheduler.params.warmup_type"}, "out of range"},
		{`{"zero_optimization": {"stage": 2}, "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_max_lr": 0.1}}}`, []string{"scheduler.params.total_num_steps"}, "requires it"},
		{`{"zero_optimization": {"stage": 2}, "scheduler": {"type": "LRRangeTest", "params": {}}}`, []string{"scheduler.type"}, "WarmupLR"},
		{`{"zero_optimization": {"stage": 2}, "scheduler": {"type": "OneCycle", "params": {"cycle_min_lr": 0.1, "cycle_max_lr": [1, 2]}}}`, []string{"scheduler.params.cycle_max_lr"}, "one per parameter group"},
		{`{"zero_optimization": {"stage": 2}, "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": 0.1, "warmup_steps": 10}}}`, []string{"scheduler.params.warmup_steps"}, "constructor"},
	} {
		_, err := ReadDeepSpeed([]byte(c.text), DeepSpeedOptions{World: 2})
		if !errors.Is(err, ErrConfig) || !strings.Contains(err.Error(), c.in) {
			t.Errorf("%s: %v, want ErrConfig with %q", c.text, err, c.in)
			continue
		}
		var ds *DeepSpeedError
		if got := errors.As(err, &ds); got != (c.paths != nil) {
			t.Errorf("%s: a *DeepSpeedError %v, want %v", c.text, got, c.paths != nil)
			continue
		}
		if ds != nil && !slices.Equal(ds.Paths(), c.paths) {
			t.Errorf("%s: paths %q, want %q", c.text, ds.Paths(), c.paths)
		}
	}
	if _, err := ReadDeepSpeed([]byte(`{}`), DeepSpeedOptions{}); !errors.Is(err, ErrConfig) || !strings.Contains(err.Error(), "World") {
		t.Errorf("no world size: %v", err)
	}
	if _, err := ReadDeepSpeedFile(filepath.Join(t.TempDir(), "missing.json"), DeepSpeedOptions{World: 1}); !errors.Is(err, ErrConfig) {
		t.Errorf("a missing file: %v", err)
	}

	// overrides: "auto" filled, a concrete value kept with a notice
	text := `{"zero_optimization": {"stage": 2, "reduce_bucket_size": "auto"}, "gradient_clipping": 0.5,
		"optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto"}}}`
	c, err := ReadDeepSpeed([]byte(text), DeepSpeedOptions{World: 2, Overrides: map[string]any{
		"zero_optimization.reduce_bucket_size": 4096, "optimizer.params.lr": 3e-4, "optimizer.params.betas": []any{0.9, 0.95},
		"gradient_clipping": 1.0, "scheduler.params.total_num_steps": 10}})
	if err != nil {
		t.Fatal(err)
	}
	if a := c.Config.Optimizer.Groups[0].(AdamW); a.LR != 3e-4 || a.Beta2 != 0.95 || c.Config.BucketBytes != 4096*4 || c.Config.Optimizer.Clip != 0.5 {
		t.Errorf("overrides: %+v, bucket %d, clip %v", a, c.Config.BucketBytes, c.Config.Optimizer.Clip)
	}
	var paths []string
	for _, n := range c.Notices {
		if strings.Contains(n.Text, "override") {
			paths = append(paths, n.Path)
		}
	}
	sort.Strings(paths)
	if !slices.Equal(paths, []string{"gradient_clipping", "scheduler.params.total_num_steps"}) {
		t.Errorf("override notices at %q, want gradient_clipping (the file sets 0.5) and scheduler.params.total_num_steps (no such key)", paths)
	}
}

// dsHeapAllocs is the least that one of n calls of fn allocated on the
// heap (runtime/metrics' /gc/heap/allocs:bytes across the call): the
// counter is the process's, so another goroutine's allocations can only
// add to one call's figure.
func dsHeapAllocs(fn func(), n int) uint64 {
	sample := []metrics.Sample{{Name: "/gc/heap/allocs:bytes"}}
	least := uint64(math.MaxUint64)
	for range n {
		metrics.Read(sample)
		before := sample[0].Value.Uint64()
		fn()
		metrics.Read(sample)
		least = min(least, sample[0].Value.Uint64()-before)
	}
	return least
}

// dsAllocBound is what reading n bytes of config may allocate: 64 bytes a
// byte and 1 MiB.
func dsAllocBound(n int) uint64 { return 64*uint64(n) + 1<<20 }

// TestDeepSpeedMalformedBatchSizes: a batch size of 0, below 0 or not a
// number is reported at its own key, alone, and nothing is derived from
// it (it divided by zero), with or without the other batch keys.
func TestDeepSpeedMalformedBatchSizes(t *testing.T) {
	keys := []string{"train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"}
	for bad := range keys {
		for _, value := range []string{`0`, `-3`, `"x"`, `2.5`, `null`} {
			for others := range 4 { // which of the other two keys are given, as 8 and 2
				fields := []string{fmt.Sprintf("%q: %s", keys[bad], value)}
				n := 0
				for k := range keys {
					if k == bad {
						continue
					}
					if others>>n&1 == 1 {
						fields = append(fields, fmt.Sprintf("%q: %d", keys[k], 8>>(2*n)))
					}
					n++
				}
				text := `{"zero_optimization": {"stage": 2}, ` + strings.Join(fields, ", ") + `}`
				var err error
				func() {
					defer func() {
						if p := recover(); p != nil {
							t.Fatalf("%s: panic %v", text, p)
						}
					}()
					_, err = ReadDeepSpeed([]byte(text), DeepSpeedOptions{World: 2})
				}()
				var ds *DeepSpeedError
				if !errors.As(err, &ds) || !slices.Equal(ds.Paths(), []string{keys[bad]}) {
					t.Errorf("%s: %v, want a problem at %s alone", text, err, keys[bad])
				}
			}
		}
	}
}

// TestDeepSpeedReadStaysLinear: a deep nest under a noticed key is refused
// before it is decoded, naming the depth, and a file of 100,000 unknown
// keys lists 100 problems and counts the rest; each read allocates at most
// 64 bytes per byte of the file and 1 MiB (it took 4.9 GB for a 1 MB nest
// 5,000 deep, and 39 s of CPU for 100,000 keys).
func TestDeepSpeedReadStaysLinear(t *testing.T) {
	key := strings.Repeat("k", 200)
	deep := func(n int) []byte {
		return []byte(`{"zero_optimization": {"stage": 2}, "tensorboard": ` + strings.Repeat(`{"`+key+`": `, n) + `1` + strings.Repeat("}", n) + `}`)
	}
	many := func(n int) []byte {
		var b strings.Builder
		b.WriteString(`{"zero_optimization": {"stage": 2, `)
		for i := range n {
			fmt.Fprintf(&b, `"unknown_%d": %d, `, i, i)
		}
		b.WriteString(`"stage3_max_live_parameters": 1}}`)
		return []byte(b.String())
	}
	for _, c := range []struct {
		what     string
		data     []byte
		problems int // listed
		more     int
		in       string
	}{
		{"1,000 deep", deep(1000), 0, 0, fmt.Sprintf("nested more than %d deep at line 1, column ", dsMaxDepth)},
		{fmt.Sprintf("%d deep", dsMaxDepth-1), deep(dsMaxDepth - 1), -1, 0, ""},
		{"100,000 unknown keys", many(100_000), dsMaxProblems, 100_000 - dsMaxProblems, "100000 key(s) zero cannot take"},
	} {
		var err error
		alloc := dsHeapAllocs(func() { _, err = ReadDeepSpeed(c.data, DeepSpeedOptions{World: 2}) }, 3)
		if bound := dsAllocBound(len(c.data)); alloc > bound {
			t.Errorf("%s: %d bytes of config allocated %d bytes, over %d", c.what, len(c.data), alloc, bound)
		}
		var ds *DeepSpeedError
		switch {
		case c.problems < 0:
			if err != nil {
				t.Errorf("%s: %v", c.what, err)
			}
		case c.problems == 0:
			if errors.As(err, &ds) || !errors.Is(err, ErrConfig) || !strings.Contains(err.Error(), c.in) {
				t.Errorf("%s: %v, want ErrConfig with %q", c.what, err, c.in)
			}
		default:
			if !errors.As(err, &ds) || len(ds.Problems) != c.problems || ds.More != c.more || !strings.Contains(err.Error(), c.in) {
				t.Fatalf("%s: %v, want %d problems listed and %d more", c.what, err, c.problems, c.more)
			}
		}
	}
}

// FuzzReadDeepSpeed reads any bytes as a DeepSpeed config, alone and with
// the Hugging Face Trainer's overrides. Checks: no panic; at most 64 bytes
// allocated per byte of input and 1 MiB; a refusal is ErrConfig, and a
// *DeepSpeedError lists 1 to 100 problems, each with a path and what to
// do, by path, none twice; an accepted config has at most 200 notices,
// each with a path and a text, and passes New's checks with a parameter of
// its dtype. The seeds are the
// published configs and testdata/fuzz/FuzzReadDeepSpeed (go test runs
// them); run it with
//
//	go test -run '^$' -fuzz FuzzReadDeepSpeed -fuzztime 5m .
func FuzzReadDeepSpeed(f *testing.F) {
	files, err := filepath.Glob(filepath.Join("testdata", "deepspeed", "*.json"))
	if err != nil || len(files) == 0 {
		f.Fatalf("no published configs to seed with: %v", err)
	}
	for _, name := range files {
		data, err := os.ReadFile(name)
		if err != nil {
			f.Fatal(err)
		}
		f.Add(data)
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		for _, opts := range []DeepSpeedOptions{{World: 2}, {World: 3, Overrides: hfOverrides}} {
			var c DeepSpeedConfig
			var err error
			read := func() { c, err = ReadDeepSpeed(data, opts) }
			if alloc, bound := dsHeapAllocs(read, 1), dsAllocBound(len(data)); alloc > bound {
				if alloc = dsHeapAllocs(read, 3); alloc > bound { // not another goroutine's
					t.Fatalf("World %d: %d bytes read allocated %d, over %d", opts.World, len(data), alloc, bound)
				}
			}
			var ds *DeepSpeedError
			switch {
			case err == nil:
				if len(c.Notices) > dsMaxNotices {
					t.Fatalf("%d notices, over %d", len(c.Notices), dsMaxNotices)
				}
				for i, n := range c.Notices {
					if n.Path == "" || n.Text == "" {
						t.Fatalf("notice %d %+v: want a path and a text", i, n)
					}
				}
				cfg, data := c.Config, Float32s(make([]float32, 8))
				if c.DType != FP32 {
					data = Halfs(make([]uint16, 8), c.DType)
				}
				if _, err := cfg.resolve([]Param{{Name: "p", Count: 8, DType: c.DType, Data: data}}); err != nil {
					t.Fatalf("an accepted config that New refuses: %v\n%+v", err, c.Config)
				}
			case !errors.Is(err, ErrConfig):
				t.Fatalf("%v, want ErrConfig", err)
			case errors.As(err, &ds):
				if len(ds.Problems) == 0 || len(ds.Problems) > dsMaxProblems || ds.More < 0 {
					t.Fatalf("%d problems listed, %d more", len(ds.Problems), ds.More)
				}
				for i, p := range ds.Problems {
					if p.Path == "" || p.Text == "" || i > 0 && ds.Problems[i-1].Path >= p.Path {
						t.Fatalf("problem %d %+v: want a path, a text, and the paths in order, none twice", i, p)
					}
				}
			}
		}
	})
}

// TestDeepSpeedLossScaleSequences: a mapped fp16 config gives DeepSpeed's
// loss scales and skipped steps, step for step, at G = 1, 2, 3 and 4
// backwards a step, for overflows at no step, at one, and several within
// the hysteresis, over more than 3 windows (window 3, hysteresis 2). The
// reference is dsScaler with DeepSpeed's convention: each backward's loss
// is scaled by S/G (loss/G times the scale S). Each clean backward's
// gradient is 0.75 × 65504 once scaled by S/G, so a backward scaled by S
// (zero's convention before) would overflow fp16 at G ≥ 2; an overflow
// step puts an inf into one element. Checked at every step: the scale a
// backward carries (Engine.LossScale, S/G), the scaler's (Stats.LossScale,
// S), and the skip. At G = 3, S/3 is not a power of two; the step's
// gradient factor, fl32(fl32(1/3)/(S/3)), is still exactly 1/S, DeepSpeed's
// unscale, which is checked too.
func TestDeepSpeedLossScaleSequences(t *testing.T) {
	const power, window, hyst = 10, 3, 2
	patterns := map[string]string{ // o: an overflow at that step
		"none":                          "..............",
		"one at step 4":                 "....o.........",
		"several within the hysteresis": "..oo....o.oo..",
		"every step, then clean":        "ooo...........",
	}
	for name, pattern := range patterns {
		for g := 1; g <= 4; g++ {
			text := fmt.Sprintf(`{"zero_optimization": {"stage": 2}, "fp16": {"enabled": true, "initial_scale_power": %d,
				"loss_scale_window": %d, "hysteresis": %d}, "gradient_accumulation_steps": %d, "train_micro_batch_size_per_gpu": 1,
				"data_types": {"grad_accum_dtype": "fp32"}, "gradient_clipping": 0, "optimizer": {"type": "SGD", "params": {"lr": 0}}}`,
				power, window, hyst, g)
			c := dsRead(t, text)
			errs := dsEngines(t, c.Config, c.DType, []int{16}, func(rank int, e *Engine, s *HostStream, ps []Param) error {
				ref := newDSScaler(math.Ldexp(1, power), window, hyst, 1)
				for st, o := range pattern {
					S, over := ref.curScale, o == 'o'
					if got := e.LossScale(); got != S/float64(g) {
						return fmt.Errorf("step %d: each backward carries %v, want DeepSpeed's S/G = %v/%d", st, got, S, g)
					}
					if g == 3 && float32(float64(float32(1.0/3))/(S/3)) != float32(1/S) {
						return fmt.Errorf("step %d: at G 3 the gradient factor is not 1/S for S %v", st, S)
					}
					for k := range g {
						m := 0.75 * 65504 * float64(g) / S // the unscaled gradient of one backward
						b := newTBuf(FP16, ps[0].Count)
						for j := range ps[0].Count {
							v := float32(m * e.LossScale())
							if rank == 1 { // a sum over ranks stays within fp16's range on any wire
								v = 0
							}
							if over && rank == 0 && k == g-1 && j == 3 {
								v = float32(math.Inf(1))
							}
							b.set(j, v)
						}
						if _, err := e.GradReady(0, b.t(), s); err != nil {
							return err
						}
						if err := e.EndBackward(); err != nil {
							return err
						}
					}
					if err := e.Step(); err != nil {
						return err
					}
					if st := e.Stats(); st.Skipped != over || st.LossScale != S {
						return fmt.Errorf("step %d: skipped %v at scale %v, want DeepSpeed's: skipped %v at %v", st.Step, st.Skipped, st.LossScale, over, S)
					}
					ref.updateScale(over)
				}
				return nil
			})
			for rank, err := range errs {
				if err != nil {
					t.Errorf("%s, G %d, rank %d: %v", name, g, rank, err)
				}
			}
		}
	}
}

// dsSections are the places a key can be, each with the keys zero knows
// there and a config that puts a key (with the value 1) in it.
var dsSections = []struct {
	at    string
	table map[string]dsKey
	wrap  func(key string) string
}{
	{"", dsTopKeys, func(k string) string { return `{"zero_optimization": {"stage": 2}, "` + k + `": 1}` }},
	{"zero_optimization.", dsZeroKeys, func(k string) string { return `{"zero_optimization": {"stage": 2, "` + k + `": 1}}` }},
	{"zero_optimization.offload_optimizer.", dsOffloadKeys, func(k string) string {
		return `{"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "` + k + `": 1}}}`
	}},
	{"fp16.", dsFP16Keys, func(k string) string {
		return `{"zero_optimization": {"stage": 2}, "fp16": {"enabled": true, "` + k + `": 1}}`
	}},
	{"bf16.", dsBF16Keys, func(k string) string {
		return `{"zero_optimization": {"stage": 2}, "bf16": {"enabled": true, "` + k + `": 1}}`
	}},
	{"data_types.", dsDataTypesKeys, func(k string) string { return `{"zero_optimization": {"stage": 2}, "data_types": {"` + k + `": 1}}` }},
	{"optimizer.", dsOptimizerKeys, func(k string) string {
		return `{"zero_optimization": {"stage": 2}, "optimizer": {"type": "AdamW", "` + k + `": 1}}`
	}},
	{"optimizer.params.", dsAdamKeys, func(k string) string {
		return `{"zero_optimization": {"stage": 2}, "optimizer": {"type": "AdamW", "params": {"` + k + `": 1}}}`
	}},
	{"optimizer.params.", dsSGDKeys, func(k string) string {
		return `{"zero_optimization": {"stage": 2}, "optimizer": {"type": "SGD", "params": {"` + k + `": 1}}}`
	}},
	{"scheduler.", dsSchedulerKeys, func(k string) string {
		return `{"zero_optimization": {"stage": 2}, "scheduler": {"type": "WarmupLR", "` + k + `": 1}}`
	}},
}

func init() {
	for _, name := range slices.Sorted(maps.Keys(dsScheduleParams)) {
		dsSections = append(dsSections, struct {
			at    string
			table map[string]dsKey
			wrap  func(key string) string
		}{"scheduler.params.", dsScheduleKeys(dsScheduleParams[name]), func(k string) string {
			return `{"zero_optimization": {"stage": 2}, "scheduler": {"type": "` + name + `", "params": {"` + k + `": 1}}}`
		}})
	}
}

// TestDeepSpeedTypos: every key zero knows, in every section, with one
// letter dropped, one added, one changed, or two neighbours swapped, is
// refused at its path with the key among the suggestions ("did you mean
// `key`?"), at the top level too, where an unknown key is otherwise taken
// with a notice.
func TestDeepSpeedTypos(t *testing.T) {
	typos := func(k string) []string {
		var out []string
		for i := range len(k) + 1 {
			out = append(out, k[:i]+"q"+k[i:]) // added
			if i < len(k) {
				out = append(out, k[:i]+k[i+1:])                                                     // dropped
				out = append(out, k[:i]+map[bool]string{true: "z", false: "q"}[k[i] == 'q']+k[i+1:]) // changed
			}
			if i+1 < len(k) && k[i] != k[i+1] {
				out = append(out, k[:i]+k[i+1:i+2]+k[i:i+1]+k[i+2:]) // swapped
			}
		}
		return out
	}
	checked := 0
	for _, sec := range dsSections {
		for _, key := range slices.Sorted(maps.Keys(sec.table)) {
			for _, typo := range typos(key) {
				if _, known := sec.table[typo]; known || typo == "" {
					continue
				}
				_, err := ReadDeepSpeed([]byte(sec.wrap(typo)), DeepSpeedOptions{World: 2})
				var ds *DeepSpeedError
				i := -1
				if errors.As(err, &ds) {
					i = slices.IndexFunc(ds.Problems, func(p DeepSpeedProblem) bool { return p.Path == sec.at+typo })
				}
				if i < 0 || !ds.Problems[i].Refused || !strings.Contains(ds.Problems[i].Text, "did you mean") ||
					!strings.Contains(ds.Problems[i].Text, "`"+key+"`") {
					t.Errorf("%s%s, a typo of %s: %v, want it refused with %s suggested", sec.at, typo, key, err, key)
				}
				checked++
			}
		}
	}
	t.Logf("%d typos of the known keys refused with the key suggested", checked)
}

// TestDeepSpeedRealKeysNoticed: 50 keys of real DeepSpeed configs that zero
// does not map onto a setting, each at its path (DeepSpeed's own
// top-level keys that zero does not know, the published configs' unknown
// top-level keys, and the keys of zero's tables that change nothing or
// only tune DeepSpeed), are taken with a notice at that path: none is
// refused, none taken for a typo.
func TestDeepSpeedRealKeysNoticed(t *testing.T) {
	top := map[string]string{
		// DeepSpeed reads these (at edaa7221); zero does not know them
		"aio": `{"block_size": 1048576, "queue_depth": 8}`, "nebula": `{"enabled": false}`, "graph_harvesting": `false`,
		"seq_parallel_communication_data_type": `"fp32"`, "use_data_before_expert_parallelism": `false`,
		"expert_parallel": `{"enabled": false}`, "datastates_ckpt": `{"host_cache_size": 16}`,
		// in published configs (the list)
		"comms_config": `{"verbose": false}`, "monitor_config": `{"enabled": false}`, "cuda_visible_devices": `"0,1"`,
		// in zero's table: taken with a notice
		"steps_per_print": `10`, "wall_clock_breakdown": `false`, "memory_breakdown": `false`, "dump_state": `false`,
		"tensorboard": `{"enabled": true, "output_path": "logs"}`, "wandb": `{"enabled": false}`, "csv_monitor": `{"enabled": false}`,
		"comet": `{"enabled": false}`, "comms_logger": `{"enabled": true}`, "flops_profiler": `{"enabled": false}`,
		"timers": `{"throughput": {"enabled": true}}`, "log_level": `"info"`, "activation_checkpointing": `{"partition_activations": false}`,
		"zero_allow_untested_optimizer": `true`, "zero_force_ds_cpu_optimizer": `false`, "dataloader_drop_last": `false`,
		"disable_allgather": `false`, "checkpoint": `{"tag_validation": "Warn"}`, "amp": `{"enabled": false}`,
		"autotuning": `{"enabled": false}`, "compile": `{"enabled": false}`, "elasticity": `{"enabled": false}`,
		"sparse_gradients": `false`, "sequence_parallel_size": `1`,
	}
	inner := map[string]string{
		"zero_optimization.contiguous_gradients": `true`, "zero_optimization.load_from_fp32_weights": `true`,
		"zero_optimization.stage3_gather_16bit_weights_on_model_save": `true`, "zero_optimization.ignore_unused_parameters": `true`,
		"zero_optimization.sub_group_size": `1e9`, "zero_optimization.stage3_max_reuse_distance": `1e9`,
		"zero_optimization.stage3_param_persistence_threshold": `1e5`, "zero_optimization.round_robin_gradients": `true`,
		"zero_optimization.allgather_bucket_size": `2e8`, "zero_optimization.use_multi_rank_bucket_allreduce": `true`,
		"zero_optimization.memory_efficient_linear": `true`, "zero_optimization.stage3_model_persistence_threshold": `1e9`,
		"zero_optimization.offload_optimizer.buffer_count": `4`, "zero_optimization.offload_optimizer.fast_init": `false`,
		"fp16.auto_cast": `false`, "bf16.immediate_grad_update": `false`, "optimizer.params.torch_adam": `true`,
		"data_types.buffer_dtype": `"fp32"`,
	}
	n := 0
	for key, value := range top {
		text := `{"zero_optimization": {"stage": 2}, "` + key + `": ` + value + `}`
		checkNoticed(t, text, key)
		n++
	}
	for path, value := range inner {
		parts := strings.Split(path, ".")
		inside := `"` + parts[len(parts)-1] + `": ` + value
		var text string
		switch parts[0] {
		case "zero_optimization":
			if len(parts) == 3 {
				inside = `"offload_optimizer": {"device": "cpu", ` + inside + `}`
			}
			text = `{"zero_optimization": {"stage": 2, ` + inside + `}}`
		case "fp16", "bf16":
			text = `{"zero_optimization": {"stage": 2}, "` + parts[0] + `": {"enabled": true, ` + inside + `}}`
		case "optimizer":
			text = `{"zero_optimization": {"stage": 2}, "optimizer": {"type": "AdamW", "params": {` + inside + `}}}`
		case "data_types":
			text = `{"zero_optimization": {"stage": 2}, "bf16": {"enabled": true}, "data_types": {` + inside + `}}`
		}
		checkNoticed(t, text, path)
		n++
	}
	if n < 50 {
		t.Fatalf("%d keys, want 50", n)
	}
}

// checkNoticed fails unless text is accepted with a notice at path.
func checkNoticed(t *testing.T, text, path string) {
	t.Helper()
	c, err := ReadDeepSpeed([]byte(text), DeepSpeedOptions{World: 2})
	if err != nil {
		t.Errorf("%s: %v", path, err)
		return
	}
	if !slices.ContainsFunc(c.Notices, func(n DeepSpeedNotice) bool { return n.Path == path }) {
		t.Errorf("%s: no notice at its path: %v", path, c.Notices)
	}
}

// TestDeepSpeedBatchMessagesCiteWhatWasGiven: whatever subset of the three
// batch keys a file gives, and at any world size, a problem with them
// cites no number but those the file gave and the world size (an absent
// gradient_accumulation_steps read as 0, and a micro-batch the file never
// set, were cited).
func TestDeepSpeedBatchMessagesCiteWhatWasGiven(t *testing.T) {
	number := regexp.MustCompile(`\d+`)
	refused := 0
	for w := 1; w <= 3; w++ {
		for _, tb := range []int{0, 1, 2, 5, 6, 8, 12} {
			for _, mb := range []int{0, 1, 3, 4} {
				for _, g := range []int{0, 1, 2, 3} {
					given := map[string]bool{fmt.Sprint(w): true}
					var fields []string
					for _, kv := range []struct {
						key string
						v   int
					}{{"train_batch_size", tb}, {"train_micro_batch_size_per_gpu", mb}, {"gradient_accumulation_steps", g}} {
						if kv.v > 0 {
							fields = append(fields, fmt.Sprintf("%q: %d", kv.key, kv.v))
							given[fmt.Sprint(kv.v)] = true
						}
					}
					text := `{"zero_optimization": {"stage": 2}` + strings.Join(append([]string{""}, fields...), ", ") + `}`
					_, err := ReadDeepSpeed([]byte(text), DeepSpeedOptions{World: w})
					var ds *DeepSpeedError
					if !errors.As(err, &ds) {
						if err != nil {
							t.Errorf("%s: %v", text, err)
						}
						continue
					}
					refused++
					for _, p := range ds.Problems {
						for _, n := range number.FindAllString(strings.TrimPrefix(p.Text, p.Path), -1) {
							if !given[n] {
								t.Errorf("W %d, %s: %s: %q cites %s, which nobody gave", w, text, p.Path, p.Text, n)
							}
						}
					}
				}
			}
		}
	}
	if refused == 0 {
		t.Fatal("no combination was refused: the check checked nothing")
	}
}

// TestDeepSpeedBatchSizesAsDeepSpeed: every subset of the three batch keys
// at W = 1, 2, 3 resolves as DeepSpeed's _set_batch_related_parameters and
// _batch_assertion (runtime/config.py at edaa7221, transcribed here): the
// missing ones derived by floor division, then train_batch_size = micro ×
// G × W checked; refused exactly where DeepSpeed asserts.
func TestDeepSpeedBatchSizesAsDeepSpeed(t *testing.T) {
	// deepspeed returns train, micro, grad_acc, or ok false where it asserts
	deepspeed := func(train, micro, gradAcc, world int) (int, int, int, bool) {
		switch {
		case train > 0 && micro > 0 && gradAcc > 0:
		case train > 0 && micro > 0:
			gradAcc = train / micro / world
		case train > 0 && gradAcc > 0:
			micro = train / world / gradAcc
		case micro > 0 && gradAcc > 0:
			train = micro * gradAcc * world
		case train > 0:
			gradAcc, micro = 1, train/world
		case micro > 0:
			train, gradAcc = micro*world, 1
		}
		return train, micro, gradAcc, train > 0 && micro > 0 && gradAcc > 0 && train == micro*gradAcc*world
	}
	checked := 0
	for w := 1; w <= 3; w++ {
		for _, tb := range []int{0, 1, 2, 5, 6, 8, 12, 16} {
			for _, mb := range []int{0, 1, 3, 4} {
				for _, g := range []int{0, 1, 2, 3} {
					if tb == 0 && mb == 0 {
						continue // DeepSpeed asks for one; zero needs none
					}
					var fields []string
					for _, kv := range []struct {
						key string
						v   int
					}{{"train_batch_size", tb}, {"train_micro_batch_size_per_gpu", mb}, {"gradient_accumulation_steps", g}} {
						if kv.v > 0 {
							fields = append(fields, fmt.Sprintf("%q: %d", kv.key, kv.v))
						}
					}
					text := `{"zero_optimization": {"stage": 2}, ` + strings.Join(fields, ", ") + `}`
					c, err := ReadDeepSpeed([]byte(text), DeepSpeedOptions{World: w})
					train, micro, acc, ok := deepspeed(tb, mb, g, w)
					switch {
					case ok != (err == nil):
						t.Errorf("W %d, %s: %v; DeepSpeed accepts it: %v", w, text, err, ok)
					case ok && (c.GlobalBatch != train || c.MicroBatch != micro || c.Config.Grads.AccumSteps != acc):
						t.Errorf("W %d, %s: batches %d/%d, %d backwards; DeepSpeed's %d/%d, %d", w, text, c.GlobalBatch, c.MicroBatch,
							c.Config.Grads.AccumSteps, train, micro, acc)
					}
					checked++
				}
			}
		}
	}
	t.Logf("%d combinations resolved as DeepSpeed resolves them", checked)
}

// TestDeepSpeedStage3Notice: a config at stage 3 says that the forward
// reads the parameters through Gather and Release (a loop written for
// stage 2 reads Param.Data, which stage 3 does not update); stages 1 and 2
// say nothing of it.
func TestDeepSpeedStage3Notice(t *testing.T) {
	for stage := 1; stage <= 3; stage++ {
		c := dsRead(t, fmt.Sprintf(`{"zero_optimization": {"stage": %d}}`, stage))
		i := slices.IndexFunc(c.Notices, func(n DeepSpeedNotice) bool { return n.Path == "zero_optimization.stage" })
		if got := i >= 0 && strings.Contains(c.Notices[i].Text, "Gather") && strings.Contains(c.Notices[i].Text, "Release"); got != (stage == 3) {
			t.Errorf("stage %d: a notice on Gather and Release %v, want %v: %v", stage, got, stage == 3, c.Notices)
		}
	}
}

// TestDeepSpeedOneCycleDefaults: DeepSpeed's OneCycle takes an unset
// cycle_second_step_size (and cycle_second_stair_count) as the first's,
// not a default of its own; a 0 given is kept. (The tutorial config gives
// both, so a wrong default passed every test.)
func TestDeepSpeedOneCycleDefaults(t *testing.T) {
	for _, c := range []struct {
		params                    string
		secondSteps, secondStairs int
	}{
		{`"cycle_first_step_size": 50, "cycle_first_stair_count": 5`, 50, 5},
		{`"cycle_first_step_size": 50, "cycle_second_step_size": 0, "cycle_first_stair_count": 5, "cycle_second_stair_count": 0`, 0, 0},
		{`"cycle_first_step_size": 30, "cycle_second_step_size": 70`, 70, 0},
	} {
		cfg := dsRead(t, `{"zero_optimization": {"stage": 2}, "scheduler": {"type": "OneCycle", "params": {"cycle_min_lr": 0.001, "cycle_max_lr": 0.01, `+c.params+`}}}`)
		s, ok := cfg.Config.Optimizer.Schedule.(OneCycle)
		if !ok || s.SecondStepSize != c.secondSteps || s.SecondStairCount != c.secondStairs {
			t.Errorf("%s: %+v, want the second half %d steps in %d stairs", c.params, cfg.Config.Optimizer.Schedule, c.secondSteps, c.secondStairs)
		}
	}
}

// TestDeepSpeedMinLossScaleBelowOne: an fp16 config's min_loss_scale below
// 1 (which DeepSpeed 0.19.8, reading it as a whole number, refuses) is
// honoured with a notice: overflow after overflow the scale halves to it,
// below 1, and stays there, as dsScaler does; unset, DeepSpeed's default 1
// is the floor.
func TestDeepSpeedMinLossScaleBelowOne(t *testing.T) {
	for _, c := range []struct {
		min   string
		floor float64
	}{{`, "min_loss_scale": 0.25`, 0.25}, {``, 1}} {
		text := `{"zero_optimization": {"stage": 2}, "fp16": {"enabled": true, "initial_scale_power": 1, "hysteresis": 1` + c.min + `},
			"optimizer": {"type": "SGD", "params": {"lr": 0.1}}}`
		cfg := dsRead(t, text)
		noticed := slices.ContainsFunc(cfg.Notices, func(n DeepSpeedNotice) bool { return n.Path == "fp16.min_loss_scale" })
		if noticed != (c.floor < 1) {
			t.Errorf("%q: a notice at fp16.min_loss_scale %v, want %v: %v", c.min, noticed, c.floor < 1, cfg.Notices)
		}
		everyRankIs(t, text, dsEngines(t, cfg.Config, cfg.DType, []int{16}, func(rank int, e *Engine, s *HostStream, ps []Param) error {
			ref := newDSScaler(2, 1000, 1, c.floor)
			for st := range 6 {
				if got := e.LossScale(); got != ref.curScale {
					return fmt.Errorf("step %d: scale %v, want %v", st, got, ref.curScale)
				}
				if err := dsBackward(e, s, ps, func(p, j int) float64 { return math.Inf(1) }); err != nil {
					return err
				}
				if err := e.Step(); err != nil {
					return err
				}
				ref.updateScale(true)
			}
			if e.LossScale() != c.floor {
				return fmt.Errorf("after 6 overflows the scale is %v, want the floor %v", e.LossScale(), c.floor)
			}
			return nil
		}), nil)
	}
}

// TestDeepSpeedStepsPerPrint: steps_per_print reaches the trainer as
// StepsPerPrint (0 where the file gives none), still with its notice; a
// value that is not a positive whole number is refused.
func TestDeepSpeedStepsPerPrint(t *testing.T) {
	if c := dsRead(t, `{"zero_optimization": {"stage": 2}, "steps_per_print": 7}`); c.StepsPerPrint != 7 || !slices.ContainsFunc(c.Notices, func(n DeepSpeedNotice) bool { return n.Path == "steps_per_print" }) {
		t.Errorf("steps_per_print 7: StepsPerPrint %d, notices %v", c.StepsPerPrint, c.Notices)
	}
	if c := dsRead(t, `{"zero_optimization": {"stage": 2}}`); c.StepsPerPrint != 0 {
		t.Errorf("no steps_per_print: StepsPerPrint %d, want 0", c.StepsPerPrint)
	}
	for _, bad := range []string{`0`, `-3`, `2.5`, `"10"`} {
		_, err := ReadDeepSpeed([]byte(`{"zero_optimization": {"stage": 2}, "steps_per_print": `+bad+`}`), DeepSpeedOptions{World: 2})
		var ds *DeepSpeedError
		if !errors.As(err, &ds) || !slices.Equal(ds.Paths(), []string{"steps_per_print"}) {
			t.Errorf("steps_per_print %s: %v, want steps_per_print refused", bad, err)
		}
	}
}

// TestDeepSpeedOffloadParam: offload_param with device "cpu" at stage 3
// maps to Offload.Params (the old cpu_offload_param: true too, with a
// notice), and New takes the mapped config; pin_memory, buffer_count,
// buffer_size, max_in_cpu and nvme_path are noticed, each saying what zero
// does instead; device "none" is noticed; NVMe, an unknown key, a bad
// device and both names at once are refused or invalid; below stage 3 it
// is noticed as having no effect, as DeepSpeed offloads parameters at
// stage 3 only.
func TestDeepSpeedOffloadParam(t *testing.T) {
	text := func(stage int, zero string) string {
		return fmt.Sprintf(`{"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": true},
			"optimizer": {"type": "AdamW", "params": {"lr": 0.001}},
			"zero_optimization": {"stage": %d, "stage3_param_persistence_threshold": 0%s}}`, stage, zero)
	}
	noticed := func(c DeepSpeedConfig, path, says string) bool {
		for _, n := range c.Notices {
			if n.Path == path && strings.Contains(n.Text, says) {
				return true
			}
		}
		return false
	}
	full := `, "offload_param": {"device": "cpu", "pin_memory": true, "buffer_count": 5, "buffer_size": 1e8, "max_in_cpu": 1e9, "nvme_path": "/local_nvme"}`
	c := dsRead(t, text(3, full))
	if !c.Config.Offload.Params || c.Config.Offload.Optimizer {
		t.Fatalf("offload_param cpu at stage 3: Offload %+v, want Params alone", c.Config.Offload)
	}
	for path, says := range map[string]string{
		"zero_optimization.offload_param.pin_memory":   "page-locks",
		"zero_optimization.offload_param.buffer_count": "gathers into its own pool",
		"zero_optimization.offload_param.buffer_size":  "largest bucket",
		"zero_optimization.offload_param.max_in_cpu":   "whole shard in page-locked host memory",
		"zero_optimization.offload_param.nvme_path":    "no NVMe",
	} {
		if !noticed(c, path, says) {
			t.Errorf("%s: no notice saying %q in %v", path, says, c.Notices)
		}
	}
	comms, _ := NewLocalGroup(1)
	e, err := New(c.Config, comms[0], []Param{{Name: "w", Count: 1000, DType: c.DType, Data: toDType(make([]float32, 1000), c.DType)}})
	if err != nil {
		t.Fatalf("New with the mapped config: %v", err)
	}
	if st := e.ParamMemory(); st.ShardBytes != 0 || st.HostShardBytes == 0 {
		t.Errorf("the mapped engine's parameter memory %+v: the shard must be on the host", st)
	}
	e.Close()

	old := dsRead(t, text(3, `, "cpu_offload_param": true`))
	if !old.Config.Offload.Params || !noticed(old, "zero_optimization.cpu_offload_param", "old name of offload_param") {
		t.Errorf("cpu_offload_param true: Offload %+v, notices %v", old.Config.Offload, old.Notices)
	}
	none := dsRead(t, text(3, `, "offload_param": {"device": "none"}`))
	if none.Config.Offload.Params || !noticed(none, "zero_optimization.offload_param.device", "stay on the device") {
		t.Errorf("device none: Offload %+v, notices %v", none.Config.Offload, none.Notices)
	}
	below := dsRead(t, text(2, `, "offload_param": {"device": "cpu"}`))
	if below.Config.Offload.Params || !noticed(below, "zero_optimization.offload_param", "stage 3 only") {
		t.Errorf("stage 2: Offload %+v, notices %v", below.Config.Offload, below.Notices)
	}
	for _, c := range []struct {
		zero    string
		path    string
		refused bool
	}{
		{`, "offload_param": {"device": "nvme", "nvme_path": "/local_nvme"}`, "zero_optimization.offload_param.device", true},
		{`, "offload_param": {"device": "cpu", "max_in_cpus": 1}`, "zero_optimization.offload_param.max_in_cpus", true},
		{`, "offload_param": {"device": "gpu"}`, "zero_optimization.offload_param.device", false},
		{`, "offload_param": {"device": "cpu"}, "cpu_offload_param": true`, "zero_optimization.cpu_offload_param", false},
	} {
		_, err := ReadDeepSpeed([]byte(text(3, c.zero)), DeepSpeedOptions{World: 2})
		var ds *DeepSpeedError
		if !errors.As(err, &ds) || !slices.Equal(ds.Paths(), []string{c.path}) || ds.Problems[0].Refused != c.refused || ds.Problems[0].Text == "" {
			t.Errorf("%s: %v, want %s refused=%v, saying what to do", c.zero, err, c.path, c.refused)
		}
	}
}
