// Minimal JSON: an append-only output buffer, and strict parsers for the flat request objects of
// the control protocol and for ptxstate's kernel report. Depends on nothing else in the shim.
#ifndef PTXMIG_JSON_H
#define PTXMIG_JSON_H
#include <stddef.h>

// The output buffer: grows as needed; on allocation failure it stops growing and sets oom.
typedef struct jbuf {
  char *p;
  size_t len, cap;
  int oom;
} jbuf;
void jb_raw(jbuf *b, const char *s, size_t n);
void jb_s(jbuf *b, const char *s);  // raw text
void jb_printf(jbuf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
void jb_str(jbuf *b, const char *s, size_t n);  // quoted, escaped JSON string
void jb_key(jbuf *b, const char *k);            // "k":

// json_flat_parse parses a flat JSON object and copies the string member of each of keys into
// vals; returns 1 if found, 0 if absent, -1 when the text is not a valid flat JSON object (error
// text in err). A key spelled "#name" takes a number (its text is returned).
int json_flat_parse(const char *text, size_t n, const char *const *keys, char **vals, size_t nkeys,
                    char *err, size_t errlen);
// json_kernel_report walks ptxstate's report ({"kernels":[{"name","eligible","refusals"},...]}) and
// calls cb per kernel (refusal: the first one, or NULL); 0, or -1 when the text is not such a report.
typedef void (*json_kernel_fn)(void *arg, const char *name, int eligible, const char *refusal);
int json_kernel_report(const char *text, size_t n, json_kernel_fn cb, void *arg);

#endif
