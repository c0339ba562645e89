package zero

import (
	"encoding/binary"
	"fmt"
	"hash"
	"hash/fnv"
	"reflect"
	"strconv"
	"strings"
)

// The settings record: every setting of a resolved Config, the world size
// and the model, each with its class (where it must agree), as the
// cross-rank check, the checkpoint's manifest and a load compare them.

// SettingClass says where a setting must agree.
type SettingClass int

// The classes a setting can be in, named as the settings record, the
// manifest and the messages spell them.
const (
	// ClassMatch ("match") settings are the same on every rank and when a
	// checkpoint is reloaded.
	ClassMatch SettingClass = iota
	// ClassReshard ("reshard") settings are the same on every rank but may
	// change when a checkpoint is reloaded: the world size, the stage, the
	// layout, the budgets and the batch split (Grads.AccumSteps,
	// Window.DType).
	ClassReshard
	// ClassLocal ("local") settings may differ between ranks: they change
	// neither the collectives nor the bits.
	ClassLocal
)

// The classes' former names, kept for one release.
const (
	// Deprecated: use ClassMatch.
	MustMatch = ClassMatch
	// Deprecated: use ClassReshard.
	MatchRanks = ClassReshard
	// Deprecated: use ClassLocal.
	RankLocal = ClassLocal
)

// String names the class as its tag does: "match", "reshard" or "local".
func (c SettingClass) String() string {
	switch c {
	case ClassMatch:
		return "match"
	case ClassReshard:
		return "reshard"
	case ClassLocal:
		return "local"
	}
	return fmt.Sprintf("SettingClass(%d)", int(c))
}

// Setting is one entry of an engine's settings record: a setting's path in
// Config (or in the model, "Model[i].Name"), its resolved value as text,
// and its class.
type Setting struct {
	Path  string       // "Optimizer.Groups[1].LR"
	Value string       // canonical: floats in their shortest exact form, dtypes by name
	Class SettingClass // where it must agree
}

// classOf reads a field's class from its zero tag.
func classOf(f reflect.StructField) (SettingClass, bool) {
	tag, ok := f.Tag.Lookup("zero")
	if !ok {
		return 0, false
	}
	switch {
	case tag == "match":
		return ClassMatch, true
	case tag == "reshard":
		return ClassReshard, true
	case strings.HasPrefix(tag, "local:") && len(tag) > len("local:"):
		return ClassLocal, true
	}
	return 0, false
}

// settingsRecord lists every setting of a resolved config, the world size
// and the model, in a fixed order.
func settingsRecord(cfg Config, params []Param, world int) []Setting {
	out := []Setting{{Path: "World", Value: strconv.Itoa(world), Class: ClassReshard}}
	out = appendSettings(out, "", reflect.ValueOf(cfg), ClassMatch)
	for i, p := range params {
		at := fmt.Sprintf("Model[%d].", i)
		shape := ""
		if p.Shape != nil {
			shape = fmt.Sprint(p.Shape)
		}
		for _, kv := range [][2]string{{"Name", strconv.Quote(p.Name)}, {"Count", strconv.Itoa(p.Count)}, {"Shape", shape},
			{"DType", p.DType.String()}, {"Group", strconv.Itoa(p.Group)}, {"Frozen", strconv.FormatBool(p.Frozen)}} {
			out = append(out, Setting{Path: at + kv[0], Value: kv[1], Class: ClassMatch})
		}
	}
	return out
}

// appendSettings walks v, a struct of settings, and appends its leaves.
// class is the class of v itself, for the elements of a tagged slice.
func appendSettings(out []Setting, prefix string, v reflect.Value, class SettingClass) []Setting {
	t := v.Type()
	for i := range t.NumField() {
		f := t.Field(i)
		if !f.IsExported() {
			continue
		}
		path := prefix + f.Name
		fv := v.Field(i)
		c, tagged := classOf(f)
		switch {
		case !tagged && f.Type.Kind() == reflect.Struct:
			out = appendSettings(out, path+".", fv, class)
		case f.Type.Kind() == reflect.Interface && f.Type != reflect.TypeOf((*Optimizer)(nil)).Elem():
			at := path
			sv := fv.Elem()
			if !sv.IsValid() {
				out = append(out, Setting{Path: at, Value: "none", Class: c})
				continue
			}
			for sv.Kind() == reflect.Pointer {
				sv = sv.Elem()
			}
			out = append(out, Setting{Path: at, Value: sv.Type().Name(), Class: c})
			if sv.Kind() == reflect.Struct {
				out = appendSettings(out, at+".", sv, c)
			}
		case f.Type == reflect.TypeOf([]Optimizer(nil)):
			for g := range fv.Len() {
				at := fmt.Sprintf("%s[%d]", path, g)
				opt := fv.Index(g).Elem()
				if !opt.IsValid() {
					out = append(out, Setting{Path: at, Value: "nil", Class: c})
					continue
				}
				out = append(out, Setting{Path: at, Value: opt.Type().Name(), Class: c})
				out = appendSettings(out, at+".", opt, c)
			}
		default:
			out = append(out, Setting{Path: path, Value: settingText(fv), Class: c})
		}
	}
	return out
}

// settingText is a value's canonical text: floats in their shortest exact
// form, dtypes and reductions by name.
func settingText(v reflect.Value) string {
	switch x := v.Interface().(type) {
	case float64:
		return strconv.FormatFloat(x, 'g', -1, 64)
	case fmt.Stringer:
		return x.String()
	}
	return fmt.Sprint(v.Interface())
}

// recordDigest hashes the entries of a record that every rank must share:
// all but the rank-local ones, or only those under prefix.
func recordDigest(rec []Setting, prefix string) uint64 {
	h := newHasher()
	for _, s := range rec {
		if s.Class == ClassLocal || !strings.HasPrefix(s.Path, prefix) {
			continue
		}
		h.text(s.Path)
		h.text(s.Value)
	}
	return h.sum()
}

// encodeRecord and decodeRecord turn the shared part of a record into
// bytes and back, for the exchange that names a difference.
func encodeRecord(rec []Setting, prefix string) []byte {
	var b strings.Builder
	for _, s := range rec {
		if s.Class == ClassLocal || !strings.HasPrefix(s.Path, prefix) {
			continue
		}
		b.WriteString(s.Path)
		b.WriteByte(0)
		b.WriteString(s.Value)
		b.WriteByte(0)
	}
	return []byte(b.String())
}

func decodeRecord(b []byte) [][2]string {
	parts := strings.Split(string(b), "\x00")
	var out [][2]string
	for i := 0; i+1 < len(parts); i += 2 {
		out = append(out, [2]string{parts[i], parts[i+1]})
	}
	return out
}

// firstDifference names the first setting in which record b differs from
// a, in a's order, then in b's: its path and both values ("none" where a
// record lacks it).
func firstDifference(a, b [][2]string) (path, va, vb string, found bool) {
	index := func(r [][2]string) map[string]string {
		m := make(map[string]string, len(r))
		for _, kv := range r {
			m[kv[0]] = kv[1]
		}
		return m
	}
	ia, ib := index(a), index(b)
	for _, kv := range a {
		if v, ok := ib[kv[0]]; !ok || v != kv[1] {
			if !ok {
				v = "none"
			}
			return kv[0], kv[1], v, true
		}
	}
	for _, kv := range b {
		if _, ok := ia[kv[0]]; !ok {
			return kv[0], "none", kv[1], true
		}
	}
	return "", "", "", false
}

// groupsRecord is the part of the record that SetGroup changes.
func groupsRecord(groups []Optimizer) []Setting {
	return appendSettings(nil, "Optimizer.", reflect.ValueOf(OptimizerPolicy{Groups: groups}), ClassMatch)
}

// hasher is FNV-1a over little-endian int64s.
type hasher struct{ h hash.Hash64 }

func newHasher() hasher { return hasher{fnv.New64a()} }

func (h hasher) put(v int64) {
	var b [8]byte
	binary.LittleEndian.PutUint64(b[:], uint64(v))
	h.h.Write(b[:])
}

// text hashes a string with its length, so that boundaries count.
func (h hasher) text(s string) {
	h.put(int64(len(s)))
	h.h.Write([]byte(s))
}

func (h hasher) sum() uint64 { return h.h.Sum64() }
