//go:build cuda

package zero

import (
	"fmt"
	"sync"
	"testing"
	"time"
)

// GPU benchmarks (scripts/gpu-test.sh runs them on a GPU host; elsewhere they
// skip like the tests).
//
// BenchmarkCUDAKernelBandwidth times each kernel against a device-to-device
// cudaMemcpyAsync of the same bytes (read + written), interleaved in the same
// run, and reports both bandwidths and their ratio (target ≥ 0.9).
//
// BenchmarkCUDAPipeline is the reduction pipeline at seed 000's shape: 8
// layers × hidden 4096 (8 parameters of 4096², bf16, ≈134M parameters), 4
// backwards per step, W=2 ranks in process on one GPU, for ZeRO-1/2/3; it
// reports wall ms per step (compare with seed 000's table and with
// bench/torch_pipeline.py, PyTorch eager ops on the same shape).

// gpuTime returns the device time of fn, enqueued on s, from CUDA events.
func gpuTime(b *testing.B, s Stream, fn func() error) time.Duration {
	b.Helper()
	start, err := s.Record()
	if err != nil {
		b.Fatal(err)
	}
	if err := fn(); err != nil {
		b.Fatal(err)
	}
	end, err := s.Record()
	if err != nil {
		b.Fatal(err)
	}
	d, err := Elapsed(start, end)
	if err != nil {
		b.Fatal(err)
	}
	return d
}

func BenchmarkCUDAKernelBandwidth(b *testing.B) {
	d := needCUDA(b)
	s := gpuStream(b, d)
	const n = 64 << 20 // elements per operand
	alloc := func(count int, t DType) Tensor {
		x, err := d.Alloc(count, t)
		if err != nil {
			b.Fatal(err)
		}
		b.Cleanup(func() { d.Free(x) })
		return x
	}
	bf := []Tensor{alloc(n, BF16), alloc(n, BF16)}
	f32 := []Tensor{alloc(n, FP32), alloc(n, FP32)}
	flag := alloc(1, FP32)
	copyA, copyB := alloc(8*n, BF16), alloc(8*n, BF16) // room for the largest case's bytes
	// the optimizer's shard: p, g, m, v in fp32 (f32[0], f32[1] and two more)
	// and the bf16 copy of the parameters (bf[0])
	m, v := alloc(n, FP32), alloc(n, FP32)
	adamw := optTensors{p: f32[0], g: f32[1], m: m, v: v, out: bf[0]}
	adamRange := optRange{count: int64(n)}
	AdamW{LR: 1e-3, WeightDecay: 0.01}.withDefaults().rangeFor(&adamRange, 3)
	sgdRange := optRange{count: int64(n)}
	SGD{LR: 1e-2, Momentum: 0.9}.rangeFor(&sgdRange, 3)
	var sumsq float64
	segs := func(src Tensor, parts int) []Segment {
		out := make([]Segment, parts)
		per := src.count / parts
		for i := range out {
			out[i] = Segment{Src: src.slice(i*per, per), Offset: i * per}
		}
		return out
	}
	cases := []struct {
		name  string
		bytes int // read + written
		fn    func() error
	}{
		{"flatten_bf16_prediv_8segs", 4 * n, func() error { return d.flatten(s, bf[1], segs(bf[0], 8), 0.5) }},
		{"flatten_bf16_to_f32", 6 * n, func() error { return d.flatten(s, f32[0], segs(bf[0], 8), 1) }},
		{"cast_f32_to_bf16", 6 * n, func() error { return d.cast(s, bf[0], f32[0], 1) }},
		{"accumulate_bf16_add", 10 * n, func() error {
			return d.accumulate(s, f32[0], []Segment{{Src: bf[0]}}, false, 0.25, flag)
		}},
		{"accumulate_f32_copy", 8 * n, func() error {
			return d.accumulate(s, f32[0], []Segment{{Src: f32[1]}}, true, 0.25, flag)
		}},
		// AdamW reads p, g, m, v and writes p, m, v and the bf16 copy
		{"adamw_f32_bf16out", 30 * n, func() error {
			return d.optimize(s, optAdamW, adamw, []optRange{adamRange}, 0.5)
		}},
		// SGD with momentum reads p, g, m and writes p, m and the bf16 copy
		{"sgd_momentum_f32_bf16out", 22 * n, func() error {
			return d.optimize(s, optSGD, optTensors{p: f32[0], g: f32[1], m: m, out: bf[0]}, []optRange{sgdRange}, 0.5)
		}},
		{"sumsq_f32", 4 * n, func() error { return d.sumSquares(s, f32[1], &sumsq) }},
		{"allreduce_w2_bf16", 8 * n, func() error {
			return d.allReduce(s, []uintptr{bf[0].ptr, bf[1].ptr}, BF16, OpSum, n)
		}},
		{"reduce_scatter_w2_bf16", 6 * n, func() error {
			return d.reduce(s, []uintptr{bf[0].ptr, bf[1].ptr + uintptr(n)}, []uintptr{bf[0].ptr, bf[1].ptr}, BF16, OpSum, n/2)
		}},
	}
	for _, c := range cases {
		b.Run(c.name, func(b *testing.B) {
			half := c.bytes / 2 // a copy of half the bytes reads and writes them all
			cp := func() error { return d.copy(s, copyB.slice(0, half/2), copyA.slice(0, half/2)) }
			if err := c.fn(); err != nil { // warm up
				b.Fatal(err)
			}
			var tk, tc time.Duration
			b.ResetTimer()
			for range b.N {
				tc += gpuTime(b, s, cp)
				tk += gpuTime(b, s, c.fn)
			}
			b.StopTimer()
			kbw := float64(c.bytes) * float64(b.N) / tk.Seconds() / 1e9
			cbw := float64(c.bytes) * float64(b.N) / tc.Seconds() / 1e9
			b.ReportMetric(kbw, "GB/s")
			b.ReportMetric(cbw, "copyGB/s")
			b.ReportMetric(kbw/cbw, "x_copy")
			b.SetBytes(int64(c.bytes))
		})
	}
}

// seed000Params is seed 000's model: 8 layers × hidden 4096, bf16.
func seed000Params() []Param {
	ps := make([]Param, 8)
	for i := range ps {
		ps[i] = Param{Name: fmt.Sprintf("layer%d.weight", i), Count: 4096 * 4096, DType: BF16}
	}
	return ps
}

func BenchmarkCUDAPipeline(b *testing.B) {
	d := needCUDA(b)
	const world, backwards = 2, 4
	params := seed000Params()
	for _, stage := range []int{1, 2, 3} {
		b.Run(fmt.Sprintf("ZeRO-%d", stage), func(b *testing.B) {
			comms, err := NewCUDALocalGroup(world, d)
			if err != nil {
				b.Fatal(err)
			}
			cfg := Config{Stage: stage, BucketBytes: 32 << 20, Overlap: true, PredivideFactor: world, GradAccumSteps: backwards}
			ready := make(chan error, world)
			start := make(chan struct{})
			done := make(chan error, world)
			var stats [world]Stats
			var wg sync.WaitGroup
			for rank := range world {
				wg.Add(1)
				go func() {
					defer wg.Done()
					defer comms[rank].Close()
					e, err := New(cfg, comms[rank], params)
					if err != nil {
						ready <- err
						return
					}
					defer e.Close()
					s, err := d.NewStream()
					if err != nil {
						ready <- err
						return
					}
					defer s.Close()
					grads := make([]Tensor, len(params))
					for p, q := range params {
						if grads[p], err = d.Alloc(q.Count, q.DType); err != nil {
							ready <- err
							return
						}
						defer d.Free(grads[p]) // zeros: the values do not change the time
					}
					step := func() error {
						for range backwards {
							for p := len(params) - 1; p >= 0; p-- {
								if _, err := e.GradReady(p, grads[p], s); err != nil {
									return err
								}
							}
							if err := e.EndBackward(); err != nil {
								return err
							}
						}
						return e.Step()
					}
					if err := step(); err != nil { // warm up: pools, events, first collectives
						ready <- err
						return
					}
					ready <- s.Sync()
					<-start
					for range b.N {
						if err := step(); err != nil {
							done <- err
							return
						}
					}
					stats[rank] = e.Stats()
					done <- nil
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
			b.ReportMetric(float64(el.Microseconds())/1000/float64(b.N), "ms/step")
			b.ReportMetric(float64(stats[0].PeakGradBytes)/(1<<20), "peakMiB")
			b.ReportMetric(float64(stats[0].Collectives.Total().Calls), "collectives/step")
		})
	}
}
