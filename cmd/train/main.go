// Command train trains a small MLP on a synthetic regression task across W
// in-process ranks with zero (or, with -mpi under mpiexec -n W, across the W
// processes of an MPI job, with the same bits): forward and backward written by hand, each
// layer's gradients handed to the engine as backward produces them, on two
// streams, and the sharded AdamW step updating the parameters in place. It
// prints each step as it ends (every -log-every steps), -metrics writes
// every step as a JSON line. -save writes a checkpoint, -resume continues
// from one to -steps in all, on the data the run that never stopped had;
// -export writes the fp32 parameters as one safetensors file.
package main

import (
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"math"
	"math/rand"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"time"

	"zero"
)

func main() { os.Exit(mainArgs(os.Args[1:], os.Stdout, os.Stderr)) }

// mainArgs is the command with its arguments; it returns the exit status.
func mainArgs(args []string, stdout, stderr io.Writer) int {
	c := defaultConfig()
	fs := flag.NewFlagSet("train", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.IntVar(&c.world, "world", c.world, "ranks in the in-process group")
	mpi := fs.Bool("mpi", false, "one rank per process of an MPI job (mpiexec -n W train -mpi …): the world is the job's")
	fs.IntVar(&c.stage, "stage", c.stage, "ZeRO stage (1, 2 or 3: parameters sharded, gathered layer by layer)")
	fs.IntVar(&c.steps, "steps", c.steps, "optimizer steps")
	fs.IntVar(&c.batch, "batch", c.batch, "global batch (samples per step, over every rank)")
	fs.IntVar(&c.accum, "accum", c.accum, "backwards per step (micro-batches per rank)")
	fs.StringVar(&c.window, "window", "", "the backwards of a step in a window: coalesce (each bucket reduced once at its end) or nosync (all but the last backward)")
	fs.IntVar(&c.in, "in", c.in, "inputs per sample")
	fs.IntVar(&c.hidden, "hidden", c.hidden, "hidden units")
	fs.Float64Var(&c.lr, "lr", c.lr, "AdamW learning rate")
	fs.Float64Var(&c.weightDecay, "wd", c.weightDecay, "AdamW weight decay of the weights (biases get none)")
	bf16 := fs.Bool("bf16", false, "bf16 parameters and gradients (fp32 master and moments)")
	fp16 := fs.Bool("fp16", false, "fp16 parameters and gradients with dynamic loss scaling (fp32 master and moments)")
	fs.BoolVar(&c.offload, "offload", c.offload, "gradient shard, master weights and AdamW moments in page-locked host memory, the optimizer on the host")
	fs.Int64Var(&c.seed, "seed", c.seed, "seed of the data and the initial parameters")
	fs.StringVar(&c.save, "save", "", "write a checkpoint into this directory at the end of the run")
	fs.IntVar(&c.saveEvery, "save-every", 0, "with -save: also a checkpoint every K steps")
	fs.IntVar(&c.keep, "keep", 0, "with -save: the newest checkpoints kept in the directory (0: 2)")
	fs.StringVar(&c.resume, "resume", "", "continue from the latest checkpoint in this directory (or from this checkpoint) up to -steps in all; -lr and -wd hold from there")
	fs.StringVar(&c.deepspeed, "deepspeed", "", "train from a DeepSpeed config (ds_config.json): its stage, precision, optimizer, schedule, clipping and batch sizes; its \"auto\" values come from the flags, as the Hugging Face Trainer fills them")
	fs.IntVar(&c.warmup, "warmup", c.warmup, "warmup steps: fills a DeepSpeed config's \"auto\" warmup_num_steps")
	fs.StringVar(&c.export, "export", "", "at the end, write the fp32 parameters (the master) into this safetensors file")
	fs.IntVar(&c.logEvery, "log-every", 0, "print every K-th step as it ends: loss, learning rate, loss scale, skipped, gradient norm, samples per second (0: a DeepSpeed config's steps_per_print, else 1)")
	fs.StringVar(&c.metrics, "metrics", "", "write every step as one JSON object a line into this file (pandas: read_json(FILE, lines=True)); with -resume the lines are appended")
	record := fs.String("record", "", "at the end, write rank 0's parameters after every step and the losses, as JSON, into this file")
	if err := fs.Parse(args); err != nil {
		return 2
	}
	c.given = map[string]bool{}
	fs.Visit(func(f *flag.Flag) { c.given[f.Name] = true })
	c.trace = *record != "" // -record writes every step's parameters
	switch {
	case *bf16 && *fp16:
		fmt.Fprintln(stderr, "train: -bf16 and -fp16 together; pick one")
		return 2
	case *bf16:
		c.dtype = zero.BF16
	case *fp16:
		c.dtype = zero.FP16
	}
	worldSet := false
	fs.Visit(func(f *flag.Flag) { worldSet = worldSet || f.Name == "world" })
	if *mpi {
		comm, err := zero.NewMPIFromEnv()
		if err != nil {
			fmt.Fprintln(stderr, "train:", err)
			return 1
		}
		if worldSet && c.world != comm.Size() {
			fmt.Fprintf(stderr, "train: -world %d, but the MPI job has %d processes; drop -world (the job's size is the world)\n", c.world, comm.Size())
			zero.AbortComm(comm, errors.New("-world differs from the job's size"))
			return 2
		}
		c.comm, c.world = comm, comm.Size()
		// SIGINT and SIGTERM (a scheduler's, or Hydra's on Ctrl-C) abort the
		// communicator: every rank's collectives fail at once instead of
		// at their timeout.
		sigs := make(chan os.Signal, 1)
		signal.Notify(sigs, syscall.SIGINT, syscall.SIGTERM)
		go func() {
			if s, ok := <-sigs; ok {
				zero.AbortComm(comm, fmt.Errorf("rank %d got %v", comm.Rank(), s))
			}
		}()
		if comm.Rank() != 0 {
			stdout = io.Discard // rank 0 prints for the job
		}
	}
	res, err := run(stdout, c)
	if err == nil && *record != "" && (c.comm == nil || c.comm.Rank() == 0) {
		err = writeRecord(*record, res)
	}
	if err != nil {
		fmt.Fprintln(stderr, "train:", err)
		if c.comm != nil {
			// the peers fail at once; MPI is not finalized (its transfers
			// may be abandoned): the process exits and the launcher ends the job
			zero.AbortComm(c.comm, err)
		}
		return 1
	}
	if c.comm != nil {
		err = c.comm.Close()
		if ferr := zero.MPIFinalize(); err == nil {
			err = ferr
		}
		if err != nil {
			fmt.Fprintln(stderr, "train:", err)
			return 1
		}
	}
	return 0
}

// record is what -record writes: the step a run started after, rank 0's
// parameters before its first step and after each (float64s that hold the
// model dtype's values exactly), and each step's loss.
type record struct {
	First  int           `json:"first"`
	Params [][][]float64 `json:"params"`
	Loss   []float64     `json:"loss"`
}

func writeRecord(file string, res result) error {
	data, err := json.Marshal(record{res.first, res.params, res.loss})
	if err != nil {
		return err
	}
	return os.WriteFile(file, data, 0o644)
}

// config is one training run.
type config struct {
	world, stage, steps, batch, accum int
	in, hidden                        int
	lr, weightDecay                   float64
	dtype                             zero.DType
	bucketBytes                       int
	prefetchBytes                     int // stage 3: Config.PrefetchBytes
	offload                           bool
	seed                              int64
	// lossScale is fp16's scaling (zero: DeepSpeed's dynamic defaults).
	lossScale zero.LossScale
	// save, saveEvery and keep: checkpoints into save at the end and
	// every saveEvery steps, the newest keep kept; resume: where the run
	// starts from (steps is then the total, counted from the first run).
	save, resume    string
	saveEvery, keep int
	// deepspeed is a DeepSpeed config file to train from; warmup fills its
	// "auto" warmup_num_steps; ds is what it was read into, whose Config
	// replaces the one the flags make.
	deepspeed string
	warmup    int
	ds        *zero.DeepSpeedConfig
	// given names the flags set on the command line: only those are cited
	// as the user's, and only those are held against a DeepSpeed config's
	// own values
	given map[string]bool
	// export: a safetensors file of the fp32 parameters at the end.
	export string
	// logEvery: a line every so many steps (0: the DeepSpeed config's
	// steps_per_print, else 1); metrics: a file of JSON lines, a step each.
	logEvery int
	metrics  string
	// trace keeps every step's parameters, stats and times in the result
	// (the tests' view of a run); without it a run keeps a few bytes a step.
	trace bool
	// window: "coalesce" or "nosync", the backwards of each step in such a
	// window; "" none.
	window string
	// comm is this process's rank of an MPI job (-mpi); nil: c.world
	// ranks in this process.
	comm zero.Comm
}

func defaultConfig() config {
	return config{world: 2, stage: 2, steps: 10, batch: 24, accum: 1, in: 4, hidden: 16,
		lr: 0.01, weightDecay: 0.01, dtype: zero.FP32, bucketBytes: 256, seed: 1, warmup: 2}
}

// byDefault says " (the default)" of a flag the command line did not set.
func (c config) byDefault(name string) string {
	if c.given[name] {
		return ""
	}
	return " (the default)"
}

func (c config) check() error {
	if c.world < 1 || c.accum < 1 || c.steps < 1 || c.in < 1 || c.hidden < 1 {
		return errors.New("world, accum, steps, in and hidden must be at least 1")
	}
	if c.batch%(c.world*c.accum) != 0 {
		def := defaultConfig()
		accum := c.flagText("accum", c.accum, def.accum)
		if c.ds != nil && c.ds.Config.Grads.AccumSteps > 0 {
			accum = fmt.Sprintf("gradient_accumulation_steps %d (the DeepSpeed config)", c.accum)
		}
		return fmt.Errorf("%s does not split into %s ranks × %s micro-batches; give a -batch that is a multiple of %d",
			c.flagText("batch", c.batch, def.batch), c.flagText("world", c.world, def.world), accum, c.world*c.accum)
	}
	switch {
	case c.window != "" && c.window != "coalesce" && c.window != "nosync":
		return fmt.Errorf("-window %q; use coalesce, nosync or nothing", c.window)
	case c.saveEvery < 0 || c.keep < 0 || c.logEvery < 0:
		return errors.New("-save-every, -keep and -log-every must be 0 or more")
	case c.saveEvery > 0 && c.save == "":
		return errors.New("-save-every needs -save DIR: the directory the checkpoints go to")
	}
	return nil
}

// flagText is flag name's value v for a message, marked as the default
// where the command line did not set it and v is def.
func (c config) flagText(name string, v, def any) string {
	s := fmt.Sprintf("-%s %v", name, v)
	if !c.given[name] && v == def {
		s += " (the default)"
	}
	return s
}

// ---- the model ----------------------------------------------------------------

// mlp is ŷ = W2·σ(W1·x + b1) + b2 with one output and the logistic σ; its
// tensors, in registration order, are W1 (hidden×in), b1, W2 and b2.
type mlp struct{ in, hidden int }

func (m mlp) sizes() []int { return []int{m.hidden * m.in, m.hidden, m.hidden, 1} }

// shapes are the tensors' shapes (rows × columns for the weights), as an
// export records them.
func (m mlp) shapes() [][]int { return [][]int{{m.hidden, m.in}, {m.hidden}, {1, m.hidden}, {1}} }

// describe lists the tensors as a checkpoint must hold them.
func (m mlp) describe() string {
	var parts []string
	for p, shape := range m.shapes() {
		parts = append(parts, fmt.Sprintf("%s %v (group %d)", tensorNames[p], shape, tensorGroups[p]))
	}
	return strings.Join(parts, ", ")
}

// names and groups of the tensors: the weights decay (group 0), the biases
// do not (group 1), the usual split.
var tensorNames = []string{"W1", "b1", "W2", "b2"}
var tensorGroups = []int{0, 1, 0, 1}

// initial draws the parameters: W2 positive, so that with positive inputs
// and targets above every output the start can reach, each gradient element
// keeps its sign over the run (the regime of the test's error bound).
func (m mlp) initial(rng *rand.Rand) [][]float64 {
	th := make([][]float64, 4)
	for i, n := range m.sizes() {
		th[i] = make([]float64, n)
	}
	for i := range th[0] {
		th[0][i] = rng.Float64() - 0.5
	}
	for i := range th[2] {
		th[2][i] = 0.1 + 0.5*rng.Float64()
	}
	return th
}

// hiddenLayer returns σ(W1·x + b1).
func (m mlp) hiddenLayer(w1, b1, x []float64) []float64 {
	h := make([]float64, m.hidden)
	for j := range h {
		z := b1[j]
		for k, xk := range x {
			z += w1[j*m.in+k] * xk
		}
		h[j] = 1 / (1 + math.Exp(-z))
	}
	return h
}

// outputLayer returns W2·h + b2.
func (m mlp) outputLayer(w2, b2, h []float64) float64 {
	y := b2[0]
	for j, hj := range h {
		y += w2[j] * hj
	}
	return y
}

// batchState is a micro-batch after forward: inputs, activations and the
// loss's derivative by the output, per sample.
type batchState struct {
	x, h [][]float64
	d    []float64
}

// forwardBatch runs forward on samples, layer by layer, and returns the
// state backward needs and the mean loss ½(ŷ − y)². layer(l) gives layer
// l's (weight, bias) and is done with them when the next call comes.
func (m mlp) forwardBatch(layer func(l int) ([]float64, []float64), xs [][]float64, ys []float64) (batchState, float64) {
	b := batchState{x: xs, h: make([][]float64, len(xs)), d: make([]float64, len(xs))}
	w1, b1 := layer(0)
	for s, x := range xs {
		b.h[s] = m.hiddenLayer(w1, b1, x)
	}
	w2, b2 := layer(1)
	loss := 0.0
	for s := range xs {
		b.d[s] = m.outputLayer(w2, b2, b.h[s]) - ys[s]
		loss += 0.5 * b.d[s] * b.d[s]
	}
	return b, loss / float64(len(xs))
}

// layersOf serves forwardBatch from parameters held whole.
func layersOf(th [][]float64) func(l int) ([]float64, []float64) {
	return func(l int) ([]float64, []float64) { return th[2*l], th[2*l+1] }
}

// backwardOutput is the output layer's part of backward: the mean gradients
// of W2 and b2.
func (m mlp) backwardOutput(b batchState, gW2, gb2 []float64) {
	clear(gW2)
	gb2[0] = 0
	for s, d := range b.d {
		for j, hj := range b.h[s] {
			gW2[j] += d * hj
		}
		gb2[0] += d
	}
	scaleBy(gW2, 1/float64(len(b.d)))
	gb2[0] /= float64(len(b.d))
}

// backwardHidden is the hidden layer's part: the mean gradients of W1 and
// b1, through W2 as forward read it.
func (m mlp) backwardHidden(w2 []float64, b batchState, gW1, gb1 []float64) {
	clear(gW1)
	clear(gb1)
	for s, d := range b.d {
		for j, hj := range b.h[s] {
			dz := d * w2[j] * hj * (1 - hj)
			gb1[j] += dz
			for k, xk := range b.x[s] {
				gW1[j*m.in+k] += dz * xk
			}
		}
	}
	scaleBy(gW1, 1/float64(len(b.d)))
	scaleBy(gb1, 1/float64(len(b.d)))
}

func scaleBy(x []float64, f float64) {
	for i := range x {
		x[i] *= f
	}
}

// ---- the data -------------------------------------------------------------------

// The data: each step's global batch of samples, inputs in [0.5, 1.5) and
// targets 20 + 3·sin(Σx), far above what the start can output. The steps
// are drawn in order from one generator, so step st's batch is the same in
// a run of any length: a resumed run needs only its position.

// batches draws the steps' global batches in order, holding only the
// current one: a long run's data costs no more memory than a short one's.
type batches struct {
	c    config
	rng  *rand.Rand
	next int         // the step the generator is at
	x    [][]float64 // the batch of step next−1: [sample][input]
	y    []float64
}

func newBatches(c config) *batches {
	b := &batches{c: c, rng: rand.New(rand.NewSource(c.seed)), x: make([][]float64, c.batch), y: make([]float64, c.batch)}
	for s := range b.x {
		b.x[s] = make([]float64, c.in)
	}
	return b
}

// at returns step st's batch (st at or after the last step asked for),
// drawing past the steps before it; it is valid until the next call.
func (b *batches) at(st int) ([][]float64, []float64) {
	for ; b.next <= st; b.next++ {
		for s, x := range b.x {
			sum := 0.0
			for k := range x {
				x[k] = 0.5 + b.rng.Float64()
				sum += x[k]
			}
			b.y[s] = 20 + 3*math.Sin(sum)
		}
	}
	return b.x, b.y
}

// dataset is every step's batch at once, as the tests' references read it.
type dataset struct {
	x [][][]float64 // [step][sample][input]
	y [][]float64   // [step][sample]
}

func makeData(c config) dataset {
	var d dataset
	b := newBatches(c)
	for st := range c.steps {
		xs, ys := b.at(st)
		cx := make([][]float64, len(xs))
		for s := range xs {
			cx[s] = append([]float64(nil), xs[s]...)
		}
		d.x, d.y = append(d.x, cx), append(d.y, append([]float64(nil), ys...))
	}
	return d
}

// microBatch is the samples of rank r's k-th micro-batch: the global batch
// split into ranks, each rank's part into micro-batches.
func (c config) microBatch(r, k int) (from, to int) {
	per := c.batch / c.world / c.accum
	from = (r*c.accum + k) * per
	return from, from + per
}

// ---- training -------------------------------------------------------------------

// result is what a run returns: what its end prints (the mean loss of
// each step's global batch, at the parameters before it; with fp16 the
// step's scale and whether it was skipped; the checkpoints written) and,
// only when config.trace asks, rank 0's parameters before the first step
// and after each (as float64) and each step's stats, wall time and gather
// wait: a history a long run must not keep. A resumed run's first step is
// first+1, its params[0] the loaded ones.
type result struct {
	first int
	saved []int // the steps after which a checkpoint was written
	loss  []float64
	scale []float64 // the loss scale each step's loss was multiplied by
	skip  []bool    // the step was skipped (fp16's overflow)
	// the trace
	params [][][]float64
	stats  []zero.Stats
	wall   []time.Duration
	// waited is the time each step's forward and backward waited for
	// gathers (stage 3): the part of ParamGatherTime not hidden.
	waited []time.Duration
	// settings is rank 0's engine's settings record
	settings []zero.Setting
	// loaded is rank 0's report of the checkpoint a resumed run loaded
	loaded *zero.LoadReport
	// log reports each step as it ends
	log *progress
}

// run trains c.steps steps on c.world in-process ranks and prints each
// step as it ends to out (nil: prints nothing).
func run(out io.Writer, c config) (res result, err error) {
	if c.deepspeed != "" {
		var err error
		if c, err = withDeepSpeed(c, out); err != nil {
			return result{}, err
		}
	}
	if err := c.check(); err != nil {
		return result{}, err
	}
	if c.logEvery == 0 {
		c.logEvery = 1
		if c.ds != nil && c.ds.StepsPerPrint > 0 {
			c.logEvery = c.ds.StepsPerPrint
		}
	}
	res.log = &progress{out: out, every: c.logEvery, last: c.steps, batch: c.batch}
	if c.metrics != "" {
		flags := os.O_WRONLY | os.O_CREATE | os.O_TRUNC
		if c.resume != "" {
			flags = os.O_WRONLY | os.O_CREATE | os.O_APPEND
		}
		f, err := os.OpenFile(c.metrics, flags, 0o644)
		if err != nil {
			return result{}, fmt.Errorf("-metrics: %w", err)
		}
		defer func() {
			if cerr := f.Close(); cerr != nil && err == nil {
				err = fmt.Errorf("-metrics: %w", cerr)
			}
		}()
		res.log.metrics = f
	}
	if out != nil {
		offload := ""
		if c.offload {
			offload = ", offloaded to the host"
		}
		opt := fmt.Sprintf("AdamW lr %g", c.lr)
		if c.ds != nil {
			opt = "the DeepSpeed config's optimizer"
		}
		ranks := fmt.Sprintf("%d ranks", c.world)
		if c.comm != nil {
			ranks = fmt.Sprintf("%d MPI processes", c.world)
		}
		window := ""
		if c.window != "" {
			window = ", in a " + c.window + " window"
		}
		fmt.Fprintf(out, "MLP %d→%d→1 on %s, ZeRO-%d%s, %s, global batch %d in %d backward(s) per step%s\n",
			c.in, c.hidden, ranks, c.stage, offload, opt, c.batch, c.accum, window)
		if c.dtype != zero.FP32 {
			fmt.Fprintf(out, "%v parameters and gradients, fp32 master and moments\n", c.dtype)
		}
	}
	train := func(comm zero.Comm) error {
		var rec *result
		if comm.Rank() == 0 {
			rec = &res
		}
		return trainRank(c, comm, newBatches(c), rec)
	}
	if c.comm != nil {
		err = train(c.comm) // this process's rank
	} else {
		// one goroutine per rank; a rank that fails aborts the others at once
		comms, cerr := zero.NewLocalGroupTimeout(c.world, time.Minute)
		if cerr != nil {
			return result{}, cerr
		}
		err = zero.RunRanks(comms, train)
	}
	if err != nil {
		return res, err
	}
	if out != nil && c.export != "" {
		fmt.Fprintf(out, "fp32 parameters exported to %s\n", c.export)
	}
	return res, nil
}

// tensorMem is one parameter's or gradient's memory in the model dtype.
type tensorMem struct {
	f32 []float32
	h   []uint16
	dt  zero.DType
}

func newTensorMem(n int, dt zero.DType) *tensorMem {
	if dt == zero.FP32 {
		return &tensorMem{f32: make([]float32, n), dt: dt}
	}
	return &tensorMem{h: make([]uint16, n), dt: dt}
}

func (t *tensorMem) tensor() zero.Tensor {
	if t.dt == zero.FP32 {
		return zero.Float32s(t.f32)
	}
	return zero.Halfs(t.h, t.dt)
}

func (t *tensorMem) set(x []float64) {
	for i, v := range x {
		switch t.dt {
		case zero.FP32:
			t.f32[i] = float32(v)
		case zero.BF16:
			t.h[i] = bf16(float32(v))
		default:
			t.h[i] = fp16(float32(v))
		}
	}
}

func (t *tensorMem) get(x []float64) {
	for i := range x {
		switch t.dt {
		case zero.FP32:
			x[i] = float64(t.f32[i])
		case zero.BF16:
			x[i] = float64(math.Float32frombits(uint32(t.h[i]) << 16))
		default:
			x[i] = float64(fromFP16(t.h[i]))
		}
	}
}

// bf16 rounds to the nearest bfloat16, ties to even (inputs are finite).
func bf16(f float32) uint16 {
	u := math.Float32bits(f)
	return uint16((u + 0x7fff + (u>>16)&1) >> 16)
}

// fp16 rounds to the nearest IEEE binary16, ties to even: beyond 65504 it
// is an infinity (the overflow the loss scaler watches for), below 2^-14 a
// subnormal.
func fp16(f float32) uint16 {
	u := math.Float32bits(f)
	sign := uint16(u>>16) & 0x8000
	exp, man := int(u>>23&0xff), u&0x7fffff
	if exp == 0xff { // inf, NaN (kept a quiet NaN)
		if man != 0 {
			return sign | 0x7e00
		}
		return sign | 0x7c00
	}
	e := exp - 127 + 15 // the binary16 biased exponent
	var q, rem, half uint32
	switch {
	case e >= 0x1f:
		return sign | 0x7c00
	case e > 0: // normal: 23 mantissa bits to 10
		q, rem, half = uint32(e)<<10|man>>13, man&0x1fff, 0x1000
	case e < -10: // under half the smallest subnormal
		return sign
	default: // subnormal: the value in units of 2^-24
		m, shift := man|0x800000, uint(14-e)
		q, rem, half = m>>shift, m&(1<<shift-1), 1<<(shift-1)
	}
	if rem > half || rem == half && q&1 == 1 {
		q++ // a carry moves into the exponent, up to infinity: still right
	}
	return sign | uint16(q)
}

// fromFP16 is binary16 h as a float32 (exact).
func fromFP16(h uint16) float32 {
	sign := uint32(h&0x8000) << 16
	exp, man := uint32(h>>10&0x1f), uint32(h&0x3ff)
	switch exp {
	case 0:
		f := float32(man) * 0x1p-24
		if sign != 0 {
			f = -f
		}
		return f
	case 0x1f:
		return math.Float32frombits(sign | 0x7f800000 | man<<13)
	}
	return math.Float32frombits(sign | (exp+127-15)<<23 | man<<13)
}

// trainRank is one rank's training loop. rec, on rank 0, records the run.
func trainRank(c config, comm zero.Comm, data *batches, rec *result) error {
	m := mlp{c.in, c.hidden}
	// Each rank draws its own start; the broadcast at New makes rank 0's win.
	theta := m.initial(rand.New(rand.NewSource(c.seed + 1 + int64(comm.Rank()))))
	params := make([]zero.Param, 4)
	mem, grads := make([]*tensorMem, 4), make([]*tensorMem, 4)
	for p, n := range m.sizes() {
		mem[p], grads[p] = newTensorMem(n, c.dtype), newTensorMem(n, c.dtype)
		mem[p].set(theta[p])
		params[p] = zero.Param{Name: tensorNames[p], Count: n, Shape: m.shapes()[p], DType: c.dtype, Data: mem[p].tensor(), Group: tensorGroups[p]}
	}
	e, err := zero.New(c.engineConfig(), comm, params)
	if err != nil {
		return err
	}
	defer e.Close()
	if rec != nil {
		rec.settings = e.Settings()
	}
	start := 0 // the steps taken, the next batch's index
	if c.resume != "" {
		// the flags' -lr and -wd hold for the rest of the run; the
		// moments, step counts and loss scale come back
		loaded, err := e.Load(c.resume, zero.LoadOptions{KeepConfigGroups: true})
		if errors.Is(err, zero.ErrCheckpoint) {
			return fmt.Errorf("%w (cmd/train's model is the MLP of -in %d -hidden %d: %s; a checkpoint it resumes, a converted DeepSpeed run's too, holds those)", err, c.in, c.hidden, m.describe())
		}
		if err != nil {
			return err
		}
		if start, err = resumePosition(c, comm, loaded.Client); err != nil {
			return err
		}
		if rec != nil {
			rec.loaded = &loaded
		}
	}
	if c.stage == 3 {
		mem = nil // the engine holds this rank's shard: the full parameters can go
	}
	// Backward runs the output layer's part on one stream and the hidden
	// layer's on another, as a framework's autograd may.
	outStream, hiddenStream := zero.NewHostStream(), zero.NewHostStream()
	defer outStream.Close()
	defer hiddenStream.Close()
	// gather reads tensors ps into theta: from their memory, or at stage 3
	// through a gather whose views are read on s and released at once.
	var waited time.Duration
	gather := func(s *zero.HostStream, ps ...int) error {
		if mem != nil {
			for _, p := range ps {
				mem[p].get(theta[p])
			}
			return nil
		}
		views, err := e.Gather(s, ps...)
		if err != nil {
			return err
		}
		t0 := time.Now()
		if err := s.Sync(); err != nil { // this host code reads the views now
			return err
		}
		waited += time.Since(t0)
		for i, p := range ps {
			(&tensorMem{f32: views[i].HostFloat32s(), h: views[i].HostHalfs(), dt: c.dtype}).get(theta[p])
		}
		return e.Release(s, ps...)
	}
	var gatherErr error
	// layer serves the forward one layer at a time
	layer := func(l int) ([]float64, []float64) {
		if err := gather(outStream, 2*l, 2*l+1); err != nil && gatherErr == nil {
			gatherErr = err
		}
		return theta[2*l], theta[2*l+1]
	}
	read := func() error { return gather(outStream, 0, 1, 2, 3) }
	record := func() {
		snap := make([][]float64, 4)
		for p := range theta {
			snap[p] = append([]float64(nil), theta[p]...)
		}
		rec.params = append(rec.params, snap)
	}
	if err := read(); err != nil { // rank 0's values, after the broadcast
		return err
	}
	if rec != nil {
		rec.first = start
		if c.trace {
			record()
		}
		rec.log.begin(c, start, rec.settings, rec.loaded)
	}
	g64 := make([][]float64, 4)
	for p, n := range m.sizes() {
		g64[p] = make([]float64, n)
	}
	for st := start; st < c.steps; st++ {
		t0 := time.Now()
		waited = 0
		loss := 0.0
		// fp16: backward is that of the loss times the scale, so the
		// gradients handed over are scaled; Step divides it out (1 in fp32
		// and bf16).
		scale := e.LossScale()
		var reused [4]zero.Event // when the engine is done with each gradient buffer
		xs, ys := data.at(st)
		nosync := c.window == "nosync" && c.accum > 1
		if c.window == "coalesce" {
			if err := e.BeginCoalesce(); err != nil {
				return err
			}
		}
		if nosync {
			if err := e.BeginNoSync(); err != nil {
				return err
			}
		}
		for k := range c.accum {
			if nosync && k == c.accum-1 { // the last backward reduces
				if err := e.EndNoSync(); err != nil {
					return err
				}
			}
			from, to := c.microBatch(comm.Rank(), k)
			b, l := m.forwardBatch(layer, xs[from:to], ys[from:to])
			if gatherErr != nil {
				return gatherErr
			}
			// the hidden layer's backward reads W2 again: gathered again
			if err := gather(hiddenStream, 2); err != nil {
				return err
			}
			w2 := append([]float64(nil), theta[2]...)
			loss += l / float64(c.accum)
			if scale != 1 {
				scaleBy(b.d, scale) // d(scale·loss)/dŷ
			}
			// report computes layers' gradients on s, after the engine's
			// reads of the previous micro-batch's, and hands them over.
			report := func(s *zero.HostStream, compute func(), ps ...int) error {
				for _, p := range ps {
					if reused[p] != nil {
						if err := s.Wait(reused[p]); err != nil {
							return err
						}
					}
				}
				if err := s.Launch(func() error {
					compute()
					for _, p := range ps {
						grads[p].set(g64[p])
					}
					return nil
				}); err != nil {
					return err
				}
				for _, p := range ps {
					if reused[p], err = e.GradReady(p, grads[p].tensor(), s); err != nil {
						return err
					}
				}
				return nil
			}
			if err := report(outStream, func() { m.backwardOutput(b, g64[2], g64[3]) }, 3, 2); err != nil {
				return err
			}
			if err := report(hiddenStream, func() { m.backwardHidden(w2, b, g64[0], g64[1]) }, 1, 0); err != nil {
				return err
			}
			if err := e.EndBackward(); err != nil {
				return err
			}
		}
		if c.window == "coalesce" {
			if err := e.EndCoalesce(); err != nil {
				return err
			}
		}
		if err := e.Step(); err != nil {
			return err
		}
		stats := e.Stats()
		if stats.Step != st {
			return fmt.Errorf("the engine took step %d for the data's step %d", stats.Step+1, st+1)
		}
		// fp16 skips a step whose scaled gradients overflowed and lowers
		// the scale; elsewhere the scale is 1 and an overflow is divergence
		if stats.Skipped && c.dtype != zero.FP16 {
			return fmt.Errorf("step %d skipped: gradient norm %g", st+1, stats.GradNorm)
		}
		wall, stepWaited := time.Since(t0), waited
		// the global batch's mean loss: the mean of the ranks' means
		global, err := zero.AllReduceScalars(comm, zero.OpAvg, loss)
		if err != nil {
			return err
		}
		if c.trace { // every rank (c is theirs too): at stage 3 it gathers
			if err := read(); err != nil {
				return err
			}
		}
		saved := false
		if c.save != "" && (st+1 == c.steps || c.saveEvery > 0 && (st+1)%c.saveEvery == 0) {
			client, err := json.Marshal(trainState{Step: st + 1, Seed: c.seed, Batch: c.batch, In: c.in})
			if err != nil {
				return err
			}
			if err := e.Save(c.save, zero.SaveOptions{Client: client, Keep: c.keep}); err != nil {
				return err
			}
			saved = true
		}
		if rec != nil {
			rec.loss = append(rec.loss, global[0])
			rec.scale = append(rec.scale, stats.LossScale)
			rec.skip = append(rec.skip, stats.Skipped)
			if err := rec.log.stepEnded(st, global[0], stats, wall); err != nil {
				return err
			}
			if saved {
				rec.saved = append(rec.saved, st+1)
				rec.log.saved(st+1, c.save)
			}
			if c.trace {
				record()
				rec.stats = append(rec.stats, stats)
				rec.wall = append(rec.wall, wall)
				rec.waited = append(rec.waited, stepWaited)
			}
		}
	}
	if c.export != "" {
		// every rank writes its shard's ranges; nothing is gathered
		return e.ExportSafetensors(c.export, zero.ExportOptions{Metadata: map[string]string{"model": fmt.Sprintf("mlp %d-%d-1", c.in, c.hidden)}})
	}
	return nil
}

// trainState is the trainer's own part of a checkpoint (SaveOptions.Client,
// the same on every rank): the data position, and what the data is drawn
// from, so that a resumed run refuses data other than the saved run's.
type trainState struct {
	Step  int   `json:"step"` // steps taken: the index of the next batch
	Seed  int64 `json:"seed"`
	Batch int   `json:"batch"`
	In    int   `json:"in"`
}

// convertedDeepSpeed is the client bytes of a DeepSpeed run converted by
// deepspeed/cmd/convert -zero (its deepspeed.ClientState): DeepSpeed's
// counters. Its data was its own, so the run goes on with this command's
// data from the batch of its step count, the global batch held to its
// samples per step.
type convertedDeepSpeed struct {
	Version       string `json:"deepspeed"`
	GlobalSteps   int    `json:"global_steps"`
	GlobalSamples int    `json:"global_samples"`
}

// resumePosition is the step a resumed run starts from, agreed by every
// rank (a rank the saving run did not have gets rank 0's client bytes).
func resumePosition(c config, comm zero.Comm, client []byte) (int, error) {
	var own error
	var ts trainState
	var ds convertedDeepSpeed
	have := client != nil
	if have && json.Unmarshal(client, &ds) == nil && ds.Version != "" {
		ts.Step = ds.GlobalSteps
		if ds.GlobalSteps < 0 || ds.GlobalSamples != ds.GlobalSteps*c.batch {
			own = fmt.Errorf("%s is DeepSpeed %s's run after %d steps and %d samples, not %d a step as this run's global batch %d; resume with its DeepSpeed config (-deepspeed), whose batch sizes give its global batch",
				c.resume, ds.Version, ds.GlobalSteps, ds.GlobalSamples, c.batch, c.batch)
		}
	} else if have {
		if err := json.Unmarshal(client, &ts); err != nil {
			own = fmt.Errorf("%s: the trainer's state in the checkpoint is unreadable (%v); was it written by cmd/train?", c.resume, err)
		} else if ts.Seed != c.seed || ts.Batch != c.batch || ts.In != c.in {
			def := defaultConfig()
			own = fmt.Errorf("%s was trained on the data of -seed %d -batch %d -in %d; resume with those (this run has %s, %s, %s)",
				c.resume, ts.Seed, ts.Batch, ts.In, c.flagText("seed", c.seed, def.seed), c.flagText("batch", c.batch, def.batch), c.flagText("in", c.in, def.in))
		}
	}
	// one all-reduce of the outcome and the positions' max and min
	const none = -1e15
	vals := []float64{0, none, none}
	if own != nil {
		vals[0] = 1
	} else if have {
		vals[1], vals[2] = float64(ts.Step), -float64(ts.Step)
	}
	out, err := zero.AllReduceScalars(comm, zero.OpMax, vals...)
	switch {
	case err != nil:
		return 0, err
	case own != nil:
		return 0, own
	case out[0] != 0:
		return 0, fmt.Errorf("%s: another rank could not resume (see its error)", c.resume)
	case out[1] == none:
		return 0, fmt.Errorf("%s holds no trainer state; resume from a checkpoint cmd/train wrote", c.resume)
	case out[1] != -out[2]:
		return 0, fmt.Errorf("%s: the ranks' data positions differ (steps %g to %g); the checkpoint is not one run's", c.resume, -out[2], out[1])
	case int(out[1]) > c.steps:
		return 0, fmt.Errorf("%s was saved after step %d; -steps is the total, so give at least %d", c.resume, int(out[1]), int(out[1]))
	}
	return int(out[1]), nil
}
