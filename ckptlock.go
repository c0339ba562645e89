package zero

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"time"

	"golang.org/x/sys/unix"
)

// One writer at a time in a checkpoint directory. A save takes dir's lock
// before it touches anything there and gives it back when it is done. The
// lock belongs to the save's identity, which every rank of one job shares
// (the first collective of the save agrees on it), not to a process: ranks
// in processes of their own (MPI, torchrun) check it against their own
// identity, never against their process, so they are never another
// writer to each other. Rank 0 takes it, with what tells whether its
// holder still lives: on the same host (its boot), the holding process
// and its start time, which a killed process no longer has (a pid reused
// later has another start time); from another host, a heartbeat the
// holder rewrites every ckptLockBeat, which a dead holder stops. A lock
// whose holder is gone is stale, and the next save breaks it: a resume
// after SIGKILL keeps working. A lock still being written (no content
// yet) is stale only once it has stayed so for a lease.

const ckptLockName = ".zero-save.lock"

// The heartbeat: the holder rewrites its lock every ckptLockBeat; a lock
// from another host whose beat has not moved for ckptLockLease is stale.
// Variables so that tests can shorten them.
var (
	ckptLockBeat  = 5 * time.Second
	ckptLockLease = 30 * time.Second
)

// saveLockData is the lock file.
type saveLockData struct {
	Save  string `json:"save"` // the save's identity
	Host  string `json:"host"`
	Boot  string `json:"boot"` // the host's boot id
	PID   int    `json:"pid"`
	Start uint64 `json:"start"` // the process's start time, in clock ticks since boot
	Beat  int64  `json:"beat"`
}

// thisProcess is what a lock taken here records of its holder.
var thisProcess = sync.OnceValue(func() saveLockData {
	host, _ := os.Hostname()
	return saveLockData{Host: host, Boot: bootID(), PID: os.Getpid(), Start: processStart(os.Getpid())}
})

func bootID() string {
	b, _ := os.ReadFile("/proc/sys/kernel/random/boot_id")
	return strings.TrimSpace(string(b))
}

// processStart is pid's start time in clock ticks since boot (field 22 of
// /proc/PID/stat), or 0 where it cannot be read: a process that is gone.
func processStart(pid int) uint64 {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return 0
	}
	// the name (field 2) is in parentheses and may hold spaces
	i := bytes.LastIndexByte(b, ')')
	if i < 0 {
		return 0
	}
	fields := strings.Fields(string(b[i+1:]))
	if len(fields) < 20 {
		return 0
	}
	v, _ := strconv.ParseUint(fields[19], 10, 64) // field 22: the 20th after the name
	return v
}

// processAlive says whether a process pid exists (where its start time
// could not be read).
func processAlive(pid int) bool {
	err := unix.Kill(pid, 0)
	return err == nil || errors.Is(err, unix.EPERM)
}

// heldHere are the saves of this process that hold their lock now: a lock
// of this process that is not among them was left by a save that died.
var heldHere = struct {
	sync.Mutex
	ids map[string]bool
}{ids: map[string]bool{}}

// saveLock is a lock this process holds.
type saveLock struct {
	fsys     ckptFS
	name     string
	data     saveLockData
	stop     chan struct{}
	beats    sync.WaitGroup
	released bool
}

// errLockHeld is another live writer's lock.
var errLockHeld = errors.New("another save holds the directory")

// acquireSaveLock takes dir's lock for save id, breaking a stale one. A
// lock another live save holds is refused at once, or, from another host,
// once its heartbeat has been seen to move (waiting up to a lease).
func acquireSaveLock(fsys ckptFS, dir, id string) (*saveLock, error) {
	l := &saveLock{fsys: fsys, name: filepath.Join(dir, ckptLockName), data: thisProcess(), stop: make(chan struct{})}
	l.data.Save = id
	content, err := json.Marshal(&l.data)
	if err != nil {
		return nil, err
	}
	// live before its file exists: a save of this process that finds the
	// file must not take it for a dead one's while it is being written
	heldHere.Lock()
	heldHere.ids[id] = true
	heldHere.Unlock()
	refuse := func(err error) (*saveLock, error) {
		heldHere.Lock()
		delete(heldHere.ids, id)
		heldHere.Unlock()
		return nil, err
	}
	for try := 0; ; try++ {
		f, err := fsys.CreateNew(l.name)
		if err == nil {
			_, err = f.Write(content)
			if cerr := f.Close(); err == nil {
				err = cerr
			}
			if err != nil {
				fsys.RemoveAll(l.name)
				return refuse(fmt.Errorf("%w: writing the lock %s: %w", ErrCheckpoint, l.name, err))
			}
			break
		}
		if !errors.Is(err, fs.ErrExist) {
			return refuse(fmt.Errorf("%w: taking the lock %s: %w", ErrCheckpoint, l.name, err))
		}
		if try == 3 {
			return refuse(errorf(ErrCheckpoint, "%s: could not take the lock %s after breaking it 3 times: another save keeps taking it; save into another directory", dir, l.name))
		}
		old, err := fsys.ReadFile(l.name)
		if errors.Is(err, fs.ErrNotExist) {
			continue // given back meanwhile
		}
		if err != nil {
			return refuse(fmt.Errorf("%w: reading the lock %s: %w", ErrCheckpoint, l.name, err))
		}
		old, err = staleLock(fsys, l.name, old)
		if err != nil {
			return refuse(err)
		}
		if err := breakLock(fsys, l.name, old); err != nil {
			return refuse(err)
		}
	}
	l.beats.Add(1)
	go l.heartbeat()
	return l, nil
}

// staleLock returns the content of the lock name, found with content old,
// once it is judged left by a save that is gone (what breakLock may
// remove), or an error that names its live holder.
func staleLock(fsys ckptFS, name string, old []byte) ([]byte, error) {
	var d saveLockData
	if json.Unmarshal(old, &d) != nil || d.Save == "" {
		// being written, or its writer died writing it: the writer writes
		// it in one go, so one that stays so for a lease is a dead one's
		now, err := awaitLockChange(fsys, name, old)
		if err != nil || now == nil {
			return old, err
		}
		return staleLock(fsys, name, now)
	}
	held := func(how string) error {
		return fmt.Errorf("%w: %w: %s is held by save %s of process %d on %s (%s); another job is saving into this directory: give each job a directory of its own, or remove the lock if no such job runs",
			ErrCheckpoint, errLockHeld, name, d.Save, d.PID, d.Host, how)
	}
	me := thisProcess()
	if d.Host == me.Host && d.Boot == me.Boot {
		if d.PID == me.PID && d.Start == me.Start {
			heldHere.Lock()
			live := heldHere.ids[d.Save]
			heldHere.Unlock()
			if live {
				return nil, held("a save of this process")
			}
			return old, nil // a save of this process that died
		}
		if d.Start != 0 && processStart(d.PID) == d.Start || d.Start == 0 && processAlive(d.PID) {
			return nil, held("its process is running")
		}
		return old, nil
	}
	// another host (or this one before a reboot, whose processes are
	// gone): the holder lives if its heartbeat moves within a lease
	now, err := awaitLockChange(fsys, name, old)
	if err != nil {
		return nil, err
	}
	if now != nil {
		return nil, held("its heartbeat moves")
	}
	return old, nil
}

// awaitLockChange reads the lock name until its content is no longer old
// and returns the new content, or nil where it stayed old for a lease or
// was given back. It reads soon at first (a lock being written), then
// every half beat.
func awaitLockChange(fsys ckptFS, name string, old []byte) ([]byte, error) {
	deadline := time.Now().Add(ckptLockLease)
	for wait := time.Millisecond; time.Now().Before(deadline); wait = min(2*wait, ckptLockBeat/2) {
		time.Sleep(min(wait, time.Until(deadline)))
		now, err := fsys.ReadFile(name)
		if errors.Is(err, fs.ErrNotExist) {
			return nil, nil // given back: take it
		}
		if err != nil {
			return nil, fmt.Errorf("%w: reading the lock %s: %w", ErrCheckpoint, name, err)
		}
		if !bytes.Equal(now, old) {
			return now, nil
		}
	}
	return nil, nil
}

// breakLock removes the stale lock whose content is old: moved aside under
// a name of its own first, so that a lock another save took meanwhile is
// put back instead of removed.
func breakLock(fsys ckptFS, name string, old []byte) error {
	aside := fmt.Sprintf("%s.stale-%d-%d", name, os.Getpid(), time.Now().UnixNano())
	if err := fsys.Rename(name, aside); err != nil {
		if errors.Is(err, fs.ErrNotExist) {
			return nil
		}
		return fmt.Errorf("%w: breaking the stale lock %s: %w", ErrCheckpoint, name, err)
	}
	now, err := fsys.ReadFile(aside)
	if err == nil && !bytes.Equal(now, old) {
		return fsys.Rename(aside, name) // someone's new lock: give it back
	}
	return fsys.RemoveAll(aside)
}

// heartbeat rewrites the lock with a new beat every ckptLockBeat until
// release, as long as the lock is still this save's.
func (l *saveLock) heartbeat() {
	defer l.beats.Done()
	t := time.NewTicker(ckptLockBeat)
	defer t.Stop()
	for {
		select {
		case <-l.stop:
			return
		case <-t.C:
		}
		if l.held() != nil {
			return
		}
		l.data.Beat++
		content, _ := json.Marshal(&l.data)
		tmp := fmt.Sprintf("%s.beat-%s", l.name, l.data.Save)
		f, err := l.fsys.Create(tmp)
		if err != nil {
			continue
		}
		_, err = f.Write(content)
		if cerr := f.Close(); err == nil && cerr == nil {
			err = l.fsys.Rename(tmp, l.name)
		}
		if err != nil {
			l.fsys.RemoveAll(tmp)
		}
	}
}

// held says whether the lock is still this save's.
func (l *saveLock) held() error { return checkSaveLock(l.fsys, filepath.Dir(l.name), l.data.Save) }

// checkSaveLock says whether dir's lock is save id's: every rank asks it
// before it writes, so a rank in a process of its own writes only under
// its own job's lock.
func checkSaveLock(fsys ckptFS, dir, id string) error {
	name := filepath.Join(dir, ckptLockName)
	b, err := fsys.ReadFile(name)
	var d saveLockData
	if err == nil {
		err = json.Unmarshal(b, &d)
	}
	switch {
	case errors.Is(err, fs.ErrNotExist):
		return errorf(ErrCheckpoint, "%s, which rank 0 took for save %s, is not there: save into a directory every rank shares (a network or parallel file system), the same on every rank; or another job broke the lock", name, id)
	case err != nil:
		return fmt.Errorf("%w: reading the lock %s: %w", ErrCheckpoint, name, err)
	case d.Save != id:
		return fmt.Errorf("%w: %w: %s is held by save %s of process %d on %s, not by this save (%s): another job took the directory; give each job a directory of its own", ErrCheckpoint, errLockHeld, name, d.Save, d.PID, d.Host, id)
	}
	return nil
}

// release gives the lock back, if it is still this save's; once.
func (l *saveLock) release() error {
	if l.released {
		return nil
	}
	l.released = true
	close(l.stop)
	l.beats.Wait()
	var err error
	if l.held() == nil {
		err = l.fsys.RemoveAll(l.name)
	}
	heldHere.Lock() // after the removal: until then the lock is live
	delete(heldHere.ids, l.data.Save)
	heldHere.Unlock()
	return err
}
