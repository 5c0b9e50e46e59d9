// Minimal JSON: an append-only writer and a strict parser for the flat request objects of the
// control protocol ({"cmd":"...","dir":"..."}). Anything else is rejected with a reason.
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "json.h"

static int jb_grow(jbuf *b, size_t need) {
  if (b->oom) return -1;
  if (b->len + need + 1 <= b->cap) return 0;
  size_t nc = b->cap ? b->cap : 1024;
  while (nc < b->len + need + 1) nc *= 2;
  char *np = realloc(b->p, nc);
  if (!np) {
    b->oom = 1;
    return -1;
  }
  b->p = np;
  b->cap = nc;
  return 0;
}

void jb_raw(jbuf *b, const char *s, size_t n) {
  if (jb_grow(b, n)) return;
  memcpy(b->p + b->len, s, n);
  b->len += n;
  b->p[b->len] = 0;
}

void jb_s(jbuf *b, const char *s) { jb_raw(b, s, strlen(s)); }

void jb_printf(jbuf *b, const char *fmt, ...) {
  char tmp[512];
  va_list ap;
  va_start(ap, fmt);
  int n = vsnprintf(tmp, sizeof tmp, fmt, ap);
  va_end(ap);
  if (n < 0) return;
  if ((size_t)n < sizeof tmp) {
    jb_raw(b, tmp, (size_t)n);
    return;
  }
  if (jb_grow(b, (size_t)n)) return;
  va_start(ap, fmt);
  vsnprintf(b->p + b->len, (size_t)n + 1, fmt, ap);
  va_end(ap);
  b->len += (size_t)n;
}

void jb_str(jbuf *b, const char *s, size_t n) {
  jb_raw(b, "\"", 1);
  for (size_t i = 0; i < n; i++) {
    unsigned char c = (unsigned char)s[i];
    if (c == '"' || c == '\\') {
      char e[2] = {'\\', (char)c};
      jb_raw(b, e, 2);
    } else if (c < 0x20 || c == 0x7f) {
      jb_printf(b, "\\u%04x", c);
    } else if (c >= 0x80) {
      // Pass valid UTF-8 through; escape stray bytes as U+FFFD so the output stays valid JSON.
      size_t len = (c & 0xe0) == 0xc0 ? 2 : (c & 0xf0) == 0xe0 ? 3 : (c & 0xf8) == 0xf0 ? 4 : 0;
      int ok = len && i + len <= n;
      for (size_t k = 1; ok && k < len; k++) ok = ((unsigned char)s[i + k] & 0xc0) == 0x80;
      if (ok) {
        jb_raw(b, s + i, len);
        i += len - 1;
      } else {
        jb_s(b, "\\ufffd");
      }
    } else {
      jb_raw(b, (const char *)&s[i], 1);
    }
  }
  jb_raw(b, "\"", 1);
}

void jb_key(jbuf *b, const char *k) {
  jb_raw(b, ",", 1);
  jb_str(b, k, strlen(k));
  jb_raw(b, ":", 1);
}

// ---- parser ----
typedef struct {
  const char *s;
  size_t n, i;
} lex;

static void ws(lex *l) {
  while (l->i < l->n && (l->s[l->i] == ' ' || l->s[l->i] == '\t' || l->s[l->i] == '\r' || l->s[l->i] == '\n')) l->i++;
}

static int hexval(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

// str parses a JSON string at l->i into a fresh buffer (NUL-terminated); NULs inside are refused.
static char *str(lex *l, const char **why) {
  if (l->i >= l->n || l->s[l->i] != '"') {
    *why = "expected a string";
    return NULL;
  }
  l->i++;
  char *out = malloc(l->n + 1);
  size_t o = 0;
  if (!out) {
    *why = "out of memory";
    return NULL;
  }
  while (l->i < l->n) {
    unsigned char c = (unsigned char)l->s[l->i++];
    if (c == '"') {
      out[o] = 0;
      return out;
    }
    if (c < 0x20) break;
    if (c != '\\') {
      out[o++] = (char)c;
      continue;
    }
    if (l->i >= l->n) break;
    char e = l->s[l->i++];
    switch (e) {
    case '"': case '\\': case '/': out[o++] = e; break;
    case 'b': out[o++] = '\b'; break;
    case 'f': out[o++] = '\f'; break;
    case 'n': out[o++] = '\n'; break;
    case 'r': out[o++] = '\r'; break;
    case 't': out[o++] = '\t'; break;
    case 'u': {
      if (l->n - l->i < 4) goto bad;
      int v = 0;
      for (int k = 0; k < 4; k++) {
        int h = hexval(l->s[l->i + (size_t)k]);
        if (h < 0) goto bad;
        v = v << 4 | h;
      }
      l->i += 4;
      if (v == 0 || (v >= 0xd800 && v <= 0xdfff)) goto bad;  // no NULs, no surrogates
      if (v < 0x80) out[o++] = (char)v;
      else if (v < 0x800) { out[o++] = (char)(0xc0 | v >> 6); out[o++] = (char)(0x80 | (v & 0x3f)); }
      else { out[o++] = (char)(0xe0 | v >> 12); out[o++] = (char)(0x80 | ((v >> 6) & 0x3f)); out[o++] = (char)(0x80 | (v & 0x3f)); }
      break;
    }
    default: goto bad;
    }
  }
bad:
  free(out);
  *why = "invalid string";
  return NULL;
}

// skip_scalar accepts a number, true, false or null.
static int skip_scalar(lex *l) {
  static const char *const words[] = {"true", "false", "null"};
  for (int k = 0; k < 3; k++) {
    size_t wl = strlen(words[k]);
    if (l->n - l->i >= wl && memcmp(l->s + l->i, words[k], wl) == 0) {
      l->i += wl;
      return 0;
    }
  }
  size_t st = l->i;
  if (l->i < l->n && l->s[l->i] == '-') l->i++;
  while (l->i < l->n && ((l->s[l->i] >= '0' && l->s[l->i] <= '9') || l->s[l->i] == '.' || l->s[l->i] == 'e' ||
                         l->s[l->i] == 'E' || l->s[l->i] == '+' || l->s[l->i] == '-'))
    l->i++;
  return l->i > st && (l->s[st] != '-' || l->i > st + 1) ? 0 : -1;
}

int json_flat_parse(const char *text, size_t n, const char *const *keys, char **vals, size_t nkeys, char *err,
                    size_t errlen) {
  lex l = {text, n, 0};
  const char *why = NULL;
  for (size_t k = 0; k < nkeys; k++) vals[k] = NULL;
  ws(&l);
  if (l.i >= l.n || l.s[l.i] != '{') {
    why = "request is not a JSON object";
    goto fail;
  }
  l.i++;
  ws(&l);
  if (l.i < l.n && l.s[l.i] == '}') {
    l.i++;
    goto end;
  }
  for (;;) {
    ws(&l);
    char *key = str(&l, &why);
    if (!key) goto fail;
    ws(&l);
    if (l.i >= l.n || l.s[l.i] != ':') {
      free(key);
      why = "expected ':'";
      goto fail;
    }
    l.i++;
    ws(&l);
    size_t slot = nkeys;
    int numeric = 0;  // a key spelled "#name" takes a number, returned as its text
    for (size_t k = 0; k < nkeys; k++) {
      const char *kk = keys[k][0] == '#' ? keys[k] + 1 : keys[k];
      if (strcmp(kk, key) == 0) {
        slot = k;
        numeric = keys[k][0] == '#';
      }
    }
    free(key);
    if (numeric && l.i < l.n && (l.s[l.i] == '-' || (l.s[l.i] >= '0' && l.s[l.i] <= '9'))) {
      size_t st = l.i;
      if (skip_scalar(&l)) {
        why = "invalid number";
        goto fail;
      }
      if (vals[slot]) {
        why = "duplicate member";
        goto fail;
      }
      if (!(vals[slot] = strndup(l.s + st, l.i - st))) {
        why = "out of memory";
        goto fail;
      }
    } else if (numeric) {
      why = "member must be a number";
      goto fail;
    } else if (l.i < l.n && l.s[l.i] == '"') {
      char *v = str(&l, &why);
      if (!v) goto fail;
      if (slot < nkeys) {
        if (vals[slot]) {
          free(v);
          why = "duplicate member";
          goto fail;
        }
        vals[slot] = v;
      } else {
        free(v);
      }
    } else if (l.i < l.n && (l.s[l.i] == '{' || l.s[l.i] == '[')) {
      why = "nested values are not part of the protocol";
      goto fail;
    } else if (skip_scalar(&l) || slot < nkeys) {
      why = slot < nkeys ? "member must be a string" : "invalid value";
      goto fail;
    }
    ws(&l);
    if (l.i < l.n && l.s[l.i] == ',') {
      l.i++;
      continue;
    }
    if (l.i < l.n && l.s[l.i] == '}') {
      l.i++;
      break;
    }
    why = "expected ',' or '}'";
    goto fail;
  }
end:
  ws(&l);
  if (l.i != l.n) {
    why = "trailing data after the object";
    goto fail;
  }
  return 1;
fail:
  for (size_t k = 0; k < nkeys; k++) {
    free(vals[k]);
    vals[k] = NULL;
  }
  snprintf(err, errlen, "%s", why ? why : "invalid JSON");
  return -1;
}

// ---- ptxstate's instrument report ----
// skip_value skips any JSON value (depth-limited); 0 or -1.
static int skip_value(lex *l, int depth) {
  const char *why;
  ws(l);
  if (l->i >= l->n || depth > 64) return -1;
  char c = l->s[l->i];
  if (c == '"') {
    char *s = str(l, &why);
    if (!s) return -1;
    free(s);
    return 0;
  }
  if (c == '{' || c == '[') {
    char close = c == '{' ? '}' : ']';
    l->i++;
    ws(l);
    if (l->i < l->n && l->s[l->i] == close) {
      l->i++;
      return 0;
    }
    for (;;) {
      if (c == '{') {
        ws(l);
        char *k = str(l, &why);
        if (!k) return -1;
        free(k);
        ws(l);
        if (l->i >= l->n || l->s[l->i] != ':') return -1;
        l->i++;
      }
      if (skip_value(l, depth + 1)) return -1;
      ws(l);
      if (l->i < l->n && l->s[l->i] == ',') {
        l->i++;
        continue;
      }
      if (l->i < l->n && l->s[l->i] == close) {
        l->i++;
        return 0;
      }
      return -1;
    }
  }
  return skip_scalar(l);
}

// kernel_obj reads one element of "kernels": name, eligible, first refusal.
static int kernel_obj(lex *l, json_kernel_fn cb, void *arg) {
  const char *why;
  ws(l);
  if (l->i >= l->n || l->s[l->i] != '{') return skip_value(l, 1);
  l->i++;
  char *name = NULL, *refusal = NULL;
  int eligible = -1, rc = -1;
  ws(l);
  if (l->i < l->n && l->s[l->i] == '}') {
    l->i++;
    return 0;
  }
  for (;;) {
    ws(l);
    char *k = str(l, &why);
    if (!k) goto out;
    ws(l);
    if (l->i >= l->n || l->s[l->i] != ':') {
      free(k);
      goto out;
    }
    l->i++;
    ws(l);
    if (strcmp(k, "name") == 0 && l->i < l->n && l->s[l->i] == '"' && !name) {
      name = str(l, &why);
      if (!name) {
        free(k);
        goto out;
      }
    } else if (strcmp(k, "eligible") == 0 && l->n - l->i >= 4 && memcmp(l->s + l->i, "true", 4) == 0) {
      eligible = 1;
      l->i += 4;
    } else if (strcmp(k, "eligible") == 0 && l->n - l->i >= 5 && memcmp(l->s + l->i, "false", 5) == 0) {
      eligible = 0;
      l->i += 5;
    } else if (strcmp(k, "refusals") == 0 && l->i < l->n && l->s[l->i] == '[' && !refusal) {
      size_t save = l->i;
      l->i++;
      ws(l);
      if (l->i < l->n && l->s[l->i] == '"') refusal = str(l, &why);
      l->i = save;
      if (skip_value(l, 2)) {
        free(k);
        goto out;
      }
    } else if (skip_value(l, 2)) {
      free(k);
      goto out;
    }
    free(k);
    ws(l);
    if (l->i < l->n && l->s[l->i] == ',') {
      l->i++;
      continue;
    }
    if (l->i < l->n && l->s[l->i] == '}') {
      l->i++;
      break;
    }
    goto out;
  }
  if (name && eligible >= 0) cb(arg, name, eligible, refusal);
  rc = 0;
out:
  free(name);
  free(refusal);
  return rc;
}

int json_kernel_report(const char *text, size_t n, json_kernel_fn cb, void *arg) {
  const char *why;
  lex l = {text, n, 0};
  ws(&l);
  if (l.i >= l.n || l.s[l.i] != '{') return -1;
  l.i++;
  int found = 0;
  for (;;) {
    ws(&l);
    if (l.i < l.n && l.s[l.i] == '}') break;
    char *k = str(&l, &why);
    if (!k) return -1;
    ws(&l);
    if (l.i >= l.n || l.s[l.i] != ':') {
      free(k);
      return -1;
    }
    l.i++;
    ws(&l);
    int is_k = strcmp(k, "kernels") == 0;
    free(k);
    if (is_k && l.i < l.n && l.s[l.i] == '[') {
      found = 1;
      l.i++;
      ws(&l);
      if (l.i < l.n && l.s[l.i] == ']') {
        l.i++;
      } else {
        for (;;) {
          if (kernel_obj(&l, cb, arg)) return -1;
          ws(&l);
          if (l.i < l.n && l.s[l.i] == ',') {
            l.i++;
            continue;
          }
          if (l.i < l.n && l.s[l.i] == ']') {
            l.i++;
            break;
          }
          return -1;
        }
      }
    } else if (skip_value(&l, 1)) {
      return -1;
    }
    ws(&l);
    if (l.i < l.n && l.s[l.i] == ',') {
      l.i++;
      continue;
    }
    if (l.i < l.n && l.s[l.i] == '}') break;
    return -1;
  }
  return found ? 0 : -1;
}
