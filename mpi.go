package zero

/*
#cgo LDFLAGS: -ldl
#include <sched.h>
#include <unistd.h>
#include <stdlib.h>
#include "mpi_api.h"
*/
import "C"

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"
	"unsafe"
)

// MPIError is a failed MPI call. It wraps ErrMPI.
type MPIError struct {
	Code  int    // the MPI error code
	Class int    // its error class (MPI_Error_class), −1 if unknown
	Text  string // MPI_Error_string
	Op    string // what zero was doing, e.g. "MPI_Comm_dup" or "ReduceScatter(4096 × bf16, sum) #12"
	Rank  int    // this process's rank, −1 before it is known
}

// Error says what failed on which rank, with MPI's own words.
func (e *MPIError) Error() string {
	return fmt.Sprintf("%v: rank %d: %s: %s (code %d, class %d)", ErrMPI, e.Rank, e.Op, e.Text, e.Code, e.Class)
}

// Unwrap makes errors.Is(err, ErrMPI) true.
func (e *MPIError) Unwrap() error { return ErrMPI }

// MPIConfig says how to start this process's rank of an MPI communicator
// (NewMPI). MPIConfigFromEnv fills it from the environment.
type MPIConfig struct {
	// Library is the MPI shared library to dlopen. Empty: $ZERO_MPI_LIBRARY,
	// else libmpi.so.12 (MPICH's ABI: MPICH, Intel MPI, MVAPICH, Cray MPICH;
	// libmpich.so.12 in Debian and Ubuntu), else libmpi_abi.so.1 (the MPI 5.0 standard ABI), from the loader's
	// search path (LD_LIBRARY_PATH), then from the lib folder beside the
	// mpiexec on PATH.
	Library string
	// Timeout bounds each collective, from the moment this rank posts its
	// transfers (default DefaultTimeout). It must cover the peers' work
	// before they reach the collective (their forward and backward).
	Timeout time.Duration
	// Split makes the communicator MPI_Comm_split(MPI_COMM_WORLD, Color,
	// world rank) instead of a duplicate of MPI_COMM_WORLD: processes with
	// the same Color form one group (several data-parallel groups in one
	// job).
	Split bool
	Color int // see Split; ≥ 0
	// LauncherWorld is the number of processes the launcher says it
	// started (PMI_SIZE, OMPI_COMM_WORLD_SIZE); 0: unknown. When it is
	// set and MPI_COMM_WORLD differs, NewMPI fails: the launcher belongs to
	// another MPI than the library loaded, and every process would be a
	// world of its own.
	LauncherWorld int
	// Funneled makes every MPI call from zero's MPI thread
	// (MPI_THREAD_FUNNELED). By default MPI is initialised with
	// MPI_THREAD_SERIALIZED and the goroutine that waits for a collective
	// makes its calls itself, under one lock, which saves each collective
	// two wake-ups of another thread; a library that provides only
	// funneled gets the thread without being asked. The first NewMPI of a
	// process decides.
	Funneled bool
}

// MPIConfigFromEnv reads ZERO_MPI_LIBRARY, ZERO_MPI_TIMEOUT (a Go duration
// such as "90s"), ZERO_MPI_COLOR (sets Split and Color), ZERO_MPI_THREAD
// ("funneled" sets Funneled, "serialized" is the default) and the launcher's
// world size (PMI_SIZE from MPICH's Hydra and Slurm's PMI, or
// OMPI_COMM_WORLD_SIZE).
func MPIConfigFromEnv() (MPIConfig, error) { return mpiConfigFrom(os.Getenv) }

func mpiConfigFrom(getenv func(string) string) (MPIConfig, error) {
	c := MPIConfig{Library: strings.TrimSpace(getenv("ZERO_MPI_LIBRARY"))}
	if v := strings.TrimSpace(getenv("ZERO_MPI_TIMEOUT")); v != "" {
		d, err := time.ParseDuration(v)
		if err != nil || d <= 0 {
			return c, errorf(ErrConfig, "ZERO_MPI_TIMEOUT=%q; give a positive Go duration such as 90s or 5m", v)
		}
		c.Timeout = d
	}
	if v := strings.TrimSpace(getenv("ZERO_MPI_COLOR")); v != "" {
		n, err := strconv.Atoi(v)
		if err != nil || n < 0 {
			return c, errorf(ErrConfig, "ZERO_MPI_COLOR=%q; give a group number ≥ 0", v)
		}
		c.Split, c.Color = true, n
	}
	switch v := strings.TrimSpace(getenv("ZERO_MPI_THREAD")); v {
	case "", "serialized":
	case "funneled":
		c.Funneled = true
	default:
		return c, errorf(ErrConfig, "ZERO_MPI_THREAD=%q; give funneled or serialized", v)
	}
	for _, name := range []string{"PMI_SIZE", "OMPI_COMM_WORLD_SIZE"} {
		if v := strings.TrimSpace(getenv(name)); v != "" {
			n, err := strconv.Atoi(v)
			if err != nil || n < 1 {
				return c, errorf(ErrConfig, "%s=%q is not a world size", name, v)
			}
			c.LauncherWorld = n
			break
		}
	}
	return c, nil
}

func (c *MPIConfig) check() error {
	if c.Timeout < 0 {
		return errorf(ErrConfig, "MPIConfig.Timeout %v; give a positive duration (0: DefaultTimeout)", c.Timeout)
	}
	if c.Timeout == 0 {
		c.Timeout = DefaultTimeout
	}
	if c.Split && c.Color < 0 {
		return errorf(ErrConfig, "MPIConfig.Color %d; give a group number ≥ 0", c.Color)
	}
	if c.LauncherWorld < 0 {
		return errorf(ErrConfig, "MPIConfig.LauncherWorld %d; 0 (unknown) or the launcher's process count", c.LauncherWorld)
	}
	if c.Library == "" {
		c.Library = strings.TrimSpace(os.Getenv("ZERO_MPI_LIBRARY"))
	}
	return nil
}

// NewMPIFromEnv is NewMPI with the config of MPIConfigFromEnv.
func NewMPIFromEnv() (Comm, error) {
	cfg, err := MPIConfigFromEnv()
	if err != nil {
		return nil, err
	}
	return NewMPI(cfg)
}

// NewMPI returns this process's rank of an MPI communicator over host
// memory: one rank per process, started by the MPI launcher (mpiexec -n W),
// on one host or many. GPU memory is NCCL's (NewNCCL).
//
// MPI is loaded with dlopen the first time (MPIConfig.Library), so nothing
// links against it. One goroutine, locked to its OS thread, initialises MPI
// (MPI_Init_thread with MPI_THREAD_SERIALIZED, the level provided checked);
// within a collective the goroutine that waits for it makes its MPI calls
// itself, under one lock (MPIConfig.Funneled leaves them to the thread).
// The communicator is MPI_COMM_WORLD duplicated (or split), with
// MPI_ERRORS_RETURN, so MPI's errors come back as *MPIError instead of
// ending the job. Signal handlers that MPI's initialisation installs are put
// back to Go's (see the README). Where several of the job's processes share
// the host, GOMAXPROCS is lowered to this process's share of its CPUs unless
// the environment sets it.
//
// MPI moves bytes only (MPI_BYTE, non-blocking point to point); zero reduces
// on the host with its own kernels, in rank order, so the results are those
// of the in-process group bit for bit. A reduce-scatter sends each peer its
// chunk and sums the W chunks of this rank's part; an all-reduce is that
// with uneven parts and an all-gather; each rank sends (W−1)/W of the
// payload, as in a ring. The transfers are polled, so a collective fails
// after MPIConfig.Timeout, naming the ranks it waited for, and Abort (or
// AbortComm) fails every blocked and later collective at once, here and, by
// a notice, on every peer.
//
// MPI cannot cancel a collective: after a timeout or an abort its buffers
// (the engine's and the caller's) are kept for ever, not freed, and the
// process should exit without MPIFinalize (Hydra, MPICH's launcher, then
// ends the job's other processes). Close frees the communicator;
// MPIFinalize ends MPI for the process.
func NewMPI(cfg MPIConfig) (Comm, error) {
	if err := cfg.check(); err != nil {
		return nil, err
	}
	th, err := startMPI(cfg.Library, cfg.Funneled)
	if err != nil {
		return nil, err
	}
	c := &mpiComm{th: th, timeout: cfg.Timeout}
	var worldErr error
	err = th.do(func() error {
		var h C.uintptr_t
		var rank, size, ub, local C.int
		split := C.int(0)
		if cfg.Split {
			split = 1
		}
		if code := C.zm_comm_create(split, C.int(cfg.Color), &h, &rank, &size, &ub, &local); code != 0 {
			return mpiErr("MPI_Comm_dup of MPI_COMM_WORLD", -1, code)
		}
		c.handle, c.rank, c.size = h, int(rank), int(size)
		fitGOMAXPROCS(int(local))
		if cfg.LauncherWorld > 0 && !cfg.Split && c.size != cfg.LauncherWorld {
			worldErr = errorf(ErrConfig, "the launcher started %d processes but MPI_COMM_WORLD has %d: the mpiexec that started this process belongs to another MPI than %s; use that library's mpiexec (or set ZERO_MPI_LIBRARY to the library of this mpiexec)",
				cfg.LauncherWorld, c.size, th.library)
		}
		// the tag: sequence | phase | kind | dtype | op; the abort notice
		// takes the top tag, above every collective's
		bits := 0
		for 1<<(bits+1) <= int(ub)+1 {
			bits++
		}
		c.seqBits = bits - tagLowBits - 1
		c.abortTag = int(ub)
		if c.seqBits < 4 {
			return errorf(ErrMPI, "MPI_TAG_UB is %d; zero needs at least %d", ub, 1<<(tagLowBits+5)-1)
		}
		return c.listen()
	})
	if err == nil {
		err = worldErr
	}
	if err != nil {
		if c.handle != 0 {
			c.Close()
		}
		return nil, err
	}
	c.collectives = collectives{world: c.size, issue: c.enqueue}
	return c, nil
}

// fitGOMAXPROCS gives this process its share of the host's CPUs when local
// processes of the job share the host and the environment does not set
// GOMAXPROCS: each Go process would run as many threads as the host has
// CPUs, and ranks that outnumber the CPUs then wait on each other's
// spare threads at every transfer (torchrun sets OMP_NUM_THREADS=1 for the
// same reason). It only ever lowers GOMAXPROCS.
func fitGOMAXPROCS(local int) {
	if local <= 1 || os.Getenv("GOMAXPROCS") != "" {
		return
	}
	if share := max(1, runtime.NumCPU()/local); runtime.GOMAXPROCS(0) > share {
		runtime.GOMAXPROCS(share)
	}
}

// MPIVersion opens MPI (library as in MPIConfig.Library) and returns
// MPI_Get_library_version's text and the ABI it speaks ("mpich" or
// "standard"), without initialising MPI or keeping the library.
func MPIVersion(library string) (version, abi string, err error) {
	if library == "" {
		library = strings.TrimSpace(os.Getenv("ZERO_MPI_LIBRARY"))
	}
	var msgs []string
	for _, name := range mpiCandidates(library) {
		cname := C.CString(name)
		var msg [1024]C.char
		var ver [8192]C.char
		var which C.int
		code := C.zm_probe(cname, &which, &ver[0], C.int(len(ver)), &msg[0], C.int(len(msg)))
		C.free(unsafe.Pointer(cname))
		if code == 0 {
			return strings.TrimSpace(C.GoString(&ver[0])), abiName(which), nil
		}
		msgs = append(msgs, C.GoString(&msg[0]))
	}
	return "", "", noMPI(msgs)
}

func abiName(which C.int) string {
	if which == C.ZM_ABI_STANDARD {
		return "standard"
	}
	return "mpich"
}

// MPIFinalize ends MPI in this process (MPI_Finalize), after closing every
// MPI communicator still open; call it once at the end of a program that
// used NewMPI. After a collective was abandoned (a timeout, an abort, a
// peer's failure) it does not finalize, since MPI would wait for transfers
// that never end, and returns an error wrapping ErrAborted: exit the
// process instead. Without NewMPI it does nothing.
func MPIFinalize() error {
	mpiState.mu.Lock()
	th := mpiState.th
	mpiState.mu.Unlock()
	if th == nil || th.initErr != nil { // nothing was started
		return nil
	}
	return th.do(func() error {
		for c := range th.comms {
			c.closeLocked()
		}
		if th.abandoned != nil {
			return fmt.Errorf("%w: MPI not finalized: %w; exit the process (the launcher ends the others)", ErrAborted, th.abandoned)
		}
		if th.finalized {
			return nil
		}
		th.finalized = true
		if code := C.zm_finalize(); code != 0 {
			return mpiErr("MPI_Finalize", -1, code)
		}
		return nil
	})
}

// ---- the process's MPI thread ----------------------------------------------

// mpiState is the process's MPI: loaded and initialised once, then served
// by one thread.
var mpiState struct {
	mu sync.Mutex
	th *mpiThread
}

// mpiCandidates are the libraries to try: library, or libmpi.so.12
// (libmpich.so.12 as Debian and Ubuntu name MPICH's), then libmpi_abi.so.1,
// from the loader's path, then beside the mpiexec on PATH.
func mpiCandidates(library string) []string {
	if library != "" {
		return []string{library}
	}
	sonames := []string{"libmpi.so.12", "libmpich.so.12", "libmpi_abi.so.1"}
	names := slices.Clone(sonames)
	if mpiexec, err := exec.LookPath("mpiexec"); err == nil {
		if real, err := filepath.EvalSymlinks(mpiexec); err == nil {
			mpiexec = real
		}
		lib := filepath.Join(filepath.Dir(filepath.Dir(mpiexec)), "lib")
		for _, n := range sonames {
			names = append(names, filepath.Join(lib, n))
		}
	}
	return names
}

func noMPI(msgs []string) error {
	return errorf(ErrMPI, "cannot load MPI (%s): install MPICH (apt-get install mpich, or scripts/install-mpi.sh, which puts PyPI's mpich wheel in .mpi/) and put its bin folder on PATH or its lib folder on LD_LIBRARY_PATH, or set ZERO_MPI_LIBRARY to the library's path (libmpi.so.12 or libmpi_abi.so.1)",
		strings.Join(msgs, "; "))
}

// loadMPI dlopens the process's MPI (the first of mpiCandidates that
// opens) and returns its ABI and path.
func loadMPI(library string) (abi, path string, err error) {
	var msgs []string
	for _, name := range mpiCandidates(library) {
		cname := C.CString(name)
		var msg [1024]C.char
		var which C.int
		code := C.zm_load(cname, &which, &msg[0], C.int(len(msg)))
		C.free(unsafe.Pointer(cname))
		if code == 0 {
			return abiName(which), name, nil
		}
		msgs = append(msgs, C.GoString(&msg[0]))
	}
	return "", "", noMPI(msgs)
}

// startMPI loads and initialises MPI once per process and returns its
// thread; a later call with another library or thread level is refused.
func startMPI(library string, funneled bool) (*mpiThread, error) {
	mpiState.mu.Lock()
	defer mpiState.mu.Unlock()
	if th := mpiState.th; th != nil {
		if th.initErr != nil {
			return nil, th.initErr
		}
		if library != "" && library != th.library && filepath.Base(library) != filepath.Base(th.library) {
			return nil, errorf(ErrConfig, "MPI is loaded from %s in this process; NewMPI asked for %s", th.library, library)
		}
		if funneled != th.funneled {
			return nil, errorf(ErrConfig, "MPI was started in this process with MPIConfig.Funneled %v; NewMPI asked for %v (the first NewMPI decides)", th.funneled, funneled)
		}
		var finalized bool
		th.do(func() error { finalized = th.finalized; return nil })
		if finalized {
			return nil, errorf(ErrClosed, "MPI was finalized in this process (MPIFinalize); it starts once per process")
		}
		return th, nil
	}
	abi, path, err := loadMPI(library)
	if err != nil {
		return nil, err // not sticky: the caller may fix the path
	}
	th := &mpiThread{in: make(chan func()), library: path, abi: abi, funneled: funneled, comms: map[*mpiComm]bool{}}
	ready := make(chan error)
	go th.loop(ready)
	th.initErr = <-ready
	mpiState.th = th
	return th, th.initErr
}

// mpiThread is the goroutine, locked to its OS thread, on which MPI was
// initialised and that makes the process's MPI calls outside a collective
// (communicators, notices while no collective runs, MPI_Finalize). Within a
// collective, MPI_THREAD_SERIALIZED lets the goroutine that waits for it
// post and test its transfers itself; at MPI_THREAD_FUNNELED the thread
// does that too, and the waiter blocks until it is told.
type mpiThread struct {
	in       chan func()
	library  string
	abi      string
	funneled bool // asked for
	initErr  error
	// restored is the signals whose handlers MPI's init changed and that
	// were put back to Go's.
	restored uint64

	// mu is held across every MPI call and guards what follows.
	mu         sync.Mutex
	serialized bool      // the waiters poll (set once at init)
	heard      time.Time // when progress last tested the notices
	comms      map[*mpiComm]bool
	active     []*mpiPhase
	finalized  bool
	abandoned  error // the first collective left to MPI: no MPI_Finalize
}

// do runs fn on the MPI thread and returns its error.
func (th *mpiThread) do(fn func() error) error {
	done := make(chan error, 1)
	th.in <- func() { done <- fn() }
	return <-done
}

// locked runs fn under th.mu.
func (th *mpiThread) locked(fn func()) {
	th.mu.Lock()
	defer th.mu.Unlock()
	fn()
}

// Polling: the transfers are tested in a loop that yields the CPU between
// rounds; after mpiYieldFor with nothing completed it naps between them,
// and with nothing to test it blocks, waking every mpiIdlePoll for the
// peers' abort notices.
const (
	mpiYieldFor   = 2 * time.Millisecond
	mpiNapMicros  = 50                    // a nap in a system call: Go's timers sleep a millisecond or more for it
	mpiIdlePoll   = 10 * time.Millisecond // notices while no collective runs
	mpiProbeEvery = 100 * time.Millisecond
	mpiHearEvery  = time.Millisecond // notices while collectives run
)

func (th *mpiThread) loop(ready chan<- error) {
	runtime.LockOSThread() // for ever: MPI knows this thread as its main one
	var level, wasInit C.int
	var restored C.uint64_t
	want := C.int(2) // serialized
	if th.funneled {
		want = 1
	}
	code := C.zm_init(want, &level, &wasInit, &restored)
	th.restored = uint64(restored)
	switch {
	case code != 0:
		ready <- mpiErr("MPI_Init_thread", -1, code)
		return
	case wasInit == 0 && level < 1:
		ready <- errorf(ErrMPI, "MPI_Init_thread provided thread level %d (single); zero needs MPI_THREAD_FUNNELED: use an MPI built with thread support", level)
		return
	case wasInit != 0 && level < 3:
		ready <- errorf(ErrMPI, "MPI was initialised before NewMPI with thread level %d; zero calls MPI from a thread of its own, which needs MPI_THREAD_MULTIPLE: let NewMPI initialise MPI", level)
		return
	}
	th.serialized = level >= 2 && !th.funneled
	ready <- nil
	idle := time.NewTicker(mpiIdlePoll)
	defer idle.Stop()
	quiet := time.Now() // when a transfer last completed
	for {
		th.mu.Lock()
		polls := !th.serialized && len(th.active) > 0
		listens := len(th.comms) > 0
		th.mu.Unlock()
		if !polls {
			var tick <-chan time.Time
			if listens {
				tick = idle.C
			}
			select {
			case fn := <-th.in:
				th.locked(fn)
			case <-tick:
				th.locked(func() { th.pollNotices() })
			}
			quiet = time.Now()
			continue
		}
	drain:
		for {
			select {
			case fn := <-th.in:
				th.locked(fn)
			default:
				break drain
			}
		}
		th.mu.Lock()
		moved := th.progress()
		th.mu.Unlock()
		if moved {
			quiet = time.Now()
			continue
		}
		th.pace(quiet, false)
	}
}

// await polls the transfers until ph finished (serialized: on the
// waiter's goroutine) and returns its result.
func (th *mpiThread) await(ph *mpiPhase) error {
	quiet := time.Now()
	for {
		th.mu.Lock()
		if ph.result == nil && th.progress() {
			quiet = time.Now()
		}
		finished := ph.result != nil
		th.mu.Unlock()
		if finished {
			return <-ph.done
		}
		th.pace(quiet, true)
	}
}

// pace waits between two rounds of tests: a yield of the CPU until
// mpiYieldFor after the last completion, then a nap. A waiter on an ordinary
// goroutine (keepP) lets this P's other goroutines run first and then yields
// or naps in a raw system call, which keeps its P: a cgo call or an ordinary
// system call that outlasts a sysmon tick (20 µs) can lose the P to another
// thread, and the caller then waits for one on its return, as it did at most
// yields where the job's processes outnumber the CPUs (a peer runs meanwhile).
// The MPI thread cannot keep its P: locked to its OS thread, it would park
// the thread at every Gosched, and would hold the P the other goroutines need.
func (th *mpiThread) pace(quiet time.Time, keepP bool) {
	nap := time.Since(quiet) >= mpiYieldFor
	if !keepP {
		if nap {
			C.usleep(mpiNapMicros)
		} else {
			C.sched_yield()
		}
		return
	}
	runtime.Gosched()
	if nap {
		ts := syscall.Timespec{Nsec: mpiNapMicros * 1000}
		syscall.RawSyscall(syscall.SYS_NANOSLEEP, uintptr(unsafe.Pointer(&ts)), 0, 0)
	} else {
		syscall.RawSyscall(syscall.SYS_SCHED_YIELD, 0, 0, 0)
	}
}

// progress tests every active transfer and every communicator's notice,
// completes or fails phases, and reports whether anything completed.
func (th *mpiThread) progress() bool {
	now := time.Now()
	any := false
	if now.Sub(th.heard) >= mpiHearEvery {
		th.heard = now
		any = th.pollNotices()
	}
	kept := th.active[:0]
	for _, ph := range th.active {
		if ph.result != nil { // failed by an abort meanwhile
			any = true
			continue
		}
		left := C.zm_test(&ph.xfers[0], C.int(len(ph.xfers)))
		switch {
		case left < 0:
			x := ph.xfers[-left-1]
			ph.c.fail(ph.xferError(x), true)
			any = true
			continue
		case left == 0:
			if err := ph.checkCounts(); err != nil {
				ph.c.fail(err, true)
			} else {
				ph.finish(nil)
			}
			any = true
			continue
		}
		if now.Sub(ph.posted) > ph.c.timeout {
			ph.c.fail(ph.timeoutError(), true)
			any = true
			continue
		}
		if now.Sub(ph.probed) > mpiProbeEvery {
			ph.probed = now
			if err := ph.probeMismatch(); err != nil {
				ph.c.fail(err, true)
				any = true
				continue
			}
		}
		kept = append(kept, ph)
	}
	clear(th.active[len(kept):])
	th.active = kept
	return any
}

// pollNotices tests every communicator's notice receive; a peer's notice
// aborts the communicator here.
func (th *mpiThread) pollNotices() bool {
	any := false
	for c := range th.comms {
		if c.notice.state != 1 {
			continue
		}
		if left := C.zm_test(&c.notice, 1); left == 0 || left < 0 {
			any = true
			from := int(c.notice.peer)
			msg := C.GoStringN((*C.char)(c.noticeBuf), C.int(max(0, min(int(c.notice.got), noticeBytes))))
			if left < 0 {
				msg = mpiErr("the abort notice's receive", c.rank, c.notice.err).Error()
			}
			c.fail(fmt.Errorf("%w: rank %d of the MPI communicator aborted: %s", ErrPeerFailed, from, msg), false)
		}
	}
	return any
}

// ---- one rank's communicator ------------------------------------------------

// tagLowBits are the tag's bits below the sequence number: the phase (1),
// the kind (2), the dtype (2) and the op (2), so that ranks that called
// different collectives never match each other's transfers.
const tagLowBits = 7

// noticeBytes bounds an abort notice's reason.
const noticeBytes = 1024

type mpiComm struct {
	th                *mpiThread
	handle            C.uintptr_t
	rank, size        int
	timeout           time.Duration
	seqBits, abortTag int
	notice            C.zm_xfer      // the posted receive of a peer's abort notice
	noticeBuf         unsafe.Pointer // C memory: MPI writes into it at any time
	pool              mpiPool
	collectives
	counters

	mu     sync.Mutex
	seq    uint64 // collectives issued
	reason error  // set once: aborted, failed or closed
	closed bool
	freed  bool // under th.mu: the MPI communicator is freed
}

func (c *mpiComm) Rank() int              { return c.rank }
func (c *mpiComm) Size() int              { return c.size }
func (c *mpiComm) Device() Device         { return hostDev }
func (c *mpiComm) Counters() CommCounters { return c.snapshot() }

// listen posts the receive of peers' abort notices (on the thread).
func (c *mpiComm) listen() error {
	c.noticeBuf = C.malloc(noticeBytes)
	c.notice = C.zm_xfer{buf: C.uintptr_t(uintptr(c.noticeBuf)), bytes: noticeBytes, peer: C.ZM_ANY, tag: C.int32_t(c.abortTag), recv: 1}
	if c.size > 1 {
		if code := C.zm_post(c.handle, &c.notice, 1); code != 0 {
			return mpiErr("MPI_Irecv of the abort notice", c.rank, code)
		}
	}
	c.th.comms[c] = true
	return nil
}

// err is the communicator's failure, or nil.
func (c *mpiComm) err() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed {
		return errorf(ErrClosed, "rank %d closed its MPI communicator", c.rank)
	}
	return c.reason
}

func (c *mpiComm) enqueue(s Stream, x collective) error {
	hs, err := hostStreamOf(s)
	if err != nil {
		return errorf(ErrStream, "the MPI communicator moves host memory: %v (GPU buffers go through NCCL)", err)
	}
	c.mu.Lock()
	if c.closed || c.reason != nil {
		c.mu.Unlock()
		return c.err()
	}
	seq := c.seq
	c.seq++
	c.mu.Unlock()
	c.add(x.kind, x.payload(), c.size)
	return hs.Launch(func() error {
		err := c.run(seq, x)
		keepAlive(x.send, x.recv)
		return err
	})
}

// run is one collective, on the stream that reached it: the transfers on
// the MPI thread, the sums here.
func (c *mpiComm) run(seq uint64, x collective) error {
	if err := c.err(); err != nil {
		return err
	}
	a := x.args()
	size := a.dtype.Size()
	W, r := c.size, c.rank
	switch a.kind {
	case KindReduceScatter:
		chunk := a.count / W
		nb := chunk * size
		tmp, err := c.pool.take((W - 1) * nb)
		if err != nil {
			return err
		}
		ph := c.phase(seq, 0, a)
		for p := range W {
			if p != r {
				ph.recv(p, tmp.ptr+uintptr(slot(p, r)*nb), nb)
				ph.send(p, a.send+uintptr(p*nb), nb)
			}
		}
		if err := ph.run(nil, x.send, x.recv, tmp); err != nil {
			return err
		}
		srcs := sumSources(W, r, a.send+uintptr(r*nb), tmp.ptr, nb)
		reduceHost(a.recv, srcs, a.dtype, a.op, 0, chunk)
		c.pool.put(tmp)
	case KindAllGather:
		nb := a.count * size
		ph := c.phase(seq, 0, a)
		for p := range W {
			if p != r {
				ph.recv(p, a.recv+uintptr(p*nb), nb)
				ph.send(p, a.send, nb)
			}
		}
		local := func() {
			if mine := a.recv + uintptr(r*nb); a.send != mine {
				copyStream(mine, a.send, nb)
			}
		}
		return ph.run(local, x.send, x.recv)
	case KindAllReduce:
		lo, hi := splitRange(a.count, W, r)
		mine := (hi - lo) * size
		tmp, err := c.pool.take((W - 1) * mine)
		if err != nil {
			return err
		}
		ph := c.phase(seq, 0, a)
		for p := range W {
			if p != r {
				plo, phi := splitRange(a.count, W, p)
				ph.recv(p, tmp.ptr+uintptr(slot(p, r)*mine), mine)
				ph.send(p, a.send+uintptr(plo*size), (phi-plo)*size)
			}
		}
		if err := ph.run(nil, x.send, tmp); err != nil {
			return err
		}
		// this rank's part, which phase 0 does not send
		srcs := sumSources(W, r, a.send+uintptr(lo*size), tmp.ptr, mine)
		reduceHost(a.send+uintptr(lo*size), srcs, a.dtype, a.op, 0, hi-lo)
		c.pool.put(tmp)
		ph = c.phase(seq, 1, a)
		for p := range W {
			if p != r {
				plo, phi := splitRange(a.count, W, p)
				ph.recv(p, a.send+uintptr(plo*size), (phi-plo)*size)
				ph.send(p, a.send+uintptr(lo*size), mine)
			}
		}
		return ph.run(nil, x.send)
	case KindBroadcast:
		nb := a.count * size
		ph := c.phase(seq, 0, a)
		for p := range W {
			switch {
			case r == a.root && p != r:
				ph.send(p, a.send, nb)
			case r != a.root && p == a.root:
				ph.recv(p, a.send, nb)
			}
		}
		return ph.run(nil, x.send)
	}
	return nil
}

// mpiOwn makes calls of MPI's own reduce-scatter (fp32, MPI_SUM) or
// all-gather over c's communicator in a C loop, blocking: the yardstick
// BenchmarkMPICollectives measures zero's collectives against, in the same
// process and run. send and recv are fp32 host tensors, as the engine's
// reduce-scatter or all-gather takes them; zero's collectives never call it.
func (c *mpiComm) mpiOwn(kind CollectiveKind, send, recv Tensor, calls int) error {
	part := min(send.count, recv.count) * 4
	gather := C.int(0)
	if kind == KindAllGather {
		gather = 1
	}
	var code C.int
	call := func() {
		code = C.zm_own(c.handle, gather, C.uintptr_t(send.ptr), C.uintptr_t(recv.ptr), C.int64_t(part), C.int(calls))
	}
	if c.th.serialized {
		c.th.locked(call)
	} else {
		c.th.do(func() error { call(); return nil })
	}
	keepAlive(send, recv)
	if code != 0 {
		return mpiErr("MPI's own "+kind.String(), c.rank, code)
	}
	return nil
}

// sumSources lists, in rank order, the W addends of this rank's part: its
// own copy at own, each peer's where it landed in the staging buffer tmp
// (parts of n bytes).
func sumSources(W, r int, own, tmp uintptr, n int) []uintptr {
	srcs := make([]uintptr, W)
	for p := range srcs {
		if p == r {
			srcs[p] = own
		} else {
			srcs[p] = tmp + uintptr(slot(p, r)*n)
		}
	}
	return srcs
}

// slot is where peer p's part lands in rank r's buffer of W−1 parts.
func slot(p, r int) int {
	if p < r {
		return p
	}
	return p - 1
}

// tag is the MPI tag of a collective's phase.
func (c *mpiComm) tag(seq uint64, phase int, a collArgs) int {
	s := int(seq & (1<<c.seqBits - 1))
	return s<<tagLowBits | phase<<6 | int(a.kind)<<4 | int(a.dtype)<<2 | int(a.op)
}

// describeTag is a peer's collective as its tag names it.
func describeTag(tag int) string {
	kind := CollectiveKind(tag >> 4 & 3)
	return fmt.Sprintf("%v of %v (%v), phase %d", kind, DType(tag>>2&3), ReduceOp(tag&3), tag>>6&1)
}

// abort fails the communicator, here and, by a notice, on every peer.
func (c *mpiComm) abort(reason error) {
	c.th.do(func() error {
		c.fail(fmt.Errorf("%w: %w", ErrAborted, reason), true) // this rank's own; its peers hear ErrPeerFailed
		return nil
	})
}

// Abort is AbortComm(c, reason).
func (c *mpiComm) Abort(reason error) { c.abort(reason) }

// fail (under th.mu) records err as the communicator's failure, fails
// every active phase and leaves their buffers to MPI; tell sends the peers
// a notice (not when the failure is a peer's notice: that peer told all).
func (c *mpiComm) fail(err error, tell bool) {
	c.mu.Lock()
	first := c.reason == nil && !c.closed
	if c.reason == nil {
		c.reason = err
	}
	err = c.reason
	c.mu.Unlock()
	for _, ph := range c.th.active {
		if ph.c == c && ph.result == nil {
			ph.abandon()
			ph.finish(err)
		}
	}
	if first && tell && !c.freed {
		c.tellPeers(err)
	}
}

// tellPeers sends every peer a notice of this rank's failure: an eager
// message each, never waited for (the buffer is left to MPI). Where a peer
// is gone the send fails, or never completes: it was told enough.
func (c *mpiComm) tellPeers(err error) {
	if c.size == 1 {
		return
	}
	text := err.Error()
	if len(text) > noticeBytes {
		text = text[:noticeBytes]
	}
	buf := C.CBytes([]byte(text))
	xs := make([]C.zm_xfer, 0, c.size-1)
	for p := range c.size {
		if p != c.rank {
			xs = append(xs, C.zm_xfer{buf: C.uintptr_t(uintptr(buf)), bytes: C.int64_t(len(text)), peer: C.int32_t(p), tag: C.int32_t(c.abortTag)})
		}
	}
	C.zm_post(c.handle, &xs[0], C.int(len(xs)))
	// a little progress, so the notices leave before this process exits
	deadline := time.Now().Add(100 * time.Millisecond)
	for C.zm_test(&xs[0], C.int(len(xs))) > 0 && time.Now().Before(deadline) {
		C.sched_yield()
	}
	c.th.abandon(err)
}

// Close frees the communicator. A collective still running fails with
// ErrClosed (its buffers left to MPI); later ones return ErrClosed. The
// peers are not told: a rank that leaves early should Abort, so that they
// fail at once instead of at their timeout.
func (c *mpiComm) Close() error {
	return c.th.do(func() error { return c.closeLocked() })
}

// closeLocked is Close on the thread.
func (c *mpiComm) closeLocked() error {
	c.mu.Lock()
	if c.closed {
		c.mu.Unlock()
		return nil
	}
	c.closed = true
	c.mu.Unlock()
	busy := false
	for _, ph := range c.th.active {
		if ph.c == c && ph.result == nil {
			ph.abandon()
			ph.finish(errorf(ErrClosed, "rank %d closed its MPI communicator during %s", c.rank, ph.what))
			busy = true
		}
	}
	delete(c.th.comms, c)
	var err error
	if c.notice.state == 1 {
		if code := C.zm_cancel(&c.notice, 1000); code != 0 {
			err = mpiErr("MPI_Cancel of the abort notice's receive", c.rank, code)
		}
	}
	c.mu.Lock()
	failed := c.reason != nil
	c.mu.Unlock()
	if c.notice.state == 1 || busy || failed || c.th.finalized {
		return err // MPI may still hold something of it: leave it
	}
	c.freed = true
	c.pool.close()
	if code := C.zm_comm_free(c.handle); code != 0 && err == nil {
		err = mpiErr("MPI_Comm_free", c.rank, code)
	}
	return err
}

// abandon records that MPI holds transfers that will never be waited for.
func (th *mpiThread) abandon(err error) {
	if th.abandoned == nil {
		th.abandoned = err
	}
}

// ---- a phase: the transfers of one collective posted together ------------------

// mpiPiece bounds one transfer: MPI counts are C ints.
const mpiPiece = 1 << 30

type mpiPhase struct {
	c      *mpiComm
	what   string
	seq    uint64
	tag    int
	xfers  []C.zm_xfer
	bufs   []Tensor // what MPI may touch: kept for ever if abandoned
	posted time.Time
	probed time.Time
	done   chan error
	result error // under th.mu: set once finished
}

func (c *mpiComm) phase(seq uint64, phase int, a collArgs) *mpiPhase {
	return &mpiPhase{c: c, what: fmt.Sprintf("%v #%d", a, seq), seq: seq, tag: c.tag(seq, phase, a), done: make(chan error, 1)}
}

func (ph *mpiPhase) send(peer int, addr uintptr, n int) { ph.add(peer, addr, n, 0) }
func (ph *mpiPhase) recv(peer int, addr uintptr, n int) { ph.add(peer, addr, n, 1) }

// add appends the transfer in pieces; both ends cut it the same way, and
// MPI keeps the order of messages with one tag between two ranks.
func (ph *mpiPhase) add(peer int, addr uintptr, n int, recv C.int32_t) {
	for off := 0; off < n; off += mpiPiece {
		m := min(mpiPiece, n-off)
		ph.xfers = append(ph.xfers, C.zm_xfer{buf: C.uintptr_t(addr + uintptr(off)), bytes: C.int64_t(m), peer: C.int32_t(peer), tag: C.int32_t(ph.tag), recv: recv})
	}
}

// run posts the phase's transfers (serialized: here; funneled: on the MPI
// thread), runs local meanwhile, and waits for every transfer. bufs are the
// memory they touch. A sum over what the phase receives runs after it: one
// that started as soon as the receives had completed, while this rank's
// sends finished, took the CPU from the peers still reading them where the
// processes outnumber the CPUs (W = 4 on two CPUs, 1 MiB reduce-scatter:
// 0.69-0.98x MPI's own, 0.89-1.08x after; W = 2 unchanged).
func (ph *mpiPhase) run(local func(), bufs ...Tensor) error {
	if len(ph.xfers) == 0 {
		if local != nil {
			local()
		}
		return ph.c.err()
	}
	ph.bufs = bufs
	th := ph.c.th
	if th.serialized {
		th.mu.Lock()
		th.start(ph)
		th.mu.Unlock()
		if local != nil {
			local()
		}
		return th.await(ph)
	}
	th.in <- func() { th.start(ph) }
	if local != nil {
		local()
	}
	return <-ph.done
}

// start posts ph (under th.mu).
func (th *mpiThread) start(ph *mpiPhase) {
	c := ph.c
	if err := c.err(); err != nil {
		ph.finish(err)
		return
	}
	ph.posted, ph.probed = time.Now(), time.Now()
	if code := C.zm_post(c.handle, &ph.xfers[0], C.int(len(ph.xfers))); code != 0 {
		th.active = append(th.active, ph) // so that fail sees it, with what was posted
		c.fail(mpiErr("posting "+ph.what, c.rank, code), true)
		return
	}
	th.active = append(th.active, ph)
}

func (ph *mpiPhase) finish(err error) {
	if ph.result != nil {
		return
	}
	ph.result = err
	if err == nil {
		ph.result = errDone
	}
	ph.done <- err
}

var errDone = fmt.Errorf("done")

// abandon leaves the phase's buffers to MPI for ever, if any transfer of it
// is still posted.
func (ph *mpiPhase) abandon() {
	for _, x := range ph.xfers {
		if x.state == 1 {
			quarantine.add(ph.bufs...)
			ph.c.th.abandon(fmt.Errorf("%s was abandoned", ph.what))
			return
		}
	}
}

// waiting lists the peers with a transfer still pending: those this rank
// waits to hear from, and those that have not taken what it sent.
func (ph *mpiPhase) waiting() (from, to []int) {
	for _, x := range ph.xfers {
		if x.state != 1 {
			continue
		}
		if x.recv != 0 {
			from = append(from, int(x.peer))
		} else {
			to = append(to, int(x.peer))
		}
	}
	slices.Sort(from)
	slices.Sort(to)
	return slices.Compact(from), slices.Compact(to)
}

func (ph *mpiPhase) timeoutError() error {
	from, to := ph.waiting()
	c := ph.c
	switch {
	case len(from) > 0:
		return errorf(ErrTimeout, "rank %d waited %v in %s for ranks %v of %d; they failed, returned early or issued fewer collectives",
			c.rank, c.timeout, ph.what, from, c.size)
	default:
		return errorf(ErrTimeout, "rank %d waited %v in %s for ranks %v of %d to take what it sent; they failed, returned early or issued fewer collectives",
			c.rank, c.timeout, ph.what, to, c.size)
	}
}

func (ph *mpiPhase) xferError(x C.zm_xfer) error {
	c := ph.c
	var buf [1024]C.char
	var truncate C.int
	cls := C.zm_error_string(x.err, &buf[0], C.int(len(buf)), &truncate)
	e := &MPIError{Code: int(x.err), Class: int(cls), Text: C.GoString(&buf[0]), Op: ph.what, Rank: c.rank}
	if truncate != 0 {
		return fmt.Errorf("%w: rank %d received more than the %d bytes it expected from rank %d in %s; every rank must issue the same collectives with the same sizes: %w",
			ErrCollectiveMismatch, c.rank, int64(x.bytes), int(x.peer), ph.what, e)
	}
	return e
}

// checkCounts: every receive got the bytes it expected.
func (ph *mpiPhase) checkCounts() error {
	for _, x := range ph.xfers {
		if x.recv != 0 && x.got >= 0 && x.got != x.bytes {
			return errorf(ErrCollectiveMismatch, "rank %d received %d bytes from rank %d in %s, where it expected %d; every rank must issue the same collectives with the same sizes",
				ph.c.rank, int64(x.got), int(x.peer), ph.what, int64(x.bytes))
		}
	}
	return nil
}

// probeMismatch looks at what the peers this phase waits for have sent: a
// message of the same collective number under another tag is a peer that
// called another collective.
func (ph *mpiPhase) probeMismatch() error {
	from, _ := ph.waiting()
	c := ph.c
	mask := 1<<c.seqBits - 1
	for _, p := range from {
		var flag, tag C.int
		var n C.int64_t
		if C.zm_iprobe(c.handle, C.int(p), &flag, &tag, &n) != 0 || flag == 0 {
			continue
		}
		t := int(tag)
		if t != c.abortTag && t != ph.tag && t>>tagLowBits&mask == ph.tag>>tagLowBits&mask {
			return errorf(ErrCollectiveMismatch, "collective %d: rank %d called %s while rank %d called %s; every rank must issue the same collectives in the same order",
				ph.seq, c.rank, describeTag(ph.tag), p, describeTag(t))
		}
	}
	return nil
}

func mpiErr(op string, rank int, code C.int) error {
	var buf [1024]C.char
	var truncate C.int
	cls := C.zm_error_string(code, &buf[0], C.int(len(buf)), &truncate)
	return &MPIError{Code: int(code), Class: int(cls), Text: C.GoString(&buf[0]), Op: op, Rank: rank}
}

// ---- staging buffers ----------------------------------------------------------

// mpiPool keeps the buffers that receive the peers' parts for the next
// collective, so the steady state maps nothing.
type mpiPool struct {
	mu   sync.Mutex
	free []Tensor
}

// take returns a buffer of at least n bytes.
func (p *mpiPool) take(n int) (Tensor, error) {
	if n == 0 {
		return Tensor{}, nil
	}
	p.mu.Lock()
	best := -1
	for i, t := range p.free {
		if t.Bytes() >= n && (best < 0 || t.Bytes() < p.free[best].Bytes()) {
			best = i
		}
	}
	if best >= 0 {
		t := p.free[best]
		p.free = slices.Delete(p.free, best, best+1)
		p.mu.Unlock()
		return t, nil
	}
	p.mu.Unlock()
	return hostDev.Alloc((n+3)/4, FP32)
}

func (p *mpiPool) put(t Tensor) {
	if t.count == 0 {
		return
	}
	p.mu.Lock()
	p.free = append(p.free, t)
	p.mu.Unlock()
}

func (p *mpiPool) close() {
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, t := range p.free {
		hostDev.Free(t)
	}
	p.free = nil
}
