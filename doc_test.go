package zero

import (
	"bytes"
	"go/ast"
	"go/parser"
	"go/token"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"
)

// TestEveryExportedIdentifierHasADoc: functions, methods, types, constants,
// variables and struct fields that the package exports, in every build
// variant's files, carry a comment.
func TestEveryExportedIdentifierHasADoc(t *testing.T) {
	files, err := filepath.Glob("*.go")
	if err != nil {
		t.Fatal(err)
	}
	fset := token.NewFileSet()
	for _, name := range files {
		if strings.HasSuffix(name, "_test.go") {
			continue
		}
		f, err := parser.ParseFile(fset, name, nil, parser.ParseComments)
		if err != nil {
			t.Fatal(err)
		}
		missing := func(pos token.Pos, what string) {
			t.Errorf("%s: %s has no doc comment", fset.Position(pos), what)
		}
		for _, decl := range f.Decls {
			switch d := decl.(type) {
			case *ast.FuncDecl:
				if !d.Name.IsExported() || d.Doc != nil {
					continue
				}
				if d.Recv != nil && !exportedReceiver(d.Recv) {
					continue
				}
				missing(d.Pos(), d.Name.Name)
			case *ast.GenDecl:
				for _, spec := range d.Specs {
					switch s := spec.(type) {
					case *ast.TypeSpec:
						if !s.Name.IsExported() {
							continue
						}
						if s.Doc == nil && d.Doc == nil {
							missing(s.Pos(), "type "+s.Name.Name)
						}
						var fields *ast.FieldList
						switch x := s.Type.(type) {
						case *ast.StructType:
							fields = x.Fields
						case *ast.InterfaceType: // the methods of an exported interface
							fields = x.Methods
						}
						for _, fld := range fieldList(fields) {
							for _, n := range fld.Names {
								if n.IsExported() && fld.Doc == nil && fld.Comment == nil {
									missing(n.Pos(), s.Name.Name+"."+n.Name)
								}
							}
						}
					case *ast.ValueSpec:
						exported := false
						for _, n := range s.Names {
							exported = exported || n.IsExported()
							// a constant with its own comment, or in a group whose
							// doc covers it, counts as documented
							if n.IsExported() && s.Doc == nil && s.Comment == nil && d.Doc == nil {
								missing(n.Pos(), n.Name)
							}
						}
						// a group of exported constants says what they are
						if exported && d.Lparen.IsValid() && d.Doc == nil && spec == d.Specs[0] {
							missing(d.Pos(), "the group of "+s.Names[0].Name)
						}
					}
				}
			}
		}
	}
}

func fieldList(l *ast.FieldList) []*ast.Field {
	if l == nil {
		return nil
	}
	return l.List
}

func exportedReceiver(recv *ast.FieldList) bool {
	typ := recv.List[0].Type
	if star, ok := typ.(*ast.StarExpr); ok {
		typ = star.X
	}
	id, ok := typ.(*ast.Ident)
	return ok && id.IsExported()
}

// TestReadmeQuotesTheExample: the README's program is example_test.go's
// Example, word for word, so the README's code compiles and runs.
func TestReadmeQuotesTheExample(t *testing.T) {
	readme, err := os.ReadFile("README.md")
	if err != nil {
		t.Fatal(err)
	}
	src, err := os.ReadFile("example_test.go")
	if err != nil {
		t.Fatal(err)
	}
	body := string(src[bytes.Index(src, []byte("func Example()")):])
	if !strings.Contains(string(readme), "```go\n"+strings.TrimRight(body, "\n")+"\n```") {
		t.Error("README.md does not quote example_test.go from func Example() to its end; copy it into the README's Use it section")
	}
}

// TestBuildWithoutCgo: with cgo off, in the default build and with -tags
// cuda, the first error the compiler shows is the package's own, which
// names the fix (cgo_required.go), not an undefined name of another file.
func TestBuildWithoutCgo(t *testing.T) {
	if testing.Short() {
		t.Skip("builds the package twice")
	}
	goTool, err := exec.LookPath("go")
	if err != nil {
		t.Skip("no go tool on PATH")
	}
	for _, tags := range []string{"", "cuda"} {
		cmd := exec.Command(goTool, "build", "-tags", tags, "-o", os.DevNull, ".")
		cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
		out, err := cmd.CombinedOutput()
		if err == nil {
			t.Fatalf("tags %q: the build with cgo off succeeded", tags)
		}
		var first string
		for _, line := range strings.Split(string(out), "\n") {
			if strings.Contains(line, ".go:") {
				first = line
				break
			}
		}
		if !strings.Contains(first, "CGO_ENABLED_1") {
			t.Errorf("tags %q: the first error is %q, want the one naming cgo\n%s", tags, first, out)
		}
	}
}

// TestReadmeCheckpointNames: the names the README gives a checkpoint and
// its files are those Save writes. Two ranks take 6 steps and save three
// times: step-00000006, step-00000006.1 and step-00000006.2, latest naming
// the last, each holding manifest.json, rank-00000.bin and rank-00001.bin;
// the README quotes those names and no placeholder of them.
func TestReadmeCheckpointNames(t *testing.T) {
	dir := t.TempDir()
	comms, err := NewLocalGroupTimeout(2, time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	errs := eachRank(2, func(rank int) error {
		defer comms[rank].Close()
		params := []Param{{Name: "w", Count: 8, DType: FP32, Data: Float32s(make([]float32, 8))}}
		e, err := New(Config{Stage: 2, BucketBytes: 64, Optimizer: OptimizerPolicy{Groups: []Optimizer{NewSGD(0.1)}}}, comms[rank], params)
		if err != nil {
			return err
		}
		defer e.Close()
		s := NewHostStream()
		defer s.Close()
		g := constGrads(params, 0.5)
		for range 6 {
			if _, err := e.GradReady(0, g[0], s); err != nil {
				return err
			}
			if err := e.EndBackward(); err != nil {
				return err
			}
			if err := e.Step(); err != nil {
				return err
			}
		}
		for range 3 {
			if err := e.Save(dir, SaveOptions{Keep: 3}); err != nil {
				return err
			}
		}
		return nil
	})
	everyRankIs(t, "6 steps and 3 saves", errs, nil)
	ckpts := []string{"step-00000006", "step-00000006.1", "step-00000006.2"}
	var dirs []string
	ents, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range ents {
		if e.IsDir() {
			dirs = append(dirs, e.Name())
		}
	}
	if !slices.Equal(dirs, ckpts) {
		t.Fatalf("Save wrote %q, want %q", dirs, ckpts)
	}
	if latest, err := os.ReadFile(filepath.Join(dir, "latest")); err != nil || strings.TrimSpace(string(latest)) != ckpts[2] {
		t.Fatalf("latest holds %q (%v), want %q", latest, err, ckpts[2])
	}
	files := []string{"manifest.json", "rank-00000.bin", "rank-00001.bin"}
	for _, c := range ckpts {
		var names []string
		ents, err := os.ReadDir(filepath.Join(dir, c))
		if err != nil {
			t.Fatal(err)
		}
		for _, e := range ents {
			names = append(names, e.Name())
		}
		if !slices.Equal(names, files) {
			t.Fatalf("%s holds %q, want %q", c, names, files)
		}
	}
	if partial := ckptPartial + ckptName(6, 0); partial != ".partial-step-00000006" {
		t.Fatalf("a save at step 6 writes into %s, which the README does not name", partial)
	}
	readme, err := os.ReadFile("README.md")
	if err != nil {
		t.Fatal(err)
	}
	text := strings.Join(strings.Fields(string(readme)), " ") // lines rewrapped
	for _, quoted := range []string{"`ckpt/step-00000006`", "`step-00000006.1`", "`step-00000006.2`", "`ckpt/latest`",
		"`.partial-step-00000006`", "`rank-00000.bin`", "`rank-00001.bin`"} {
		if !strings.Contains(text, quoted) {
			t.Errorf("README.md does not quote %s, a name Save writes", quoted)
		}
	}
	for _, placeholder := range []string{"step-N", "rank-RRRRR"} {
		if strings.Contains(text, placeholder) {
			t.Errorf("README.md names a checkpoint file %s; quote the name Save writes", placeholder)
		}
	}
}

// TestMakeTestSweeps: every test that runs lighter under the race detector
// (its body names forEachLevel, fullSize, withoutRace or raceEnabled) is
// in the Makefile's SWEEPS, which make test runs again without it, so
// nothing is only ever checked lightly.
func TestMakeTestSweeps(t *testing.T) {
	mk, err := os.ReadFile("Makefile")
	if err != nil {
		t.Fatal(err)
	}
	m := regexp.MustCompile(`(?m)^SWEEPS := (.+)$`).FindSubmatch(mk)
	if m == nil {
		t.Fatal("the Makefile has no SWEEPS := line")
	}
	sweeps := regexp.MustCompile(string(m[1]))
	if !bytes.Contains(mk, []byte("-run '$(SWEEPS)'")) {
		t.Fatal("make test does not run $(SWEEPS)")
	}
	files, _ := filepath.Glob("*_test.go")
	fset := token.NewFileSet()
	lighter := 0
	for _, name := range files {
		f, err := parser.ParseFile(fset, name, nil, 0)
		if err != nil {
			t.Fatal(err)
		}
		for _, d := range f.Decls {
			fn, ok := d.(*ast.FuncDecl)
			if !ok || fn.Recv != nil || !strings.HasPrefix(fn.Name.Name, "Test") || fn.Body == nil {
				continue
			}
			light := false
			ast.Inspect(fn.Body, func(n ast.Node) bool {
				if id, ok := n.(*ast.Ident); ok {
					switch id.Name {
					case "forEachLevel", "fullSize", "withoutRace", "raceEnabled":
						light = true
					}
				}
				return !light
			})
			if light {
				lighter++
				if !sweeps.MatchString(fn.Name.Name) {
					t.Errorf("%s (%s) runs lighter under the race detector, and the Makefile's SWEEPS does not run it without", fn.Name.Name, name)
				}
			}
		}
	}
	if lighter == 0 {
		t.Fatal("no test runs lighter under the race detector: the test reads nothing")
	}
	t.Logf("%d tests run lighter under the race detector, in full without it", lighter)
}
