package zero

import (
	"cmp"
	"fmt"
	"go/ast"
	"go/importer"
	"go/token"
	"go/types"
	"maps"
	"path/filepath"
	"slices"
	"strings"
	"testing"
)

// The package's files stand on floors. A file may use the private fields
// and methods of a lower floor's files; of a file on its own floor or a
// higher one, nothing; and of a component (componentFloor up) only methods,
// never fields, even from above: a component's state is read and changed by
// its own file alone. Interface methods are seams, open to all.
var floors = map[string]int{
	// 0: the foundation types (a host tensor beside the dtypes)
	"dtype.go": 0, "errors.go": 0, "doc.go": 0, "cgo_required.go": 0,
	// 1: the types that cross into C
	"kernels_abi.go": 1,
	// 2: kernels and streams
	"kernels.go": 2, "stream.go": 2, "gpu_errors.go": 2,
	// 3: devices and their memory
	"device.go": 3, "cuda.go": 3, "nvml.go": 3,
	// 4: what lives on a device: pools, page-locked memory, collectives;
	// the bootstrap of a group, and the default build's word that CUDA is
	// not in it; the step's figures and the backward-end mark they are
	// measured from; the checkpoint's file layer, its rank files and the
	// lock of its directory; the safetensors format
	"pool.go": 4, "pinned.go": 4, "nccl.go": 4, "bootstrap.go": 4, "cuda_stub.go": 4, "stats.go": 4,
	"ckptfs.go": 4, "ckptfile.go": 4, "ckptlock.go": 4, "safetensors.go": 4,
	// 5: the communicators
	"group_local.go": 5, "group_cuda.go": 5, "nccl_cuda.go": 5, "mpi.go": 5,
	// 6: the caller's words, the partition plan and what the engine reports
	// back; the import of a model from a safetensors file
	"config.go": 6, "settings.go": 6, "plan.go": 6, "view.go": 6, "schedule.go": 6, "dsconfig.go": 6, "safetensors_io.go": 9,
	// (the shard's sums of squares, which the sinks keep)
	"norm.go": 6,
	// 7: the pipeline
	"bucket.go": 7,
	// 8: the components the pipeline is handed or that sit beside it
	"offload.go": 8, "optim.go": 8, "params.go": 8, "coalesce.go": 8, "agree.go": 8,
	// 9: what reads and sets every component's state: checkpoints (their
	// manifest and its layout) and their exports to safetensors; and the
	// estimator, which plans as the hub builds
	"checkpoint.go": 9, "ckptlayout.go": 9, "estimate.go": 9,
	// 10: the hub; and a checkpoint written without an engine, which
	// commits as a save does
	"zero.go": 10, "ckptwrite.go": 10,
}

// componentFloor is the first floor whose files are components: their
// fields are read by their own file alone, whatever the floor of the
// reader.
const componentFloor = 6

// ownershipAllowed are the exceptions, each with its reason:
// "using file -> declaring file: name".
var ownershipAllowed = map[string]string{}

// clients are files that stand outside the engine and use it as a caller
// does: the exported API, errorf, and the schedule-check hook (the
// interface New asks a schedule through, and the warmup rule its notices
// share with ReadDeepSpeed's).
var clients = map[string]bool{"dsconfig.go": true, "schedule.go": true}

var clientPrivate = map[string]bool{"errorf": true, "scheduleChecker": true, "checkSchedule": true, "warmupOutlasts": true}

// A fileUse is one use, in file use, of a package-level name, a field or a
// method that file decl declares.
type fileUse struct {
	use, decl string
	obj       types.Object
	pos       token.Position
	owner     *types.Named // a field's struct type, if named at package level
}

// fieldOwners maps each field of the package's named struct types to its
// type.
func fieldOwners(pkg *types.Package) map[types.Object]*types.Named {
	owner := map[types.Object]*types.Named{}
	for _, name := range pkg.Scope().Names() {
		tn, ok := pkg.Scope().Lookup(name).(*types.TypeName)
		if !ok {
			continue
		}
		named, ok := tn.Type().(*types.Named)
		if !ok {
			continue
		}
		if st, ok := named.Underlying().(*types.Struct); ok {
			for f := range st.Fields() {
				owner[f] = named
			}
		}
	}
	return owner
}

// fileUses type-checks the package's files of the build with tags and
// returns every use of what one file declares in another.
func fileUses(t *testing.T, tags []string) []fileUse {
	t.Helper()
	fset, files := parsePackage(t, tags)
	for _, f := range files {
		name := filepath.Base(fset.Position(f.Pos()).Filename)
		if _, ok := floors[name]; !ok {
			t.Errorf("%s stands on no floor: add it to floors in ownership_test.go", name)
		}
	}
	info := &types.Info{Uses: map[*ast.Ident]types.Object{}}
	conf := types.Config{FakeImportC: true, Importer: importer.Default(), Error: func(error) {}}
	pkg, _ := conf.Check("zero", fset, files, info)
	owner := fieldOwners(pkg)
	var uses []fileUse
	for id, obj := range info.Uses {
		if obj == nil || obj.Pkg() != pkg {
			continue
		}
		switch o := obj.(type) {
		case *types.Var:
			obj = o.Origin()
			if !o.IsField() && o.Parent() != pkg.Scope() {
				continue // a local variable or parameter
			}
		case *types.Func:
			obj = o.Origin()
		default:
			if obj.Parent() != pkg.Scope() {
				continue // a local type or constant, a label
			}
		}
		pos := fset.Position(id.Pos())
		use, decl := filepath.Base(pos.Filename), filepath.Base(fset.Position(obj.Pos()).Filename)
		if use == decl || !strings.HasSuffix(decl, ".go") {
			continue
		}
		uses = append(uses, fileUse{use: use, decl: decl, obj: obj, pos: pos, owner: owner[obj]})
	}
	slices.SortFunc(uses, func(a, b fileUse) int {
		return cmp.Or(strings.Compare(a.pos.Filename, b.pos.Filename), a.pos.Line-b.pos.Line, a.pos.Column-b.pos.Column)
	})
	return uses
}

// ownershipProblem says what is wrong with a use, or "".
func ownershipProblem(u fileUse) string {
	uf, df := floors[u.use], floors[u.decl]
	name := u.obj.Name()
	v, isVar := u.obj.(*types.Var)
	field := isVar && v.IsField()
	switch {
	case clients[u.use] && !u.obj.Exported() && !clientPrivate[name]:
		return fmt.Sprintf("uses %s, private to %s: %s is a client of the exported API (errorf and the schedule-check hook aside)", name, u.decl, u.use)
	case df > uf:
		return fmt.Sprintf("uses %s of %s, which stands above it (floor %d over %d): move one of them", name, u.decl, df, uf)
	case field && !u.obj.Exported() && df >= componentFloor && isComponent(u.owner):
		return fmt.Sprintf("reads the private field %s.%s of %s, a component (floor %d): ask its owner through a method", u.owner.Obj().Name(), name, u.decl, df)
	}
	return ""
}

// isComponent reports whether a struct type is a component's: one with
// methods. A struct without methods is a plain record (a constructor's
// context, a landing's events), which its readers fill and read.
func isComponent(t *types.Named) bool {
	return t != nil && t.NumMethods() > 0
}

// TestOwnership holds the package to its floors (see floors), in the
// default build and with -tags cuda: every use, in one file, of a
// package-level name, field or method declared in another is checked; a
// use on the same floor or below passes, one that points up fails, and so
// do a component's private fields read from another file and a client's
// use of anything private, but for the allowed exceptions.
func TestOwnership(t *testing.T) {
	withoutRace(t)
	seen := map[string]bool{}
	checked := 0
	for _, tags := range [][]string{nil, {"cuda"}} {
		for _, u := range fileUses(t, tags) {
			checked++
			problem := ownershipProblem(u)
			if problem == "" {
				continue
			}
			key := fmt.Sprintf("%s -> %s: %s", u.use, u.decl, u.obj.Name())
			if _, ok := ownershipAllowed[key]; ok || seen[key] {
				seen[key] = true
				continue
			}
			seen[key] = true
			t.Errorf("%s:%d %s (or allow it in ownershipAllowed with a reason)", u.use, u.pos.Line, problem)
		}
	}
	if checked == 0 {
		t.Fatal("no use of one file's names in another: the check resolves nothing")
	}
	for key := range ownershipAllowed {
		if !seen[key] {
			t.Errorf("ownershipAllowed holds %q, which no file does any more: drop it", key)
		}
	}
}

// TestFileLoops: no two files use each other, directly or through others,
// in the default build or with -tags cuda. With -v it logs each file's
// height (1 + the highest height of the files it uses; 0 for a file that
// uses none), the floors as measured.
func TestFileLoops(t *testing.T) {
	withoutRace(t)
	for _, tags := range [][]string{nil, {"cuda"}} {
		graph := map[string]map[string]bool{}
		for _, u := range fileUses(t, tags) {
			if graph[u.use] == nil {
				graph[u.use] = map[string]bool{}
			}
			graph[u.use][u.decl] = true
		}
		height, loop := fileHeights(graph)
		if loop != nil {
			t.Errorf("tags %q: the files use each other in a loop: %s", tags, strings.Join(loop, " -> "))
			continue
		}
		byHeight := map[int][]string{}
		top := 0
		for f, h := range height {
			byHeight[h] = append(byHeight[h], f)
			top = max(top, h)
		}
		for h := 0; h <= top; h++ {
			slices.Sort(byHeight[h])
			t.Logf("tags %q height %2d: %s", tags, h, strings.Join(byHeight[h], " "))
		}
	}
}

// fileHeights gives each file of graph (file -> the files it uses) its
// height, or a loop it found.
func fileHeights(graph map[string]map[string]bool) (map[string]int, []string) {
	height := map[string]int{}
	onPath := map[string]int{} // index in path, for the files being visited
	var path, loop []string
	var visit func(f string) int
	visit = func(f string) int {
		if h, ok := height[f]; ok {
			return h
		}
		if i, ok := onPath[f]; ok {
			if loop == nil {
				loop = append(slices.Clone(path[i:]), f)
			}
			return 0
		}
		onPath[f] = len(path)
		path = append(path, f)
		h := 0
		for _, g := range slices.Sorted(maps.Keys(graph[f])) {
			h = max(h, visit(g)+1)
		}
		path = path[:len(path)-1]
		delete(onPath, f)
		height[f] = h
		return h
	}
	for _, f := range slices.Sorted(maps.Keys(graph)) {
		visit(f)
	}
	return height, loop
}
