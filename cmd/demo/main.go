// Command demo runs ZeRO gradient reduction across in-process ranks on the
// CPU and prints, per stage, what one step moved, held and cost, checked
// against a float64 reference.
package main

import (
	"flag"
	"fmt"
	"math"
	"math/rand"
	"os"
	"sort"
	"strconv"
	"strings"
	"sync"
	"time"

	"zero"
)

func main() {
	world := flag.Int("world", 4, "ranks in the in-process group")
	layers := flag.Int("layers", 8, "layers of the MLP")
	hidden := flag.Int("hidden", 1024, "hidden size (each layer: hidden×hidden weight + bias)")
	backwards := flag.Int("backwards", 4, "backwards per step")
	bucketMiB := flag.Int("bucket", 8, "bucket size in MiB")
	steps := flag.Int("steps", 3, "timed steps per row (the median is shown)")
	stages := flag.String("stages", "1,2,3", "stages to run")
	flag.Parse()

	params := mlp(*layers, *hidden)
	n := 0
	for _, p := range params {
		n += p.Count
	}
	fmt.Printf("zero demo: %d ranks in one process, MLP %d×%d (%.1fM params, %.0f MiB of bf16 gradient per rank), %d backwards per step, %d MiB buckets\n\n",
		*world, *layers, *hidden, float64(n)/1e6, float64(2*n)/(1<<20), *backwards, *bucketMiB)
	data := makeData(params, *world, *backwards)
	fmt.Printf("%-6s %-8s %12s %12s %12s %10s %10s %10s %10s %10s\n", "stage", "overlap", "collectives", "payload MiB", "wire MiB", "peak MiB", "resid MiB", "wall ms", "reduce ms", "max err")
	for _, s := range strings.Split(*stages, ",") {
		stage, err := strconv.Atoi(strings.TrimSpace(s))
		if err != nil {
			fail(err)
		}
		for _, overlap := range []bool{true, false} {
			cfg := zero.Config{Stage: stage, BucketBytes: *bucketMiB << 20, Overlap: overlap}
			row, err := run(cfg, params, data, *steps)
			if err != nil {
				fail(err)
			}
			c := row.stats.Collectives.Total()
			fmt.Printf("ZeRO-%-1d  %-8v %12d %12.1f %12.1f %10.1f %10.1f %10.1f %10.1f %10.1e\n", stage, overlap, c.Calls,
				mib(c.PayloadBytes), mib(c.WireBytes), mib(row.stats.PeakGradBytes), mib(row.stats.ResidentGradBytes),
				ms(row.wall), ms(row.stats.ReduceTime), row.maxErr)
		}
	}
	fmt.Println("\nper rank; collectives, payload and wire are per step (wire: ring model; collectives include Step's")
	fmt.Println("8-byte window check); memory is gradient memory (fp32 shard, ZeRO-1's fp32 local sums, bucket staging);")
	fmt.Println("max err: relative to Σ|g|, against a float64 mean")
}

func mlp(layers, hidden int) []zero.Param {
	var ps []zero.Param
	for l := range layers {
		ps = append(ps, zero.Param{Name: fmt.Sprintf("l%d.w", l), Count: hidden * hidden, DType: zero.BF16},
			zero.Param{Name: fmt.Sprintf("l%d.b", l), Count: hidden, DType: zero.BF16})
	}
	return ps
}

// data[rank][backward][param] holds bf16 gradient bits.
func makeData(params []zero.Param, world, backwards int) [][][][]uint16 {
	d := make([][][][]uint16, world)
	for r := range d {
		rng := rand.New(rand.NewSource(int64(r + 1)))
		d[r] = make([][][]uint16, backwards)
		for k := range d[r] {
			d[r][k] = make([][]uint16, len(params))
			for p, q := range params {
				g := make([]uint16, q.Count)
				for i := range g {
					g[i] = uint16(math.Float32bits(float32(rng.NormFloat64())) >> 16) // truncation is fine for data
				}
				d[r][k][p] = g
			}
		}
	}
	return d
}

type row struct {
	stats  zero.Stats
	wall   time.Duration
	maxErr float64
}

func run(cfg zero.Config, params []zero.Param, data [][][][]uint16, steps int) (row, error) {
	world := len(data)
	comms, err := zero.NewLocalGroup(world)
	if err != nil {
		return row{}, err
	}
	rows := make([]row, world)
	errs := make([]error, world)
	var wg sync.WaitGroup
	for r := range world {
		wg.Add(1)
		go func() {
			defer wg.Done()
			rows[r], errs[r] = runRank(cfg, comms[r], params, data, steps)
		}()
	}
	wg.Wait()
	for _, err := range errs {
		if err != nil {
			return row{}, err
		}
	}
	return rows[0], nil
}

func runRank(cfg zero.Config, comm zero.Comm, params []zero.Param, data [][][][]uint16, steps int) (row, error) {
	defer comm.Close()
	e, err := zero.New(cfg, comm, params)
	if err != nil {
		return row{}, err
	}
	defer e.Close()
	s := zero.NewHostStream()
	defer s.Close()
	var walls []time.Duration
	for range steps + 1 { // the first step warms up
		t0 := time.Now()
		for k := range data[0] {
			for p := len(params) - 1; p >= 0; p-- {
				if _, err := e.GradReady(p, zero.Halfs(data[comm.Rank()][k][p], zero.BF16), s); err != nil {
					return row{}, err
				}
			}
			if err := e.EndBackward(); err != nil {
				return row{}, err
			}
		}
		if err := e.Step(); err != nil {
			return row{}, err
		}
		walls = append(walls, time.Since(t0))
	}
	full, err := e.FullGrads()
	if err != nil {
		return row{}, err
	}
	walls = walls[1:]
	sort.Slice(walls, func(i, j int) bool { return walls[i] < walls[j] })
	return row{stats: e.Stats(), wall: walls[len(walls)/2], maxErr: maxError(full, data)}, nil
}

// maxError compares a sample of the averaged gradient with the float64 mean.
func maxError(full [][]float32, data [][][][]uint16) float64 {
	worst := 0.0
	world, backwards := len(data), len(data[0])
	for p := range full {
		for i := 0; i < len(full[p]); i += 97 {
			sum, mag := 0.0, 0.0
			for r := range world {
				for k := range backwards {
					v := float64(math.Float32frombits(uint32(data[r][k][p][i]) << 16))
					sum += v
					mag += math.Abs(v)
				}
			}
			n := float64(world * backwards)
			worst = math.Max(worst, math.Abs(float64(full[p][i])-sum/n)/(mag/n))
		}
	}
	return worst
}

func mib(b int64) float64        { return float64(b) / (1 << 20) }
func ms(d time.Duration) float64 { return float64(d.Microseconds()) / 1000 }
func fail(err error)             { fmt.Fprintln(os.Stderr, "demo:", err); os.Exit(1) }
