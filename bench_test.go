package zero

import (
	"fmt"
	"math/rand"
	"os"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"
)

// BenchmarkStep: one step of 4 backwards of an 8×512 bf16 MLP across 4
// in-process ranks, per stage and overlap. Bytes are the gradient bytes
// each rank hands over per step.
func BenchmarkStep(b *testing.B) {
	const world, layers, hidden, backwards = 4, 8, 512, 4
	var params []Param
	for range layers {
		params = append(params, Param{Count: hidden * hidden, DType: BF16}, Param{Count: hidden, DType: BF16})
	}
	rng := rand.New(rand.NewSource(1))
	grads := make([][]Tensor, world)
	bytes := 0
	for r := range grads {
		for _, p := range params {
			grads[r] = append(grads[r], makeGrad(rng, p.Count, BF16, 1).t)
			if r == 0 {
				bytes += p.Count * 2 * backwards
			}
		}
	}
	for _, stage := range []int{1, 2, 3} {
		for _, overlap := range []bool{true, false} {
			b.Run(fmt.Sprintf("zero%d/overlap=%v", stage, overlap), func(b *testing.B) {
				comms, _ := NewLocalGroup(world)
				engines := make([]*Engine, world)
				streams := make([]*HostStream, world)
				var wg sync.WaitGroup
				for r := range world {
					wg.Add(1)
					go func() {
						defer wg.Done()
						var err error
						engines[r], err = New(Config{Stage: stage, BucketBytes: 1 << 20, Overlap: overlap, Grads: GradPolicy{AccumSteps: backwards}}, comms[r], params)
						if err != nil {
							b.Error(err)
						}
						streams[r] = NewHostStream()
					}()
				}
				wg.Wait()
				if b.Failed() {
					return
				}
				b.SetBytes(int64(bytes))
				b.ResetTimer()
				start := time.Now()
				for range b.N {
					for r := range world {
						wg.Add(1)
						go func() {
							defer wg.Done()
							e := engines[r]
							for range backwards {
								for p := len(params) - 1; p >= 0; p-- {
									if _, err := e.GradReady(p, grads[r][p], streams[r]); err != nil {
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
				elapsed := time.Since(start)
				b.StopTimer()
				st := engines[0].Stats()
				b.ReportMetric(float64(elapsed.Microseconds())/1000/float64(b.N), "ms/step")
				b.ReportMetric(float64(st.Collectives.Total().WireBytes)/(1<<20), "wireMiB/step")
				b.ReportMetric(float64(st.PeakGradBytes)/(1<<20), "peakMiB")
				for r := range world {
					engines[r].Close()
					streams[r].Close()
				}
			})
		}
	}
}

// BenchmarkCollectives runs each collective of the in-process group over
// 64 MiB of fp32 per rank, beside a yardstick of the same bytes in the same
// run: the same rank goroutines each make one in-place pass (x += 1) over
// their 1/N of all N rank buffers, the least traffic any all-reduce of
// shared buffers needs. Reported per rank count N:
//
//	algGB/s      payload bytes per second (one rank's buffer, as nccl-tests)
//	yard-algGB/s the yardstick's, counted the same way
//	x-yardstick  collective speed / yardstick speed (target ≥ 0.9 for all-reduce)
func BenchmarkCollectives(b *testing.B) {
	const elems = 64 << 20 / 4
	for _, n := range []int{2, 4, 8} {
		for _, kind := range []string{"all_reduce", "reduce_scatter", "all_gather", "all_reduce_as_rs+ag", "all_reduce_unstaggered"} {
			b.Run(fmt.Sprintf("%s/N=%d", kind, n), func(b *testing.B) {
				// Unstaggered, every rank's buffer starts at the same offset
				// modulo the mapping's alignment.
				staggerAllocs = kind != "all_reduce_unstaggered"
				defer func() { staggerAllocs = true }()
				comms, _ := NewLocalGroup(n)
				bufs := make([]Tensor, n)
				streams := make([]*HostStream, n)
				for r := range n {
					var err error
					if bufs[r], err = CPU().Alloc(elems, FP32); err != nil {
						b.Fatal(err)
					}
					defer CPU().Free(bufs[r])
					streams[r] = NewHostStream()
					defer streams[r].Close()
				}
				collective := func(r int) error {
					c, s, buf := comms[r], streams[r], bufs[r]
					mine := buf.slice(r*elems/n, elems/n)
					switch kind {
					case "all_reduce", "all_reduce_unstaggered":
						return c.AllReduce(s, buf, OpSum)
					case "reduce_scatter":
						return c.ReduceScatter(s, buf, mine, OpSum)
					case "all_gather":
						return c.AllGather(s, mine, buf)
					}
					if err := c.ReduceScatter(s, buf, mine, OpSum); err != nil {
						return err
					}
					return c.AllGather(s, mine, buf)
				}
				onAll := func(fn func(r int)) time.Duration {
					var wg sync.WaitGroup
					t0 := time.Now()
					for r := range n {
						wg.Add(1)
						go func() { defer wg.Done(); fn(r) }()
					}
					wg.Wait()
					return time.Since(t0)
				}
				warm := func(r int) { // first touch of the pages, outside the timings
					if err := collective(r); err != nil {
						b.Error(err)
					}
					streams[r].Sync()
				}
				onAll(warm)
				var tColl, tYard time.Duration
				b.SetBytes(elems * 4)
				b.ResetTimer()
				for range b.N {
					tColl += onAll(func(r int) {
						if err := collective(r); err != nil {
							b.Error(err)
						}
						if err := streams[r].Sync(); err != nil {
							b.Error(err)
						}
					})
					b.StopTimer()
					tYard += onAll(func(r int) {
						lo, hi := splitRange(elems, n, r)
						for _, buf := range bufs {
							yardstick(yardInc32, buf.ptr, 0, 0, 0, 0, lo, hi)
						}
					})
					b.StartTimer()
				}
				b.ReportMetric(float64(anonHugeBytes())/(1<<20), "hugeMiB")
				payload := float64(elems*4) * float64(b.N)
				b.ReportMetric(payload/tColl.Seconds()/1e9, "algGB/s")
				b.ReportMetric(payload/tYard.Seconds()/1e9, "yard-algGB/s")
				b.ReportMetric(tYard.Seconds()/tColl.Seconds(), "x-yardstick")
			})
		}
	}
}

// anonHugeBytes reads how much of the process's anonymous memory sits on
// transparent huge pages.
func anonHugeBytes() int64 {
	data, err := os.ReadFile("/proc/self/smaps_rollup")
	if err != nil {
		return -1
	}
	for _, line := range strings.Split(string(data), "\n") {
		if f := strings.Fields(line); len(f) >= 2 && f[0] == "AnonHugePages:" {
			kb, _ := strconv.ParseInt(f[1], 10, 64)
			return kb << 10
		}
	}
	return -1
}

// BenchmarkGradReady: the engine's cost per gradient handed over, for 1000
// small bf16 gradients per backward on one rank (ZeRO-2, Overlap), the
// flatten kernels and reductions included: one GradReady per gradient, and
// GradsReady batches of 100.
func BenchmarkGradReady(b *testing.B) {
	for _, batch := range []int{1, 100} {
		b.Run(fmt.Sprintf("batch=%d", batch), func(b *testing.B) {
			comms, _ := NewLocalGroup(1)
			params := make([]Param, 1000)
			for i := range params {
				params[i] = Param{Count: 64, DType: BF16}
			}
			e, err := New(Config{Stage: 2, BucketBytes: 1 << 20, Overlap: true}, comms[0], params)
			if err != nil {
				b.Fatal(err)
			}
			defer e.Close()
			s := NewHostStream()
			defer s.Close()
			ids := make([]int, len(params))
			grads := make([]Tensor, len(params))
			for i := range ids {
				ids[i] = len(params) - 1 - i
				grads[i] = Halfs(make([]uint16, 64), BF16)
			}
			b.ReportAllocs()
			b.ResetTimer()
			for range b.N {
				for i := 0; i < len(ids); i += batch {
					if _, err := e.GradsReady(ids[i:i+batch], grads[i:i+batch], s); err != nil {
						b.Fatal(err)
					}
				}
				if err := e.EndBackward(); err != nil {
					b.Fatal(err)
				}
				if err := e.Step(); err != nil {
					b.Fatal(err)
				}
			}
			b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N*len(params)), "ns/grad")
		})
	}
}

// BenchmarkStepMemory: the memory per rank of ZeRO-1 and ZeRO-2 with AdamW
// for the demo's model (8 layers × 1024², bf16, Ψ = 8.4M parameters, 4
// ranks, 8 MiB buckets), from the stats after a step: the engine's gradient
// and optimizer bytes, with the framework's bf16 parameters (2Ψ), beside
// DeepSpeed's formula for mixed precision (ZeRO-1: 2Ψ + 2Ψ + 12Ψ/W;
// ZeRO-2: 2Ψ + (2 + 12)Ψ/W). TestMemoryFormula checks the stats against
// the plan's formula.
func BenchmarkStepMemory(b *testing.B) {
	const world, layers, hidden = 4, 8, 1024
	psi := float64(layers * (hidden*hidden + hidden))
	mib := func(x float64) float64 { return x / (1 << 20) }
	for _, stage := range []int{1, 2} {
		b.Run(fmt.Sprintf("zero%d", stage), func(b *testing.B) {
			var st Stats
			for range b.N {
				st, _ = memoryRun(b, stage, world, layers, hidden, 8<<20)
			}
			ds := 2*psi + 2*psi + 12*psi/world
			if stage == 2 {
				ds = 2*psi + (2+12)*psi/world
			}
			b.ReportMetric(mib(float64(st.PeakGradBytes)), "grad_MiB")
			b.ReportMetric(mib(float64(st.OptimizerBytes)), "opt_MiB")
			b.ReportMetric(mib(2*psi+float64(st.PeakGradBytes+st.OptimizerBytes)), "total_MiB")
			b.ReportMetric(mib(ds), "deepspeed_MiB")
		})
	}
}

// BenchmarkGather: the stage-3 Gather of one 8 MiB bf16 bucket (and its
// Release) on N in-process ranks, beside the group's own all-gather of the
// same bytes on the same streams in the same run, out of place as the
// engine's is (the shard persists apart from the gathered buffer, so each
// rank copies its own chunk too); algGB/s counts the bucket's bytes, as
// nccl-tests' algorithm bandwidth.
func BenchmarkGather(b *testing.B) {
	const elems = 4 << 20 // 8 MiB of bf16
	for _, n := range []int{2, 4} {
		b.Run(fmt.Sprintf("N=%d", n), func(b *testing.B) {
			comms, _ := NewLocalGroup(n)
			engines := make([]*Engine, n)
			streams := make([]*HostStream, n)
			raw := make([]Tensor, n)
			errs := eachRank(n, func(r int) error {
				data := make([]uint16, elems)
				var err error
				engines[r], err = New(Config{Stage: 3, BucketBytes: elems * 2, Params: ParamPolicy{PrefetchBytes: -1}},
					comms[r], []Param{{Count: elems, DType: BF16, Data: Halfs(data, BF16)}})
				streams[r] = NewHostStream()
				if err == nil {
					raw[r], err = CPU().Alloc(elems+elems/n, BF16) // the gathered bucket, then a shard
				}
				return err
			})
			for _, err := range errs {
				if err != nil {
					b.Fatal(err)
				}
			}
			defer func() {
				for r := range n {
					engines[r].Close()
					streams[r].Close()
					CPU().Free(raw[r])
				}
			}()
			gather := func(r int) error {
				if _, err := engines[r].Gather(streams[r], 0); err != nil {
					return err
				}
				if err := streams[r].Sync(); err != nil {
					return err
				}
				return engines[r].Release(streams[r], 0)
			}
			direct := func(r int) error {
				if err := comms[r].AllGather(streams[r], raw[r].slice(elems, elems/n), raw[r].slice(0, elems)); err != nil {
					return err
				}
				return streams[r].Sync()
			}
			onAll := func(fn func(r int) error) time.Duration {
				t0 := time.Now()
				for _, err := range eachRank(n, fn) {
					if err != nil {
						b.Fatal(err)
					}
				}
				return time.Since(t0)
			}
			onAll(gather) // first touch
			onAll(direct)
			var tg, td time.Duration
			b.SetBytes(elems * 2)
			b.ResetTimer()
			for range b.N {
				tg += onAll(gather)
				b.StopTimer()
				td += onAll(direct)
				b.StartTimer()
			}
			payload := float64(elems*2) * float64(b.N)
			b.ReportMetric(payload/tg.Seconds()/1e9, "algGB/s")
			b.ReportMetric(payload/td.Seconds()/1e9, "allgather-algGB/s")
			b.ReportMetric(td.Seconds()/tg.Seconds(), "x-allgather")
		})
	}
}

// BenchmarkOffloadStep: steps of 2 backwards of an 8×1024² bf16 model (8.4M
// parameters, one layer a bucket) on 2 in-process ranks at ZeRO-2 with
// AdamW, with and without offload. Each layer's backward is a host task on
// a producer stream that writes its gradient (a xorshift an element), so
// the copies of the reduced shards to the host can overlap with the layers
// still to come. Reported per step:
//
//	step_ms        wall time
//	optimizer_ms   the optimizer pass (on the host with offload)
//	adamw-GB/s     its speed, 30 B an element (p, g, m, v read; p, m, v, bf16 out written),
//	               per rank: the ranks' passes share the cores
//	yard-GB/s      yardOptPass over buffers of the same size, one per rank at once, in the same run
//	grad_copy_ms   the copies of the reduced shards to the host (offload)
//	copy_hidden    the share of them that ran before backward's last gradient
//	param_copy_ms  the copies of the new parameters to the device (offload)
//	grad_copy-GB/s, param_copy-GB/s
//	               their speed: the bytes each step copies over that time
//	host_MiB, pinned_share, saved_MiB, buckets
//	               the stats' host bytes, the page-locked share of them, the
//	               device bytes saved, and the plan's buckets
func BenchmarkOffloadStep(b *testing.B) {
	const hidden = 1024
	grads := map[[2]int][]uint16{}
	benchOffloadStep(b, offloadBench{
		world: 2, layers: 8, hidden: hidden, backwards: 2,
		group:  func(n int) ([]Comm, error) { return NewLocalGroup(n) },
		stream: func() (Stream, error) { return NewHostStream(), nil },
		param: func(n int) (Tensor, error) {
			x := make([]uint16, n)
			for i := range x {
				x[i] = bf16FromFloat(float32(i%97) / 97)
			}
			return Halfs(x, BF16), nil
		},
		backward: func(s Stream, rank, k, p, n int) (Tensor, error) {
			g := grads[[2]int{rank, p}]
			if g == nil { // set up before the ranks run
				return Tensor{}, fmt.Errorf("no gradient buffer for rank %d param %d", rank, p)
			}
			seed := uint32(rank*131 + k*17 + p + 1)
			err := s.(*HostStream).Launch(func() error {
				x := seed
				for i := range g {
					x ^= x << 13
					x ^= x >> 17
					x ^= x << 5
					g[i] = uint16(0x3a00 | x&0x81ff) // ±[2^-11, 2^-10): random bf16 bits
				}
				return nil
			})
			return Halfs(g, BF16), err
		},
		setup: func(rank, p, n int) { grads[[2]int{rank, p}] = make([]uint16, n) },
	})
}

// BenchmarkNormInLanding: steps of 2 backwards of a 32M-parameter bf16
// model on 2 in-process ranks at ZeRO-2 with AdamW, the boundary unknown
// (Step sums the fp32 shard's squares in a pass of its own) or known
// (Grads.AccumSteps 2: the last backward's landings sum them as they
// store). Reported per step: the shard's bytes the norm read after the
// reductions (NormReadBytes), the shard's reads by the step counted in
// shards (the optimizer's pass, one, plus the norm's), and the wall time
// of Step alone (on rank 0; the backwards are not in it).
func BenchmarkNormInLanding(b *testing.B) {
	normInLandingRun(b, hostBench, 2048) // benchenv_test.go; BenchmarkCUDANormInLanding on a GPU
}

// BenchmarkParamOffloadStep: stage-3 AdamW steps at seed 000's shape (8 ×
// 4096² bf16 layers, 134M parameters, a layer a bucket) on 2 in-process
// ranks, 2 backwards a step, with the parameter shard on the device and in
// page-locked host memory (benchParamOffloadStep): the device bytes from
// the engine's Stats. On the CPU device "device" and "host" are the same
// RAM, so the time shows what the copies cost, not what a GPU saves.
func BenchmarkParamOffloadStep(b *testing.B) {
	benchParamOffloadStep(b, hostTrain, layerParams(8, 4096), 2, 2)
}

// BenchmarkParamOffloadEstimate: the same device-side figures at Llama-2
// 7B's shape, which no CPU here holds, from the estimator in Stats' words
// (Estimation.Stats, held to the engine's Stats field by field by the
// estimate tests): stage 3, AdamW, W 8 and 64, the parameters gathered one
// at a time (as DeepSpeed fetches a module's), with the parameter shard on
// the device and on the host, the optimizer on the device and offloaded.
func BenchmarkParamOffloadEstimate(b *testing.B) {
	params, err := (TransformerShape{Hidden: 4096, Layers: 32, Vocab: 32000, FFN: 11008, Heads: 32}).Params(BF16)
	if err != nil {
		b.Fatal(err)
	}
	mib := func(x int64) float64 { return float64(x) / (1 << 20) }
	for _, world := range []int{8, 64} {
		for _, offload := range []OffloadPolicy{{}, {Params: true}, {Optimizer: true}, {Optimizer: true, Params: true}} {
			b.Run(fmt.Sprintf("7B/W=%d/optimizer=%v/params=%v", world, offload.Optimizer, offload.Params), func(b *testing.B) {
				cfg := Config{Stage: 3, BucketBytes: 32 << 20, Overlap: true, Offload: offload,
					Optimizer: OptimizerPolicy{Groups: []Optimizer{NewAdamW(1e-4)}}}
				var st Stats
				for range b.N {
					est, err := Estimate(params, cfg, world, Workload{Backwards: 4})
					if err != nil {
						b.Fatal(err)
					}
					st = est.Stats()
				}
				b.ReportMetric(mib(st.PeakParamBytes+st.PeakGradBytes+st.OptimizerBytes+st.ControlBytes), "device-MiB")
				b.ReportMetric(mib(st.ParamShardBytes), "device-shard-MiB")
				b.ReportMetric(mib(st.HostParamBytes), "host-shard-MiB")
				b.ReportMetric(mib(st.HostBytes), "host-MiB")
			})
		}
	}
}
