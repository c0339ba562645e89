package zero

import (
	"bytes"
	"context"
	"encoding/binary"
	"encoding/gob"
	"errors"
	"fmt"
	"math"
	"math/rand"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"runtime"
	"slices"
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
		for _, lib := range []string{filepath.Join(h, "lib", "libmpi.so.12"), filepath.Join(h, "lib", "x86_64-linux-gnu", "libmpich.so.12"), "libmpi.so.12"} {
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
	dir      string        // the workers' ZERO_MPI_OUT (default: a new one)
	// survive runs each rank under a shell that outlives it, so that
	// Hydra sees a rank SIGKILLed as an exit status, not a death by a
	// signal (which makes it kill the whole job, whatever
	// -disable-auto-cleanup says): with -disable-auto-cleanup the other
	// ranks live on, as under a launcher that leaves them running. The
	// shell takes the SIGUSR1 Hydra sends them.
	survive bool
	// colors splits the job into groups of n/colors processes, each with
	// its ZERO_MPI_COLOR (0 none).
	colors int
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
	dir := r.dir
	if dir == "" {
		dir = t.TempDir()
	}
	args := append([]string{}, r.args...)
	for c := range max(r.colors, 1) {
		if c > 0 {
			args = append(args, ":")
		}
		args = append(args, "-n", strconv.Itoa(r.n/max(r.colors, 1)))
		if r.colors > 0 { // one MPMD segment per group
			args = append(args, "-env", "ZERO_MPI_COLOR", strconv.Itoa(c))
		}
		if r.survive {
			args = append(args, "/bin/sh", "-c", `trap : USR1; "$@"`, "sh")
		}
		args = append(args, os.Args[0], "-test.run=^TestMPIWorker$", "-test.v")
	}
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
	dir := os.Getenv("ZERO_MPI_OUT")
	rank := os.Getenv("PMI_RANK")
	os.WriteFile(filepath.Join(dir, "pid-"+rank), []byte(strconv.Itoa(os.Getpid())), 0o644)
	comm, err := NewMPIFromEnv()
	if err != nil {
		t.Fatal(err)
	}
	if err := fn(comm, dir); err != nil {
		AbortComm(comm, err)
		// each rank's own error, for the test that launched the job
		os.WriteFile(filepath.Join(dir, fmt.Sprintf("err-%d", comm.Rank())), []byte(err.Error()), 0o644)
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
	"train":       trainScenario,
	"mismatch":    mismatchScenario,
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
	if want := os.Getenv("ZERO_MPI_EXPECT_ABI"); want != "" {
		if got := comm.(*mpiComm).th.abi; got != want {
			return fmt.Errorf("MPI speaks the %s ABI, want %s", got, want)
		}
	}
	if got, funneled := comm.(*mpiComm).th.serialized, os.Getenv("ZERO_MPI_THREAD") == "funneled"; got == funneled {
		return fmt.Errorf("the waiters poll: %v, with ZERO_MPI_THREAD=%q", got, os.Getenv("ZERO_MPI_THREAD"))
	}
	// every process of the job is on this host: the launcher's world
	host, err := strconv.Atoi(os.Getenv("PMI_SIZE"))
	if err != nil {
		return fmt.Errorf("PMI_SIZE: %v", err)
	}
	if set := os.Getenv("GOMAXPROCS"); set != "" {
		if got := runtime.GOMAXPROCS(0); strconv.Itoa(got) != set {
			return fmt.Errorf("GOMAXPROCS %d, where the environment set %s", got, set)
		}
	} else if got, share := runtime.GOMAXPROCS(0), max(1, runtime.NumCPU()/host); got > share {
		return fmt.Errorf("GOMAXPROCS %d with %d processes on %d CPUs; want at most %d", got, host, runtime.NumCPU(), share)
	}
	seed := envSeed()
	outs, err := runCollCases(comm, seed, collCases(seed, comm.Size()))
	if err != nil {
		return err
	}
	if err := ownAgrees(comm.(*mpiComm)); err != nil {
		return err
	}
	name := fmt.Sprintf("coll-%d.bin", comm.Rank())
	if c := os.Getenv("ZERO_MPI_COLOR"); c != "" {
		name = fmt.Sprintf("coll-%s-%d.bin", c, comm.Rank())
	}
	return os.WriteFile(filepath.Join(dir, name), bytes.Join(outs, nil), 0o644)
}

// ownAgrees: MPI's own reduce-scatter and all-gather, the yardstick of
// BenchmarkMPICollectives (twice in its C loop), give zero's results on
// integer-valued fp32, which every order of summing gives exactly: the
// ABI's handles of MPI_FLOAT and MPI_SUM, the counts and the buffers' roles.
func ownAgrees(c *mpiComm) error {
	W, r := c.Size(), c.Rank()
	const part = 1000
	full := make([]float32, W*part)
	for i := range full {
		full[i] = float32((r+1)*(i%97) - 40*r)
	}
	s := NewHostStream()
	defer s.Close()
	for _, kind := range []CollectiveKind{KindReduceScatter, KindAllGather} {
		zeroOut, ownOut := make([]float32, W*part), make([]float32, W*part)
		send, zeroRecv, ownRecv := Float32s(full), Float32s(zeroOut[:part]), Float32s(ownOut[:part])
		if kind == KindAllGather {
			send, zeroRecv, ownRecv = Float32s(full[r*part:(r+1)*part]), Float32s(zeroOut), Float32s(ownOut)
		}
		err := syncedCollective(c, s, kind, send, zeroRecv)
		if err == nil {
			err = c.mpiOwn(kind, send, ownRecv, 2)
		}
		if err != nil {
			return err
		}
		for i := range zeroOut {
			if zeroOut[i] != ownOut[i] {
				return fmt.Errorf("MPI's own %v: element %d is %v, zero's %v", kind, i, ownOut[i], zeroOut[i])
			}
		}
	}
	return nil
}

// TestMPICollectivesMatchLocalGroup: every collective of every dtype and
// op, on 2, 3 and 4 processes, some aliased, on two streams at once, gives
// the in-process group's bits on every rank, with the waiters polling MPI
// (serialized; at W=2 with GOMAXPROCS=2, so that two streams' waiters poll
// at once) and with MPI's thread polling for them (funneled).
func TestMPICollectivesMatchLocalGroup(t *testing.T) {
	m := findMPI(t)
	seed := testSeed(t)
	for _, tc := range []struct {
		w      int
		thread string
		env    string
	}{{2, "serialized", "GOMAXPROCS=2"}, {3, "serialized", ""}, {4, "serialized", ""}, {2, "funneled", ""}, {4, "funneled", "GOMAXPROCS=2"}} {
		w := tc.w
		t.Run(fmt.Sprintf("W%d/%s", w, tc.thread), func(t *testing.T) {
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
			env := []string{fmt.Sprintf("ZERO_TEST_SEED=%d", seed), "ZERO_MPI_THREAD=" + tc.thread}
			if tc.env != "" {
				env = append(env, tc.env)
			}
			res := m.launch(t, mpiRun{n: w, scenario: "collectives", env: env})
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

// TestMPISplit: 4 processes in 2 groups (ZERO_MPI_COLOR, MPI_Comm_split):
// each group of 2 runs the collectives on its own and gives the bits of an
// in-process group of 2.
func TestMPISplit(t *testing.T) {
	m := findMPI(t)
	seed := testSeed(t)
	cases := collCases(seed, 2)
	want := make([][][]byte, 2)
	if err := RunLocal(2, func(comm Comm) error {
		out, err := runCollCases(comm, seed, cases)
		want[comm.Rank()] = out
		return err
	}); err != nil {
		t.Fatal(err)
	}
	res := m.launch(t, mpiRun{n: 4, colors: 2, scenario: "collectives", env: []string{fmt.Sprintf("ZERO_TEST_SEED=%d", seed)}})
	res.mustSucceed(t, "two groups")
	for c := range 2 {
		for r := range 2 {
			got, err := os.ReadFile(filepath.Join(res.dir, fmt.Sprintf("coll-%d-%d.bin", c, r)))
			if err != nil {
				t.Fatal(err)
			}
			if !bytes.Equal(got, bytes.Join(want[r], nil)) {
				t.Fatalf("group %d, rank %d: differs from the in-process group of 2", c, r)
			}
		}
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

// ---- training processes: failures, checkpoints, resumes ----------------------------

// mpiTrainSpec is one run of trainScenario, passed as ZERO_MPI_TRAIN
// ("key=value,…").
type mpiTrainSpec struct {
	stage, steps int
	save         string // checkpoints into this directory ("%d": the rank's own)
	every, keep  int
	resume       string
	// kill is "rank:step:where": the rank SIGKILLs itself in step (from 1)
	// where is "step" (after its first gradient is handed over), "save"
	// (its rank file written, before the commit), "commit" (rank 0,
	// between the rank files and the manifest) or "between" (after the
	// step and its save, before the next step).
	kill string
	// signal: SIGTERM makes the rank Abort its engine; the rank writes
	// ready-R after its first step and then trains slowly.
	signal bool
	absent int    // this rank never reaches New (−1: none)
	differ string // "bucket" or "model": rank 1 registers another bucket size or model
}

func (sp mpiTrainSpec) String() string {
	return fmt.Sprintf("stage=%d,steps=%d,save=%s,every=%d,keep=%d,resume=%s,kill=%s,signal=%v,absent=%d,differ=%s",
		sp.stage, sp.steps, sp.save, sp.every, sp.keep, sp.resume, sp.kill, sp.signal, sp.absent, sp.differ)
}

func parseTrainSpec(v string) (mpiTrainSpec, error) {
	sp := mpiTrainSpec{absent: -1}
	for _, kv := range strings.Split(v, ",") {
		k, val, _ := strings.Cut(kv, "=")
		n, _ := strconv.Atoi(val)
		switch k {
		case "stage":
			sp.stage = n
		case "steps":
			sp.steps = n
		case "save":
			sp.save = val
		case "every":
			sp.every = n
		case "keep":
			sp.keep = n
		case "resume":
			sp.resume = val
		case "kill":
			sp.kill = val
		case "signal":
			sp.signal = val == "true"
		case "absent":
			sp.absent = n
		case "differ":
			sp.differ = val
		default:
			return sp, fmt.Errorf("ZERO_MPI_TRAIN: unknown key %q", k)
		}
	}
	return sp, nil
}

// killAt reports whether this rank dies at (step, where).
func (sp mpiTrainSpec) killAt(rank, step int, where string) bool {
	return sp.kill == fmt.Sprintf("%d:%d:%s", rank, step, where)
}

func die() {
	syscall.Kill(os.Getpid(), syscall.SIGKILL)
	select {} // the signal is on its way
}

// killFS is the operating system's file layer that kills the process at
// the rename of a file named base (its last element).
type killFS struct {
	osFS
	base func(name string) bool
}

func (k killFS) Rename(from, to string) error {
	if k.base(filepath.Base(from)) {
		die()
	}
	return k.osFS.Rename(from, to)
}

// mpiTrainSizes are the model's parameters: several buckets of 1 KiB.
var mpiTrainSizes = []int{300, 7, 1000, 129, 64}

// mpiTrainRank trains sp on comm: AdamW on gradients drawn from (seed,
// step, rank, parameter), so a run that resumes sees the data the
// uninterrupted one saw. It returns the fp32 parameters at the end.
func mpiTrainRank(comm Comm, sp mpiTrainSpec, seed int64, out string) ([][]float32, error) {
	rank := comm.Rank()
	if rank == sp.absent {
		time.Sleep(time.Hour) // never arrives: the launcher ends it
	}
	sizes := mpiTrainSizes
	if sp.differ == "model" && rank == 1 {
		sizes = append(slices.Clone(sizes[:len(sizes)-1]), 65)
	}
	params := make([]Param, len(sizes))
	init := rand.New(rand.NewSource(seed + int64(rank)))
	for p, n := range sizes {
		x := make([]float32, n)
		for i := range x {
			x[i] = float32(init.NormFloat64())
		}
		params[p] = Param{Name: fmt.Sprint("w", p), Count: n, DType: FP32, Data: Float32s(x), Group: p % 2}
	}
	decay := NewAdamW(0.01)
	decay.WeightDecay = 0.01
	cfg := Config{Stage: sp.stage, BucketBytes: 1024, Optimizer: OptimizerPolicy{Groups: []Optimizer{decay, NewAdamW(0.01)}},
		Params: ParamPolicy{NoBroadcast: sp.resume != ""}}
	if sp.differ == "bucket" && rank == 1 {
		cfg.BucketBytes = 2048
	}
	e, err := New(cfg, comm, params)
	if err != nil {
		return nil, err
	}
	defer e.Close()
	if sp.signal {
		sigs := make(chan os.Signal, 1)
		signal.Notify(sigs, syscall.SIGTERM)
		defer signal.Stop(sigs)
		go func() {
			if s, ok := <-sigs; ok {
				e.Abort(fmt.Errorf("rank %d got %v", rank, s))
			}
		}()
	}
	save := strings.ReplaceAll(sp.save, "%d", strconv.Itoa(rank))
	start := 0
	if sp.resume != "" {
		rep, err := e.Load(sp.resume, LoadOptions{})
		if err != nil {
			return nil, err
		}
		if start, err = strconv.Atoi(string(rep.Client)); err != nil {
			return nil, fmt.Errorf("%s: client state %q: %v", sp.resume, rep.Client, err)
		}
	}
	s := NewHostStream()
	defer s.Close()
	for st := start; st < sp.steps; st++ {
		if sp.killAt(rank, st, "between") {
			die()
		}
		if err := forward(e, s); err != nil { // stage 3 reads its parameters through a Gather
			return nil, err
		}
		for p := len(sizes) - 1; p >= 0; p-- {
			rng := rand.New(rand.NewSource(seed*1_000_003 + int64(st)*10_007 + int64(rank)*101 + int64(p)))
			g := make([]float32, sizes[p])
			for i := range g {
				g[i] = float32(rng.NormFloat64())
			}
			if _, err := e.GradReady(p, Float32s(g), s); err != nil {
				return nil, err
			}
			if sp.killAt(rank, st+1, "step") {
				die()
			}
		}
		if err := e.EndBackward(); err != nil {
			return nil, err
		}
		if err := e.Step(); err != nil {
			return nil, err
		}
		if save != "" && (st+1)%max(sp.every, 1) == 0 {
			switch {
			case sp.killAt(rank, st+1, "save"): // its file written, not yet renamed
				e.files = killFS{base: func(b string) bool { return b == rankFileName(rank)+".tmp" }}
			case sp.killAt(rank, st+1, "commit"): // every file renamed, the directory not yet
				e.files = killFS{base: func(b string) bool { return strings.HasPrefix(b, ckptPartial) }}
			}
			if err := e.Save(save, SaveOptions{Client: []byte(strconv.Itoa(st + 1)), Keep: sp.keep}); err != nil {
				return nil, err
			}
		}
		if sp.signal {
			if st == start {
				os.WriteFile(filepath.Join(out, fmt.Sprintf("ready-%d", rank)), nil, 0o644)
			}
			time.Sleep(20 * time.Millisecond)
		}
	}
	return e.FullParams()
}

func trainScenario(comm Comm, dir string) error {
	sp, err := parseTrainSpec(os.Getenv("ZERO_MPI_TRAIN"))
	if err != nil {
		return err
	}
	final, err := mpiTrainRank(comm, sp, envSeed(), dir)
	if err != nil || comm.Rank() != 0 {
		return err
	}
	f, err := os.Create(filepath.Join(dir, "final.gob"))
	if err != nil {
		return err
	}
	defer f.Close()
	return gob.NewEncoder(f).Encode(final)
}

// trainLocal is sp on w in-process ranks; rank 0's parameters at the end.
func trainLocal(t *testing.T, w int, sp mpiTrainSpec, seed int64) [][]float32 {
	t.Helper()
	var final [][]float32
	err := RunLocal(w, func(comm Comm) error {
		f, err := mpiTrainRank(comm, sp, seed, t.TempDir())
		if comm.Rank() == 0 {
			final = f
		}
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	return final
}

// trainMPI runs sp on w processes.
func (m mpiInstall) trainMPI(t *testing.T, w int, sp mpiTrainSpec, seed int64, timeout time.Duration, mpiexecArgs ...string) mpiResult {
	t.Helper()
	env := []string{"ZERO_MPI_TRAIN=" + sp.String(), fmt.Sprintf("ZERO_TEST_SEED=%d", seed)}
	if timeout > 0 {
		env = append(env, "ZERO_MPI_TIMEOUT="+timeout.String())
	}
	return m.launch(t, mpiRun{n: w, scenario: "train", env: env, args: mpiexecArgs})
}

// final is rank 0's parameters a job wrote.
func (res mpiResult) final(t *testing.T) [][]float32 {
	t.Helper()
	f, err := os.Open(filepath.Join(res.dir, "final.gob"))
	if err != nil {
		t.Fatalf("%v\n%s", err, res.out)
	}
	defer f.Close()
	var out [][]float32
	if err := gob.NewDecoder(f).Decode(&out); err != nil {
		t.Fatal(err)
	}
	return out
}

// rankErr is the error rank r reported (err-R), "" if none.
func (res mpiResult) rankErr(r int) string {
	b, _ := os.ReadFile(filepath.Join(res.dir, fmt.Sprintf("err-%d", r)))
	return string(b)
}

func sameParams(t *testing.T, what string, got, want [][]float32) {
	t.Helper()
	if len(got) != len(want) {
		t.Fatalf("%s: %d parameters, want %d", what, len(got), len(want))
	}
	for p := range want {
		for i := range want[p] {
			if math.Float32bits(got[p][i]) != math.Float32bits(want[p][i]) {
				t.Fatalf("%s: w%d[%d] = %v, want %v (bits differ)", what, p, i, got[p][i], want[p][i])
			}
		}
	}
}

// TestMPIRankKilled: a rank SIGKILLed inside a step, inside a save (its
// file written, or rank 0 between the files and the manifest) and between
// steps. Where the other processes live on (a launcher that leaves them
// running), each fails on its own, with a timeout that names the dead rank
// or a peer's abort notice; none hangs. The checkpoint directory keeps the
// last complete checkpoint, and a resume from it under mpiexec gives the
// uninterrupted run's bits. Hydra itself, by default, ends the others at
// once: a job whose timeout is beyond the test's guard ends in time.
func TestMPIRankKilled(t *testing.T) {
	m := findMPI(t)
	seed := testSeed(t)
	const W, steps = 3, 5
	base := mpiTrainSpec{stage: 2, steps: steps, every: 1, keep: 2, absent: -1}
	want := trainLocal(t, W, base, seed)
	for _, tc := range []struct {
		kill  string
		dead  int
		saved int // the step of the last complete checkpoint
	}{
		{"1:3:step", 1, 2},
		{"2:3:save", 2, 2},
		{"0:3:commit", 0, 2},
		{"1:3:between", 1, 3},
	} {
		t.Run(tc.kill, func(t *testing.T) {
			sp := base
			sp.save, sp.kill = t.TempDir(), tc.kill
			res := m.launch(t, mpiRun{n: W, scenario: "train", survive: true, args: []string{"-disable-auto-cleanup"},
				env: []string{"ZERO_MPI_TRAIN=" + sp.String(), fmt.Sprintf("ZERO_TEST_SEED=%d", seed), "ZERO_MPI_TIMEOUT=3s"}})
			if res.err == nil {
				t.Fatalf("the job succeeded with rank %d killed\n%s", tc.dead, res.out)
			}
			for r := range W {
				msg := res.rankErr(r)
				switch {
				case r == tc.dead && msg != "":
					t.Errorf("the killed rank %d reported %q", r, msg)
				case r != tc.dead && msg == "":
					t.Errorf("rank %d exited without an error of its own\n%s", r, res.out)
				case r != tc.dead && !strings.Contains(msg, fmt.Sprintf("for ranks [%d] of %d", tc.dead, W)) && !strings.Contains(msg, "of the MPI communicator aborted"):
					t.Errorf("rank %d's error names neither rank %d nor a peer's abort: %s", r, tc.dead, msg)
				}
			}
			latest, err := os.ReadFile(filepath.Join(sp.save, ckptLatest))
			if err != nil || strings.TrimSpace(string(latest)) != ckptName(tc.saved, 0) {
				t.Fatalf("latest is %q (%v), want %s", latest, err, ckptName(tc.saved, 0))
			}
			resumed := base
			resumed.resume = sp.save
			again := m.trainMPI(t, W, resumed, seed, 0)
			again.mustSucceed(t, "the resume")
			sameParams(t, "resumed after "+tc.kill, again.final(t), want)
		})
	}
	t.Run("hydra", func(t *testing.T) {
		sp := base
		sp.save, sp.kill = t.TempDir(), "1:3:step"
		// a timeout beyond the job's guard: only the launcher ends the others in time
		res := m.trainMPI(t, W, sp, seed, 10*time.Minute)
		if res.err == nil || !strings.Contains(res.out, "BAD TERMINATION") {
			t.Fatalf("mpiexec: %v; want Hydra's report of the killed rank\n%s", res.err, res.out)
		}
	})
}

// TestMPICheckpointsAcrossProcesses: 4 processes save into one directory
// (every step, Keep 2): the directory holds the 2 newest complete
// checkpoints, each with its manifest and the 4 rank files, latest names
// the newest, and no partial directory is left. 2 processes resume from it
// (a reshard) and give the bits of the same resume in one process.
// Directories that are not shared (each process its own, as on node-local
// disks) fail the save on every rank: at rank 1's write, where only rank 0
// made the partial directory, and at rank 0's check that it sees every
// rank's file, where rank 1 could write.
func TestMPICheckpointsAcrossProcesses(t *testing.T) {
	m := findMPI(t)
	seed := testSeed(t)
	dir := t.TempDir()
	sp := mpiTrainSpec{stage: 3, steps: 3, save: dir, every: 1, keep: 2, absent: -1}
	m.trainMPI(t, 4, sp, seed, 0).mustSucceed(t, "4 processes saving")
	ents, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, e := range ents {
		names = append(names, e.Name())
	}
	if want := []string{ckptLatest, ckptName(2, 0), ckptName(3, 0)}; !slices.Equal(names, want) {
		t.Fatalf("the directory holds %v, want %v", names, want)
	}
	for _, st := range []int{2, 3} {
		for _, f := range []string{ckptManifest, rankFileName(0), rankFileName(1), rankFileName(2), rankFileName(3)} {
			if _, err := os.Stat(filepath.Join(dir, ckptName(st, 0), f)); err != nil {
				t.Fatal(err)
			}
		}
	}
	// the same resume on 2 ranks, over MPI and in one process
	local := t.TempDir()
	trainLocal(t, 4, with(sp, func(s *mpiTrainSpec) { s.save = local }), seed)
	resume := mpiTrainSpec{stage: 2, steps: 5, resume: dir, absent: -1}
	got := m.trainMPI(t, 2, resume, seed, 0)
	got.mustSucceed(t, "2 processes resuming 4's checkpoint")
	want := trainLocal(t, 2, with(resume, func(s *mpiTrainSpec) { s.resume = local }), seed)
	sameParams(t, "resumed on 2 processes", got.final(t), want)

	// every process its own directory
	own := t.TempDir()
	res := m.trainMPI(t, 2, mpiTrainSpec{stage: 2, steps: 1, save: filepath.Join(own, "rank%d"), absent: -1}, seed, 30*time.Second, "-disable-auto-cleanup")
	if res.err == nil {
		t.Fatalf("a save into directories the ranks do not share succeeded\n%s", res.out)
	}
	for r := range 2 {
		if msg := res.rankErr(r); !strings.Contains(msg, ErrCheckpoint.Error()) {
			t.Errorf("rank %d: %q, want an error wrapping ErrCheckpoint", r, msg)
		}
	}
	if _, err := os.Stat(filepath.Join(own, "rank0", ckptLatest)); err == nil {
		t.Error("rank 0 committed a checkpoint without rank 1's file")
	}
	// the same, where rank 1's disk has the partial directory too (an
	// earlier attempt left it): rank 1 finds no lock of rank 0's save there
	// (and, were it to write its file, rank 0's check that it sees every
	// rank's file would refuse the commit): one of them names the fix
	other := t.TempDir()
	if err := os.MkdirAll(filepath.Join(other, "rank1", ckptPartial+ckptName(1, 0)), 0o755); err != nil {
		t.Fatal(err)
	}
	res = m.trainMPI(t, 2, mpiTrainSpec{stage: 2, steps: 1, save: filepath.Join(other, "rank%d"), absent: -1}, seed, 30*time.Second, "-disable-auto-cleanup")
	if msg := res.rankErr(0) + "; " + res.rankErr(1); !strings.Contains(msg, "every rank shares") {
		t.Errorf("ranks 0 and 1: %q, want the check that every rank's file is in one shared directory\n%s", msg, res.out)
	}
	if msg := res.rankErr(1); !strings.Contains(msg, ErrCheckpoint.Error()) {
		t.Errorf("rank 1: %q, want ErrCheckpoint", msg)
	}
	if _, err := os.Stat(filepath.Join(other, "rank0", ckptLatest)); err == nil {
		t.Error("rank 0 committed a checkpoint without seeing rank 1's file")
	}
}

// TestMPIRanksThatDisagree: processes that start with different settings
// (a bucket size) or different models each fail in New with
// ErrPlanMismatch, and a rank that never arrives makes the others time out
// naming it (the first to exit makes Hydra end the job, the absent rank
// with it).
func TestMPIRanksThatDisagree(t *testing.T) {
	m := findMPI(t)
	seed := testSeed(t)
	for _, differ := range []string{"bucket", "model"} {
		res := m.trainMPI(t, 2, mpiTrainSpec{stage: 2, steps: 1, differ: differ, absent: -1}, seed, 30*time.Second, "-disable-auto-cleanup")
		for r := range 2 {
			if msg := res.rankErr(r); !strings.Contains(msg, ErrPlanMismatch.Error()) {
				t.Errorf("%s: rank %d: %q, want ErrPlanMismatch\n%s", differ, r, msg, res.out)
			}
		}
	}
	res := m.launch(t, mpiRun{n: 3, scenario: "train", timeout: time.Minute,
		env: []string{"ZERO_MPI_TRAIN=" + mpiTrainSpec{stage: 2, steps: 1, absent: 2}.String(), fmt.Sprintf("ZERO_TEST_SEED=%d", seed), "ZERO_MPI_TIMEOUT=2s"}})
	// the first rank to fail exits and Hydra ends the job: the other may
	// have been ended before it reported
	for r := range 2 {
		msg := res.rankErr(r)
		if msg != "" && !strings.Contains(msg, ErrTimeout.Error()) && !strings.Contains(msg, "aborted") {
			t.Errorf("rank %d: %q, want a timeout (or the other's abort)\n%s", r, msg, res.out)
		}
	}
	if msg := res.rankErr(0) + res.rankErr(1); !strings.Contains(msg, ErrTimeout.Error()) || !strings.Contains(msg, "ranks [2] of 3") {
		t.Errorf("no rank's timeout names rank 2: %q", msg)
	}
}

// TestMPIAbortFromSignalHandler: SIGTERM to one process makes its handler
// Abort the engine: that rank fails with ErrAborted, and the others with
// ErrPeerFailed naming its abort (a notice; their timeout is 10 minutes,
// beyond the job's guard).
func TestMPIAbortFromSignalHandler(t *testing.T) {
	m := findMPI(t)
	seed := testSeed(t)
	const W, victim = 3, 1
	sp := mpiTrainSpec{stage: 2, steps: 1 << 20, signal: true, absent: -1}
	dir := t.TempDir()
	go func() {
		// once every rank has stepped, SIGTERM to the victim
		deadline := time.Now().Add(time.Minute)
		for time.Now().Before(deadline) {
			ready := 0
			for r := range W {
				if _, err := os.Stat(filepath.Join(dir, fmt.Sprintf("ready-%d", r))); err == nil {
					ready++
				}
			}
			pid, err := os.ReadFile(filepath.Join(dir, fmt.Sprintf("pid-%d", victim)))
			if ready == W && err == nil {
				if n, err := strconv.Atoi(string(pid)); err == nil {
					syscall.Kill(n, syscall.SIGTERM)
					return
				}
			}
			time.Sleep(20 * time.Millisecond)
		}
	}()
	res := m.launch(t, mpiRun{n: W, scenario: "train", dir: dir, args: []string{"-disable-auto-cleanup"}, timeout: time.Minute,
		env: []string{"ZERO_MPI_TRAIN=" + sp.String(), fmt.Sprintf("ZERO_TEST_SEED=%d", seed), "ZERO_MPI_TIMEOUT=10m"}})
	if res.err == nil {
		t.Fatalf("the job went on after the abort\n%s", res.out)
	}
	if msg := res.rankErr(victim); !strings.Contains(msg, ErrAborted.Error()) || !strings.Contains(msg, "got terminated") {
		t.Errorf("rank %d: %q, want ErrAborted with the signal\n%s", victim, msg, res.out)
	}
	for r := range W {
		if r == victim {
			continue
		}
		if msg := res.rankErr(r); !strings.Contains(msg, ErrPeerFailed.Error()) || !strings.Contains(msg, fmt.Sprintf("rank %d of the MPI communicator aborted", victim)) {
			t.Errorf("rank %d: %q, want ErrPeerFailed naming rank %d's abort\n%s", r, msg, victim, res.out)
		}
	}
}

// ---- in this process ------------------------------------------------------------

// TestMPIMissingLibrary: a library that is not there is ErrMPI, and the
// message says how to install one.
func TestMPIMissingLibrary(t *testing.T) {
	_, _, err := MPIVersion("/nonexistent/libmpi.so.12")
	if !errors.Is(err, ErrMPI) || !strings.Contains(err.Error(), "apt-get install mpich") || !strings.Contains(err.Error(), "scripts/install-mpi.sh") {
		t.Fatalf("MPIVersion of a missing library: %v; want ErrMPI saying how to install MPICH", err)
	}
	mpiState.mu.Lock()
	started := mpiState.th != nil
	mpiState.mu.Unlock()
	if !started {
		if _, err := NewMPI(MPIConfig{Library: "/nonexistent/libmpi.so.12"}); !errors.Is(err, ErrMPI) {
			t.Fatalf("NewMPI of a missing library: %v; want ErrMPI", err)
		}
	}
	if !errors.Is(&MPIError{Code: 1}, ErrMPI) {
		t.Fatal("an MPIError does not wrap ErrMPI")
	}
}

// TestMPIConfigFromEnv reads the environment, and refuses what is wrong.
func TestMPIConfigFromEnv(t *testing.T) {
	env := func(kv map[string]string) func(string) string { return func(k string) string { return kv[k] } }
	c, err := mpiConfigFrom(env(map[string]string{"ZERO_MPI_LIBRARY": "/x/libmpi.so.12", "ZERO_MPI_TIMEOUT": "90s", "ZERO_MPI_COLOR": "3", "PMI_SIZE": "4", "ZERO_MPI_THREAD": "funneled"}))
	if err != nil || c.Library != "/x/libmpi.so.12" || c.Timeout != 90*time.Second || !c.Split || c.Color != 3 || c.LauncherWorld != 4 || !c.Funneled {
		t.Fatalf("%+v, %v", c, err)
	}
	if c, err := mpiConfigFrom(env(map[string]string{"OMPI_COMM_WORLD_SIZE": "2", "ZERO_MPI_THREAD": "serialized"})); err != nil || c.LauncherWorld != 2 || c.Split || c.Funneled {
		t.Fatalf("Open MPI's size: %+v, %v", c, err)
	}
	for _, bad := range []map[string]string{{"ZERO_MPI_TIMEOUT": "soon"}, {"ZERO_MPI_TIMEOUT": "-1s"}, {"ZERO_MPI_COLOR": "-1"}, {"PMI_SIZE": "x"}, {"ZERO_MPI_THREAD": "multiple"}} {
		if _, err := mpiConfigFrom(env(bad)); !errors.Is(err, ErrConfig) {
			t.Errorf("%v: %v, want ErrConfig", bad, err)
		}
	}
	for _, bad := range []MPIConfig{{Timeout: -time.Second}, {Split: true, Color: -2}, {LauncherWorld: -1}} {
		if _, err := NewMPI(bad); !errors.Is(err, ErrConfig) {
			t.Errorf("NewMPI(%+v): %v, want ErrConfig", bad, err)
		}
	}
}

// TestMPIPieces: a transfer beyond what an MPI count holds goes in pieces
// of 1 GiB, cut the same way at both ends.
func TestMPIPieces(t *testing.T) {
	ph := &mpiPhase{tag: 7}
	ph.send(1, 0x10000, 5<<29) // 2.5 GiB
	ph.recv(2, 0x20000, 100)
	want := []int64{1 << 30, 1 << 30, 1 << 29, 100}
	if len(ph.xfers) != len(want) {
		t.Fatalf("%d transfers, want %d", len(ph.xfers), len(want))
	}
	at := uintptr(0x10000)
	for i, x := range ph.xfers {
		if int64(x.bytes) != want[i] || int(x.tag) != 7 {
			t.Errorf("transfer %d: %d bytes, tag %d; want %d, 7", i, int64(x.bytes), int(x.tag), want[i])
		}
		if i < 3 && (uintptr(x.buf) != at || x.peer != 1 || x.recv != 0) {
			t.Errorf("piece %d at %#x to %d (recv %d), want %#x to 1", i, uintptr(x.buf), int(x.peer), int(x.recv), at)
		}
		at += uintptr(x.bytes)
	}
	if x := ph.xfers[3]; x.peer != 2 || x.recv != 1 {
		t.Errorf("the receive is from %d (recv %d)", int(x.peer), int(x.recv))
	}
}

// TestAbandonedHostMemoryStaysMapped: memory left to an MPI transfer that
// cannot be cancelled (quarantined) is never unmapped, even by Free.
func TestAbandonedHostMemoryStaysMapped(t *testing.T) {
	a, err := hostDev.Alloc(1<<16, FP32)
	if err != nil {
		t.Fatal(err)
	}
	quarantine.add(a.slice(100, 10))
	if err := hostDev.Free(a); err != nil {
		t.Fatal(err)
	}
	b := a.hostBytes() // would fault if unmapped
	b[0], b[len(b)-1] = 1, 2
	if b[0]+b[len(b)-1] != 3 {
		t.Fatal("the abandoned buffer does not hold what was written")
	}
	keep := Float32s(make([]float32, 8))
	quarantine.add(keep)
	quarantine.mu.Lock()
	defer quarantine.mu.Unlock()
	if len(quarantine.keep) == 0 {
		t.Fatal("abandoned Go memory is not kept")
	}
}

// TestMPIOneProcess runs TestMPIOneProcessChild in a process of its own,
// so that MPI is the first library of its kind that process opens and its
// singleton world ends with it; here, after MPIVersion opened and closed the
// library, a nil dereference is still Go's panic to recover from.
func TestMPIOneProcess(t *testing.T) {
	m := findMPI(t) // opens and closes the library here
	recoversNil(t)
	seed := testSeed(t)
	cmd := exec.Command(os.Args[0], "-test.run=^TestMPIOneProcessChild$", "-test.v")
	cmd.Env = append(os.Environ(), "ZERO_MPI_ONE_PROCESS="+m.library, fmt.Sprintf("ZERO_TEST_SEED=%d", seed))
	out, err := cmd.CombinedOutput()
	if err != nil || !strings.Contains(string(out), "--- PASS: TestMPIOneProcessChild") {
		t.Fatalf("the process of one rank: %v\n%s", err, out)
	}
}

// recoversNil fails t unless a nil dereference is a panic recover takes
// (Go's SIGSEGV handler, not one an MPI library installed).
func recoversNil(t *testing.T) {
	t.Helper()
	defer func() {
		if r := recover(); r == nil {
			t.Error("a nil dereference did not panic")
		}
	}()
	var p *int
	_ = *p
}

// TestMPIOneProcessChild: a world of one (MPICH's singleton), its library
// opened by NewMPI first: a launcher's count that differs from MPI's world
// is refused; its collectives give the in-process group's bits; Go's signal
// handlers are Go's after MPI's load and init (a nil dereference is a panic
// to recover from, a SIGUSR1 that MPI wanted leaves the process alive); a
// stream of another device is refused; after AbortComm a collective is
// ErrAborted; after Close it is ErrClosed; after MPIFinalize, NewMPI is
// refused.
func TestMPIOneProcessChild(t *testing.T) {
	library := os.Getenv("ZERO_MPI_ONE_PROCESS")
	if library == "" {
		t.Skip("run by TestMPIOneProcess in a process of its own")
	}
	if _, err := NewMPI(MPIConfig{Library: library, LauncherWorld: 5}); !errors.Is(err, ErrConfig) || !strings.Contains(err.Error(), "the launcher started 5 processes") {
		t.Fatalf("a launcher of 5 processes around a world of 1: %v, want ErrConfig naming both", err)
	}
	comm, err := NewMPI(MPIConfig{Library: library})
	if err != nil {
		t.Fatal(err)
	}
	if !comm.(*mpiComm).th.serialized {
		t.Error("MPI started without MPI_THREAD_SERIALIZED: the waiters do not poll")
	}
	if _, err := NewMPI(MPIConfig{Library: library, Funneled: true}); !errors.Is(err, ErrConfig) || !strings.Contains(err.Error(), "Funneled") {
		t.Errorf("NewMPI asking for funneled after a serialized start: %v, want ErrConfig naming Funneled", err)
	}
	if comm.Rank() != 0 || comm.Size() != 1 {
		t.Fatalf("rank %d of %d, want 0 of 1", comm.Rank(), comm.Size())
	}
	seed := testSeed(t)
	cases := collCases(seed, 1)
	got, err := runCollCases(comm, seed, cases)
	if err != nil {
		t.Fatal(err)
	}
	var want [][]byte
	if err := RunLocal(1, func(c Comm) error { want, err = runCollCases(c, seed, cases); return err }); err != nil {
		t.Fatal(err)
	}
	for i := range cases {
		if !bytes.Equal(got[i], want[i]) {
			t.Fatalf("case %d (%+v): MPI differs from the in-process group", i, cases[i])
		}
	}
	if n := comm.Counters().Total().Calls; n != int64(len(cases)) {
		t.Errorf("%d collectives counted, want %d", n, len(cases))
	}
	// an abort: this rank's own calls fail with ErrAborted, as on the
	// other communicators (its peers' with ErrPeerFailed)
	aborted, err := NewMPI(MPIConfig{Library: library})
	if err != nil {
		t.Fatal(err)
	}
	AbortComm(aborted, errors.New("the caller's reason"))
	hs := NewHostStream()
	if err := aborted.AllReduce(hs, Float32s(make([]float32, 4)), OpSum); !errors.Is(err, ErrAborted) || errors.Is(err, ErrPeerFailed) || !strings.Contains(err.Error(), "the caller's reason") {
		t.Errorf("a collective after AbortComm: %v, want ErrAborted with the reason, not ErrPeerFailed", err)
	}
	hs.Close()
	aborted.Close()
	recoversNil(t)
	syscall.Kill(os.Getpid(), syscall.SIGUSR1) // the process lives on
	time.Sleep(50 * time.Millisecond)
	if err := comm.AllReduce(otherStream{}, Float32s(make([]float32, 4)), OpSum); !errors.Is(err, ErrStream) {
		t.Errorf("a stream of another device: %v, want ErrStream", err)
	}
	if err := comm.Close(); err != nil {
		t.Fatal(err)
	}
	s := NewHostStream()
	defer s.Close()
	if err := comm.AllReduce(s, Float32s(make([]float32, 4)), OpSum); !errors.Is(err, ErrClosed) {
		t.Errorf("after Close: %v, want ErrClosed", err)
	}
	if err := MPIFinalize(); err != nil {
		t.Fatal(err)
	}
	if _, err := NewMPI(MPIConfig{Library: library}); !errors.Is(err, ErrClosed) {
		t.Errorf("NewMPI after MPIFinalize: %v, want ErrClosed", err)
	}
}

// otherStream is a stream of no device of this package.
type otherStream struct{ Stream }

// mismatchScenario: rank 0 all-reduces 100 fp32 values; rank 1 calls what
// ZERO_MPI_DIFFER says instead.
func mismatchScenario(comm Comm, dir string) error {
	s := NewHostStream()
	defer s.Close()
	var err error
	if comm.Rank() == 0 {
		err = comm.AllReduce(s, Float32s(make([]float32, 100)), OpSum)
	} else {
		switch os.Getenv("ZERO_MPI_DIFFER") {
		case "size":
			err = comm.AllReduce(s, Float32s(make([]float32, 101)), OpSum)
		case "dtype": // the same bytes
			err = comm.AllReduce(s, Halfs(make([]uint16, 200), BF16), OpSum)
		case "kind": // the same bytes
			err = comm.ReduceScatter(s, Float32s(make([]float32, 100)), Float32s(make([]float32, 50)), OpSum)
		case "larger": // rank 0 receives more than it expects: MPI truncates
			err = comm.AllReduce(s, Float32s(make([]float32, 200)), OpSum)
		}
	}
	if err == nil {
		err = s.Sync()
	}
	return err
}

// TestMPIMismatchedCollectives: ranks that call collectives of different
// sizes, dtypes or kinds at the same point fail with ErrCollectiveMismatch (their
// timeout is a minute), on both ranks; a message larger than its receive
// is MPI's own error (MPI_ERR_TRUNCATE, returned, not fatal), in MPI's
// words.
func TestMPIMismatchedCollectives(t *testing.T) {
	m := findMPI(t)
	for _, differ := range []string{"size", "dtype", "kind", "larger"} {
		t.Run(differ, func(t *testing.T) {
			res := m.launch(t, mpiRun{n: 2, scenario: "mismatch", survive: true, args: []string{"-disable-auto-cleanup"},
				env: []string{"ZERO_MPI_DIFFER=" + differ, "ZERO_MPI_TIMEOUT=1m"}})
			for r := range 2 {
				if msg := res.rankErr(r); !strings.Contains(msg, ErrCollectiveMismatch.Error()) {
					t.Errorf("rank %d: %q, want ErrCollectiveMismatch\n%s", r, msg, res.out)
				}
			}
			// MPI's own words come back with its code
			if msg := res.rankErr(0); differ == "larger" && (!strings.Contains(msg, ErrMPI.Error()) || !strings.Contains(strings.ToLower(msg), "truncat")) {
				t.Errorf("rank 0: %q, want MPI's truncation error", msg)
			}
		})
	}
}

// TestMPIStandardABI: the collectives through MPICH's libmpi_abi.so.1, the
// MPI 5.0 standard ABI (pointer handles), give the in-process group's bits.
func TestMPIStandardABI(t *testing.T) {
	m := findMPI(t)
	lib := filepath.Join(filepath.Dir(m.library), "libmpi_abi.so.1")
	if _, abi, err := MPIVersion(lib); err != nil || abi != "standard" {
		t.Skipf("no standard-ABI library beside %s (%v, %q): MPICH 5's wheel (scripts/install-mpi.sh) has one", m.library, err, abi)
	}
	seed := testSeed(t)
	const w = 2
	cases := collCases(seed, w)
	want := make([][][]byte, w)
	if err := RunLocal(w, func(comm Comm) error {
		out, err := runCollCases(comm, seed, cases)
		want[comm.Rank()] = out
		return err
	}); err != nil {
		t.Fatal(err)
	}
	res := m.launch(t, mpiRun{n: w, scenario: "collectives", env: []string{fmt.Sprintf("ZERO_TEST_SEED=%d", seed), "ZERO_MPI_LIBRARY=" + lib, "ZERO_MPI_EXPECT_ABI=standard"}})
	res.mustSucceed(t, "collectives over the standard ABI")
	for r := range w {
		got, err := os.ReadFile(filepath.Join(res.dir, fmt.Sprintf("coll-%d.bin", r)))
		if err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(got, bytes.Join(want[r], nil)) {
			t.Fatalf("rank %d: the standard ABI's run differs from the in-process group", r)
		}
	}
}
