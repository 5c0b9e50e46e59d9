package ptxstate

import (
	"fmt"
	"sort"
	"strconv"
	"strings"
)

// TwinSuffix is appended to a kernel's name to name its preemptible twin.
const TwinSuffix = "__ptxmig"

// CtlParam is the name of the control-block parameter appended to every twin.
const CtlParam = "__ptxmig_ctl"

// Reserved prefixes of names the transform generates; input that already uses them is refused.
const (
	regPrefix   = "%ptxmig_"
	labelPrefix = "$__ptxmig_"
	slotPrefix  = "__ptxmig_slot_"
)

// BarrierSite is one CTA barrier (or a call to a function containing one) in a kernel.
type BarrierSite struct {
	Line      int      `json:"line"`
	Op        string   `json:"op"`
	Live      []string `json:"live"`       // registers live after the site
	LiveBytes int      `json:"live_bytes"` // per thread, predicates counted as 4 bytes
	Uniform   bool     `json:"uniformly_reached"`
}

// KernelReport is the analysis of one .entry.
type KernelReport struct {
	Name      string        `json:"name"`
	Line      int           `json:"line"`
	Eligible  bool          `json:"eligible"`
	Twin      string        `json:"twin,omitempty"`
	Refusals  []string      `json:"refusals,omitempty"`
	Notes     []string      `json:"notes,omitempty"`
	Params    int           `json:"params"`
	Blocks    int           `json:"basic_blocks"`
	Registers int           `json:"registers"`
	Barriers  []BarrierSite `json:"barriers"`
	// MidBlockSites are the candidate mid-block safe points (midblock.go), each eligible or
	// refused with the conditions it fails.
	MidBlockSites      []MidBlockSite `json:"mid_block_sites"`
	WarpCollectives    int            `json:"warp_collectives"`
	SpecialRegs        []string       `json:"special_registers"`
	Calls              []string       `json:"calls,omitempty"`
	SharedStaticBytes  int            `json:"shared_static_bytes"`
	DynamicShared      bool           `json:"dynamic_shared"`
	LocalBytes         int            `json:"local_bytes"`
	MaxNTID            []int          `json:"maxntid,omitempty"`
	ReqNTID            []int          `json:"reqntid,omitempty"`
	SaveBytesPerThread int            `json:"save_bytes_per_thread"`
	SaveBytesPerCTA    *int           `json:"save_bytes_per_cta,omitempty"` // when the block size is bounded by .reqntid/.maxntid
	EarlyExitDivergent bool           `json:"divergent_early_exit"`
	// TwinMaxNReg is the .maxnreg given to the twin (Options.MaxNReg), 0 when none.
	TwinMaxNReg int `json:"twin_maxnreg,omitempty"`
	// MidBlock is set when the twin also stops at mid-block sites (Options.MidBlock): a
	// version-3 twin, with the layout of its save records. With Options.MidBlockTwins it is the
	// layout of the second twin, MidTwin.
	MidBlock *MidBlockLayout `json:"mid_block,omitempty"`
	// MidTwin names the kernel's mid-block twin beside its block-granular one
	// (Options.MidBlockTwins), "" when it has none.
	MidTwin string `json:"mid_twin,omitempty"`
}

// Report is the analysis of a module.
type Report struct {
	Version string         `json:"version"`
	Target  []string       `json:"target"`
	Kernels []KernelReport `json:"kernels"`
	Notes   []string       `json:"notes,omitempty"` // about the whole module (e.g. registers not matched)
}

// moduleVar is a module-scope variable.
type moduleVar struct {
	Space  string
	Bytes  int
	Align  int // .align, 0 when not given
	Extern bool
}

// funcFacts are the facts of one function body that matter to its callers.
type funcFacts struct {
	specials   map[string]bool
	barriers   []*Stmt
	callees    []string
	exits      []*Stmt // exit instructions (in a .func they end the thread)
	indirect   []*Stmt
	clusterOps []*Stmt
	symbols    map[string]bool
	localBytes int
	sharedDecl int
	reserved   []string

	selfSched  []*Stmt // clusterlaunchcontrol: cancels not-yet-launched CTAs and runs their work
	maxnreg    []*Stmt // setmaxnreg
	relinquish []*Stmt // tcgen05.relinquish_alloc_permit
	asyncCopy  bool    // cp.async (non-bulk): per-thread groups into shared memory
	bulkGroup  bool    // a .bulk_group completion: bulk copies reading shared memory
	mbarInit   []*Stmt // mbarrier.init
	mbarInval  bool    // mbarrier.inval
}

type analyzer struct {
	m     *Module
	funcs map[string]*Function
	vars  map[string]moduleVar
	facts map[string]*funcFacts
}

func newAnalyzer(m *Module) *analyzer {
	a := &analyzer{m: m, funcs: map[string]*Function{}, vars: map[string]moduleVar{}, facts: map[string]*funcFacts{}}
	for _, it := range m.Items {
		switch it.Kind {
		case ItemFunc:
			if !it.Func.Proto {
				a.funcs[it.Func.Name] = it.Func
			} else if _, ok := a.funcs[it.Func.Name]; !ok {
				a.funcs[it.Func.Name] = it.Func
			}
		case ItemVar:
			if name, v, ok := parseVar(it.Text); ok {
				a.vars[name] = v
			}
		}
	}
	return a
}

// parseVar reads "[.extern] .shared .align 4 .b8 name[1024] …;" into its name, space and size.
func parseVar(text string) (string, moduleVar, bool) {
	toks, err := lex([]byte(text))
	if err != nil {
		return "", moduleVar{}, false
	}
	var v moduleVar
	name, typ := "", ""
	size := 0
	for k := 0; k < len(toks); k++ {
		t := toks[k]
		switch {
		case t.Kind == tokIdent && t.Text == ".extern":
			v.Extern = true
		case t.Kind == tokIdent && isVarSpace(spaceName(t.Text)):
			v.Space = spaceName(t.Text)
		case t.Kind == tokIdent && t.Text == ".align":
			k++
			if k < len(toks) && toks[k].Kind == tokNumber {
				v.Align, _ = strconv.Atoi(toks[k].Text)
			}
		case t.Kind == tokIdent && t.Text[0] == '.' && typeBytes(t.Text) > 0:
			typ = t.Text
		case t.Kind == tokIdent && t.Text[0] != '.' && name == "":
			name = t.Text
			size = typeBytes(typ)
			for k+1 < len(toks) && toks[k+1].Text == "[" {
				if k+3 < len(toks) && toks[k+2].Kind == tokNumber && toks[k+3].Text == "]" {
					n, _ := strconv.Atoi(toks[k+2].Text)
					size *= n
					k += 3
				} else {
					size = 0 // unsized: extern array
					k += 2
				}
			}
		case t.Kind == tokPunct && (t.Text == "=" || t.Text == ";"):
			k = len(toks)
		}
	}
	if name == "" || v.Space == "" {
		return "", moduleVar{}, false
	}
	v.Bytes = size
	return name, v, true
}

// factsOf computes (and caches) the facts of function name.
func (a *analyzer) factsOf(f *Function) *funcFacts {
	if ff, ok := a.facts[f.Name]; ok {
		return ff
	}
	ff := &funcFacts{specials: map[string]bool{}, symbols: map[string]bool{}}
	a.facts[f.Name] = ff
	for _, s := range f.Body {
		for _, t := range s.toks {
			if t.Kind == tokIdent && (strings.HasPrefix(t.Text, regPrefix) || strings.HasPrefix(t.Text, labelPrefix) || strings.HasPrefix(t.Text, slotPrefix)) {
				ff.reserved = append(ff.reserved, t.Text)
			}
		}
		switch s.Kind {
		case StDecl:
			if _, v, ok := parseVar(s.Text); ok {
				switch v.Space {
				case ".local":
					ff.localBytes += v.Bytes
				case ".shared":
					ff.sharedDecl += v.Bytes
				}
			}
			continue
		case StInstr:
		default:
			continue
		}
		for _, o := range s.Args {
			for _, r := range o.Regs {
				if IsSpecialReg(r) {
					ff.specials[r] = true
				}
			}
			for _, t := range o.toks {
				if t.Kind == tokIdent && t.Text[0] != '%' && t.Text[0] != '.' {
					ff.symbols[t.Text] = true
				}
			}
		}
		if s.Pred != "" && IsSpecialReg(s.Pred) {
			ff.specials[s.Pred] = true
		}
		switch base := s.Base(); {
		case isBarrier(s):
			ff.barriers = append(ff.barriers, s)
		case base == "call":
			if c := callee(s); c != "" {
				ff.callees = append(ff.callees, c)
			} else {
				ff.indirect = append(ff.indirect, s)
			}
		case base == "exit":
			ff.exits = append(ff.exits, s)
		case isClusterOp(s):
			ff.clusterOps = append(ff.clusterOps, s)
		case strings.HasPrefix(s.Op, "clusterlaunchcontrol.try_cancel"):
			ff.selfSched = append(ff.selfSched, s)
		case base == "setmaxnreg":
			ff.maxnreg = append(ff.maxnreg, s)
		case strings.HasPrefix(s.Op, "tcgen05.relinquish_alloc_permit"):
			ff.relinquish = append(ff.relinquish, s)
		case strings.HasPrefix(s.Op, "mbarrier.init"):
			ff.mbarInit = append(ff.mbarInit, s)
		case strings.HasPrefix(s.Op, "mbarrier.inval"):
			ff.mbarInval = true
		}
		if strings.HasPrefix(s.Op, "cp.async.") && !strings.HasPrefix(s.Op, "cp.async.bulk") {
			ff.asyncCopy = true
		}
		if s.HasMod("bulk_group") {
			ff.bulkGroup = true
		}
	}
	return ff
}

// isClusterOp reports whether an instruction only makes sense between the CTAs of a cluster:
// cluster barriers, mapa/getctarank (another CTA's shared memory), multicast to the cluster, and
// tcgen05 operations of a CTA pair (cta_group::2). An operand in .shared::cluster space alone is
// not one: without mapa the only .shared::cluster addresses a kernel has are its own CTA's
// (nvcc and CUTLASS emit cp.async.bulk.shared::cluster.global for plain TMA loads).
func isClusterOp(s *Stmt) bool {
	switch s.Base() {
	case "mapa", "getctarank":
		return true
	case "barrier":
		return strings.HasPrefix(s.Op, "barrier.cluster")
	}
	for _, m := range s.Mods() {
		if strings.HasPrefix(m, "multicast::cluster") || m == "cta_group::2" {
			return true
		}
	}
	return false
}

// Analyze reports on every kernel (.entry with a body) of the module.
func Analyze(m *Module) (*Report, error) {
	r := &Report{Version: m.Version, Target: m.Target}
	a := newAnalyzer(m)
	for _, it := range m.Items {
		if it.Kind != ItemFunc || !it.Func.Entry || it.Func.Proto || strings.HasSuffix(it.Func.Name, TwinSuffix) {
			continue
		}
		kr, _, err := a.kernel(it.Func)
		if err != nil {
			return nil, fmt.Errorf("kernel %s: %w", it.Func.Name, err)
		}
		r.Kernels = append(r.Kernels, *kr)
	}
	return r, nil
}

// dynamic-parallelism and cooperative-launch runtime entry points.
var forbiddenCallees = map[string]string{
	"cudaLaunchDevice":         "dynamic parallelism (calls cudaLaunchDevice)",
	"cudaLaunchDeviceV2":       "dynamic parallelism (calls cudaLaunchDeviceV2)",
	"cudaGetParameterBuffer":   "dynamic parallelism (calls cudaGetParameterBuffer)",
	"cudaGetParameterBufferV2": "dynamic parallelism (calls cudaGetParameterBufferV2)",
	"cudaCGGetIntrinsicHandle": "grid-wide synchronisation (cooperative groups intrinsic handle)",
	"cudaCGSynchronizeGrid":    "grid-wide synchronisation (cudaCGSynchronizeGrid)",
	"cudaCGSynchronize":        "grid-wide synchronisation (cudaCGSynchronize)",
	"__cudaCGSynchronizeGrid":  "grid-wide synchronisation (__cudaCGSynchronizeGrid)",
	"cudaGraphLaunch":          "device graph launch",
	"cudaStreamTailLaunch":     "dynamic parallelism (tail launch)",
	"cudaStreamFireAndForget":  "dynamic parallelism (fire-and-forget launch)",
	"cudaGetCurrentGraphExec":  "device graph launch",
}

// kernelInfo carries what the transform needs beyond the report.
type kernelInfo struct {
	cfg *CFG
	// shared are the module-scope .shared variables the kernel and its callees name.
	shared map[string]bool
	// The kernel (or a callee) issues cp.async / bulk-group copies: the twin waits for the
	// thread's own groups before the next virtual block reuses shared memory.
	drainAsync, drainBulk bool
}

func (a *analyzer) kernel(f *Function) (*KernelReport, *kernelInfo, error) {
	kr := &KernelReport{Name: f.Name, Line: f.Line, Params: len(f.Params), MaxNTID: f.MaxNTID, ReqNTID: f.ReqNTID, Barriers: []BarrierSite{}, SpecialRegs: []string{}}
	g, err := buildCFG(f)
	if err != nil {
		return nil, nil, err
	}
	kr.Blocks = len(g.Blocks)
	kr.Registers = len(g.regNames)
	refuse := func(format string, args ...any) { kr.Refusals = append(kr.Refusals, fmt.Sprintf(format, args...)) }
	note := func(format string, args ...any) { kr.Notes = append(kr.Notes, fmt.Sprintf(format, args...)) }

	// Transitive callees.
	own := a.factsOf(f)
	all := []*funcFacts{own}
	seen := map[string]bool{f.Name: true}
	work := append([]string(nil), own.callees...)
	barrierFuncs := map[string]bool{}
	var calls []string
	for len(work) > 0 {
		c := work[0]
		work = work[1:]
		if seen[c] {
			continue
		}
		seen[c] = true
		calls = append(calls, c)
		if why, bad := forbiddenCallees[c]; bad {
			refuse("%s", why)
			continue
		}
		cf, ok := a.funcs[c]
		if !ok {
			refuse("calls %s, which is not declared in the module", c)
			continue
		}
		if cf.Proto {
			refuse("calls external function %s whose body is not in the module", c)
			continue
		}
		if cf.Entry {
			refuse("calls kernel %s", c)
			continue
		}
		ff := a.factsOf(cf)
		all = append(all, ff)
		for sr := range ff.specials {
			if strings.HasPrefix(sr, "%ctaid") || strings.HasPrefix(sr, "%nctaid") {
				refuse("called function %s reads %s (only the kernel body is virtualised)", c, sr)
			}
		}
		if len(ff.exits) > 0 {
			refuse("called function %s executes exit (line %d)", c, ff.exits[0].Line)
		}
		work = append(work, ff.callees...)
	}
	// Functions that (transitively) contain barriers (memoised; call graphs may be cyclic).
	memo := map[string]int8{} // 0 unknown, 1 visiting/no, 2 yes
	var hasBarrier func(name string, depth int) bool
	hasBarrier = func(name string, depth int) bool {
		if v, ok := memo[name]; ok {
			return v == 2
		}
		memo[name] = 1
		cf, ok := a.funcs[name]
		if !ok || cf.Proto || depth > 64 {
			return false
		}
		ff := a.factsOf(cf)
		yes := len(ff.barriers) > 0
		for _, c := range ff.callees {
			if !yes && hasBarrier(c, depth+1) {
				yes = true
			}
		}
		if yes {
			memo[name] = 2
		}
		return yes
	}
	for _, c := range calls {
		if hasBarrier(c, 0) {
			barrierFuncs[c] = true
		}
	}
	sort.Strings(calls)
	kr.Calls = calls

	specials := map[string]bool{}
	info := &kernelInfo{cfg: g, shared: map[string]bool{}}
	var mbarInit []*Stmt
	mbarInval := false
	for _, ff := range all {
		for sr := range ff.specials {
			specials[sr] = true
		}
		kr.LocalBytes += ff.localBytes
		kr.SharedStaticBytes += ff.sharedDecl
		for _, s := range ff.indirect {
			refuse("indirect call at line %d: the callee cannot be checked", s.Line)
		}
		for _, s := range ff.clusterOps {
			refuse("thread-block cluster operation %s at line %d", s.Op, s.Line)
		}
		for _, s := range ff.selfSched {
			refuse("schedules its own work: %s at line %d takes over CTAs that have not launched yet (cluster launch control)", s.Op, s.Line)
		}
		for _, s := range ff.maxnreg {
			refuse("%s at line %d reallocates the warp's registers: the twin would repeat it for every virtual block", s.Op, s.Line)
		}
		for _, s := range ff.relinquish {
			refuse("%s at line %d gives up the CTA's tensor-memory allocation permit, which the next virtual block would need", s.Op, s.Line)
		}
		info.drainAsync = info.drainAsync || ff.asyncCopy
		info.drainBulk = info.drainBulk || ff.bulkGroup
		mbarInit = append(mbarInit, ff.mbarInit...)
		mbarInval = mbarInval || ff.mbarInval
		if len(ff.reserved) > 0 {
			refuse("uses the name %s, reserved for the transform", ff.reserved[0])
		}
	}
	for sr := range specials {
		kr.SpecialRegs = append(kr.SpecialRegs, sr)
	}
	sort.Strings(kr.SpecialRegs)
	for _, sr := range kr.SpecialRegs {
		switch {
		case strings.HasPrefix(sr, "%envreg"):
			refuse("reads %s: the cooperative-launch workspace used for grid-wide synchronisation", sr)
		case strings.HasPrefix(sr, "%cluster") || strings.HasPrefix(sr, "%nclusterid") || sr == "%is_explicit_cluster":
			refuse("reads %s: thread-block clusters", sr)
		case sr == "%ctaid" || sr == "%nctaid":
			refuse("reads %s as a whole vector", sr)
		case sr == "%gridid":
			note("reads %%gridid, which differs between the relaunches of a preempted twin")
		case sr == "%smid" || sr == "%nsmid" || sr == "%warpid":
			note("reads %s: a virtual block may run on any SM and CTA slot", sr)
		case strings.HasPrefix(sr, "%clock") || strings.HasPrefix(sr, "%globaltimer"):
			note("reads %s: a preempted block's timings include the time it spent waiting", sr)
		}
	}
	if len(mbarInit) > 0 && !mbarInval {
		note("initialises an mbarrier (line %d) and never invalidates it: the twin initialises it again for every virtual block, after the block barrier", mbarInit[0].Line)
	}
	if len(f.ClusterDirectives) > 0 {
		refuse("declares %s: thread-block clusters", strings.Join(f.ClusterDirectives, ", "))
	}
	if _, taken := a.funcs[f.Name+TwinSuffix]; taken {
		refuse("the twin name %s is already defined in the module", f.Name+TwinSuffix)
	}
	if f.noParams {
		refuse("has no parameter list")
	}

	// Shared memory referenced by the kernel and its callees.
	syms := map[string]bool{}
	for _, ff := range all {
		for s := range ff.symbols {
			syms[s] = true
		}
	}
	for name := range syms {
		if v, ok := a.vars[name]; ok && v.Space == ".shared" {
			info.shared[name] = true
			if v.Extern || v.Bytes == 0 {
				kr.DynamicShared = true
			} else {
				kr.SharedStaticBytes += v.Bytes
			}
		}
	}
	if specials["%dynamic_smem_size"] {
		kr.DynamicShared = true
	}

	// Warp collectives and barriers in the kernel body. Liveness is wanted after the barrier
	// sites and at the loop headers (midBlockSites).
	want := make([]bool, len(f.Body))
	for i, s := range f.Body {
		if s.Kind == StInstr && (isBarrier(s) || s.Base() == "call" && barrierFuncs[callee(s)]) {
			want[i] = true
		}
	}
	for h := range layoutLoops(g) {
		if k := firstInstr(g, h); k >= 0 {
			want[k] = true
		}
	}
	after := g.liveness(want)
	uni := g.uniformity()
	for i, s := range f.Body {
		if s.Kind != StInstr {
			continue
		}
		if isWarpCollective(s) {
			kr.WarpCollectives++
		}
		isCallBar := s.Base() == "call" && barrierFuncs[callee(s)]
		if !isBarrier(s) && !isCallBar {
			continue
		}
		site := BarrierSite{Line: s.Line, Op: s.Op, Uniform: uni.reachedUniformly(g.blockOf[i])}
		if isCallBar {
			site.Op = "call " + callee(s)
		}
		g.work += len(after[i])
		for _, k := range after[i] {
			site.Live = append(site.Live, regKeyName(g.regNames[k]))
			site.LiveBytes += regSize(g.regTypes[k])
		}
		sort.Strings(site.Live)
		if site.LiveBytes > kr.SaveBytesPerThread {
			kr.SaveBytesPerThread = site.LiveBytes
		}
		kr.Barriers = append(kr.Barriers, site)
	}
	if threads := blockThreads(f); threads > 0 {
		v := kr.SharedStaticBytes + kr.LocalBytes*threads + kr.SaveBytesPerThread*threads + 4*threads
		kr.SaveBytesPerCTA = &v
	}

	// A barrier that not every thread of the CTA reaches is legal in the original only because
	// the threads that skip it have exited; in the twin they would wait at the claim barrier.
	for _, site := range kr.Barriers {
		if !site.Uniform {
			kr.EarlyExitDivergent = true
			refuse("the barrier on line %d is reached divergently: threads that leave early (ret/exit) would wait at the twin's claim barrier instead", site.Line)
		}
	}

	// Spin-waits and self-scheduling loops.
	a.loops(g, a.provenanceOf(g), refuse)

	kr.Refusals = dedup(kr.Refusals)
	kr.Notes = dedup(kr.Notes)
	kr.Eligible = len(kr.Refusals) == 0
	if kr.Eligible {
		kr.Twin = f.Name + TwinSuffix
	}
	bodies := [][]*Stmt{f.Body}
	for _, c := range calls {
		if cf, ok := a.funcs[c]; ok && !cf.Proto {
			bodies = append(bodies, cf.Body)
		}
	}
	kr.MidBlockSites = midBlockSites(kr, g, after, uni, bodies, barrierFuncs, a.m.Target)
	if kr.MidBlockSites == nil {
		kr.MidBlockSites = []MidBlockSite{}
	}
	return kr, info, nil
}

func blockThreads(f *Function) int {
	d := f.ReqNTID
	if d == nil {
		d = f.MaxNTID
	}
	if d == nil {
		return 0
	}
	n := 1
	for _, x := range d {
		n *= x
	}
	return n
}

func dedup(xs []string) []string {
	seen := map[string]bool{}
	var out []string
	for _, x := range xs {
		if !seen[x] {
			seen[x] = true
			out = append(out, x)
		}
	}
	return out
}

// loops refuses kernels whose loops wait on memory other CTAs write (spin-waits) or pull work
// from an atomic counter (a kernel that is already persistent).
//
// Only memory another CTA can write counts: a loop that waits on a load (or counts with an
// atomic) whose address is provably this CTA's shared memory or the thread's local memory
// (prov.privateAccess: a .shared/.shared::cta/.local opcode, or a generic address derived only
// from cvta.shared/cvta.local or such variables) waits for threads of the same CTA. In the twin
// those threads run the same virtual block (no thread starts the next block before all passed
// the block barrier), so such a wait ends exactly as in the original, and preempting between
// blocks cannot leave it waiting for a block that was never claimed.
//
// Each back edge b -> h (h <= b in layout order) closes a loop of the blocks h..b, and its
// branches' dependencies are followed inside those blocks. The back edges of one header are taken
// together, latest latch last, each adding its blocks to what the previous one found: the work
// is O(statements of the header's largest loop) per header, not O(statements x registers) per
// back edge (a loop whose exit depended on a chain through 20,000 barriers took 23 s; issue 36).
// The refusals come out in the order of the back edges (b, then h's place in b's successors).
func (a *analyzer) loops(g *CFG, prov *provenance, refuse func(string, ...any)) {
	f := g.Fn
	type backEdge struct{ b, h, at int } // at: h's index in b's successors
	var edges []backEdge
	for _, b := range g.Blocks {
		for at, h := range b.Succs {
			if h <= b.ID { // back edge b -> h (layout order approximates it); the exit is > b.ID
				edges = append(edges, backEdge{b.ID, h, at})
			}
		}
	}
	// By header, each header's latches in order.
	sort.Slice(edges, func(i, j int) bool {
		if edges[i].h != edges[j].h {
			return edges[i].h < edges[j].h
		}
		return edges[i].b < edges[j].b
	})
	type found struct {
		b, at, seq int
		msg        string
	}
	var out []found
	// Per header (tag: its block + 1, so that nothing is cleared between headers): dep marks the
	// registers its branches depend on; a register not (yet) one has the definitions of it in the
	// blocks taken so far in a chain (pends, in statement order); done marks the definitions of
	// dependencies already followed.
	nr := len(g.regNames)
	depTag, pendTag := make([]int32, nr), make([]int32, nr)
	pendHead, pendTail := make([]int32, nr), make([]int32, nr)
	doneTag := make([]int32, len(f.Body))
	type pend struct{ k, next int32 } // next: -1 at the end of the chain
	var pends []pend
	var work, defs []int
	for i := 0; i < len(edges); {
		h := edges[i].h
		tag := int32(h + 1)
		header := f.Body[g.Blocks[h].Start].Line
		pends = pends[:0]
		next := h // the first block not taken yet
		for ; i < len(edges) && edges[i].h == h; i++ {
			e := edges[i]
			dep := func(r int) {
				if depTag[r] != tag {
					depTag[r] = tag
					work = append(work, r)
				}
			}
			follow := func(k int) { // a definition of a dependency
				if doneTag[k] == tag {
					return
				}
				doneTag[k] = tag
				g.work++
				s := f.Body[k]
				switch {
				case (s.Base() == "ld" || s.Base() == "atom") && prov.privateAccess(k):
					// CTA-private memory: see above.
				case s.Base() == "ld" && (s.HasMod("volatile") || s.HasMod("acquire") || s.HasMod("relaxed")):
					out = append(out, found{e.b, e.at, len(out), fmt.Sprintf("spin-wait: the loop at line %d waits on %s (line %d), which another CTA may write", header, s.Op, s.Line)})
				case s.Base() == "atom" && (s.HasMod("add") || s.HasMod("inc")) || s.Base() == "atom" && s.HasMod("or") && len(s.Args) == 3 && s.Args[2].Text == "0":
					out = append(out, found{e.b, e.at, len(out), fmt.Sprintf("schedules its own work: the loop at line %d exits on the result of %s (line %d), a kernel that is already persistent", header, s.Op, s.Line)})
				}
				for _, u := range g.uses[k] {
					dep(u)
				}
			}
			// The blocks up to this latch: the definitions in them, and their conditional
			// branches' uses (the dependencies' roots).
			for ; next <= e.b; next++ {
				bl := g.Blocks[next]
				for k := bl.Start; k < bl.End; k++ {
					g.work++
					if f.Body[k].Kind != StInstr {
						continue
					}
					for _, d := range g.defs[k] {
						switch {
						case depTag[d] == tag:
							defs = append(defs, k)
						case pendTag[d] != tag:
							pendTag[d], pendHead[d], pendTail[d] = tag, int32(len(pends)), int32(len(pends))
							pends = append(pends, pend{int32(k), -1})
						default:
							pends[pendTail[d]].next = int32(len(pends))
							pendTail[d] = int32(len(pends))
							pends = append(pends, pend{int32(k), -1})
						}
					}
				}
				last := f.Body[bl.End-1]
				if last.Kind == StInstr && last.Pred != "" && (last.Base() == "bra" || last.Base() == "ret" || last.Base() == "exit") {
					for _, u := range g.uses[bl.End-1] {
						dep(u)
					}
				}
			}
			for _, k := range defs {
				follow(k)
			}
			defs = defs[:0]
			for len(work) > 0 {
				r := work[len(work)-1]
				work = work[:len(work)-1]
				if pendTag[r] == tag {
					for p := pendHead[r]; p >= 0; p = pends[p].next {
						follow(int(pends[p].k))
					}
					pendTag[r] = 0 // its definitions from now on are followed as they are taken
				}
			}
		}
	}
	sort.Slice(out, func(i, j int) bool {
		x, y := out[i], out[j]
		if x.b != y.b {
			return x.b < y.b
		}
		if x.at != y.at {
			return x.at < y.at
		}
		return x.seq < y.seq
	})
	for _, r := range out {
		refuse("%s", r.msg)
	}
}

func containsInt(xs []int, v int) bool {
	for _, x := range xs {
		if x == v {
			return true
		}
	}
	return false
}
