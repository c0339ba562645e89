package zero

import (
	"fmt"
	"os"
	"sort"
	"sync"
	"testing"
	"time"
)

// BenchmarkExposedReduce measures, on the wall clock and apart from Stats,
// the time from the return of a step's last GradReady to the end of its
// last reduction, beside the engine's own figures (Stats.ExposedReduceTime,
// Stats.LastReduceTime). Two in-process ranks run an MLP's backward: each
// layer's gradient is computed on the rank's goroutine (a hash per
// element, about 1.5 ns per byte of bf16 gradient), then handed over with
// GradsReady on an idle stream, so the gradient exists when GradReady is
// called and t0 is the backward's true end. ZeRO-2, Overlap, one backward
// per step. Shapes: the demo's (8 × 1024²) and seed 000's (8 × 4096²,
// ZERO_BENCH_SEED000=1: 256 MiB of gradient per rank and backward);
// buckets of one layer, a quarter of one and two, and 2 or 4 staging
// buffers. Reported per step (medians over the steps):
//
//	exposed-ms       wall clock, from the later rank's last GradReady return to
//	                 the later rank's end of its reductions
//	stats-exposed-ms Stats.ExposedReduceTime
//	bucket-ms        Stats.LastReduceTime, the last bucket's reduction
//	x-bucket         exposed-ms / bucket-ms
//	floor-ms         exposed-ms of a step whose other buckets were reduced and
//	                 whose ranks met before the last layer: the last bucket's
//	                 whole handling (its copy, reduction and handoffs), the
//	                 least exposure any overlap reaches
//	x-floor          exposed-ms / floor-ms (target ≤ 1.2)
//	backward-ms      wall clock of the backward up to the last GradReady's return
func BenchmarkExposedReduce(b *testing.B) {
	shapes := []struct {
		name           string
		layers, hidden int
	}{{"demo", 8, 1024}}
	if os.Getenv("ZERO_BENCH_SEED000") != "" {
		shapes = append(shapes, struct {
			name           string
			layers, hidden int
		}{"seed000", 8, 4096})
	}
	for _, sh := range shapes {
		var params []Param
		for l := range sh.layers {
			params = append(params, Param{Name: fmt.Sprintf("l%d.w", l), Count: sh.hidden * sh.hidden, DType: BF16},
				Param{Name: fmt.Sprintf("l%d.b", l), Count: sh.hidden, DType: BF16})
		}
		layer := 2 * (sh.hidden*sh.hidden + sh.hidden + 64)
		for _, v := range []struct {
			name    string
			bucket  int
			staging int
		}{{"layer", layer, 2}, {"layer", layer, 4}, {"quarter", layer / 4, 2}, {"two", 2 * layer, 2}} {
			b.Run(fmt.Sprintf("%s/bucket=%s/staging=%d", sh.name, v.name, v.staging), func(b *testing.B) {
				exposedReduceRun(b, params, Config{Stage: 2, BucketBytes: v.bucket, Overlap: true, StagingBuffers: v.staging})
			})
		}
	}
}

func exposedReduceRun(b *testing.B, params []Param, cfg Config) {
	const world = 2
	type sample struct {
		t0, t1                time.Time // the last GradReady's return; the reductions' end
		stats, last, backward time.Duration
	}
	samples, floors := make([][]sample, world), make([][]sample, world)
	meet := newBarrier(world)
	bytes := int64(0)
	for _, p := range params {
		bytes += int64(p.Count * 2)
	}
	b.SetBytes(bytes)
	comms, err := NewLocalGroup(world)
	if err != nil {
		b.Fatal(err)
	}
	b.ResetTimer()
	errs := eachRank(world, func(rank int) error {
		e, err := New(cfg, comms[rank], params)
		if err != nil {
			return err
		}
		defer e.Close()
		s := NewHostStream()
		defer s.Close()
		grads := make([][]uint16, len(params))
		for i, p := range params {
			grads[i] = make([]uint16, p.Count)
		}
		// step runs one backward; with floor, every bucket but the last is
		// reduced and both ranks have met before the last layer is handed
		// over, so what follows is the least exposure any overlap reaches.
		step := func(it int, floor bool) (sample, error) {
			t := time.Now()
			var t0 time.Time
			for l := len(params)/2 - 1; l >= 0; l-- {
				for _, p := range []int{2*l + 1, 2 * l} {
					hashFill(grads[p], uint64(rank)<<40|uint64(it)<<20|uint64(p))
				}
				if floor && l == 0 {
					if err := e.pl.sync(); err != nil {
						return sample{}, err
					}
					meet.wait()
				}
				if _, err := e.GradsReady([]int{2*l + 1, 2 * l}, []Tensor{Halfs(grads[2*l+1], BF16), Halfs(grads[2*l], BF16)}, s); err != nil {
					return sample{}, err
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
		return nil
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
