#!/usr/bin/env python3
"""Python's safetensors against zero's, for TestSafetensorsPython.

  safetensors_check.py read FILE    prints FILE as Python's safetensors reads it
                                    (numpy API): metadata, and per tensor its
                                    dtype, shape and bytes (hex), as JSON
  safetensors_check.py write FILE   writes the tensors of pyModel in
                                    safetensors_test.go (F32, F16, BF16, a
                                    scalar, an empty one) with its values

Needs safetensors and numpy (scripts/install-safetensors.sh; PYTHONPATH).
"""
import json
import sys

import numpy as np
from safetensors import TensorSpec, safe_open, serialize_file
from safetensors.numpy import load_file

# name, dtype, shape, modulus, scale: element i of tensor t is
# (((i*2654435761 + t*40503 + 12345) mod 2^32) mod m - m//2) / scale,
# exact in the tensor's dtype.
MODEL = [
    ("embed.weight", "float32", [3, 5], 20001, 4096),
    ("norm.weight", "float16", [7], 2001, 512),
    ("head.weight", "bfloat16", [2, 4], 201, 32),
    ("scalar", "float32", [], 20001, 4096),
    ("empty", "float32", [0], 20001, 4096),
]


def values(t):
    _, _, shape, mod, scale = MODEL[t]
    n = int(np.prod(shape, dtype=np.int64))
    i = np.arange(n, dtype=np.uint64)
    v = (i * np.uint64(2654435761) + np.uint64(t * 40503 + 12345)) % np.uint64(1 << 32)
    k = (v % np.uint64(mod)).astype(np.int64) - mod // 2
    return k.astype(np.float32) / np.float32(scale)


def write(path):
    keep, specs = [], {}
    for t, (name, dtype, shape, _, _) in enumerate(MODEL):
        x = values(t)
        if dtype == "float16":
            x = x.astype("<f2")
        elif dtype == "bfloat16":  # numpy has no bf16: its bits, exact here
            x = (x.astype("<f4").view("<u4") >> np.uint32(16)).astype("<u2")
        x = np.ascontiguousarray(x.reshape(shape))
        keep.append(x)
        specs[name] = TensorSpec(dtype=dtype, shape=list(shape), data_ptr=x.ctypes.data, data_len=x.nbytes)
    # one metadata key: the reader keeps them in a hash map, in no fixed order
    serialize_file(specs, path, metadata={"format": "pt"})


def read(path):
    with safe_open(path, framework="np") as f:
        meta = f.metadata()
    out = {"metadata": meta, "tensors": {}}
    for name, x in load_file(path).items():
        le = x.astype(x.dtype.newbyteorder("<"), copy=False)
        out["tensors"][name] = {"dtype": str(x.dtype), "shape": list(x.shape), "hex": le.tobytes().hex()}
    json.dump(out, sys.stdout)


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] not in ("read", "write"):
        sys.exit(__doc__)
    {"read": read, "write": write}[sys.argv[1]](sys.argv[2])
