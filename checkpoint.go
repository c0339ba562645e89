package zero

import (
	"errors"
	"fmt"
	"hash/crc32"
	"io"
	"math"
	"math/rand/v2"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
)

// Checkpoints. A checkpoint is a directory, dir/step-N, holding one file
// per rank (its state tensors in its shard layout, and the caller's bytes;
// ckptfile.go) and manifest.json, written last. dir/latest names the newest
// complete one. Saving writes into dir/.partial-step-N, every file under a
// temporary name, fsynced and renamed; once every rank has succeeded (a
// collective of the outcomes), rank 0 renames the directory into place,
// writes the manifest and then the latest pointer, each durably. A crash
// or a failed rank at any moment leaves latest on the last complete
// checkpoint, and the new one without a manifest: visibly incomplete.
//
// The manifest describes the layout by bucket (which parameter sits where
// in each bucket, and each bucket's shard size and place), so state is
// found by parameter and element range, never by flat offset: a
// checkpoint loads into another plan (another world size, stage, bucket
// size or alignment) as well as into its own.

// SaveOptions are the choices of a Save.
type SaveOptions struct {
	// Client is this rank's own state (a data position, an RNG's state, an
	// epoch), committed with the engine's and returned by Load.
	Client []byte
	// Keep is how many complete checkpoints dir keeps, the newest; older
	// ones are removed once the new one is complete. 0 keeps 2.
	Keep int
}

// LoadOptions are the choices of a Load.
type LoadOptions struct {
	// WeightsOnly loads the parameters (the fp32 master and the model-dtype
	// values) and starts the optimizer afresh: moments zero, no steps
	// taken, the loss scale and the groups as the engine's Config sets
	// them (DeepSpeed's load_module_only, for a fine-tuning restart).
	WeightsOnly bool
	// KeepConfigGroups restores everything but the optimizer groups'
	// settings, which stay as this engine's Config sets them: the
	// hyperparameters of a resumed run (a new learning rate or weight
	// decay), with the moments, step counts and loss scale it saved.
	// SetGroup after Load changes a single group the same way.
	KeepConfigGroups bool
	// NewRankClient is the saved rank whose Client bytes a rank gets that
	// the checkpoint does not have (a load into more ranks than saved):
	// rank 0's by default, so a position every rank shares (a data
	// loader's) reaches the new ranks; NoClient gives them none.
	NewRankClient int
}

// NoClient, as LoadOptions.NewRankClient, gives the ranks a reshard adds
// no Client bytes.
const NoClient = -1

// LoadReport is what a Load did: this rank's Client bytes, the checkpoint
// it loaded, what of its layout was resharded, and where the settings the
// engine runs with came from.
type LoadReport struct {
	// Client is this rank's bytes from SaveOptions.Client: its own where
	// the saving run had this rank, otherwise saved rank ClientRank's.
	Client []byte
	// ClientRank is the saved rank whose bytes Client holds: this rank,
	// or for a rank the saving run did not have LoadOptions.NewRankClient
	// (-1 and nil Client with NoClient).
	ClientRank int
	// Dir is the checkpoint loaded: dir, or the checkpoint its latest
	// names.
	Dir string
	// Step, World and Stage are the checkpoint's: the steps taken when it
	// was saved (the engine's step count after Load, 0 with WeightsOnly),
	// its world size and its stage.
	Step, World, Stage int
	// Reshard is what differs between the checkpoint's layout and the
	// engine's (zero where nothing does).
	Reshard Reshard
	// FromCheckpoint names the settings Load set from the checkpoint: the
	// optimizer groups' ("Optimizer.Groups[0].LR", …), unless
	// KeepConfigGroups or WeightsOnly. Every other setting is the
	// engine's Config's.
	FromCheckpoint []string
	// Changed lists the settings whose saved value differs from the
	// engine's, with both values, in the settings record's order: the
	// world size, the stage, the layout, the batch split, the optimizer's
	// settings, rank-local ones. Load refuses a difference in any other.
	Changed []SettingChange
}

// Reshard is what differs between a checkpoint's layout and the engine
// that loads it; state is found by parameter and element range either way.
type Reshard struct {
	World   bool // another world size: a rank the saving run did not have gets LoadReport.ClientRank's Client bytes
	Stage   bool // another stage
	Buckets bool // the parameters are grouped into buckets otherwise (another bucket size)
	// Params names the parameters some of whose elements lie elsewhere
	// than saved (in another rank's shard, or at another place in it), in
	// registration order: their state was read from other saved ranks'
	// files or places.
	Params []string
}

// Any reports whether anything was resharded.
func (r Reshard) Any() bool { return r.World || r.Stage || r.Buckets || len(r.Params) > 0 }

// SettingChange is a setting whose value in a checkpoint differs from the
// engine's that loads it.
type SettingChange struct {
	Path   string // as in Engine.Settings
	Saved  string // the checkpoint's value ("none": its record has no such setting)
	Engine string // the engine's before the load ("none": its record has none)
	// FromCheckpoint says the engine runs with Saved from now on (an
	// optimizer group's setting restored); otherwise it keeps Engine.
	FromCheckpoint bool
}

// ckptSnapshot is what a checkpoint needs of the engine: a plain record
// the hub fills when a save, load or export starts.
type ckptSnapshot struct {
	fs          ckptFS
	comm        Comm
	rank, world int
	stage       int
	plan        *Plan
	params      []Param
	settings    []Setting
	opt         *optState
	ps          *paramState // nil below stage 3
	step        int
	// stop says whether to stop before the next read or write of a
	// chunk: the engine's Abort (nil: never).
	stop func() error
}

// ckptJob runs a save, load or export over a snapshot.
type ckptJob struct{ ckptSnapshot }

func newCkptJob(snap ckptSnapshot) *ckptJob { return &ckptJob{snap} }

// shareOutcome runs one collective of the ranks' outcomes: every rank learns
// whether any failed; vals (the same length on every rank) are summed.
func (ce *ckptJob) shareOutcome(failed bool, vals ...float64) (bool, []float64, error) {
	f := 0.0
	if failed {
		f = 1
	}
	out, err := AllReduceScalars(ce.comm, OpSum, append([]float64{f}, vals...)...)
	if err != nil {
		return false, nil, err
	}
	return out[0] != 0, out[1:], nil
}

// manifestFor describes the engine's model, layout and settings.
func (ce *ckptJob) manifestFor() ckptManifestData {
	m := ckptManifestData{Format: ckptFormat, Version: ckptVersion, Step: ce.step, Stage: ce.stage,
		Optimizer: ce.opt.checkpointState()}
	for _, p := range ce.params {
		m.Params = append(m.Params, ckptParam{Name: p.Name, Shape: slices.Clone(p.Shape), Count: p.Count, DType: p.DType.String(), Group: p.Group, Frozen: p.Frozen})
	}
	m.Layout = ckptLayout{World: ce.world, ShardElems: ce.plan.ShardElems}
	for _, bp := range ce.plan.Buckets {
		b := ckptBucket{Shard: bp.Shard, ShardOffset: bp.ShardOffset}
		for _, p := range bp.Params {
			b.Members = append(b.Members, [2]int{p, ce.plan.ParamOffset[p]})
		}
		m.Layout.Buckets = append(m.Layout.Buckets, b)
	}
	for _, s := range ce.settings {
		m.Settings = append(m.Settings, ckptSetting{s.Path, s.Value, s.Class.String()})
	}
	return m
}

// ---- save --------------------------------------------------------------------

// save writes a checkpoint of the engine under dir; every rank calls it.
func (ce *ckptJob) save(dir string, opt SaveOptions) error {
	keep := opt.Keep
	if keep == 0 {
		keep = 2
	}
	if keep < 0 {
		return errorf(ErrConfig, "SaveOptions.Keep %d; keep at least 1 checkpoint (0 keeps 2)", keep)
	}
	// Rank 0 draws the save's identity, takes dir's lock for it (one
	// writer at a time: ckptlock.go), names the checkpoint (a name not
	// taken yet) and makes its partial directory; every rank learns the
	// outcome, the name and the identity (below 2^48: it travels exactly).
	var suffix, id float64
	var err0 error
	var lock *saveLock
	if ce.rank == 0 {
		n := rand.Uint64() >> 16
		id = float64(n)
		if err0 = ce.fs.MkdirAll(dir); err0 != nil {
			err0 = fmt.Errorf("%w: %w", ErrCheckpoint, err0)
		} else if lock, err0 = acquireSaveLock(ce.fs, dir, formatSaveID(n)); err0 == nil {
			defer lock.release()
			var k int
			k, err0 = ce.freshName(dir)
			suffix = float64(k)
		}
	}
	failed, vals, err := ce.shareOutcome(err0 != nil, suffix, id)
	if err != nil {
		return err
	}
	if failed {
		return ckptPeerError(err0, "could not take "+dir+" or create the checkpoint's directory there")
	}
	name := ckptName(ce.step, int(vals[0]))
	partial := filepath.Join(dir, ckptPartial+name)
	saveID := formatSaveID(uint64(vals[1]))

	// Every rank writes its file, under its save's lock; rank 0 gathers
	// sizes and checksums.
	var size int64
	var crc uint32
	errw := checkSaveLock(ce.fs, dir, saveID)
	if errw == nil {
		size, crc, errw = ce.writeRankFile(partial, opt.Client, saveID)
	}
	report := make([]float64, 2*ce.world)
	if errw == nil {
		report[2*ce.rank], report[2*ce.rank+1] = float64(size), float64(crc)
	}
	failed, vals, err = ce.shareOutcome(errw != nil, report...)
	if err != nil {
		return err
	}
	if failed {
		if ce.rank == 0 {
			ce.fs.RemoveAll(partial) // best effort: it was never complete
		}
		return ckptPeerError(errw, "a rank could not write its part of the checkpoint")
	}
	// Rank 0 commits: the directory into place, the manifest, the pointer.
	var errc error
	committed := 0.0
	if ce.rank == 0 {
		m := ce.manifestFor()
		m.Save = saveID
		for r := range ce.world {
			m.Files = append(m.Files, ckptFileInfo{Name: rankFileName(r), Rank: r, Bytes: int64(vals[2*r]), CRC: uint32(vals[2*r+1])})
		}
		if errc = checkSaveLock(ce.fs, dir, saveID); errc == nil {
			errc = ce.commit(dir, name, partial, m)
		}
		if errc == nil {
			committed = 1
			if perr := ce.prune(dir, name, keep); perr != nil {
				errc = errorf(ErrCheckpoint, "%s is saved and %s names it, but removing older checkpoints failed: %v; remove them by hand", filepath.Join(dir, name), ckptLatest, perr)
			}
		}
		if rerr := lock.release(); errc == nil && rerr != nil {
			errc = errorf(ErrCheckpoint, "%s is saved and %s names it, but giving back the lock failed: %v; the next save breaks it", filepath.Join(dir, name), ckptLatest, rerr)
		}
	}
	failed, vals, err = ce.shareOutcome(errc != nil, committed)
	switch {
	case err != nil:
		return err
	case failed && vals[0] != 0:
		return ckptPeerError(errc, "the checkpoint is saved, but rank 0 could not remove older ones or give back the lock")
	case failed:
		return ckptPeerError(errc, "rank 0 could not commit the checkpoint")
	}
	return nil
}

func ckptName(step, k int) string {
	name := fmt.Sprintf("step-%08d", step)
	if k > 0 {
		name += "." + strconv.Itoa(k)
	}
	return name
}

// ckptPeerError is this rank's own error, or, where another rank failed,
// one that says so.
func ckptPeerError(own error, what string) error {
	if own != nil {
		return own
	}
	return errorf(ErrCheckpoint, "%s (see that rank's error); the previous checkpoint is untouched", what)
}

// freshName picks the suffix of a name no checkpoint has, clears stale
// partial directories, and makes this save's partial directory.
func (ce *ckptJob) freshName(dir string) (int, error) {
	if err := ce.fs.MkdirAll(dir); err != nil {
		return 0, fmt.Errorf("%w: %w", ErrCheckpoint, err)
	}
	ents, err := ce.fs.ReadDir(dir)
	if err != nil {
		return 0, fmt.Errorf("%w: %w", ErrCheckpoint, err)
	}
	taken := map[string]bool{}
	for _, e := range ents {
		if strings.HasPrefix(e.Name(), ckptPartial) {
			if err := ce.fs.RemoveAll(filepath.Join(dir, e.Name())); err != nil {
				return 0, fmt.Errorf("%w: %w", ErrCheckpoint, err)
			}
			continue
		}
		taken[e.Name()] = true
	}
	k := 0
	for taken[ckptName(ce.step, k)] {
		k++
	}
	if err := ce.fs.MkdirAll(filepath.Join(dir, ckptPartial+ckptName(ce.step, k))); err != nil {
		return 0, fmt.Errorf("%w: %w", ErrCheckpoint, err)
	}
	return k, nil
}

// writeRankFile streams this rank's state into partial/rank-R.bin, through
// a temporary name, and returns the file's size and CRC32C.
func (ce *ckptJob) writeRankFile(partial string, client []byte, saveID string) (int64, uint32, error) {
	footer := ckptFooter{Save: saveID, Rank: ce.rank, World: ce.world, ShardElems: int64(ce.plan.ShardElems)}
	for p := range ce.params {
		if r := ce.plan.shardRange(p, ce.rank); r.Count > 0 {
			footer.Segments = append(footer.Segments, ckptSegment{int64(p), int64(r.ParamOffset), int64(r.Count), int64(r.ShardOffset)})
		}
	}
	name := filepath.Join(partial, rankFileName(ce.rank))
	return createRankFile(ce.fs, name, footer, ce.stop, client, func(w *rankWriter) error {
		buf := make([]byte, ckptChunk)
		for _, st := range ce.opt.stateTensors() {
			if err := writeState(w, st, buf); err != nil {
				return err
			}
		}
		return nil
	})
}

// writeState streams one state tensor, a chunk at a time: read in place
// on the host, copied through buf from a device.
func writeState(w *rankWriter, st stateTensor, buf []byte) error {
	w.begin(st.name, st.t.dtype)
	defer w.end()
	if err := st.s.Sync(); err != nil { // the state's last writes
		return err
	}
	size := st.t.dtype.Size()
	per := len(buf) / size
	_, onHost := st.dev.(*hostDevice)
	for off := 0; off < st.t.count; off += per {
		if w.stop != nil {
			if err := w.stop(); err != nil {
				return err
			}
		}
		n := min(per, st.t.count-off)
		part := st.t.slice(off, n)
		var b []byte
		if onHost {
			b = part.hostBytes()
		} else {
			b = buf[:n*size]
			if err := st.dev.copy(st.s, hostTensor(b, st.t.dtype), part); err != nil {
				return err
			}
			if err := st.s.Sync(); err != nil {
				return err
			}
		}
		if err := w.add(b); err != nil {
			return err
		}
	}
	return nil
}

// commit moves a checkpoint whose rank files are all written into place:
// the partial directory's renames made durable, the directory renamed,
// the manifest written (from then on it is complete), the latest pointer
// moved to it.
func (ce *ckptJob) commit(dir, name, partial string, m ckptManifestData) error {
	wrap := func(err error) error {
		if err == nil {
			return nil
		}
		return fmt.Errorf("%w: committing %s: %w; the previous checkpoint is untouched", ErrCheckpoint, filepath.Join(dir, name), err)
	}
	final := filepath.Join(dir, name)
	if err := ce.sharedByAll(partial, m.Files); err != nil {
		return err
	}
	if err := ce.fs.SyncDir(partial); err != nil {
		return wrap(err)
	}
	if err := ce.fs.Rename(partial, final); err != nil {
		return wrap(err)
	}
	if err := ce.fs.SyncDir(dir); err != nil {
		return wrap(err)
	}
	data, err := sealManifest(&m)
	if err != nil {
		return wrap(err)
	}
	if err := writeFileDurably(ce.fs, filepath.Join(final, ckptManifest), data); err != nil {
		return wrap(err)
	}
	return wrap(writeFileDurably(ce.fs, filepath.Join(dir, ckptLatest), []byte(name+"\n")))
}

// sharedByAll checks that rank 0 sees every rank's file as that rank
// wrote it: a checkpoint is one directory every rank sees. On disks local
// to each node, the files of another node's ranks are missing here.
func (ce *ckptJob) sharedByAll(partial string, files []ckptFileInfo) error {
	for _, fi := range files {
		name := filepath.Join(partial, fi.Name)
		f, err := ce.fs.Open(name)
		var size int64
		if err == nil {
			size, err = f.Size()
			f.Close()
		}
		if err != nil || size != fi.Bytes {
			return errorf(ErrCheckpoint, "rank %d wrote %s (%d bytes), rank 0 does not see it there (%v, %d bytes): save into a directory every rank shares (a network or parallel file system); the previous checkpoint is untouched",
				fi.Rank, name, fi.Bytes, err, size)
		}
	}
	return nil
}

// prune removes the complete checkpoints beyond the newest keep (name, just
// written, among them), and any incomplete ones (no manifest), which no
// load would take.
func (ce *ckptJob) prune(dir, name string, keep int) error {
	ents, err := ce.fs.ReadDir(dir)
	if err != nil {
		return err
	}
	var complete []string
	for _, e := range ents {
		if !e.IsDir() || !strings.HasPrefix(e.Name(), "step-") || e.Name() == name {
			continue
		}
		if _, err := ce.fs.ReadFile(filepath.Join(dir, e.Name(), ckptManifest)); err != nil {
			if err := ce.fs.RemoveAll(filepath.Join(dir, e.Name())); err != nil {
				return err
			}
			continue
		}
		complete = append(complete, e.Name())
	}
	slices.SortFunc(complete, compareCkptNames)
	for len(complete) > keep-1 {
		if err := ce.fs.RemoveAll(filepath.Join(dir, complete[0])); err != nil {
			return err
		}
		complete = complete[1:]
	}
	return nil
}

// compareCkptNames orders step-N and step-N.k by N, then k.
func compareCkptNames(a, b string) int {
	parse := func(s string) (int, int) {
		s = strings.TrimPrefix(s, "step-")
		n, k, _ := strings.Cut(s, ".")
		x, _ := strconv.Atoi(n)
		y, _ := strconv.Atoi(k)
		return x, y
	}
	an, ak := parse(a)
	bn, bk := parse(b)
	if an != bn {
		return an - bn
	}
	return ak - bk
}

// ---- load --------------------------------------------------------------------

// checkModel pairs the engine's parameters with the checkpoint's, by name
// (by position where either side has a parameter without one), and
// refuses a checkpoint of another model, naming the first parameter that
// differs: one the engine lacks, one the checkpoint lacks, or one of
// another count, shape, dtype, group or frozen flag; or a checkpoint with
// settings that must match and differ. The optimizer's settings are state
// (restored, or the engine's own with WeightsOnly) and may differ; so may
// the layout (world size, stage, buckets: state is found by parameter) and
// the batch split (the saved loss scale is the step's mean loss's, at any
// G). It returns, for each engine parameter, its index in the checkpoint,
// and the engine's parameters in the checkpoint's order.
func (ce *ckptJob) checkModel(at string, m ckptManifestData) ([]int, []Param, error) {
	where := filepath.Join(at, ckptManifest)
	src, err := matchParams(where, m.Params, ce.params)
	if err != nil {
		return nil, nil, err
	}
	for i, q := range ce.params {
		p := m.Params[src[i]]
		if p.Count != q.Count || p.DType != q.DType.String() || p.Frozen != q.Frozen || (!q.Frozen && p.Group != q.Group) ||
			(len(p.Shape) > 0 && len(q.Shape) > 0 && !slices.Equal(p.Shape, q.Shape)) {
			return nil, nil, errorf(ErrCheckpoint, "%s: parameter %d (%q) is %v %d %s (group %d, frozen %v) in the checkpoint, the engine's is %v %d %v (group %d, frozen %v); load a checkpoint of this model",
				where, i, q.Name, p.Shape, p.Count, p.DType, p.Group, p.Frozen, q.Shape, q.Count, q.DType, q.Group, q.Frozen)
		}
	}
	saved := make([]Param, len(ce.params))
	for i, j := range src {
		saved[j] = ce.params[i]
	}
	if err := ce.checkSettings(where, m); err != nil {
		return nil, nil, err
	}
	return src, saved, nil
}

// matchParams finds each of params among a checkpoint's (saved): by name
// where every parameter on both sides has a name of its own, by position
// otherwise; a parameter on one side only is refused, named.
func matchParams(where string, saved []ckptParam, params []Param) ([]int, error) {
	byName := map[string]int{}
	named := true
	for i, p := range saved {
		byName[p.Name] = i
		named = named && p.Name != ""
	}
	named = named && len(byName) == len(saved)
	for _, q := range params {
		named = named && q.Name != ""
	}
	src := make([]int, len(params))
	if !named {
		if len(saved) != len(params) {
			return nil, errorf(ErrCheckpoint, "%s: a model of %d parameters, the engine has %d; load a checkpoint of this model", where, len(saved), len(params))
		}
		for i := range src {
			src[i] = i
		}
		return src, nil
	}
	for i, q := range params {
		j, ok := byName[q.Name]
		if !ok {
			return nil, errorf(ErrCheckpoint, "%s: the engine's parameter %d (%q) is not in the checkpoint, whose parameters are %s; load a checkpoint of this model, or register only the checkpoint's parameters", where, i, q.Name, paramNames(saved))
		}
		src[i] = j
		delete(byName, q.Name)
	}
	for j, p := range saved {
		if _, left := byName[p.Name]; left {
			return nil, errorf(ErrCheckpoint, "%s: the checkpoint's parameter %d (%q, %v %d %s) is not one of the engine's; register it (frozen, if it does not train), or load a checkpoint of this model", where, j, p.Name, p.Shape, p.Count, p.DType)
		}
	}
	return src, nil
}

// paramNames lists the first names of a checkpoint's parameters, for a
// message.
func paramNames(ps []ckptParam) string {
	var names []string
	for i, p := range ps {
		if i == 8 {
			names = append(names, fmt.Sprintf("… (%d in all)", len(ps)))
			break
		}
		names = append(names, strconv.Quote(p.Name))
	}
	return strings.Join(names, ", ")
}

// checkSettings refuses a checkpoint saved with settings that must match
// and differ from the engine's.
func (ce *ckptJob) checkSettings(where string, m ckptManifestData) error {
	saved := map[string]ckptSetting{}
	for _, s := range m.Settings {
		saved[s.Path] = s
	}
	for _, s := range ce.settings {
		if s.Class != ClassMatch || strings.HasPrefix(s.Path, "Optimizer.") || strings.HasPrefix(s.Path, "Model[") {
			continue
		}
		if o, ok := saved[s.Path]; ok && o.Value != s.Value {
			return errorf(ErrCheckpoint, "%s: %s was %s when saved, the engine has %s; a setting of class match is the same on reload: set it as saved", where, s.Path, o.Value, s.Value)
		}
	}
	return nil
}

// checkScalars refuses optimizer scalars no save writes: they would be
// loaded as they are.
func checkScalars(at string, c optCheckpoint) error {
	bad := func(format string, args ...any) error {
		return errorf(ErrCheckpoint, "%s: %s; the manifest is damaged: load another checkpoint", filepath.Join(at, ckptManifest), fmt.Sprintf(format, args...))
	}
	for p, n := range c.Steps {
		if n < 0 {
			return bad("parameter %d has taken %d optimizer steps", p, n)
		}
	}
	s := c.Scaler
	switch {
	case c.Scheduled < 0:
		return bad("the schedule is at step %d", c.Scheduled)
	case !(s.Scale > 0) || math.IsInf(s.Scale, 0):
		return bad("a loss scale of %v", s.Scale)
	case s.CurHysteresis < 0 || s.Iter < 0 || s.LastOverflow < -1 || s.LastOverflow > s.Iter:
		return bad("the loss scaler's hysteresis %d, iteration %d, last overflow %d", s.CurHysteresis, s.Iter, s.LastOverflow)
	}
	return nil
}

// loader reads a checkpoint's state into this rank's plan.
type loader struct {
	ce       *ckptJob
	at       string
	m        ckptManifestData
	x        *ckptIndex
	src      []int // per parameter of ce, its index in the checkpoint
	readers  map[int]*rankReader
	sections []string // the first verified file's, which every file must have
	buf      []byte   // one chunk (ckptChunk bytes)
	ahead    []byte   // a second one, for the checks' read-ahead
}

func newLoader(ce *ckptJob, at string, m ckptManifestData, x *ckptIndex) *loader {
	src := make([]int, len(ce.params))
	for p := range src {
		src[p] = p
	}
	return &loader{ce: ce, at: at, m: m, x: x, src: src, readers: map[int]*rankReader{}}
}

// byEngine is c with its step counts in the engine's order of parameters
// (src: each one's index in the checkpoint).
func byEngine(c optCheckpoint, src []int) optCheckpoint {
	if len(c.Steps) != len(src) {
		return c // refused by restorable, or unused (WeightsOnly)
	}
	steps := make([]int, len(src))
	for p, j := range src {
		steps[p] = c.Steps[j]
	}
	c.Steps = steps
	return c
}

// need lists the ranks whose files hold part of this rank's shard, and the
// client bytes (this rank's own file, where the checkpoint had this rank).
func (ld *loader) need() []int {
	set := map[int]bool{}
	if world, _ := ld.x.shape(); ld.ce.rank < world {
		set[ld.ce.rank] = true
	}
	for p := range ld.ce.params {
		r := ld.ce.plan.shardRange(p, ld.ce.rank)
		if r.Count == 0 {
			continue
		}
		ld.x.each(ld.src[p], r.ParamOffset, r.Count, func(rank, _, _, _ int) error {
			set[rank] = true
			return nil
		})
	}
	out := make([]int, 0, len(set))
	for r := range set {
		out = append(out, r)
	}
	slices.Sort(out)
	return out
}

// verify opens every file this rank needs and checks it against the
// manifest, and whole against its CRC32C, before anything of the engine
// changes.
func (ld *loader) verify() error { return ld.verifyRanks(ld.need()) }

// verifyRanks checks the files of ranks and keeps them open.
func (ld *loader) verifyRanks(ranks []int) error {
	for _, r := range ranks {
		fi := ld.m.Files[r]
		rr, err := openRankFile(ld.ce.fs, filepath.Join(ld.at, fi.Name), fi.Bytes, ld.ce.stop)
		if err != nil {
			return err
		}
		ld.readers[r] = rr
		if err := ld.checkFooter(rr, r); err != nil {
			return err
		}
		crc, err := fileCRC(rr, fi.Bytes, ld.buffers(fi.Bytes))
		if err != nil {
			return err
		}
		if crc != fi.CRC {
			return rr.corrupt("its checksum is %08x, the manifest says %08x", crc, fi.CRC)
		}
		rr.verified = true
	}
	return nil
}

// checkFooter checks rank r's file's footer against the manifest: its
// format version, the save's identity, its rank and world, its shard's
// parameter ranges (the manifest's for rank r, exactly), and its sections
// (every one zero's, of its dtype and the shard's size; master, model and
// client there, and AdamW's moments; the same names in every file).
func (ld *loader) checkFooter(rr *rankReader, r int) error {
	f := &rr.footer
	switch {
	case f.Version != ld.m.Version:
		return rr.corrupt("format version %d, the manifest's is %d", f.Version, ld.m.Version)
	case f.Save != ld.m.Save:
		return rr.corrupt("written by another save (%q; the manifest's is %q): a file of another checkpoint", f.Save, ld.m.Save)
	}
	if world, shardElems := ld.x.shape(); f.Rank != r || f.World != world || f.ShardElems != int64(shardElems) {
		return rr.corrupt("rank %d of %d with a shard of %d elements; the manifest lists it as rank %d of %d with %d", f.Rank, f.World, f.ShardElems, r, world, shardElems)
	}
	want := ld.x.segments(r)
	if !slices.Equal(f.Segments, want) {
		i := 0
		for i < min(len(want), len(f.Segments)) && f.Segments[i] == want[i] {
			i++
		}
		return rr.corrupt("its shard holds other parameter ranges than the manifest's layout gives rank %d (they differ from range %d on: %v, the layout's %v)", r, i, f.Segments[i:min(i+1, len(f.Segments))], want[i:min(i+1, len(want))])
	}
	names := make([]string, 0, len(f.Sections))
	for _, s := range f.Sections {
		dt, ok := ld.x.sectionDType(s.Name)
		switch {
		case !ok || slices.Contains(names, s.Name):
			return rr.corrupt("a section %q, which is not one of zero's or comes twice", s.Name)
		case s.DType != dt:
			return rr.corrupt("section %q holds %q, not %q", s.Name, s.DType, dt)
		case dt != "":
			d, _ := dtypeNamed(dt)
			if s.Bytes != f.ShardElems*int64(d.Size()) {
				return rr.corrupt("section %q has %d bytes, a shard of %d %s elements has %d", s.Name, s.Bytes, f.ShardElems, dt, f.ShardElems*int64(d.Size()))
			}
		}
		names = append(names, s.Name)
	}
	required := []string{"master", "model", "client"}
	if ld.m.Optimizer.Kind == "adamw" {
		required = append(required, "m", "v")
	}
	for _, name := range required {
		if !slices.Contains(names, name) {
			return rr.corrupt("no %s section", name)
		}
	}
	slices.Sort(names)
	if ld.sections == nil {
		ld.sections = names
	} else if !slices.Equal(names, ld.sections) {
		return rr.corrupt("the sections %v, another rank's file has %v", names, ld.sections)
	}
	return nil
}

// buffer is the loader's memory for every read it copies: a chunk, or
// the bytes wanted where they are fewer (at least 4).
func (ld *loader) buffer(want int64) []byte {
	n := int(max(min(want, ckptChunk), 4))
	if len(ld.buf) < n {
		ld.buf = make([]byte, n)
	}
	return ld.buf
}

// buffers are two pieces of at most verifyPiece bytes, for reading ahead
// while checking files of up to size bytes.
func (ld *loader) buffers(size int64) [2][]byte {
	n := int(max(min(size, verifyPiece), 1))
	if len(ld.ahead) < 2*n {
		ld.ahead = make([]byte, 2*n)
	}
	return [2][]byte{ld.ahead[:n], ld.ahead[n : 2*n]}
}

const verifyPiece = 1 << 20 // the checks' reads: small enough to be summed while still in cache

// fileCRC reads a whole file in order and returns its CRC32C: a reader
// fills one of two pieces while the other is summed, so the check costs
// about the read alone.
func fileCRC(rr *rankReader, size int64, bufs [2][]byte) (uint32, error) {
	type piece struct {
		b   []byte
		err error
	}
	full, free := make(chan piece, 2), make(chan []byte, 2)
	free <- bufs[0]
	free <- bufs[1]
	go func() {
		defer close(full)
		step := int64(len(bufs[0]))
		for off := int64(0); off < size; off += step {
			b := (<-free)[:min(step, size-off)]
			_, err := rr.readAt(b, off)
			if err == io.EOF {
				err = nil
			}
			full <- piece{b, err}
			if err != nil {
				return
			}
		}
	}()
	crc := uint32(0)
	var err error
	for p := range full {
		if p.err != nil && err == nil {
			err = p.err
			if !errors.Is(err, ErrAborted) {
				err = rr.corrupt("reading it: %v", p.err)
			}
		}
		if err == nil {
			crc = crc32.Update(crc, castagnoli, p.b)
		}
		free <- p.b // two buffers, room for two: never blocks
	}
	return crc, err
}

// fill writes state tensor st from the checkpoint's section of the same
// name, a chunk of this rank's shard at a time; elements no parameter
// holds (padding) are zero. zero fills it with zeros instead.
func (ld *loader) fill(st stateTensor, zero bool) error {
	size := st.t.dtype.Size()
	per := ckptChunk / size
	_, onHost := st.dev.(*hostDevice) // read straight into the state
	type seg struct{ p, po, so, n int }
	var segs []seg
	for p := range ld.ce.params {
		if r := ld.ce.plan.shardRange(p, ld.ce.rank); r.Count > 0 {
			segs = append(segs, seg{p, r.ParamOffset, r.ShardOffset, r.Count})
		}
	}
	slices.SortFunc(segs, func(x, y seg) int { return x.so - y.so })
	// chunk fills b, elements [off, off+n) of the state: the gaps zeroed
	chunk := func(off, n int, b []byte) error {
		at := off // b is written up to element at
		for _, sg := range segs {
			lo, hi := max(off, sg.so), min(off+n, sg.so+sg.n)
			if lo >= hi || zero {
				continue
			}
			clear(b[(at-off)*size : (lo-off)*size])
			// param elements [lo−so+po, hi−so+po) go to b at lo−off
			if err := ld.readParam(st, ld.src[sg.p], lo-sg.so+sg.po, hi-lo, b[(lo-off)*size:(hi-off)*size]); err != nil {
				return err
			}
			at = hi
		}
		clear(b[(at-off)*size:])
		return nil
	}
	verified := true
	for _, rr := range ld.readers {
		verified = verified && rr.verified
	}
	if onHost && verified {
		if err := st.s.Sync(); err != nil { // nothing of the stream still uses it
			return err
		}
		// Verified files are read with ReadAt alone: two goroutines take
		// alternate chunks, as a copy out of the page cache is the CPU's.
		var other error
		var wg sync.WaitGroup
		wg.Add(1)
		go func() {
			defer wg.Done()
			for off := per; off < st.t.count && other == nil; off += 2 * per {
				n := min(per, st.t.count-off)
				other = chunk(off, n, st.t.slice(off, n).hostBytes())
			}
		}()
		var err error
		for off := 0; off < st.t.count && err == nil; off += 2 * per {
			n := min(per, st.t.count-off)
			err = chunk(off, n, st.t.slice(off, n).hostBytes())
		}
		wg.Wait()
		return errors.Join(err, other)
	}
	buf := ld.buffer(int64(st.t.count) * int64(size))
	per = len(buf) / size
	for off := 0; off < st.t.count; off += per {
		n := min(per, st.t.count-off)
		b := buf[:n*size]
		if err := chunk(off, n, b); err != nil {
			return err
		}
		if err := st.dev.copy(st.s, st.t.slice(off, n), hostTensor(b, st.t.dtype)); err != nil {
			return err
		}
		if err := st.s.Sync(); err != nil {
			return err
		}
	}
	return nil
}

// readParam reads count elements of the checkpoint's parameter p from
// element from, of section st.name, into dst, from whichever ranks' files
// hold them.
func (ld *loader) readParam(st stateTensor, p, from, count int, dst []byte) error {
	size := st.t.dtype.Size()
	return ld.x.each(p, from, count, func(rank, po, n, so int) error {
		rr := ld.readers[rank]
		if rr == nil {
			return errorf(ErrCheckpoint, "%s: rank %d's file holds part of parameter %d and was not checked", ld.at, rank, p)
		}
		sec, ok := rr.footer.section(st.name)
		if !ok || sec.DType != st.t.dtype.String() {
			return rr.corrupt("no %s section of %v", st.name, st.t.dtype)
		}
		return rr.read(sec, int64(so)*int64(size), dst[(po-from)*size:(po-from+n)*size])
	})
}

// client returns saved rank from's client bytes (nil where from is -1).
// Where this rank reads no state from that rank's file, only the file's
// footer is checked here, and the bytes' chunks as they are read: the
// engine rank of that number checks the file whole (a rank the saving
// run did not have takes a rank's that it had).
func (ld *loader) client(from int) ([]byte, error) {
	if from < 0 {
		return nil, nil
	}
	rr, ok := ld.readers[from]
	if !ok {
		fi := ld.m.Files[from]
		var err error
		if rr, err = openRankFile(ld.ce.fs, filepath.Join(ld.at, fi.Name), fi.Bytes, ld.ce.stop); err != nil {
			return nil, err
		}
		defer rr.close()
		if err := ld.checkFooter(rr, from); err != nil {
			return nil, err
		}
	}
	sec, ok := rr.footer.section("client")
	if !ok {
		return nil, rr.corrupt("no client section")
	}
	b := make([]byte, sec.Bytes) // bounded by the file's size (readFooter)
	return b, rr.read(sec, 0, b)
}

func (ld *loader) close() {
	for _, rr := range ld.readers {
		rr.close()
	}
}

// has reports whether the checkpoint holds section name (every file has
// the same sections: checkFooter).
func (ld *loader) has(name string) bool { return slices.Contains(ld.sections, name) }

// load replaces the engine's state with the checkpoint's; every rank calls
// it. Nothing changes until every rank has found and checked every file it
// needs; a failure after that (an I/O error while filling) is fatal for
// the engine, the caller's error says so.
func (ce *ckptJob) load(dir string, opt LoadOptions, fresh lossScaler) (rep LoadReport, step int, fatal bool, err error) {
	at, m, err := findCheckpoint(ce.fs, dir)
	var x *ckptIndex
	var ld *loader
	var groups []Optimizer
	var src []int
	var saved []Param
	var client []byte
	from := NoClient
	if err == nil {
		src, saved, err = ce.checkModel(at, m)
	}
	if err == nil {
		x, err = checkLayout(at, m, saved)
	}
	if err == nil {
		world, _ := x.shape()
		from, err = ce.clientSource(at, world, opt)
	}
	if err == nil && !opt.WeightsOnly {
		if err = checkScalars(at, m.Optimizer); err == nil {
			groups, err = ce.opt.restorable(filepath.Join(at, ckptManifest), m.Optimizer)
		}
	}
	if err == nil {
		ld = newLoader(ce, at, m, x)
		ld.src = src
		defer ld.close()
		if err = ld.verify(); err == nil {
			client, err = ld.client(from)
		}
	}
	failed, _, cerr := ce.shareOutcome(err != nil)
	if cerr != nil {
		return rep, 0, true, cerr
	}
	if failed {
		return rep, 0, false, ckptPeerError(err, "a rank could not read its part of the checkpoint; nothing was loaded")
	}
	// Committed: fill the state.
	restored := !opt.WeightsOnly && !opt.KeepConfigGroups
	if !restored {
		groups = ce.opt.currentGroups()
	}
	savedWorld, _ := x.shape()
	rep = LoadReport{Client: client, ClientRank: from, Dir: at, Step: m.Step, World: savedWorld, Stage: m.Stage, Reshard: ce.reshard(m, x, src)}
	rep.FromCheckpoint, rep.Changed = ce.settingsOrigin(m, groups, restored)
	states, err := ce.opt.prepareLoad(groups)
	if err == nil && ce.ps != nil {
		err = ce.ps.dropGathered()
	}
	for i := 0; err == nil && i < len(states); i++ {
		st := states[i]
		skip := opt.WeightsOnly && st.name != "master" && st.name != "model"
		err = ld.fill(st, skip || !ld.has(st.name))
	}
	if err == nil {
		err = ce.opt.restore(byEngine(m.Optimizer, src), groups, opt.WeightsOnly, fresh, scalerOrigin{m.Version, savedAccumSteps(m)})
	}
	failed, _, cerr = ce.shareOutcome(err != nil)
	if cerr != nil {
		return LoadReport{}, 0, true, cerr
	}
	if failed {
		return LoadReport{}, 0, true, ckptPeerError(err, "a rank failed while filling its state from the checkpoint")
	}
	if err := ce.opt.publish(); err != nil {
		return LoadReport{}, 0, true, err
	}
	if ce.ps != nil {
		if err := ce.ps.afterStep(); err != nil {
			return LoadReport{}, 0, true, err
		}
	}
	step = m.Step
	if opt.WeightsOnly {
		step = 0
	}
	return rep, step, false, nil
}

// clientSource is the saved rank whose client bytes this rank gets: its
// own, or on a rank the checkpoint (of world ranks) does not have,
// opt.NewRankClient's (NoClient: none).
func (ce *ckptJob) clientSource(at string, world int, opt LoadOptions) (int, error) {
	if n := opt.NewRankClient; n < NoClient || n >= world {
		return NoClient, errorf(ErrConfig, "LoadOptions.NewRankClient %d, and %s holds ranks 0 to %d: give one of them, or NoClient (-1) for none", n, at, world-1)
	}
	if ce.rank < world {
		return ce.rank, nil
	}
	return opt.NewRankClient, nil
}

// reshard is what differs between the checkpoint's layout (m, checked
// into x) and the engine's plan; src maps the engine's parameters to the
// checkpoint's (checkModel).
func (ce *ckptJob) reshard(m ckptManifestData, x *ckptIndex, src []int) Reshard {
	savedWorld, _ := x.shape()
	r := Reshard{World: savedWorld != ce.world, Stage: m.Stage != ce.stage, Buckets: len(m.Layout.Buckets) != len(ce.plan.Buckets)}
	savedBucket := make([]int, len(ce.params))
	for b, bk := range m.Layout.Buckets {
		for _, mb := range bk.Members {
			savedBucket[mb[0]] = b // checkLayout: a trained parameter of the model, in one bucket
		}
	}
	for p, q := range ce.params {
		b, j := ce.plan.ParamBucket[p], src[p] // j: the checkpoint's index of engine parameter p
		saved, ok := x.placed(j)
		if !ok || b < 0 {
			continue // frozen or empty: no state
		}
		bp, offset := ce.plan.Buckets[b], ce.plan.ParamOffset[p]
		if savedBucket[j] != b || saved != offset {
			r.Buckets = true
		}
		// each saved piece (one rank's, contiguous) must be one piece of
		// the same rank at the same place now: its ends say so
		moved := false
		x.each(j, 0, q.Count, func(rank, from, n, at int) error {
			first, last := offset+from, offset+from+n-1 // in the bucket
			if r0 := first / bp.Shard; r0 != rank || last/bp.Shard != rank || bp.ShardOffset+first-r0*bp.Shard != at {
				moved = true
			}
			return nil
		})
		if moved {
			r.Params = append(r.Params, q.Name)
		}
	}
	return r
}

// settingsOrigin lists the settings a load takes from the checkpoint (the
// optimizer groups' where restored), and every setting whose saved value
// differs from the engine's, in the engine's record's order, then those
// only the checkpoint's record has. The model's entries are checkModel's.
func (ce *ckptJob) settingsOrigin(m ckptManifestData, groups []Optimizer, restored bool) ([]string, []SettingChange) {
	var from []string
	if restored {
		for _, s := range groupsRecord(groups) {
			from = append(from, s.Path)
		}
	}
	taken := func(path string) bool { return restored && strings.HasPrefix(path, "Optimizer.Groups[") }
	saved := map[string]string{}
	for _, s := range m.Settings {
		saved[s.Path] = s.Value
	}
	mine := map[string]bool{}
	var changed []SettingChange
	for _, s := range ce.settings {
		if strings.HasPrefix(s.Path, "Model[") {
			continue
		}
		mine[s.Path] = true
		v, ok := saved[s.Path]
		if !ok {
			v = "none"
		}
		if v != s.Value {
			changed = append(changed, SettingChange{Path: s.Path, Saved: v, Engine: s.Value, FromCheckpoint: taken(s.Path)})
		}
	}
	for _, s := range m.Settings {
		if !mine[s.Path] && !strings.HasPrefix(s.Path, "Model[") {
			changed = append(changed, SettingChange{Path: s.Path, Saved: s.Value, Engine: "none", FromCheckpoint: taken(s.Path)})
		}
	}
	return from, changed
}

// shapeHolds reports whether shape (none, or its dimensions) has count
// elements.
func shapeHolds(shape []int, count int) bool {
	if len(shape) == 0 {
		return true
	}
	n := 1
	for _, d := range shape {
		if d < 0 || d > 0 && n > count/d {
			return false
		}
		n *= d
	}
	return n == count
}

// dtypeNamed is the DType a manifest names.
func dtypeNamed(s string) (DType, bool) {
	for _, d := range []DType{FP32, BF16, FP16} {
		if d.String() == s {
			return d, true
		}
	}
	return 0, false
}

// savedAccumSteps is the Grads.AccumSteps a checkpoint was saved with (0:
// counted, or not recorded), which a format-1 loss scale depends on.
func savedAccumSteps(m ckptManifestData) int {
	for _, s := range m.Settings {
		if s.Path == "Grads.AccumSteps" {
			n, _ := strconv.Atoi(s.Value)
			return n
		}
	}
	return 0
}
