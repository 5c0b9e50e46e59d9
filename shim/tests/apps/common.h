// Shared by the shim's test apps: a valid PTX module (assembled by ptxas in the tests after a
// dump) and the wait-for-the-harness protocol: print "ready", block until stdin closes.
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

static const char test_ptx[] =
    ".version 7.0\n"
    ".target sm_70\n"
    ".address_size 64\n"
    "\n"
    ".visible .entry k_test(\n"
    "\t.param .u64 k_test_param_0,\n"
    "\t.param .u32 k_test_param_1\n"
    ")\n"
    "{\n"
    "\t.reg .pred %p<2>;\n"
    "\t.reg .b32 %r<6>;\n"
    "\t.reg .b64 %rd<5>;\n"
    "\tld.param.u64 %rd1, [k_test_param_0];\n"
    "\tld.param.u32 %r2, [k_test_param_1];\n"
    "\tmov.u32 %r3, %ctaid.x;\n"
    "\tmov.u32 %r4, %ntid.x;\n"
    "\tmov.u32 %r5, %tid.x;\n"
    "\tmad.lo.s32 %r1, %r3, %r4, %r5;\n"
    "\tsetp.ge.s32 %p1, %r1, %r2;\n"
    "\t@%p1 bra $L__BB0_2;\n"
    "\tcvta.to.global.u64 %rd2, %rd1;\n"
    "\tmul.wide.s32 %rd3, %r1, 4;\n"
    "\tadd.s64 %rd4, %rd2, %rd3;\n"
    "\tst.global.u32 [%rd4], %r1;\n"
    "$L__BB0_2:\n"
    "\tret;\n"
    "}\n";

#define CK(x)                                                           \
  do {                                                                  \
    int r_ = (x);                                                       \
    if (r_) {                                                           \
      fprintf(stderr, "%s:%d: %s failed: %d\n", __FILE__, __LINE__, #x, r_); \
      exit(2);                                                          \
    }                                                                   \
  } while (0)

__attribute__((unused)) static void wait_harness(void) {
  printf("ready\n");
  fflush(stdout);
  char buf[64];
  while (read(0, buf, sizeof buf) > 0) {
  }
}
