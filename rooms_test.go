package zero

import (
	"fmt"
	"go/ast"
	"go/build"
	"go/importer"
	"go/parser"
	"go/token"
	"go/types"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
)

// testRooms are the test files that others may borrow from: the harness
// (running ranks, seeds, stream gates, small builders, ISA levels), the
// training runs (train_test.go), the package's source
// read for go/types (source_test.go), the fakes (failing
// and counting devices, comms and streams), the float64 references, and the
// partition plan's tests. harness_cuda_test.go is the part of the harness
// that only compiles with -tags cuda (it names *cudaDevice); race_test.go
// and norace_test.go say whether the race detector is on; benchenv_test.go
// holds the bodies of the benchmarks that run on the CPU and on a GPU.
// A CUDA test file (x_cuda_test.go) may borrow from its CPU twin
// (x_test.go). Every other test file keeps to itself: what it declares
// only it uses.
var testRooms = []string{"harness_test.go", "train_test.go", "source_test.go", "harness_cuda_test.go", "fakes_test.go", "reference_test.go", "bucket_test.go", "race_test.go", "norace_test.go", "benchenv_test.go"}

// A roomBorrow is a use, in one test file, of a package-level identifier
// (or a method) declared in another test file that is not a room.
type roomBorrow struct {
	use, decl token.Position
	what      string // "func eachRank", "method (*HostStream).waitedOn", ...
}

// TestTestRooms: no test file uses a function, type, variable, constant or
// method declared in another test file unless that file is a room, in the
// default build and with -tags cuda (both type-checked from source).
func TestTestRooms(t *testing.T) {
	withoutRace(t)
	imp := importer.Default() // one cache of the standard library for both builds
	seen := map[string]bool{}
	for _, tags := range [][]string{nil, {"cuda"}} {
		borrows, shared, err := roomBorrows(".", tags, imp)
		if err != nil {
			t.Fatal(err)
		}
		if shared == 0 {
			t.Fatalf("tags %q: no test file uses what another declares: the check resolves nothing", tags)
		}
		for _, b := range borrows { // the first use in each file, in either build
			use, decl := filepath.Base(b.use.Filename), filepath.Base(b.decl.Filename)
			if key := use + " " + b.what; !seen[key] {
				seen[key] = true
				t.Errorf("%s:%d uses %s, declared in %s:%d, a feature's test file: move it into a room (%s)",
					use, b.use.Line, b.what, decl, b.decl.Line, strings.Join(testRooms, ", "))
			}
		}
	}
}

// roomBorrows type-checks the package in dir with its test files (and the
// external test package, if any) for the build tags, and returns every
// borrow from a test file that is not a room, and how many uses of another
// test file's declarations it saw in all (borrows included). Type errors are ignored: importer.Default
// reads only the standard library's export data, so imports of other
// modules fail, and nothing a test file declares depends on them.
func roomBorrows(dir string, tags []string, imp types.Importer) ([]roomBorrow, int, error) {
	ctx := build.Default
	ctx.CgoEnabled = true
	ctx.BuildTags = tags
	entries, err := os.ReadDir(dir)
	if err != nil {
		return nil, 0, err
	}
	fset := token.NewFileSet()
	var files, external []*ast.File
	for _, ent := range entries {
		name := ent.Name()
		if ent.IsDir() || !strings.HasSuffix(name, ".go") {
			continue
		}
		if ok, err := ctx.MatchFile(dir, name); err != nil {
			return nil, 0, err
		} else if !ok {
			continue
		}
		f, err := parser.ParseFile(fset, filepath.Join(dir, name), nil, 0)
		if err != nil {
			return nil, 0, err
		}
		if strings.HasSuffix(f.Name.Name, "_test") {
			external = append(external, f)
		} else {
			files = append(files, f)
		}
	}
	if len(files) == 0 {
		return nil, 0, fmt.Errorf("tags %q: no Go files in %s", tags, dir)
	}
	info := &types.Info{Uses: map[*ast.Ident]types.Object{}}
	conf := types.Config{FakeImportC: true, Importer: imp, Error: func(error) {}}
	pkg, _ := conf.Check(files[0].Name.Name, fset, files, info)
	if len(external) > 0 {
		ext := types.Config{Importer: importerFunc(func(path string) (*types.Package, error) {
			if path == pkg.Path() {
				return pkg, nil
			}
			return imp.Import(path)
		}), Error: func(error) {}}
		ext.Check(pkg.Path()+"_test", fset, external, info)
	}
	var borrows []roomBorrow
	shared := 0
	for id, obj := range info.Uses {
		if obj == nil || obj.Pkg() != pkg {
			continue
		}
		what := ""
		switch o := obj.(type) {
		case *types.Func:
			if recv := o.Signature().Recv(); recv != nil {
				what = fmt.Sprintf("method (%s).%s", types.TypeString(recv.Type(), types.RelativeTo(pkg)), o.Name())
			} else if o.Parent() == pkg.Scope() {
				what = "func " + o.Name()
			}
		case *types.TypeName:
			if o.Parent() == pkg.Scope() {
				what = "type " + o.Name()
			}
		case *types.Var:
			if o.Parent() == pkg.Scope() {
				what = "var " + o.Name()
			}
		case *types.Const:
			if o.Parent() == pkg.Scope() {
				what = "const " + o.Name()
			}
		}
		if what == "" {
			continue
		}
		use, decl := fset.Position(id.Pos()), fset.Position(obj.Pos())
		if !strings.HasSuffix(use.Filename, "_test.go") || !strings.HasSuffix(decl.Filename, "_test.go") || use.Filename == decl.Filename {
			continue
		}
		shared++
		if slices.Contains(testRooms, filepath.Base(decl.Filename)) || cudaTwin(use.Filename, decl.Filename) {
			continue
		}
		borrows = append(borrows, roomBorrow{use: use, decl: decl, what: what})
	}
	slices.SortFunc(borrows, func(a, b roomBorrow) int {
		if c := strings.Compare(a.use.Filename, b.use.Filename); c != 0 {
			return c
		}
		if a.use.Line != b.use.Line {
			return a.use.Line - b.use.Line
		}
		return strings.Compare(a.what, b.what)
	})
	return borrows, shared, nil
}

// cudaTwin reports whether use is the CUDA test file of decl, its CPU
// twin: x_cuda_test.go of x_test.go.
func cudaTwin(use, decl string) bool {
	return filepath.Base(use) == strings.TrimSuffix(filepath.Base(decl), "_test.go")+"_cuda_test.go"
}

// importerFunc is a types.Importer made of a function.
type importerFunc func(path string) (*types.Package, error)

func (f importerFunc) Import(path string) (*types.Package, error) { return f(path) }
