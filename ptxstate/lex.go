package ptxstate

import (
	"fmt"
)

// tokKind classifies a PTX token.
type tokKind uint8

const (
	tokEOF    tokKind = iota
	tokIdent          // names, opcodes with modifiers (ld.global.f32, ld.shared::cta.u32), directives (.reg, .shared::cta), registers (%r1), labels ($L__BB0_1)
	tokNumber         // 12, 0x1f, 0f3F800000, 0d..., 1.5e3, 7U
	tokString         // "..."
	tokPunct          // one of { } ( ) [ ] , ; : @ ! | + - < > = * / ~ & ^ ? %
)

// token is one lexeme; Off/End are byte offsets into the module source.
type token struct {
	Kind tokKind
	Off  int
	End  int
	Text string
	// NL reports whether a newline occurs in the trivia before this token (directives such as
	// .version and .loc end at the end of their line, not at a semicolon).
	NL bool
}

// lexer splits PTX source into tokens, skipping whitespace and comments.
type lexer struct {
	src  []byte
	pos  int
	toks []token
}

// SyntaxError is returned for malformed PTX; it carries a 1-based line and column.
type SyntaxError struct {
	Line, Col int
	Msg       string
}

func (e *SyntaxError) Error() string { return fmt.Sprintf("line %d col %d: %s", e.Line, e.Col, e.Msg) }

func isIdentStart(c byte) bool {
	return c == '_' || c == '$' || c == '%' || c == '.' || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z')
}

func isIdentChar(c byte) bool {
	return isIdentStart(c) || (c >= '0' && c <= '9')
}

func isDigit(c byte) bool { return c >= '0' && c <= '9' }

// isQualChar reports whether c may start the part of a qualifier after "::" (cta, 128B, 1, 2X).
func isQualChar(c byte) bool {
	return c == '_' || isDigit(c) || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z')
}

// lex tokenises the whole source. Comments and whitespace are trivia: the parser recovers them
// from the gaps between token offsets, which is what makes printing byte exact.
func lex(src []byte) ([]token, error) {
	lx := &lexer{src: src}
	// Token texts are substrings of one copy of the source, not a copy each: a 50 MB module held
	// about 3 GB of token strings before.
	text := string(src)
	nl := true
	for {
		// trivia
		for lx.pos < len(src) {
			c := src[lx.pos]
			if c == '\n' {
				nl = true
				lx.pos++
			} else if c == ' ' || c == '\t' || c == '\r' || c == '\f' || c == '\v' {
				lx.pos++
			} else if c == '/' && lx.pos+1 < len(src) && src[lx.pos+1] == '/' {
				for lx.pos < len(src) && src[lx.pos] != '\n' {
					lx.pos++
				}
			} else if c == '/' && lx.pos+1 < len(src) && src[lx.pos+1] == '*' {
				start := lx.pos
				lx.pos += 2
				for {
					if lx.pos+1 >= len(src) {
						return nil, lx.errAt(start, "unterminated /* comment")
					}
					if src[lx.pos] == '\n' {
						nl = true
					}
					if src[lx.pos] == '*' && src[lx.pos+1] == '/' {
						lx.pos += 2
						break
					}
					lx.pos++
				}
			} else {
				break
			}
		}
		if lx.pos >= len(src) {
			lx.toks = append(lx.toks, token{Kind: tokEOF, Off: len(src), End: len(src), NL: true})
			return lx.toks, nil
		}
		start := lx.pos
		c := src[lx.pos]
		var kind tokKind
		switch {
		case isDigit(c):
			kind = tokNumber
			if c == '0' && lx.pos+1 < len(src) && (src[lx.pos+1] == 'f' || src[lx.pos+1] == 'F' || src[lx.pos+1] == 'd' || src[lx.pos+1] == 'D' || src[lx.pos+1] == 'x' || src[lx.pos+1] == 'X') {
				lx.pos += 2
				for lx.pos < len(src) && isHex(src[lx.pos]) {
					lx.pos++
				}
			} else {
				for lx.pos < len(src) && (isDigit(src[lx.pos]) || src[lx.pos] == '.') {
					lx.pos++
				}
				if lx.pos < len(src) && (src[lx.pos] == 'e' || src[lx.pos] == 'E') {
					p := lx.pos + 1
					if p < len(src) && (src[p] == '+' || src[p] == '-') {
						p++
					}
					if p < len(src) && isDigit(src[p]) {
						lx.pos = p
						for lx.pos < len(src) && isDigit(src[lx.pos]) {
							lx.pos++
						}
					}
				}
			}
			if lx.pos < len(src) && (src[lx.pos] == 'U' || src[lx.pos] == 'u') {
				lx.pos++
			}
			if lx.pos < len(src) && isIdentChar(src[lx.pos]) && src[lx.pos] != '.' {
				return nil, lx.errAt(start, fmt.Sprintf("malformed number %q", string(src[start:lx.pos+1])))
			}
		case c == '%' && lx.pos+1 < len(src) && !isIdentChar(src[lx.pos+1]):
			kind = tokPunct
			lx.pos++
		case isIdentStart(c):
			kind = tokIdent
			for lx.pos < len(src) {
				if isIdentChar(src[lx.pos]) {
					lx.pos++
					continue
				}
				// "::" joins the parts of a qualifier or state space, in opcodes and declarations
				// (ld.shared::cta, mbarrier::complete_tx::bytes, .L2::128B, .cta_group::1); it is
				// never followed by '.', '%' or '$', so a label "L:" before an instruction is safe.
				if src[lx.pos] == ':' && lx.pos+2 < len(src) && src[lx.pos+1] == ':' && isQualChar(src[lx.pos+2]) {
					lx.pos += 2
					continue
				}
				break
			}
		case c == '"':
			kind = tokString
			lx.pos++
			for {
				if lx.pos >= len(src) || src[lx.pos] == '\n' {
					return nil, lx.errAt(start, "unterminated string")
				}
				if src[lx.pos] == '\\' {
					lx.pos += 2
					continue
				}
				if src[lx.pos] == '"' {
					lx.pos++
					break
				}
				lx.pos++
			}
		case isPunct(c):
			kind = tokPunct
			lx.pos++
		default:
			return nil, lx.errAt(start, fmt.Sprintf("unexpected character %q", c))
		}
		if len(lx.toks) >= MaxTokens {
			return nil, fmt.Errorf("%w: more than %d tokens", ErrLimit, MaxTokens)
		}
		lx.toks = append(lx.toks, token{Kind: kind, Off: start, End: lx.pos, Text: text[start:lx.pos], NL: nl})
		nl = false
	}
}

func isHex(c byte) bool {
	return isDigit(c) || (c >= 'a' && c <= 'f') || (c >= 'A' && c <= 'F')
}

func isPunct(c byte) bool {
	switch c {
	case '{', '}', '(', ')', '[', ']', ',', ';', ':', '@', '!', '|', '+', '-', '<', '>', '=', '*', '/', '~', '&', '^', '?':
		return true
	}
	return false
}

func (lx *lexer) errAt(off int, msg string) error {
	l, c := lineCol(lx.src, off)
	return &SyntaxError{Line: l, Col: c, Msg: msg}
}

// lineCol converts a byte offset to a 1-based line and column (columns count bytes).
func lineCol(src []byte, off int) (int, int) {
	line, col := 1, 1
	if off > len(src) {
		off = len(src)
	}
	for i := 0; i < off; i++ {
		if src[i] == '\n' {
			line++
			col = 1
		} else {
			col++
		}
	}
	return line, col
}
