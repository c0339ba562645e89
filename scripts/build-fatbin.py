#!/usr/bin/env python3
"""build-fatbin.py: compile csrc/kernels.cu ahead of time into zero_kernels.fatbin.

nvrtc (CUDA 12.0, from the nvidia-cuda-nvrtc-cu12 wheel) compiles the kernels
to SASS for sm_80 and sm_90 and to PTX for compute_90; nvFatbin (from the
nvidia-nvfatbin-cu12 wheel) packs the three into one fatbin, which the library
embeds and loads with cuModuleLoadData. CUDA 12.0's compiler makes PTX of ISA
8.0 and cubins that every driver since CUDA 12.0 loads (driver 525.60); newer
GPUs JIT the PTX. The CUDA 12 wheels on PyPI carry no nvcc binary, only the
compiler libraries, so this script drives them through ctypes.

  scripts/build-fatbin.py --lib DIR --lib DIR   # the folders of libnvrtc.so.12 and libnvfatbin.so.12
  scripts/build-fatbin.py --stamp-only       # print the stamp of the sources, build nothing

It writes zero_kernels.fatbin and zero_kernels.stamp at the repository root.
The stamp is a hash of the kernel sources, the nvrtc version and the flags;
`scripts/check-fatbin.sh` (run by CI) fails when the sources and the stamp
disagree.
"""
import argparse
import ctypes
import hashlib
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SOURCES = ["csrc/kernels.cu", "csrc/kernels_dev.cuh", "cuda_abi.h", "elementwise.h"]
# --fmad=false and IEEE division and denormals: the host kernels' arithmetic.
FLAGS = ["--std=c++17", "--fmad=false", "--prec-div=true", "--ftz=false", "--prec-sqrt=true",
         "-default-device", "-I" + os.path.join(ROOT, "csrc"), "-I" + ROOT]
TARGETS = [("sm_80", "cubin"), ("sm_90", "cubin"), ("compute_90", "ptx")]


def stamp(nvrtc_version):
    h = hashlib.sha256()
    for name in SOURCES:
        with open(os.path.join(ROOT, name), "rb") as f:
            h.update(name.encode() + b"\0" + f.read() + b"\0")
    flags = [f for f in FLAGS if not f.startswith("-I")]
    h.update(("nvrtc %s\0%s\0%s\0-compress-all" % (nvrtc_version, " ".join(flags), TARGETS)).encode())
    return h.hexdigest()


def compile_one(nvrtc, src, arch, kind):
    prog = ctypes.c_void_p()
    check(nvrtc, nvrtc.nvrtcCreateProgram(ctypes.byref(prog), src, b"kernels.cu", 0, None, None), "create")
    opts = [o.encode() for o in FLAGS + ["--gpu-architecture=" + arch]]
    arr = (ctypes.c_char_p * len(opts))(*opts)
    rc = nvrtc.nvrtcCompileProgram(prog, len(opts), arr)
    logn = ctypes.c_size_t()
    nvrtc.nvrtcGetProgramLogSize(prog, ctypes.byref(logn))
    log = ctypes.create_string_buffer(logn.value)
    nvrtc.nvrtcGetProgramLog(prog, log)
    if rc != 0:
        sys.exit("nvrtc %s: %s\n%s" % (arch, nvrtc.nvrtcGetErrorString(rc).decode(), log.value.decode()))
    if log.value.strip():
        print(log.value.decode(), file=sys.stderr)
    size = ctypes.c_size_t()
    if kind == "cubin":
        check(nvrtc, nvrtc.nvrtcGetCUBINSize(prog, ctypes.byref(size)), "cubin size")
        out = ctypes.create_string_buffer(size.value)
        check(nvrtc, nvrtc.nvrtcGetCUBIN(prog, out), "cubin")
    else:
        check(nvrtc, nvrtc.nvrtcGetPTXSize(prog, ctypes.byref(size)), "ptx size")
        out = ctypes.create_string_buffer(size.value)
        check(nvrtc, nvrtc.nvrtcGetPTX(prog, out), "ptx")
    nvrtc.nvrtcDestroyProgram(ctypes.byref(prog))
    return out.raw


def check(nvrtc, rc, what):
    if rc != 0:
        sys.exit("nvrtc %s: %s" % (what, nvrtc.nvrtcGetErrorString(rc).decode()))


def find(dirs, name):
    for d in dirs:
        if os.path.exists(os.path.join(d, name)):
            return os.path.join(d, name)
    sys.exit("build-fatbin: %s is in none of %s; run scripts/install-cuda.sh" % (name, dirs))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lib", action="append", default=[], help="a folder holding libnvrtc.so.12 or libnvfatbin.so.12")
    ap.add_argument("--stamp-only", action="store_true")
    ap.add_argument("--nvrtc-version", default="", help="with --stamp-only: the version to stamp")
    args = ap.parse_args()
    if args.stamp_only:
        print(stamp(args.nvrtc_version))
        return
    nvrtc = ctypes.CDLL(find(args.lib, "libnvrtc.so.12"))
    nvrtc.nvrtcGetErrorString.restype = ctypes.c_char_p
    major, minor = ctypes.c_int(), ctypes.c_int()
    nvrtc.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor))
    version = "%d.%d" % (major.value, minor.value)
    fb = ctypes.CDLL(find(args.lib, "libnvfatbin.so.12"))
    with open(os.path.join(ROOT, "csrc/kernels.cu"), "rb") as f:
        src = f.read()
    handle = ctypes.c_void_p()
    fbopts = (ctypes.c_char_p * 1)(b"-compress-all")  # every CUDA 12 driver reads compressed fatbins
    if fb.nvFatbinCreate(ctypes.byref(handle), fbopts, 1) != 0:
        sys.exit("nvFatbinCreate failed")
    for arch, kind in TARGETS:
        img = compile_one(nvrtc, src, arch, kind)
        num = arch.split("_")[1].encode()
        if kind == "cubin":
            rc = fb.nvFatbinAddCubin(handle, img, ctypes.c_size_t(len(img)), num, b"kernels")
        else:
            rc = fb.nvFatbinAddPTX(handle, img, ctypes.c_size_t(len(img)), num, b"kernels", None)
        if rc != 0:
            sys.exit("nvFatbin: adding %s failed (%d)" % (arch, rc))
        print("build-fatbin: %s %s, %d bytes" % (arch, kind, len(img)))
    size = ctypes.c_size_t()
    fb.nvFatbinSize(handle, ctypes.byref(size))
    out = ctypes.create_string_buffer(size.value)
    if fb.nvFatbinGet(handle, out) != 0:
        sys.exit("nvFatbinGet failed")
    fb.nvFatbinDestroy(ctypes.byref(handle))
    with open(os.path.join(ROOT, "zero_kernels.fatbin"), "wb") as f:
        f.write(out.raw)
    with open(os.path.join(ROOT, "zero_kernels.stamp"), "w") as f:
        f.write("nvrtc %s\n%s\n" % (version, stamp(version)))
    print("build-fatbin: zero_kernels.fatbin, %d bytes (nvrtc %s)" % (size.value, version))


if __name__ == "__main__":
    main()
