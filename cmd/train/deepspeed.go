package main

import (
	"encoding/json"
	"fmt"
	"io"
	"os"
	"strings"

	"zero"
)

// withDeepSpeed reads c.deepspeed and returns c trained as it says: the
// stage, dtype, accumulation steps, batch sizes and offload from the file,
// its Config in c.ds. The flags fill only the file's "auto" values, as the
// Hugging Face Trainer fills them from its training arguments; a flag set
// on the command line for a key the file sets otherwise, or does not
// have, is not used, with a notice. Where the file gives no batch size
// (DeepSpeed would ask for one) -batch is the global batch. It prints
// every notice to out.
func withDeepSpeed(c config, out io.Writer) (config, error) {
	data, err := os.ReadFile(c.deepspeed)
	if err != nil {
		return c, fmt.Errorf("-deepspeed: %w", err)
	}
	doc := map[string]any{}
	_ = json.Unmarshal(data, &doc) // ReadDeepSpeed says what is wrong with it
	fill, err := c.batchFillIns(doc)
	if err != nil {
		return c, err
	}
	ds, err := zero.ReadDeepSpeed(data, zero.DeepSpeedOptions{World: c.world, Overrides: c.overrides(autoPaths(doc), fill)})
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
		fmt.Fprintf(out, "DeepSpeed config %s: %d notice(s)\n", c.deepspeed, len(ds.Notices)+ds.MoreNotices)
		for _, n := range ds.Notices {
			fmt.Fprintf(out, "  notice %s\n", n)
		}
		if ds.GlobalBatch == 0 {
			fmt.Fprintf(out, "  the file gives no batch size: -batch %d%s is the global batch\n", c.batch, c.byDefault("batch"))
		}
	}
	return c, nil
}

// autoPaths are the dotted paths of a DeepSpeed config's "auto" values.
func autoPaths(doc map[string]any) map[string]bool {
	paths := map[string]bool{}
	var walk func(m map[string]any, at string)
	walk = func(m map[string]any, at string) {
		for k, v := range m {
			switch v := v.(type) {
			case map[string]any:
				walk(v, at+k+".")
			case string:
				if v == "auto" {
					paths[at+k] = true
				}
			}
		}
	}
	walk(doc, "")
	return paths
}

// batchFills are the values for the file's "auto" batch keys.
type batchFills struct{ global, micro, accum int }

// batchFillIns fills the file's "auto" batch keys: from the file's own
// batch sizes where they determine it (DeepSpeed's rule), from -batch and
// -accum otherwise. A split of the flags that does not divide is refused
// here, naming the flags, as the file never gave those values.
func (c config) batchFillIns(doc map[string]any) (batchFills, error) {
	number := func(key string) (int, bool) {
		f, ok := doc[key].(float64)
		return int(f), ok && f >= 1 && f == float64(int(f))
	}
	tb, hasTB := number("train_batch_size")
	mb, hasMB := number("train_micro_batch_size_per_gpu")
	g, hasG := number("gradient_accumulation_steps")
	fromFlags := false
	if !hasG {
		if g = c.accum; hasTB && hasMB && tb >= mb*c.world {
			g = tb / (mb * c.world)
		}
	}
	if !hasTB {
		if tb = mb * g * c.world; !hasMB {
			tb, fromFlags = c.batch, true
		}
	}
	if !hasMB {
		mb = tb / (c.world * g)
		if fromFlags && tb%(c.world*g) != 0 {
			return batchFills{}, fmt.Errorf("-batch %d%s does not split into -world %d%s ranks × %d micro-batches, which fill the DeepSpeed config's \"auto\" batch sizes; use a multiple of %d",
				tb, c.byDefault("batch"), c.world, c.byDefault("world"), g, c.world*g)
		}
	}
	return batchFills{global: tb, micro: mb, accum: g}, nil
}

// overrides are the Trainer's fill-ins from the flags for the paths the
// file leaves "auto", and for the keys of the flags set on the command
// line (ReadDeepSpeed notes those the file sets otherwise or lacks): the
// batch sizes (batchFillIns), the optimizer's and the warmup's settings, the precision,
// clipping at its default max_grad_norm of 1, and the bucket sizes from
// the hidden size (hidden², 0.9·hidden², 10·hidden).
func (c config) overrides(auto map[string]bool, batch batchFills) map[string]any {
	h := c.hidden
	fillIns := []struct {
		path  string
		flags []string // the flags it comes from
		value any      // what fills "auto"
		flag  any      // what the flags say, held against the file's value (nil: value)
	}{
		{"train_batch_size", []string{"batch"}, batch.global, c.batch},
		{"train_micro_batch_size_per_gpu", nil, batch.micro, nil},
		{"gradient_accumulation_steps", []string{"accum"}, batch.accum, c.accum},
		{"gradient_clipping", nil, 1.0, nil},
		{"optimizer.params.lr", []string{"lr"}, c.lr, nil},
		{"optimizer.params.betas", nil, []float64{0.9, 0.999}, nil},
		{"optimizer.params.eps", nil, 1e-8, nil},
		{"optimizer.params.weight_decay", []string{"wd"}, c.weightDecay, nil},
		{"scheduler.params.warmup_min_lr", nil, 0, nil},
		{"scheduler.params.warmup_max_lr", []string{"lr"}, c.lr, nil},
		{"scheduler.params.warmup_num_steps", []string{"warmup"}, c.warmup, nil},
		{"scheduler.params.total_num_steps", []string{"steps"}, c.steps, nil},
		{"fp16.enabled", []string{"fp16"}, c.dtype == zero.FP16, nil},
		{"bf16.enabled", []string{"bf16"}, c.dtype == zero.BF16, nil},
		{"bfloat16.enabled", []string{"bf16"}, c.dtype == zero.BF16, nil},
		{"zero_optimization.reduce_bucket_size", []string{"hidden"}, h * h, nil},
		{"zero_optimization.stage3_prefetch_bucket_size", []string{"hidden"}, int(0.9 * float64(h*h)), nil},
		{"zero_optimization.stage3_param_persistence_threshold", []string{"hidden"}, 10 * h, nil},
		{"zero_optimization.stage3_gather_16bit_weights_on_model_save", nil, false, nil},
	}
	over := map[string]any{}
	for _, f := range fillIns {
		given := len(f.flags) > 0
		for _, name := range f.flags {
			given = given && c.given[name]
		}
		switch {
		case auto[f.path]:
			over[f.path] = f.value
		case given && f.flag != nil:
			over[f.path] = f.flag
		case given:
			over[f.path] = f.value
		}
	}
	return over
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
