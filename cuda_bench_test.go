//go:build cuda

package zero

import (
	"encoding/json"
	"fmt"
	"math"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
)

// GPU benchmarks (scripts/gpu-test.sh runs them on a GPU host; elsewhere they
// skip like the tests, and against the fake driver they run at a smaller
// shape: benchShrink).
//
// BenchmarkCUDAKernelBandwidth times each kernel against a device-to-device
// cudaMemcpyAsync of the same bytes (read + written), interleaved in the same
// run, and reports both bandwidths and their ratio (target ≥ 0.9).
//
// BenchmarkCUDAPipeline is the reduction pipeline at seed 000's shape: 8
// layers × hidden 4096 (8 parameters of 4096², bf16, ≈134M parameters), 4
// backwards per step, W=2 ranks in process on one GPU, for ZeRO-1/2/3 and
// each of seed 000's modes; it reports wall ms per step (compare with seed
// 000's table and with bench/torch_pipeline.py, PyTorch eager ops on the
// same shape) and the memory and collectives of cmd/demo's table.
//
// The others measure on the GPU what a CPU benchmark measures on the host,
// through the same body (benchenv_test.go): BenchmarkCUDAExposedReduce,
// BenchmarkCUDANormInLanding, BenchmarkCUDACheckpoint,
// BenchmarkCUDASafetensors; and the offload's copies and step
// (BenchmarkCUDAOffloadCopy, BenchmarkCUDAOffloadStep).

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
	n := 64 << 20 / benchShrink(b, 64) // elements per operand
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
	segs := func(src Tensor, parts int) []flatPiece {
		out := make([]flatPiece, parts)
		per := src.count / parts
		for i := range out {
			out[i] = flatPiece{Src: src.slice(i*per, per), Offset: i * per}
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
			return d.accumulate(s, f32[0], []flatPiece{{Src: bf[0]}}, false, 0.25, flag)
		}},
		// the landing of a step's last reduction with its squares: the same
		// bytes from memory (the squares are read back from L2)
		{"accumulate_bf16_add_squares", 10 * n, func() error {
			return d.accumulateSquares(s, f32[0], flatPiece{Src: bf[0]}, false, 0.25, flag, parts)
		}},
		{"accumulate_f32_add", 12 * n, func() error {
			return d.accumulate(s, f32[0], []flatPiece{{Src: f32[1]}}, false, 0.25, flag)
		}},
		{"accumulate_f32_add_squares", 12 * n, func() error {
			return d.accumulateSquares(s, f32[0], flatPiece{Src: f32[1]}, false, 0.25, flag, parts)
		}},
		{"accumulate_bf16_into_bf16_add", 6 * n, func() error {
			return d.accumulate(s, bf[1], []flatPiece{{Src: bf[0]}}, false, 0.25, flag)
		}},
		{"accumulate_f32_copy", 8 * n, func() error {
			return d.accumulate(s, f32[0], []flatPiece{{Src: f32[1]}}, true, 0.25, flag)
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

// seed000Params is seed 000's model: 8 layers × hidden 4096, bf16 (hidden
// 4096/shrink).
func seed000Params(shrink int) []Param {
	h := 4096 / shrink
	ps := make([]Param, 8)
	for i := range ps {
		ps[i] = Param{Name: fmt.Sprintf("layer%d.weight", i), Count: h * h, DType: BF16}
	}
	return ps
}

// The modes of a step's backwards, as cmd/demo names them.
var pipelineModes = []string{"baseline", "no_sync", "coalesce", "coalesce_budget"}

// BenchmarkCUDAPipeline/ZeRO-S/MODE runs seed 000's rows: stage S with
// the 4 backwards of a step plain (baseline), the first 3 inside NoSync
// (no_sync), all 4 inside Coalesce (coalesce), and inside Coalesce under a
// budget of half a gradient's fp32 sums (coalesce_budget, the demo's
// coalesce_budget). The gradients are hashed noise uploaded once (the
// values do not change the time, but zeros are no test of it). Per step:
// ms/step (wall), collectives/step and payloadMiB (the gradients'
// reduce-scatters and all-reduces), peakMiB (the pools' high-water mark,
// held), inUsePeakMiB, windowInUseMiB and flushInUseMiB (the gradient
// memory in use at the peak, at the end of the backwards and after the
// flush, cmd/demo's columns; without a window the window figure is the
// last backward's), exposedMs (Stats.ExposedReduceTime) and lastReduceMs
// (Stats.LastReduceTime).
func BenchmarkCUDAPipeline(b *testing.B) {
	d := needCUDA(b)
	const world, backwards = 2, 4
	shrink := benchShrink(b, 4)
	params := seed000Params(shrink)
	bucket := 32 << 20 / (shrink * shrink) // a layer, as at the full shape
	count := 0
	for _, p := range params {
		count += p.Count
	}
	// each rank's gradients: hashed noise, the same every backward
	grads := make([][]Tensor, world)
	up := gpuStream(b, d)
	for r := range grads {
		for p, q := range params {
			g, err := d.Alloc(q.Count, q.DType)
			if err != nil {
				b.Fatal(err)
			}
			b.Cleanup(func() { d.Free(g) })
			h := make([]uint16, q.Count)
			hashFill(h, uint64(r)<<40|uint64(p))
			if err := d.copy(up, g, Halfs(h, BF16)); err != nil { // pageable: done when it returns
				b.Fatal(err)
			}
			grads[r] = append(grads[r], g)
		}
	}
	for _, stage := range []int{1, 2, 3} {
		for _, mode := range pipelineModes {
			b.Run(fmt.Sprintf("ZeRO-%d/%s", stage, mode), func(b *testing.B) {
				cfg := Config{Stage: stage, BucketBytes: bucket, Overlap: true, Grads: GradPolicy{PredivideFactor: world, AccumSteps: backwards}}
				if mode == "coalesce_budget" { // half the fp32 sums, each bucket's padding allowed for
					cfg.Window.BudgetBytes = (count + len(params)*world*64) * FP32.Size() / 2
				}
				pipelineRun(b, d, cfg, mode, backwards, params, grads)
			})
		}
	}
}

// pipelineRun times steps of cfg on 2 ranks of the one-GPU group, each
// handing over its grads backwards times in mode, and reports
// BenchmarkCUDAPipeline's metrics.
func pipelineRun(b *testing.B, d *cudaDevice, cfg Config, mode string, backwards int, params []Param, grads [][]Tensor) {
	world := len(grads)
	comms, err := NewCUDALocalGroup(world, d)
	if err != nil {
		b.Fatal(err)
	}
	ready := make(chan error, world)
	start := make(chan struct{})
	done := make(chan error, world)
	stats := make([]Stats, world)
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
			backward := func() error {
				for p := len(params) - 1; p >= 0; p-- {
					if _, err := e.GradReady(p, grads[rank][p], s); err != nil {
						return err
					}
				}
				return e.EndBackward()
			}
			run := func(n int) error {
				for range n {
					if err := backward(); err != nil {
						return err
					}
				}
				return nil
			}
			step := func() error {
				var err error
				switch mode {
				case "baseline":
					err = run(backwards)
				case "no_sync": // DDP's rule: the last backward, outside, reduces everything
					if err = e.NoSync(func() error { return run(backwards - 1) }); err == nil {
						err = run(1)
					}
				default:
					err = e.Coalesce(func() error { return run(backwards) })
				}
				if err != nil {
					return err
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
	st, c := stats[0], stats[0].Collectives
	mib := func(x int64) float64 { return float64(x) / (1 << 20) }
	window := st.WindowGradBytesInUse
	if mode == "baseline" {
		window = st.GradBytesInUse
	}
	b.ReportMetric(float64(el.Microseconds())/1000/float64(b.N), "ms/step")
	b.ReportMetric(float64(c.Total().Calls), "collectives/step")
	b.ReportMetric(mib(c[KindReduceScatter].PayloadBytes+c[KindAllReduce].PayloadBytes), "payloadMiB")
	b.ReportMetric(mib(st.PeakGradBytes), "peakMiB")
	b.ReportMetric(mib(st.PeakGradBytesInUse), "inUsePeakMiB")
	b.ReportMetric(mib(window), "windowInUseMiB")
	b.ReportMetric(mib(st.GradBytesInUse), "flushInUseMiB")
	// what backward left of the reductions, beside one bucket's
	// reduction (the floor overlap can reach), on the card
	b.ReportMetric(float64(st.ExposedReduceTime.Microseconds())/1000, "exposedMs")
	b.ReportMetric(float64(st.LastReduceTime.Microseconds())/1000, "lastReduceMs")
}

// BenchmarkCUDAOffloadCopy/DIR/SIZE: the copies offload makes between
// device memory and page-locked host memory, as the engine makes them
// (cuMemcpyAsync, the direction found by unified addressing), against the
// plain direction-named copies of the same bytes between the same buffers
// (cuMemcpyDtoHAsync, cuMemcpyHtoDAsync), interleaved on one stream and
// timed with events: device to host (d2h), host to device (h2d), and both
// at once on two streams (both, the bytes of both counted), at 256 MiB, at
// seed 000's bucket part (16 MiB: a 32 MiB bucket's shard at W=2) and at
// BenchmarkCUDAOffloadStep's (4 MiB: a 2048² bf16 layer's shard). Beside
// them the limit of the card's host link from NVML (PCIe generation and
// width, per direction, after line encoding). Reports GB/s (the engine's
// copies), plain-GB/s, x-plain (the first over the second), link-GB/s and
// x-link (the engine's copies per direction over the link).
func BenchmarkCUDAOffloadCopy(b *testing.B) {
	d := needCUDA(b)
	const most = 256 << 20 // bytes
	devBuf := func() Tensor {
		x, err := d.Alloc(most/4, FP32)
		if err != nil {
			b.Fatal(err)
		}
		b.Cleanup(func() { d.Free(x) })
		return x
	}
	hostBuf := func() Tensor {
		x, err := AllocPinned(d, most/4, FP32)
		if err != nil {
			b.Fatal(err)
		}
		b.Cleanup(func() { FreePinned(d, x) })
		return x
	}
	devs, hosts := [2]Tensor{devBuf(), devBuf()}, [2]Tensor{hostBuf(), hostBuf()}
	s1, s2 := gpuStream(b, d), gpuStream(b, d)
	link := pcieLinkBytesPerSecond(b, d.ordinal)
	// enqueue copies i's bytes on s, to the host or from it, the engine's
	// way (d.copy) or the plain one
	enqueue := func(s Stream, i, bytes int, toHost, plain bool) error {
		dev, host := devs[i].slice(0, bytes/4), hosts[i].slice(0, bytes/4)
		dst, src := dev, host
		if toHost {
			dst, src = host, dev
		}
		if plain {
			return d.copyDirected(s, dst, src, toHost)
		}
		return d.copy(s, dst, src)
	}
	// copies runs dir's copies of size bytes inside s1's timed span
	copies := func(dir string, size int, plain bool) func() error {
		return func() error {
			if dir != "both" {
				return enqueue(s1, 0, size, dir == "d2h", plain)
			}
			// host to device on s2, inside s1's span
			start, err := s1.Record()
			if err == nil {
				err = s2.Wait(start)
			}
			if err == nil {
				err = enqueue(s2, 1, size, false, plain)
			}
			if err == nil {
				err = enqueue(s1, 0, size, true, plain)
			}
			var other Event
			if err == nil {
				other, err = s2.Record()
			}
			if err == nil {
				err = s1.Wait(other)
			}
			return err
		}
	}
	for _, size := range []int{most, 16 << 20, 4 << 20} {
		for _, dir := range []string{"d2h", "h2d", "both"} {
			if dir == "both" && size != most {
				continue
			}
			b.Run(fmt.Sprintf("%s/%dMiB", dir, size>>20), func(b *testing.B) {
				bytes := int64(size)
				if dir == "both" {
					bytes *= 2
				}
				engine, plain := copies(dir, size, false), copies(dir, size, true)
				for _, warm := range []func() error{engine, plain} {
					if err := warm(); err != nil {
						b.Fatal(err)
					}
				}
				var te, tp time.Duration
				b.ResetTimer()
				for range b.N {
					te += gpuTime(b, s1, engine)
					tp += gpuTime(b, s1, plain)
				}
				b.StopTimer()
				b.SetBytes(bytes)
				gbs := float64(bytes) * float64(b.N) / te.Seconds() / 1e9
				pgbs := float64(bytes) * float64(b.N) / tp.Seconds() / 1e9
				b.ReportMetric(gbs, "GB/s")
				b.ReportMetric(pgbs, "plain-GB/s")
				b.ReportMetric(gbs/pgbs, "x-plain")
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
	b.Logf("figure: PCIe gen %d x%d (now gen %d x%d)", gen, width, curGen, curWidth)
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

// spunGrads is BenchmarkCUDAExposedReduce's gradient source: rank's
// gradients live in d's memory, filled once with hashed noise, and a
// parameter's backward is a spin kernel on the producer stream of about
// 1 ms per 4M elements (as BenchmarkCUDAOffloadStep's), after which the
// gradient exists: its event.
func spunGrads(d *cudaDevice) gradSource {
	return func(rank int, params []Param) (func(Stream, int, int) (Tensor, Event, error), func(), error) {
		var bufs []Tensor
		free := func() {
			for _, x := range bufs {
				d.Free(x)
			}
		}
		up, err := d.NewStream()
		if err != nil {
			return nil, nil, err
		}
		defer up.Close()
		for p, q := range params {
			x, err := d.Alloc(q.Count, BF16)
			if err != nil {
				free()
				return nil, nil, err
			}
			bufs = append(bufs, x)
			h := make([]uint16, q.Count)
			hashFill(h, uint64(rank)<<40|uint64(p))
			if err := d.copy(up, x, Halfs(h, BF16)); err != nil { // pageable: done when it returns
				free()
				return nil, nil, err
			}
		}
		return func(s Stream, _, p int) (Tensor, Event, error) {
			if err := cudaSpin(s, time.Duration(params[p].Count/4)*time.Nanosecond); err != nil {
				return Tensor{}, nil, err
			}
			made, err := s.Record()
			return bufs[p], made, err
		}, free, nil
	}
}

// BenchmarkCUDAExposedReduce is BenchmarkExposedReduce (bench_exposed_test.go)
// on the one-GPU group, both shapes: 2 ranks, ZeRO-2, Overlap, one
// backward a step, each layer's gradients made by a spin kernel on the
// rank's stream (spunGrads) and handed over after it on that stream, as a
// framework's backward does; t0, the backward's end, is the later of the
// last GradsReady's return and the last spin's end (its event, waited
// for on the host). exposed-ms and floor-ms are so on the host's clock
// (a wait for an event on each side); stats-exposed-ms and bucket-ms are
// the engine's own figures, from CUDA events.
func BenchmarkCUDAExposedReduce(b *testing.B) {
	d := needCUDA(b)
	shrink := benchShrink(b, 4)
	env := gpuTrainEnv(d)
	for _, sh := range []struct {
		name           string
		layers, hidden int
	}{{"demo", 8, 1024 / shrink}, {"seed000", 8, 4096 / shrink}} {
		params := exposedParams(sh.layers, sh.hidden)
		layer := 2 * (sh.hidden*sh.hidden + sh.hidden + 64)
		for _, v := range []struct {
			name    string
			bucket  int
			staging int
		}{{"layer", layer, 2}, {"layer", layer, 4}, {"quarter", layer / 4, 2}, {"two", 2 * layer, 2}} {
			b.Run(fmt.Sprintf("%s/bucket=%s/staging=%d", sh.name, v.name, v.staging), func(b *testing.B) {
				exposedReduceRun(b, env, spunGrads(d), params, Config{Stage: 2, BucketBytes: v.bucket, Overlap: true, StagingBuffers: v.staging})
			})
		}
	}
}

// BenchmarkCUDANormInLanding is BenchmarkNormInLanding (bench_test.go) on
// the one-GPU group: 8 × 2048² bf16 parameters and their gradients in
// device memory, 2 ranks, ZeRO-2, AdamW, 2 backwards a step, the boundary
// unknown (Step's own pass over the shard: chunkSquares and sumChunks) or
// known (the last landings sum the squares as they store). The kernels'
// side of it (accumulate_*_squares against accumulate_*, norm_chunks_*)
// is in BenchmarkCUDAKernelBandwidth.
func BenchmarkCUDANormInLanding(b *testing.B) {
	d := needCUDA(b)
	normInLandingRun(b, gpuTrainEnv(d), 2048/benchShrink(b, 4))
}

// BenchmarkCUDACheckpoint is BenchmarkCheckpoint (checkpoint_test.go) with
// the parameters and the state in device memory: Save copies them to the
// host through its chunks, Load back (ZERO_BENCH_CKPT_ELEMS, ZERO_BENCH_DIR
// as there).
func BenchmarkCUDACheckpoint(b *testing.B) {
	d := needCUDA(b)
	checkpointRun(b, gpuTrainEnv(d))
}

// BenchmarkCUDASafetensors is BenchmarkSafetensors (safetensors_test.go)
// on the one-GPU group: the export from device memory (and, with offload,
// from page-locked host memory), the import into device memory
// (ZERO_BENCH_ST_ELEMS as there).
func BenchmarkCUDASafetensors(b *testing.B) {
	d := needCUDA(b)
	safetensorsRun(b, gpuTrainEnv(d), d)
}

// TestCUDAKernelRegisters records every kernel of the embedded fatbin as
// the driver loaded it on device 0 (cuFuncGetAttribute, so no CUDA toolkit
// is needed): registers per thread, local memory per thread (spills and
// stack), static shared memory, the largest block it can launch with, and
// the PTX and SASS versions; one "figure:" line each, and kernels.json in
// ZERO_GPU_RESULTS where that is set (the GPU runner sets it to $OUT).
// It fails where a kernel is missing from the fatbin, where names repeat, where a figure
// is out of CUDA's range, and where a kernel cannot launch the blocks of
// ZC_THREADS threads that every launcher but the spin kernel's uses.
// Against the fake driver the figures are the fake's fixed ones.
func TestCUDAKernelRegisters(t *testing.T) {
	d := needCUDA(t)
	ks, err := d.kernels()
	if err != nil {
		t.Fatal(err)
	}
	seen := map[string]bool{}
	for _, k := range ks {
		t.Logf("figure: kernel %-16s %3d registers, %4d B local, %5d B shared, %4d B const, max %4d threads, ptx %d, sass %d",
			k.Name, k.Regs, k.LocalBytes, k.SharedBytes, k.ConstBytes, k.MaxThreads, k.PTX, k.Binary)
		switch {
		case !strings.HasPrefix(k.Name, "zc_") || seen[k.Name]:
			t.Errorf("kernel %q: not a zc_ name, or named twice", k.Name)
		case k.Regs < 1 || k.Regs > 255 || k.LocalBytes < 0 || k.SharedBytes < 0 || k.SharedBytes > 48<<10 || k.Binary < 10 || k.PTX < 0:
			t.Errorf("kernel %s: figures out of CUDA's range: %+v", k.Name, k)
		case k.Name != "zc_spin" && k.MaxThreads < zcThreads:
			t.Errorf("kernel %s: at most %d threads a block, and its launcher starts %d (%d registers each)", k.Name, k.MaxThreads, zcThreads, k.Regs)
		}
		seen[k.Name] = true
	}
	if dir := os.Getenv("ZERO_GPU_RESULTS"); dir != "" {
		out, err := json.MarshalIndent(struct {
			Device  string       `json:"device"`
			Kernels []kernelInfo `json:"kernels"`
		}{d.Name(), ks}, "", "  ")
		if err == nil {
			err = os.WriteFile(filepath.Join(dir, "kernels.json"), append(out, '\n'), 0o644)
		}
		if err != nil {
			t.Fatal(err)
		}
	}
}

// TestCUDADirectedCopies: BenchmarkCUDAOffloadCopy's yardstick moves what
// the engine's copy moves: random words from page-locked memory to the
// device through copyDirected, back to another page-locked buffer through
// copy, to the device again through copy and back through copyDirected,
// each buffer the source's bits (a size that is no multiple of anything).
func TestCUDADirectedCopies(t *testing.T) {
	d := needCUDA(t)
	seed := testSeed(t)
	rng := rand.New(rand.NewPCG(uint64(seed), 11))
	s := gpuStream(t, d)
	const n = 1<<20 + 3
	pinned := func() Tensor {
		x, err := AllocPinned(d, n, FP32)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { FreePinned(d, x) })
		return x
	}
	onDevice := func() Tensor {
		x, err := d.Alloc(n, FP32)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { d.Free(x) })
		return x
	}
	src, mid, back := pinned(), pinned(), pinned()
	a, b := onDevice(), onDevice()
	words := src.HostFloat32s()
	for i := range words {
		words[i] = math.Float32frombits(rng.Uint32())
	}
	for i, step := range []func() error{
		func() error { return d.copyDirected(s, a, src, false) },
		func() error { return d.copy(s, mid, a) },
		func() error { return d.copy(s, b, mid) },
		func() error { return d.copyDirected(s, back, b, true) },
		s.Sync,
	} {
		if err := step(); err != nil {
			t.Fatalf("copy %d: %v", i, err)
		}
	}
	for name, x := range map[string]Tensor{"through copyDirected and copy": mid, "and back": back} {
		got := x.HostFloat32s()
		for i := range words {
			if math.Float32bits(got[i]) != math.Float32bits(words[i]) {
				t.Fatalf("%s: word %d is %#x, the source's %#x", name, i, math.Float32bits(got[i]), math.Float32bits(words[i]))
			}
		}
	}
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
	n := 128 << 20 / benchShrink(b, 128) // bf16 elements: 256 MiB (the fake driver copies with the CPU: its path, not its figure)
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
	hidden := 4096 / benchShrink(b, 16)
	benchParamOffloadStep(b, gpuTrainEnv(d), layerParams(8, hidden), 2, 4)
}
