package ptxstate

import (
	"errors"
	"fmt"
	"sort"
	"strconv"
	"strings"
)

// ErrSyntax is wrapped by every parse error (a *SyntaxError with line and column).
var ErrSyntax = errors.New("ptx syntax error")

func (e *SyntaxError) Unwrap() error { return ErrSyntax }

type parser struct {
	src   []byte
	toks  []token
	i     int
	lines []int // offsets of line starts
	prev  int   // end offset of the last consumed statement (start of the next Lead)
}

// Limits on untrusted input (docs/PTXSTATE.md, "Limits"). Past them Parse and Analyze/Instrument
// fail with an error wrapping ErrLimit instead of using time or memory without bound.
const (
	MaxSourceBytes      = 64 << 20  // a PTX module
	MaxBlocksPerKernel  = 50_000    // basic blocks of one function
	MaxStmtsPerFunction = 1_000_000 // statements of one function body
	MaxTokens           = 4_000_000 // tokens of a module (about 500,000 typical statements)
	// MaxLoopDepth bounds the loops around one basic block (layout intervals header..latch of
	// backward branches): the per-loop analyses cost the loop depth times the statements.
	MaxLoopDepth = 256
)

// ErrLimit is wrapped by the errors for input past a documented limit.
var ErrLimit = errors.New("ptx input exceeds a ptxstate limit")

// Parse parses a PTX module. Errors are *SyntaxError values (errors.Is(err, ErrSyntax)), or wrap
// ErrLimit for a module over MaxSourceBytes.
func Parse(src []byte) (*Module, error) {
	if len(src) > MaxSourceBytes {
		return nil, fmt.Errorf("%w: %d bytes of PTX, at most %d", ErrLimit, len(src), MaxSourceBytes)
	}
	toks, err := lex(src)
	if err != nil {
		return nil, err
	}
	p := &parser{src: src, toks: toks}
	p.lines = append(p.lines, 0)
	for i, c := range src {
		if c == '\n' {
			p.lines = append(p.lines, i+1)
		}
	}
	m := &Module{src: src}
	for p.peek().Kind != tokEOF {
		it, err := p.item(m)
		if err != nil {
			return nil, err
		}
		m.Items = append(m.Items, it)
	}
	m.Trailer = string(src[p.prev:])
	return m, nil
}

func (p *parser) peek() token { return p.toks[p.i] }
func (p *parser) peekN(n int) token {
	if p.i+n < len(p.toks) {
		return p.toks[p.i+n]
	}
	return p.toks[len(p.toks)-1]
}
func (p *parser) next() token {
	t := p.toks[p.i]
	if t.Kind != tokEOF {
		p.i++
	}
	return t
}

func (p *parser) pos(off int) (int, int) {
	l := sort.Search(len(p.lines), func(i int) bool { return p.lines[i] > off }) - 1
	return l + 1, off - p.lines[l] + 1
}

func (p *parser) errf(t token, format string, args ...any) error {
	l, c := p.pos(t.Off)
	return &SyntaxError{Line: l, Col: c, Msg: fmt.Sprintf(format, args...)}
}

// lead returns the trivia before token t and advances the statement cursor past end.
func (p *parser) take(start, end int) (lead, text string) {
	lead = string(p.src[p.prev:start])
	text = string(p.src[start:end])
	p.prev = end
	return
}

// untilEOL consumes tokens up to (not including) the first token that starts a new line.
func (p *parser) untilEOL() token {
	last := p.next()
	for p.peek().Kind != tokEOF && !p.peek().NL {
		last = p.next()
	}
	return last
}

// lineDirective consumes a directive without ';' (.version, .target, .address_size, .file,
// .loc) and returns its last token. nvcc writes each on one line, but ptxas does not end them at
// a newline: comments and line breaks may sit between their fields, so they are read by their
// grammar. A form not known here (a newer .loc field) ends at the end of the line, as before.
func (p *parser) lineDirective() token {
	first := p.next()
	last := first
	isP := func(t token, s string) bool { return t.Kind == tokPunct && t.Text == s }
	num := func() bool {
		if p.peek().Kind == tokNumber {
			last = p.next()
			return true
		}
		return false
	}
	switch spaceName(first.Text) {
	case ".version", ".address_size":
		num()
		return last
	case ".target":
		if p.peek().Kind == tokIdent && p.peek().Text[0] != '.' {
			last = p.next()
			for isP(p.peek(), ",") && p.peekN(1).Kind == tokIdent && p.peekN(1).Text[0] != '.' {
				p.next()
				last = p.next()
			}
		}
		return last
	case ".file":
		// .file 1 "name" [, timestamp, size]
		if num() && p.peek().Kind == tokString {
			last = p.next()
			for isP(p.peek(), ",") && p.peekN(1).Kind == tokNumber {
				p.next()
				last = p.next()
			}
		}
		return last
	case ".loc":
		// .loc file line col [, function_name label [+ off], inlined_at file line col]
		for k := 0; k < 3 && num(); k++ {
		}
		for isP(p.peek(), ",") {
			kw := p.peekN(1)
			switch {
			case kw.Kind == tokIdent && kw.Text == "function_name" && p.peekN(2).Kind == tokIdent:
				p.next()
				p.next()
				last = p.next()
				if isP(p.peek(), "+") && p.peekN(1).Kind == tokNumber {
					p.next()
					last = p.next()
				}
			case kw.Kind == tokIdent && kw.Text == "inlined_at":
				p.next()
				last = p.next()
				for k := 0; k < 3 && num(); k++ {
				}
			default:
				// unknown field: the rest of the line
				for p.peek().Kind != tokEOF && !p.peek().NL {
					last = p.next()
				}
				return last
			}
		}
		return last
	}
	for p.peek().Kind != tokEOF && !p.peek().NL {
		last = p.next()
	}
	return last
}

// untilSemi consumes tokens through the next ";" at brace depth 0 and returns it.
func (p *parser) untilSemi(first token) (token, error) {
	depth := 0
	for {
		t := p.next()
		switch {
		case t.Kind == tokEOF:
			return t, p.errf(first, "missing ';' after %q", first.Text)
		case t.Text == "{" && t.Kind == tokPunct:
			depth++
		case t.Text == "}" && t.Kind == tokPunct:
			depth--
			if depth < 0 {
				return t, p.errf(t, "unexpected '}'")
			}
		case t.Text == ";" && t.Kind == tokPunct && depth == 0:
			return t, nil
		}
	}
}

var linkage = map[string]bool{".visible": true, ".extern": true, ".weak": true, ".common": true}

func (p *parser) item(m *Module) (*Item, error) {
	first := p.peek()
	line, _ := p.pos(first.Off)
	it := &Item{Line: line}
	switch {
	case first.Kind == tokPunct && first.Text == "@":
		// @@DWARF lines of old debug output.
		last := p.untilEOL()
		it.Kind = ItemDirective
		it.Lead, it.Text = p.take(first.Off, last.End)
		return it, nil
	case first.Kind != tokIdent || first.Text[0] != '.':
		return nil, p.errf(first, "expected a directive at module scope, found %q", first.Text)
	}
	switch first.Text {
	case ".version", ".target", ".address_size", ".file":
		i0 := p.i
		last := p.lineDirective()
		it.Kind = ItemDirective
		it.Lead, it.Text = p.take(first.Off, last.End)
		// The fields are the tokens, not the text: comments and line breaks may sit between them.
		var fields []string
		for _, t := range p.toks[i0:p.i] {
			if !(t.Kind == tokPunct && t.Text == ",") {
				fields = append(fields, t.Text)
			}
		}
		switch first.Text {
		case ".version":
			if len(fields) != 2 {
				return nil, p.errf(first, ".version wants one number")
			}
			m.Version = fields[1]
		case ".target":
			m.Target = fields[1:]
		case ".address_size":
			if len(fields) != 2 {
				return nil, p.errf(first, ".address_size wants one number")
			}
			n, err := strconv.Atoi(fields[1])
			if err != nil {
				return nil, p.errf(first, ".address_size %q: %v", fields[1], err)
			}
			m.AddressSize = n
		}
		return it, nil
	case ".section":
		p.next()
		for p.peek().Kind != tokEOF && !(p.peek().Kind == tokPunct && p.peek().Text == "{") {
			p.next()
		}
		if p.peek().Kind == tokEOF {
			return nil, p.errf(first, ".section without '{'")
		}
		depth := 0
		var last token
		for {
			t := p.next()
			if t.Kind == tokEOF {
				return nil, p.errf(first, "unterminated .section")
			}
			if t.Kind == tokPunct && t.Text == "{" {
				depth++
			} else if t.Kind == tokPunct && t.Text == "}" {
				depth--
				if depth == 0 {
					last = t
					break
				}
			}
		}
		it.Kind = ItemDirective
		it.Lead, it.Text = p.take(first.Off, last.End)
		return it, nil
	}
	// Function or variable: look ahead for .entry/.func before ';' or '{'.
	isFunc := false
	for j := p.i; j < len(p.toks); j++ {
		t := p.toks[j]
		if t.Kind == tokEOF || (t.Kind == tokPunct && (t.Text == ";" || t.Text == "{" || t.Text == "=")) {
			break
		}
		if t.Kind == tokIdent && (t.Text == ".entry" || t.Text == ".func") {
			isFunc = true
			break
		}
		if t.Kind == tokIdent && !linkage[t.Text] && t.Text != ".noreturn" && !strings.HasPrefix(t.Text, ".attribute") {
			if j > p.i || t.Text[0] != '.' {
				break
			}
		}
	}
	if !isFunc {
		last, err := p.untilSemi(first)
		if err != nil {
			return nil, err
		}
		it.Kind = ItemVar
		if first.Text == ".pragma" || first.Text == ".alias" {
			it.Kind = ItemDirective
		}
		it.Lead, it.Text = p.take(first.Off, last.End)
		return it, nil
	}
	f, lead, err := p.function(first)
	if err != nil {
		return nil, err
	}
	f.Line = line
	it.Kind, it.Func, it.Lead = ItemFunc, f, lead
	return it, nil
}

func (p *parser) function(first token) (*Function, string, error) {
	f := &Function{}
	// Linkage and .entry/.func.
	for {
		t := p.next()
		if t.Kind == tokEOF {
			return nil, "", p.errf(first, "unexpected end of file in function header")
		}
		if t.Text == ".entry" {
			f.Entry = true
			break
		}
		if t.Text == ".func" {
			break
		}
	}
	// Attributes between .entry/.func and the name: .attribute(.unified(0xAB, 0xCD)), .noreturn.
	for p.peek().Kind == tokIdent && (p.peek().Text == ".attribute" || p.peek().Text == ".noreturn") {
		if p.next().Text == ".attribute" && p.peek().Kind == tokPunct && p.peek().Text == "(" {
			if err := p.skipParens(); err != nil {
				return nil, "", err
			}
		}
	}
	// .func may have a return parameter list first.
	if !f.Entry && p.peek().Kind == tokPunct && p.peek().Text == "(" {
		rets, _, err := p.params()
		if err != nil {
			return nil, "", err
		}
		f.Returns = rets
	}
	name := p.next()
	if name.Kind != tokIdent {
		return nil, "", p.errf(name, "expected a function name, found %q", name.Text)
	}
	f.Name = name.Text
	f.nameOff = name.Off - first.Off
	f.noParams = true
	if p.peek().Kind == tokPunct && p.peek().Text == "(" {
		ps, closeTok, err := p.params()
		if err != nil {
			return nil, "", err
		}
		f.Params = ps
		_ = closeTok
		// The twin's extra parameter goes right after the last token of the list (or after "(");
		// inserted before ")" it could land in a "//" comment ending the last parameter's line.
		f.paramsEnd = p.toks[p.i-2].End - first.Off
		f.noParams = false
	}
	// Attributes and performance directives up to '{' or ';'.
	for {
		t := p.peek()
		if t.Kind == tokEOF {
			return nil, "", p.errf(first, "function %s: missing body or ';'", f.Name)
		}
		if t.Kind == tokPunct && (t.Text == "{" || t.Text == ";") {
			break
		}
		p.next()
		if t.Kind != tokIdent {
			continue
		}
		switch t.Text {
		case ".pragma":
			// .entry k(...) .pragma "nounroll"; { ... }: the ';' ends the pragma, not the header.
			if _, err := p.untilSemi(t); err != nil {
				return nil, "", err
			}
		case ".blocksareclusters":
			f.ClusterDirectives = append(f.ClusterDirectives, t.Text)
		case ".maxntid", ".reqntid", ".minnctapersm", ".maxnreg", ".reqnctapercluster", ".maxclusterrank":
			var nums []int
			for p.peek().Kind == tokNumber || (p.peek().Kind == tokPunct && p.peek().Text == ",") {
				n := p.next()
				if n.Kind == tokNumber {
					v, err := strconv.Atoi(strings.TrimRight(n.Text, "Uu"))
					if err != nil {
						return nil, "", p.errf(n, "%s: bad number %q", t.Text, n.Text)
					}
					nums = append(nums, v)
				}
			}
			if len(nums) == 0 {
				return nil, "", p.errf(t, "%s wants numbers", t.Text)
			}
			switch t.Text {
			case ".maxntid":
				f.MaxNTID = nums
			case ".reqntid":
				f.ReqNTID = nums
			case ".minnctapersm":
				f.MinNCTAPerSM = nums[0]
			case ".maxnreg":
				f.MaxNReg = nums[0]
			default:
				f.ClusterDirectives = append(f.ClusterDirectives, t.Text)
			}
		case ".explicitcluster":
			f.ClusterDirectives = append(f.ClusterDirectives, t.Text)
		}
	}
	open := p.next()
	if open.Text == ";" {
		f.Proto = true
		lead, head := p.take(first.Off, open.End)
		f.Head = head
		return f, lead, nil
	}
	lead, head := p.take(first.Off, open.End)
	f.Head = head
	depth := 0
	for {
		t := p.peek()
		if t.Kind == tokEOF {
			return nil, "", p.errf(open, "function %s: missing '}'", f.Name)
		}
		if t.Kind == tokPunct && t.Text == "}" && depth == 0 {
			p.next()
			l, txt := p.take(t.Off, t.End)
			f.Close = l + txt
			return f, lead, nil
		}
		s, err := p.stmt(depth)
		if err != nil {
			return nil, "", fmt.Errorf("function %s: %w", f.Name, err)
		}
		switch s.Kind {
		case StOpen:
			depth++
		case StClose:
			depth--
			s.Depth = depth
		}
		if len(f.Body) >= MaxStmtsPerFunction {
			// Refuse while parsing, not after: a 50 MB body would otherwise be held whole.
			return nil, "", fmt.Errorf("%w: more than %d statements in %s", ErrLimit, MaxStmtsPerFunction, f.Name)
		}
		f.Body = append(f.Body, s)
	}
}

// skipParens consumes a balanced "( ... )" group.
func (p *parser) skipParens() error {
	open := p.next()
	depth := 1
	for depth > 0 {
		t := p.next()
		switch {
		case t.Kind == tokEOF:
			return p.errf(open, "unbalanced '('")
		case t.Kind == tokPunct && t.Text == "(":
			depth++
		case t.Kind == tokPunct && t.Text == ")":
			depth--
		}
	}
	return nil
}

// params parses "( .param .u64 name, .param .align 8 .b8 name[16] )".
func (p *parser) params() ([]Param, token, error) {
	open := p.next()
	var ps []Param
	var cur []token
	flush := func() error {
		if len(cur) == 0 {
			return nil
		}
		pr := Param{}
		for k, t := range cur {
			switch {
			case k == 0:
				pr.Space = t.Text
			case t.Kind == tokIdent && t.Text[0] == '.' && t.Text != ".ptr" && t.Text != ".align" && !strings.HasPrefix(t.Text, ".global") && !strings.HasPrefix(t.Text, ".shared") && !strings.HasPrefix(t.Text, ".const") && !strings.HasPrefix(t.Text, ".local"):
				pr.Type = t.Text
			case t.Kind == tokIdent && t.Text[0] != '.' && pr.Name == "":
				pr.Name = t.Text
			}
		}
		pr.Bytes = typeBytes(pr.Type)
		for k := 0; k+2 < len(cur); k++ {
			if cur[k].Text == "[" && cur[k+1].Kind == tokNumber && cur[k+2].Text == "]" {
				n, _ := strconv.Atoi(cur[k+1].Text)
				pr.Bytes *= n
			}
		}
		if pr.Name == "" {
			return p.errf(cur[0], "parameter without a name")
		}
		ps = append(ps, pr)
		cur = nil
		return nil
	}
	for {
		t := p.next()
		switch {
		case t.Kind == tokEOF:
			return nil, t, p.errf(open, "unterminated parameter list")
		case t.Kind == tokPunct && t.Text == ")":
			if err := flush(); err != nil {
				return nil, t, err
			}
			return ps, t, nil
		case t.Kind == tokPunct && t.Text == ",":
			if err := flush(); err != nil {
				return nil, t, err
			}
		default:
			cur = append(cur, t)
		}
	}
}

// typeBytes is the size of a scalar PTX type (.pred counts 1).
func typeBytes(t string) int {
	switch t {
	case ".pred", ".b8", ".u8", ".s8":
		return 1
	case ".b16", ".u16", ".s16", ".f16", ".bf16", ".e4m3x2", ".e5m2x2":
		return 2
	case ".b32", ".u32", ".s32", ".f32", ".f16x2", ".bf16x2", ".tf32":
		return 4
	case ".b64", ".u64", ".s64", ".f64":
		return 8
	case ".b128":
		return 16
	}
	return 0
}

func (p *parser) stmt(depth int) (*Stmt, error) {
	first := p.peek()
	l, c := p.pos(first.Off)
	s := &Stmt{Line: l, Col: c, Depth: depth}
	startTok := p.i
	finish := func(last token) *Stmt {
		s.Lead, s.Text = p.take(first.Off, last.End)
		s.toks = p.toks[startTok:p.i]
		return s
	}
	switch {
	case first.Kind == tokPunct && first.Text == "{":
		s.Kind = StOpen
		return finish(p.next()), nil
	case first.Kind == tokPunct && first.Text == "}":
		s.Kind = StClose
		return finish(p.next()), nil
	case first.Kind == tokIdent && p.peekN(1).Kind == tokPunct && p.peekN(1).Text == ":" && first.Text[0] != '.':
		s.Kind, s.Name = StLabel, first.Text
		p.next()
		return finish(p.next()), nil
	case first.Kind == tokPunct && first.Text == "@" && p.peekN(1).Text == "@":
		s.Kind = StDirective
		return finish(p.untilEOL()), nil
	case first.Kind == tokIdent && first.Text[0] == '.':
		s.Name = first.Text
		switch spaceName(first.Text) {
		case ".loc", ".file":
			s.Kind = StDirective
			return finish(p.lineDirective()), nil
		case ".reg", ".local", ".shared", ".param", ".const", ".global", ".tex", ".sreg":
			s.Kind = StDecl
		default:
			s.Kind = StDirective
		}
		last, err := p.untilSemi(first)
		if err != nil {
			return nil, err
		}
		return finish(last), nil
	}
	// Instruction.
	s.Kind = StInstr
	if first.Kind == tokPunct && first.Text == "@" {
		p.next()
		if p.peek().Kind == tokPunct && p.peek().Text == "!" {
			p.next()
			s.PredNeg = true
		}
		g := p.next()
		if g.Kind != tokIdent {
			return nil, p.errf(g, "expected a predicate register after '@', found %q", g.Text)
		}
		s.Pred = g.Text
	}
	op := p.next()
	if op.Kind != tokIdent || op.Text[0] == '%' || op.Text[0] == '.' {
		return nil, p.errf(op, "expected an instruction, found %q", op.Text)
	}
	s.Op = op.Text
	var cur []token
	depthP := 0
	for {
		t := p.next()
		if t.Kind == tokEOF {
			return nil, p.errf(op, "missing ';' after %s", op.Text)
		}
		if t.Kind == tokPunct {
			switch t.Text {
			case "(", "[", "{":
				depthP++
			case ")", "]", "}":
				depthP--
				if depthP < 0 && t.Text == "}" {
					return nil, p.errf(op, "missing ';' after %s", op.Text)
				}
				if depthP < 0 {
					return nil, p.errf(t, "unbalanced %q", t.Text)
				}
			}
			if depthP == 0 && (t.Text == "," || t.Text == ";") {
				if len(cur) > 0 {
					s.Args = append(s.Args, p.operand(cur))
				} else if t.Text == "," {
					return nil, p.errf(t, "empty operand")
				}
				cur = nil
				if t.Text == ";" {
					return finish(t), nil
				}
				continue
			}
		}
		cur = append(cur, t)
	}
}

func (p *parser) operand(ts []token) Operand {
	o := Operand{toks: ts, Text: string(p.src[ts[0].Off:ts[len(ts)-1].End])}
	for _, t := range ts {
		if t.Kind == tokIdent && t.Text[0] == '%' {
			o.Regs = append(o.Regs, t.Text)
		}
	}
	f := ts[0]
	switch {
	case f.Kind == tokPunct && f.Text == "[":
		o.Kind = OpAddr
	case f.Kind == tokPunct && f.Text == "{":
		o.Kind = OpVec
	case f.Kind == tokPunct && f.Text == "(":
		o.Kind = OpList
	case f.Kind == tokPunct && f.Text == "!" && len(ts) == 2:
		o.Kind, o.Neg = OpReg, true
	case f.Kind == tokPunct && f.Text == "-" || f.Kind == tokNumber:
		o.Kind = OpImm
	case len(ts) == 3 && ts[1].Text == "|":
		o.Kind = OpPair
	case f.Kind == tokIdent && f.Text == "_" && len(ts) == 1:
		o.Kind = OpSink
	case f.Kind == tokIdent && f.Text[0] == '%' && len(ts) == 1:
		o.Kind = OpReg
	case f.Kind == tokIdent:
		o.Kind = OpSym
	default:
		o.Kind = OpOther
	}
	return o
}
