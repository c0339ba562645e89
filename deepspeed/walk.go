package deepspeed

import (
	"math"

	"github.com/nlpodyssey/gopickle/types"
)

// Reading the unpickled values along the paths a checkpoint defines. The
// values may share or even contain themselves (a pickle's memo makes
// graphs), so nothing here walks a value generically except toJSON,
// which has a budget.

// kv is one entry of a dict with string keys.
type kv struct {
	key string
	val any
}

// entries are a dict's or an OrderedDict's entries, in order; ok is false
// for any other value or a key that is not a string.
func entries(v any) ([]kv, bool) {
	switch d := v.(type) {
	case *types.Dict:
		out := make([]kv, 0, d.Len())
		for _, e := range *d {
			k, ok := e.Key.(string)
			if !ok {
				return nil, false
			}
			out = append(out, kv{k, e.Value})
		}
		return out, true
	case *types.OrderedDict:
		out := make([]kv, 0, d.Len())
		for el := d.List.Front(); el != nil; el = el.Next() {
			e := el.Value.(*types.OrderedDictEntry)
			k, ok := e.Key.(string)
			if !ok {
				return nil, false
			}
			out = append(out, kv{k, e.Value})
		}
		return out, true
	}
	return nil, false
}

// field is d[key] of a dict or an OrderedDict with string keys; the last
// entry wins, as in Python.
func field(d any, key string) (any, bool) {
	switch d := d.(type) {
	case *types.Dict:
		var v any
		found := false
		for _, e := range *d {
			if k, ok := e.Key.(string); ok && k == key {
				v, found = e.Value, true
			}
		}
		return v, found
	case *types.OrderedDict:
		return d.Get(key)
	case *pyObject:
		v, ok := d.attrs[key]
		return v, ok
	}
	return nil, false
}

// intKeyed are a dict's entries keyed by int (torch's optimizer state).
func intKeyed(v any) (map[int]any, bool) {
	d, ok := v.(*types.Dict)
	if !ok {
		return nil, false
	}
	out := make(map[int]any, d.Len())
	for _, e := range *d {
		k, ok := e.Key.(int)
		if !ok {
			return nil, false
		}
		out[k] = e.Value
	}
	return out, true
}

// list is a list's or a tuple's items.
func list(v any) ([]any, bool) {
	switch l := v.(type) {
	case *types.List:
		return *l, true
	case *types.Tuple:
		return *l, true
	}
	return nil, false
}

// number reads an int or a float as a float64.
func number(v any) (float64, bool) {
	switch x := v.(type) {
	case int:
		return float64(x), true
	case float64:
		return x, true
	}
	return 0, false
}

// toJSON turns a pickled plain value (dicts with string keys, lists,
// tuples, strings, numbers, booleans, None) into one encoding/json
// writes; budget bounds the nodes visited, since shared references could
// make a small pickle a huge tree.
func toJSON(v any, budget *int) (any, bool) {
	if *budget--; *budget < 0 {
		return nil, false
	}
	switch x := v.(type) {
	case nil, string, bool, int:
		return x, true
	case float64:
		if math.IsInf(x, 0) || math.IsNaN(x) {
			return nil, false
		}
		return x, true
	case *types.Dict, *types.OrderedDict:
		es, ok := entries(x)
		if !ok {
			return nil, false
		}
		m := make(map[string]any, len(es))
		for _, e := range es {
			if m[e.key], ok = toJSON(e.val, budget); !ok {
				return nil, false
			}
		}
		return m, true
	case *types.List, *types.Tuple:
		items, _ := list(x)
		out := make([]any, len(items))
		for i, it := range items {
			var ok bool
			if out[i], ok = toJSON(it, budget); !ok {
				return nil, false
			}
		}
		return out, true
	}
	return nil, false
}
