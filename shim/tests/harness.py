"""What drive.py and preempt.py share: per-case results (PASS, SKIP or FAIL, appended to
$SHIM_RESULTS for tests/results.sh when set), PTXMIG_REQUIRE turning a skip into a failure, and a
client of the shim's control socket. Set `label` before the first result."""
import atexit, json, os, shutil, socket, sys, tempfile

failures = []
tally = {"PASS": 0, "SKIP": 0, "FAIL": 0}
label = "shim"
_open_cases = 0  # a skip inside a case fails that case instead of adding a result of its own
_scratch = []  # directories made by scratch(), removed when their case ends (or at exit)


def scratch(prefix):
    """A new temporary directory, removed when the case that made it ends, whether it passed or not."""
    d = tempfile.mkdtemp(prefix=prefix)
    _scratch.append(d)
    return d


@atexit.register
def _remove_scratch(keep=0):
    while len(_scratch) > keep:
        shutil.rmtree(_scratch.pop(), ignore_errors=True)


def check(cond, msg):
    if not cond:
        failures.append(msg)
        print("FAIL", msg, file=sys.stderr)
    return cond


def result(status, name, detail=""):
    tally[status] += 1
    if status != "PASS":
        print(f"{status} {label}/{name}" + (f": {detail}" if detail else ""))
    path = os.environ.get("SHIM_RESULTS")
    if path:
        with open(path, "a") as f:
            f.write(f"{status}\t{label}/{name}\t{detail}\n")


def required(need):
    reqs = [r.strip() for r in os.environ.get("PTXMIG_REQUIRE", "").split(",")]
    return need in reqs or "all" in reqs


def skip(need, name, reason):
    """A skipped check: SKIP, or a failure when PTXMIG_REQUIRE lists need (None: no requirement)."""
    if need and required(need):
        msg = f"{name}: required {need} unavailable: {reason} (PTXMIG_REQUIRE)"
        if _open_cases:
            check(False, msg)
        else:
            result("FAIL", name, msg)
            failures.append(msg)
    else:
        result("SKIP", name, reason)


class case:
    """One test case: PASS unless a check inside it failed or it raised (which ends only it)."""

    def __init__(self, name):
        self.name = name

    def __enter__(self):
        global _open_cases
        _open_cases += 1
        self.start = len(failures)
        self.scratch = len(_scratch)
        return self

    def __exit__(self, typ, exc, tb):
        global _open_cases
        _open_cases -= 1
        _remove_scratch(self.scratch)
        if typ is not None:
            check(False, f"{self.name}: {typ.__name__}: {exc}")
        if len(failures) > self.start:
            result("FAIL", self.name, "; ".join(failures[self.start:])[:400])
        else:
            result("PASS", self.name)
        return True


def summary(shim):
    return f"{tally['PASS']} passed, {tally['SKIP']} skipped, {tally['FAIL']} failed ({os.path.basename(shim)})"


class Conn:
    """One connection to a shim's control socket: one JSON request line, one reply line."""

    def __init__(self, path, timeout=10):
        self.s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.s.settimeout(timeout)
        self.s.connect(path)
        self.f = self.s.makefile("rb")

    def raw(self, data):
        self.s.sendall(data)
        line = self.f.readline()
        if not line:
            raise RuntimeError("connection closed without a reply")
        return json.loads(line)

    def req(self, **kw):
        return self.raw((json.dumps(kw) + "\n").encode())

    def close(self):
        self.f.close()
        self.s.close()
