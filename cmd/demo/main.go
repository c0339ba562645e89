// Command demo prints the table of DeepSpeed PR #7992 (seed 000) for zero:
// per ZeRO stage, N backwards per step taken as plain backwards, as
// no_sync, in a coalesced window and in a coalesced window with a budget of
// half a gradient, across in-process ranks on the CPU (or, with -mpi under
// mpiexec, one rank per process). Each row gives the
// gradient memory, the step's wall time, its collectives and the largest
// error against a float64 mean.
package main

import (
	"bufio"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"math"
	"os"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"time"

	"zero"
)

// The modes of a step's N backwards.
const (
	baseline       = "baseline"        // N plain backwards, then Step
	noSync         = "no_sync"         // N−1 inside NoSync, one after it, Step
	coalesce       = "coalesce"        // N inside BeginCoalesce/EndCoalesce, Step
	coalesceBudget = "coalesce_budget" // coalesce within half a gradient of fp32 sums
)

var allModes = []string{baseline, noSync, coalesce, coalesceBudget}

type options struct {
	world, layers, hidden int
	mpi                   bool // one rank per process of an MPI job
	rank                  int  // this process's rank, with mpi
	ns, stages            []int
	modes                 []string
	steps                 int        // timed steps per row, after one warm-up step
	bucketBytes           int        // 0: one layer per bucket
	rounds                int        // hash rounds per gradient element: the backward's compute
	overlap               bool       // Config.Overlap
	windowDType           zero.DType // Window.DType: of a window's local sums
	shardDType            zero.DType // Precision.ShardDType: of the reduced gradient shard
}

// Row is one line of the table (and one JSON object).
type Row struct {
	Stage int    `json:"stage"`
	Mode  string `json:"mode"`
	N     int    `json:"n"`
	// Gradient memory per rank, in bytes, held (in use or idle in the
	// pools): PeakGradBytes, the bytes held at the end of the last backward
	// before the flush (measured: WindowResidentBytes; baseline:
	// ResidentGradBytes, see the footnote), ResidentGradBytes at Step, and
	// the idle pooled part of it.
	PeakBytes              int64 `json:"peak_window_bytes"`
	WindowResidentBytes    int64 `json:"window_resident_bytes"`
	WindowResidentMeasured bool  `json:"window_resident_measured"`
	FlushResidentBytes     int64 `json:"flush_resident_bytes"`
	PooledBytes            int64 `json:"pooled_bytes"`
	// The same in use (the pools' idle buffers left out, as PyTorch's
	// memory_allocated leaves out its cache).
	PeakInUseBytes   int64 `json:"peak_in_use_bytes"`
	WindowInUseBytes int64 `json:"window_in_use_bytes"`
	FlushInUseBytes  int64 `json:"flush_in_use_bytes"`
	// Timing of rank 0: the median step wall time, every timed step's, and
	// the last step's ReduceTime, ExposedReduceTime and LastReduceTime.
	WallMs    float64   `json:"wall_ms"`
	WallsMs   []float64 `json:"walls_ms"`
	ReduceMs  float64   `json:"reduce_ms"`
	ExposedMs float64   `json:"exposed_ms"`
	BucketMs  float64   `json:"last_bucket_ms"`
	// Collectives of the last step on rank 0, by kind.
	ReduceScatters int64 `json:"reduce_scatters"`
	AllReduces     int64 `json:"all_reduces"`
	AllGathers     int64 `json:"all_gathers"`
	// Gradient traffic (reduce-scatters and all-reduces) and stage 3's
	// parameter all-gathers, per rank.
	GradPayloadBytes   int64 `json:"grad_payload_bytes"`
	GradWireBytes      int64 `json:"grad_wire_bytes"`
	GatherPayloadBytes int64 `json:"gather_payload_bytes"`
	GatherWireBytes    int64 `json:"gather_wire_bytes"`
	// The plan: buckets, and those a window makes local (all but the budget's).
	Buckets      int `json:"buckets"`
	LocalBuckets int `json:"local_buckets"`
	// MaxErr is the largest error of the reduced gradient against the
	// float64 mean on a sample, relative to the mean of |g|.
	MaxErr float64 `json:"max_err"`
	// The setup, so JSON rows stand alone.
	World       int    `json:"world"`
	Params      int64  `json:"params"`
	Steps       int    `json:"steps"`
	WindowDType string `json:"window_dtype"`
	ShardDType  string `json:"shard_dtype"`
}

func main() { os.Exit(mainArgs(os.Args[1:], os.Stdout, os.Stderr)) }

// mainArgs is the command with args; it returns the exit code.
func mainArgs(args []string, stdout, stderr io.Writer) int {
	fail := func(err error) int { fmt.Fprintln(stderr, "demo:", err); return 1 }
	o := options{}
	fs := flag.NewFlagSet("demo", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.IntVar(&o.world, "world", 2, "ranks in the in-process group")
	fs.BoolVar(&o.mpi, "mpi", false, "one rank per process of an MPI job (mpiexec -n W demo -mpi): the world is the job's, rank 0 prints the table")
	fs.IntVar(&o.layers, "layers", 8, "layers of the MLP (each a hidden×hidden weight and a bias)")
	fs.IntVar(&o.hidden, "hidden", 1024, "hidden size")
	seed := fs.Bool("seed000", false, "seed 000's model, overriding -layers and -hidden: 8 layers × hidden 4096, bf16, 134M parameters (slow on a CPU)")
	ns := fs.String("n", "2,4,8", "backwards per step")
	stages := fs.String("stages", "1,2,3", "ZeRO stages")
	modes := fs.String("modes", strings.Join(allModes, ","), "modes")
	fs.IntVar(&o.steps, "steps", 3, "timed steps per row, after one warm-up step (the median is shown)")
	bucketMiB := fs.Float64("bucket", 0, "bucket size in MiB (0: one layer per bucket)")
	fs.IntVar(&o.rounds, "rounds", 1, "hash rounds per gradient element: the synthetic backward's compute (about 2 µs per KiB at 1)")
	fs.BoolVar(&o.overlap, "overlap", true, "reduce on the engine's own stream (Config.Overlap)")
	windowDType := fs.String("window-dtype", "fp32", "dtype of a window's local sums (Window.DType): fp32 or bf16")
	shardDType := fs.String("shard-dtype", "fp32", "dtype of the reduced gradient shard (Precision.ShardDType): fp32 or bf16")
	asJSON := fs.Bool("json", false, "print one JSON object per row instead of the table")
	quiet := fs.Bool("q", false, "no progress on stderr")
	if err := fs.Parse(args); err != nil {
		return 2
	}
	if *seed {
		o.layers, o.hidden = 8, 4096
	}
	o.bucketBytes = int(*bucketMiB * (1 << 20))
	var err error
	if o.windowDType, err = dtypeFlag("window-dtype", *windowDType); err != nil {
		return fail(err)
	}
	if o.shardDType, err = dtypeFlag("shard-dtype", *shardDType); err != nil {
		return fail(err)
	}
	if o.ns, err = ints(*ns); err != nil {
		return fail(err)
	}
	if o.stages, err = ints(*stages); err != nil {
		return fail(err)
	}
	for _, m := range strings.Split(*modes, ",") {
		if m = strings.TrimSpace(m); !slices.Contains(allModes, m) {
			return fail(fmt.Errorf("unknown mode %q (want %s)", m, strings.Join(allModes, ", ")))
		}
		o.modes = append(o.modes, m)
	}
	for _, n := range o.ns {
		if n < 1 || (n < 2 && slices.Contains(o.modes, noSync)) {
			return fail(fmt.Errorf("N = %d: no_sync needs N ≥ 2, every mode N ≥ 1", n))
		}
	}
	if o.steps < 1 || o.world < 1 || o.layers < 1 || o.hidden < 1 {
		return fail(fmt.Errorf("steps, world, layers and hidden must be positive"))
	}
	progress := stderr
	if *quiet {
		progress = io.Discard
	}
	if o.mpi {
		// the job's size is the world; every row runs on a communicator of
		// its own, and MPI ends with the table (only rank 0 prints it)
		comm, err := zero.NewMPIFromEnv()
		if err != nil {
			return fail(err)
		}
		o.world, o.rank = comm.Size(), comm.Rank()
		if err := comm.Close(); err != nil {
			return fail(err)
		}
		if o.rank != 0 {
			stdout, progress = io.Discard, io.Discard
		}
		defer func() {
			if err := zero.MPIFinalize(); err != nil {
				fmt.Fprintln(stderr, "demo:", err)
			}
		}()
	}
	m := newModel(o.layers, o.hidden)
	start := time.Now()
	rows, err := runTable(o, m, progress)
	if err != nil {
		return fail(err)
	}
	fmt.Fprintf(progress, "demo: %d rows in %.1f s\n", len(rows), time.Since(start).Seconds())
	w := bufio.NewWriter(stdout)
	defer w.Flush()
	if *asJSON {
		enc := json.NewEncoder(w)
		for _, r := range rows {
			if err := enc.Encode(r); err != nil {
				return fail(err)
			}
		}
		return 0
	}
	printTable(w, o, m, rows)
	return 0
}

// model is the synthetic MLP: parameter 2l is layer l's weight, 2l+1 its
// bias. Its bf16 values are shared read-only by every rank.
type model struct {
	layers, hidden int
	params         []zero.Param
	weights        [][]uint16
	count          int64
}

func newModel(layers, hidden int) *model {
	m := &model{layers: layers, hidden: hidden}
	for l := range layers {
		for j, n := range []int{hidden * hidden, hidden} {
			p := 2*l + j
			m.params = append(m.params, zero.Param{Name: fmt.Sprintf("l%d.%c", l, "wb"[j]), Count: n, DType: zero.BF16})
			w := make([]uint16, n)
			key := mix(uint64(p) + 1<<60)
			for i := range w {
				w[i] = toBF16(0.1 * noise(key, i, 1))
			}
			m.weights = append(m.weights, w)
			m.count += int64(n)
		}
	}
	return m
}

// layerBytes is one layer's bf16 gradient with its bias, as the plan lays
// it out: a bucket of this size holds exactly one layer.
func (m *model) layerBytes() int { return 2 * (m.hidden*m.hidden + (m.hidden+7)/8*8) }

func runTable(o options, m *model, progress io.Writer) ([]Row, error) {
	var rows []Row
	total := len(o.stages) * len(o.modes) * len(o.ns)
	for _, stage := range o.stages {
		for _, mode := range o.modes {
			for _, n := range o.ns {
				runtime.GC() // the last row's garbage, collected outside the timed steps
				t0 := time.Now()
				r, err := runRow(o, m, stage, mode, n)
				if err != nil {
					return nil, fmt.Errorf("stage %d %s N=%d: %w", stage, mode, n, err)
				}
				rows = append(rows, r)
				fmt.Fprintf(progress, "demo: [%d/%d] ZeRO-%d %-15s N=%d  %8.1f ms/step  (%.1f s)\n",
					len(rows), total, stage, mode, n, r.WallMs, time.Since(t0).Seconds())
			}
		}
	}
	return rows, nil
}

// rankOut is what one rank leaves.
type rankOut struct {
	stats zero.Stats
	walls []time.Duration
	plan  *zero.Plan
	full  [][]float32
}

func runRow(o options, m *model, stage int, mode string, n int) (Row, error) {
	cfg := zero.Config{Stage: stage, BucketBytes: o.bucketBytes, Overlap: o.overlap}
	cfg.Window.DType, cfg.Precision.ShardDType = o.windowDType, o.shardDType
	if cfg.BucketBytes == 0 {
		cfg.BucketBytes = m.layerBytes()
	}
	if mode == coalesceBudget {
		// half a gradient of a window's sums, and the padding of half the
		// buckets (a granule of W × 64 elements at most each)
		cfg.Window.BudgetBytes = (int(m.count) + m.layers*o.world*64) * sumsDType(cfg).Size() / 2
	}
	outs := make([]rankOut, o.world)
	run := func(comm zero.Comm) error { return runRank(o, m, cfg, comm, mode, n, &outs[comm.Rank()]) }
	if o.mpi {
		comm, err := zero.NewMPIFromEnv()
		if err != nil {
			return Row{}, err
		}
		if err := run(comm); err != nil {
			return Row{}, err
		}
		if o.rank != 0 {
			return Row{}, nil // rank 0 makes the row
		}
	} else if err := zero.RunLocal(o.world, run); err != nil {
		return Row{}, err
	}
	st, c := outs[0].stats, outs[0].stats.Collectives
	var walls []float64
	for _, d := range outs[0].walls {
		walls = append(walls, ms(d))
	}
	row := Row{
		Stage: stage, Mode: mode, N: n,
		PeakBytes: st.PeakGradBytes, WindowResidentBytes: st.WindowResidentBytes, WindowResidentMeasured: st.WindowResidentBytes > 0,
		FlushResidentBytes: st.ResidentGradBytes, PooledBytes: st.PooledGradBytes,
		PeakInUseBytes: st.PeakGradBytesInUse, WindowInUseBytes: st.WindowGradBytesInUse, FlushInUseBytes: st.GradBytesInUse,
		WallMs: median(walls), WallsMs: walls, ReduceMs: ms(st.ReduceTime),
		ExposedMs: ms(st.ExposedReduceTime), BucketMs: ms(st.LastReduceTime),
		ReduceScatters: c[zero.KindReduceScatter].Calls, AllReduces: c[zero.KindAllReduce].Calls, AllGathers: c[zero.KindAllGather].Calls,
		GradPayloadBytes:   c[zero.KindReduceScatter].PayloadBytes + c[zero.KindAllReduce].PayloadBytes,
		GradWireBytes:      c[zero.KindReduceScatter].WireBytes + c[zero.KindAllReduce].WireBytes,
		GatherPayloadBytes: c[zero.KindAllGather].PayloadBytes, GatherWireBytes: c[zero.KindAllGather].WireBytes,
		Buckets: len(outs[0].plan.Buckets), LocalBuckets: localBuckets(outs[0].plan, cfg),
		MaxErr: maxError(m, outs[0].full, o.world, n, o.rounds),
		World:  o.world, Params: m.count, Steps: o.steps, WindowDType: o.windowDType.String(), ShardDType: o.shardDType.String(),
	}
	if !row.WindowResidentMeasured {
		// No window: memory only grows into the pools, and Step allocates
		// nothing after the warm-up, so Step's resident bytes are those of
		// the last backward's end.
		row.WindowResidentBytes, row.WindowInUseBytes = st.ResidentGradBytes, st.GradBytesInUse
	}
	return row, nil
}

// localBuckets counts the buckets a window makes local: the engine's rule,
// from the last produced down while their sums fit the budget (ZeRO-1's own
// in fp32, the others' in the window's dtype, padded).
func localBuckets(p *zero.Plan, cfg zero.Config) int {
	used, n := 0, 0
	for b := len(p.Buckets) - 1; b >= 0; b-- {
		size := 4 * p.Buckets[b].Elems
		if cfg.Stage != 1 {
			size = sumsDType(cfg).Size() * p.Buckets[b].Padded
		}
		if cfg.Window.BudgetBytes > 0 && used+size > cfg.Window.BudgetBytes {
			break
		}
		used += size
		n++
	}
	return n
}

// sumsDType is the dtype of the local sums, a window's and ZeRO-1's own:
// Window.DType (fp32 where unset).
func sumsDType(cfg zero.Config) zero.DType {
	if cfg.Window.DType == 0 {
		return zero.FP32
	}
	return cfg.Window.DType
}

// dtypeFlag reads a dtype flag.
func dtypeFlag(name, v string) (zero.DType, error) {
	switch v {
	case "fp32":
		return zero.FP32, nil
	case "bf16":
		return zero.BF16, nil
	}
	return 0, fmt.Errorf("-%s %q: want fp32 or bf16 (the model is bf16)", name, v)
}

func runRank(o options, m *model, cfg zero.Config, comm zero.Comm, mode string, n int, out *rankOut) (err error) {
	defer comm.Close()
	rank := comm.Rank()
	params := slices.Clone(m.params)
	if cfg.Stage == 3 {
		// Real stage 3: the engine shards the parameters and the layers
		// are gathered. Every rank has the same values, and skipping the
		// broadcast keeps the shared memory read-only.
		for i := range params {
			params[i].Data = zero.Halfs(m.weights[i], zero.BF16)
		}
		cfg.Params.NoBroadcast = true
	}
	e, err := zero.New(cfg, comm, params)
	if err != nil {
		return err
	}
	defer func() {
		if cerr := e.Close(); err == nil {
			err = cerr
		}
	}()
	// Two producer streams, as two CUDA streams of a framework's backward;
	// each has one gradient buffer per parameter of a layer.
	var streams [2]*zero.HostStream
	var bufs [2][2][]uint16
	var ready [2]zero.Event // the engine's read of each stream's buffers
	for i := range streams {
		streams[i] = zero.NewHostStream()
		defer streams[i].Close()
		bufs[i] = [2][]uint16{make([]uint16, m.hidden*m.hidden), make([]uint16, m.hidden)}
	}
	// layer returns layer l's weight and bias as the compute sees them:
	// gathered at stage 3 for work on s, the shared memory below it.
	layer := func(s zero.Stream, l int) ([2][]uint16, error) {
		if cfg.Stage != 3 {
			return [2][]uint16{m.weights[2*l], m.weights[2*l+1]}, nil
		}
		views, err := e.Gather(s, 2*l, 2*l+1)
		if err != nil {
			return [2][]uint16{}, err
		}
		return [2][]uint16{views[0].HostHalfs(), views[1].HostHalfs()}, nil
	}
	release := func(s zero.Stream, l int) error {
		if cfg.Stage != 3 {
			return nil
		}
		return e.Release(s, 2*l, 2*l+1)
	}
	var sink float32 // the forward's result, written on stream 0 only
	forward := func() error {
		s := streams[0]
		for l := range m.layers {
			w, err := layer(s, l)
			if err != nil {
				return err
			}
			if err := s.Launch(func() error { sink += touch(w[0]) + touch(w[1]); return nil }); err != nil {
				return err
			}
			if err := release(s, l); err != nil {
				return err
			}
		}
		return nil
	}
	backward := func(k int) error {
		if err := forward(); err != nil {
			return err
		}
		for l := m.layers - 1; l >= 0; l-- {
			si := l % 2
			s := streams[si]
			w, err := layer(s, l)
			if err != nil {
				return err
			}
			if err := s.Wait(ready[si]); err != nil { // the buffers' last read
				return err
			}
			g := bufs[si]
			if err := s.Launch(func() error {
				for j := range g {
					fill(g[j], w[j], gradKey(rank, k, 2*l+j), o.rounds)
				}
				return nil
			}); err != nil {
				return err
			}
			ev, err := e.GradsReady([]int{2*l + 1, 2 * l}, []zero.Tensor{zero.Halfs(g[1], zero.BF16), zero.Halfs(g[0], zero.BF16)}, s)
			if err != nil {
				return err
			}
			ready[si] = ev
			if err := release(s, l); err != nil {
				return err
			}
		}
		return e.EndBackward()
	}
	for range o.steps + 1 { // the first step warms up the pools
		t0 := time.Now()
		if err := step(e, mode, n, backward); err != nil {
			return err
		}
		out.walls = append(out.walls, time.Since(t0))
		ready = [2]zero.Event{} // Step synced every read; it reuses the events
	}
	out.walls = out.walls[1:]
	out.stats, out.plan = e.Stats(), e.Plan()
	out.full, err = e.FullGrads()
	return err
}

// step takes one step of n backwards in mode.
func step(e *zero.Engine, mode string, n int, backward func(k int) error) error {
	run := func(from, to int) error {
		for k := from; k < to; k++ {
			if err := backward(k); err != nil {
				return err
			}
		}
		return nil
	}
	var err error
	switch mode {
	case baseline:
		err = run(0, n)
	case noSync:
		err = e.NoSync(func() error { return run(0, n-1) })
		if err == nil {
			err = run(n-1, n) // DDP's rule: this backward reduces everything
		}
	case coalesce, coalesceBudget:
		err = e.Coalesce(func() error { return run(0, n) })
	}
	if err != nil {
		return err
	}
	return e.Step()
}

// The synthetic gradient of parameter p at rank and backward k, element i:
// hashed noise in [−1, 1) plus half the weight, rounded to bf16. It reads
// the (gathered) weight so stage 3's gathers matter, and the hash rounds
// give the backward some compute for the reductions to hide behind.
func gradKey(rank, k, p int) uint64 { return mix(uint64(rank)<<40 | uint64(k)<<20 | uint64(p)) }

func fill(g, w []uint16, key uint64, rounds int) {
	for i := range g {
		g[i] = gradElem(key, i, w[i], rounds)
	}
}

func gradElem(key uint64, i int, w uint16, rounds int) uint16 {
	return toBF16(noise(key, i, rounds) + 0.5*fromBF16(w))
}

func noise(key uint64, i, rounds int) float32 {
	h := key ^ uint64(i)
	for range rounds {
		h = mix(h)
	}
	return float32(int32(h>>32)) * 0x1p-31
}

// mix is splitmix64's finalizer.
func mix(h uint64) uint64 {
	h += 0x9e3779b97f4a7c15
	h = (h ^ h>>30) * 0xbf58476d1ce4e5b9
	h = (h ^ h>>27) * 0x94d049bb133111eb
	return h ^ h>>31
}

// touch reads every 16th element: a forward that depends on the gather.
func touch(w []uint16) float32 {
	s := float32(0)
	for i := 0; i < len(w); i += 16 {
		s += fromBF16(w[i])
	}
	return s
}

func fromBF16(b uint16) float32 { return math.Float32frombits(uint32(b) << 16) }

// toBF16 rounds to nearest even (the values here are finite).
func toBF16(f float32) uint16 {
	b := math.Float32bits(f)
	return uint16((b + 0x7fff + (b >> 16 & 1)) >> 16)
}

// maxError compares a sample of the reduced gradient with the float64 mean
// of the gradients every rank produced, recomputed here.
func maxError(m *model, full [][]float32, world, n, rounds int) float64 {
	worst := 0.0
	for p := range full {
		for i := 0; i < len(full[p]); i += 97 {
			sum, mag := 0.0, 0.0
			for r := range world {
				for k := range n {
					g := float64(fromBF16(gradElem(gradKey(r, k, p), i, m.weights[p][i], rounds)))
					sum += g
					mag += math.Abs(g)
				}
			}
			cnt := float64(world * n)
			worst = math.Max(worst, math.Abs(float64(full[p][i])-sum/cnt)/(mag/cnt))
		}
	}
	return worst
}

func printTable(w io.Writer, o options, m *model, rows []Row) {
	bucket := "one layer per bucket"
	if o.bucketBytes > 0 {
		bucket = fmt.Sprintf("%.1f MiB buckets", mib(int64(o.bucketBytes)))
	}
	ranks := fmt.Sprintf("%d ranks in one process", o.world)
	if o.mpi {
		ranks = fmt.Sprintf("%d MPI processes", o.world)
	}
	fmt.Fprintf(w, "zero demo: %s, MLP %d×%d (%.1fM params, %.1f MiB of bf16 gradient per backward), %s (%d), overlap %v, window sums %v, shard %v; %s\n\n",
		ranks, m.layers, m.hidden, float64(m.count)/1e6, mib(2*m.count), bucket, rows[0].Buckets, o.overlap, o.windowDType, o.shardDType, host())
	fmt.Fprintln(w, "| stage | mode | N | in use: peak / window / flush MiB | held: peak / window / flush MiB | pooled MiB | wall ms | exposed ms | bucket ms | collectives | payload MiB | wire MiB | gather MiB | max err |")
	fmt.Fprintln(w, "|---|---|--:|--:|--:|--:|--:|--:|--:|---|--:|--:|--:|--:|")
	for _, r := range rows {
		mark := ""
		if !r.WindowResidentMeasured {
			mark = "¹"
		}
		gather := "–"
		if r.AllGathers > 0 {
			gather = fmt.Sprintf("%.1f", mib(r.GatherPayloadBytes))
		}
		fmt.Fprintf(w, "| ZeRO-%d | %s | %d | %.1f / %.1f%s / %.1f | %.1f / %.1f%s / %.1f | %.1f | %.1f | %.1f | %.1f | %s | %.1f | %.1f | %s | %.1e |\n",
			r.Stage, r.Mode, r.N, mib(r.PeakInUseBytes), mib(r.WindowInUseBytes), mark, mib(r.FlushInUseBytes),
			mib(r.PeakBytes), mib(r.WindowResidentBytes), mark, mib(r.FlushResidentBytes), mib(r.PooledBytes),
			r.WallMs, r.ExposedMs, r.BucketMs, collectives(r), mib(r.GradPayloadBytes), mib(r.GradWireBytes), gather, r.MaxErr)
	}
	fmt.Fprintf(w, `
Per rank, for one step of N backwards; wall ms is rank 0's median of %d steps after a warm-up step. Memory is
the engine's gradient memory (the shard, local sums, bucket staging and the scratch they need): in use, as
PyTorch's memory_allocated counts tensors, and held, the pools' idle buffers included (PyTorch's cache).
Peak is over the window; window: at the end of the last backward, before the flush; flush: at Step.
¹ Baseline has no window: Step's figures stand in; the pools only grow and Step allocates nothing after the
warm-up, so they equal the last backward's end. Pooled is the idle part at Step (a window's sums are kept
for the next window until a backward begins outside one; TrimPools frees them).
Exposed: from the end of the last backward (its last gradient produced) to the end of the last reduction
(Stats.ExposedReduceTime); bucket: the last bucket's own reduction, which overlap cannot hide.
Collectives: RS reduce-scatter, AR all-reduce (one: Step's 8- or 12-byte check that every rank took N
backwards), AG stage 3's parameter all-gathers (forward and backward gather each layer; a layer released
just before its next use stays gathered). Payload and wire (ring model) are the RS and AR; gather MiB is
the AG payload. coalesce_budget: Window.BudgetBytes = half a gradient in the window's dtype; the buckets
backward produces last are local, the others reduce every backward (no effect at stage 1, whose buckets
are all local). Max err: against the float64 mean on a sample, relative to mean |g|.
`, o.steps)
}

// collectives writes a row's counts as "8 RS + 1 AR + 32 AG".
func collectives(r Row) string {
	var parts []string
	for _, c := range []struct {
		n    int64
		kind string
	}{{r.ReduceScatters, "RS"}, {r.AllReduces, "AR"}, {r.AllGathers, "AG"}} {
		if c.n > 0 {
			parts = append(parts, fmt.Sprintf("%d %s", c.n, c.kind))
		}
	}
	return strings.Join(parts, " + ")
}

// host names the CPU, from /proc/cpuinfo where there is one.
func host() string {
	name := runtime.GOARCH
	if b, err := os.ReadFile("/proc/cpuinfo"); err == nil {
		for _, line := range strings.Split(string(b), "\n") {
			if k, v, ok := strings.Cut(line, ":"); ok && strings.TrimSpace(k) == "model name" {
				name = strings.TrimSpace(v)
				break
			}
		}
	}
	return fmt.Sprintf("%s, %d CPUs", name, runtime.NumCPU())
}

func ints(s string) ([]int, error) {
	var out []int
	for _, f := range strings.Split(s, ",") {
		v, err := strconv.Atoi(strings.TrimSpace(f))
		if err != nil {
			return nil, err
		}
		out = append(out, v)
	}
	return out, nil
}

func median(x []float64) float64 {
	s := slices.Sorted(slices.Values(x))
	return (s[(len(s)-1)/2] + s[len(s)/2]) / 2
}

func mib(b int64) float64        { return float64(b) / (1 << 20) }
func ms(d time.Duration) float64 { return float64(d.Microseconds()) / 1000 }
