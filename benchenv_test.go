package zero

import (
	"errors"
	"fmt"
	"golang.org/x/sys/unix"
	"io"
	"math"
	"math/rand"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"
	"unsafe"
)

// The bodies of the benchmarks that run on either device: the host's
// in-process group (bench_test.go, bench_exposed_test.go, checkpoint_test.go,
// safetensors_test.go) and the one-GPU group (cuda_bench_test.go, which the
// GPU runner scripts/gpu-test.sh calls), so that a GPU's figures are the
// same measurement as the CPU's. Each takes a trainEnv (harness_test.go):
// the group, the callers' streams and where parameters and gradients live.

// hostBench runs the CPU benchmarks: hostTrain with the group's default
// timeout.
var hostBench = trainEnv{group: NewLocalGroup, stream: hostTrain.stream, place: hostTrain.place, fetch: hostTrain.fetch}

// ---- the exposed reduction (BenchmarkExposedReduce) ---------------------------

// gradSource makes rank's gradients of params for exposedReduceRun: its
// backward produces gradient p of step it for stream s and returns it with
// the event at which it exists (nil: it exists when backward returns); free
// releases the buffers once the engine is done with them.
type gradSource func(rank int, params []Param) (backward func(s Stream, it, p int) (Tensor, Event, error), free func(), err error)

// hashedHostGrads computes each gradient on the rank's goroutine: hashed
// bf16 noise (hashFill), about 1.5 ns per byte.
func hashedHostGrads(rank int, params []Param) (func(Stream, int, int) (Tensor, Event, error), func(), error) {
	grads := make([][]uint16, len(params))
	for i, p := range params {
		grads[i] = make([]uint16, p.Count)
	}
	return func(_ Stream, it, p int) (Tensor, Event, error) {
		hashFill(grads[p], uint64(rank)<<40|uint64(it)<<20|uint64(p))
		return Halfs(grads[p], BF16), nil, nil
	}, func() {}, nil
}

// exposedParams is an MLP of layers × (hidden² weight + hidden bias), bf16.
func exposedParams(layers, hidden int) []Param {
	var params []Param
	for l := range layers {
		params = append(params, Param{Name: fmt.Sprintf("l%d.w", l), Count: hidden * hidden, DType: BF16},
			Param{Name: fmt.Sprintf("l%d.b", l), Count: hidden, DType: BF16})
	}
	return params
}

// exposedReduceRun runs the steps BenchmarkExposedReduce describes on 2
// ranks of env's group and reports its metrics: each layer's gradients
// come from grads and are handed over together with GradsReady on the
// rank's stream; t0 is the later of the last GradsReady's return and the
// last gradient's existence.
func exposedReduceRun(b *testing.B, env trainEnv, grads gradSource, params []Param, cfg Config) {
	const world = 2
	type sample struct {
		t0, t1                time.Time // the last gradient handed over and made; the reductions' end
		stats, last, backward time.Duration
	}
	samples, floors := make([][]sample, world), make([][]sample, world)
	meet := newBarrier(world)
	bytes := int64(0)
	for _, p := range params {
		bytes += int64(p.Count * 2)
	}
	b.SetBytes(bytes)
	comms, err := env.group(world)
	if err != nil {
		b.Fatal(err)
	}
	b.ResetTimer()
	errs := eachRank(world, func(rank int) error {
		defer comms[rank].Close()
		e, err := New(cfg, comms[rank], params)
		if err != nil {
			return err
		}
		defer e.Close()
		s, err := env.stream()
		if err != nil {
			return err
		}
		defer s.Close()
		backward, free, err := grads(rank, params)
		if err != nil {
			return err
		}
		defer free()
		// step runs one backward; with floor, every bucket but the last is
		// reduced and both ranks have met before the last layer is handed
		// over, so what follows is the least exposure any overlap reaches.
		step := func(it int, floor bool) (sample, error) {
			t := time.Now()
			var t0 time.Time
			for l := len(params)/2 - 1; l >= 0; l-- {
				ps := []int{2*l + 1, 2 * l}
				gs := make([]Tensor, len(ps))
				var made Event
				for i, p := range ps {
					g, ev, err := backward(s, it, p)
					if err != nil {
						return sample{}, err
					}
					gs[i] = g
					if ev != nil {
						made = ev
					}
				}
				if floor && l == 0 {
					if err := e.pl.sync(); err != nil {
						return sample{}, err
					}
					meet.wait()
				}
				if _, err := e.GradsReady(ps, gs, s); err != nil {
					return sample{}, err
				}
				if l == 0 && made != nil { // the backward's end on the device
					if err := made.Sync(); err != nil {
						return sample{}, err
					}
				}
				t0 = time.Now()
			}
			if err := e.EndBackward(); err != nil {
				return sample{}, err
			}
			if err := e.pl.sync(); err != nil {
				return sample{}, err
			}
			t1 := time.Now()
			if err := e.Step(); err != nil {
				return sample{}, err
			}
			st := e.Stats()
			return sample{t0, t1, st.ExposedReduceTime, st.LastReduceTime, t0.Sub(t)}, nil
		}
		for it := range b.N + 1 { // the first step warms the pools
			sm, err := step(it, false)
			if err != nil {
				return err
			}
			fl, err := step(it, true)
			if err != nil {
				return err
			}
			if it > 0 {
				samples[rank] = append(samples[rank], sm)
				floors[rank] = append(floors[rank], fl)
			}
		}
		return s.Sync()
	})
	b.StopTimer()
	for _, err := range errs {
		if err != nil {
			b.Fatal(err)
		}
	}
	// The group's exposure: the reductions cannot end before the last rank
	// has ended its backward, so it runs from the later t0 to the later t1.
	group := func(all [][]sample) []float64 {
		var out []float64
		for i := range all[0] {
			var t0, t1 time.Time
			for r := range all {
				if s := all[r][i]; s.t0.After(t0) {
					t0 = s.t0
				}
				if s := all[r][i]; s.t1.After(t1) {
					t1 = s.t1
				}
			}
			out = append(out, float64(t1.Sub(t0).Microseconds())/1000)
		}
		return out
	}
	walls, floorWalls := group(samples), group(floors)
	median := func(x []float64) float64 {
		sort.Float64s(x)
		return (x[(len(x)-1)/2] + x[len(x)/2]) / 2
	}
	med := func(f func(sample) time.Duration) float64 {
		var x []float64
		for _, r := range samples {
			for _, s := range r {
				x = append(x, float64(f(s).Microseconds())/1000)
			}
		}
		return median(x)
	}
	wall, last := median(walls), med(func(s sample) time.Duration { return s.last })
	b.ReportMetric(wall, "exposed-ms")
	b.ReportMetric(med(func(s sample) time.Duration { return s.stats }), "stats-exposed-ms")
	b.ReportMetric(last, "bucket-ms")
	b.ReportMetric(wall/last, "x-bucket")
	floor := median(floorWalls)
	b.ReportMetric(floor, "floor-ms")
	b.ReportMetric(wall/floor, "x-floor")
	b.ReportMetric(med(func(s sample) time.Duration { return s.backward }), "backward-ms")
}

// barrier holds n goroutines until all have arrived, again and again.
type barrier struct {
	mu     sync.Mutex
	cond   *sync.Cond
	n, in  int
	rounds int
}

func newBarrier(n int) *barrier {
	b := &barrier{n: n}
	b.cond = sync.NewCond(&b.mu)
	return b
}

func (b *barrier) wait() {
	b.mu.Lock()
	defer b.mu.Unlock()
	round := b.rounds
	if b.in++; b.in == b.n {
		b.in, b.rounds = 0, b.rounds+1
		b.cond.Broadcast()
		return
	}
	for round == b.rounds {
		b.cond.Wait()
	}
}

// hashFill writes hashed bf16 noise in [−1, 1): the backward's compute.
func hashFill(g []uint16, key uint64) {
	for i := range g {
		h := key ^ uint64(i)
		h = (h ^ h>>30) * 0xbf58476d1ce4e5b9
		h = (h ^ h>>27) * 0x94d049bb133111eb
		g[i] = uint16(0x3f80|uint16(h>>57)) ^ uint16(h>>48)&0x807f
	}
}

// ---- the norm summed by the landing (BenchmarkNormInLanding) --------------------

// placer places host buffers with env on a stream of its own and frees
// them all at once.
type placer struct {
	env   trainEnv
	s     Stream
	frees []func()
}

func newPlacer(env trainEnv) (*placer, error) {
	s, err := env.stream()
	if err != nil {
		return nil, err
	}
	return &placer{env: env, s: s}, nil
}

// place returns memory of env's holding buf's elements once done returns.
func (p *placer) place(buf *tbuf) (Tensor, error) {
	x, free, err := p.env.place(p.s, buf)
	if err == nil {
		p.frees = append(p.frees, free)
	}
	return x, err
}

// done waits for the placements.
func (p *placer) done() error { return p.s.Sync() }

// close frees every placement and the stream; the engines that used them
// are closed.
func (p *placer) close() {
	for _, f := range p.frees {
		f()
	}
	p.s.Close()
}

// normInLandingRun runs BenchmarkNormInLanding's steps on env: 2 ranks,
// 8 layers of hidden² bf16 parameters, ZeRO-2 with AdamW, 2 backwards a
// step, the boundary unknown and known.
func normInLandingRun(b *testing.B, env trainEnv, hidden int) {
	const world, layers, backwards = 2, 8, 2
	pl, err := newPlacer(env)
	if err != nil {
		b.Fatal(err)
	}
	defer pl.close()
	var params []Param
	for l := range layers {
		data, err := pl.place(newTBuf(BF16, hidden*hidden))
		if err != nil {
			b.Fatal(err)
		}
		params = append(params, Param{Name: fmt.Sprint("w", l), Count: hidden * hidden, DType: BF16, Data: data})
	}
	rng := rand.New(rand.NewSource(1))
	grads := make([][]Tensor, world)
	for r := range grads {
		for _, p := range params {
			g := newTBuf(BF16, p.Count)
			for i := range g.h {
				g.h[i] = bf16FromFloat(float32(rng.NormFloat64()))
			}
			x, err := pl.place(g)
			if err != nil {
				b.Fatal(err)
			}
			grads[r] = append(grads[r], x)
		}
	}
	if err := pl.done(); err != nil {
		b.Fatal(err)
	}
	for _, known := range []bool{false, true} {
		b.Run(fmt.Sprintf("boundary-known=%v", known), func(b *testing.B) {
			accum := 0
			if known {
				accum = backwards
			}
			comms, err := env.group(world)
			if err != nil {
				b.Fatal(err)
			}
			engines := make([]*Engine, world)
			streams := make([]Stream, world)
			for r, err := range eachRank(world, func(r int) error {
				var err error
				cfg := Config{Stage: 2, BucketBytes: 8 << 20, Grads: GradPolicy{AccumSteps: accum},
					Optimizer: OptimizerPolicy{Clip: 1, Groups: []Optimizer{NewAdamW(1e-4)}}}
				if engines[r], err = New(cfg, comms[r], params); err != nil {
					return err
				}
				streams[r], err = env.stream()
				return err
			}) {
				if err != nil {
					b.Fatalf("rank %d: %v", r, err)
				}
			}
			defer func() {
				for r := range world {
					if engines[r] != nil {
						engines[r].Close()
					}
					if streams[r] != nil {
						streams[r].Close()
					}
					comms[r].Close()
				}
			}()
			shard := int64(engines[0].pl.gradShard().Bytes())
			b.SetBytes(shard)
			var stepTime time.Duration
			var read int64
			b.ResetTimer()
			for range b.N {
				for r, err := range eachRank(world, func(r int) error {
					e := engines[r]
					for range backwards {
						for p := len(params) - 1; p >= 0; p-- {
							if _, err := e.GradReady(p, grads[r][p], streams[r]); err != nil {
								return err
							}
						}
						if err := e.EndBackward(); err != nil {
							return err
						}
					}
					start := time.Now()
					err := e.Step()
					if r == 0 {
						stepTime += time.Since(start)
						read += e.Stats().NormReadBytes
					}
					return err
				}) {
					if err != nil {
						b.Fatalf("rank %d: %v", r, err)
					}
				}
			}
			b.StopTimer()
			b.ReportMetric(float64(read)/float64(b.N)/(1<<20), "normReadMiB/step")
			b.ReportMetric(1+float64(read)/float64(b.N)/float64(shard), "shardReads/step")
			b.ReportMetric(float64(stepTime.Microseconds())/1000/float64(b.N), "stepMs")
		})
	}
}

// ---- checkpoints (BenchmarkCheckpoint) ---------------------------------------------

// checkpointRun runs BenchmarkCheckpoint on one rank of env's group, the
// parameters placed by env.
func checkpointRun(b *testing.B, env trainEnv) {
	elems := 4 << 20
	if v, err := strconv.Atoi(os.Getenv("ZERO_BENCH_CKPT_ELEMS")); err == nil && v > 0 {
		elems = v
	}
	root, err := os.MkdirTemp(os.Getenv("ZERO_BENCH_DIR"), "zero-ckpt-bench")
	if err != nil {
		b.Fatal(err)
	}
	defer os.RemoveAll(root)
	comms, err := env.group(1)
	if err != nil {
		b.Fatal(err)
	}
	defer comms[0].Close()
	pl, err := newPlacer(env)
	if err != nil {
		b.Fatal(err)
	}
	defer pl.close()
	sizes := []int{elems / 2, elems / 4, elems / 4}
	ps := make([]Param, len(sizes))
	for p, n := range sizes {
		data, err := pl.place(newTBuf(FP32, n))
		if err != nil {
			b.Fatal(err)
		}
		ps[p] = Param{Name: fmt.Sprint("w", p), Count: n, DType: FP32, Data: data}
	}
	if err := pl.done(); err != nil {
		b.Fatal(err)
	}
	e, err := New(Config{Stage: 2, BucketBytes: 32 << 20, Optimizer: OptimizerPolicy{Groups: []Optimizer{NewAdamW(1e-3)}}}, comms[0], ps)
	if err != nil {
		b.Fatal(err)
	}
	defer e.Close()
	dir := filepath.Join(root, "ckpt")
	if err := e.Save(dir, SaveOptions{Keep: 1}); err != nil { // allocates the moments' files once
		b.Fatal(err)
	}
	bytes := int64(0)
	filepath.WalkDir(dir, func(p string, d os.DirEntry, err error) error {
		if err == nil && strings.HasSuffix(p, ".bin") {
			st, _ := os.Stat(p)
			bytes += st.Size()
		}
		return nil
	})
	plain := filepath.Join(root, "plain")
	buf, dst := make([]byte, ckptChunk), make([]byte, bytes)
	var tSave, tLoad, tWrite, tRead []time.Duration
	var allocSave, allocLoad uint64
	timed := func(into *[]time.Duration, f func() error) {
		t0 := time.Now()
		if err := f(); err != nil {
			b.Fatal(err)
		}
		*into = append(*into, time.Since(t0))
	}
	b.SetBytes(bytes)
	b.ResetTimer()
	for range b.N {
		a := heapAllocated()
		timed(&tSave, func() error { return e.Save(dir, SaveOptions{Keep: 1}) })
		allocSave += heapAllocated() - a
		if err := dropCache(dir); err != nil {
			b.Fatal(err)
		}
		a = heapAllocated()
		timed(&tLoad, func() error { _, err := e.Load(dir, LoadOptions{}); return err })
		allocLoad += heapAllocated() - a
		timed(&tWrite, func() error { return writePlain(plain, buf, bytes) })
		if err := dropCache(plain); err != nil {
			b.Fatal(err)
		}
		timed(&tRead, func() error { return readPlain(plain, dst) })
	}
	median := func(d []time.Duration) float64 {
		s := slices.Clone(d)
		slices.Sort(s)
		return s[len(s)/2].Seconds()
	}
	mbs := func(d []time.Duration) float64 { return float64(bytes) / median(d) / 1e6 }
	b.ReportMetric(mbs(tSave), "save-MB/s")
	b.ReportMetric(mbs(tLoad), "load-MB/s")
	b.ReportMetric(mbs(tWrite), "write-MB/s")
	b.ReportMetric(mbs(tRead), "read-MB/s")
	b.ReportMetric(median(tWrite)/median(tSave), "x-write")
	b.ReportMetric(median(tRead)/median(tLoad), "x-read")
	b.ReportMetric(float64(allocSave)/float64(b.N)/(1<<20), "save-extra-MiB")
	b.ReportMetric(float64(allocLoad)/float64(b.N)/(1<<20), "load-extra-MiB")
	b.ReportMetric(float64(bytes)/(1<<20), "state-MiB")
}

// writePlain writes n bytes beside name in pieces of buf, fsynced, and
// renames the file over name (the directory fsynced).
func writePlain(name string, buf []byte, n int64) error {
	f, err := os.Create(name + ".new")
	if err != nil {
		return err
	}
	for off := int64(0); off < n; off += int64(len(buf)) {
		if _, err := f.Write(buf[:min(int64(len(buf)), n-off)]); err != nil {
			f.Close()
			return err
		}
	}
	if err := f.Sync(); err != nil {
		f.Close()
		return err
	}
	if err := f.Close(); err != nil {
		return err
	}
	if err := os.Rename(name+".new", name); err != nil {
		return err
	}
	return osFS{}.SyncDir(filepath.Dir(name))
}

// readPlain reads name front to back into dst, in pieces of 8 MiB: the
// bytes land in memory of their size, as a load's land in the state.
func readPlain(name string, dst []byte) error {
	f, err := os.Open(name)
	if err != nil {
		return err
	}
	defer f.Close()
	for off := 0; off < len(dst); {
		n, err := f.Read(dst[off:min(off+ckptChunk, len(dst))])
		off += n
		if err == io.EOF {
			return nil
		} else if err != nil {
			return err
		}
	}
	return nil
}

// dropCache asks the kernel to drop the cached pages of every file under
// path (they are fsynced), so the next read comes from the disk.
func dropCache(path string) error {
	return filepath.WalkDir(path, func(p string, d os.DirEntry, err error) error {
		if err != nil || d.IsDir() {
			return err
		}
		f, err := os.Open(p)
		if err != nil {
			return err
		}
		defer f.Close()
		return unix.Fadvise(int(f.Fd()), 0, 0, unix.FADV_DONTNEED)
	})
}

// ---- safetensors (BenchmarkSafetensors) ------------------------------------------

// safetensorsRun runs BenchmarkSafetensors on 2 ranks of env's group; dev
// is its engines' device, where the import puts the parameters.
func safetensorsRun(b *testing.B, env trainEnv, dev Device) {
	elems := 4 << 20
	if v, err := strconv.Atoi(os.Getenv("ZERO_BENCH_ST_ELEMS")); err == nil && v > 0 {
		elems = v
	}
	const world = 2
	sizes := []int{elems / 2, elems / 4, elems/4 - 3, 3}
	params := func() []Param {
		ps := make([]Param, len(sizes))
		for p, n := range sizes {
			ps[p] = Param{Name: fmt.Sprint("layer", p), Count: n, DType: FP32, Init: func(dst []float32, off int) error {
				for i := range dst {
					dst[i] = float32(off+i) * 1e-6
				}
				return nil
			}}
		}
		return ps
	}
	dir := b.TempDir()
	file := filepath.Join(dir, "model.safetensors")
	cfg := Config{Stage: 3, BucketBytes: 32 << 20, Optimizer: OptimizerPolicy{Groups: []Optimizer{NewAdamW(1e-3)}}}
	size := func() float64 {
		st, err := os.Stat(file)
		if err != nil {
			b.Fatal(err)
		}
		return float64(st.Size())
	}
	// engines for cfg with offload, and a function that closes them
	build := func(offload bool) ([]*Engine, func()) {
		cfg := cfg
		cfg.Offload.Optimizer = offload
		comms, err := env.group(world)
		if err != nil {
			b.Fatal(err)
		}
		engines := make([]*Engine, world)
		err = errors.Join(eachRank(world, func(r int) error {
			var err error
			engines[r], err = New(cfg, comms[r], params())
			return err
		})...)
		done := func() {
			for r, e := range engines {
				if e != nil {
					e.Close()
				}
				comms[r].Close()
			}
		}
		if err != nil {
			done()
			b.Fatal(err)
		}
		return engines, done
	}
	export := func(engines []*Engine) error {
		return errors.Join(eachRank(world, func(r int) error {
			return engines[r].ExportSafetensors(file, ExportOptions{Optimizer: true})
		})...)
	}
	engines, done := build(false) // the file the import reads
	err := export(engines)
	done()
	if err != nil {
		b.Fatal(err)
	}
	for _, offload := range []bool{false, true} {
		b.Run(fmt.Sprintf("export/offload=%v", offload), func(b *testing.B) {
			engines, done := build(offload)
			defer done()
			var heap uint64
			b.ResetTimer()
			for range b.N {
				a := heapAllocated()
				if err := export(engines); err != nil {
					b.Fatal(err)
				}
				heap += heapAllocated() - a
			}
			b.StopTimer()
			b.SetBytes(int64(size()))
			b.ReportMetric(float64(heap)/float64(b.N)/world/(1<<20), "extra-MiB/rank")
			b.ReportMetric(float64(sizes[0])*4/(1<<20), "param-MiB")
		})
	}
	b.Run("import", func(b *testing.B) {
		var heap uint64
		for range b.N {
			comms, err := env.group(world)
			if err != nil {
				b.Fatal(err)
			}
			a := heapAllocated()
			engines := make([]*Engine, world)
			err = errors.Join(eachRank(world, func(r int) error {
				ps := params()
				for p := range ps {
					ps[p].Init = nil
				}
				if err := ImportSafetensors(file, cfg, dev, ps, ImportOptions{}); err != nil {
					return err
				}
				var err error
				engines[r], err = New(Config{Stage: 3, BucketBytes: cfg.BucketBytes}, comms[r], ps)
				return err
			})...)
			heap += heapAllocated() - a
			for r, e := range engines {
				if e != nil {
					e.Close()
				}
				comms[r].Close()
			}
			if err != nil {
				b.Fatal(err)
			}
		}
		b.SetBytes(int64(elems) * 4) // the parameters it reads, not the optimizer state beside them
		b.ReportMetric(float64(heap)/float64(b.N)/world/(1<<20), "extra-MiB/rank")
		b.ReportMetric(float64(sizes[0])*4/(1<<20), "param-MiB")
	})
}

// ---- the offload benchmarks ----------------------------------------------------

// offloadBench is a model and a backward for benchOffloadStep: layers ×
// (hidden² + hidden) bf16 parameters on world ranks of group; param makes a
// parameter's memory, backward enqueues on s the compute that writes layer
// gradient p's n elements and returns them; setup (optional) runs for every
// rank and parameter before the ranks start.
type offloadBench struct {
	world, layers, hidden, backwards int
	group                            func(n int) ([]Comm, error)
	stream                           func() (Stream, error)
	param                            func(n int) (Tensor, error)
	backward                         func(s Stream, rank, k, p, n int) (Tensor, error)
	setup                            func(rank, p, n int)
}

// benchOffloadStep times ZeRO-2 AdamW steps of m without and with offload
// and reports the metrics that BenchmarkOffloadStep (bench_test.go) lists.
func benchOffloadStep(b *testing.B, m offloadBench) {
	var params []Param
	for range m.layers {
		params = append(params, Param{Count: m.hidden * m.hidden, DType: BF16}, Param{Count: m.hidden, DType: BF16})
	}
	for _, offload := range []bool{false, true} {
		b.Run(fmt.Sprintf("offload=%v", offload), func(b *testing.B) {
			comms, err := m.group(m.world)
			if err != nil {
				b.Fatal(err)
			}
			engines := make([]*Engine, m.world)
			streams := make([]Stream, m.world)
			cfgs := make([][]Param, m.world)
			for r := range m.world {
				cfgs[r] = append([]Param(nil), params...)
				for p := range cfgs[r] {
					if cfgs[r][p].Data, err = m.param(params[p].Count); err != nil {
						b.Fatal(err)
					}
					if m.setup != nil {
						m.setup(r, p, params[p].Count)
					}
				}
			}
			var wg sync.WaitGroup
			for r := range m.world {
				wg.Add(1)
				go func() {
					defer wg.Done()
					var err error
					// a layer (weight and bias) a bucket
					engines[r], err = New(Config{Stage: 2, BucketBytes: (m.hidden*m.hidden + m.hidden) * 2, Overlap: true, Optimizer: OptimizerPolicy{Groups: []Optimizer{with(NewAdamW(1e-4), func(o *AdamW) { o.WeightDecay = 0.01 })}}, Offload: OffloadPolicy{Optimizer: offload}}, comms[r], cfgs[r])
					if err == nil {
						streams[r], err = m.stream()
					}
					if err != nil {
						b.Error(err)
					}
				}()
			}
			wg.Wait()
			defer func() {
				for r := range m.world {
					if engines[r] != nil {
						engines[r].Close()
					}
					if streams[r] != nil {
						streams[r].Close()
					}
					comms[r].Close()
				}
			}()
			if b.Failed() {
				return
			}
			step := func() {
				for r := range m.world {
					wg.Add(1)
					go func() {
						defer wg.Done()
						e, s := engines[r], streams[r]
						for k := range m.backwards {
							for p := len(params) - 1; p >= 0; p-- {
								g, err := m.backward(s, r, k, p, params[p].Count)
								if err == nil {
									_, err = e.GradReady(p, g, s)
								}
								if err != nil {
									b.Error(err)
									return
								}
							}
							if err := e.EndBackward(); err != nil {
								b.Error(err)
								return
							}
						}
						if err := e.Step(); err != nil {
							b.Error(err)
						}
					}()
				}
				wg.Wait()
			}
			step() // the first step allocates the moments
			var opt, gradCopy, exposed, paramCopy time.Duration
			b.ResetTimer()
			start := time.Now()
			for range b.N {
				step()
				st := engines[0].Stats()
				opt += st.OptimizerTime
				gradCopy += st.GradCopyTime
				exposed += st.GradCopyExposed
				paramCopy += st.ParamCopyTime
			}
			elapsed := time.Since(start)
			b.StopTimer()
			if b.Failed() {
				return
			}
			n := float64(b.N)
			shard := engines[0].Plan().ShardElems
			b.ReportMetric(elapsed.Seconds()*1e3/n, "step_ms")
			b.ReportMetric(opt.Seconds()*1e3/n, "optimizer_ms")
			b.ReportMetric(30*float64(shard)*n/opt.Seconds()/1e9, "adamw-GB/s")
			if offload || engines[0].dev == CPU() {
				b.ReportMetric(30*float64(shard)/yardOptSeconds(shard, m.world)/1e9, "yard-GB/s")
			}
			if offload {
				st := engines[0].Stats()
				b.ReportMetric(gradCopy.Seconds()*1e3/n, "grad_copy_ms")
				b.ReportMetric(1-float64(exposed)/float64(gradCopy), "copy_hidden")
				b.ReportMetric(paramCopy.Seconds()*1e3/n, "param_copy_ms")
				// the copies' speed: every backward lands each bucket's
				// reduced part (the shard, in the bf16 wire dtype); the step
				// sends the shard's new bf16 parameters back (its padding,
				// under 64 elements a bucket, counted too)
				wire := float64(m.backwards*shard*BF16.Size()) * n
				b.ReportMetric(wire/gradCopy.Seconds()/1e9, "grad_copy-GB/s")
				b.ReportMetric(float64(shard*BF16.Size())*n/paramCopy.Seconds()/1e9, "param_copy-GB/s")
				b.ReportMetric(float64(st.HostBytes)/(1<<20), "host_MiB")
				b.ReportMetric(float64(st.HostPinnedBytes)/float64(st.HostBytes), "pinned_share")
				b.ReportMetric(float64(st.DeviceBytesSaved)/(1<<20), "saved_MiB")
				b.ReportMetric(float64(len(engines[0].Plan().Buckets)), "buckets")
			}
		})
	}
}

// yardOptSeconds times yardOptPass over fresh fp32 buffers of n elements
// (p, g, m, v, staggered by 4 KiB + 64 B) and a bf16 out, on both cores,
// for ranks ranks at once as the engines' passes run: the best of 3.
func yardOptSeconds(n, ranks int) float64 {
	const stagger = 1040
	all := make([][]float32, ranks)
	out := make([][]uint16, ranks)
	for r := range ranks {
		all[r], out[r] = make([]float32, 4*(n+stagger)), make([]uint16, n)
	}
	best := math.Inf(1)
	for range 3 {
		t0 := time.Now()
		var wg sync.WaitGroup
		for r := range ranks {
			wg.Add(1)
			go func() {
				defer wg.Done()
				at := func(k int) uintptr { return uintptr(unsafe.Pointer(&all[r][k*(n+stagger)])) }
				parallelRange(n, func(lo, hi int) {
					yardstick(yardOptPass, uintptr(unsafe.Pointer(&out[r][0])), at(0), at(1), at(2), at(3), lo, hi)
				})
			}()
		}
		wg.Wait()
		best = min(best, time.Since(t0).Seconds())
	}
	runtime.KeepAlive(all)
	runtime.KeepAlive(out)
	return best
}

// ---- the parameter offload benchmarks ---------------------------------------------

// layerParams is a model of layers bf16 weights of hidden² each: seed
// 000's at 8 × 4096 (134M parameters, a layer a 32 MiB bucket).
func layerParams(layers, hidden int) []Param {
	ps := make([]Param, layers)
	for i := range ps {
		ps[i] = Param{Name: fmt.Sprintf("layer%d.weight", i), Count: hidden * hidden, DType: BF16}
	}
	return ps
}

// benchParamOffloadStep times stage-3 AdamW steps of params on world ranks
// of env, with the parameter shard on the device and in page-locked host
// memory (Offload.Params), the optimizer on the device: each step takes
// backwards backwards, each layer gathered for its forward and released,
// then gathered again in backward (in reverse) while its gradient is
// handed over, and released. It reports per step the wall ms, the gathers'
// time (Stats.ParamGatherTime, copies included), and from rank 0's Stats
// the device bytes the engine holds (PeakParamBytes, PeakGradBytes,
// OptimizerBytes, ControlBytes), the parameter shard's on the device and
// on the host, and the host's page-locked bytes.
func benchParamOffloadStep(b *testing.B, env trainEnv, params []Param, world, backwards int) {
	for _, onHost := range []bool{false, true} {
		b.Run(fmt.Sprintf("offload-params=%v", onHost), func(b *testing.B) {
			comms, err := env.group(world)
			if err != nil {
				b.Fatal(err)
			}
			cfg := Config{Stage: 3, BucketBytes: 32 << 20, Overlap: true, Offload: OffloadPolicy{Params: onHost},
				Optimizer: OptimizerPolicy{Groups: []Optimizer{NewAdamW(1e-4)}}}
			ready, start, done := make(chan error, world), make(chan struct{}), make(chan error, world)
			stats := make([]Stats, world)
			var wg sync.WaitGroup
			for rank := range world {
				wg.Add(1)
				go func() {
					defer wg.Done()
					defer comms[rank].Close()
					fail := func(err error) { ready <- err }
					s, err := env.stream()
					if err != nil {
						fail(err)
						return
					}
					defer s.Close()
					ps := append([]Param(nil), params...)
					grads := make([]Tensor, len(ps))
					for p, q := range ps {
						w, g := newTBuf(q.DType, q.Count), newTBuf(q.DType, q.Count)
						for i := range g.len() {
							w.set(i, float32(i%251)/251-0.5)
							g.set(i, float32(i%7)/64-0.05)
						}
						var freeW, freeG func()
						if ps[p].Data, freeW, err = env.place(s, w); err == nil {
							defer freeW()
							grads[p], freeG, err = env.place(s, g)
						}
						if err != nil {
							fail(err)
							return
						}
						defer freeG()
					}
					if err := s.Sync(); err != nil {
						fail(err)
						return
					}
					e, err := New(cfg, comms[rank], ps)
					if err != nil {
						fail(err)
						return
					}
					defer e.Close()
					gather := func(p int) error {
						if _, err := e.Gather(s, p); err != nil {
							return err
						}
						return e.Release(s, p)
					}
					step := func() error {
						for range backwards {
							for p := range ps {
								if err := gather(p); err != nil {
									return err
								}
							}
							for p := len(ps) - 1; p >= 0; p-- {
								if _, err := e.Gather(s, p); err != nil {
									return err
								}
								if _, err := e.GradReady(p, grads[p], s); err != nil {
									return err
								}
								if err := e.Release(s, p); err != nil {
									return err
								}
							}
							if err := e.EndBackward(); err != nil {
								return err
							}
						}
						return e.Step()
					}
					if err := step(); err != nil { // the first step allocates the moments and learns the order
						fail(err)
						return
					}
					ready <- s.Sync()
					<-start
					var gathers time.Duration
					for range b.N {
						if err := step(); err != nil {
							done <- err
							return
						}
						gathers += e.Stats().ParamGatherTime
					}
					stats[rank] = e.Stats()
					stats[rank].ParamGatherTime = gathers / time.Duration(b.N)
					done <- s.Sync()
				}()
			}
			for range world {
				if err := <-ready; err != nil {
					close(start)
					wg.Wait()
					b.Fatal(err)
				}
			}
			b.ResetTimer()
			t0 := time.Now()
			close(start)
			for range world {
				if err := <-done; err != nil {
					b.Fatal(err)
				}
			}
			el := time.Since(t0)
			b.StopTimer()
			wg.Wait()
			st, mib := stats[0], func(x int64) float64 { return float64(x) / (1 << 20) }
			b.ReportMetric(float64(el.Microseconds())/1000/float64(b.N), "ms/step")
			b.ReportMetric(float64(st.ParamGatherTime.Microseconds())/1000, "gather-ms")
			b.ReportMetric(mib(st.PeakParamBytes+st.PeakGradBytes+st.OptimizerBytes+st.ControlBytes), "device-MiB")
			b.ReportMetric(mib(st.ParamShardBytes), "device-shard-MiB")
			b.ReportMetric(mib(st.HostParamBytes), "host-shard-MiB")
			b.ReportMetric(mib(st.HostBytes), "host-MiB")
		})
	}
}
