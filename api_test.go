package zero

import (
	"bufio"
	"fmt"
	"go/importer"
	"go/types"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
)

// apiFile is the exported API of the last release, one declaration a line,
// as Go's own api/ files hold theirs. It changes only at a release
// (ZERO_API_WRITE=1 go test -run TestAPI rewrites it); between releases,
// every difference from it must be named in CHANGELOG.md's Unreleased
// section.
const apiFile = "api/zero.txt"

// cudaOnlyAPI are the names only the -tags cuda build exports, each for a
// reason: NVML wraps go-nvml, which the default build never compiles.
var cudaOnlyAPI = map[string]bool{"NVML": true, "NewNVML": true}

// TestAPI: the exported API, read with go/types from the package's source,
// is the same in the default build and with -tags cuda, and it differs from
// api/zero.txt only by identifiers CHANGELOG.md's Unreleased section names.
func TestAPI(t *testing.T) {
	var builds [2][]string
	for i, tags := range [][]string{nil, {"cuda"}} {
		builds[i] = exportedAPI(t, tags)
	}
	var differ []string
	for _, d := range apiDiff(builds[0], builds[1]) {
		if id := apiIdent(d[2:]); !cudaOnlyAPI[strings.Split(id, ".")[0]] {
			differ = append(differ, d)
		}
	}
	if d := differ; len(d) > 0 {
		t.Errorf("the exported API differs between the default build and -tags cuda (%s): both builds must export the same names", strings.Join(d, "; "))
	}
	api := builds[0]
	if len(api) < 50 {
		t.Fatalf("only %d exported declarations found: the walk reads nothing", len(api))
	}
	if os.Getenv("ZERO_API_WRITE") == "1" {
		if err := os.WriteFile(apiFile, []byte(strings.Join(api, "\n")+"\n"), 0o644); err != nil {
			t.Fatal(err)
		}
		t.Logf("wrote %s (%d lines)", apiFile, len(api))
		return
	}
	release, err := readLines(apiFile)
	if err != nil {
		t.Fatalf("%v: write it with ZERO_API_WRITE=1 go test -run TestAPI", err)
	}
	unreleased, err := unreleasedSection("CHANGELOG.md")
	if err != nil {
		t.Fatal(err)
	}
	for _, missing := range unnamedChanges(release, api, unreleased) {
		t.Errorf("%s: name `%s` in CHANGELOG.md's Unreleased section (Added, Changed, Deprecated or Removed)", missing.line, missing.ident)
	}
}

// TestAPIChangeNeedsItsEntry: the check itself finds an added, a removed and
// a changed declaration, and accepts each once the changelog names it.
func TestAPIChangeNeedsItsEntry(t *testing.T) {
	release := []string{"func New(Config, Comm, []Param) (*Engine, error)", "type Config struct, Stage int", "type Stats struct, Skipped bool"}
	now := []string{"func New(Config, Comm, []Param) (*Engine, error)", "type Config struct, Stage int8", "type Engine struct", "method (*Engine) Step() (Stats, error)"}
	var got []string
	for _, c := range unnamedChanges(release, now, "") {
		got = append(got, c.ident)
	}
	want := []string{"Config.Stage", "Config.Stage", "Engine", "Engine.Step", "Stats.Skipped"}
	if !slices.Equal(got, want) {
		t.Fatalf("unnamed changes %q, want %q", got, want)
	}
	named := "### Added\n- `zero.Engine` and `Engine.Step()`.\n### Changed\n- `Config.Stage` is an int8.\n### Removed\n- `Stats.Skipped`\n"
	if c := unnamedChanges(release, now, named); len(c) > 0 {
		t.Fatalf("changes named in the changelog still reported: %v", c)
	}
	// A new type is named once, with its members; a member added to a type
	// that was already there is named on its own.
	release2 := []string{"type Config struct"}
	now2 := []string{"type Config struct", "type Config struct, Stage int", "type MPIError struct", "type MPIError struct, Code int", "method (*MPIError) Error() string"}
	if c := unnamedChanges(release2, now2, "- `MPIError`, with `Config.Stage`"); len(c) != 0 {
		t.Fatalf("a new type's members reported: %v", c)
	}
	if c := unnamedChanges(release2, now2, "- `MPIError`"); len(c) != 1 || c[0].ident != "Config.Stage" {
		t.Fatalf("a new member of an old type: reported %v, want Config.Stage", c)
	}
	// A name that only contains the identifier does not count.
	if c := unnamedChanges(release, now, "`Engine.StepAll` `Config.Stages` `MyEngine` `Stats.SkippedX`"); len(c) != len(want) {
		t.Fatalf("near names accepted: %d of %d reported", len(c), len(want))
	}
}

// TestVersionIsTheLatestRelease: Version names the newest released section
// of CHANGELOG.md, so a vendored copy says what it is.
func TestVersionIsTheLatestRelease(t *testing.T) {
	lines, err := readLines("CHANGELOG.md")
	if err != nil {
		t.Fatal(err)
	}
	re := regexp.MustCompile(`^## \[(\d+\.\d+\.\d+)\] - \d{4}-\d{2}-\d{2}$`)
	for _, l := range lines {
		if m := re.FindStringSubmatch(l); m != nil {
			if m[1] != Version {
				t.Fatalf("Version is %q, the newest release in CHANGELOG.md is %q", Version, m[1])
			}
			return
		}
	}
	t.Fatal("CHANGELOG.md has no released section (## [x.y.z] - YYYY-MM-DD)")
}

type apiChange struct{ line, ident string }

// unnamedChanges lists each declaration added or removed between release
// and now whose identifier the changelog text does not name in backquotes.
func unnamedChanges(release, now []string, changelog string) []apiChange {
	var spans []string
	for _, m := range regexp.MustCompile("`([^`]+)`").FindAllStringSubmatch(changelog, -1) {
		spans = append(spans, m[1])
	}
	named := func(ident string) bool {
		re := regexp.MustCompile(`(^|[^A-Za-z0-9_.]|\bzero\.)` + regexp.QuoteMeta(ident) + `($|[^A-Za-z0-9_.])`)
		for _, s := range spans {
			if re.MatchString(s) {
				return true
			}
		}
		return false
	}
	// A type added or removed whole is named once: its fields and methods
	// come and go with it.
	diff := apiDiff(release, now)
	whole := map[string]bool{}
	for _, line := range diff {
		if id := apiIdent(line[2:]); strings.HasPrefix(line[2:], "type ") && !strings.Contains(id, ".") {
			whole[line[:2]+id] = true
		}
	}
	var out []apiChange
	for _, line := range diff {
		id := apiIdent(line[2:])
		typ, _, member := strings.Cut(id, ".")
		if named(id) || member && whole[line[:2]+typ] && named(typ) {
			continue
		}
		out = append(out, apiChange{line, id})
	}
	slices.SortFunc(out, func(a, b apiChange) int { return strings.Compare(a.ident, b.ident) })
	return out
}

// apiDiff gives "- line" for each line only in a and "+ line" for each only
// in b.
func apiDiff(a, b []string) []string {
	var d []string
	for _, l := range a {
		if !slices.Contains(b, l) {
			d = append(d, "- "+l)
		}
	}
	for _, l := range b {
		if !slices.Contains(a, l) {
			d = append(d, "+ "+l)
		}
	}
	return d
}

// apiIdent is the identifier a declaration line is about: Name, or
// Type.Member for a method, field or interface method.
func apiIdent(line string) string {
	kind, rest, _ := strings.Cut(line, " ")
	switch kind {
	case "method": // method (*T) Name(...
		recv, after, _ := strings.Cut(strings.TrimPrefix(rest, "("), ") ")
		name, _, _ := strings.Cut(after, "(")
		return strings.TrimPrefix(recv, "*") + "." + name
	case "type": // type T kind[, Member ...]
		name, after, _ := strings.Cut(rest, " ")
		if _, member, ok := strings.Cut(after, ", "); ok {
			m, _, _ := strings.Cut(member, " ")
			m, _, _ = strings.Cut(m, "(")
			return name + "." + m
		}
		return name
	default: // const, var, func
		name, _, _ := strings.Cut(rest, " ")
		name, _, _ = strings.Cut(name, "(")
		return name
	}
}

// exportedAPI type-checks the package's non-test files of the build with
// tags and lists its exported declarations, sorted.
func exportedAPI(t *testing.T, tags []string) []string {
	t.Helper()
	fset, files := parsePackage(t, tags)
	conf := types.Config{FakeImportC: true, Importer: importer.Default(), Error: func(error) {}}
	pkg, _ := conf.Check("zero", fset, files, nil)
	qual := func(p *types.Package) string {
		if p.Path() == "zero" {
			return ""
		}
		return p.Path()
	}
	str := func(typ types.Type) string { return types.TypeString(typ, qual) }
	sig := func(s *types.Signature) string { return strings.TrimPrefix(types.TypeString(s, qual), "func") }
	var api []string
	scope := pkg.Scope()
	for _, name := range scope.Names() {
		obj := scope.Lookup(name)
		if !obj.Exported() {
			continue
		}
		switch o := obj.(type) {
		case *types.Const:
			api = append(api, fmt.Sprintf("const %s %s", name, str(o.Type())))
		case *types.Var:
			api = append(api, fmt.Sprintf("var %s %s", name, str(o.Type())))
		case *types.Func:
			api = append(api, fmt.Sprintf("func %s%s", name, sig(o.Type().(*types.Signature))))
		case *types.TypeName:
			if o.IsAlias() {
				api = append(api, fmt.Sprintf("type %s = %s", name, str(types.Unalias(o.Type()))))
				continue
			}
			named := o.Type().(*types.Named)
			switch u := named.Underlying().(type) {
			case *types.Struct:
				api = append(api, fmt.Sprintf("type %s struct", name))
				for i := range u.NumFields() {
					if f := u.Field(i); f.Exported() {
						embedded := ""
						if f.Embedded() {
							embedded = "embedded "
						}
						api = append(api, fmt.Sprintf("type %s struct, %s%s %s", name, embedded, f.Name(), str(f.Type())))
					}
				}
			case *types.Interface:
				api = append(api, fmt.Sprintf("type %s interface", name))
				for i := range u.NumExplicitMethods() {
					if m := u.ExplicitMethod(i); m.Exported() {
						api = append(api, fmt.Sprintf("type %s interface, %s%s", name, m.Name(), sig(m.Type().(*types.Signature))))
					}
				}
				for i := range u.NumEmbeddeds() {
					api = append(api, fmt.Sprintf("type %s interface, embedded %s", name, str(u.EmbeddedType(i))))
				}
			default:
				api = append(api, fmt.Sprintf("type %s %s", name, str(u)))
			}
			for i := range named.NumMethods() {
				m := named.Method(i)
				if !m.Exported() {
					continue
				}
				s := m.Type().(*types.Signature)
				recv := name
				if _, ptr := s.Recv().Type().(*types.Pointer); ptr {
					recv = "*" + name
				}
				api = append(api, fmt.Sprintf("method (%s) %s%s", recv, m.Name(), sig(s)))
			}
		}
	}
	slices.Sort(api)
	return api
}

// unreleasedSection returns the text of the changelog's Unreleased section.
func unreleasedSection(path string) (string, error) {
	lines, err := readLines(path)
	if err != nil {
		return "", err
	}
	var b strings.Builder
	in := false
	for _, l := range lines {
		if strings.HasPrefix(l, "## [") {
			if in {
				break
			}
			in = strings.HasPrefix(l, "## [Unreleased]")
			continue
		}
		if in {
			b.WriteString(l + "\n")
		}
	}
	if !in && b.Len() == 0 {
		return "", fmt.Errorf("%s has no ## [Unreleased] section", path)
	}
	return b.String(), nil
}

func readLines(path string) ([]string, error) {
	f, err := os.Open(filepath.FromSlash(path))
	if err != nil {
		return nil, err
	}
	defer f.Close()
	var lines []string
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		lines = append(lines, sc.Text())
	}
	return lines, sc.Err()
}
