#!/usr/bin/env bash
# probe-jit.sh OUT — how CuPy and Numba reach the GPU with JIT-compiled kernels (issue 33), on a GPU
# host, from a GPU bundle:
#   A: which NVRTC / nvJitLink / linker symbols each framework looks up (dlsymlog.so, no shim),
#      and which libraries its extension modules link;
#   B: does NVRTC give the PTX of a program compiled for a real architecture (sm_XX)?
#   C: the shim's own account (PTXMIG_DEBUG=1) of the modules each framework loads;
#   D: CuPy with CUPY_COMPILE_WITH_PTX=1: a checkpoint --leave-running one second into a 3 s-a-block
#      kernel, with the shim's log (on 2026-11-29 it ran on both times, alone on the GPU; the
#      process lost on 2026-11-28 shared the GPU with a reference run's long kernels);
#   E: CuPy's and Numba's kernels compiled under the shim (twins from the compiler's PTX): where
#      the stop of a long many-block twin goes (default, 32 hardware queues, one-block claims);
#   F: the wall time of such a launch as the original and as the twin, without a checkpoint.
# Everything goes to OUT/summary.txt. Needs PTXMIG_BIN, PTXMIG_WORKLOADS as gpu-e2e.sh sets.
set -u
out=${1:?usage: probe-jit.sh OUT}
here=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$out"
sum=$out/summary.txt
fw=$PTXMIG_WORKLOADS/frameworks.py
export CUDA_VISIBLE_DEVICES=0
gcc -O2 -shared -fPIC -o "$out/dlsymlog.so" "$here/dlsymlog.c" -ldl || exit 1
parts=${PROBE_PARTS:-ABCDEF}

if [[ $parts == *A* ]]; then
  echo "== A: symbol lookups" >>"$sum"
  for f in cupy numba; do
    rm -f "$out/A-$f.syms"
    DLSYMLOG=$out/A-$f.syms LD_PRELOAD=$out/dlsymlog.so timeout 120 python3 "$fw" "$f" --steps 2 >"$out/A-$f.log" 2>&1
    echo "-- $f (exit $?): $(tail -n 2 "$out/A-$f.log" | tr '\n' ' ')" >>"$sum"
    grep -E 'nvJitLink|cuLink|cuLibrary|cuModule|nvrtcGetCUBIN|nvrtcGetPTX' "$out/A-$f.syms" 2>/dev/null | sort | uniq -c >>"$sum"
  done
  python3 - >>"$sum" 2>&1 <<'PY'
import importlib, subprocess
for m in ("cupy_backends.cuda.libs.nvrtc", "cupy_backends.cuda.api.driver", "cupy.cuda.function"):
    try:
        f = importlib.import_module(m).__file__
        libs = [l.split()[0] for l in subprocess.run(["ldd", f], capture_output=True, text=True).stdout.splitlines() if "nv" in l or "cuda" in l]
        print("ldd", m, f, libs)
    except Exception as e:
        print("ldd", m, "error", e)
for m in ("numba_cuda", "cuda.bindings", "cuda.core", "cupy", "numba"):
    try:
        mod = importlib.import_module(m)
        print(m, getattr(mod, "__version__", "?"))
    except Exception as e:
        print(m, "error", e)
try:
    import numpy as np
    if not hasattr(np, "row_stack"): np.row_stack = np.vstack
    from numba.cuda import config
    print("numba config", {k: getattr(config, k) for k in dir(config) if "LINK" in k or "NVJIT" in k})
except Exception as e:
    print("numba config error", e)
PY
fi

if [[ $parts == *B* ]]; then
  echo "== B: NVRTC for sm_XX: PTX too?" >>"$sum"
  python3 - >>"$sum" 2>&1 <<'PY'
import ctypes, cupy as cp
k = cp.RawKernel('extern "C" __global__ void k(int *p){ p[threadIdx.x] += 1; }', "k")
k.compile()
libs = sorted({l.split()[-1] for l in open("/proc/self/maps") if "libnvrtc" in l and ".so" in l})
print("nvrtc libraries mapped:", libs)
for path in libs:
    if "builtins" in path: continue
    n = ctypes.CDLL(path)
    prog = ctypes.c_void_p()
    src = b'extern "C" __global__ void k(int *p){ p[threadIdx.x] += 1; }'
    print(path, "create", n.nvrtcCreateProgram(ctypes.byref(prog), src, b"k.cu", 0, None, None))
    for arch in (b"--gpu-architecture=sm_90", b"--gpu-architecture=compute_90"):
        p2 = ctypes.c_void_p()
        n.nvrtcCreateProgram(ctypes.byref(p2), src, b"k.cu", 0, None, None)
        opts = (ctypes.c_char_p * 1)(arch)
        rc = n.nvrtcCompileProgram(p2, 1, opts)
        ps, cs = ctypes.c_size_t(), ctypes.c_size_t()
        rp = n.nvrtcGetPTXSize(p2, ctypes.byref(ps))
        rcb = n.nvrtcGetCUBINSize(p2, ctypes.byref(cs))
        ptx = b""
        if rp == 0 and ps.value:
            buf = ctypes.create_string_buffer(ps.value)
            n.nvrtcGetPTX(p2, buf)
            ptx = buf.value
        print(arch.decode(), "compile", rc, "ptxsize rc", rp, ps.value, "cubinsize rc", rcb, cs.value,
              "ptx head", ptx[:120].replace(b"\n", b" | "))
PY
fi

if [[ $parts == *C* ]]; then
  echo "== C: the shim's account (PTXMIG_DEBUG=1)" >>"$sum"
  for f in cupy numba; do
    PTXMIG_DEBUG=1 timeout 180 "$PTXMIG_BIN" run --socket-dir "$out/sock" -- python3 "$fw" "$f" --steps 2 >"$out/C-$f.log" 2>&1
    echo "-- $f (exit $?)" >>"$sum"
    grep -vE 'trace: (dlsym|resolve)' "$out/C-$f.log" | grep -iE 'jit|link|modul|ptx|twin|instr|librar|step' | head -n 60 >>"$sum"
  done
fi

# longrun LABEL FW [VAR=VALUE...]: FW's 3 s-a-block loop (many blocks) under `ptxmig run` with
# PTXMIG_DEBUG=1 and a kernel cache of its own (compiled under the shim), a checkpoint
# --leave-running one second into its second launch; the checkpoint's timings, the shim's lines
# about twins and JIT compilers, and whether the process ran on to the end.
longrun() {
  local label=$1 fw=$2; shift 2
  local log=$out/$label.log
  echo "-- $label ($fw $*)" >>"$sum"
  env "$@" CUPY_CACHE_DIR="$out/cupy-$label" PTXMIG_DEBUG=1 setsid "$PTXMIG_BIN" run --socket-dir "$out/sock" -- \
    python3 "$PTXMIG_WORKLOADS/frameworks.py" "$fw" --steps 3 --sleep-ms 0 --long-ms 3000 >"$log" 2>&1 </dev/null &
  local pid=$!
  for _ in $(seq 1200); do grep -q '^step 1 ' "$log" && break; sleep 0.1; done
  sleep 1
  "$PTXMIG_BIN" --store "$out/store" checkpoint --leave-running --lock-timeout 20s --name "probe-$label" "$pid" >"$out/$label-ck.txt" 2>&1
  echo "checkpoint exit $?: $(grep -E '^  (quiesce|lock) ' "$out/$label-ck.txt" | tr -s ' ' | tr '\n' ';') $(grep -E 'still stopping|quiesced in' "$out/$label-ck.txt" | tr '\n' ' ')" >>"$sum"
  for _ in $(seq 900); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
  wait "$pid"
  local rc=$?
  { echo "process exit $rc; last: $(grep -E '^(step|final)' "$log" | tail -n 1)"
    grep -E 'jit:|twin of|ended after|no PTX|Traceback|Error|error' "$log" | grep -v 'trace: ' | head -n 12
    dmesg 2>/dev/null | grep -iE 'xid' | tail -n 3; } >>"$sum"
}
if [[ $parts == *E* ]]; then
  echo "== E: where a JIT twin's stop goes" >>"$sum"
  longrun E-cupy cupy
  longrun E-cupy-conn32 cupy CUDA_DEVICE_MAX_CONNECTIONS=32
  longrun E-cupy-batch1 cupy PTXMIG_PREEMPT_BATCH_MAX=1
  longrun E-numba numba
fi

if [[ $parts == *F* ]]; then
  echo "== F: a long many-block launch's time: original, twin (no checkpoint)" >>"$sum"
  for mode in none off auto; do
    log=$out/F-$mode.log
    if [ $mode = none ]; then
      FW_TIMES=1 CUPY_CACHE_DIR=$out/cupy-F-$mode python3 "$PTXMIG_WORKLOADS/frameworks.py" cupy --steps 2 --sleep-ms 0 --long-ms 3000 >"$log" 2>&1
    else
      FW_TIMES=1 CUPY_CACHE_DIR=$out/cupy-F-$mode PTXMIG_DEBUG=1 "$PTXMIG_BIN" run --preempt $mode --socket-dir "$out/sock" -- \
        python3 "$PTXMIG_WORKLOADS/frameworks.py" cupy --steps 2 --sleep-ms 0 --long-ms 3000 >"$log" 2>&1
    fi
    echo "-- cupy, shim $mode: $(grep -E '^time step' "$log" | tr '\n' ' ') $(grep -E 'twin of' "$log" | tr '\n' ' ')" >>"$sum"
  done
fi

if [[ $parts == *D* ]]; then
  echo "== D: CuPy with CUPY_COMPILE_WITH_PTX=1, checkpoint in a 3 s-a-block kernel" >>"$sum"
  log=$out/D.log
  CUPY_COMPILE_WITH_PTX=1 PTXMIG_DEBUG=1 setsid "$PTXMIG_BIN" run --socket-dir "$out/sock" -- \
    python3 "$fw" cupy --steps 4 --sleep-ms 0 --long-ms 3000 >"$log" 2>&1 </dev/null &
  pid=$!
  for _ in $(seq 900); do grep -q '^step 1 ' "$log" && break; sleep 0.1; done
  sleep 1
  "$PTXMIG_BIN" --store "$out/store" --log-level debug checkpoint --leave-running --lock-timeout 10s --name probe-jit-d "$pid" >"$out/D-ck.txt" 2>&1
  echo "checkpoint exit $?:" >>"$sum"; tail -n 30 "$out/D-ck.txt" >>"$sum"
  for _ in $(seq 600); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
  wait "$pid"
  rc=$?
  { echo "process exit $rc (alive: $(kill -0 "$pid" 2>/dev/null && echo yes || echo no))"
    grep -vE 'trace: dlsym\(.*not hooked|trace: (cuGetProcAddress|getproc)' "$log" | tail -n 80
    echo "-- dmesg"; dmesg 2>/dev/null | grep -iE 'nvrm|xid|segfault|trap' | tail -n 10; } >>"$sum"
fi
