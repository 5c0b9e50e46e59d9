package main

import (
	"fmt"
	"strings"
	"unicode"
	"unicode/utf8"
)

// esc makes a string that came from outside ptxmig (an image's names, paths, symlink targets and
// labels, an export stream, a PTX file, a process's name or command line, the shim's socket) safe
// to print for people: control characters (C0, DEL, C1; newlines and tabs too), Unicode format
// characters that reorder or hide text (bidi overrides, zero-width characters) and invalid UTF-8
// are written as Go escapes (\x1b, \n, \u202e). A terminal never interprets them, and a line
// stays one line. Plain text passes unchanged and allocation-free. JSON output needs none of
// this: encoding/json escapes control characters itself.
func esc(s string) string { return escape(s, false) }

// escLines is esc for multi-line messages (errors): newlines and tabs stay.
func escLines(s string) string { return escape(s, true) }

func escape(s string, keepLines bool) string {
	if !needsEscape(s, keepLines) {
		return s
	}
	var b strings.Builder
	for i := 0; i < len(s); {
		r, n := utf8.DecodeRuneInString(s[i:])
		switch {
		case r == utf8.RuneError && n == 1:
			fmt.Fprintf(&b, `\x%02x`, s[i])
		case keepLines && (r == '\n' || r == '\t'):
			b.WriteRune(r)
		case r == '\n':
			b.WriteString(`\n`)
		case r == '\t':
			b.WriteString(`\t`)
		case r == '\r':
			b.WriteString(`\r`)
		case unsafeRune(r) && r < 0x100:
			fmt.Fprintf(&b, `\x%02x`, r)
		case unsafeRune(r):
			fmt.Fprintf(&b, `\u%04x`, r)
		default:
			b.WriteString(s[i : i+n])
		}
		i += n
	}
	return b.String()
}

func needsEscape(s string, keepLines bool) bool {
	for i := 0; i < len(s); {
		c := s[i]
		if c < utf8.RuneSelf {
			if (c < 0x20 || c == 0x7f) && !(keepLines && (c == '\n' || c == '\t')) {
				return true
			}
			i++
			continue
		}
		r, n := utf8.DecodeRuneInString(s[i:])
		if (r == utf8.RuneError && n == 1) || unsafeRune(r) {
			return true
		}
		i += n
	}
	return false
}

// unsafeRune: control characters and the format characters (Cf: bidi controls, zero-width
// joiners and spaces, the BOM...) that change how surrounding text displays.
func unsafeRune(r rune) bool {
	return unicode.IsControl(r) || unicode.Is(unicode.Cf, r)
}

// escList escapes every element of a list and joins it with sep.
func escList(items []string, sep string) string {
	out := make([]string, len(items))
	for i, s := range items {
		out[i] = esc(s)
	}
	return strings.Join(out, sep)
}
