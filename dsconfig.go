package zero

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"os"
	"slices"
	"sort"
	"strconv"
	"strings"
	"unicode/utf8"
)

// ReadDeepSpeed reads a DeepSpeed JSON config (ds_config.json) into a zero
// Config, its learning-rate schedule included. Every key present is either
// mapped onto a setting, checked (the batch sizes against the world size),
// accepted with a notice because it changes nothing in zero's arithmetic or
// collectives, or refused. Where the file is silent DeepSpeed's defaults
// apply, also where they differ from zero's (gradient_clipping 1.0, the
// shard summed in the model dtype), and a notice says so. The README's
// DeepSpeed section has the table of keys.
//
// Every refused key, malformed value and "auto" without an override is
// reported at once, in a *DeepSpeedError that wraps ErrConfig and names
// each key by its path ("zero_optimization.offload_param") with what to
// do.
func ReadDeepSpeed(data []byte, opts DeepSpeedOptions) (DeepSpeedConfig, error) {
	if opts.World < 1 {
		return DeepSpeedConfig{}, errorf(ErrConfig, "DeepSpeedOptions.World %d; give the data-parallel world size (train_batch_size is checked against it)", opts.World)
	}
	if err := jsonDepth(data); err != nil {
		return DeepSpeedConfig{}, err
	}
	dec := json.NewDecoder(bytes.NewReader(data))
	dec.UseNumber()
	var doc any
	if err := dec.Decode(&doc); err != nil {
		return DeepSpeedConfig{}, jsonError(data, err)
	}
	if dec.More() {
		return DeepSpeedConfig{}, errorf(ErrConfig, "DeepSpeed config: more than one JSON value; give one object")
	}
	root, ok := doc.(map[string]any)
	if !ok {
		return DeepSpeedConfig{}, errorf(ErrConfig, "DeepSpeed config: the top level is %s; give a JSON object", describe(doc))
	}
	r := &dsReader{opts: opts, bad: map[string]bool{}}
	if err := r.fillAuto(root); err != nil {
		return DeepSpeedConfig{}, err
	}
	out := r.read(root)
	if len(r.problems) > 0 {
		sort.SliceStable(r.problems, func(i, j int) bool { return r.problems[i].Path < r.problems[j].Path })
		return DeepSpeedConfig{}, &DeepSpeedError{Problems: r.problems, More: r.moreProblems}
	}
	sort.SliceStable(r.notices, func(i, j int) bool { return r.notices[i].Path < r.notices[j].Path })
	out.Notices, out.MoreNotices = r.notices, r.moreNotices
	return out, nil
}

// ReadDeepSpeedFile is ReadDeepSpeed of the file at path.
func ReadDeepSpeedFile(path string, opts DeepSpeedOptions) (DeepSpeedConfig, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return DeepSpeedConfig{}, errorf(ErrConfig, "DeepSpeed config: %v; give the path of a ds_config.json", err)
	}
	return ReadDeepSpeed(data, opts)
}

// DeepSpeedOptions says how ReadDeepSpeed reads a config.
type DeepSpeedOptions struct {
	// World is the data-parallel world size W, ≥ 1: train_batch_size must
	// equal train_micro_batch_size_per_gpu × gradient_accumulation_steps ×
	// W, and prescale_gradients divides by it.
	World int
	// Overrides fill the file's "auto" values by dotted path
	// ("optimizer.params.lr", "zero_optimization.reduce_bucket_size"), as
	// the Hugging Face Trainer fills them from its training arguments;
	// values are JSON-like (numbers, bools, strings, lists). An "auto"
	// without an override is refused. An override of a key the file sets
	// to another value is not used, and a notice says so; so is one for a
	// key the file does not have.
	Overrides map[string]any
	// Strict refuses what is otherwise taken with a notice because it only
	// tunes DeepSpeed's own implementation, zero's result being the same:
	// allgather_bucket_size other than reduce_bucket_size,
	// stage3_param_persistence_threshold other than 0,
	// stage3_max_reuse_distance, sub_group_size, round_robin_gradients
	// true, optimizer.params.torch_adam true; and a top-level key zero
	// does not know. For a user who wants every key honoured or refused.
	Strict bool
}

// DeepSpeedConfig is a DeepSpeed config in zero's terms.
type DeepSpeedConfig struct {
	// Config holds the mapped settings. The optimizer block, if any,
	// becomes Optimizer.Groups[0]: a caller with more groups (the Trainer's
	// weights without decay) copies it and changes what differs.
	Config Config
	// DType is the model dtype the file asks for (fp16, bf16, or fp32 when
	// neither is enabled): register the parameters in it. The byte sizes
	// in Config are the file's element counts times its size.
	DType DType
	// MicroBatch and GlobalBatch are the batch sizes as DeepSpeed resolves
	// them from the file and the world size (0 where the file gives none).
	MicroBatch, GlobalBatch int
	// StepsPerPrint is the file's steps_per_print (0 where it gives none):
	// how often a trainer logs progress. The engine does nothing with it.
	StepsPerPrint int
	// Notices list, by path, every key accepted without effect, every
	// DeepSpeed default taken where it differs from zero's, and every
	// difference in arithmetic that the mapped config keeps: the first
	// 200 given.
	Notices []DeepSpeedNotice
	// MoreNotices counts the notices beyond those listed.
	MoreNotices int
}

// DeepSpeedNotice is one thing ReadDeepSpeed wants the caller to know.
type DeepSpeedNotice struct {
	Path string // the key's path, "zero_optimization.contiguous_gradients"
	Text string // what zero does with it
}

// String is "path: text".
func (n DeepSpeedNotice) String() string { return n.Path + ": " + n.Text }

// DeepSpeedError lists everything in a DeepSpeed config that zero cannot
// take: keys it cannot honour (Refused) and values that are malformed, of
// the wrong type, out of range or "auto" without an override. It wraps
// ErrConfig.
type DeepSpeedError struct {
	Problems []DeepSpeedProblem // by path: the first 100 found
	More     int                // problems found beyond those listed
}

// DeepSpeedProblem is one key of a DeepSpeed config that zero cannot take.
type DeepSpeedProblem struct {
	Path string // the key's path, "zero_optimization.offload_param"
	// Refused: a valid DeepSpeed key that zero cannot honour; otherwise
	// the value is wrong.
	Refused bool
	Text    string // why, and what to do
}

// Error lists every problem, one a line.
func (e *DeepSpeedError) Error() string {
	var b strings.Builder
	fmt.Fprintf(&b, "%v: DeepSpeed config: %d key(s) zero cannot take:", ErrConfig, len(e.Problems)+e.More)
	for _, p := range e.Problems {
		kind := "invalid"
		if p.Refused {
			kind = "refused"
		}
		fmt.Fprintf(&b, "\n  %s (%s): %s", p.Path, kind, p.Text)
	}
	if e.More > 0 {
		fmt.Fprintf(&b, "\n  and %d more", e.More)
	}
	return b.String()
}

// Unwrap makes errors.Is(err, ErrConfig) true.
func (e *DeepSpeedError) Unwrap() error { return ErrConfig }

// Paths lists the problems' paths, in order.
func (e *DeepSpeedError) Paths() []string {
	var out []string
	for _, p := range e.Problems {
		out = append(out, p.Path)
	}
	return out
}

// jsonError names where malformed JSON breaks: line and column.
func jsonError(data []byte, err error) error {
	var syn *json.SyntaxError
	var typ *json.UnmarshalTypeError
	off := int64(-1)
	switch {
	case errors.As(err, &syn):
		off = syn.Offset
	case errors.As(err, &typ):
		off = typ.Offset
	}
	if off < 0 {
		return errorf(ErrConfig, "DeepSpeed config: malformed JSON: %v", err)
	}
	idx := max(0, min(off, int64(len(data)))-1) // the byte the decoder stopped at
	line := 1 + bytes.Count(data[:idx], []byte("\n"))
	col := idx - int64(bytes.LastIndexByte(data[:idx], '\n'))
	return errorf(ErrConfig, "DeepSpeed config: malformed JSON at line %d, column %d: %v; fix the file (a missing or extra comma is the usual cause)", line, col, err)
}

// ---- reading ---------------------------------------------------------------------

// The bounds that keep reading linear in the file's size, whatever it
// holds: DeepSpeed's own configs nest 3 deep and give a few problems.
const (
	dsMaxDepth    = 32  // objects and lists nested deeper are refused
	dsMaxProblems = 100 // problems listed; the rest are counted
	dsMaxNotices  = 200 // notices listed; the rest are counted
	dsMaxKeyShown = 64  // bytes of a key a path shows
)

// dsReader collects problems and notices while it reads one config.
type dsReader struct {
	opts         DeepSpeedOptions
	problems     []DeepSpeedProblem
	moreProblems int
	// bad holds every path with a problem: a value that is not the file's
	// never feeds a later computation (clean)
	bad         map[string]bool
	notices     []DeepSpeedNotice
	moreNotices int
	rows        []int // typoDistance's
}

// clean reports whether none of paths has a problem: a check or a
// computation across keys runs only on the values the file gave.
func (r *dsReader) clean(paths ...string) bool {
	for _, p := range paths {
		if r.bad[p] {
			return false
		}
	}
	return true
}

// cleanUnder reports whether no path under prefix has a problem.
func (r *dsReader) cleanUnder(prefix string) bool {
	for p := range r.bad {
		if strings.HasPrefix(p, prefix) {
			return false
		}
	}
	return true
}

// refuse and invalid record a problem; the first one at a path is the one
// reported (a value of the wrong type is not then also out of range).
func (r *dsReader) refuse(path, format string, args ...any) {
	r.problem(DeepSpeedProblem{Path: path, Refused: true, Text: fmt.Sprintf(format, args...)})
}

func (r *dsReader) invalid(path, format string, args ...any) {
	r.problem(DeepSpeedProblem{Path: path, Text: fmt.Sprintf(format, args...)})
}

func (r *dsReader) problem(p DeepSpeedProblem) {
	if r.bad[p.Path] {
		return
	}
	r.bad[p.Path] = true
	if len(r.problems) == dsMaxProblems {
		r.moreProblems++
		return
	}
	r.problems = append(r.problems, p)
}

func (r *dsReader) notice(path, format string, args ...any) {
	if len(r.notices) == dsMaxNotices {
		r.moreNotices++
		return
	}
	r.notices = append(r.notices, DeepSpeedNotice{Path: path, Text: fmt.Sprintf(format, args...)})
}

// shownKey is a key as a path shows it: a long one cut, so that what is
// reported stays in proportion to the file, and the empty key as "".
func shownKey(k string) string {
	if k == "" {
		return `""`
	}
	if len(k) <= dsMaxKeyShown {
		return k
	}
	cut := dsMaxKeyShown
	for cut > 0 && !utf8.RuneStart(k[cut]) {
		cut--
	}
	return fmt.Sprintf("%s…(%d bytes)", k[:cut], len(k))
}

// jsonDepth refuses data whose objects and lists nest deeper than
// dsMaxDepth, naming where, before anything is decoded: the decoder would
// build every level.
func jsonDepth(data []byte) error {
	depth, inString, escaped := 0, false, false
	for i, c := range data {
		switch {
		case inString:
			switch {
			case escaped:
				escaped = false
			case c == '\\':
				escaped = true
			case c == '"':
				inString = false
			}
		case c == '"':
			inString = true
		case c == '{' || c == '[':
			if depth++; depth > dsMaxDepth {
				line := 1 + bytes.Count(data[:i], []byte("\n"))
				col := i - bytes.LastIndexByte(data[:i], '\n')
				return errorf(ErrConfig, "DeepSpeed config: nested more than %d deep at line %d, column %d; DeepSpeed's configs nest 3 deep: flatten or remove what is nested there", dsMaxDepth, line, col)
			}
		case c == '}' || c == ']':
			depth--
		}
	}
	return nil
}

// fillAuto puts each override where the file says "auto" at its path,
// notes overrides that the file's own values or keys leave unused, and
// refuses every "auto" left.
func (r *dsReader) fillAuto(root map[string]any) error {
	paths := make([]string, 0, len(r.opts.Overrides))
	for path := range r.opts.Overrides {
		paths = append(paths, path)
	}
	slices.Sort(paths)
	for _, path := range paths {
		b, err := json.Marshal(r.opts.Overrides[path])
		if err != nil {
			return errorf(ErrConfig, "DeepSpeedOptions.Overrides[%q]: %v; give a number, bool, string or list", path, err)
		}
		dec := json.NewDecoder(bytes.NewReader(b))
		dec.UseNumber()
		var o any
		if err := dec.Decode(&o); err != nil {
			return errorf(ErrConfig, "DeepSpeedOptions.Overrides[%q]: %v", path, err)
		}
		obj, key := dsLookup(root, path)
		v, has := obj[key]
		switch {
		case !has:
			r.notice(path, "override %s not used: the file has no such key", jsonText(o))
		case v == "auto":
			obj[key] = o
		case !sameJSON(o, v):
			r.notice(path, "override %s not used: the file sets %s", jsonText(o), jsonText(v))
		}
	}
	r.refuseAuto(root, nil)
	return nil
}

// dsLookup finds the object that holds the last key of a dotted path, and
// that key (a nil object where the path leads nowhere).
func dsLookup(root map[string]any, path string) (map[string]any, string) {
	obj := root
	for {
		k, rest, more := strings.Cut(path, ".")
		if !more {
			return obj, k
		}
		sub, ok := obj[k].(map[string]any)
		if !ok {
			return nil, ""
		}
		obj, path = sub, rest
	}
}

// refuseAuto refuses every "auto" under obj, whose keys' path is at.
func (r *dsReader) refuseAuto(obj map[string]any, at []string) {
	for _, k := range sortedKeys(obj) {
		switch v := obj[k].(type) {
		case map[string]any:
			r.refuseAuto(v, append(at, k))
		case string:
			if v == "auto" && len(r.problems) < dsMaxProblems {
				r.invalid(dsPath(at, k), `"auto" with no override; give its value (the Hugging Face Trainer fills it from its training arguments: DeepSpeedOptions.Overrides)`)
			} else if v == "auto" {
				r.moreProblems++
			}
		}
	}
}

// dsPath joins keys into a path, each as shownKey shows it.
func dsPath(at []string, k string) string {
	var b strings.Builder
	for _, a := range at {
		b.WriteString(shownKey(a))
		b.WriteByte('.')
	}
	b.WriteString(shownKey(k))
	return b.String()
}

func sameJSON(a, b any) bool { return jsonText(a) == jsonText(b) }

// jsonText is v as compact JSON, numbers as their values.
func jsonText(v any) string {
	switch x := v.(type) {
	case json.Number:
		if f, err := x.Float64(); err == nil {
			return strconv.FormatFloat(f, 'g', -1, 64)
		}
	case []any:
		parts := make([]string, len(x))
		for i, e := range x {
			parts[i] = jsonText(e)
		}
		return "[" + strings.Join(parts, ",") + "]"
	}
	b, _ := json.Marshal(v)
	return string(b)
}

func sortedKeys(m map[string]any) []string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	return keys
}

// describe names a JSON value's type for an error.
func describe(v any) string {
	switch x := v.(type) {
	case nil:
		return "null"
	case bool:
		return fmt.Sprintf("the bool %v", x)
	case json.Number:
		if len(x) > dsMaxKeyShown {
			return fmt.Sprintf("a number of %d digits", len(x))
		}
		return "the number " + x.String()
	case string:
		if len(x) > dsMaxKeyShown {
			return fmt.Sprintf("a string of %d bytes", len(x))
		}
		return fmt.Sprintf("the string %q", x)
	case []any:
		return "a list"
	case map[string]any:
		return "an object"
	}
	return fmt.Sprintf("%T", v)
}

// ---- typed values ------------------------------------------------------------------

func (r *dsReader) number(path string, v any) (float64, bool) {
	n, ok := v.(json.Number)
	if !ok {
		r.invalid(path, "%s; give a number", describe(v))
		return 0, false
	}
	f, err := n.Float64()
	if err != nil || math.IsInf(f, 0) || math.IsNaN(f) {
		r.invalid(path, "%s is out of range; give a finite number", n)
		return 0, false
	}
	return f, true
}

// integer takes integral numbers, 5e8 included, as DeepSpeed's pydantic
// fields do.
func (r *dsReader) integer(path string, v any) (int, bool) {
	f, ok := r.number(path, v)
	if !ok {
		return 0, false
	}
	if f != math.Trunc(f) || math.Abs(f) > 1<<53 {
		r.invalid(path, "%v; give a whole number", f)
		return 0, false
	}
	return int(f), true
}

func (r *dsReader) boolean(path string, v any) (bool, bool) {
	b, ok := v.(bool)
	if !ok {
		r.invalid(path, "%s; give true or false", describe(v))
	}
	return b, ok
}

func (r *dsReader) text(path string, v any) (string, bool) {
	s, ok := v.(string)
	if !ok {
		r.invalid(path, "%s; give a string", describe(v))
	}
	return s, ok
}

func (r *dsReader) object(path string, v any) (map[string]any, bool) {
	m, ok := v.(map[string]any)
	if !ok {
		r.invalid(path, "%s; give an object", describe(v))
	}
	return m, ok
}

// intIn reads key of obj as an integer in [lo, hi], or def where absent.
func (r *dsReader) intIn(obj map[string]any, key, at string, def, lo, hi int) (int, bool) {
	v, present := obj[key]
	if !present {
		return def, false
	}
	n, ok := r.integer(at+key, v)
	if ok && (n < lo || n > hi) {
		r.invalid(at+key, "%d is out of range; give %d to %d", n, lo, hi)
		return def, true
	}
	if !ok {
		return def, true
	}
	return n, true
}

// numIn reads key of obj as a number ≥ lo, or def where absent.
func (r *dsReader) numIn(obj map[string]any, key, at string, def, lo float64) (float64, bool) {
	v, present := obj[key]
	if !present {
		return def, false
	}
	f, ok := r.number(at+key, v)
	if ok && f < lo {
		r.invalid(at+key, "%v is out of range; give a number ≥ %v", f, lo)
		return def, true
	}
	if !ok {
		return def, true
	}
	return f, true
}

// boolOr reads key of obj as a bool, or def where absent.
func (r *dsReader) boolOr(obj map[string]any, key, at string, def bool) bool {
	v, present := obj[key]
	if !present {
		return def
	}
	b, ok := r.boolean(at+key, v)
	if !ok {
		return def
	}
	return b
}

// ---- the keys ------------------------------------------------------------------

// dsKey is what zero does with one key of a section.
type dsKey struct {
	mapped bool // read by the mapping
	// accept says which values zero can take without effect (nil: any);
	// note is the notice for those, fix the refusal for the others.
	accept    func(v any) bool
	note, fix string
	// tuning: the key only tunes DeepSpeed's implementation, so any value
	// is taken with the note, unless DeepSpeedOptions.Strict
	tuning bool
}

func mapped() dsKey { return dsKey{mapped: true} }

// noted keys are accepted with a notice, whatever their value.
func noted(note string) dsKey { return dsKey{note: note} }

// only keys are accepted with a notice at the values accept takes, and
// refused at others.
func only(accept func(any) bool, note, fix string) dsKey {
	return dsKey{accept: accept, note: note, fix: fix}
}

// tuning keys only tune DeepSpeed's own implementation: taken with a
// notice at any value (note says what zero does instead), and with
// DeepSpeedOptions.Strict as only(accept, note, fix) is.
func tuning(accept func(any) bool, note, fix string) dsKey {
	return dsKey{accept: accept, note: note, fix: fix, tuning: true}
}

// refused keys are refused at any value.
func refused(fix string) dsKey {
	return dsKey{accept: func(any) bool { return false }, fix: fix}
}

func is(want any) func(any) bool {
	return func(v any) bool { return sameJSON(v, want) }
}

// disabled takes a feature block that is off: {"enabled": false}, or null.
func disabled(v any) bool {
	if v == nil {
		return true
	}
	m, ok := v.(map[string]any)
	if !ok {
		return false
	}
	e, has := m["enabled"]
	return !has || e == false
}

// keys walks a section: notices and refusals for the keys that are not
// mapped, a refusal for every key zero does not know.
func (r *dsReader) keys(obj map[string]any, at string, table map[string]dsKey, unknown string) {
	for _, k := range sortedKeys(obj) {
		path := at + shownKey(k)
		key, known := table[k]
		switch {
		case !known:
			r.unknownKey(path, k, table, unknown)
		case key.mapped:
		case key.tuning && !r.opts.Strict, key.accept == nil || key.accept(obj[k]):
			r.notice(path, "%s", key.note)
		default:
			r.refuse(path, "%s", key.fix)
		}
	}
}

// unknownKey refuses a key the table does not have as a typo, with the
// keys it is close to, where it is close to one; takes any other unknown
// top-level key with a notice, as DeepSpeed takes it (not with Strict);
// and refuses any other in a section, as DeepSpeed's config does.
func (r *dsReader) unknownKey(path, k string, table map[string]dsKey, unknown string) {
	near := r.nearKeys(k, table)
	switch {
	case len(near) > 0:
		why := unknown
		if unknown == unknownTop {
			why = "DeepSpeed ignores a top-level key it does not know, so there a typo goes unnoticed: correct it"
		}
		r.refuse(path, "not a key zero knows here; did you mean %s? %s", strings.Join(near, " or "), why)
	case unknown == unknownTop && !r.opts.Strict:
		r.notice(path, "not a key zero knows: taken without effect, as DeepSpeed takes a top-level key it does not know (if your DeepSpeed reads it, zero does not honour it; DeepSpeedOptions.Strict refuses it)")
	default:
		r.refuse(path, "not a key zero knows here; %s", unknown)
	}
}

// nearKeys are the keys of table closest to k, quoted, where k is likely
// a typo of one: the same but for case, or within typoDistance of 1 (of 2
// for keys longer than 5 bytes); none otherwise.
func (r *dsReader) nearKeys(k string, table map[string]dsKey) []string {
	best := 3
	var near []string
	for known := range table { // no copy of the table per key: a file may hold many
		limit := 1
		if len(known) > 5 {
			limit = 2
		}
		d := r.typoDistance(k, known, limit)
		if strings.EqualFold(k, known) {
			d = 0
		}
		switch {
		case d > limit || d > best:
		case d < best:
			best, near = d, append(near[:0], "`"+known+"`")
		default:
			near = append(near, "`"+known+"`")
		}
	}
	slices.Sort(near)
	return near
}

// typoDistance is the optimal string alignment distance of a and b, in
// bytes: a byte dropped, added or changed, or two neighbours swapped,
// each count 1. Past limit it stops and says limit+1; so it costs at most
// len(b) × (2·limit+1) steps, whatever a's length.
func (r *dsReader) typoDistance(a, b string, limit int) int {
	if len(a)-len(b) > limit || len(b)-len(a) > limit {
		return limit + 1
	}
	n := len(b) + 1
	if cap(r.rows) < 3*n {
		r.rows = make([]int, 3*n)
	}
	rows := r.rows[:3*n]
	prev2, prev, cur := rows[:n], rows[n:2*n], rows[2*n:]
	for j := range prev {
		prev[j] = j
	}
	for i := 1; i <= len(a); i++ {
		cur[0] = i
		least := cur[0]
		for j := 1; j < n; j++ {
			cost := 1
			if a[i-1] == b[j-1] {
				cost = 0
			}
			d := min(prev[j]+1, cur[j-1]+1, prev[j-1]+cost)
			if i > 1 && j > 1 && a[i-1] == b[j-2] && a[i-2] == b[j-1] {
				d = min(d, prev2[j-2]+1)
			}
			cur[j] = d
			least = min(least, d)
		}
		if least > limit {
			return limit + 1
		}
		prev2, prev, cur = prev, cur, prev2
	}
	return min(prev[n-1], limit+1)
}

const (
	noEffect    = "no effect on zero's arithmetic or collectives"
	unknownTop  = "DeepSpeed ignores a top-level key it does not know, and DeepSpeedOptions.Strict refuses it: correct or remove it"
	unknownPyd  = "DeepSpeed refuses unknown keys in this section too: correct or remove it"
	unknownArgs = "DeepSpeed passes it to the constructor, which refuses it: correct or remove it"
)

var dsTopKeys = map[string]dsKey{
	"train_batch_size":               mapped(),
	"train_micro_batch_size_per_gpu": mapped(),
	"gradient_accumulation_steps":    mapped(),
	"gradient_clipping":              mapped(),
	"optimizer":                      mapped(),
	"scheduler":                      mapped(),
	"fp16":                           mapped(),
	"bf16":                           mapped(),
	"bfloat16":                       mapped(),
	"zero_optimization":              mapped(),
	"communication_data_type":        mapped(),
	"data_types":                     mapped(),
	"prescale_gradients":             mapped(),
	"gradient_predivide_factor":      mapped(),
	"gradient_allreduce_op":          mapped(),
	"allgather_size":                 mapped(),
	"steps_per_print":                noted("logging: " + noEffect + " (DeepSpeedConfig.StepsPerPrint holds it for the trainer)"),
	"wall_clock_breakdown":           noted("timing: " + noEffect + " (Stats has the engine's times)"),
	"memory_breakdown":               noted("logging: " + noEffect + " (Stats has the engine's memory)"),
	"dump_state":                     noted("logging: " + noEffect),
	"tensorboard":                    noted("monitoring: " + noEffect),
	"wandb":                          noted("monitoring: " + noEffect),
	"csv_monitor":                    noted("monitoring: " + noEffect),
	"comet":                          noted("monitoring: " + noEffect),
	"comms_logger":                   noted("logging: " + noEffect + " (Stats counts the engine's collectives)"),
	"flops_profiler":                 noted("profiling: " + noEffect),
	"timers":                         noted("timing: " + noEffect),
	"log_level":                      noted("logging: " + noEffect),
	"activation_checkpointing":       noted("recomputation in the framework's forward: " + noEffect),
	"zero_allow_untested_optimizer":  noted("zero runs its own AdamW and SGD, tested: " + noEffect),
	"zero_force_ds_cpu_optimizer":    noted("with offload zero runs its own host AdamW and SGD: " + noEffect),
	"dataloader_drop_last":           noted("data loading is the framework's: " + noEffect),
	"disable_allgather":              noted("DeepSpeed reads it and uses it nowhere: " + noEffect),
	"managed_gradient_accumulation": only(is(true), "zero's windows are managed, as DeepSpeed's default: "+noEffect,
		"unmanaged accumulation (every step a boundary) is not mapped: remove it; zero then takes gradient_accumulation_steps, or Grads.AccumSteps 0 counts the backwards taken"),
	"sparse_gradients": only(is(false), noEffect, "zero has no sparse embedding gradients: remove it"),
	"checkpoint":       noted("zero writes and reads its own checkpoints (Engine.Save, Engine.Load): " + noEffect),
	"amp":              only(disabled, "disabled: "+noEffect, "zero has no Apex AMP: use fp16 or bf16"),
	"torch_autocast":   only(disabled, "disabled: "+noEffect, "torch.autocast is the framework's: remove it and give the gradients' dtype with fp16 or bf16"),
	"autotuning":       only(disabled, "disabled: "+noEffect, "zero has no autotuner: remove it"),
	"eigenvalue":       only(disabled, "disabled: "+noEffect, "zero has no eigenvalue computation: remove it"),
	"progressive_layer_drop": only(disabled, "disabled: "+noEffect,
		"progressive layer drop is the model's: remove it"),
	"hybrid_engine":        only(disabled, "disabled: "+noEffect, "zero has no hybrid engine: remove it"),
	"curriculum_learning":  only(disabled, "disabled: "+noEffect, "data scheduling is the framework's: remove it"),
	"data_efficiency":      only(disabled, "disabled: "+noEffect, "data scheduling is the framework's: remove it"),
	"elasticity":           only(disabled, "disabled: "+noEffect, "zero has no elastic training: remove it"),
	"compression_training": refused("zero has no compression training: remove it"),
	"sparse_attention":     refused("sparse attention is the model's: remove it"),
	"pipeline":             refused("zero is data-parallel only: remove pipeline parallelism"),
	"compile":              only(disabled, "disabled: "+noEffect, "zero has no DeepCompile: remove it"),
	"sequence_parallel_size": only(is(1), noEffect,
		"zero is data-parallel only (W' = W): remove sequence parallelism"),
	"tensor_parallel": refused("zero is data-parallel only: remove tensor parallelism"),
}

// read maps the whole config.
func (r *dsReader) read(root map[string]any) DeepSpeedConfig {
	r.keys(root, "", dsTopKeys, unknownTop)
	var out DeepSpeedConfig
	cfg := &out.Config
	model := r.precision(root, cfg)
	out.DType = model
	stage := r.zero(root, cfg, model)
	clip, _ := r.numIn(root, "gradient_clipping", "", 1.0, 0)
	if _, set := root["gradient_clipping"]; !set {
		r.notice("gradient_clipping", "unset: DeepSpeed's default 1.0 applies (zero's own default is no clipping)")
	}
	cfg.Optimizer.Clip = clip
	if clip > 0 {
		r.notice("gradient_clipping", "DeepSpeed scales by clip/(norm + 1e-6), zero by clip/norm: a relative difference of 1e-6/norm, kept")
	}
	out.MicroBatch, out.GlobalBatch, cfg.Grads.AccumSteps = r.batch(root)
	out.StepsPerPrint, _ = r.intIn(root, "steps_per_print", "", 0, 1, math.MaxInt32)
	r.reduction(root, cfg, stage)
	opt := r.optimizer(root, cfg)
	r.scheduler(root, cfg, opt)
	return out
}

// ---- precision -------------------------------------------------------------------

var dsFP16Keys = map[string]dsKey{
	"enabled": mapped(), "loss_scale": mapped(), "initial_scale_power": mapped(), "loss_scale_window": mapped(),
	"hysteresis": mapped(), "min_loss_scale": mapped(),
	"consecutive_hysteresis": only(is(false), "DeepSpeed's default, zero's scaler",
		"zero's loss scaler restores the hysteresis only when the scale grows (DeepSpeed's default): set it to false or remove it"),
	"auto_cast": noted("casting the model's inputs is the framework's: " + noEffect),
	"fp16_master_weights_and_grads": only(is(false), "zero keeps fp32 master weights",
		"zero keeps fp32 master weights and gradients: remove it"),
}

var dsBF16Keys = map[string]dsKey{
	"enabled": mapped(), "check_grad_overflow": mapped(),
	"immediate_grad_update": noted("when the framework's gradients are handed over is the framework's: " + noEffect),
	"bf16_master_weights_and_grads": only(is(false), "zero keeps fp32 master weights",
		"zero keeps fp32 master weights and gradients: remove it"),
	"bf16_optimizer_states": only(is(false), "zero keeps fp32 optimizer state",
		"zero keeps the optimizer state in fp32: remove it"),
}

var dsDataTypesKeys = map[string]dsKey{"grad_accum_dtype": mapped(), "param_dtype": mapped(),
	"buffer_dtype": noted("the model's buffers are the framework's: " + noEffect)}

// precision maps fp16, bf16, communication_data_type and data_types, and
// returns the model dtype.
func (r *dsReader) precision(root map[string]any, cfg *Config) DType {
	fp16, _ := r.section(root, "fp16", dsFP16Keys)
	bfKey := "bf16"
	if _, has := root["bf16"]; !has {
		bfKey = "bfloat16"
	} else if _, old := root["bfloat16"]; old {
		r.refuse("bfloat16", "DeepSpeed reads bf16 and ignores bfloat16 when both are given: keep one")
	}
	bf16, _ := r.section(root, bfKey, dsBF16Keys)
	fp16On := r.boolOr(fp16, "enabled", "fp16.", false)
	bf16On := r.boolOr(bf16, "enabled", bfKey+".", false)
	model := FP32
	switch {
	case fp16On && bf16On:
		r.invalid("fp16.enabled", "fp16 and %s are both enabled; DeepSpeed refuses that too: enable one", bfKey)
	case fp16On:
		model = FP16
	case bf16On:
		model = BF16
	}
	if !fp16On {
		for _, k := range sortedKeys(fp16) {
			if k != "enabled" {
				r.notice("fp16."+k, "fp16 is not enabled: %s", noEffect)
			}
		}
	}
	if !bf16On {
		for _, k := range sortedKeys(bf16) {
			if k != "enabled" {
				r.notice(bfKey+"."+k, "%s is not enabled: %s", bfKey, noEffect)
			}
		}
	}
	p := &cfg.Precision
	switch model {
	case FP16:
		static, _ := r.numIn(fp16, "loss_scale", "fp16.", 0, 0)
		if static > 0 {
			p.LossScale = LossScale{Static: static}
			for _, k := range []string{"initial_scale_power", "loss_scale_window", "hysteresis", "min_loss_scale"} {
				if _, has := fp16[k]; has {
					r.notice("fp16."+k, "a static loss_scale: the dynamic settings have no effect, as in DeepSpeed")
				}
			}
			break
		}
		power, hasPower := r.intIn(fp16, "initial_scale_power", "fp16.", 16, 0, 1000)
		window, _ := r.intIn(fp16, "loss_scale_window", "fp16.", 1000, 1, math.MaxInt32)
		hyst, _ := r.intIn(fp16, "hysteresis", "fp16.", 2, 1, math.MaxInt32)
		minScale, _ := r.numIn(fp16, "min_loss_scale", "fp16.", 1, 0)
		switch {
		case minScale <= 0:
			r.invalid("fp16.min_loss_scale", "%v; give a scale > 0", minScale)
		case minScale < 1:
			r.notice("fp16.min_loss_scale", "%v, below 1: DeepSpeed 0.19.8 reads it as a whole number and refuses it; zero honours it, so the scale may fall below 1, to %v", minScale, minScale)
		}
		initial := math.Ldexp(1, power)
		if minScale > initial && r.clean("fp16.initial_scale_power", "fp16.min_loss_scale") {
			of := fmt.Sprintf("initial_scale_power %d", power)
			if !hasPower {
				of = "DeepSpeed's default initial_scale_power 16 (initial_scale_power unset)"
			}
			r.invalid("fp16.min_loss_scale", "%v is above the initial scale 2^%d of %s; give a smaller minimum or a larger initial_scale_power", minScale, power, of)
		}
		p.LossScale = LossScale{Initial: initial, Window: window, Hysteresis: hyst, Min: minScale}
	case BF16:
		// DeepSpeed skips a bf16 step with a non-finite gradient unless
		// check_grad_overflow is false
		p.KeepNonFinite = !r.boolOr(bf16, "check_grad_overflow", bfKey+".", true)
		if p.KeepNonFinite {
			r.notice(bfKey+".check_grad_overflow", "false: a non-finite gradient is applied, as in DeepSpeed, unless clipping is on (zero then skips the step: its norm is not finite)")
		}
	case FP32:
		// DeepSpeed's fp32 ZeRO checks no overflow
		p.KeepNonFinite = true
		r.notice("fp16.enabled", "neither fp16 nor bf16 is enabled, so the model is fp32: DeepSpeed checks no overflow, so neither does zero (Precision.KeepNonFinite), unless clipping is on (zero then skips a step whose norm is not finite)")
	}
	p.CommDType, p.ShardDType = model, model
	if v, has := root["communication_data_type"]; has && v != nil {
		if dt, ok := r.dtype("communication_data_type", v); ok {
			if dt != model && dt != FP32 {
				r.refuse("communication_data_type", "%v on the wire with %v gradients: zero sends the model dtype or fp32; set %q or %q", dt, model, model.dsName(), "fp32")
			} else {
				p.CommDType = dt
			}
		}
	}
	types, _ := r.section(root, "data_types", dsDataTypesKeys)
	if v, has := types["grad_accum_dtype"]; has && v != nil {
		if dt, ok := r.dtype("data_types.grad_accum_dtype", v); ok {
			if dt != model && dt != FP32 {
				r.refuse("data_types.grad_accum_dtype", "%v with %v gradients: zero sums the shard in fp32 or the model dtype; set %q or %q", dt, model, model.dsName(), "fp32")
			} else {
				p.ShardDType = dt
			}
		}
	} else if model != FP32 {
		r.notice("data_types.grad_accum_dtype", "unset: DeepSpeed sums the reduced gradients in the model dtype (%v), and so does zero (Precision.ShardDType); set \"fp32\" for zero's own default", model)
	}
	if v, has := types["param_dtype"]; has && v != nil {
		if dt, ok := r.dtype("data_types.param_dtype", v); ok && dt != model {
			r.refuse("data_types.param_dtype", "%v with %v training: DeepSpeed refuses a param_dtype other than the enabled mode too; remove it", dt, model)
		} else if ok {
			r.notice("data_types.param_dtype", "the model dtype: "+noEffect)
		}
	}
	return model
}

// section reads root[key] as an object and walks its keys (nil where it
// is absent or null).
func (r *dsReader) section(root map[string]any, key string, table map[string]dsKey) (map[string]any, bool) {
	v, has := root[key]
	if !has || v == nil {
		return nil, false
	}
	obj, ok := r.object(key, v)
	if !ok {
		return nil, false
	}
	r.keys(obj, key+".", table, unknownPyd)
	return obj, true
}

// dtype reads DeepSpeed's names of a dtype.
func (r *dsReader) dtype(path string, v any) (DType, bool) {
	s, ok := r.text(path, v)
	if !ok {
		return 0, false
	}
	switch strings.ToLower(s) {
	case "fp32", "float32", "torch.float32", "float":
		return FP32, true
	case "bf16", "bfloat16", "torch.bfloat16", "bfloat":
		return BF16, true
	case "fp16", "float16", "torch.float16", "half":
		return FP16, true
	}
	r.invalid(path, "%q; give \"fp32\", \"bf16\" or \"fp16\"", s)
	return 0, false
}

// dsName is the dtype as DeepSpeed's configs name it.
func (d DType) dsName() string {
	switch d {
	case BF16:
		return "bf16"
	case FP16:
		return "fp16"
	}
	return "fp32"
}

// ---- zero_optimization ----------------------------------------------------------

var dsZeroKeys = map[string]dsKey{
	"stage": mapped(), "reduce_bucket_size": mapped(), "overlap_comm": mapped(),
	"stage3_prefetch_bucket_size": mapped(), "prefetch_bucket_size": mapped(),
	"stage3_max_live_parameters": mapped(), "max_live_parameters": mapped(),
	"offload_optimizer": mapped(), "cpu_offload": mapped(), "allgather_bucket_size": mapped(),
	"contiguous_gradients": noted("zero always flattens each gradient into its bucket: " + noEffect +
		" (without it DeepSpeed's ZeRO-2 all-reduces, dividing by W in the wire dtype first; zero's reduce-scatter is unchanged)"),
	"reduce_scatter": only(is(true), "zero always reduce-scatters (DeepSpeed's ZeRO-1/2 all-reduce each bucket and keep their part)",
		"zero always reduce-scatters: set it to true or remove it"),
	"use_multi_rank_bucket_allreduce": noted("zero reduce-scatters each bucket: " + noEffect),
	"allgather_partitions": only(is(true), "zero all-gathers the new parameters: DeepSpeed's default",
		"zero all-gathers the new parameters (no broadcasts): set it to true or remove it"),
	"load_from_fp32_weights": noted("zero's checkpoints hold the fp32 master weights: " + noEffect),
	"elastic_checkpoint": only(is(false), noEffect,
		"DeepSpeed no longer supports it either; zero's checkpoints reshard by parameter: remove it"),
	"offload_param": mapped(),
	"zenflow":       only(func(v any) bool { return v == nil }, noEffect, "zero has no ZenFlow: remove it"),
	"sub_group_size": tuning(never, "zero steps the optimizer bucket by bucket (reduce_bucket_size) as one fused pass: the same bits",
		"zero steps the optimizer bucket by bucket (reduce_bucket_size): remove it"),
	"cpu_offload_param":          mapped(),
	"cpu_offload_use_pin_memory": noted("zero pins its host memory where the system allows: " + noEffect),
	"stage3_param_persistence_threshold": tuning(is(0), persistence,
		"zero partitions every parameter, small ones too: set it to 0 or remove it (the same bits: only DeepSpeed's all-gathers of small parameters differ)"),
	"param_persistence_threshold": tuning(is(0), persistence,
		"zero partitions every parameter, small ones too: set it to 0 or remove it"),
	"stage3_model_persistence_threshold": noted("zero keeps no parameter whole: " + noEffect),
	"model_persistence_threshold":        noted("zero keeps no parameter whole: " + noEffect),
	"stage3_max_reuse_distance": tuning(never, reuse, "zero keeps a released bucket gathered only when the last window's order needs it again within stage3_prefetch_bucket_size, "+
		"under stage3_max_live_parameters: remove it"),
	"max_reuse_distance":                        tuning(never, reuse, "zero keeps a released bucket by the last window's order, not a distance: remove it"),
	"stage3_gather_16bit_weights_on_model_save": noted("saving the model is not training: " + noEffect + " (FullParams gives the consolidated parameters)"),
	"gather_16bit_weights_on_model_save":        noted("saving the model is not training: " + noEffect + " (FullParams gives the consolidated parameters)"),
	"stage3_gather_fp16_weights_on_model_save":  noted("deprecated name; saving the model is not training: " + noEffect),
	"stage3_module_granularity_threshold": only(is(0), noEffect,
		"zero gathers what the framework asks for, bucket by bucket: remove it"),
	"stage3_use_all_reduce_for_fetch_params": only(is(false), noEffect,
		"zero all-gathers the parameters: remove it"),
	"stage3_allgather_sequential": only(is(false), noEffect, "zero gathers bucket by bucket: remove it"),
	"ignore_unused_parameters":    noted("zero leaves a parameter no rank reported untouched, whatever this says"),
	"legacy_stage1":               only(is(false), noEffect, "zero has no legacy stage 1: remove it"),
	"round_robin_gradients": tuning(is(false), "zero's shards are fixed by the bucket plan: which rank owns which elements differs from DeepSpeed's, not the bits",
		"zero's shards are fixed by the bucket plan: remove it (it changes which rank owns which elements in DeepSpeed, not the bits)"),
	"zero_hpz_partition_size": only(is(1), noEffect, "zero has no secondary partition (ZeRO++ hpZ): remove it"),
	"zero_quantized_weights": only(is(false), noEffect,
		"zero has no quantized all-gather (ZeRO++ qwZ): remove it"),
	"zero_quantized_nontrainable_weights": only(is(false), noEffect,
		"zero keeps frozen parameters in the model dtype: remove it"),
	"zero_quantized_gradients": only(is(false), noEffect,
		"zero has no quantized reduction (ZeRO++ qgZ): remove it"),
	"zeropp_loco_param":                   only(func(v any) bool { return v == nil }, noEffect, "zero has no LoCo-Zero++: remove it"),
	"mics_shard_size":                     only(is(-1), noEffect, "zero shards over the whole group (no MiCS): remove it"),
	"mics_hierarchical_params_gather":     only(is(false), noEffect, "zero shards over the whole group (no MiCS): remove it"),
	"memory_efficient_linear":             noted("the model's linear layers are the framework's: " + noEffect),
	"pipeline_loading_checkpoint":         noted(noEffect),
	"override_module_apply":               noted("module hooks are the framework's: " + noEffect),
	"log_trace_cache_warnings":            noted("logging: " + noEffect),
	"enable_sanity_checks":                noted(noEffect),
	"save_muon_momentum_buffer_in_memory": noted("zero has no Muon: " + noEffect),
	"leaf_module":                         noted("what the framework gathers together is its own: " + noEffect),
}

// The notices of the stage-3 tuning keys.
const (
	persistence = "zero partitions every parameter, small ones too (DeepSpeed keeps those under the threshold whole on every rank): the same bits, only DeepSpeed's all-gathers of small parameters differ"
	reuse       = "zero keeps a released bucket gathered only when the last window's order needs it again within stage3_prefetch_bucket_size, under stage3_max_live_parameters: when it gathers differs from DeepSpeed, not the bits"
)

// never accepts no value: a tuning key refused at any value with Strict.
func never(any) bool { return false }

var dsOffloadKeys = map[string]dsKey{
	"device": mapped(), "pin_memory": mapped(),
	"nvme_path":          noted("no NVMe offload in zero: " + noEffect),
	"buffer_count":       noted(noEffect),
	"fast_init":          noted(noEffect),
	"cpuadam_cores_perc": noted("the host optimizer uses the process's threads: " + noEffect),
	"pipeline_read":      only(is(false), noEffect, "an NVMe pipeline: zero offloads to host memory only: remove it"),
	"pipeline_write":     only(is(false), noEffect, "an NVMe pipeline: zero offloads to host memory only: remove it"),
	"ratio":              only(is(1), noEffect, "zero offloads all of the optimizer or none: set ratio to 1 or remove it"),
	"super_offload":      only(is(false), noEffect, "zero has no SuperOffload: remove it"),
}

// zero maps zero_optimization and returns the stage.
func (r *dsReader) zero(root map[string]any, cfg *Config, model DType) int {
	const at = "zero_optimization."
	var z map[string]any
	switch v := root["zero_optimization"].(type) {
	case nil:
	case bool: // DeepSpeed's old form: true is stage 1, allgather_size its bucket
		z = map[string]any{}
		if v {
			z["stage"] = json.Number("1")
			if a, has := root["allgather_size"]; has {
				z["allgather_bucket_size"] = a
			}
		}
		r.notice("zero_optimization", "the old boolean form, read as DeepSpeed reads it: true is stage 1")
	default:
		var ok bool
		if z, ok = r.object("zero_optimization", v); !ok {
			return 1
		}
		r.keys(z, at, dsZeroKeys, unknownPyd)
		if _, has := root["allgather_size"]; has {
			r.notice("allgather_size", "read only with the old boolean zero_optimization: %s", noEffect)
		}
	}
	stage, set := r.intIn(z, "stage", at, 0, 0, 3)
	switch {
	case !set:
		r.refuse(at+"stage", "unset: DeepSpeed's default is stage 0 (plain data parallelism), which zero does not run; set 1, 2 or 3")
	case stage == 0:
		r.refuse(at+"stage", "stage 0 (plain data parallelism) is not ZeRO; set 1, 2 or 3")
	case stage == 3:
		r.notice(at+"stage", "3: each rank keeps only its shard of the parameters, and Param.Data is not updated: "+
			"the forward and backward read the parameters through Engine.Gather and hand them back with Release "+
			"(a loop written for stage 2 that reads Param.Data trains on the initial weights)")
	}
	cfg.Stage = stage
	size := model.Size()
	reduce, _ := r.intIn(z, "reduce_bucket_size", at, 500_000_000, 1, math.MaxInt/8)
	cfg.BucketBytes = reduce * size
	if v, has := z["allgather_bucket_size"]; has {
		if n, ok := r.integer(at+"allgather_bucket_size", v); ok {
			switch {
			case n == reduce:
				r.notice(at+"allgather_bucket_size", "equal to reduce_bucket_size: zero all-gathers the new parameters bucket by bucket, each of reduce_bucket_size")
			case !r.opts.Strict:
				r.notice(at+"allgather_bucket_size", "zero all-gathers the new parameters bucket by bucket, each of reduce_bucket_size: the same bits, only the size of DeepSpeed's all-gathers differs")
			case r.clean(at + "reduce_bucket_size"):
				r.refuse(at+"allgather_bucket_size", "%d elements, not reduce_bucket_size's: zero all-gathers the new parameters bucket by bucket, each of reduce_bucket_size; set it to reduce_bucket_size or remove it (or leave DeepSpeedOptions.Strict off)", n)
			}
		}
	}
	cfg.Overlap = r.boolOr(z, "overlap_comm", at, stage == 3)
	if _, has := z["overlap_comm"]; !has && stage > 0 {
		r.notice(at+"overlap_comm", "unset: DeepSpeed's default for stage %d is %v, taken (it changes neither the collectives nor the bits here)", stage, stage == 3)
	}
	prefetch, live := "stage3_prefetch_bucket_size", "stage3_max_live_parameters"
	for _, pair := range [][2]string{{prefetch, "prefetch_bucket_size"}, {live, "max_live_parameters"}} {
		if _, both := z[pair[1]]; both {
			if _, also := z[pair[0]]; also {
				r.invalid(at+pair[1], "given with %s, its other name; give one", pair[0])
			}
			z[pair[0]] = z[pair[1]]
		}
	}
	pf, _ := r.intIn(z, prefetch, at, 50_000_000, 0, math.MaxInt/8)
	lv, _ := r.intIn(z, live, at, 1_000_000_000, 0, math.MaxInt/8)
	cfg.Params.PrefetchBytes, cfg.Params.LiveParamBytes = pf*size, lv*size
	if pf == 0 || lv == 0 {
		cfg.Params.PrefetchBytes, cfg.Params.LiveParamBytes = -1, 0
		r.notice(at+prefetch, "a prefetch or live-parameter budget of 0: zero prefetches nothing (Params.PrefetchBytes −1) and gathers what the framework asks for")
	}
	if stage != 3 {
		for _, k := range []string{prefetch, live} {
			if _, has := z[k]; has {
				r.notice(at+k, "stage %d keeps the parameters whole: %s", stage, noEffect)
			}
		}
	}
	r.offload(z, cfg)
	r.offloadParams(z, cfg, stage)
	return stage
}

// offloadSection reads the offload section name of z and the old boolean
// oldName it replaces (refused beside it): old, set where oldName was read;
// the section (nil where absent) and its device ("none" where not given);
// ok false where the section is not an object (refused: read no further).
func (r *dsReader) offloadSection(z map[string]any, name, oldName string, keys map[string]dsKey) (old, oldSet bool, o map[string]any, dev string, ok bool) {
	const zo = "zero_optimization."
	at := zo + name + "."
	v, hasOld := z[oldName]
	if hasOld {
		if b, good := r.boolean(zo+oldName, v); good {
			old, oldSet = b, true
			r.notice(zo+oldName, "the old name of %s {\"device\": \"cpu\"}, read as DeepSpeed reads it", name)
		}
	}
	sec, has := z[name]
	if !has || sec == nil {
		return old, oldSet, nil, "", true
	}
	if hasOld {
		r.invalid(zo+oldName, "given with %s, which replaces it; DeepSpeed refuses both: give one", name)
	}
	if o, ok = r.object(zo+name, sec); !ok {
		return old, oldSet, nil, "", false
	}
	r.keys(o, at, keys, unknownPyd)
	dev = "none"
	if d, has := o["device"]; has {
		if s, good := r.text(at+"device", d); good {
			dev = s
		}
	}
	return old, oldSet, o, dev, true
}

// offload maps offload_optimizer (and the old cpu_offload).
func (r *dsReader) offload(z map[string]any, cfg *Config) {
	const at = "zero_optimization.offload_optimizer."
	old, oldSet, o, dev, ok := r.offloadSection(z, "offload_optimizer", "cpu_offload", dsOffloadKeys)
	if oldSet {
		cfg.Offload.Optimizer = old
	}
	if !ok || o == nil {
		return
	}
	switch dev {
	case "cpu":
		cfg.Offload.Optimizer = true
	case "none":
	case "nvme":
		r.refuse(at+"device", "zero offloads to host memory, not NVMe: set \"cpu\"")
	default:
		r.invalid(at+"device", "%q; give \"cpu\", \"nvme\" or \"none\"", dev)
	}
	if pin := r.boolOr(o, "pin_memory", at, true); !pin {
		r.notice(at+"pin_memory", "false: zero page-locks its host memory where the system allows, whatever this says; the same bits")
	} else if _, has := o["pin_memory"]; has {
		r.notice(at+"pin_memory", "zero page-locks its host memory (unlocked where RLIMIT_MEMLOCK refuses; Stats.HostPinnedBytes shows it)")
	}
}

var dsOffloadParamKeys = map[string]dsKey{
	"device": mapped(), "pin_memory": mapped(),
	"nvme_path":                noted("no NVMe offload in zero: " + noEffect),
	"nvme_path_per_local_rank": noted("no NVMe offload in zero: " + noEffect),
	"buffer_count": noted("the buffer pool of NVMe's parameter swapping: zero gathers into its own pool of bucket buffers, " +
		"as many as stage3_prefetch_bucket_size and stage3_max_live_parameters ask (Params.PrefetchBytes, Params.LiveParamBytes): " + noEffect),
	"buffer_size": noted("the buffers of NVMe's parameter swapping: zero's gather buffers are each the largest bucket (reduce_bucket_size): " + noEffect),
	"max_in_cpu": noted("the parameter elements NVMe offload keeps in host memory: zero keeps this rank's whole shard in page-locked host memory " +
		"(Stats.HostParamBytes): " + noEffect),
}

// offloadParams maps offload_param (and the old cpu_offload_param): with
// device "cpu", at stage 3, Offload.Params; below stage 3 DeepSpeed
// offloads no parameters either.
func (r *dsReader) offloadParams(z map[string]any, cfg *Config, stage int) {
	const at = "zero_optimization.offload_param."
	on, _, o, dev, ok := r.offloadSection(z, "offload_param", "cpu_offload_param", dsOffloadParamKeys)
	if !ok {
		return
	}
	if o != nil {
		switch dev {
		case "cpu":
			on = true
		case "none":
			r.notice(at+"device", "none: the parameters stay on the device")
		case "nvme":
			r.refuse(at+"device", "zero offloads the parameters to host memory, not NVMe: set \"cpu\"")
		default:
			r.invalid(at+"device", "%q; give \"cpu\", \"nvme\" or \"none\"", dev)
		}
		if pin := r.boolOr(o, "pin_memory", at, false); !pin {
			if _, has := o["pin_memory"]; has || on {
				r.notice(at+"pin_memory", "false (DeepSpeed's default): zero page-locks its host memory where the system allows, whatever this says; the same bits")
			}
		} else {
			r.notice(at+"pin_memory", "zero page-locks its host memory (unlocked where RLIMIT_MEMLOCK refuses; Stats.HostPinnedBytes shows it)")
		}
	}
	switch {
	case on && stage == 3:
		cfg.Offload.Params = true
	case on:
		r.notice("zero_optimization.offload_param", "stage %d keeps the parameters whole in the framework's memory, and DeepSpeed offloads them at stage 3 only: %s", stage, noEffect)
	}
}

// ---- batch and reduction -----------------------------------------------------------

// batch resolves the batch sizes as DeepSpeed does, checks them against the
// world size, and returns micro, global and the accumulation steps. Only
// values the file (or an override) gave are cited; a malformed one is
// reported alone, nothing derived from it.
func (r *dsReader) batch(root map[string]any) (micro, global, accum int) {
	const tbKey, mbKey, gKey = "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"
	w := r.opts.World
	tb, hasTB := r.intIn(root, tbKey, "", 0, 1, math.MaxInt32)
	mb, hasMB := r.intIn(root, mbKey, "", 0, 1, math.MaxInt32)
	g, hasG := r.intIn(root, gKey, "", 1, 1, math.MaxInt32)
	if !r.clean(tbKey, mbKey, gKey) {
		return 0, 0, 1
	}
	var whole bool // tb is a whole multiple of what divides it
	switch {
	case hasTB && hasMB && hasG:
		p, ok := product(mb, g, w)
		if !ok || p != tb {
			r.invalid(tbKey, "%d is not train_micro_batch_size_per_gpu %d × gradient_accumulation_steps %d × world size %d; DeepSpeed refuses it too: make them agree", tb, mb, g, w)
		}
		return mb, tb, g
	case hasTB && hasMB:
		p, ok := product(mb, w)
		if g, whole = tb/max(1, p), ok && tb%p == 0; !whole || g < 1 {
			r.invalid(tbKey, "%d is not a whole multiple of train_micro_batch_size_per_gpu %d × world size %d (DeepSpeed takes gradient_accumulation_steps, unset, as the quotient, and refuses this too): make them agree", tb, mb, w)
		}
	case hasTB && hasG:
		p, ok := product(g, w)
		if mb, whole = tb/max(1, p), ok && tb%p == 0; !whole || mb < 1 {
			r.invalid(tbKey, "%d is not a whole multiple of gradient_accumulation_steps %d × world size %d (DeepSpeed takes train_micro_batch_size_per_gpu, unset, as the quotient, and refuses this too): make them agree", tb, g, w)
		}
	case hasMB:
		var ok bool
		if tb, ok = product(mb, g, w); !ok || tb > math.MaxInt32 {
			r.invalid(mbKey, "%d × gradient_accumulation_steps × world size %d is past 2^31 samples a step; give a smaller batch", mb, w)
		}
	case hasTB:
		if mb = tb / w; tb%w != 0 || mb < 1 {
			r.invalid(tbKey, "%d does not split over world size %d (with neither train_micro_batch_size_per_gpu nor gradient_accumulation_steps DeepSpeed takes one backward of train_batch_size / W, and refuses this too): make it a multiple of the world size", tb, w)
		}
	default: // zero needs no batch size; DeepSpeed would ask for one
		if !hasG {
			r.notice(gKey, "unset: DeepSpeed's 1, so Step expects one backward (Grads.AccumSteps 1)")
		}
		return 0, 0, g
	}
	return mb, tb, g
}

// product multiplies counts ≥ 1, false where it overflows.
func product(xs ...int) (int, bool) {
	p := 1
	for _, x := range xs {
		if x < 1 || p > math.MaxInt/x {
			return 0, false
		}
		p *= x
	}
	return p, true
}

// reduction maps the reduction's keys.
func (r *dsReader) reduction(root map[string]any, cfg *Config, stage int) {
	if v, has := root["gradient_allreduce_op"]; has {
		if s, ok := r.text("gradient_allreduce_op", v); ok {
			switch strings.ToLower(s) {
			case "mean":
			case "sum":
				cfg.Grads.Reduction = Sum
				if stage == 3 {
					r.notice("gradient_allreduce_op", "sum at stage 3: DeepSpeed refuses it, zero honours it")
				}
			default:
				r.invalid("gradient_allreduce_op", "%q; give \"mean\" or \"sum\"", s)
			}
		}
	}
	f, hasF := r.numIn(root, "gradient_predivide_factor", "", 1, 0)
	if hasF && f <= 0 {
		r.invalid("gradient_predivide_factor", "%v; give a factor > 0", f)
		f = 1
	}
	pre := r.boolOr(root, "prescale_gradients", "", false)
	cfg.Grads.PredivideFactor = f
	if pre {
		cfg.Grads.PredivideFactor = float64(r.opts.World)
		if hasF && f != 1 {
			r.notice("gradient_predivide_factor", "with prescale_gradients DeepSpeed divides by W before the sum and ignores the factor; so does zero")
		}
	}
	if (pre || f != 1) && stage < 3 {
		r.notice("gradient_predivide_factor", "DeepSpeed refuses pre-division at stage 2 and ignores it at stage 1 (with reduce_scatter, its default); zero honours it at every stage: Grads.PredivideFactor %v", cfg.Grads.PredivideFactor)
	}
}

// ---- optimizer ------------------------------------------------------------------

var dsOptimizerKeys = map[string]dsKey{"type": mapped(), "params": mapped(), "legacy_fusion": noted(noEffect)}

var dsAdamKeys = map[string]dsKey{
	"lr": mapped(), "betas": mapped(), "eps": mapped(), "weight_decay": mapped(), "amsgrad": mapped(),
	"adam_w_mode": mapped(),
	"bias_correction": only(is(true), "zero's AdamW corrects the bias, as DeepSpeed's default",
		"zero's AdamW always corrects the moments' bias: set it to true or remove it"),
	"torch_adam": tuning(is(false), "zero runs its own fused AdamW with torch.optim.AdamW's formulas (bias correction, decoupled weight decay, eps added after the root), "+
		"not DeepSpeed's fused Adam nor torch.optim.AdamW itself: the order of operations differs, so the parameters agree within a few ulp, not bit for bit "+
		"(after 8 steps, measured against DeepSpeed 0.19.8 on the CPU: 5 ulp at the largest value with torch_adam false, 3 with true)",
		"zero runs its own fused AdamW with PyTorch's formulas, not torch.optim's: remove it (or leave DeepSpeedOptions.Strict off)"),
	"fp32_optimizer_states": only(is(true), "zero keeps the optimizer state in fp32",
		"zero keeps the optimizer state in fp32: remove it"),
	"max_grad_norm": refused("DeepSpeed refuses it too: use the top-level gradient_clipping"),
}

var dsSGDKeys = map[string]dsKey{
	"lr": mapped(), "momentum": mapped(), "dampening": mapped(), "weight_decay": mapped(), "nesterov": mapped(),
	"maximize":       only(is(false), noEffect, "zero minimises: remove it"),
	"foreach":        noted("an implementation choice of torch.optim: " + noEffect),
	"fused":          noted("an implementation choice of torch.optim: " + noEffect),
	"differentiable": only(is(false), noEffect, "zero's step is not differentiable: remove it"),
}

// optimizer maps the optimizer block into Groups[0], or returns nil.
func (r *dsReader) optimizer(root map[string]any, cfg *Config) Optimizer {
	v, has := root["optimizer"]
	if !has || v == nil {
		r.notice("optimizer", "none in the file: DeepSpeed takes the client's optimizer; give Optimizer.Groups yourself, or Step only reduces")
		return nil
	}
	blk, ok := r.object("optimizer", v)
	if !ok {
		return nil
	}
	r.keys(blk, "optimizer.", dsOptimizerKeys, unknownPyd)
	name, ok := r.text("optimizer.type", blk["type"])
	if !ok {
		return nil
	}
	params := map[string]any{}
	if p, has := blk["params"]; has && p != nil {
		if params, ok = r.object("optimizer.params", p); !ok {
			return nil
		}
	}
	switch {
	case strings.EqualFold(name, "adam") || strings.EqualFold(name, "adamw"):
		return r.adam(params, cfg, strings.EqualFold(name, "adamw"))
	case name == "SGD":
		return r.sgd(params, cfg)
	}
	r.refuse("optimizer.type", "%q: zero has AdamW (\"AdamW\", or \"Adam\" in its default adam_w_mode) and SGD (\"SGD\"); choose one", name)
	return nil
}

func (r *dsReader) adam(params map[string]any, cfg *Config, adamw bool) Optimizer {
	const at = "optimizer.params."
	r.keys(params, at, dsAdamKeys, unknownArgs)
	o := NewAdamW(1e-3)
	lr, hasLR := r.numIn(params, "lr", at, 1e-3, 0)
	if !hasLR {
		r.notice(at+"lr", "unset: DeepSpeed's default 0.001")
	}
	o.LR = lr
	if v, has := params["betas"]; has {
		list, ok := v.([]any)
		if !ok || len(list) != 2 {
			r.invalid(at+"betas", "%s; give two numbers, [beta1, beta2]", describe(v))
		} else {
			b1, ok1 := r.number(at+"betas[0]", list[0])
			b2, ok2 := r.number(at+"betas[1]", list[1])
			if ok1 && ok2 {
				if b1 < 0 || b1 >= 1 || b2 < 0 || b2 >= 1 {
					r.invalid(at+"betas", "[%v, %v]; give betas in [0, 1)", b1, b2)
				}
				o.Beta1, o.Beta2 = b1, b2
			}
		}
	}
	if eps, _ := r.numIn(params, "eps", at, 1e-8, 0); eps > 0 {
		o.Eps = eps
	} else {
		r.invalid(at+"eps", "0; give eps > 0")
	}
	o.WeightDecay, _ = r.numIn(params, "weight_decay", at, 0, 0)
	o.AMSGrad = r.boolOr(params, "amsgrad", at, false)
	if o.AMSGrad {
		r.notice(at+"amsgrad", "DeepSpeed's FusedAdam refuses amsgrad; zero runs PyTorch's AMSGrad")
	}
	if mode := r.boolOr(params, "adam_w_mode", at, true); !mode {
		switch {
		case adamw:
			r.notice(at+"adam_w_mode", "ignored with type AdamW, as DeepSpeed ignores it")
		case o.WeightDecay == 0:
			r.notice(at+"adam_w_mode", "Adam with L2 regularisation, but no weight decay: the same steps as AdamW")
		default:
			r.refuse(at+"adam_w_mode", "false asks for Adam with L2 regularisation (weight_decay added to the gradient); zero's AdamW decays decoupled: remove it, or set weight_decay to 0")
		}
	}
	cfg.Optimizer.Groups = []Optimizer{o}
	return o
}

func (r *dsReader) sgd(params map[string]any, cfg *Config) Optimizer {
	const at = "optimizer.params."
	r.keys(params, at, dsSGDKeys, unknownArgs)
	lr, hasLR := r.numIn(params, "lr", at, 1e-3, 0)
	if !hasLR {
		r.notice(at+"lr", "unset: torch.optim.SGD's default 0.001")
	}
	o := NewSGD(lr)
	o.Momentum, _ = r.numIn(params, "momentum", at, 0, 0)
	o.Dampening, _ = r.numIn(params, "dampening", at, 0, 0)
	o.WeightDecay, _ = r.numIn(params, "weight_decay", at, 0, 0)
	o.Nesterov = r.boolOr(params, "nesterov", at, false)
	if o.Dampening > 1 {
		r.invalid(at+"dampening", "%v; give a dampening in [0, 1]", o.Dampening)
	}
	if o.Nesterov && (o.Momentum == 0 || o.Dampening != 0) && r.clean(at+"momentum", at+"dampening") {
		r.invalid(at+"nesterov", "Nesterov needs a momentum and zero dampening; torch.optim.SGD refuses it too")
	}
	r.notice("optimizer.type", "SGD with ZeRO needs \"zero_allow_untested_optimizer\": true in DeepSpeed; zero runs it tested")
	cfg.Optimizer.Groups = []Optimizer{o}
	return o
}

// ---- scheduler -------------------------------------------------------------------

var dsScheduleParams = map[string][]string{
	"WarmupLR":       {"warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type"},
	"WarmupDecayLR":  {"total_num_steps", "warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type"},
	"WarmupCosineLR": {"total_num_steps", "warmup_min_ratio", "warmup_num_steps", "cos_min_ratio", "warmup_type"},
	"OneCycle": {"cycle_min_lr", "cycle_max_lr", "decay_lr_rate", "cycle_first_step_size", "cycle_second_step_size",
		"cycle_first_stair_count", "cycle_second_stair_count", "decay_step_size", "cycle_momentum", "cycle_min_mom",
		"cycle_max_mom", "decay_mom_rate"},
}

var dsSchedulerKeys = map[string]dsKey{"type": mapped(), "params": mapped()}

// warmupNotice says, as DeepSpeed warns, that total_num_steps ends the run
// before warmup_num_steps (at least 2) does, citing what the file gave.
func (r *dsReader) warmupNotice(params map[string]any, total, warmup int) {
	const at = "scheduler.params."
	if !warmupOutlasts(total, warmup, true) || !r.clean(at+"total_num_steps", at+"warmup_num_steps") {
		return
	}
	of := fmt.Sprintf("warmup_num_steps %d", warmup)
	if _, has := params["warmup_num_steps"]; !has {
		of = fmt.Sprintf("DeepSpeed's default warmup_num_steps %d (unset)", warmup)
	}
	if warmup < 2 {
		of += ", counted as 2 as DeepSpeed counts it"
	}
	r.notice(at+"total_num_steps", "%d is below %s: the run ends before the warmup does; DeepSpeed warns and so does zero", total, of)
}

// dsScheduleKeys are the keys of a schedule's params: names, and DeepSpeed's
// last_batch_iteration.
func dsScheduleKeys(names []string) map[string]dsKey {
	table := map[string]dsKey{"last_batch_iteration": only(is(-1), "the schedule starts at the beginning; a resumed engine takes its step from the checkpoint",
		"zero takes the schedule's step from the checkpoint it resumes: remove it")}
	for _, k := range names {
		table[k] = mapped()
	}
	return table
}

// scheduler maps the scheduler block into Optimizer.Schedule; opt is the
// file's optimizer (nil: the caller's).
func (r *dsReader) scheduler(root map[string]any, cfg *Config, opt Optimizer) {
	v, has := root["scheduler"]
	if !has || v == nil {
		return
	}
	blk, ok := r.object("scheduler", v)
	if !ok {
		return
	}
	r.keys(blk, "scheduler.", dsSchedulerKeys, unknownPyd)
	name, ok := r.text("scheduler.type", blk["type"])
	if !ok {
		return
	}
	names, known := dsScheduleParams[name]
	if !known {
		r.refuse("scheduler.type", "%q: zero runs DeepSpeed's WarmupLR, WarmupDecayLR, WarmupCosineLR and OneCycle (and PyTorch's linear and cosine with warmup as zero.NewLinearWarmup and zero.NewCosineWarmup, which a DeepSpeed file cannot name): choose one", name)
		return
	}
	params := map[string]any{}
	if p, has := blk["params"]; has && p != nil {
		if params, ok = r.object("scheduler.params", p); !ok {
			return
		}
	}
	const at = "scheduler.params."
	r.keys(params, at, dsScheduleKeys(names), unknownArgs)
	// a list gives one value per parameter group; zero maps one group
	for _, k := range sortedKeys(params) {
		if list, isList := params[k].([]any); isList {
			if len(list) != 1 {
				r.refuse(at+k, "a list of %d values, one per parameter group: ReadDeepSpeed maps one group; give one value and set the other groups' schedules yourself", len(list))
				delete(params, k)
				continue
			}
			params[k] = list[0]
		}
	}
	num := func(k string, def float64) float64 { f, _ := r.numIn(params, k, at, def, 0); return f }
	count := func(k string, def, lo int) int { n, _ := r.intIn(params, k, at, def, lo, math.MaxInt32); return n }
	required := func(k string) {
		if _, has := params[k]; !has {
			r.invalid(at+k, "unset; %s requires it (DeepSpeed has no default): give it", name)
		}
	}
	warmup := func() WarmupType {
		s := "log"
		if v, has := params["warmup_type"]; has {
			s, _ = r.text(at+"warmup_type", v)
		}
		switch s {
		case "log":
			return WarmupLog
		case "linear":
			return WarmupLinear
		}
		r.invalid(at+"warmup_type", "%q; give \"log\" or \"linear\" (DeepSpeed falls back to log with a warning)", s)
		return WarmupLog
	}
	var sched Schedule
	switch name {
	case "WarmupLR":
		s := NewWarmupLR(num("warmup_min_lr", 0), 0, count("warmup_num_steps", 1000, 1))
		if _, has := params["warmup_max_lr"]; has {
			s.MaxLR = num("warmup_max_lr", 0)
		} else {
			s.GroupMaxLR = true
			r.notice(at+"warmup_max_lr", "unset: DeepSpeed warms up to the optimizer's rate (WarmupLR.GroupMaxLR)")
		}
		s.Warmup = warmup()
		sched = s
	case "WarmupDecayLR":
		required("total_num_steps")
		s := NewWarmupDecay(num("warmup_min_lr", 0), num("warmup_max_lr", 0.001), count("warmup_num_steps", 1000, 1), count("total_num_steps", 0, 0))
		s.Warmup = warmup()
		r.warmupNotice(params, s.TotalSteps, s.WarmupSteps)
		sched = s
	case "WarmupCosineLR":
		required("total_num_steps")
		s := NewWarmupCosine(count("warmup_num_steps", 1000, 1), count("total_num_steps", 0, 0))
		s.WarmupMinRatio, s.CosMinRatio, s.Warmup = num("warmup_min_ratio", 0), num("cos_min_ratio", 0.0001), warmup()
		r.warmupNotice(params, s.TotalSteps, s.WarmupSteps)
		sched = s
	case "OneCycle":
		required("cycle_min_lr")
		required("cycle_max_lr")
		s := NewOneCycle(num("cycle_min_lr", 0), num("cycle_max_lr", 0))
		s.DecayLRRate = num("decay_lr_rate", 0)
		s.FirstStepSize = count("cycle_first_step_size", 2000, 1)
		s.SecondStepSize = count("cycle_second_step_size", s.FirstStepSize, 0)
		s.FirstStairCount = count("cycle_first_stair_count", 0, 0)
		s.SecondStairCount = count("cycle_second_stair_count", s.FirstStairCount, 0)
		s.DecayStepSize = count("decay_step_size", 0, 0)
		s.CycleMomentum = r.boolOr(params, "cycle_momentum", at, true)
		s.MinMom, s.MaxMom, s.DecayMomRate = num("cycle_min_mom", 0.8), num("cycle_max_mom", 0.9), num("decay_mom_rate", 0)
		if s.CycleMomentum {
			switch o := opt.(type) {
			case SGD:
				s.CycleMomentum = false
				r.notice(at+"cycle_momentum", "DeepSpeed cycles the momentum only of optimizers with betas, not SGD's; neither does zero")
			case AdamW:
				if (s.MinMom >= 1 || s.MaxMom >= 1) && r.clean(at+"cycle_min_mom", at+"cycle_max_mom") {
					r.invalid(at+"cycle_max_mom", "momenta %v to %v: Adam's beta1 must stay below 1", s.MinMom, s.MaxMom)
				}
				o.Beta2 = 0.99
				cfg.Optimizer.Groups[0] = o
				r.notice(at+"cycle_momentum", "DeepSpeed sets Adam's betas to (momentum, 0.99) at every step, whatever optimizer.params.betas says; zero follows: Optimizer.Groups[0].Beta2 0.99")
			case nil:
				r.notice(at+"cycle_momentum", "the momentum cycles AdamW's Beta1 (or SGD's Momentum) of the groups you give; DeepSpeed also sets Adam's second beta to 0.99")
			}
		}
		sched = s
	}
	cfg.Optimizer.Schedule = sched
	if c, ok := sched.(scheduleChecker); ok && r.cleanUnder("scheduler.") {
		if err := c.checkSchedule("scheduler"); err != nil {
			r.invalid("scheduler.params", "%s", strings.TrimPrefix(err.Error(), ErrConfig.Error()+": "))
		}
	}
}
