// Cooperative-groups grid synchronisation: every block must be co-resident, so the persistent
// transform must refuse this kernel.
#include <cooperative_groups.h>
namespace cg = cooperative_groups;

extern "C" __global__ void two_phase(const float *in, float *tmp, float *out, int n) {
  cg::grid_group g = cg::this_grid();
  int i = g.thread_rank();
  if (i < n) tmp[i] = in[i] * 2.0f;
  g.sync();
  if (i < n) out[i] = tmp[i] + tmp[(i + 1) % n];
}
