package zero

import (
	"fmt"
	"os"
	"testing"
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
//
// Its body, exposedReduceRun (benchenv_test.go), runs on the GPU too
// (BenchmarkCUDAExposedReduce).
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
		params := exposedParams(sh.layers, sh.hidden)
		layer := 2 * (sh.hidden*sh.hidden + sh.hidden + 64)
		for _, v := range []struct {
			name    string
			bucket  int
			staging int
		}{{"layer", layer, 2}, {"layer", layer, 4}, {"quarter", layer / 4, 2}, {"two", 2 * layer, 2}} {
			b.Run(fmt.Sprintf("%s/bucket=%s/staging=%d", sh.name, v.name, v.staging), func(b *testing.B) {
				exposedReduceRun(b, hostBench, hashedHostGrads, params, Config{Stage: 2, BucketBytes: v.bucket, Overlap: true, StagingBuffers: v.staging})
			})
		}
	}
}
