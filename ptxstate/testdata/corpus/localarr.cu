// A per-thread local array indexed dynamically (a .local depot in PTX).
extern "C" __global__ void local_sort8(const int *in, int *out, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i * 8 + 7 >= n) return;
  int v[8];
  for (int k = 0; k < 8; k++) v[k] = in[i * 8 + k];
  for (int a = 1; a < 8; a++) {
    int x = v[a], b = a - 1;
    while (b >= 0 && v[b] > x) { v[b + 1] = v[b]; b--; }
    v[b + 1] = x;
  }
  for (int k = 0; k < 8; k++) out[i * 8 + k] = v[k] * (k + 1);
}
