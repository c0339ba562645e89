package main

import (
	"fmt"
	"io"
	"strings"

	"zero"
)

// withDeepSpeed reads c.deepspeed and returns c trained as it says: the
// stage, dtype, accumulation steps, global batch and offload from the
// file, its Config in c.ds. The file's "auto" values come from the flags,
// as the Hugging Face Trainer fills them from its training arguments. It
// prints every notice to out.
func withDeepSpeed(c config, out io.Writer) (config, error) {
	ds, err := zero.ReadDeepSpeedFile(c.deepspeed, zero.DeepSpeedOptions{World: c.world, Overrides: c.overrides()})
	if err != nil {
		return c, err
	}
	c.ds = &ds
	c.stage, c.dtype, c.offload = ds.Config.Stage, ds.DType, ds.Config.Offload.Optimizer
	c.accum = max(1, ds.Config.Grads.AccumSteps)
	if ds.GlobalBatch > 0 {
		c.batch = ds.GlobalBatch
	}
	if out != nil {
		fmt.Fprintf(out, "DeepSpeed config %s: %d notice(s)\n", c.deepspeed, len(ds.Notices))
		for _, n := range ds.Notices {
			fmt.Fprintf(out, "  notice %s\n", n)
		}
	}
	return c, nil
}

// overrides are the Trainer's fill-ins from the flags: the batch sizes,
// the optimizer's and the warmup's settings, the precision, clipping at
// its default max_grad_norm of 1, and the bucket sizes from the hidden
// size (hidden², 0.9·hidden², 10·hidden).
func (c config) overrides() map[string]any {
	h := c.hidden
	micro := 0
	if c.world > 0 && c.accum > 0 {
		micro = c.batch / c.world / c.accum
	}
	return map[string]any{
		"train_batch_size": c.batch, "train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": c.accum,
		"gradient_clipping":   1.0,
		"optimizer.params.lr": c.lr, "optimizer.params.betas": []float64{0.9, 0.999}, "optimizer.params.eps": 1e-8,
		"optimizer.params.weight_decay":  c.weightDecay,
		"scheduler.params.warmup_min_lr": 0, "scheduler.params.warmup_max_lr": c.lr,
		"scheduler.params.warmup_num_steps": c.warmup, "scheduler.params.total_num_steps": c.steps,
		"fp16.enabled": c.dtype == zero.FP16, "bf16.enabled": c.dtype == zero.BF16, "bfloat16.enabled": c.dtype == zero.BF16,
		"zero_optimization.reduce_bucket_size":                 h * h,
		"zero_optimization.stage3_prefetch_bucket_size":        int(0.9 * float64(h*h)),
		"zero_optimization.stage3_param_persistence_threshold": 10 * h,
	}
}

// engineConfig is the Config a rank builds its engine with: the
// DeepSpeed config's when there is one (its optimizer for the weights, the
// same without decay for the biases, as the Trainer groups them), the
// flags' otherwise.
func (c config) engineConfig() zero.Config {
	if c.ds == nil {
		decayed := zero.NewAdamW(c.lr)
		decayed.WeightDecay = c.weightDecay
		return zero.Config{Stage: c.stage, BucketBytes: c.bucketBytes, Align: 1, // a tiny model: let every bucket split over the ranks
			Precision: zero.PrecisionPolicy{LossScale: c.lossScale},
			Optimizer: zero.OptimizerPolicy{Groups: []zero.Optimizer{decayed, zero.NewAdamW(c.lr)}},
			// a resumed run loads its parameters: the broadcast would be wasted
			Params:  zero.ParamPolicy{PrefetchBytes: c.prefetchBytes, NoBroadcast: c.resume != ""},
			Offload: zero.OffloadPolicy{Optimizer: c.offload}}
	}
	cfg := c.ds.Config
	cfg.Align = 1 // not a DeepSpeed setting: this tiny model's buckets split over the ranks
	cfg.Params.NoBroadcast = c.resume != ""
	var w zero.Optimizer = zero.NewAdamW(c.lr) // DeepSpeed takes the client's optimizer when the file has none
	if len(cfg.Optimizer.Groups) > 0 {
		w = cfg.Optimizer.Groups[0]
	}
	b := w
	switch o := w.(type) {
	case zero.AdamW:
		o.WeightDecay = 0
		b = o
	case zero.SGD:
		o.WeightDecay = 0
		b = o
	}
	cfg.Optimizer.Groups = []zero.Optimizer{w, b}
	return cfg
}

// printSettings prints the engine's settings (the model's entries left
// out), one a line.
func printSettings(out io.Writer, settings []zero.Setting) {
	fmt.Fprintln(out, "settings:")
	for _, s := range settings {
		if strings.HasPrefix(s.Path, "Model[") {
			continue
		}
		fmt.Fprintf(out, "  %s = %s (%v)\n", s.Path, s.Value, s.Class)
	}
}
