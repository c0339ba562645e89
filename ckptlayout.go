package zero

import (
	"cmp"
	"encoding/json"
	"errors"
	"fmt"
	"hash/crc32"
	"io/fs"
	"math"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
)

// A checkpoint's manifest, found and checked against itself: loading
// trusts nothing it has not checked, and checks everything before the
// first byte of the engine's state changes. Here: the manifest against
// its checksum and itself (every file named as its rank's, the buckets
// tiling the shard layout, every member inside its bucket and clear of the
// others, every trained parameter in exactly one bucket), with no number
// used to size an allocation; the pieces of a parameter are computed from
// the layout, never listed. The rank files are checked against it as they
// are opened (checkpoint.go's loader): their real sizes, the parameter
// ranges the layout gives each rank, the save's identity, their sections.

// findCheckpoint resolves dir: a checkpoint directory itself, or a
// directory whose latest names one.
func findCheckpoint(fsys ckptFS, dir string) (string, ckptManifestData, error) {
	var m ckptManifestData
	at := dir
	data, err := fsys.ReadFile(filepath.Join(dir, ckptManifest))
	if err != nil && !errors.Is(err, fs.ErrNotExist) {
		return "", m, errorf(ErrCheckpoint, "%v; the checkpoint's manifest is unreadable: load another checkpoint", err)
	}
	if err != nil {
		latest, lerr := fsys.ReadFile(filepath.Join(dir, ckptLatest))
		if lerr != nil && !errors.Is(lerr, fs.ErrNotExist) {
			return "", m, errorf(ErrCheckpoint, "%v; %s is damaged: pass a checkpoint directory instead", lerr, ckptLatest)
		}
		if lerr != nil {
			return "", m, errorf(ErrCheckpoint, "%s holds no checkpoint (no %s, no %s); pass a checkpoint directory or the directory Save wrote into", dir, ckptManifest, ckptLatest)
		}
		name := strings.TrimSpace(string(latest))
		at = filepath.Join(dir, name)
		if !strings.HasPrefix(name, "step-") || strings.ContainsAny(name, `/\`) {
			return "", m, errorf(ErrCheckpoint, "%s names %q, not a checkpoint of this directory: %s is damaged; pass a checkpoint directory instead", filepath.Join(dir, ckptLatest), name, ckptLatest)
		}
		if _, err := fsys.ReadDir(at); err != nil {
			return "", m, errorf(ErrCheckpoint, "%s names %q, which is not a checkpoint directory (%v): %s is damaged; pass a checkpoint directory instead", filepath.Join(dir, ckptLatest), name, err, ckptLatest)
		}
		if data, err = fsys.ReadFile(filepath.Join(at, ckptManifest)); err != nil && !errors.Is(err, fs.ErrNotExist) {
			return "", m, errorf(ErrCheckpoint, "%v; the checkpoint's manifest is unreadable: load another checkpoint", err)
		} else if err != nil {
			return "", m, errorf(ErrCheckpoint, "%s: the checkpoint %s names is incomplete (no %s): its save never finished; load another", dir, ckptLatest, ckptManifest)
		}
	}
	where := filepath.Join(at, ckptManifest)
	if err := json.Unmarshal(data, &m); err != nil {
		return "", m, errorf(ErrCheckpoint, "%s: %v; the manifest is damaged: load another checkpoint", where, err)
	}
	if m.Format != ckptFormat {
		return "", m, errorf(ErrCheckpoint, "%s: not a zero checkpoint manifest", where)
	}
	if m.Version > ckptVersion {
		return "", m, errorf(ErrCheckpoint, "%s: format version %d, newer than this library's %d; load it with a newer zero", where, m.Version, ckptVersion)
	}
	if !sealed(m) {
		return "", m, errorf(ErrCheckpoint, "%s: its values do not match its checksum; the manifest is damaged: load another checkpoint", where)
	}
	switch {
	case m.Version < 1:
		return "", m, errorf(ErrCheckpoint, "%s: format version %d; the manifest is damaged: load another checkpoint", where, m.Version)
	case m.Version >= 2 && !validSaveID(m.Save):
		return "", m, errorf(ErrCheckpoint, "%s: the save's identity is %q; the manifest is damaged: load another checkpoint", where, m.Save)
	case m.Step < 0 || m.Stage < 1 || m.Stage > 3:
		return "", m, errorf(ErrCheckpoint, "%s: step %d at stage %d; the manifest is damaged: load another checkpoint", where, m.Step, m.Stage)
	}
	return at, m, nil
}

// ckptIndex is a checkpoint's layout once checked: for each parameter the
// bucket that holds it, so the pieces of any range of it (which saved
// rank, where in that rank's shard) are computed, never listed.
type ckptIndex struct {
	world, shardElems int
	model             DType        // the model-dtype shard's ("model" section)
	members           []ckptMember // by parameter; shard 0: in no bucket
}

// shape is the saved world and the shard's elements on each rank.
func (x *ckptIndex) shape() (world, shardElems int) { return x.world, x.shardElems }

// placed says where the checkpoint's parameter p starts in its saved
// bucket, and whether it has state there (false: frozen or empty).
func (x *ckptIndex) placed(p int) (offset int, ok bool) {
	m := x.members[p]
	return m.offset, m.shard != 0
}

// ckptMember is a parameter's place: count elements at offset of a bucket
// whose shard (of shard elements) sits at shardOffset of every rank's.
type ckptMember struct{ count, offset, shard, shardOffset int }

// checkLayout checks the manifest's files and layout against params (the
// engine's, or the manifest's own) and against itself: every file named
// as its rank's, the buckets tiling the shard layout in order, every member
// inside its bucket and clear of the others, every trained parameter in
// exactly one bucket. It reads no file and allocates in proportion to the
// manifest only.
func checkLayout(at string, m ckptManifestData, params []Param) (*ckptIndex, error) {
	bad := func(format string, args ...any) error {
		return errorf(ErrCheckpoint, "%s: %s; the manifest is damaged: load another checkpoint", filepath.Join(at, ckptManifest), fmt.Sprintf(format, args...))
	}
	l := m.Layout
	if l.World < 1 || len(m.Files) != l.World {
		return nil, bad("%d files for %d ranks", len(m.Files), l.World)
	}
	for r, fi := range m.Files {
		if fi.Rank != r || fi.Name != rankFileName(r) || fi.Bytes < ckptTrailerLen {
			return nil, bad("file %d is %q, of rank %d, %d bytes; rank %d's is %s, of at least %d bytes", r, fi.Name, fi.Rank, fi.Bytes, r, rankFileName(r), ckptTrailerLen)
		}
	}
	if l.ShardElems < 0 {
		return nil, bad("a shard of %d elements", l.ShardElems)
	}
	x := &ckptIndex{world: l.World, shardElems: l.ShardElems, model: FP32, members: make([]ckptMember, len(params))}
	for _, q := range params {
		if !q.Frozen && q.Count > 0 {
			x.model = q.DType
		}
	}
	next := 0
	for b, bk := range l.Buckets {
		if bk.ShardOffset != next || bk.Shard < 1 || bk.Shard > l.ShardElems-next || len(bk.Members) == 0 {
			return nil, bad("bucket %d has a shard of %d elements at %d and %d members; its shard must start at %d, after the buckets before it, and end by %d", b, bk.Shard, bk.ShardOffset, len(bk.Members), next, l.ShardElems)
		}
		next += bk.Shard
		if bk.Shard > math.MaxInt/l.World {
			return nil, bad("bucket %d: a shard of %d elements on %d ranks", b, bk.Shard, l.World)
		}
		span := bk.Shard * l.World
		members := slices.Clone(bk.Members)
		slices.SortFunc(members, func(a, c [2]int) int { return cmp.Compare(a[1], c[1]) })
		end := 0
		for _, mb := range members {
			p, o := mb[0], mb[1]
			if p < 0 || p >= len(params) || params[p].Frozen || params[p].Count == 0 || x.members[p].shard != 0 {
				return nil, bad("bucket %d lists parameter %d, which is not a trained parameter of the model or lies in another bucket too", b, p)
			}
			if o < end || params[p].Count > span-o {
				return nil, bad("bucket %d places parameter %d (%d elements) at %d, over the member before it (which ends at %d) or past the bucket's %d elements", b, p, params[p].Count, o, end, span)
			}
			end = o + params[p].Count
			x.members[p] = ckptMember{count: params[p].Count, offset: o, shard: bk.Shard, shardOffset: bk.ShardOffset}
		}
	}
	if next != l.ShardElems {
		return nil, bad("the buckets' shards hold %d elements, the shard %d", next, l.ShardElems)
	}
	for p, q := range params {
		if !q.Frozen && q.Count > 0 && x.members[p].shard == 0 {
			return nil, bad("parameter %d (%q) lies in no bucket", p, q.Name)
		}
	}
	return x, nil
}

// each calls fn for every piece of elements [from, from+n) of parameter p
// (which lies in a bucket): the saved rank that holds it, its elements, and
// their place in that rank's shard.
func (x *ckptIndex) each(p, from, n int, fn func(rank, paramOffset, count, shardOffset int) error) error {
	mb := x.members[p]
	for i := from; i < from+n; {
		g := mb.offset + i // in the bucket
		r := g / mb.shard
		k := min(from+n-i, (r+1)*mb.shard-g)
		if err := fn(r, i, k, mb.shardOffset+g-r*mb.shard); err != nil {
			return err
		}
		i += k
	}
	return nil
}

// segments are the parameter ranges rank r's shard holds, in the order and
// form its file's footer lists them.
func (x *ckptIndex) segments(r int) []ckptSegment {
	var out []ckptSegment
	for p, mb := range x.members {
		if mb.shard == 0 {
			continue
		}
		lo, hi := max(mb.offset, r*mb.shard), min(mb.offset+mb.count, (r+1)*mb.shard)
		if lo < hi {
			out = append(out, ckptSegment{int64(p), int64(lo - mb.offset), int64(hi - lo), int64(mb.shardOffset + lo - r*mb.shard)})
		}
	}
	return out
}

// sectionDType is the dtype each section of a rank file holds ("" for the
// caller's bytes); a name not listed is not a section of zero's.
func (x *ckptIndex) sectionDType(name string) (string, bool) {
	switch name {
	case "master", "m", "v", "vmax":
		return FP32.String(), true
	case "model":
		return x.model.String(), true
	case "client":
		return "", true
	}
	return "", false
}

const (
	ckptFormat   = "zero-checkpoint"
	ckptManifest = "manifest.json"
	ckptLatest   = "latest"
	ckptPartial  = ".partial-"
)

// ckptParam is a parameter as the manifest records it.
type ckptParam struct {
	Name   string `json:"name"`
	Shape  []int  `json:"shape,omitempty"`
	Count  int    `json:"count"`
	DType  string `json:"dtype"`
	Group  int    `json:"group"`
	Frozen bool   `json:"frozen,omitempty"`
}

// ckptBucket is a bucket of the layout: Members are (parameter, offset in
// the bucket); rank r holds elements [r·Shard, (r+1)·Shard) of it at
// ShardOffset of its shard.
type ckptBucket struct {
	Shard       int      `json:"shard"`
	ShardOffset int      `json:"shard_offset"`
	Members     [][2]int `json:"members"`
}

type ckptLayout struct {
	World      int          `json:"world"`
	ShardElems int          `json:"shard_elems"`
	Buckets    []ckptBucket `json:"buckets"`
}

type ckptSetting struct {
	Path  string `json:"path"`
	Value string `json:"value"`
	Class string `json:"class"`
}

type ckptFileInfo struct {
	Name  string `json:"name"`
	Rank  int    `json:"rank"`
	Bytes int64  `json:"bytes"`
	CRC   uint32 `json:"crc32c"`
}

// ckptManifestData is manifest.json.
type ckptManifestData struct {
	Format  string `json:"format"`
	Version int    `json:"version"`
	// Save is the save's identity (version 2 on): 48 random bits that rank
	// 0 draws and every rank writes into its file's footer, so a load
	// refuses a rank file of another save; it also names the save's lock.
	Save      string         `json:"save,omitempty"`
	Step      int            `json:"step"` // steps the engine had taken
	Stage     int            `json:"stage"`
	Params    []ckptParam    `json:"params"`
	Layout    ckptLayout     `json:"layout"`
	Settings  []ckptSetting  `json:"settings"`
	Optimizer optCheckpoint  `json:"optimizer"`
	Files     []ckptFileInfo `json:"files"`
	// Checksum is the CRC32C of the manifest as written with Checksum 0: a
	// damaged value is found before it places state anywhere.
	Checksum uint32 `json:"crc32c"`
}

// sealManifest writes m's checksum into it and returns its bytes.
func sealManifest(m *ckptManifestData) ([]byte, error) {
	m.Checksum = 0
	data, err := json.MarshalIndent(m, "", " ")
	if err != nil {
		return nil, err
	}
	m.Checksum = crc32.Checksum(data, castagnoli)
	return json.MarshalIndent(m, "", " ")
}

// sealed reports whether m's values are those its checksum was taken of.
func sealed(m ckptManifestData) bool {
	want := m.Checksum
	m.Checksum = 0
	data, err := json.MarshalIndent(&m, "", " ")
	return err == nil && crc32.Checksum(data, castagnoli) == want
}

func rankFileName(r int) string { return fmt.Sprintf("rank-%05d.bin", r) }

// formatSaveID writes a save's identity as it is stored.
func formatSaveID(id uint64) string { return fmt.Sprintf("%012x", id) }

// validSaveID reports whether s is a save's identity as formatSaveID
// writes it.
func validSaveID(s string) bool {
	if len(s) != 12 {
		return false
	}
	_, err := strconv.ParseUint(s, 16, 48)
	return err == nil && strings.ToLower(s) == s
}
