// Kernels whose loops run a different number of iterations in each thread, with no barrier and no
// warp collective anywhere (ptxmig ptx instrument --mid-block: thread-loop sites, where each
// thread stops by itself), and clock readings live across the loop (rebased at a stop). Results
// are exact functions of the inputs: a replayed or skipped stretch changes them.

// CuPy's spin-and-count kernel (testdata/workloads/frameworks.py): spin on the SM clock, then a
// per-thread atomic add that depends on the index and the step.
extern "C" __global__ void spin_count(unsigned long long *out, unsigned long long spin, unsigned int step) {
    unsigned long long t0 = clock64();
    while (spin && (unsigned long long)(clock64() - t0) < spin) { }
    unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
    atomicAdd(&out[i], (unsigned long long)(i % 97 + step));
}

// A deadline on the global timer, with work counted while waiting: the count depends on timing,
// so only the sum of out over a per-thread mask is exact (mask[i] = 1 when thread i got past
// the deadline, which it must).
extern "C" __global__ void timer_deadline(unsigned *passed, unsigned long long ns) {
    unsigned long long deadline = 0;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(deadline));
    deadline += ns;
    unsigned long long now;
    do {
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    } while (now < deadline);
    passed[blockIdx.x * blockDim.x + threadIdx.x] = 1u;
}

// Collatz trajectories repeated `reps` times (a uniform outer loop around a per-thread inner
// loop), with a non-idempotent histogram of the values met and the thread's own running sum in
// shared memory (no barrier: each thread touches only its own word); threads past n leave first.
extern "C" __global__ void collatz_hist(const unsigned *start, unsigned long long *steps, unsigned *hist, int n, int reps) {
    __shared__ unsigned long long mine[256];
    unsigned t = threadIdx.x;
    unsigned gid = blockIdx.x * blockDim.x + t;
    if (gid >= (unsigned)n) return;
    mine[t] = 0;
    for (int r = 0; r < reps; r++) {
        unsigned long long x = start[gid] + (unsigned)r;
        unsigned k = 0;
        while (x > 1) {
            x = (x & 1) ? 3 * x + 1 : x >> 1;
            k++;
            if ((k & 15) == 0) atomicAdd(&hist[x & 255], 1u);
        }
        mine[t] += k;
    }
    steps[gid] = mine[t];
}
