// Command estimate prints what one rank of a zero engine holds and moves
// for a model size and a list of world sizes (zero.Estimate: the engine's
// own plan, nothing allocated), stage by stage, with and without offload
// (of the optimizer, and at stage 3 of the parameters) and a coalesced
// window, beside DeepSpeed's published formulas: the ZeRO paper's 2Ψ + 2Ψ
// + KΨ/N family (K = 12 for mixed-precision Adam) and DeepSpeed's
// estimate_zero2_model_states_mem_needs and
// estimate_zero3_model_states_mem_needs (with offload_param where the
// parameters are offloaded). Each difference from DeepSpeed's figure is
// broken down by kind and named. -deepspeed FILE estimates a model under a
// DeepSpeed config (zero.ReadDeepSpeedFile), with its notices.
package main

import (
	"bufio"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"maps"
	"math"
	"os"
	"slices"
	"strconv"
	"strings"

	"zero"
)

// presets are Llama-2's shapes (the 70B with grouped-query attention).
var presets = map[string]zero.TransformerShape{
	"7b":  {Hidden: 4096, Layers: 32, Vocab: 32000, FFN: 11008, Heads: 32},
	"13b": {Hidden: 5120, Layers: 40, Vocab: 32000, FFN: 13824, Heads: 40},
	"70b": {Hidden: 8192, Layers: 80, Vocab: 32000, FFN: 28672, Heads: 64, KVHeads: 8},
}

type options struct {
	models      []string // preset names
	count       int64    // -params: a model known by its size (with -largest)
	largest     int64
	worlds      []int
	stages      []int
	offloads    []bool
	params      []bool // Offload.Params, at stage 3 only
	windows     []bool
	dtype       zero.DType
	cfg         zero.Config // bucket, dtypes, budgets, optimizer
	backwards   int
	gatherBlock bool // stage 3 gathers a decoder block at a time (else one parameter)
	gpusPerNode int
	wide        bool
	// ds reads the -deepspeed config for a model and a world size (nil:
	// the flags configure)
	ds func(m model, world int) (zero.DeepSpeedConfig, error)
}

// model is one model of the table.
type model struct {
	name     string
	params   []zero.Param
	sets     [][]int // stage-3 gather sets (nil: a parameter at a time)
	total    int64   // Ψ
	largest  int64   // the largest layer (DeepSpeed's largest_layer_params)
	hidden   int     // the hidden size (0: unknown), which fills a DeepSpeed config's "auto" bucket sizes
	describe string
}

// Device is one rank's device bytes by kind (zero.DeviceBytes).
type Device struct {
	FrameworkParams int64 `json:"framework_params"`
	ParamShard      int64 `json:"param_shard"`
	Gathered        int64 `json:"gathered"`
	GradShard       int64 `json:"grad_shard"`
	GradScratch     int64 `json:"grad_scratch"`
	Staging         int64 `json:"staging"`
	LocalSums       int64 `json:"local_sums"`
	WindowSums      int64 `json:"window_sums"`
	Master          int64 `json:"master"`
	OptimizerState  int64 `json:"optimizer_state"`
	NewParams       int64 `json:"new_params"`
	ParamGather     int64 `json:"param_gather"`
	Control         int64 `json:"control"`
}

// Host is an offloading rank's page-locked host bytes by kind.
type Host struct {
	ParamShard     int64 `json:"param_shard"`
	GradShard      int64 `json:"grad_shard"`
	GradScratch    int64 `json:"grad_scratch"`
	Landing        int64 `json:"landing"`
	Master         int64 `json:"master"`
	OptimizerState int64 `json:"optimizer_state"`
	NewParams      int64 `json:"new_params"`
	Control        int64 `json:"control"`
}

// Part is one kind of model state, zero's bytes against DeepSpeed's, and
// why they differ where zero holds more.
type Part struct {
	Kind      string `json:"kind"` // params, grads, window, optimizer
	Zero      int64  `json:"zero_bytes"`
	DeepSpeed int64  `json:"deepspeed_bytes"`
	Why       string `json:"why,omitempty"`
}

// Wire is one step's collectives on one rank (ring model).
type Wire struct {
	ReduceScatterBytes int64 `json:"reduce_scatter_wire_bytes"`
	AllGatherBytes     int64 `json:"all_gather_wire_bytes"`
	AllReduceBytes     int64 `json:"all_reduce_wire_bytes"`
	Calls              int64 `json:"calls"`
	Total              int64 `json:"total_wire_bytes"`
}

// Row is one line of the table and one JSON object: one rank of one
// configuration.
type Row struct {
	Model   string `json:"model"`
	Params  int64  `json:"params"`
	Largest int64  `json:"largest_layer_params"`
	World   int    `json:"world"`
	Stage   int    `json:"stage"`
	Offload bool   `json:"offload"`
	// OffloadParams is Offload.Params: stage 3's parameter shard on the host
	OffloadParams bool   `json:"offload_params"`
	Window        bool   `json:"window"`
	Backwards     int    `json:"backwards"`
	Buckets       int    `json:"buckets"`
	Device        Device `json:"device_bytes"`
	Host          Host   `json:"host_bytes"`
	// ModelStates is what is compared with DeepSpeed: parameters (at stage
	// 3 with the gather buffers, as DeepSpeed's 4 × largest layer),
	// gradients, a window's sums and optimizer state.
	ModelStates int64 `json:"model_states_bytes"`
	// Buffers is the rest of the device bytes (staging, the stage 1-2
	// gather buffer, scratch, control), which DeepSpeed's formulas leave
	// out as they leave out its own buckets.
	Buffers     int64 `json:"buffers_bytes"`
	DeviceTotal int64 `json:"device_total_bytes"`
	HostTotal   int64 `json:"host_bytes_per_rank"`
	HostPerNode int64 `json:"host_bytes_per_node"`
	// DeepSpeed's per-GPU figure (its estimator; the paper's at stage 1,
	// where DeepSpeed has none), its formula, and its CPU figure per node.
	DeepSpeed        int64  `json:"deepspeed_gpu_bytes"`
	DeepSpeedFormula string `json:"deepspeed_formula"`
	DeepSpeedCPU     int64  `json:"deepspeed_cpu_bytes_per_node"`
	Paper            int64  `json:"paper_gpu_bytes"`
	PaperFormula     string `json:"paper_formula"`
	Diff             int64  `json:"diff_bytes"` // ModelStates − DeepSpeed
	Parts            []Part `json:"parts"`
	Named            bool   `json:"within_or_named"` // Diff ≤ 0, or every kind over DeepSpeed has its reason
	Wire             Wire   `json:"wire"`
	// PaperWire is the paper's volume per step for DeepSpeed's reductions:
	// stage 1 reduces once per step, stage 2 every backward, stage 3
	// gathers twice and reduces once every backward.
	PaperWire int64 `json:"paper_wire_bytes"`
}

func main() {
	w := bufio.NewWriter(os.Stdout)
	err := run(os.Args[1:], w)
	if ferr := w.Flush(); err == nil {
		err = ferr
	}
	if errors.Is(err, flag.ErrHelp) {
		return
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "estimate:", err)
		os.Exit(2)
	}
}

// run parses args and prints the tables (or JSON rows) to w.
func run(args []string, w io.Writer) error {
	fs := flag.NewFlagSet("estimate", flag.ContinueOnError)
	o := options{}
	models := fs.String("model", "7b,70b", "models: "+strings.Join(slices.Sorted(maps.Keys(presets)), ", ")+" (Llama-2 shapes); ignored with -params")
	count := fs.String("params", "", "a model known by its size instead (e.g. 7e9), with -largest")
	largest := fs.String("largest", "", "with -params: the largest layer's parameters (e.g. 1.31e8)")
	worlds := fs.String("world", "8,16,32,64,128,256,512,1024", "world sizes W")
	stages := fs.String("stages", "1,2,3", "ZeRO stages")
	offload := fs.String("offload", "off,on", "Offload.Optimizer: off, on or both (off,on)")
	offloadParams := fs.String("offload-params", "off", "Offload.Params (stage 3 rows only): off, on or both (off,on)")
	window := fs.String("window", "off,on", "every step's backwards in a Coalesce window: off, on or both")
	dtype := fs.String("dtype", "bf16", "model dtype: bf16, fp16 or fp32")
	bucket := fs.String("bucket", "32MiB", "BucketBytes (B, KiB, MiB, GiB)")
	shard := fs.String("shard-dtype", "fp32", "Precision.ShardDType: fp32 or the model dtype")
	windowDType := fs.String("window-dtype", "fp32", "Window.DType: fp32 or the model dtype")
	comm := fs.String("comm-dtype", "", "Precision.CommDType: the model dtype (default) or fp32")
	budget := fs.String("window-budget", "0", "Window.BudgetBytes (0: no cap)")
	prefetch := fs.String("prefetch", "0", "Params.PrefetchBytes (0: BucketBytes; negative: none)")
	live := fs.String("live", "0", "Params.LiveParamBytes (0: no cap)")
	opt := fs.String("optimizer", "adamw", "adamw, sgd or sgd-momentum")
	fs.IntVar(&o.backwards, "backwards", 4, "backwards per step (gradient accumulation)")
	gather := fs.String("gather", "param", "stage 3 gathers a parameter at a time (param, as DeepSpeed fetches a module) or a decoder block (block)")
	fs.IntVar(&o.gpusPerNode, "gpus-per-node", 8, "GPUs per node, for the host bytes per node and DeepSpeed's CPU figures")
	asJSON := fs.Bool("json", false, "one JSON object per row instead of the tables")
	fs.BoolVar(&o.wide, "wide", false, "one table per model: a row per stage, offload and window, a column per W (zero's model states / DeepSpeed's)")
	dsFile := fs.String("deepspeed", "", "estimate under this DeepSpeed config (ds_config.json): its stage, precision, buckets, budgets, offload, optimizer and accumulation steps; its notices are printed")
	hidden := fs.Int("hidden", 0, "with -params and -deepspeed: the hidden size, which fills the config's \"auto\" bucket sizes as the Hugging Face Trainer does")
	if err := fs.Parse(args); err != nil {
		return err
	}
	given := map[string]bool{}
	fs.Visit(func(f *flag.Flag) { given[f.Name] = true })
	if fs.NArg() > 0 {
		return fmt.Errorf("unexpected arguments %q; every setting is a flag (-h lists them)", fs.Args())
	}

	var err error
	check := func(e error) {
		if e != nil && err == nil {
			err = e
		}
	}
	o.models = split(*models)
	if *count != "" || *largest != "" {
		o.count, err = parseCount("params", *count)
		var e error
		o.largest, e = parseCount("largest", *largest)
		check(e)
		if err == nil && o.largest > o.count {
			err = fmt.Errorf("-largest %d exceeds -params %d", o.largest, o.count)
		}
	}
	o.worlds, err = ints("world", *worlds, err)
	o.stages, err = ints("stages", *stages, err)
	o.offloads, err = onOff("offload", *offload, err)
	o.params, err = onOff("offload-params", *offloadParams, err)
	o.windows, err = onOff("window", *window, err)
	o.dtype, err = dtypeFlag("dtype", *dtype, err)
	o.cfg.Precision.ShardDType, err = dtypeFlag("shard-dtype", *shard, err)
	o.cfg.Window.DType, err = dtypeFlag("window-dtype", *windowDType, err)
	if *comm != "" {
		o.cfg.Precision.CommDType, err = dtypeFlag("comm-dtype", *comm, err)
	}
	o.cfg.BucketBytes, err = bytesFlag("bucket", *bucket, err)
	o.cfg.Window.BudgetBytes, err = bytesFlag("window-budget", *budget, err)
	o.cfg.Params.PrefetchBytes, err = bytesFlag("prefetch", *prefetch, err)
	o.cfg.Params.LiveParamBytes, err = bytesFlag("live", *live, err)
	switch *opt {
	case "adamw":
		o.cfg.Optimizer.Groups = []zero.Optimizer{zero.NewAdamW(1e-4)}
	case "sgd":
		o.cfg.Optimizer.Groups = []zero.Optimizer{zero.NewSGD(1e-2)}
	case "sgd-momentum":
		s := zero.NewSGD(1e-2)
		s.Momentum = 0.9
		o.cfg.Optimizer.Groups = []zero.Optimizer{s}
	default:
		check(fmt.Errorf("-optimizer %q: want adamw, sgd or sgd-momentum", *opt))
	}
	switch *gather {
	case "param", "block":
		o.gatherBlock = *gather == "block"
	default:
		check(fmt.Errorf("-gather %q: want param or block", *gather))
	}
	if o.backwards < 1 || o.gpusPerNode < 1 {
		check(fmt.Errorf("-backwards and -gpus-per-node must be at least 1"))
	}
	if err != nil {
		return err
	}
	if *dsFile == "" && given["hidden"] {
		return fmt.Errorf("-hidden fills a DeepSpeed config's \"auto\" bucket sizes: give it with -deepspeed")
	}
	ms, err := buildModels(o, *hidden)
	if err != nil {
		return err
	}
	var notices []string
	if *dsFile != "" {
		if !given["window"] {
			o.windows = []bool{false} // DeepSpeed has no coalesced window: -window on adds zero's
		}
		if o, notices, err = withDeepSpeed(o, *dsFile, given, ms[0]); err != nil {
			return err
		}
		if ms, err = buildModels(o, *hidden); err != nil { // in the config's dtype
			return err
		}
	}
	for _, m := range ms {
		if !*asJSON && len(notices) > 0 {
			fmt.Fprintf(w, "\nDeepSpeed config %s (at W=%d, for %s):\n", *dsFile, o.worlds[0], m.name)
			for _, n := range notices {
				fmt.Fprintf(w, "  %s\n", n)
			}
		}
		rows, err := table(o, m)
		if err != nil {
			return err
		}
		switch {
		case *asJSON:
			enc := json.NewEncoder(w)
			for _, r := range rows {
				if err := enc.Encode(r); err != nil {
					return err
				}
			}
		case o.wide:
			printWide(w, o, m, rows)
		default:
			printLong(w, o, m, rows)
		}
	}
	return nil
}

// buildModels lists the models of the table: the presets named, or one
// model known by its size.
func buildModels(o options, hidden int) ([]model, error) {
	if o.count > 0 {
		params, err := zero.CountParams(int(o.count), int(o.largest), o.dtype)
		if err != nil {
			return nil, err
		}
		return []model{{name: fmt.Sprintf("%s params", short(o.count)), params: params, total: o.count, largest: o.largest, hidden: hidden,
			describe: fmt.Sprintf("%d parameters in layers of %d (the largest layer)", o.count, o.largest)}}, nil
	}
	var out []model
	for _, name := range o.models {
		t, ok := presets[strings.ToLower(name)]
		if !ok {
			return nil, fmt.Errorf("-model %q: want one of %s, or -params and -largest", name, strings.Join(slices.Sorted(maps.Keys(presets)), ", "))
		}
		params, err := t.Params(o.dtype)
		if err != nil {
			return nil, err
		}
		m := model{name: strings.ToUpper(name), params: params, hidden: t.Hidden}
		for _, p := range params {
			m.total += int64(p.Count)
			m.largest = max(m.largest, int64(p.Count))
		}
		if o.gatherBlock {
			// the embedding, each decoder block's nine parameters, the
			// final norm, the head
			m.sets = [][]int{{0}}
			for l := range t.Layers {
				set := make([]int, 9)
				for i := range set {
					set[i] = 1 + 9*l + i
				}
				m.sets = append(m.sets, set)
			}
			for p := 1 + 9*t.Layers; p < len(params); p++ {
				m.sets = append(m.sets, []int{p})
			}
		}
		kv := t.KVHeads
		if kv == 0 {
			kv = t.Heads
		}
		m.describe = fmt.Sprintf("Llama-2 %s shape (hidden %d, %d layers, vocab %d, FFN %d, %d heads, %d KV heads): %d parameters, largest layer %d",
			name, t.Hidden, t.Layers, t.Vocab, t.FFN, t.Heads, kv, m.total, m.largest)
		out = append(out, m)
	}
	return out, nil
}

// table estimates every row of one model.
func table(o options, m model) ([]Row, error) {
	var rows []Row
	for _, world := range o.worlds {
		base := o.cfg
		if o.ds != nil { // the config read at this W: its batch sizes are checked against it
			ds, err := o.ds(m, world)
			if err != nil {
				return nil, fmt.Errorf("%s W=%d: %w", m.name, world, err)
			}
			base = ds.Config
			base.Window = o.cfg.Window
			if len(base.Optimizer.Groups) == 0 { // DeepSpeed takes the client's: -optimizer's
				base.Optimizer.Groups = o.cfg.Optimizer.Groups
			}
		}
		for _, stage := range o.stages {
			for _, off := range o.offloads {
				for _, params := range o.params {
					if params && stage != 3 {
						continue // only stage 3 keeps a parameter shard
					}
					for _, win := range o.windows {
						cfg := base
						cfg.Stage, cfg.Offload.Optimizer, cfg.Offload.Params = stage, off, params
						est, err := zero.Estimate(m.params, cfg, world, zero.Workload{Backwards: o.backwards, Window: win, Gathers: m.sets})
						if err != nil {
							return nil, fmt.Errorf("%s W=%d stage %d: %w", m.name, world, stage, err)
						}
						rows = append(rows, row(o, m, cfg, world, win, est))
					}
				}
			}
		}
	}
	return rows, nil
}

func row(o options, m model, cfg zero.Config, world int, window bool, est zero.Estimation) Row {
	d, h := est.Device, est.Host
	r := Row{Model: m.name, Params: m.total, Largest: m.largest, World: world, Stage: cfg.Stage, Offload: cfg.Offload.Optimizer,
		OffloadParams: cfg.Offload.Params, Window: window, Backwards: o.backwards, Buckets: len(est.Plan.Buckets),
		Device: Device(d), Host: Host(h),
		DeviceTotal: d.Total(), HostTotal: h.Total(), HostPerNode: h.Total() * int64(min(o.gpusPerNode, world))}
	r.ModelStates = d.ModelStates() + d.Gathered
	r.Buffers = d.Total() - r.ModelStates

	ds := deepspeed(m, cfg, world, o.gpusPerNode)
	r.DeepSpeed, r.DeepSpeedFormula, r.DeepSpeedCPU = ds.gpu, ds.formula, ds.cpu
	r.Paper, r.PaperFormula = paper(m.total, cfg.Stage, world, cfg.Offload.Optimizer, cfg.Offload.Params)
	r.Diff = r.ModelStates - r.DeepSpeed

	zeroParts := map[string]int64{
		"params":    d.FrameworkParams + d.ParamShard + d.NewParams + d.Gathered,
		"grads":     d.GradShard + d.LocalSums,
		"window":    d.WindowSums,
		"optimizer": d.Master + d.OptimizerState,
	}
	// The shard's padding: the elements a rank's shard holds beyond its
	// 1/W of the trainable parameters, in the bytes each kind keeps per
	// shard element.
	trainable := int64(0)
	for _, p := range m.params {
		if !p.Frozen {
			trainable += int64(p.Count)
		}
	}
	padElems := float64(est.Plan.ShardElems) - float64(trainable)/float64(world)
	perElem := map[string]int64{"params": d.ParamShard + d.NewParams, "grads": d.GradShard, "optimizer": d.Master + d.OptimizerState}
	r.Named = true
	for _, kind := range []string{"params", "grads", "window", "optimizer"} {
		p := Part{Kind: kind, Zero: zeroParts[kind], DeepSpeed: ds.parts[kind]}
		if over := p.Zero - p.DeepSpeed; over > 0 {
			pad := 0.0
			if est.Plan.ShardElems > 0 {
				pad = padElems * float64(perElem[kind]) / float64(est.Plan.ShardElems)
			}
			p.Why = why(kind, cfg, float64(over) <= pad+1) // +1: DeepSpeed's int() truncation
			r.Named = r.Named && p.Why != ""
		}
		r.Parts = append(r.Parts, p)
	}
	r.Named = r.Named || r.Diff <= 0

	wire := est.Wire
	r.Wire = Wire{ReduceScatterBytes: wire[zero.KindReduceScatter].WireBytes, AllGatherBytes: wire[zero.KindAllGather].WireBytes,
		AllReduceBytes: wire[zero.KindAllReduce].WireBytes, Calls: wire.Total().Calls, Total: wire.Total().WireBytes}
	r.PaperWire = paperWire(m.total, int64(m.params[0].DType.Size()), cfg.Stage, world, o.backwards)
	return r
}

// why names the reason zero holds more of a kind than DeepSpeed's figure;
// padding says the excess is no more than the shard's padding.
func why(kind string, cfg zero.Config, padding bool) string {
	switch {
	case kind == "params" && cfg.Stage < 3:
		return "N: the new parameters' model-dtype shard (2Ψ/W), the source of Step's all-gather; DeepSpeed's is a view into its flat 16-bit copy of the parameters, while zero leaves the framework's tensors as they are"
	case kind == "params" && cfg.Stage == 3 && !padding:
		return "G: the gather buffers (the set the framework holds and PrefetchBytes ahead, each the largest bucket) against DeepSpeed's 4 × the largest layer"
	case kind == "grads" && cfg.Stage == 1:
		return "L: ZeRO-1's local sums are fp32 (4Ψ) where the paper counts a 16-bit gradient (2Ψ), so backwards add up without rounding to 16 bits; and, unless offloaded, the reduced gradient shard (Ψ/W in Precision.ShardDType), which the paper's K leaves out and DeepSpeed holds in fp32"
	case kind == "window":
		return "W: a window's sums (Window.DType, capped by Window.BudgetBytes), so each bucket is reduced once per window instead of once per backward; DeepSpeed's coalesce_grad_reduction keeps its backwards' sums in every parameter's 16-bit .grad (2Ψ), which its estimators leave out; zero's are fp32 (4Ψ) unless Window.DType is the model dtype"
	case padding:
		return "P: padding: each bucket is cut into W equal shards of a multiple of Align (64) elements, so a shard holds up to 64 elements a bucket beyond Ψ/W"
	}
	return ""
}

// dsFigure is DeepSpeed's estimate for one configuration, with its parts.
type dsFigure struct {
	gpu, cpu int64
	formula  string
	parts    map[string]int64
}

// deepspeed is DeepSpeed's estimate of a rank's GPU bytes (and a node's
// CPU bytes): estimate_zero2_model_states_mem_needs and
// estimate_zero3_model_states_mem_needs (zero_init; cpu_offload_params
// where the parameters are offloaded, which it honours only with
// cpu_offload, the optimizer offloaded: its estimator has no row of
// offload_param alone), additional_buffer_factor 1.5; at stage 1,
// where DeepSpeed has no estimator, the ZeRO paper's Pos. The parts split
// its terms by kind: the 2Ψ of 16-bit parameters, and its 18Ψ/N as 2
// (16-bit gradients at stage 2, parameters at stage 3) + 4 (fp32
// gradients) + 4 (fp32 parameters) + 8 (Adam's moments).
func deepspeed(m model, cfg zero.Config, world, gpusPerNode int) dsFigure {
	psi, n, ll := m.total, int64(world), m.largest
	gpn := int64(min(gpusPerNode, world))
	nodes := (n + gpn - 1) / gpn
	off := cfg.Offload.Optimizer
	f := dsFigure{parts: map[string]int64{}}
	switch cfg.Stage {
	case 1:
		f.gpu, f.formula = paper(psi, 1, world, off, false)
		f.parts["params"], f.parts["grads"] = 2*psi, 2*psi
		f.parts["optimizer"] = f.gpu - 4*psi
	case 2:
		if off {
			f.gpu, f.formula = 2*psi, "2Ψ"
			f.cpu = int64(float64(psi) * float64(max(4*n, 16)) * 1.5)
			f.parts["params"] = 2 * psi
		} else {
			f.gpu, f.formula = 2*psi+int64(18*float64(psi)/float64(n)), "2Ψ + 18Ψ/N"
			f.cpu = int64(float64(psi) * 4 * float64(gpn) * 1.5)
			f.parts["params"], f.parts["grads"] = 2*psi, 6*psi/n
			f.parts["optimizer"] = f.gpu - f.parts["params"] - f.parts["grads"]
		}
	case 3:
		if off && cfg.Offload.Params { // the largest layer's gathered copy, and nothing else
			f.gpu, f.formula = 4*ll, "4·LL"
			f.cpu = int64(float64(psi) * 18 / float64(nodes) * 1.5)
			f.parts["params"] = f.gpu
		} else if off {
			f.gpu, f.formula = 4*ll+int64(2*float64(psi)/float64(n)), "4·LL + 2Ψ/N"
			f.cpu = int64(float64(psi) * 16 / float64(nodes) * 1.5)
			f.parts["params"] = f.gpu
		} else {
			f.gpu, f.formula = 4*ll+int64(18*float64(psi)/float64(n)), "4·LL + 18Ψ/N"
			if cfg.Offload.Params {
				f.formula += " (offload_param alone: its estimator ignores it)"
			}
			f.cpu = int64(float64(ll) * 4 * float64(gpn) * 1.5)
			f.parts["params"], f.parts["grads"] = 4*ll+2*psi/n, 4*psi/n
			f.parts["optimizer"] = f.gpu - f.parts["params"] - f.parts["grads"]
		}
	}
	return f
}

// paper is the ZeRO paper's per-GPU model states for mixed-precision Adam
// (K = 12): Pos 2Ψ + 2Ψ + KΨ/N, Pos+g 2Ψ + (2 + K)Ψ/N, Pos+g+p
// (2 + 2 + K)Ψ/N; with the optimizer offloaded (ZeRO-Offload) the K term
// leaves the GPU, and with the parameters offloaded (stage 3, as
// ZeRO-Infinity) their 2Ψ/N.
func paper(psi int64, stage, world int, offload, params bool) (int64, string) {
	k, ks := 12.0, "12Ψ"
	if offload {
		k, ks = 0, "0"
	}
	p, n := float64(psi), float64(world)
	if stage == 3 && params {
		return int64((2 + k) * p / n), "(0 + 2Ψ + " + ks + ")/N"
	}
	switch stage {
	case 1:
		return int64(4*p + k*p/n), "2Ψ + 2Ψ + " + ks + "/N"
	case 2:
		return int64(2*p + (2+k)*p/n), "2Ψ + (2Ψ + " + ks + ")/N"
	}
	return int64((4 + k) * p / n), "(2Ψ + 2Ψ + " + ks + ")/N"
}

// paperWire is the paper's communication volume per step, each collective
// moving (W−1)/W of Ψ elements of the model dtype per rank, for DeepSpeed's
// schedule of g backwards: stage 1 reduce-scatters once and all-gathers
// once per step (2Ψ), stage 2 reduces every backward ((g+1)Ψ), stage 3
// gathers for the forward and the backward and reduces, every backward
// (3gΨ).
func paperWire(psi, size int64, stage, world, g int) int64 {
	vol := map[int]int64{1: 2, 2: int64(g) + 1, 3: 3 * int64(g)}[stage]
	return vol * psi * size * int64(world-1) / int64(world)
}

// ---- printing ------------------------------------------------------------------------

func printLong(w io.Writer, o options, m model, rows []Row) {
	header(w, o, m)
	// the parameters' offload gets a column where some row has it
	pcol, phead, prule := func(Row) string { return "" }, "", ""
	if slices.Contains(o.params, true) {
		pcol, phead, prule = func(r Row) string { return " " + yes(r.OffloadParams) + " |" }, " params |", "---|"
	}
	fmt.Fprintln(w, "| W | stage | offload | window |"+phead+" zero model states | DeepSpeed | formula | zero − DeepSpeed | named | paper | buffers | device total | host/rank | DeepSpeed CPU/node | wire/step | paper wire/step |")
	fmt.Fprintln(w, "|--:|--:|---|---|"+prule+"--:|--:|---|--:|---|--:|--:|--:|--:|--:|--:|--:|")
	for _, r := range rows {
		fmt.Fprintf(w, "| %d | %d | %s | %s |%s %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s |\n",
			r.World, r.Stage, yes(r.Offload), yes(r.Window), pcol(r), gib(r.ModelStates), gib(r.DeepSpeed), r.DeepSpeedFormula,
			signed(r.Diff), codes(r), gib(r.Paper), gib(r.Buffers), gib(r.DeviceTotal), gib(r.HostTotal), cpu(r), gib(r.Wire.Total), gib(r.PaperWire))
	}
	legend(w, rows)
}

func printWide(w io.Writer, o options, m model, rows []Row) {
	header(w, o, m)
	fmt.Fprintf(w, "zero's model states / DeepSpeed's, GiB per rank; a code names each kind zero holds more of\n\n")
	withParams := slices.Contains(o.params, true)
	fmt.Fprint(w, "| stage | offload | window |")
	if withParams {
		fmt.Fprint(w, " params |")
	}
	for _, n := range o.worlds {
		fmt.Fprintf(w, " W=%d |", n)
	}
	fmt.Fprint(w, "\n|--:|---|---|")
	if withParams {
		fmt.Fprint(w, "---|")
	}
	for range o.worlds {
		fmt.Fprint(w, "--:|")
	}
	fmt.Fprintln(w)
	for _, stage := range o.stages {
		for _, off := range o.offloads {
			for _, params := range o.params {
				if params && stage != 3 {
					continue
				}
				for _, win := range o.windows {
					fmt.Fprintf(w, "| %d | %s | %s |", stage, yes(off), yes(win))
					if withParams {
						fmt.Fprintf(w, " %s |", yes(params))
					}
					for _, n := range o.worlds {
						for _, r := range rows {
							if r.World == n && r.Stage == stage && r.Offload == off && r.OffloadParams == params && r.Window == win {
								c := codes(r)
								if c == "≤" {
									c = ""
								} else {
									c = " " + c
								}
								fmt.Fprintf(w, " %s / %s%s |", gib(r.ModelStates), gib(r.DeepSpeed), c)
							}
						}
					}
					fmt.Fprintln(w)
				}
			}
		}
	}
	legend(w, rows)
}

func header(w io.Writer, o options, m model) {
	c := o.cfg
	comm := c.Precision.CommDType
	if comm == 0 {
		comm = o.dtype
	}
	gather := "a parameter at a time"
	if m.sets != nil {
		gather = "a decoder block at a time"
	}
	fmt.Fprintf(w, "\n## %s: %s\n\n", m.name, m.describe)
	fmt.Fprintf(w, "%v model, %v wire, %v gradient shard, %v window sums (budget %s), BucketBytes %s, %s, %d backwards per step, stage 3 gathering %s (prefetch %s, live cap %s); GiB per rank (2^30 bytes); host per node for %d GPUs per node\n\n",
		o.dtype, comm, c.Precision.ShardDType, c.Window.DType, bytesOr(c.Window.BudgetBytes, "none"), bytesOr(c.BucketBytes, ""), optName(c),
		o.backwards, gather, bytesOr(c.Params.PrefetchBytes, "BucketBytes"), bytesOr(c.Params.LiveParamBytes, "none"), o.gpusPerNode)
}

// legend names the codes the rows use, with the parts' reasons.
func legend(w io.Writer, rows []Row) {
	seen := map[string]bool{}
	var lines []string
	for _, r := range rows {
		for _, p := range r.Parts {
			if p.Why != "" && !seen[p.Why] {
				seen[p.Why] = true
				lines = append(lines, p.Why)
			}
		}
	}
	fmt.Fprintln(w)
	slices.Sort(lines)
	for _, l := range lines {
		fmt.Fprintf(w, "- %s\n", l)
	}
	fmt.Fprintln(w)
}

// codes are the letters of the kinds zero holds more of than DeepSpeed
// ("?" for one without a reason), or "≤" where zero holds no more in all.
func codes(r Row) string {
	if r.Diff <= 0 {
		return "≤"
	}
	var c []string
	for _, p := range r.Parts {
		code := "?"
		if p.Why != "" {
			code = p.Why[:1]
		}
		if p.Zero > p.DeepSpeed && !slices.Contains(c, code) {
			c = append(c, code)
		}
	}
	return strings.Join(c, "")
}

func cpu(r Row) string {
	if r.Stage == 1 {
		return "–"
	}
	return gib(r.DeepSpeedCPU)
}

func gib(b int64) string {
	v := float64(b) / (1 << 30)
	switch {
	case v == 0:
		return "0"
	case math.Abs(v) >= 100:
		return fmt.Sprintf("%.0f", v)
	case math.Abs(v) >= 10:
		return fmt.Sprintf("%.1f", v)
	}
	return fmt.Sprintf("%.2f", v)
}

func signed(b int64) string {
	if b > 0 {
		return "+" + gib(b)
	}
	return gib(b)
}

func yes(b bool) string {
	if b {
		return "yes"
	}
	return "no"
}

func optName(c zero.Config) string {
	switch g := c.Optimizer.Groups[0].(type) {
	case zero.AdamW:
		return "AdamW"
	case zero.SGD:
		if g.Momentum != 0 {
			return "SGD with momentum"
		}
		return "SGD"
	}
	return "?"
}

func bytesOr(n int, zeroText string) string {
	switch {
	case n == 0 && zeroText != "":
		return zeroText
	case n < 0:
		return "none"
	case n%(1<<30) == 0 && n > 0:
		return fmt.Sprintf("%d GiB", n>>30)
	case n%(1<<20) == 0 && n > 0:
		return fmt.Sprintf("%d MiB", n>>20)
	}
	return fmt.Sprintf("%d B", n)
}

func short(n int64) string {
	switch {
	case n >= 1e9:
		return fmt.Sprintf("%.3gB", float64(n)/1e9)
	case n >= 1e6:
		return fmt.Sprintf("%.3gM", float64(n)/1e6)
	}
	return strconv.FormatInt(n, 10)
}

// ---- flags ---------------------------------------------------------------------------

func split(s string) []string {
	var out []string
	for _, f := range strings.Split(s, ",") {
		if f = strings.TrimSpace(f); f != "" {
			out = append(out, f)
		}
	}
	return out
}

func ints(name, s string, err error) ([]int, error) {
	if err != nil {
		return nil, err
	}
	var out []int
	for _, f := range split(s) {
		n, e := strconv.Atoi(f)
		if e != nil || n < 1 {
			return nil, fmt.Errorf("-%s: %q is not a positive integer", name, f)
		}
		out = append(out, n)
	}
	if len(out) == 0 {
		return nil, fmt.Errorf("-%s: give at least one value", name)
	}
	return out, nil
}

func onOff(name, s string, err error) ([]bool, error) {
	if err != nil {
		return nil, err
	}
	var out []bool
	for _, f := range split(s) {
		switch f {
		case "off":
			out = append(out, false)
		case "on":
			out = append(out, true)
		default:
			return nil, fmt.Errorf("-%s: %q; want off, on or off,on", name, f)
		}
	}
	if len(out) == 0 {
		return nil, fmt.Errorf("-%s: give off, on or off,on", name)
	}
	return out, nil
}

func dtypeFlag(name, v string, err error) (zero.DType, error) {
	if err != nil {
		return 0, err
	}
	switch v {
	case "fp32":
		return zero.FP32, nil
	case "bf16":
		return zero.BF16, nil
	case "fp16":
		return zero.FP16, nil
	}
	return 0, fmt.Errorf("-%s %q: want fp32, bf16 or fp16", name, v)
}

// bytesFlag reads a byte count: an integer (negative where the setting
// allows it) with an optional B, KiB, MiB or GiB.
func bytesFlag(name, v string, err error) (int, error) {
	if err != nil {
		return 0, err
	}
	s, unit := strings.TrimSpace(v), 1
	for _, u := range []struct {
		suffix string
		n      int
	}{{"GiB", 1 << 30}, {"MiB", 1 << 20}, {"KiB", 1 << 10}, {"B", 1}} {
		if strings.HasSuffix(s, u.suffix) {
			s, unit = strings.TrimSpace(strings.TrimSuffix(s, u.suffix)), u.n
			break
		}
	}
	n, e := strconv.Atoi(s)
	if e != nil {
		return 0, fmt.Errorf("-%s %q: want bytes, e.g. 32MiB or 33554432", name, v)
	}
	return n * unit, nil
}

// parseCount reads a parameter count such as 7e9 or 6738415616.
func parseCount(name, v string) (int64, error) {
	f, err := strconv.ParseFloat(strings.TrimSpace(v), 64)
	if err != nil || f < 1 || f > 1e15 || f != math.Trunc(f) {
		return 0, fmt.Errorf("-%s %q: want a whole number of parameters, e.g. 7e9 (-params and -largest go together)", name, v)
	}
	return int64(f), nil
}

// withDeepSpeed sets o from the DeepSpeed config at path, read for m at the
// first world size: the stage, offload, model dtype and backwards; each
// row reads it again at its own W (o.ds). The flags the config decides are
// refused where given; they fill its "auto" values where it has them, as
// the Hugging Face Trainer does (the bucket sizes from the model's hidden
// size; the batch sizes from -backwards and a micro-batch of 1; the rest,
// which change no byte of the estimate, from the Trainer's defaults). It
// returns the notices, and a line naming each "auto" it filled.
func withDeepSpeed(o options, path string, given map[string]bool, first model) (options, []string, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return o, nil, fmt.Errorf("-deepspeed: %w", err)
	}
	doc := map[string]any{}
	_ = json.Unmarshal(data, &doc) // ReadDeepSpeed says what is wrong with it
	auto := map[string]bool{}
	var walk func(m map[string]any, at string)
	walk = func(m map[string]any, at string) {
		for k, v := range m {
			if sub, ok := v.(map[string]any); ok {
				walk(sub, at+k+".")
			} else if v == "auto" {
				auto[at+k] = true
			}
		}
	}
	walk(doc, "")
	_, hasOptimizer := doc["optimizer"]
	decided := map[string]bool{"stages": true, "offload": true, "offload-params": true, "bucket": true, "shard-dtype": true, "comm-dtype": true, "prefetch": true, "live": true,
		"dtype":     !auto["fp16.enabled"] && !auto["bf16.enabled"] && !auto["bfloat16.enabled"],
		"backwards": !auto["gradient_accumulation_steps"], "optimizer": hasOptimizer}
	for _, name := range slices.Sorted(maps.Keys(decided)) {
		if decided[name] && given[name] {
			return o, nil, fmt.Errorf("-%s with -deepspeed: the config decides it; leave the flag out", name)
		}
	}
	fills := func(m model, world int) (map[string]any, error) {
		h := m.hidden
		g := o.backwards
		if v, ok := doc["gradient_accumulation_steps"].(float64); ok && v >= 1 {
			g = int(v)
		}
		micro := 1
		if tb, ok := doc["train_batch_size"].(float64); ok && int(tb)%(g*world) == 0 && int(tb) >= g*world {
			micro = int(tb) / (g * world)
		} else if mb, ok := doc["train_micro_batch_size_per_gpu"].(float64); ok && mb >= 1 {
			micro = int(mb)
		}
		all := map[string]any{
			"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": g, "train_batch_size": micro * g * world,
			"fp16.enabled": o.dtype == zero.FP16, "bf16.enabled": o.dtype == zero.BF16, "bfloat16.enabled": o.dtype == zero.BF16,
			"zero_optimization.reduce_bucket_size": h * h, "zero_optimization.stage3_prefetch_bucket_size": int(0.9 * float64(h*h)),
			"zero_optimization.stage3_param_persistence_threshold":        10 * h,
			"zero_optimization.stage3_gather_16bit_weights_on_model_save": false,
			"gradient_clipping": 1.0, "optimizer.params.lr": 5e-5, "optimizer.params.betas": []float64{0.9, 0.999},
			"optimizer.params.eps": 1e-8, "optimizer.params.weight_decay": 0.0, "scheduler.params.warmup_min_lr": 0,
			"scheduler.params.warmup_max_lr": 5e-5, "scheduler.params.warmup_num_steps": 1, "scheduler.params.total_num_steps": 1,
		}
		over := map[string]any{}
		for path := range auto {
			v, ok := all[path]
			if !ok {
				continue // ReadDeepSpeed refuses an "auto" it cannot fill
			}
			if strings.HasPrefix(path, "zero_optimization.") && strings.Contains(path, "size") || strings.HasSuffix(path, "threshold") {
				if h == 0 {
					return nil, fmt.Errorf("-deepspeed: %s is \"auto\", which the Trainer fills from the hidden size: give -hidden (or a -model)", path)
				}
			}
			over[path] = v
		}
		return over, nil
	}
	o.ds = func(m model, world int) (zero.DeepSpeedConfig, error) {
		over, err := fills(m, world)
		if err != nil {
			return zero.DeepSpeedConfig{}, err
		}
		return zero.ReadDeepSpeed(data, zero.DeepSpeedOptions{World: world, Overrides: over})
	}
	ds, err := o.ds(first, o.worlds[0])
	if err != nil {
		return o, nil, err
	}
	o.stages, o.offloads, o.dtype = []int{ds.Config.Stage}, []bool{ds.Config.Offload.Optimizer}, ds.DType
	o.params = []bool{ds.Config.Offload.Params}
	o.backwards = max(1, ds.Config.Grads.AccumSteps)
	o.cfg.Precision, o.cfg.BucketBytes, o.cfg.Params = ds.Config.Precision, ds.Config.BucketBytes, ds.Config.Params
	if len(ds.Config.Optimizer.Groups) > 0 {
		o.cfg.Optimizer = ds.Config.Optimizer
	}
	var notices []string
	for _, n := range ds.Notices {
		notices = append(notices, "notice "+n.String())
	}
	if ds.MoreNotices > 0 {
		notices = append(notices, fmt.Sprintf("and %d more notices", ds.MoreNotices))
	}
	over, _ := fills(first, o.worlds[0])
	for _, path := range slices.Sorted(maps.Keys(over)) {
		b, _ := json.Marshal(over[path])
		notices = append(notices, fmt.Sprintf("\"auto\" %s filled with %s for the estimate", path, b))
	}
	return o, notices, nil
}
