// Package ptxstate parses PTX (up to ISA 9.0, as nvcc from CUDA 13 emits it), analyses its kernels
// (control flow, liveness, barriers, special registers, shared memory, patterns that forbid
// preemption) and adds preemptible persistent-thread twins of eligible kernels.
//
// Parsing keeps every statement's source text and the trivia (whitespace, comments) before it, so
// printing an unmodified Module reproduces the input byte for byte. The transform only adds
// functions and module-scope declarations; original kernels are never changed.
package ptxstate

import "strings"

// Module is a parsed PTX module.
type Module struct {
	Items   []*Item
	Trailer string // trivia after the last item

	Version     string // "9.0"
	Target      []string
	AddressSize int

	src []byte
}

// ItemKind says what a top-level item is.
type ItemKind uint8

const (
	ItemDirective ItemKind = iota // .version, .target, .address_size, .file, .pragma, .section, @@DWARF
	ItemVar                       // module-scope variable (.global, .const, .shared, .extern .shared …)
	ItemFunc                      // .entry or .func (definition or prototype)
)

// Item is one top-level construct. Lead is the trivia before it.
type Item struct {
	Kind ItemKind
	Lead string
	Text string // source text for directives and variables
	Func *Function
	Line int
}

// Function is an .entry or .func with its body statements.
type Function struct {
	Entry   bool
	Name    string
	Line    int
	Head    string // text from the first token through "{" (or through ";" for a prototype)
	Proto   bool   // declaration without a body
	Body    []*Stmt
	Close   string // trivia before the closing "}" plus "}"
	Params  []Param
	Returns []Param

	// Performance-tuning directives between the parameter list and the body.
	MaxNTID, ReqNTID   []int
	MinNCTAPerSM       int
	MaxNReg            int
	ClusterDirectives  []string // .reqnctapercluster, .explicitcluster, .maxclusterrank
	nameOff, paramsEnd int      // offsets into Head: the name, and the end of the last token before the ")" closing the parameters
	noParams           bool
}

// Param is one function parameter.
type Param struct {
	Space string // ".param" or ".reg"
	Type  string // ".u64", ".b8" …
	Name  string
	Bytes int // size in bytes (arrays included), 0 when unknown
}

// StmtKind classifies body statements.
type StmtKind uint8

const (
	StInstr     StmtKind = iota // an instruction, maybe predicated
	StLabel                     // NAME:
	StDecl                      // .reg, .local, .shared, .param, .const, .global inside a body
	StDirective                 // .loc, .pragma, .branchtargets, .calltargets, .callprototype, @@DWARF …
	StOpen                      // {
	StClose                     // }
)

// Stmt is one body statement. Lead+Text is exactly its source.
type Stmt struct {
	Kind  StmtKind
	Lead  string
	Text  string
	Line  int
	Col   int
	Depth int // scope depth: 0 directly in the function body

	// Instructions.
	Pred    string // guard register without "@" and "!", "" if unguarded
	PredNeg bool
	Op      string // full opcode: "ld.global.nc.f32"
	Args    []Operand

	// Labels: the name. Directives and declarations: the leading directive (".reg").
	Name string

	toks []token // the statement's tokens (offsets into the module source)
}

// Base is the opcode without modifiers ("ld" for "ld.global.f32").
func (s *Stmt) Base() string {
	if i := strings.IndexByte(s.Op, '.'); i >= 0 {
		return s.Op[:i]
	}
	return s.Op
}

// HasMod reports whether the opcode carries modifier m (without the dot).
func (s *Stmt) HasMod(m string) bool {
	parts := strings.Split(s.Op, ".")
	for _, p := range parts[1:] {
		if p == m {
			return true
		}
	}
	return false
}

// OperandKind classifies an instruction operand.
type OperandKind uint8

const (
	OpReg  OperandKind = iota // %r1 (also special registers such as %tid.x)
	OpImm                     // 1, -1, 0f3F800000
	OpSym                     // a label, function or variable name, maybe with +offset
	OpAddr                    // [ ... ]
	OpVec                     // { a, b }
	OpList                    // ( a, b ) in call
	OpPair                    // %p|%q
	OpSink                    // _
	OpOther
)

// Operand is one comma-separated instruction operand.
type Operand struct {
	Kind OperandKind
	Text string
	Neg  bool     // !%p
	Regs []string // every %name inside, in order (registers and special registers)
	toks []token
}

// Mods returns the opcode's qualifiers without their dots, in order: "shared::cta", "b64" for
// mbarrier.init.shared::cta.b64 (a "::" sub-qualifier stays part of its qualifier).
func (s *Stmt) Mods() []string {
	parts := strings.Split(s.Op, ".")
	return parts[1:]
}

// Spaces returns the state spaces the opcode names, in order (destination first where an
// instruction names two, as cp.async.bulk.shared::cluster.global does), each normalised by
// spaceOf; cvta's "to" is skipped. A memory instruction without one uses generic addressing.
func (s *Stmt) Spaces() []string {
	var out []string
	for _, m := range s.Mods() {
		if sp := spaceOf(m); sp != "" {
			out = append(out, sp)
		}
	}
	return out
}

// spaceOf maps a qualifier (without its dot) to the state space it names: "shared" and
// "shared::cta" are both "shared::cta", "param::entry" and "param::func" are "param"; "" when the
// qualifier is not a state space.
func spaceOf(q string) string {
	switch q {
	case "shared", "shared::cta":
		return "shared::cta"
	case "shared::cluster":
		return "shared::cluster"
	case "param", "param::entry", "param::func":
		return "param"
	case "global", "local", "const", "tex":
		return q
	}
	return ""
}

// spaceName strips a "::" sub-qualifier from a directive: ".shared::cta" is ".shared".
func spaceName(d string) string {
	if i := strings.Index(d, "::"); i >= 0 {
		return d[:i]
	}
	return d
}

// isVarSpace reports whether d (from spaceName) is a state space variables are declared in.
func isVarSpace(d string) bool {
	switch d {
	case ".shared", ".global", ".const", ".local", ".tex":
		return true
	}
	return false
}
