#!/usr/bin/env python3
"""Drives the shim's integration tests (see run.sh): starts each test app with the shim
preloaded, waits for it to report "ready", then talks to its control socket like ptxmig does.
Each case ends as PASS, SKIP or FAIL, appended to $SHIM_RESULTS (tests/results.sh) when set; a
skipped check counts as a skip of its own. PTXMIG_REQUIRE: a skip for a listed requirement fails."""
import argparse, hashlib, json, os, re, select, shutil, socket, stat, subprocess, sys, time

import harness
from harness import Conn, case, check, failures, required, result, skip


class App:
    def __init__(self, args, env, cwd):
        self.p = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  env=env, cwd=cwd, text=True)
        self.lines = []
        while True:
            line = self.p.stdout.readline()
            if not line:
                raise RuntimeError(f"{args[0]} exited before ready: {self.p.wait()} {self.p.stderr.read()}")
            line = line.rstrip("\n")
            if line == "ready":
                break
            self.lines.append(line)

    def finish(self):
        self.p.stdin.close()
        rest = self.p.stdout.read()
        err = self.p.stderr.read()
        return self.p.wait(), rest, err


def kernel(kernels, name):
    """All entries of one kernel name (one per function/kernel handle), merged."""
    ks = [k for k in kernels["kernels"] if k["name"] == name]
    if not ks:
        return None
    m = dict(ks[0], launches=sum(k["launches"] for k in ks), shapes=[s for k in ks for s in k["shapes"]],
             timed=min(k["timed"] for k in ks))
    m["time_us"] = min((k.get("time_us", {"p50": 0, "p99": 0}) for k in ks), key=lambda t: t["p50"])
    return m


def fake_counts(lines):
    for l in lines:
        if l.startswith("fake "):
            return dict(kv.split("=") for kv in l.split()[1:])
    return {}


SHARE_KINDS = ("ipc_mem", "vmm", "pool", "pool_ptr")


def share_counts(exported, imported, kinds, calls=(0, 0)):
    """The status "ipc" object: live totals, per kind (exported, imported), successful calls."""
    d = {"exported": exported, "imported": imported, "export_calls": calls[0], "import_calls": calls[1],
         "untracked": {"exported": 0, "imported": 0}}
    for k in SHARE_KINDS:
        e, i = kinds.get(k, (0, 0))
        d[k] = {"exported": e, "imported": i}
    return d


def common_checks(name, sockdir, app, expect_kernels, expect_alloc, expect_sources, expect_peer=0, expect_ipc=None):
    path = os.path.join(sockdir, f"{app.p.pid}.sock")
    check(os.path.exists(path), f"{name}: no control socket at {path}")
    if not os.path.exists(path):
        return None
    st = os.stat(path)
    check(stat.S_ISSOCK(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600, f"{name}: socket mode {oct(st.st_mode)}")
    c = Conn(path)
    s = c.req(cmd="status")
    check(s["ok"] and s["result"]["pid"] == app.p.pid, f"{name}: status: {s}")
    r = s["result"]
    check(r["cuda_initialized"] and r["devices"] and r["devices"][0]["name"] == "Fake GPU", f"{name}: devices {r.get('devices')}")
    check(any(x["primary"] for x in r["contexts"]), f"{name}: no primary context in {r['contexts']}")
    for kind, nbytes in expect_alloc.items():
        check(r["allocations"][kind]["bytes"] == nbytes, f"{name}: allocations[{kind}] = {r['allocations'][kind]}, want {nbytes}")
    srcs = sorted(m["source"] for m in r["modules"])
    check(srcs == sorted(expect_sources), f"{name}: module sources {srcs}, want {sorted(expect_sources)}")
    for m in r["modules"]:
        if m["loaded"]:
            check(m.get("sha256") and m["bytes"] > 0, f"{name}: module not captured: {m}")
    check(r.get("peer_access") == expect_peer, f"{name}: peer_access {r.get('peer_access')}, want {expect_peer}")
    want_ipc = expect_ipc or share_counts(0, 0, {})
    check(r.get("ipc") == want_ipc, f"{name}: ipc {r.get('ipc')}, want {want_ipc}")
    check(r["interception"]["unmatched"] == 0, f"{name}: unmatched resolver pointers {r['interception']}")
    k = c.req(cmd="kernels")
    check(k["ok"], f"{name}: kernels: {k}")
    for kname, (launches, shapes) in expect_kernels.items():
        kk = kernel(k["result"], kname)
        check(kk is not None, f"{name}: kernel {kname} missing from {k['result']['kernels']}")
        if kk:
            check(kk["launches"] == launches, f"{name}: {kname} launches {kk['launches']}, want {launches}")
            got = sorted((tuple(x["grid"]), tuple(x["block"]), x["launches"]) for x in kk["shapes"])
            check(got == sorted(shapes), f"{name}: {kname} shapes {got}, want {sorted(shapes)}")
            check(kk["timed"] >= 1 and kk["time_us"]["p50"] > 0 and kk["time_us"]["p99"] >= kk["time_us"]["p50"],
                  f"{name}: {kname} timing {kk.get('timed')} {kk.get('time_us')}")
            check(kk["module"] > 0, f"{name}: {kname} not attributed to a module")
    return c, r, k["result"]


def protocol_checks(name, c):
    bad = [b"not json\n", b"{}\n", b'{"cmd":"nope"}\n', b'{"cmd":1}\n', b'{"cmd":"status"\n', b"\x00\xff\xfe{\n",
           b'{"cmd":"dump-modules"}\n', b'{"cmd":"dump-modules","dir":"relative/dir"}\n', b"[1,2,3]\n",
           b'{"cmd":"status","cmd":"kernels"}\n', b"x" * 70000 + b"\n"]
    for b in bad:
        r = c.raw(b)
        check(r["ok"] is False and r["error"], f"{name}: garbage {b[:40]!r} got {r}")
    r = c.req(cmd="status")
    check(r["ok"], f"{name}: connection unusable after garbage: {r}")
    # Random bytes on a fresh connection, then close abruptly: the app must not notice.
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(c.s.getpeername())
    s.sendall(os.urandom(5000))
    s.close()


def dump_checks(name, c, tmp, want_ptx_entry, need_ptxas):
    d = os.path.join(tmp, f"dump-{name}")
    r = c.req(cmd="dump-modules", dir=d)
    check(r["ok"], f"{name}: dump: {r}")
    if not r["ok"]:
        return
    idx = json.load(open(os.path.join(d, "index.json")))
    check(stat.S_IMODE(os.stat(d).st_mode) == 0o700, f"{name}: dump dir mode")
    files = [e["file"] for m in idx["modules"] for e in m["entries"] if "file" in e]
    check(all(os.path.exists(os.path.join(d, f)) for f in files), f"{name}: index names missing files")
    ptx = [f for f in files if f.endswith(".ptx")]
    check(len(ptx) >= 1, f"{name}: no PTX dumped: {idx}")
    for f in files:
        check(stat.S_IMODE(os.stat(os.path.join(d, f)).st_mode) == 0o600, f"{name}: {f} mode")
    ptxas = shutil.which("ptxas")
    if ptxas:
        too_new = set()  # ISA versions of dumped modules this ptxas predates
        for f in set(ptx):
            text = open(os.path.join(d, f)).read()
            m = re.search(r"^\s*\.target\s+(sm_\d+[a-z]?)", text, re.M)
            arch = m.group(1) if m else "sm_70"
            p = subprocess.run([ptxas, "-arch", arch, "-o", os.devnull, os.path.join(d, f)], capture_output=True, text=True)
            if "Unsupported .version" in p.stderr and not need_ptxas:
                v = re.search(r"^\s*\.version\s+(\S+)", text, re.M)
                too_new.add(v.group(1) if v else "?")
                continue
            check(p.returncode == 0, f"{name}: ptxas rejects dumped {f}: {p.stderr[:500]}")
        if too_new:
            skip(None, f"{name}/ptxas", f"{ptxas} predates PTX ISA {', '.join(sorted(too_new))} of the dumped PTX "
                 "(checked on the GPU host)")
    elif need_ptxas:
        check(False, f"{name}: ptxas not installed (make deps installs it); dumped PTX not assembled")
    else:
        skip("ptxas", f"{name}/ptxas", "ptxas not installed; dumped PTX not assembled")
    if want_ptx_entry:
        # want_ptx_entry names the codec the fatbin's PTX entries were compressed with.
        check(any(e.get("kind") == "ptx" and e.get("compression") == want_ptx_entry
                  for m in idx["modules"] for e in m["entries"]), f"{name}: no {want_ptx_entry} PTX entry in {idx}")
    # Dumping again writes nothing new (content-addressed).
    r2 = c.req(cmd="dump-modules", dir=d)
    check(r2["ok"] and r2["result"]["files_written"] == 0, f"{name}: second dump wrote {r2}")


def run_app(opts, name, env_extra, expect_kernels, expect_alloc, expect_sources, fake_expect, want_ptx_entry=None,
            need_ptxas=False, expect_peer=0, expect_ipc=None, after=None):
    """after(c, app), when given, runs once the checks are done, while the app still waits."""
    tmp = harness.scratch(f"ptxmig-shim-{name}-")
    sockdir = os.path.join(tmp, "sock")
    exe = os.path.join(opts.build, name)
    base = dict(os.environ, LD_LIBRARY_PATH=os.path.join(opts.build, "fake"))
    base.update(env_extra)
    # Reference run without the shim: same output.
    ref = App([exe], base, tmp)
    rc0, rest0, _ = ref.finish()
    env = dict(base, PTXMIG_SOCKET_DIR=sockdir,
               LD_PRELOAD=" ".join(x for x in [opts.preload_first, opts.shim] if x))
    app = App([exe], env, tmp)
    check(app.lines == ref.lines, f"{name}: output differs under the shim: {app.lines} vs {ref.lines}")
    counts = fake_counts(app.lines)
    for k, v in fake_expect.items():
        check(counts.get(k) == str(v), f"{name}: fake driver saw {k}={counts.get(k)}, want {v}")
    res = common_checks(name, sockdir, app, expect_kernels, expect_alloc, expect_sources, expect_peer, expect_ipc)
    if res:
        c, status, kernels = res
        protocol_checks(name, c)
        dump_checks(name, c, tmp, want_ptx_entry, need_ptxas)
        if after:
            after(c, app)
        c.s.close()
    rc, rest, err = app.finish()
    check(rc == rc0 == 0, f"{name}: exit {rc} (without shim {rc0}); stderr: {err[-2000:]}")
    check(not os.path.exists(os.path.join(sockdir, f"{app.p.pid}.sock")), f"{name}: socket left behind after exit")
    shutil.rmtree(tmp, ignore_errors=True)
    return res and res + (err,)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shim", required=True)
    ap.add_argument("--build", required=True)
    ap.add_argument("--preload-first", default="")
    opts = ap.parse_args()
    harness.label = "drive-san" if opts.preload_first else "drive"
    # Without and with PTXMIG_SELF_TIME=1: the shim's own time per launch is measured only when asked.
    for self_time in ("", "1"):
        with case(f"app_direct[PTXMIG_SELF_TIME={self_time}]"):
            res = run_app(opts, "app_direct", {"PTXMIG_SELF_TIME": self_time},
                          {"k_test": (8, [((4, 1, 1), (256, 1, 1), 5), ((8, 1, 1), (128, 1, 1), 3)])},
                          {"device": 1 << 20}, ["cuModuleLoadData"], {"cuLaunchKernel": 6, "cuLaunchKernel_ptsz": 3},
                          expect_peer=1)
            if res:
                st = res[2]["self_time"]
                calls = sum(k["launches"] + k["failed"] for k in res[2]["kernels"])  # failed launch calls count too
                want = {"enabled": True, "launches": calls} if self_time else {"enabled": False, "launches": 0, "ns": 0}
                if self_time:
                    check(0 < st["clock_ns"] < 100000, f"app_direct: clock read cost {st['clock_ns']} ns")
                else:
                    want["clock_ns"] = 0
                check(all(st[k] == v for k, v in want.items()) and (st["ns"] > 0) == bool(self_time),
                      f"app_direct PTXMIG_SELF_TIME={self_time!r}: self_time {st}")
    # PTXMIG_PEER_ACCESS=0 (`ptxmig run --no-peer-access`): the GPUs answer as a pair without a peer
    # path, an enable is refused (217) and not counted; status says so. Without it, the driver's.
    for off in ("", "0"):
        with case(f"app_direct[PTXMIG_PEER_ACCESS={off}]"):
            res = run_app(opts, "app_direct", {"PTXMIG_PEER_ACCESS": off},
                          {"k_test": (8, [((4, 1, 1), (256, 1, 1), 5), ((8, 1, 1), (128, 1, 1), 3)])},
                          {"device": 1 << 20}, ["cuModuleLoadData"], {"cuLaunchKernel": 6, "cuLaunchKernel_ptsz": 3},
                          expect_peer=0 if off else 1)
            if res:
                want = "peer: can 0 access-supported 0 enable 217" if off else "peer: can 1 access-supported 1 enable 0"
                check(want in res[3], f"app_direct PTXMIG_PEER_ACCESS={off!r}: stderr lacks {want!r}: {res[3][-500:]}")
                st = res[1]
                check(st.get("peer_access_off") == bool(off) and st.get("peer_access_refused") == (2 if off else 0),
                      f"app_direct PTXMIG_PEER_ACCESS={off!r}: status peer_access_off {st.get('peer_access_off')}, "
                      f"refused {st.get('peer_access_refused')}")
    # Peer access off for a checkpoint: peer-off (quiesced, the lease's connection) disables every
    # link in the driver and says so in status; the app's own enable and disable meanwhile change
    # only the shim's table; the resume enables the links again.
    with case("app_direct[peer-off]"):
        peer_file = os.path.join(harness.scratch("ptxmig-peer-"), "links")

        def toggle(c, app):
            links = lambda: open(peer_file).read().strip()
            r = c.req(cmd="peer-off")
            check(not r["ok"] and "not quiesced" in r["error"], f"peer-off while running: {r}")
            path = c.s.getpeername()
            q = Conn(path)
            r = q.req(cmd="quiesce", budget_ms=100)
            check(r["ok"], f"quiesce: {r}")
            r = c.req(cmd="peer-off")
            check(not r["ok"] and "only the connection that quiesced" in r["error"], f"peer-off from another connection: {r}")
            r = q.req(cmd="peer-off")
            check(r["ok"] and r["result"]["links"] == 1 and r["result"]["changed"] and r["result"].get("largest_device_alloc") == 1 << 20,
                  f"peer-off: {r}")
            check(links() == "0", f"peer-off: the driver still has {links()} link(s)")
            st = c.req(cmd="status")["result"]
            check(st["peer_access"] == 1 and st["peer_access_suspended"] and st["peer_toggle"], f"status after peer-off: {st.get('peer_access')}, suspended {st.get('peer_access_suspended')}")
            # ptxmig refuses peer links beside a cuMemAlloc allocation over 256 MiB: the largest is reported.
            check(st.get("largest_device_alloc") == 1 << 20, f"status largest_device_alloc {st.get('largest_device_alloc')}, want the app's 1 MiB")
            r = q.req(cmd="peer-off")
            check(r["ok"] and not r["result"]["changed"], f"peer-off again: {r}")
            r = q.req(cmd="resume")
            check(r["ok"] and links() == "1", f"resume: {r}; the driver has {links()} link(s)")
            st = c.req(cmd="status")["result"]
            check(st["peer_access"] == 1 and not st["peer_access_suspended"], f"status after resume: suspended {st.get('peer_access_suspended')}")
            # A lease that goes away while peer access is off: on again before the resume.
            r = q.req(cmd="quiesce", budget_ms=100)
            r2 = q.req(cmd="peer-off")
            check(r["ok"] and r2["ok"] and links() == "0", f"quiesce + peer-off: {r} {r2}")
            q.close()
            deadline = time.time() + 5
            while time.time() < deadline and links() != "1":
                time.sleep(0.05)
            check(links() == "1", "lease closed while peer access was off: not enabled again")
            # A link whose peer context the driver no longer knows (400) is dropped at the resume:
            # the process runs on, the link gone from status.
            q = Conn(path)
            r, r2 = q.req(cmd="quiesce", budget_ms=100), q.req(cmd="peer-off")
            open(stale_file, "w").close()
            r3 = q.req(cmd="resume")
            os.unlink(stale_file)
            st = c.req(cmd="status")["result"]
            check(r["ok"] and r2["ok"] and r3["ok"] and st["peer_access"] == 0 and st["peer_links"] == [] and not st["peer_access_suspended"],
                  f"a stale link at the resume: {r3}; status peer_access {st.get('peer_access')}, links {st.get('peer_links')}")
            q.close()
            # The same found at peer-off: nothing to turn off, the link leaves the table.
            app.p.stdin.write("peer\n")
            app.p.stdin.flush()
            got = app.p.stdout.readline().strip()
            q = Conn(path)
            r = q.req(cmd="quiesce", budget_ms=100)
            open(stale_file, "w").close()
            r2 = q.req(cmd="peer-off")
            os.unlink(stale_file)
            st = c.req(cmd="status")["result"]
            r3 = q.req(cmd="resume")
            check(got == "peer 0" and r["ok"] and r2["ok"] and r3["ok"] and st["peer_access"] == 0,
                  f"a stale link at peer-off: app {got!r}, {r2}, {r3}; status peer_access {st.get('peer_access')}")
            q.close()
            # A link between live contexts that the driver refuses at its first enable after a
            # restore (400: twogpu on 2x H200) is tried again, not dropped; one it keeps refusing
            # fails the resume (the process stays held) and stays in the table, and goes on when
            # the driver takes it. (The stale case above left the link in the fake driver only.)
            app.p.stdin.write("unpeer\npeer\n")
            app.p.stdin.flush()
            got = app.p.stdout.readline().strip() + ", " + app.p.stdout.readline().strip()
            q = Conn(path)
            r, r2 = q.req(cmd="quiesce", budget_ms=100), q.req(cmd="peer-off")
            with open(refuse_file, "w") as f:
                f.write("1\n")
            r3 = q.req(cmd="resume")
            st = c.req(cmd="status")["result"]
            check(got == "unpeer 0, peer 0" and r["ok"] and r2["ok"] and r3["ok"] and links() == "1" and st["peer_access"] == 1,
                  f"a link refused once at the resume: app {got!r}, {r3}; the driver has {links()}; status {st.get('peer_links')}")
            r, r2 = q.req(cmd="quiesce", budget_ms=100), q.req(cmd="peer-off")
            with open(refuse_file, "w") as f:
                f.write("2\n")
            r3 = q.req(cmd="resume")
            st = c.req(cmd="status")["result"]
            check(r["ok"] and r2["ok"] and not r3["ok"] and "peer-on" in r3.get("error", "") and links() == "0" and
                  st["peer_access"] == 1 and st["peer_access_suspended"],
                  f"a link refused twice at the resume: {r3}; the driver has {links()}; status {st.get('peer_links')}")
            r3 = q.req(cmd="resume")
            st = c.req(cmd="status")["result"]
            check(r3["ok"] and links() == "1" and not st["peer_access_suspended"],
                  f"the resume again, the driver taking the link: {r3}; the driver has {links()}")
            q.close()

        stale_file = os.path.join(os.path.dirname(peer_file), "stale")
        refuse_file = os.path.join(os.path.dirname(peer_file), "refuse")
        run_app(opts, "app_direct", {"FAKE_CUDA_PEER_FILE": peer_file, "FAKE_CUDA_PEER_STALE": stale_file,
                                     "FAKE_CUDA_PEER_REFUSE": refuse_file, "APP_PEER": "1"},
                {"k_test": (8, [((4, 1, 1), (256, 1, 1), 5), ((8, 1, 1), (128, 1, 1), 3)])},
                {"device": 1 << 20}, ["cuModuleLoadData"], {"cuLaunchKernel": 6, "cuLaunchKernel_ptsz": 3},
                expect_peer=1, after=toggle)
    # A link the app enables while quiesced waits in the table (no link comes on behind a quiesce
    # that reported none) and goes on at the resume; a disable while running goes to the driver.
    with case("app_direct[peer while quiesced]"):
        peer_file2 = os.path.join(harness.scratch("ptxmig-peer2-"), "links")

        def deferred(c, app):
            links = lambda: open(peer_file2).read().strip()
            say = lambda cmd: (app.p.stdin.write(cmd + "\n"), app.p.stdin.flush(), app.p.stdout.readline().strip())[2]
            q = Conn(c.s.getpeername())
            r = q.req(cmd="quiesce", budget_ms=100)
            check(r["ok"] and r["result"].get("peer_links") == 1, f"quiesce with one link on: {r}")
            got = say("peer")
            st = c.req(cmd="status")["result"]
            on = sorted(l["on"] for l in st["peer_links"])
            check(got == "peer 0" and links() == "1" and st["peer_access"] == 2 and on == [False, True],
                  f"enable while quiesced: app {got!r}, driver links {links()}, status {st.get('peer_links')}")
            r = q.req(cmd="resume")
            st = c.req(cmd="status")["result"]
            check(r["ok"] and links() == "2" and all(l["on"] for l in st["peer_links"]) and not st["peer_access_suspended"],
                  f"resume: {r}; driver links {links()}, status {st.get('peer_links')}")
            got = say("unpeer")
            check(got == "unpeer 0" and links() == "1" and c.req(cmd="status")["result"]["peer_access"] == 1,
                  f"disable while running: app {got!r}, driver links {links()}")
            q.close()

        run_app(opts, "app_direct", {"APP_PEER": "1", "FAKE_CUDA_PEER_FILE": peer_file2},
                {"k_test": (8, [((4, 1, 1), (256, 1, 1), 5), ((8, 1, 1), (128, 1, 1), 3)])},
                {"device": 1 << 20}, ["cuModuleLoadData"], {"cuLaunchKernel": 6, "cuLaunchKernel_ptsz": 3},
                expect_peer=1, after=deferred)
    # Memory shared with other processes (CUDA IPC, VMM shareable handles, pools; ptxmig refuses to
    # checkpoint such a process): the live exports and imports in status, then none once undone.
    with case("app_direct[APP_SHARE=1]"):
        calls = (9, 9)  # exports: 3 IPC, 3 VMM, 1 pool, 2 pool pointers; imports: 4 IPC opens, 2 VMM, 2 pools, 1 pointer
        live = share_counts(5, 3, {"ipc_mem": (1, 1), "vmm": (2, 1), "pool": (1, 1), "pool_ptr": (1, 0)}, calls)

        def undo(c, app):
            app.p.stdin.write("cleanup\n")
            app.p.stdin.flush()
            line = app.p.stdout.readline().rstrip("\n")
            check(line == "clean", f"app_direct sharing: cleanup answered {line!r}")
            s = c.req(cmd="status")
            want = share_counts(0, 0, {}, calls)
            check(s["ok"] and s["result"].get("ipc") == want, f"app_direct sharing undone: ipc {s.get('result', {}).get('ipc')}, want {want}")

        run_app(opts, "app_direct", {"APP_SHARE": "1"},
                {"k_test": (8, [((4, 1, 1), (256, 1, 1), 5), ((8, 1, 1), (128, 1, 1), 3)])},
                {"device": 2 << 20, "async": 4096, "vmm_mapped": 3 * (2 << 20)}, ["cuModuleLoadData"],
                {"cuLaunchKernel": 6, "cuLaunchKernel_ptsz": 3, "cuIpcOpenMemHandle_v2": 3, "cuIpcOpenMemHandle": 1,
                 "cuMemExportToShareableHandle": 3, "cuMemImportFromShareableHandle": 2},
                expect_peer=1, expect_ipc=live, after=undo)
    # Collective alignment (a job's ranks stop right after the same collective before ptxmig locks
    # them): the count of NCCL-named launches, "passed", a hold right after launch `at` with the
    # next launch blocked, release by align 0, by closing the arming connection, and by resume.
    with case("app_direct[APP_COLL=1]"):
        def coll(c, app):
            path = c.s.getpeername()

            def send(n):
                app.p.stdin.write(f"coll {n}\n")
                app.p.stdin.flush()

            def line(timeout):
                r, _, _ = select.select([app.p.stdout], [], [], timeout)
                return app.p.stdout.readline().rstrip("\n") if r else None

            def st():
                return c.req(cmd="status")["result"].get("collectives")

            def wait(pred, what):
                for _ in range(500):
                    if pred(st()):
                        return True
                    time.sleep(0.01)
                return check(False, f"app_direct collectives: {what}: {st()}")

            check(st() == {"count": 0, "hold_at": 0, "held": False}, f"app_direct collectives at start: {st()}")
            # A brief status (ptxmig's preflight) leaves out the module list and nothing else.
            full, brief = c.req(cmd="status")["result"], c.req(cmd="status", brief=1)["result"]
            check(brief.get("brief") is True and brief["modules"] == [] and len(full["modules"]) == 2 and
                  {k: v for k, v in brief.items() if k not in ("modules", "brief", "uptime_s", "preempt")} ==
                  {k: v for k, v in full.items() if k not in ("modules", "uptime_s", "preempt")},
                  f"brief status: {brief}")
            send(3)
            check(line(10) == "coll done" and st()["count"] == 3, f"app_direct collectives: 3 launches: {st()}")
            a = Conn(path)
            r = a.req(cmd="align", at=2)
            check(r["ok"] and r["result"] == {"state": "passed", "collectives": 3, "at": 2}, f"align past the count: {r}")
            r = a.req(cmd="align", at=5)
            check(r["ok"] and r["result"] == {"state": "armed", "collectives": 3, "at": 5}, f"align at 5: {r}")
            send(4)  # launches 4 and 5 go; the gate closes after 5; the 6th waits
            wait(lambda x: x == {"count": 5, "hold_at": 5, "held": True}, "not held right after launch 5")
            check(line(0.3) is None, "app_direct collectives: a launch went past the alignment's gate")
            r = a.req(cmd="align", at=5)
            check(r["ok"] and r["result"]["state"] == "held", f"align again while held: {r}")
            r = a.req(cmd="align", at=0)
            check(r["ok"] and r["result"]["state"] == "running", f"align 0: {r}")
            check(line(10) == "coll done", "app_direct collectives: the held launch did not go on after align 0")
            check(st() == {"count": 7, "hold_at": 0, "held": False}, f"after the release: {st()}")
            a.req(cmd="align", at=9)
            a.close()  # the arming is the connection's lease
            wait(lambda x: x["hold_at"] == 0, "closing the arming connection did not disarm")
            send(3)
            check(line(10) == "coll done" and st() == {"count": 10, "hold_at": 0, "held": False}, f"after the lease: {st()}")
            b = Conn(path)
            b.req(cmd="align", at=12)
            send(3)
            wait(lambda x: x["held"] and x["count"] == 12, "not held at 12")
            r = b.req(cmd="resume")
            check(r["ok"] and line(10) == "coll done" and st() == {"count": 13, "hold_at": 0, "held": False},
                  f"resume ends the alignment: {r} {st()}")
            b.close()

        run_app(opts, "app_direct", {"APP_COLL": "1"},
                {"k_test": (8, [((4, 1, 1), (256, 1, 1), 5), ((8, 1, 1), (128, 1, 1), 3)])},
                {"device": 1 << 20}, ["cuModuleLoadData", "cuModuleLoadData"], {"cuLaunchKernel": 6, "cuLaunchKernel_ptsz": 3},
                expect_peer=1, after=coll)
    # Every launch sampled: the shim reuses idle events instead of creating two per sampled launch.
    with case("app_direct[PTXMIG_SAMPLE_FIRST=100]"):
        res = run_app(opts, "app_direct", {"PTXMIG_SAMPLE_FIRST": "100", "FAKE_CUDA_EVENT_STATS": "1"},
                      {"k_test": (8, [((4, 1, 1), (256, 1, 1), 5), ((8, 1, 1), (128, 1, 1), 3)])},
                      {"device": 1 << 20}, ["cuModuleLoadData"], {"cuLaunchKernel": 6, "cuLaunchKernel_ptsz": 3},
                      expect_peer=1)
        if res:
            k = kernel(res[2], "k_test")
            m = re.search(r"fake-events created=(\d+) destroyed=(\d+)", res[3])
            check(k and k["timed"] >= 7, f"app_direct sampling every launch: timed {k and k['timed']}, want >= 7")
            check(m and 2 <= int(m.group(1)) <= 4, f"app_direct sampling every launch: events not reused: {m and m.group(0)}")
    with case("app_dlsym"):
        res = run_app(opts, "app_dlsym", {}, {"k_test": (7, [((2, 2, 1), (32, 2, 1), 7)])},
                      {"device": 3 << 20}, ["cuModuleLoadData"], {"cuLaunchKernel": 7})
        if res:
            check(res[1]["interception"]["dlsym"] >= 8, f"app_dlsym: dlsym hits {res[1]['interception']}")
    with case("app_getproc"):
        res = run_app(opts, "app_getproc", {},
                      {"k_test": (10, [((1, 1, 1), (64, 1, 1), 4), ((3, 1, 1), (96, 1, 1), 6)])},
                      {"device": 5 << 20, "async": 7 << 20}, ["cuModuleLoadData", "cuLibraryLoadData"],
                      {"cuLaunchKernel": 0, "cuLaunchKernel_ptsz": 4, "cuLaunchKernelEx": 6, "cuGetExportTable": 1,
                       "cuMemAllocAsync_ptsz": 1})
        if res:
            i = res[1]["interception"]
            check(i["cuGetProcAddress"] >= 1 and i["cuGetProcAddress_v2"] >= 10, f"app_getproc: resolver hits {i}")
    # The real driver's resolver returns internal entry points, not its exported symbols' addresses:
    # the shim must recognise them by (symbol, version, flags) and still see every launch.
    with case("app_getproc[FAKE_CUDA_INTERNAL_PTRS=1]"):
        res = run_app(opts, "app_getproc", {"FAKE_CUDA_INTERNAL_PTRS": "1"},
                      {"k_test": (10, [((1, 1, 1), (64, 1, 1), 4), ((3, 1, 1), (96, 1, 1), 6)])},
                      {"device": 5 << 20, "async": 7 << 20}, ["cuModuleLoadData", "cuLibraryLoadData"],
                      {"cuLaunchKernel": 0, "cuLaunchKernel_ptsz": 4, "cuLaunchKernelEx": 6, "cuGetExportTable": 1,
                       "cuMemAllocAsync_ptsz": 1})
        if res:
            i = res[1]["interception"]
            check(i["by_name"] >= 5, f"app_getproc with internal pointers: by-name matches {i}")
    # The same host code built by CUDA 13.0 (Zstd entries) and by CUDA 12.4 (LZ4 entries, PTX that
    # the build machine's ptxas 12.4 must assemble).
    for name, codec, need_ptxas in (("app_runtime", "zstd", False), ("app_runtime_cu12", "lz4", True)):
        with case(name):
            res = run_app(opts, name, {},
                          {"fx_scale": (3, [((2, 1, 1), (128, 1, 1), 3)]),
                           "_Z6fx_addIfEvPT_PKS0_i": (3, [((2, 1, 1), (128, 1, 1), 3)])},
                          {"device": 2 << 20}, ["__cudaRegisterFatBinary", "cuLibraryLoadData"], {},
                          want_ptx_entry=codec, need_ptxas=need_ptxas)
            if not res:
                continue
            mods = res[1]["modules"]
            check(all(m["format"] == "fatbin" and m["ptx"] == 1 and m["elf"] == 1 and m["archs"] == "sm_90,compute_90"
                      for m in mods), f"{name}: modules {mods}")
            check(res[1]["interception"]["cudaGetDriverEntryPoint"] >= 1, f"{name}: entry point hits {res[1]['interception']}")
            # A registered fatbin is borrowed in place, and the lazy load of the same bytes shares it.
            reg = [m for m in mods if m["source"] == "__cudaRegisterFatBinary"]
            lib = [m for m in mods if m["source"] == "cuLibraryLoadData"]
            check(reg and all(m["image"] == "borrowed" for m in reg), f"{name}: registrations not borrowed: {reg}")
            check(lib and all(m["image"] == "borrowed" and m.get("same_image_as") in [r["id"] for r in reg] for m in lib),
                  f"{name}: lazy loads do not share the registration's bytes: {lib}")
            mb = res[1]["module_bytes"]
            check(mb["copied"] == 0 and mb["borrowed"] == sum(m["bytes"] for m in reg + lib), f"{name}: module_bytes {mb}")
    # The registration ends and its bytes are unmapped while the library stays loaded: the library
    # keeps a private copy of the same bytes and status/dump never touch the unmapped pages.
    # CUDA 13 (plain entries) and CUDA 12.4 (LZ4 entries for two architectures, whose PTX the
    # build machine's ptxas must assemble from the private copy).
    testdata = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "testdata")
    for fb, need_ptxas in ((os.path.join(testdata, "fatbin", "multi_plain.fatbin"), False),
                           (os.path.join(testdata, "fatbin-cu12", "multi_compressall.fatbin"), True)):
        with case(f"app_unregister[{os.path.basename(os.path.dirname(fb))}/{os.path.basename(fb)}]"):
            res = run_app(opts, "app_unregister", {"FATBIN": fb}, {}, {}, ["__cudaRegisterFatBinary", "cuLibraryLoadData"], {},
                          need_ptxas=need_ptxas)
            if not res:
                continue
            want = hashlib.sha256(open(fb, "rb").read()).hexdigest()
            mods = {m["source"]: m for m in res[1]["modules"]}
            reg, lib = mods["__cudaRegisterFatBinary"], mods["cuLibraryLoadData"]
            check(not reg["loaded"] and reg.get("not_captured") == "unloaded" and "image" not in reg,
                  f"app_unregister {fb}: registration after unregister: {reg}")
            check(lib["loaded"] and lib.get("image") == "copy" and lib.get("sha256") == want and "same_image_as" not in lib,
                  f"app_unregister {fb}: library after its registration ended: {lib} (want sha256 {want})")
            mb = res[1]["module_bytes"]
            check(mb["borrowed"] == 0 and mb["copied"] == lib["bytes"], f"app_unregister {fb}: module_bytes {mb}")
    # The runtime's registration fails (NULL handle, later unregistered as NULL): the shim cannot
    # match the end of that registration, so it must not borrow its bytes; the load keeps a copy.
    with case("app_unregister[FAKE_CUDART_REGISTER_FAIL=1]"):
        fb = os.path.join(testdata, "fatbin-cu12", "multi_compressall.fatbin")
        res = run_app(opts, "app_unregister", {"FATBIN": fb, "FAKE_CUDART_REGISTER_FAIL": "1"}, {}, {},
                      ["cuLibraryLoadData"], {}, need_ptxas=True)
        if res:
            want = hashlib.sha256(open(fb, "rb").read()).hexdigest()
            lib = res[1]["modules"][0]
            check(lib["loaded"] and lib.get("image") == "copy" and lib.get("sha256") == want,
                  f"app_unregister with a failed registration: {lib} (want sha256 {want})")
            mb = res[1]["module_bytes"]
            check(mb["borrowed"] == 0 and mb["copied"] == lib["bytes"], f"app_unregister with a failed registration: module_bytes {mb}")
    summary = harness.summary(opts.shim)
    if failures:
        print(f"drive.py: {summary}", file=sys.stderr)
        sys.exit(1)
    print(f"drive.py: {summary}")


if __name__ == "__main__":
    main()
