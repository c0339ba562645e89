package zero

import (
	"bytes"
	"context"
	"encoding/binary"
	"encoding/gob"
	"fmt"
	"math"
	"math/rand"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"
)

// The MPI tests run ranks as processes: this test binary, started by
// mpiexec with ZERO_MPI_WORKER naming a scenario, runs TestMPIWorker, which
// plays the scenario on its rank and writes what it saw into
// ZERO_MPI_OUT; the test that launched it compares that with the
// in-process group's run of the same scenario, bit for bit.
//
// MPI comes from ZERO_MPI_HOME (scripts/install-mpi.sh prints it; .ci/run
// sets it): with it set, a missing or broken MPI fails the tests. Without
// it they use .mpi/ at the repository root or an mpiexec on PATH, and skip,
// naming what to install, where there is none.

// mpiInstall is where the tests find MPI.
type mpiInstall struct {
	mpiexec string // Hydra's mpiexec
	library string // libmpi.so.12
	home    string
}

func findMPI(t testing.TB) mpiInstall {
	t.Helper()
	home := os.Getenv("ZERO_MPI_HOME")
	required := home != "" || os.Getenv("CI") == "true"
	var candidates []string
	if home != "" {
		candidates = []string{home}
	} else {
		if abs, err := filepath.Abs(".mpi"); err == nil {
			candidates = append(candidates, abs)
		}
		if p, err := exec.LookPath("mpiexec"); err == nil {
			candidates = append(candidates, filepath.Dir(filepath.Dir(p)))
		}
	}
	var tried []string
	for _, h := range candidates {
		mpiexec := filepath.Join(h, "bin", "mpiexec")
		if _, err := os.Stat(mpiexec); err != nil {
			tried = append(tried, mpiexec+": "+err.Error())
			continue
		}
		for _, lib := range []string{filepath.Join(h, "lib", "libmpi.so.12"), filepath.Join(h, "lib", "x86_64-linux-gnu", "libmpi.so.12"), "libmpi.so.12"} {
			if _, _, err := MPIVersion(lib); err == nil {
				return mpiInstall{mpiexec: mpiexec, library: lib, home: h}
			} else {
				tried = append(tried, err.Error())
			}
		}
	}
	msg := fmt.Sprintf("no MPI found (%s): run scripts/install-mpi.sh and set ZERO_MPI_HOME to the folder it prints (.ci/run does), or apt-get install mpich", strings.Join(tried, "; "))
	if required {
		t.Fatal(msg)
	}
	t.Skip(msg)
	return mpiInstall{}
}

// mpiRun is one mpiexec job of workers.
type mpiRun struct {
	n        int
	scenario string
	env      []string      // added to the workers' environment
	args     []string      // mpiexec's own options, before -n
	timeout  time.Duration // of the whole job (default 2 minutes)
}

// mpiResult is what a job did.
type mpiResult struct {
	out     string
	err     error // mpiexec's exit
	elapsed time.Duration
	dir     string // the workers' ZERO_MPI_OUT
}

// launch runs the workers of r under mpiexec and returns when mpiexec
// exits or the job's timeout passes (then the test fails: a hang).
func (m mpiInstall) launch(t *testing.T, r mpiRun) mpiResult {
	t.Helper()
	if r.timeout == 0 {
		r.timeout = 2 * time.Minute
	}
	dir := t.TempDir()
	args := append(append([]string{}, r.args...), "-n", strconv.Itoa(r.n), os.Args[0], "-test.run=^TestMPIWorker$", "-test.v")
	ctx, cancel := context.WithTimeout(context.Background(), r.timeout)
	defer cancel()
	cmd := exec.CommandContext(ctx, m.mpiexec, args...)
	cmd.Env = append(os.Environ(), "ZERO_MPI_WORKER="+r.scenario, "ZERO_MPI_OUT="+dir, "ZERO_MPI_LIBRARY="+m.library)
	cmd.Env = append(cmd.Env, r.env...)
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	// on the timeout: SIGINT, on which Hydra ends every process, then the group
	cmd.Cancel = func() error { return cmd.Process.Signal(os.Interrupt) }
	cmd.WaitDelay = 10 * time.Second
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	t0 := time.Now()
	err := cmd.Run()
	res := mpiResult{out: out.String(), err: err, elapsed: time.Since(t0), dir: dir}
	if cmd.Process != nil {
		syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL) // nothing of the job outlives it
	}
	if ctx.Err() != nil {
		t.Fatalf("mpiexec -n %d (%s) hung: killed after %v\n%s", r.n, r.scenario, r.timeout, res.out)
	}
	return res
}

// mustSucceed fails t unless the job exited 0.
func (res mpiResult) mustSucceed(t *testing.T, what string) {
	t.Helper()
	if res.err != nil {
		t.Fatalf("%s: mpiexec: %v\n%s", what, res.err, res.out)
	}
}

// TestMPIWorker is one rank of an MPI job; it runs only under mpiexec with
// ZERO_MPI_WORKER set.
func TestMPIWorker(t *testing.T) {
	scenario := os.Getenv("ZERO_MPI_WORKER")
	if scenario == "" {
		t.Skip("a rank of the MPI tests: runs under mpiexec only")
	}
	fn := mpiScenarios[scenario]
	if fn == nil {
		t.Fatalf("ZERO_MPI_WORKER=%q: no such scenario", scenario)
	}
	comm, err := NewMPIFromEnv()
	if err != nil {
		t.Fatal(err)
	}
	if err := fn(comm, os.Getenv("ZERO_MPI_OUT")); err != nil {
		AbortComm(comm, err)
		t.Fatalf("rank %d: %v", comm.Rank(), err)
	}
	if err := comm.Close(); err != nil {
		t.Fatal(err)
	}
	if err := MPIFinalize(); err != nil {
		t.Fatal(err)
	}

}

// mpiScenarios are the workers' parts, by name.
var mpiScenarios = map[string]func(comm Comm, dir string) error{
	"collectives": collectivesScenario,
	"engine":      engineScenario,
}

func envInt(name string) int {
	v, _ := strconv.Atoi(os.Getenv(name))
	return v
}

func envSeed() int64 {
	v, _ := strconv.ParseInt(os.Getenv("ZERO_TEST_SEED"), 10, 64)
	return v
}

// ---- the collectives, bit for bit ----------------------------------------------

// collCase is one collective of the sequence both groups run.
type collCase struct {
	kind   CollectiveKind
	dtype  DType
	op     ReduceOp
	count  int // elements of the full buffer
	root   int
	alias  bool // recv is chunk Rank() of send (reduce-scatter), send chunk Rank() of recv (all-gather)
	stream int  // which of two streams
}

// collCases draws the sequence: every kind, dtype and op, sizes from one
// element to a few cache lines per rank and some large enough to cross
// the all-reduce's part boundaries.
func collCases(seed int64, world int) []collCase {
	rng := rand.New(rand.NewSource(seed))
	var cs []collCase
	for _, kind := range []CollectiveKind{KindAllReduce, KindReduceScatter, KindAllGather, KindBroadcast} {
		for _, dt := range []DType{FP32, BF16, FP16} {
			for _, op := range []ReduceOp{OpSum, OpAvg, OpMax} {
				if (kind == KindAllGather || kind == KindBroadcast) && op != OpSum {
					continue
				}
				for _, per := range []int{1, 1 + rng.Intn(200), 300 + rng.Intn(3000)} {
					c := collCase{kind: kind, dtype: dt, op: op, count: per * world, root: rng.Intn(world), alias: rng.Intn(2) == 0, stream: rng.Intn(2)}
					if kind == KindAllReduce || kind == KindBroadcast {
						c.count = per + rng.Intn(world)
					}
					cs = append(cs, c)
				}
			}
		}
	}
	rng.Shuffle(len(cs), func(i, j int) { cs[i], cs[j] = cs[j], cs[i] })
	return cs
}

// collInput is rank's input of case i: normal values in the dtype.
func collInput(seed int64, i, rank int, c collCase) []byte {
	rng := rand.New(rand.NewSource(seed ^ int64(i)<<20 ^ int64(rank)<<40))
	elems := c.count // the full buffer (an all-gather sends this rank's part of it)
	out := make([]byte, elems*c.dtype.Size())
	for k := range elems {
		f := float32(rng.NormFloat64() * 4)
		switch c.dtype {
		case FP32:
			binary.LittleEndian.PutUint32(out[4*k:], math.Float32bits(f))
		case BF16:
			binary.LittleEndian.PutUint16(out[2*k:], bf16FromFloat(f))
		default:
			binary.LittleEndian.PutUint16(out[2*k:], fp16FromFloat(f))
		}
	}
	return out
}

// runCollCases runs the cases on comm and returns, per case, the bytes of
// the output buffer.
func runCollCases(comm Comm, seed int64, cases []collCase) ([][]byte, error) {
	dev := comm.Device()
	streams := [2]Stream{}
	for i := range streams {
		s, err := dev.NewStream()
		if err != nil {
			return nil, err
		}
		defer s.Close()
		streams[i] = s
	}
	W, r := comm.Size(), comm.Rank()
	type buf struct{ send, recv Tensor }
	bufs := make([]buf, len(cases))
	for i, c := range cases {
		in := collInput(seed, i, r, c)
		full, err := dev.Alloc(c.count, c.dtype)
		if err != nil {
			return nil, err
		}
		copy(full.hostBytes(), in)
		b := buf{send: full, recv: full}
		switch c.kind {
		case KindReduceScatter:
			if c.alias {
				b.recv = full.slice(r*c.count/W, c.count/W)
			} else if b.recv, err = dev.Alloc(c.count/W, c.dtype); err != nil {
				return nil, err
			}
		case KindAllGather:
			part := c.count / W
			if c.alias {
				b.send = full.slice(r*part, part)
			} else {
				if b.send, err = dev.Alloc(part, c.dtype); err != nil {
					return nil, err
				}
				copy(b.send.hostBytes(), in[r*part*c.dtype.Size():])
				clear(full.hostBytes()) // the gather must fill every part
			}
		}
		bufs[i] = b
		s := streams[c.stream]
		switch c.kind {
		case KindAllReduce:
			err = comm.AllReduce(s, b.send, c.op)
		case KindReduceScatter:
			err = comm.ReduceScatter(s, b.send, b.recv, c.op)
		case KindAllGather:
			err = comm.AllGather(s, b.send, b.recv)
		case KindBroadcast:
			err = comm.Broadcast(s, b.send, c.root)
		}
		if err != nil {
			return nil, fmt.Errorf("case %d (%+v): %w", i, c, err)
		}
	}
	for _, s := range streams {
		if err := s.Sync(); err != nil {
			return nil, err
		}
	}
	out := make([][]byte, len(cases))
	for i, b := range bufs {
		out[i] = append([]byte(nil), b.recv.hostBytes()...)
	}
	return out, nil
}

func collectivesScenario(comm Comm, dir string) error {
	seed := envSeed()
	outs, err := runCollCases(comm, seed, collCases(seed, comm.Size()))
	if err != nil {
		return err
	}
	return os.WriteFile(filepath.Join(dir, fmt.Sprintf("coll-%d.bin", comm.Rank())), bytes.Join(outs, nil), 0o644)
}

// TestMPICollectivesMatchLocalGroup: every collective of every dtype and
// op, on 2, 3 and 4 processes, some aliased, on two streams at once, gives
// the in-process group's bits on every rank.
func TestMPICollectivesMatchLocalGroup(t *testing.T) {
	m := findMPI(t)
	seed := testSeed(t)
	for _, w := range []int{2, 3, 4} {
		t.Run(fmt.Sprintf("W%d", w), func(t *testing.T) {
			cases := collCases(seed, w)
			want := make([][][]byte, w)
			err := RunLocal(w, func(comm Comm) error {
				out, err := runCollCases(comm, seed, cases)
				want[comm.Rank()] = out
				return err
			})
			if err != nil {
				t.Fatal(err)
			}
			res := m.launch(t, mpiRun{n: w, scenario: "collectives", env: []string{fmt.Sprintf("ZERO_TEST_SEED=%d", seed)}})
			res.mustSucceed(t, "collectives")
			for r := range w {
				got, err := os.ReadFile(filepath.Join(res.dir, fmt.Sprintf("coll-%d.bin", r)))
				if err != nil {
					t.Fatal(err)
				}
				if !bytes.Equal(got, bytes.Join(want[r], nil)) {
					off := 0
					for i, wb := range want[r] {
						if !bytes.Equal(got[off:min(off+len(wb), len(got))], wb) {
							t.Fatalf("rank %d, case %d (%+v): MPI differs from the in-process group at byte %d", r, i, cases[i], firstByteDiff(got[off:min(off+len(wb), len(got))], wb))
						}
						off += len(wb)
					}
					t.Fatalf("rank %d: %d bytes, want %d", r, len(got), off)
				}
			}
		})
	}
}

// ---- the engine over MPI, bit for bit --------------------------------------------

// mpiEngineSpecs are the engine runs TestMPIEngineMatchesLocalGroup repeats
// over MPI: every stage, the three dtypes, windows of both kinds, offload,
// Overlap, several producer streams in a shuffled order, pre-division.
var mpiEngineSpecs = []runSpec{
	{stage: 1, world: 2, dtype: FP32, bucket: 512, backwards: 2, overlap: true, streams: 2, shuffle: true, steps: 3, predivide: 1},
	{stage: 2, world: 3, dtype: BF16, bucket: 256, backwards: 3, streams: 2, shuffle: true, steps: 3, window: "coalesce", windowEvery: true, predivide: 2},
	{stage: 3, world: 2, dtype: FP16, bucket: 640, backwards: 2, overlap: true, steps: 3, window: "nosync", offload: true, predivide: 1},
	{stage: 2, world: 4, dtype: BF16, comm: FP32, bucket: 384, backwards: 2, steps: 2, window: "coalesce", budget: 2048, offload: true, predivide: 1},
}

// engineRecord is what a rank read back: its shard and the full gradients,
// per step.
type engineRecord struct {
	Shard [][]float32
	Full  [][][]float32
}

func engineScenario(comm Comm, dir string) error {
	i := envInt("ZERO_MPI_SPEC")
	r, seed := mpiEngineSpecs[i], envSeed()
	if r.world != comm.Size() {
		return fmt.Errorf("spec %d is for %d ranks, not %d", i, r.world, comm.Size())
	}
	params := testParams(r.dtype)
	data := makeWorkload(rand.New(rand.NewSource(seed)), r, params)
	var out rankResult
	grad := func(step, k, p int) Tensor { return data[step][k][comm.Rank()][p].t }
	if err := rankLoop(r.config(), comm, CPU(), r, params, grad, seed, &out); err != nil {
		return err
	}
	f, err := os.Create(filepath.Join(dir, fmt.Sprintf("engine-%d.gob", comm.Rank())))
	if err != nil {
		return err
	}
	defer f.Close()
	return gob.NewEncoder(f).Encode(engineRecord{out.shard, out.full})
}

// TestMPIEngineMatchesLocalGroup: the backward protocol over MPI processes
// gives every rank the in-process group's reduced gradients, bit for bit,
// in every stage and window, with offload.
func TestMPIEngineMatchesLocalGroup(t *testing.T) {
	m := findMPI(t)
	seed := testSeed(t)
	for i, r := range mpiEngineSpecs {
		t.Run(r.String(), func(t *testing.T) {
			params := testParams(r.dtype)
			want := runEngine(t, r, params, makeWorkload(rand.New(rand.NewSource(seed)), r, params), seed)
			res := m.launch(t, mpiRun{n: r.world, scenario: "engine", env: []string{fmt.Sprintf("ZERO_TEST_SEED=%d", seed), fmt.Sprintf("ZERO_MPI_SPEC=%d", i)}})
			res.mustSucceed(t, r.String())
			got := make([]rankResult, r.world)
			for rank := range got {
				f, err := os.Open(filepath.Join(res.dir, fmt.Sprintf("engine-%d.gob", rank)))
				if err != nil {
					t.Fatal(err)
				}
				var rec engineRecord
				err = gob.NewDecoder(f).Decode(&rec)
				f.Close()
				if err != nil {
					t.Fatal(err)
				}
				got[rank] = rankResult{shard: rec.Shard, full: rec.Full}
				if len(rec.Shard) != r.steps {
					t.Fatalf("rank %d recorded %d steps, want %d", rank, len(rec.Shard), r.steps)
				}
				for st := range rec.Full {
					for p := range rec.Full[st] {
						for k, x := range rec.Full[st][p] {
							if y := want[rank].full[st][p][k]; math.Float32bits(x) != math.Float32bits(y) {
								t.Fatalf("rank %d step %d param %d [%d]: MPI %x, in-process %x", rank, st, p, k, math.Float32bits(x), math.Float32bits(y))
							}
						}
					}
				}
			}
			if err := sameShards(want, got); err != nil {
				t.Fatal(err)
			}
		})
	}
}
