package zero

import (
	"fmt"
	"math/rand"
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
						engines[r], err = New(Config{Stage: stage, BucketBytes: 1 << 20, Overlap: overlap, GradAccumSteps: backwards}, comms[r], params)
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
