//go:build cuda

package zero

import (
	"fmt"
	"os"
	"sync"
	"testing"
	"time"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
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
	with(NewAdamW(1e-3), func(o *AdamW) { o.WeightDecay = 0.01 }).rangeFor(&adamRange, 3)
	sgdRange := optRange{count: int64(n)}
	with(NewSGD(1e-2), func(o *SGD) { o.Momentum = 0.9 }).rangeFor(&sgdRange, 3)
	var sumsq float64
	// the norm's chunk sums of a shard of n elements, their total and its
	// host copy: what shardNorm.squares does for a one-bucket shard
	parts, outs := alloc(2*chunksOf(n), FP32), alloc(2, FP32)
	whole := []chunkRange{{0, chunksOf(n)}}
	host := make([]float32, 2)
	norm := func(x Tensor) error {
		if err := d.chunkSquares(s, x, parts); err != nil {
			return err
		}
		if err := d.sumChunks(s, parts, whole, outs); err != nil {
			return err
		}
		return d.copy(s, Float32s(host), outs) // pageable: done when it returns
	}
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
		// the landing of a step's last reduction with its squares: the same
		// bytes from memory (the squares are read back from L2)
		{"accumulate_bf16_add_squares", 10 * n, func() error {
			return d.accumulateSquares(s, f32[0], Segment{Src: bf[0]}, false, 0.25, flag, parts)
		}},
		{"accumulate_f32_add", 12 * n, func() error {
			return d.accumulate(s, f32[0], []Segment{{Src: f32[1]}}, false, 0.25, flag)
		}},
		{"accumulate_f32_add_squares", 12 * n, func() error {
			return d.accumulateSquares(s, f32[0], Segment{Src: f32[1]}, false, 0.25, flag, parts)
		}},
		{"accumulate_bf16_into_bf16_add", 6 * n, func() error {
			return d.accumulate(s, bf[1], []Segment{{Src: bf[0]}}, false, 0.25, flag)
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
		// the norm of a shard no landing summed: its chunks read once (a
		// 16-bit shard as it is), their sums added, the total read back
		{"norm_chunks_f32", 4 * n, func() error { return norm(f32[1]) }},
		{"norm_chunks_bf16", 2 * n, func() error { return norm(bf[0]) }},
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
			cfg := Config{Stage: stage, BucketBytes: 32 << 20, Overlap: true, Grads: GradPolicy{PredivideFactor: world, AccumSteps: backwards}}
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
			// what backward left of the reductions, beside one bucket's
			// reduction (the floor overlap can reach), on the card
			b.ReportMetric(float64(stats[0].ExposedReduceTime.Microseconds())/1000, "exposedMs")
			b.ReportMetric(float64(stats[0].LastReduceTime.Microseconds())/1000, "lastReduceMs")
		})
	}
}

// BenchmarkCUDAOffloadCopy: the copies offload makes, 256 MiB between
// device memory and page-locked host memory on one stream (device to host,
// host to device) and both at once on two streams, beside the limit of the
// card's host link from NVML (PCIe generation and width, per direction,
// after line encoding). Reports GB/s and the share of the link.
func BenchmarkCUDAOffloadCopy(b *testing.B) {
	d := needCUDA(b)
	const n = 256 << 20 // bytes
	devBuf := func() Tensor {
		x, err := d.Alloc(n/4, FP32)
		if err != nil {
			b.Fatal(err)
		}
		b.Cleanup(func() { d.Free(x) })
		return x
	}
	hostBuf := func() Tensor {
		x, err := AllocPinned(d, n/4, FP32)
		if err != nil {
			b.Fatal(err)
		}
		b.Cleanup(func() { FreePinned(d, x) })
		return x
	}
	dev, host, dev2, host2 := devBuf(), hostBuf(), devBuf(), hostBuf()
	s1, s2 := gpuStream(b, d), gpuStream(b, d)
	link := pcieLinkBytesPerSecond(b, d.ordinal)
	for _, dir := range []string{"d2h", "h2d", "both"} {
		b.Run(dir, func(b *testing.B) {
			bytes := int64(n)
			if dir == "both" {
				bytes = 2 * n
			}
			b.SetBytes(bytes)
			var total time.Duration
			for range b.N {
				total += gpuTime(b, s1, func() error {
					switch dir {
					case "d2h":
						return d.copy(s1, host, dev)
					case "h2d":
						return d.copy(s1, dev, host)
					}
					// the other direction on s2, inside s1's timed span
					start, err := s1.Record()
					if err == nil {
						err = s2.Wait(start)
					}
					if err == nil {
						err = d.copy(s2, dev2, host2)
					}
					if err == nil {
						err = d.copy(s1, host, dev)
					}
					var other Event
					if err == nil {
						other, err = s2.Record()
					}
					if err == nil {
						err = s1.Wait(other)
					}
					return err
				})
			}
			gbs := float64(bytes) * float64(b.N) / total.Seconds() / 1e9
			b.ReportMetric(gbs, "GB/s")
			if link > 0 {
				perDir := gbs
				if dir == "both" {
					perDir /= 2
				}
				b.ReportMetric(link/1e9, "link-GB/s")
				b.ReportMetric(perDir/(link/1e9), "x-link")
			}
		})
	}
}

// pcieLinkBytesPerSecond is the theoretical bandwidth of one direction of
// GPU ordinal's host link at its maximum PCIe generation and width, from
// NVML, after line encoding (8b/10b up to gen 2, 128b/130b after); 0 where
// NVML cannot tell (it then logs why).
func pcieLinkBytesPerSecond(b *testing.B, ordinal int) float64 {
	lib := nvml.New()
	if ret := lib.Init(); ret != nvml.SUCCESS {
		b.Logf("no link limit: NVML init: %v", nvml.ErrorString(ret))
		return 0
	}
	defer lib.Shutdown()
	dev, ret := lib.DeviceGetHandleByIndex(ordinal)
	if ret != nvml.SUCCESS {
		b.Logf("no link limit: NVML device %d: %v", ordinal, nvml.ErrorString(ret))
		return 0
	}
	gen, ret := dev.GetMaxPcieLinkGeneration()
	if ret != nvml.SUCCESS {
		b.Logf("no link limit: PCIe generation: %v", nvml.ErrorString(ret))
		return 0
	}
	width, ret := dev.GetMaxPcieLinkWidth()
	if ret != nvml.SUCCESS {
		b.Logf("no link limit: PCIe width: %v", nvml.ErrorString(ret))
		return 0
	}
	curGen, _ := dev.GetCurrPcieLinkGeneration()
	curWidth, _ := dev.GetCurrPcieLinkWidth()
	b.Logf("PCIe gen %d x%d (now gen %d x%d)", gen, width, curGen, curWidth)
	gts := map[int]float64{1: 2.5, 2: 5, 3: 8, 4: 16, 5: 32, 6: 64}[gen]
	enc := 128.0 / 130
	if gen <= 2 {
		enc = 0.8
	}
	return gts * 1e9 * enc * float64(width) / 8
}

// BenchmarkCUDAOffloadStep is BenchmarkOffloadStep (bench_test.go) on the
// one-GPU group: 8 × 2048² bf16 layers, 2 ranks, ZeRO-2, AdamW, with and
// without offload; each layer's backward is a spin kernel of about 1 ms
// per 4M elements on the producer stream, so the copies of the reduced
// shards to the host run while later layers compute. copy_hidden is the
// share of those copies the backward hid.
func BenchmarkCUDAOffloadStep(b *testing.B) {
	d := needCUDA(b)
	var frees []Tensor
	b.Cleanup(func() {
		for _, x := range frees {
			d.Free(x)
		}
	})
	alloc := func(n int) (Tensor, error) {
		x, err := d.Alloc(n, BF16)
		if err == nil {
			frees = append(frees, x)
		}
		return x, err
	}
	grads := map[[2]int]Tensor{}
	benchOffloadStep(b, offloadBench{
		world: 2, layers: 8, hidden: 2048, backwards: 2,
		group:  func(n int) ([]Comm, error) { return NewCUDALocalGroupTimeout(n, d, 60*time.Second) },
		stream: d.NewStream,
		param:  alloc,
		backward: func(s Stream, rank, k, p, n int) (Tensor, error) {
			return grads[[2]int{rank, p}], cudaSpin(s, time.Duration(n/4)*time.Nanosecond)
		},
		setup: func(rank, p, n int) {
			g, err := alloc(n)
			if err != nil {
				b.Fatal(err)
			}
			grads[[2]int{rank, p}] = g
		},
	})
}

// BenchmarkCUDAParamOffloadCopy: the copy a gather makes with the parameter
// shard in page-locked host memory (Offload.Params), against a plain
// cuMemcpyAsync of the same 256 MiB from page-locked memory to the device,
// interleaved: one rank, one bf16 bucket of 128M parameters, so the gather
// is the copy alone (a one-rank all-gather in place moves nothing), timed
// on the caller's stream from before the Gather to its wait on the
// gather's event. x_memcpy is the gather's throughput over the memcpy's
// (goal ≥ 0.8); link-GB/s the host link's limit (NVML).
func BenchmarkCUDAParamOffloadCopy(b *testing.B) {
	d := needCUDA(b)
	n := 128 << 20 // bf16 elements: 256 MiB
	if os.Getenv("ZERO_FAKE_CUDA") == "1" {
		n = 1 << 20 // the fake driver copies with the CPU: the benchmark's path, not its figure
	}
	comms, err := NewCUDALocalGroup(1, d)
	if err != nil {
		b.Fatal(err)
	}
	defer comms[0].Close()
	e, err := New(Config{Stage: 3, BucketBytes: 2 * n, Params: ParamPolicy{PrefetchBytes: -1}, Offload: OffloadPolicy{Params: true}},
		comms[0], []Param{{Name: "w", Count: n, DType: BF16, Init: func(dst []float32, _ int) error { clear(dst); return nil }}})
	if err != nil {
		b.Fatal(err)
	}
	defer e.Close()
	dev, err := d.Alloc(n, BF16)
	if err != nil {
		b.Fatal(err)
	}
	defer d.Free(dev)
	host, err := AllocPinned(d, n, BF16)
	if err != nil {
		b.Fatal(err)
	}
	defer FreePinned(d, host)
	s := gpuStream(b, d)
	link := pcieLinkBytesPerSecond(b, d.ordinal)
	var gather, memcpy time.Duration
	b.SetBytes(2 * int64(n))
	for range b.N {
		gather += gpuTime(b, s, func() error {
			if _, err := e.Gather(s, 0); err != nil {
				return err
			}
			return e.Release(s, 0)
		})
		memcpy += gpuTime(b, s, func() error { return d.copy(s, dev, host) })
	}
	gbs := func(t time.Duration) float64 { return 2 * float64(n) * float64(b.N) / t.Seconds() / 1e9 }
	b.ReportMetric(gbs(gather), "gatherGB/s")
	b.ReportMetric(gbs(memcpy), "memcpyGB/s")
	b.ReportMetric(gbs(gather)/gbs(memcpy), "x_memcpy")
	if link > 0 {
		b.ReportMetric(link/1e9, "link-GB/s")
	}
}

// BenchmarkCUDAParamOffloadStep is BenchmarkParamOffloadStep (bench_test.go)
// on the one-GPU group: stage-3 AdamW steps at seed 000's shape (8 × 4096²
// bf16 layers, a layer a bucket), 2 ranks, 4 backwards a step (seed 000's),
// the parameter shard on the device and in page-locked host memory; on
// the fake driver, which runs the kernels on the CPU, 8 × 256².
func BenchmarkCUDAParamOffloadStep(b *testing.B) {
	d := needCUDA(b)
	hidden := 4096
	if os.Getenv("ZERO_FAKE_CUDA") == "1" {
		hidden = 256
	}
	benchParamOffloadStep(b, gpuTrainEnv(d), layerParams(8, hidden), 2, 4)
}
