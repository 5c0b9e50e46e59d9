#!/usr/bin/env python3
"""Preemption tests of the shim against the fake driver (see run.sh): instrumented module loads
(real ptxmig helper, failing helpers, the cache), twin launches with private argument copies, the
gate, the tail rule, honest synchronisation, the lease, detach/resume, protocol garbage, and the
control socket after a CRIU dump+restore. Results go to $SHIM_RESULTS like drive.py's."""
import argparse, json, os, select, shutil, socket, stat, subprocess, sys, time

import harness
from harness import Conn, case, check, failures, required, result, skip

OPTS = None

class App:
    """app_preempt under the shim, driven line by line."""

    def __init__(self, tmp, env_extra, exe="app_preempt", shim=True):
        self.tmp = tmp
        self.sockdir = os.path.join(tmp, "sock")
        env = dict(os.environ, LD_LIBRARY_PATH=os.path.join(OPTS.build, "fake"), PTXMIG_SOCKET_DIR=self.sockdir,
                   PTXMIG_PTX_CACHE=os.path.join(tmp, "cache"), PTXMIG_PREEMPT="always", FAKE_CUDA_BLOCK_US="2000",
                   # The fake driver runs twins from PTX only (it reads their parameters there); t_cubin
                   # covers the cubin the shim asks its helper for by default.
                   PTXMIG_PTX_CUBIN="0")
        if os.path.exists(os.path.join(OPTS.build, "ptxmig")):
            env["PTXMIG_HELPER"] = os.path.abspath(os.path.join(OPTS.build, "ptxmig"))
        if shim:
            env["LD_PRELOAD"] = " ".join(x for x in [OPTS.preload_first, OPTS.shim] if x)
        for k, v in env_extra.items():
            if v is None:
                env.pop(k, None)
            else:
                env[k] = v
        self.p = subprocess.Popen([os.path.join(OPTS.build, exe)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, env=env, text=True, bufsize=1)
        self.rbuf = b""
        while True:
            line = self.line(20)
            if line == "ready":
                break
            if line is None:
                raise RuntimeError(f"app not ready: {self.p.stderr.read() if self.p.poll() is not None else ''}")
        self.path = os.path.join(self.sockdir, f"{self.p.pid}.sock")

    def line(self, timeout=10):
        """The next line of output, or None after timeout seconds (own buffering: select() on a
        buffered pipe file would miss lines already read ahead)."""
        end = time.time() + timeout
        fd = self.p.stdout.fileno()
        while b"\n" not in self.rbuf:
            left = end - time.time()
            if left <= 0:
                return None
            r, _, _ = select.select([fd], [], [], left)
            if r:
                chunk = os.read(fd, 4096)
                if not chunk:
                    return None
                self.rbuf += chunk
        l, self.rbuf = self.rbuf.split(b"\n", 1)
        return l.decode()

    def cmd(self, c, expect=True, timeout=10):
        self.p.stdin.write(c + "\n")
        self.p.stdin.flush()
        if expect:
            return self.line(timeout)
        return None

    def expect_none(self, secs):
        """No output for secs seconds (a thread must still be blocked)."""
        return self.line(secs)

    def conn(self):
        return Conn(self.path, 20)

    def finish(self):
        try:
            self.cmd("quit", expect=False)
            self.p.stdin.close()
        except BrokenPipeError:
            pass
        try:
            rc = self.p.wait(20)
        except subprocess.TimeoutExpired:
            self.p.kill()
            rc = self.p.wait()
        err = self.p.stderr.read()
        return rc, err


def kern(c, name):
    ks = [k for k in c.req(cmd="kernels")["result"]["kernels"] if k["name"] == name]
    return ks[0] if ks else None


def ended_ok(name, app):
    rc, err = app.finish()
    check(rc == 0, f"{name}: app exit {rc}: {err[-1500:]}")


def have_helper():
    return os.path.exists(os.path.join(OPTS.build, "ptxmig"))


def with_app(name, env=None, exe="app_preempt"):
    tmp = harness.scratch("ptxmig-preempt-")
    return tmp, App(tmp, env or {}, exe)


# ---- the cases ----

def t_basic(name, env):
    tmp, app = with_app(name, env)
    c = app.conn()
    s = c.req(cmd="status")["result"]
    check(s["proto"] == 2 and s["preempt"]["mode"] == "always", f"{name}: status {s.get('proto')} {s.get('preempt')}")
    check(s["preempt"]["instrumented_modules"] == 1, f"{name}: instrumented modules {s['preempt']}")
    check(app.cmd("launch s 400") == "launched s", f"{name}: launch")
    time.sleep(0.05)
    k = kern(c, "k_count")
    check(k and k["twin"] is True and k["twin_reason"] is None and k["twin_launches"] == 1, f"{name}: kernels k_count {k}")
    kr = kern(c, "k_refused")
    check(kr and kr["twin"] is False and kr["twin_reason"].startswith("refused by ptxstate: reads %envreg1"),
          f"{name}: k_refused {kr}")
    q = c.req(cmd="quiesce", budget_ms=500)
    r = q["result"]
    check(q["ok"] and r["state"] == "quiesced" and r["gate"] == "closed", f"{name}: quiesce {q}")
    p = r.get("preempted", [])
    check(len(p) == 1 and p[0]["kernel"] == "k_count" and 0 < p[0]["blocks_done"] < p[0]["blocks_total"] == 400,
          f"{name}: preempted {p}")
    check(r["elapsed_us"] < 500000, f"{name}: quiesce took {r['elapsed_us']} us")
    st = c.req(cmd="status")["result"]["preempt"]
    check(st["state"] == "quiesced" and st["preempted_pending"] == 1, f"{name}: status while quiesced {st}")
    # A stream query while the twin's remainder has not run: not ready.
    check(app.cmd("query s") == "query 600", f"{name}: cuStreamQuery while preempted is not NOT_READY")
    rs = c.req(cmd="resume")["result"]
    check(rs["was"] == "quiesced" and rs["relaunched"] == 1 and rs["state"] == "running", f"{name}: resume {rs}")
    check(app.cmd("check", timeout=30) == "check ok 1 launches, 0 bad blocks", f"{name}: blocks after resume")
    c.close()
    ended_ok(name, app)
    shutil.rmtree(tmp, ignore_errors=True)


def t_jit_cache(name):
    """A cubin compiled by NVRTC under the shim, loaded again in a later run straight from a file
    (CuPy's kernel cache: no compiler call) gets its twins from the PTX cache's <sha>.jit.ptx; with
    an empty PTX cache it loads as it is, without twins."""
    tmp = harness.scratch("ptxmig-jitcache-")
    cache, cubin = os.path.join(tmp, "ptxcache"), os.path.join(tmp, "k.cubin")
    first = App(tmp, {"APP_MODULE": "nvrtc", "APP_SAVE_CUBIN": cubin, "PTXMIG_PTX_CACHE": cache})
    c = first.conn()
    check(kern(c, "k_count")["twin"] is True, f"{name}: first run (NVRTC): no twin")
    c.close()
    ended_ok(name, first)
    kept = [f for f in os.listdir(cache) if f.endswith(".jit-v1.ptx")]
    check(len(kept) == 1, f"{name}: PTX cache entries for JIT cubins: {os.listdir(cache)}")
    if kept:
        st = os.stat(os.path.join(cache, kept[0]))
        check(stat.S_IMODE(st.st_mode) == 0o600, f"{name}: {kept[0]} mode {oct(st.st_mode)}")
    for label, env, twin in (("cached", {"PTXMIG_PTX_CACHE": cache}, True),
                             ("cold", {"PTXMIG_PTX_CACHE": os.path.join(tmp, "empty")}, False)):
        app = App(tmp, dict(env, APP_MODULE="cubin", APP_CUBIN=cubin))
        c = app.conn()
        k = kern(c, "k_count")
        if twin:
            check(k and k["twin"] is True, f"{name}: {label}: the cached cubin got no twin: {k}")
            check(app.cmd("launch s 300") == "launched s", f"{name}: {label}: launch")
            r = c.req(cmd="quiesce", budget_ms=500)["result"]
            check(len(r.get("preempted", [])) == 1, f"{name}: {label}: preempted {r}")
            c.req(cmd="resume")
            check(app.cmd("check", timeout=30) == "check ok 1 launches, 0 bad blocks", f"{name}: {label}: blocks")
        else:
            check(k is not None and k["twin"] is False and "no PTX" in (k["twin_reason"] or ""),
                  f"{name}: {label}: a cubin with no known PTX: {k}")
        c.close()
        ended_ok(name, app)
    shutil.rmtree(tmp, ignore_errors=True)


def t_jit_many(name):
    """Several NVRTC programs compiled before any is loaded, without a PTX cache: each cubin's PTX
    stays known in memory (one record per cubin, none overwriting another), so every module gets
    its twins."""
    tmp, app = with_app(name, {"APP_MODULE": "nvrtc", "APP_JIT_EXTRA": "3", "PTXMIG_PTX_CACHE": "off"})
    c = app.conn()
    st = c.req(cmd="status")["result"]["preempt"]
    check(st["instrumented_modules"] == 4, f"{name}: instrumented modules {st['instrumented_modules']}, want 4")
    k = kern(c, "k_count")
    check(k and k["twin"] is True, f"{name}: k_count {k}")
    c.close()
    ended_ok(name, app)
    shutil.rmtree(tmp, ignore_errors=True)


def t_jit_no_twin(name, env, why):
    """A JIT cubin whose PTX the shim cannot vouch for loads as it is: no twins, the app runs."""
    tmp, app = with_app(name, env)
    c = app.conn()
    k = kern(c, "k_count")
    check(k is not None and k["twin"] is False and why in (k["twin_reason"] or ""), f"{name}: k_count {k}")
    # (The fake driver runs no original kernel from a cubin: the app's own lookups of both
    # kernels, done before it said "ready", are what must work.)
    c.close()
    ended_ok(name, app)
    shutil.rmtree(tmp, ignore_errors=True)


def t_free_attrs(name):
    tmp, app = with_app(name)
    c = app.conn()
    check(app.cmd("bigshm s 300") == "launched s", f"{name}: launch with 64 KiB of dynamic shared memory")
    k = kern(c, "k_count")
    check(k["twin_launches"] == 1 and k["twin_fallbacks"] == 0, f"{name}: attribute not replayed on the twin: {k}")
    r = c.req(cmd="quiesce", budget_ms=500)["result"]
    check(len(r["preempted"]) == 1, f"{name}: preempted {r}")
    app.cmd("free", expect=False)  # cuMemFree must not run while a remainder is pending
    check(app.expect_none(0.4) is None, f"{name}: cuMemFree returned while a twin awaited its relaunch")
    c.req(cmd="resume")
    check(app.line(10) == "freed", f"{name}: cuMemFree after resume")
    check(app.cmd("check", timeout=30) == "check ok 1 launches, 0 bad blocks", f"{name}: blocks")
    c.close()
    ended_ok(name, app)


def t_legacy_extra(name):
    tmp, app = with_app(name, {"FAKE_CUDA_NO_PARAM_INFO": "1"})
    c = app.conn()
    app.cmd("launch l 300 x")
    time.sleep(0.05)
    r = c.req(cmd="quiesce", budget_ms=500)["result"]
    check(len(r["preempted"]) == 1 and r["preempted"][0]["stream"] == "0x0", f"{name}: preempted {r}")
    c.req(cmd="resume")
    check(app.cmd("check", timeout=30) == "check ok 1 launches, 0 bad blocks", f"{name}: blocks")
    check(kern(c, "k_count")["twin_launches"] == 1, f"{name}: twin launches")
    c.close()
    ended_ok(name, app)


def t_tail(name):
    # The fallback: with holding off, work submitted behind a twin makes it undrainable.
    tmp, app = with_app(name, {"PTXMIG_PREEMPT_HOLD": "0"})
    c = app.conn()
    app.cmd("launch s 100")  # 0.2 s: drained
    app.cmd("launch s 300")  # the stream's tail: preempted
    r = c.req(cmd="quiesce", budget_ms=5000)["result"]
    check([d["launch"] for d in r["drained"]] == [1], f"{name}: drained {r['drained']}")
    check([p["launch"] for p in r["preempted"]] == [2], f"{name}: preempted {r['preempted']}")
    c.req(cmd="resume")
    check(app.cmd("check", timeout=30) == "check ok 2 launches, 0 bad blocks", f"{name}: blocks")
    # An event recorded after the twin: the twin is not the tail; the budget runs out.
    app.cmd("launch n 300")
    app.cmd("event n")
    r = c.req(cmd="quiesce", budget_ms=50)["result"]
    ns = r["not_stopped"]
    check(len(ns) == 1 and ns[0]["reason"] == "not the tail of its stream" and not r["preempted"],
          f"{name}: twin with an event behind it: {r}")
    c.req(cmd="resume")
    check(app.cmd("check", timeout=30) == "check ok 3 launches, 0 bad blocks", f"{name}: blocks")
    # Work on the legacy stream behind a twin of a blocking stream: not the tail either.
    app.cmd("launch s 300")
    app.cmd("refused l")
    r = c.req(cmd="quiesce", budget_ms=50)["result"]
    check(len(r["not_stopped"]) == 1 and not r["preempted"], f"{name}: twin with legacy work behind it: {r}")
    c.req(cmd="resume")
    check(app.cmd("check", timeout=30) == "check ok 4 launches, 0 bad blocks", f"{name}: blocks")
    # A host function behind the twin: drained, and it runs only after the twin.
    app.cmd("launch s 100")
    check(app.cmd("hostfn s") == "queued s", f"{name}: hostfn")
    r = c.req(cmd="quiesce", budget_ms=3000)["result"]
    check(not r["preempted"] and [d["launch"] for d in r["drained"]] == [5], f"{name}: twin with a host function behind it: {r}")
    check(app.line(5) == "hostfn ran", f"{name}: host function")
    c.req(cmd="resume")
    check(app.cmd("check", timeout=30) == "check ok 5 launches, 0 bad blocks", f"{name}: blocks")
    c.close()
    ended_ok(name, app)


def t_hold(name):
    # Holding (the default): a submission that would queue behind a twin in flight waits in the shim
    # until the twin has finished, so the twin stays its stream's tail and a quiesce preempts it;
    # the held call returns only after the twin's remainder ran (after resume), in order.
    tmp, app = with_app(name)
    c = app.conn()
    app.cmd("launch s 100")  # 0.2 s
    t0 = time.time()
    check(app.cmd("launch s 300") == "launched s", f"{name}: second launch")  # held until the first ends
    check(time.time() - t0 >= 0.1, f"{name}: a launch behind a twin on its stream was not held ({time.time() - t0:.3f} s)")
    r = c.req(cmd="quiesce", budget_ms=1000)["result"]
    check([p["launch"] for p in r["preempted"]] == [2] and not r["drained"] and not r["not_stopped"],
          f"{name}: the second twin, its stream's tail, preempted: {r}")
    c.req(cmd="resume")
    # Each kind of submission behind a twin is held: an event, a host function, legacy-stream work
    # behind a blocking stream's twin, a launch on a blocking stream behind a legacy twin; each time
    # the twin is preempted, the held call stays blocked while quiesced and completes after resume.
    for launch_on, then, reply in [("n", "event n", "recorded n"), ("s", "hostfn s", "queued s"),
                                   ("s", "refused l", "launched l"), ("l", "launch s 10", "launched s")]:
        check(app.cmd("check", timeout=30).startswith("check ok"), f"{name}: blocks before {then}")
        app.cmd(f"launch {launch_on} 300")
        app.cmd(then, expect=False)
        time.sleep(0.05)
        r = c.req(cmd="quiesce", budget_ms=1000)["result"]
        check(len(r["preempted"]) == 1 and not r["not_stopped"] and not r["drained"],
              f"{name}: {then} behind a twin on {launch_on}: the twin is preempted: {r}")
        check(app.expect_none(0.3) is None, f"{name}: {then} returned while its twin was preempted")
        c.req(cmd="resume")
        got = [app.line(15)]
        if then.startswith("hostfn"):  # the host function's line may come first
            got = sorted(got + [app.line(10)])
            reply = sorted([reply, "hostfn ran"])
        else:
            got, reply = got[0], reply
        check(got == reply, f"{name}: {then} after resume: {got}")
    check(app.cmd("check", timeout=30).startswith("check ok") , f"{name}: blocks")
    st = c.req(cmd="status")["result"]["preempt"]
    check(st["hold"] is True and st["holds"] >= 5 and st["hold_ms"] > 0, f"{name}: status {st}")
    c.close()
    ended_ok(name, app)


def t_hold_not_started(name):
    # A twin still queued behind other work after 50 ms may wait for something only the held
    # thread would do next: the submission behind it goes ahead instead of waiting (no deadlock).
    tmp, app = with_app(name, {"PTXMIG_PREEMPT": "auto", "FAKE_CUDA_BLOCK_US": "50000"})
    c = app.conn()
    app.cmd("launch s 8")   # one wave: the original, 8 x 50 ms on stream s
    app.cmd("launch s 40")  # a twin, queued behind it
    t0 = time.time()
    check(app.cmd("event s") == "recorded s", f"{name}: event behind a queued twin")
    took = time.time() - t0
    check(took < 0.3, f"{name}: the event waited {took:.3f} s for a twin that had not started")
    st = c.req(cmd="status")["result"]["preempt"]
    check(st["hold_not_started"] >= 1, f"{name}: status {st}")
    check(app.cmd("check", timeout=60).startswith("check ok"), f"{name}: blocks")
    c.close()
    ended_ok(name, app)


def wait_status(c, cond, secs=5):
    end = time.time() + secs
    while True:
        st = c.req(cmd="status")["result"]["preempt"]
        if cond(st) or time.time() > end:
            return st
        time.sleep(0.02)


def t_late_stop(name):
    # Twins that stop only after the budget: the fake twin claims batches of 16 blocks of 5 ms
    # (as ptxstate's do) and sees the flag only between claims, ~80 ms after the raise.
    tmp, app = with_app(name, {"FAKE_CUDA_TWIN_BATCH": "1", "FAKE_CUDA_BLOCK_US": "5000", "PTXMIG_PREEMPT_BATCH_MAX": "16"})
    c = app.conn()
    app.cmd("launch s 400")
    app.cmd("sync s", expect=False)  # a thread inside cuStreamSynchronize behind the twin
    time.sleep(0.03)
    r = c.req(cmd="quiesce", budget_ms=2)["result"]
    ns = r["not_stopped"]
    check(len(ns) == 1 and ns[0]["reason"] == "still running after the budget" and ns[0].get("stopping") is True
          and r.get("stopping") == [ns[0]["launch"]] and not r["preempted"], f"{name}: quiesce {r}")
    # The raiser keeps the flag raised and classifies the twin once it ended: preempted.
    st = wait_status(c, lambda st: st["stopping"] == 0)
    check(st["stopping"] == 0 and st["preempted_pending"] == 1 and st["preempted"] == 1 and st["state"] == "quiesced",
          f"{name}: status after the twin ended {st}")
    check(app.expect_none(0.4) is None, f"{name}: cuStreamSynchronize returned while the twin awaited its relaunch")
    check(app.cmd("query s") == "query 600", f"{name}: cuStreamQuery while preempted is not NOT_READY")
    check(c.req(cmd="status")["result"]["preempt"]["twins_in_flight"] == 0, f"{name}: something relaunched while quiesced")
    rs = c.req(cmd="resume")["result"]
    check(rs["relaunched"] == 1 and rs["still_stopping"] == 0, f"{name}: resume {rs}")
    check(app.line(15) == "synced s", f"{name}: sync after resume")
    check(app.cmd("check", timeout=30) == "check ok 1 launches, 0 bad blocks", f"{name}: blocks after resume")
    # A raised twin that ends with no block left (one batch of 16 already claimed): done, and the
    # thread syncing on it is released although still quiesced; nothing is relaunched.
    app.cmd("launch s 16")
    app.cmd("sync s", expect=False)
    time.sleep(0.03)
    r = c.req(cmd="quiesce", budget_ms=2)["result"]
    check(len(r["not_stopped"]) == 1 and len(r["stopping"]) == 1, f"{name}: quiesce (one batch) {r}")
    check(app.line(5) == "synced s", f"{name}: sync on a twin that completed after the budget")
    st = wait_status(c, lambda st: st["stopping"] == 0)
    check(st["stopping"] == 0 and st["preempted_pending"] == 0, f"{name}: status {st}")
    rs = c.req(cmd="resume")["result"]
    check(rs["relaunched"] == 0, f"{name}: resume {rs}")
    check(app.cmd("check", timeout=30) == "check ok 2 launches, 0 bad blocks", f"{name}: blocks")
    # Resume while the twin is still stopping: it waits for the end, then relaunches the remainder.
    app.cmd("launch s 400")
    time.sleep(0.03)
    r = c.req(cmd="quiesce", budget_ms=2)["result"]
    check(len(r["stopping"]) == 1, f"{name}: quiesce {r}")
    rs = c.req(cmd="resume")["result"]
    check(rs["relaunched"] == 1 and rs["still_stopping"] == 0, f"{name}: resume while stopping {rs}")
    check(app.cmd("check", timeout=30) == "check ok 3 launches, 0 bad blocks", f"{name}: blocks")
    c.close()
    ended_ok(name, app)
    shutil.rmtree(tmp, ignore_errors=True)


def t_batch_max(name):
    # batch_max from the sampled time per block: the fake's twin runs its blocks one after the
    # other (300 us each) and has 8 CTAs (occupancy 2 x 4 SMs), so a block is timed at ~2.4 ms
    # of a real wave: batch_max 1. Untimed: the default 16.
    tmp, app = with_app(name, {"FAKE_CUDA_BLOCK_US": "300"})
    c = app.conn()
    app.cmd("launch s 400")
    time.sleep(0.02)
    r = c.req(cmd="quiesce", budget_ms=500)["result"]
    check(len(r["preempted"]) == 1 and r["preempted"][0]["batch_max"] == 16, f"{name}: untimed kernel {r}")
    c.req(cmd="resume")
    check(app.cmd("check", timeout=30) == "check ok 1 launches, 0 bad blocks", f"{name}: blocks")
    app.cmd("launch s 40")  # timed whole (the first launch's sample covered only its preempted part)
    check(app.cmd("check", timeout=30) == "check ok 2 launches, 0 bad blocks", f"{name}: blocks")
    app.cmd("launch s 400")
    time.sleep(0.02)
    r = c.req(cmd="quiesce", budget_ms=500)["result"]
    check(len(r["preempted"]) == 1 and r["preempted"][0]["batch_max"] == 1, f"{name}: timed kernel {r}")
    c.req(cmd="resume")
    check(app.cmd("check", timeout=30) == "check ok 3 launches, 0 bad blocks", f"{name}: blocks")
    c.close()
    ended_ok(name, app)
    # The override.
    tmp2, app = with_app(name, {"FAKE_CUDA_BLOCK_US": "300", "PTXMIG_PREEMPT_BATCH_MAX": "4"})
    c = app.conn()
    check(c.req(cmd="status")["result"]["preempt"]["batch_max"] == 4, f"{name}: status batch_max")
    app.cmd("launch s 400")
    time.sleep(0.02)
    r = c.req(cmd="quiesce", budget_ms=500)["result"]
    check(len(r["preempted"]) == 1 and r["preempted"][0]["batch_max"] == 4, f"{name}: PTXMIG_PREEMPT_BATCH_MAX=4 {r}")
    c.req(cmd="resume")
    check(app.cmd("check", timeout=30) == "check ok 1 launches, 0 bad blocks", f"{name}: blocks")
    c.close()
    ended_ok(name, app)
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.rmtree(tmp2, ignore_errors=True)


def t_gate(name):
    tmp, app = with_app(name)
    c = app.conn()
    r = c.req(cmd="quiesce", budget_ms=20)["result"]
    check(r["state"] == "quiesced" and not r["preempted"], f"{name}: quiesce {r}")
    app.cmd("bg s 10", expect=False)
    check(app.expect_none(0.5) is None, f"{name}: a launch went through the closed gate")
    c2 = app.conn()  # other clients are served while the lease is held
    check(c2.req(cmd="status")["result"]["preempt"]["gate"] == "closed", f"{name}: status on a second connection")
    s = socket.socket(socket.AF_UNIX)
    s.connect(app.path)
    s.sendall(os.urandom(3000) + b"\n")  # garbage on a third connection
    s.close()
    c2.close()
    rs = c.req(cmd="resume")["result"]
    check(rs["relaunched"] == 0, f"{name}: resume {rs}")
    check(app.line(5) == "bglaunched s", f"{name}: the blocked launch did not proceed after resume")
    check(app.cmd("check", timeout=30) == "check ok 1 launches, 0 bad blocks", f"{name}: blocks")
    c.close()
    ended_ok(name, app)


def t_sync(name):
    tmp, app = with_app(name)
    c = app.conn()
    app.cmd("launch n 400")
    app.cmd("sync n", expect=False)  # a thread inside cuStreamSynchronize (in the fake driver)
    app.cmd("launch l 400")
    app.cmd("memcpy", expect=False)  # a thread in a synchronous copy behind the legacy twin
    time.sleep(0.1)
    r = c.req(cmd="quiesce", budget_ms=1000)["result"]
    check(sorted(p["stream"] == "0x0" for p in r["preempted"]) == [False, True],
          f"{name}: both twins preempted (a copy waiting behind one must not make it undrainable): {r}")
    check(app.expect_none(0.5) is None, f"{name}: a sync returned while its twin was preempted")
    c.req(cmd="resume")
    got = sorted(filter(None, [app.line(10), app.line(10)]))
    check(got == ["memcpied", "synced n"], f"{name}: after resume: {got}")
    check(app.cmd("check", timeout=30) == "check ok 2 launches, 0 bad blocks", f"{name}: blocks")
    # ctx-wide sync during a checkpoint
    app.cmd("launch n 300")
    app.cmd("ctxsync", expect=False)
    time.sleep(0.05)
    r = c.req(cmd="quiesce", budget_ms=1000)["result"]
    check(len(r["preempted"]) == 1, f"{name}: preempted {r}")
    check(app.expect_none(0.3) is None, f"{name}: cuCtxSynchronize returned while a twin was preempted")
    c.req(cmd="resume")
    check(app.line(10) == "ctxsynced", f"{name}: ctxsync after resume")
    check(app.cmd("check", timeout=30) == "check ok 3 launches, 0 bad blocks", f"{name}: blocks")
    c.close()
    ended_ok(name, app)


def t_lease(name):
    tmp, app = with_app(name)
    a = app.conn()
    app.cmd("launch s 400")
    r = a.req(cmd="quiesce", budget_ms=500)["result"]
    check(len(r["preempted"]) == 1, f"{name}: preempted {r}")
    b = app.conn()
    again = b.req(cmd="quiesce", budget_ms=5)["result"]
    check(again == r, f"{name}: a second quiesce does not answer the current state: {again}")
    d = b.req(cmd="detach")
    check(not d["ok"] and "only the connection" in d["error"], f"{name}: detach from another connection: {d}")
    g = a.raw(b"\x00garbage\n")  # garbage on the lease's connection: an error, the lease stays
    check(not g["ok"] and b.req(cmd="status")["result"]["preempt"]["state"] == "quiesced", f"{name}: garbage on the lease: {g}")
    a.close()  # the lease holder goes away: the shim resumes by itself
    for _ in range(100):
        st = b.req(cmd="status")["result"]["preempt"]
        if st["state"] == "running":
            break
        time.sleep(0.05)
    check(st["state"] == "running" and st["gate"] == "open" and st["relaunches"] == 1, f"{name}: after lease loss {st}")
    check(app.cmd("check", timeout=30) == "check ok 1 launches, 0 bad blocks", f"{name}: blocks")
    b.close()
    ended_ok(name, app)


def t_detach(name):
    tmp, app = with_app(name)
    a = app.conn()
    app.cmd("launch s 400")
    a.req(cmd="quiesce", budget_ms=500)
    d = a.req(cmd="detach")
    check(d["ok"] and d["result"] == {"state": "detached", "detached": True}, f"{name}: detach {d}")
    check(a.f.readline() == b"", f"{name}: the shim did not close the detached connection")
    a.close()
    time.sleep(0.1)
    b = app.conn()
    st = b.req(cmd="status")["result"]["preempt"]
    check(st["state"] == "detached" and st["gate"] == "closed", f"{name}: status after detach {st}")
    r = b.req(cmd="resume")["result"]
    check(r["was"] == "detached" and r["relaunched"] == 1, f"{name}: resume {r}")
    r2 = b.req(cmd="resume")["result"]
    check(r2["was"] == "running" and r2["relaunched"] == 0, f"{name}: second resume {r2}")
    check(app.cmd("check", timeout=30) == "check ok 1 launches, 0 bad blocks", f"{name}: blocks")
    b.close()
    ended_ok(name, app)


def t_protocol(name):
    tmp, app = with_app(name)
    c = app.conn()
    for bad in [b'{"cmd":"quiesce","budget_ms":"10"}\n', b'{"cmd":"quiesce","budget_ms":0}\n',
                b'{"cmd":"quiesce","budget_ms":60001}\n', b'{"cmd":"quiesce","budget_ms":1.5}\n',
                b'{"cmd":"quiesce","budget_ms":-3}\n', b'{"cmd":"quiesce","budget_ms":[1]}\n',
                b'{"cmd":"quiesce","budget_ms":1,"budget_ms":2}\n', b'{"cmd":"detach"}\n', b'{"cmd":"resum"}\n']:
        r = c.raw(bad)
        check(r["ok"] is False and r["proto"] == 2 and r["error"], f"{name}: {bad!r} got {r}")
    check(c.req(cmd="status")["result"]["preempt"]["state"] == "running", f"{name}: garbage changed the state")
    check(c.req(cmd="resume")["result"]["was"] == "running", f"{name}: resume while running")
    c.close()
    ended_ok(name, app)


def t_relisten(name):
    tmp, app = with_app(name, {"PTXMIG_PREEMPT": None})
    os.unlink(app.path)
    c = None
    for _ in range(40):
        time.sleep(0.1)
        if os.path.exists(app.path):
            c = app.conn()
            break
    if check(c is not None, f"{name}: the control socket was not re-created"):
        check(c.req(cmd="status")["result"]["pid"] == app.p.pid, f"{name}: status")
        check(stat.S_IMODE(os.stat(app.path).st_mode) == 0o600, f"{name}: mode")
        c.close()
    ended_ok(name, app)
    check(not os.path.exists(app.path), f"{name}: socket left behind")


HELPER_FAIL = "#!/bin/sh\ncat >/dev/null\necho 'instrument: broken on purpose' >&2\nexit 3\n"
HELPER_GARBAGE = "#!/bin/sh\ncat >/dev/null\necho 'not ptx at all'\n"


def t_cubin(name):
    """PTXMIG_PTX_CUBIN=1 (the default): the helper assembles the instrumented module with ptxas and
    the shim loads that cubin (no PTX JIT at start-up), cached as .cubin; the twins are found in its
    sections; a later run uses the cached cubin without the helper; with cubins off the .cubin
    entry is not used."""
    if not os.path.exists(os.path.join(OPTS.build, "ptxmig")):
        skip(None, name, "no ptxmig helper in the build directory")
        return
    if not (shutil.which("ptxas") or os.environ.get("PTXAS") or os.path.exists("/usr/local/cuda/bin/ptxas")):
        skip("ptxas", name, "no ptxas for the helper (scripts/install-ptxas.sh)")
        return
    tmp = harness.scratch("ptxmig-preempt-")
    cdir = os.path.join(tmp, "cache")
    for run, extra in (("helper", {}), ("cached", {"PTXMIG_HELPER": None})):
        app = App(tmp, dict(extra, PTXMIG_PTX_CUBIN="1"))
        c = app.conn()
        st = c.req(cmd="status")["result"]["preempt"]
        want = (1, 0) if run == "helper" else (0, 1)
        check(st["instrumented_modules"] == 1 and (st["cache"]["helper_runs"], st["cache"]["hits"]) == want,
              f"{name}: {run}: status {st}")
        k = kern(c, "k_count")
        check(k and k["twin"] is True and k["twin_reason"] is None, f"{name}: {run}: k_count {k}")
        kr = kern(c, "k_refused")
        check(kr and kr["twin"] is False and kr["twin_reason"].startswith("refused by ptxstate: reads %envreg1"),
              f"{name}: {run}: k_refused {kr}")
        c.close()
        ended_ok(name, app)
        files = sorted(os.listdir(cdir))
        check(len(files) == 2 and files[0].endswith("-v3-b-sm90.cubin") and files[1].endswith("-v3-b-sm90.why"),
              f"{name}: {run}: cache files {files}")
    with open(os.path.join(cdir, files[0]), "rb") as f:
        check(f.read(4) == b"\x7fELF", f"{name}: the .cubin entry is not an ELF file")
    app = App(tmp, {})  # PTXMIG_PTX_CUBIN=0: the PTX entry, from the helper
    c = app.conn()
    st = c.req(cmd="status")["result"]["preempt"]["cache"]
    check(st["helper_runs"] == 1 and st["hits"] == 0, f"{name}: cubins off used the .cubin entry: {st}")
    c.close()
    ended_ok(name, app)
    check(any(f.endswith("-v3-b-sm90.ptx") for f in os.listdir(cdir)), f"{name}: no .ptx entry with cubins off")
    shutil.rmtree(tmp, ignore_errors=True)


def t_fallback(name, helper_script, want_reason, env=None):
    tmp = harness.scratch("ptxmig-preempt-")
    extra = dict(env or {})
    if helper_script is not None:
        h = os.path.join(tmp, "helper.sh")
        with open(h, "w") as f:
            f.write(helper_script)
        os.chmod(h, 0o755)
        extra["PTXMIG_HELPER"] = h
    app = App(tmp, extra)
    c = app.conn()
    app.cmd("launch s 20")
    k = kern(c, "k_count")
    check(k and k["twin"] is False and want_reason in (k["twin_reason"] or "") and k["twin_launches"] == 0,
          f"{name}: k_count {k} (want reason containing {want_reason!r})")
    st = c.req(cmd="status")["result"]["preempt"]
    check(st["instrumented_modules"] == 0, f"{name}: status {st}")
    r = c.req(cmd="quiesce", budget_ms=200)["result"]
    check(not r["preempted"], f"{name}: preempted an original: {r}")
    c.req(cmd="resume")
    check(app.cmd("check", timeout=30) == "check ok 1 launches, 0 bad blocks", f"{name}: blocks")
    c.close()
    ended_ok(name, app)
    shutil.rmtree(tmp, ignore_errors=True)
    return st


def t_cache(name):
    tmp = harness.scratch("ptxmig-preempt-")
    app = App(tmp, {})
    c = app.conn()
    st = c.req(cmd="status")["result"]["preempt"]["cache"]
    check(st["misses"] == 1 and st["hits"] == 0 and st["helper_runs"] == 1, f"{name}: first run {st}")
    c.close()
    ended_ok(name, app)
    cdir = os.path.join(tmp, "cache")
    check(stat.S_IMODE(os.stat(cdir).st_mode) == 0o700, f"{name}: cache dir mode")
    files = sorted(os.listdir(cdir))
    check(len(files) == 2 and files[0].endswith("-v3-b-sm90.ptx") and files[1].endswith("-v3-b-sm90.why"), f"{name}: cache files {files}")
    for f in files:
        check(stat.S_IMODE(os.stat(os.path.join(cdir, f)).st_mode) == 0o600, f"{name}: {f} mode")
    # Second run: from the cache only (no helper at all), reasons kept.
    app = App(tmp, {"PTXMIG_HELPER": None})
    c = app.conn()
    st = c.req(cmd="status")["result"]["preempt"]["cache"]
    check(st["hits"] == 1 and st["misses"] == 0 and st["helper_runs"] == 0, f"{name}: second run {st}")
    app.cmd("launch s 20")
    check(kern(c, "k_count")["twin_launches"] == 1, f"{name}: no twin from the cache")
    kr = kern(c, "k_refused")
    check(kr and kr["twin_reason"].startswith("refused by ptxstate: reads %envreg1"), f"{name}: reason from cache {kr}")
    check(app.cmd("check", timeout=30) == "check ok 1 launches, 0 bad blocks", f"{name}: blocks")
    c.close()
    ended_ok(name, app)
    # Same helper: a hit. Another helper binary (another ptxstate): a miss, and the entry is rewritten.
    app = App(tmp, {})
    c = app.conn()
    st = c.req(cmd="status")["result"]["preempt"]["cache"]
    check(st["hits"] == 1 and st["helper_runs"] == 0, f"{name}: same helper {st}")
    c.close()
    ended_ok(name, app)
    other = os.path.join(tmp, "ptxmig-copy")
    shutil.copy(os.path.join(OPTS.build, "ptxmig"), other)
    app = App(tmp, {"PTXMIG_HELPER": other})
    c = app.conn()
    st = c.req(cmd="status")["result"]["preempt"]["cache"]
    check(st["hits"] == 0 and st["misses"] == 1 and st["helper_runs"] == 1, f"{name}: other helper {st}")
    c.close()
    ended_ok(name, app)
    # A symlink planted under the cache name is not followed; a corrupt entry is not used.
    ptx = [f for f in files if f.endswith(".ptx")][0]
    os.unlink(os.path.join(cdir, ptx))
    os.symlink("/etc/hostname", os.path.join(cdir, ptx))
    app = App(tmp, {"PTXMIG_HELPER": None})
    c = app.conn()
    k = kern(c, "k_count") or {}
    st = c.req(cmd="status")["result"]["preempt"]["cache"]
    check(st["hits"] == 0 and st["misses"] == 1, f"{name}: symlinked cache entry used: {st}")
    c.close()
    ended_ok(name, app)
    shutil.rmtree(tmp, ignore_errors=True)


def t_auto(name):
    tmp, app = with_app(name, {"PTXMIG_PREEMPT": "auto", "PTXMIG_PREEMPT_MIN_US": "100000000", "FAKE_CUDA_BLOCK_US": "0"})
    c = app.conn()
    for _ in range(6):
        app.cmd("launch s 40")
        app.cmd("check", timeout=30)
        c.req(cmd="kernels")  # harvests the samples
    k = kern(c, "k_count")
    check(k and 1 <= k["twin_launches"] < k["launches"] == 6 and k["timed"] >= 1, f"{name}: auto policy {k}")
    # A grid that fits in one wave (4 SMs x 2 CTAs in the fake driver) never gets a twin under auto.
    app.cmd("launch s 8")
    check(app.cmd("check", timeout=30).startswith("check ok"), f"{name}: one-wave blocks")
    k2 = kern(c, "k_count")
    check(k2["twin_launches"] == k["twin_launches"] and k2["launches"] == 7, f"{name}: a one-wave grid got a twin: {k2}")
    r = c.req(cmd="quiesce", budget_ms=50)["result"]
    c.req(cmd="resume")
    check(app.cmd("check", timeout=30) == "check ok 7 launches, 0 bad blocks", f"{name}: blocks")
    c.close()
    ended_ok(name, app)


def t_auto_occupancy(name):
    # auto: a twin that fits fewer CTAs per SM than its original launches only for kernels sampled
    # at or above PTXMIG_PREEMPT_LONG_US; shorter ones launch as originals, with the reason.
    for long_us, want_twins in (("100000000", False), ("1", True)):
        tmp, app = with_app(name, {"PTXMIG_PREEMPT": "auto", "PTXMIG_PREEMPT_MIN_US": "1", "FAKE_CUDA_TWIN_OCC": "1",
                                   "FAKE_CUDA_BLOCK_US": "2000", "PTXMIG_PREEMPT_LONG_US": long_us})
        c = app.conn()
        for _ in range(5):
            app.cmd("launch s 8")
            app.cmd("check", timeout=30)
            c.req(cmd="kernels")  # harvests the samples
        k = kern(c, "k_count")
        if want_twins:
            check(k and k["twin_launches"] == 5, f"{name}: long kernels keep their twins: {k}")
        else:
            # the first launch (untimed) is a twin; once timed, the slower twin is not used
            check(k and 1 <= k["twin_launches"] < 5 and k["timed"] >= 1, f"{name}: short kernel, slower twin: {k}")
            check("fewer CTAs per SM" in (k.get("original_reason") or ""), f"{name}: kernels' original_reason: {k}")
            app.cmd("launch s 300")
            time.sleep(0.05)
            r = c.req(cmd="quiesce", budget_ms=2000)["result"]
            why = [o.get("reason", "") for o in r.get("originals", [])]
            check(any("fewer CTAs per SM" in w for w in why), f"{name}: the reason is reported: {r}")
            c.req(cmd="resume")
        check(app.cmd("check", timeout=30).startswith("check ok"), f"{name}: blocks")
        c.close()
        ended_ok(name, app)


def t_auto_grid(name):
    # auto: a kernel timed short on small grids (a warm-up, a calibration) and then launched on a
    # grid many times larger is expected to run for longer: its time is scaled by the blocks, so
    # the large launch gets its twin and can be preempted; the small ones stay originals.
    tmp, app = with_app(name, {"PTXMIG_PREEMPT": "auto", "PTXMIG_PREEMPT_MIN_US": "50000", "FAKE_CUDA_BLOCK_US": "1000"})
    c = app.conn()
    for _ in range(4):
        app.cmd("launch s 16")  # two waves, ~16 ms: short
        app.cmd("check", timeout=30)
        c.req(cmd="kernels")  # harvests the samples
    k = kern(c, "k_count")
    check(k and k["twin_launches"] == 1 and k["launches"] == 4 and k["timed"] >= 2, f"{name}: small grids: {k}")
    check("short kernel" in (k.get("original_reason") or ""), f"{name}: small grids' original_reason: {k}")
    app.cmd("launch s 400")  # 25 times the timed grid: ~400 ms expected
    time.sleep(0.05)
    r = c.req(cmd="quiesce", budget_ms=2000)["result"]
    check(len(r.get("preempted", [])) == 1, f"{name}: the large launch was not preempted: {r}")
    c.req(cmd="resume")
    check(app.cmd("check", timeout=30) == "check ok 5 launches, 0 bad blocks", f"{name}: blocks")
    k = kern(c, "k_count")
    check(k["twin_launches"] == 2, f"{name}: the large launch did not run as a twin: {k}")
    app.cmd("launch s 16")
    app.cmd("check", timeout=30)
    k = kern(c, "k_count")
    check(k["twin_launches"] == 2 and k["launches"] == 6, f"{name}: a small grid after the large one got a twin: {k}")
    # The large launch's sample covers only what ran before its preemption: it must not make a
    # launch of 300 blocks (about 300 ms) look short.
    app.cmd("launch s 300")
    app.cmd("check", timeout=30)
    k = kern(c, "k_count")
    check(k["twin_launches"] == 3, f"{name}: scaled from a preempted twin's partial sample: {k}")
    c.close()
    ended_ok(name, app)


def t_auto_args(name):
    # auto: a kernel timed short with a small loop count and then launched on the same grid with
    # a count 1000 times larger is expected to run about 1000 times longer: its estimate scales
    # with the count argument, so that launch gets its twin and is preempted; the short ones stay
    # originals.
    tmp, app = with_app(name, {"PTXMIG_PREEMPT": "auto", "PTXMIG_PREEMPT_MIN_US": "50000", "FAKE_CUDA_BLOCK_US": "100",
                               "FAKE_CUDA_BLOCK_US_ARG": "1"})
    c = app.conn()
    for _ in range(4):
        app.cmd("launchw s 16 1")  # 16 blocks of 100 µs: short
        app.cmd("check", timeout=30)
        c.req(cmd="kernels")  # harvests the samples
    k = kern(c, "k_count")
    check(k and k["twin_launches"] == 1 and k["launches"] == 4 and k["timed"] >= 2, f"{name}: short launches: {k}")
    check("short kernel" in (k.get("original_reason") or ""), f"{name}: short launches' original_reason: {k}")
    app.cmd("launchw s 16 1000")  # the same grid, blocks of 100 ms: ~1.6 s expected
    time.sleep(0.05)
    r = c.req(cmd="quiesce", budget_ms=2000)["result"]
    check(len(r.get("preempted", [])) == 1, f"{name}: the long launch was not preempted: {r}")
    c.req(cmd="resume")
    check(app.cmd("check", timeout=60) == "check ok 5 launches, 0 bad blocks", f"{name}: blocks")
    k = kern(c, "k_count")
    check(k["twin_launches"] == 2, f"{name}: the long launch did not run as a twin: {k}")
    app.cmd("launchw s 16 1")
    app.cmd("check", timeout=30)
    k = kern(c, "k_count")
    check(k["twin_launches"] == 2 and k["launches"] == 6, f"{name}: a short launch after the long one got a twin: {k}")
    c.close()
    ended_ok(name, app)


def t_off(name):
    tmp, app = with_app(name, {"PTXMIG_PREEMPT": None})
    c = app.conn()
    app.cmd("launch s 10")
    k = kern(c, "k_count")
    check(k and k["twin"] is False and k["twin_reason"] == "preempt mode off" and k["twin_launches"] == 0, f"{name}: {k}")
    st = c.req(cmd="status")["result"]["preempt"]
    check(st["mode"] == "off" and st["cache"]["helper_runs"] == 0, f"{name}: status {st}")
    r = c.req(cmd="quiesce", budget_ms=10)["result"]
    check(r["state"] == "quiesced" and r["gate"] == "closed", f"{name}: quiesce in mode off {r}")
    c.req(cmd="resume")
    check(app.cmd("check", timeout=30) == "check ok 1 launches, 0 bad blocks", f"{name}: blocks")
    c.close()
    ended_ok(name, app)


def t_runtime(name):
    """The fake runtime's lazy cuLibraryLoadData of an nvcc fatbin: PTX entry picked and instrumented
    by the real ptxstate; launches through cuLaunchKernelEx of CUkernel handles."""
    tmp = harness.scratch("ptxmig-preempt-")
    app = App(tmp, {}, exe="app_runtime")
    c = app.conn()
    for kn in ("fx_scale", "_Z6fx_addIfEvPT_PKS0_i"):
        k = kern(c, kn)
        check(k and k["twin"] is True and k["twin_launches"] == 3, f"{name}: {kn} {k}")
    names = [k["name"] for k in c.req(cmd="kernels")["result"]["kernels"]]
    check(not any(n.endswith("__ptxmig") for n in names), f"{name}: twins listed as kernels: {names}")
    c.close()
    ended_ok(name, app)
    shutil.rmtree(tmp, ignore_errors=True)


def t_sass_keep(name):
    tmp = harness.scratch("ptxmig-preempt-")
    app = App(tmp, {"PTXMIG_PREEMPT_SASS": "keep"}, exe="app_runtime")
    c = app.conn()
    k = kern(c, "fx_scale")
    check(k and k["twin"] is False and k["twin_reason"] == "module has SASS for this GPU (PTXMIG_PREEMPT_SASS=keep)"
          and k["twin_launches"] == 0, f"{name}: {k}")
    st = c.req(cmd="status")["result"]["preempt"]
    check(st["cache"]["helper_runs"] == 0 and st["instrumented_modules"] == 0, f"{name}: {st}")
    c.close()
    ended_ok(name, app)
    shutil.rmtree(tmp, ignore_errors=True)


def t_mid_block(name, env=None):
    """A kernel with a mid-block site (k_count_loop): the shim reads the record layout the module
    carries and launches its twin with two save areas; each quiesce stops it inside a block (a
    record), each resume swaps the areas, and every block counts exactly once."""
    tmp, app = with_app(name, dict({"APP_KERNEL": "loop", "PTXMIG_MID_BLOCK": "1"}, **(env or {})))
    c = app.conn()
    check(app.cmd("launch s 200") == "launched s", f"{name}: launch")
    time.sleep(0.05)
    k = kern(c, "k_count_loop")
    mb = (k or {}).get("mid_block") or {}
    check(k and k["twin"] is True and mb.get("sites") == 1 and mb.get("register_slots") == 3 and mb.get("launches") == 1,
          f"{name}: kernels k_count_loop {k}")
    mid = 0
    for i in range(4):
        r = c.req(cmd="quiesce", budget_ms=500)["result"]
        p = r.get("preempted", [])
        if not check(len(p) == 1 and p[0]["kernel"] == "k_count_loop" and p[0]["mid_block"] is True and
                     p[0]["stop"] in ("mid-block", "block boundary") and p[0]["blocks_done"] < p[0]["blocks_total"] == 200,
                     f"{name}: cycle {i}: preempted {p}"):
            break
        # The fake block's time passes before its site: a raise lands there but for a window of
        # microseconds at the block's end, so nearly every stop is mid-block with one record.
        if p[0]["stop"] == "mid-block":
            mid += 1
            check(p[0]["records"] == 1, f"{name}: cycle {i}: records {p[0]}")
        rs = c.req(cmd="resume")["result"]
        check(rs["relaunched"] == 1 and not rs.get("errors"), f"{name}: cycle {i}: resume {rs}")
        time.sleep(0.03)
    check(mid >= 3, f"{name}: {mid} of 4 stops were mid-block")
    check(app.cmd("check", timeout=60) == "check ok 1 launches, 0 bad blocks", f"{name}: blocks after the stops")
    st = c.req(cmd="status")["result"]["preempt"]
    check(st["mid_block"] is True and st["mid_block_launches"] == 1 and st["mid_block_stops"] == mid,
          f"{name}: status {st}")
    k = kern(c, "k_count_loop")
    check(k and k["mid_block"]["stops"] == mid, f"{name}: kernel stops {k}")
    # A second launch takes the first one's save areas from the pool: one allocation (the app's
    # buffer), not three. Its quiesce has a 1 ms budget: a fake block takes 2 ms, so the twin is
    # usually still stopping when the reply comes, and resume waits for it before the area swap.
    before = app.cmd("calls cuMemAlloc_v2")
    check(app.cmd("launch s 200") == "launched s", f"{name}: second launch")
    after = app.cmd("calls cuMemAlloc_v2")
    check(before and after and int(after.split()[1]) - int(before.split()[1]) == 1,
          f"{name}: device allocations for the second launch: {before} -> {after}")
    time.sleep(0.05)
    r = c.req(cmd="quiesce", budget_ms=1)["result"]
    rs = c.req(cmd="resume")["result"]
    check(rs["relaunched"] + len(r.get("drained", [])) >= 1 and not rs.get("errors"), f"{name}: quick stop {r} resume {rs}")
    check(app.cmd("check", timeout=60) == "check ok 2 launches, 0 bad blocks", f"{name}: blocks after a quick stop")
    c.close()
    ended_ok(name, app)
    shutil.rmtree(tmp, ignore_errors=True)


def t_mid_auto(name, env=None):
    """PTXMIG_MID_BLOCK=auto: the module carries k_count_loop's block twin and its second,
    mid-block twin. An untimed many-block grid runs as the block twin and stops between blocks; a
    grid that fits in one wave (the fake: 4 SMs x 2 CTAs) runs as the mid-block twin and stops
    inside its blocks; a many-block grid whose blocks are expected to run long (timed before) runs
    as the mid-block twin too. Every block counts once. With the mid twin fitting fewer CTAs per SM
    (FAKE_CUDA_MID_OCC=1), the one-wave grid is not one wave for it; it gets the mid twin because its
    blocks are expected long (its loop count grew over the sampled launch's)."""
    full = dict({"APP_KERNEL": "loop", "PTXMIG_MID_BLOCK": "auto", "FAKE_CUDA_BLOCK_US_ARG": "1",
                 "FAKE_CUDA_BLOCK_US": "1000"}, **(env or {}))
    tmp, app = with_app(name, full)
    c = app.conn()
    st = c.req(cmd="status")["result"]["preempt"]
    check(st.get("mid_block_mode") == "auto", f"{name}: status {st}")
    c.close()
    launches = 0

    def stop(what, cmd, total):
        # A connection of its own per step: the shim closes one idle for 10 s, and a step's blocks
        # run for seconds.
        nonlocal launches
        c = app.conn()
        check(app.cmd(cmd) == "launched s", f"{name}: {what} launch")
        launches += 1
        time.sleep(0.05)
        p = c.req(cmd="quiesce", budget_ms=500)["result"].get("preempted", [])
        ok = check(len(p) == 1 and p[0]["kernel"] == "k_count_loop" and p[0]["blocks_total"] == total,
                   f"{name}: {what}: preempted {p}")
        rs = c.req(cmd="resume")["result"]
        check(rs["relaunched"] == 1 and not rs.get("errors"), f"{name}: {what}: resume {rs}")
        check(app.cmd("check", timeout=60) == f"check ok {launches} launches, 0 bad blocks",
              f"{name}: blocks after the {what} stop")
        c.close()
        return p[0] if ok else {}

    def kernel():
        cc = app.conn()
        k = kern(cc, "k_count_loop")
        cc.close()
        return k

    # Many blocks, never timed: the block twin, stopped between blocks.
    p = stop("untimed many-block", "launchw s 200 2", 200)
    check(p.get("mid_block") is False and p.get("stop") == "block boundary" and p.get("blocks_done", 200) < 200,
          f"{name}: untimed many blocks: {p}")
    k = kernel()
    check(k and k["twin"] is True and k.get("mid_twin") is True, f"{name}: kernels k_count_loop {k}")
    # One wave of 8 blocks of 400 ms each (the loop count is the fake block's time factor). Where
    # the mid twin fits fewer CTAs per SM the grid is not one wave for it, but its loop count is
    # 200x the sampled launch's: long blocks, so the mid twin runs too (in two waves).
    p = stop("one-wave", "launchw s 8 400", 8)
    check(p.get("mid_block") is True and p.get("stop") == "mid-block" and p.get("records", 0) >= 1,
          f"{name}: the one-wave grid did not stop inside its blocks: {p}")
    k = kernel()
    mb = (k or {}).get("mid_block") or {}
    check(mb.get("launches") == 1, f"{name}: mid-block launches {k}")
    # Many blocks of 200 ms, the kernel timed: a block twin would hold the stop for up to two
    # blocks, so the mid-block twin runs (whatever its occupancy: more waves, not fewer stops).
    p = stop("long-block", "launchw s 64 200", 64)
    check(p.get("mid_block") is True and p.get("stop") == "mid-block", f"{name}: long blocks: {p}")
    # The one-wave grid again, its blocks now known to be long: the mid-block twin, also where it
    # fits fewer CTAs per SM (two waves, but stoppable; it was the block twin, and under auto the
    # original, which nothing stops).
    p = stop("timed one-wave", "launchw s 8 400", 8)
    check(p.get("mid_block") is True and p.get("stop") == "mid-block", f"{name}: timed one wave: {p}")
    ended_ok(name, app)
    shutil.rmtree(tmp, ignore_errors=True)


def t_mid_auto_learned(name, env=None, refused=False):
    """PTXMIG_MID_BLOCK=auto, as numba's many-block launches run: the first, untimed launch of a
    kernel with long blocks runs as the block twin to its end; the same launch again, the kernel
    now timed with 100 ms blocks, runs as the mid-block twin and stops inside its blocks. With its
    save areas refused (refused=True: over PTXMIG_MID_BLOCK_MAX_MB, or no device memory for them)
    it runs as the block twin instead,
    which stops between blocks as fast and at its own occupancy."""
    full = dict({"APP_KERNEL": "loop", "PTXMIG_PREEMPT": "auto", "FAKE_CUDA_BLOCK_US_ARG": "1",
                 "FAKE_CUDA_BLOCK_US": "1000"}, **(env or {}))
    tmp, app = with_app(name, full)
    c = app.conn()
    check(app.cmd("launchw s 64 100") == "launched s", f"{name}: first launch")
    check(app.cmd("check", timeout=60) == "check ok 1 launches, 0 bad blocks", f"{name}: first launch's blocks")
    k = kern(c, "k_count_loop")
    check(k and k["twin_launches"] == 1 and k["timed"] == 1 and not (k.get("mid_block") or {}).get("launches"),
          f"{name}: the first launch ran as the block twin: {k}")
    check(app.cmd("calls mid_twin_launches") == "calls 0", f"{name}: a mid twin ran first")
    check(app.cmd("launchw s 64 100") == "launched s", f"{name}: second launch")
    time.sleep(0.05)
    p = c.req(cmd="quiesce", budget_ms=500)["result"].get("preempted", [])
    if refused:
        check(len(p) == 1 and p[0].get("mid_block") is False and p[0].get("stop") == "block boundary",
              f"{name}: refused save areas: {p}")
        check(app.cmd("calls mid_twin_launches") == "calls 0", f"{name}: the mid twin ran without save areas")
    else:
        check(len(p) == 1 and p[0].get("mid_block") is True and p[0].get("stop") == "mid-block",
              f"{name}: the timed long-block launch did not stop inside its blocks: {p}")
        check(app.cmd("calls mid_twin_launches") == "calls 1", f"{name}: mid twin launches")
    c.req(cmd="resume")
    check(app.cmd("check", timeout=60) == "check ok 2 launches, 0 bad blocks", f"{name}: blocks after the stop")
    c.close()
    ended_ok(name, app)
    shutil.rmtree(tmp, ignore_errors=True)


def t_mid_auto_args(name):
    """PTXMIG_MID_BLOCK=auto: a kernel that has only run as a twin (no original launch timed),
    first with a loop count of 1 (100 µs blocks), then with 1000 on the same grid: its blocks are
    expected 1000x longer (the count grew over the sample with the longest blocks), so the
    mid-block twin runs and stops inside them."""
    tmp, app = with_app(name, {"APP_KERNEL": "loop", "PTXMIG_PREEMPT": "auto", "FAKE_CUDA_BLOCK_US_ARG": "1",
                               "FAKE_CUDA_BLOCK_US": "100"})
    check(app.cmd("launchw s 64 1") == "launched s", f"{name}: short launch")
    check(app.cmd("check", timeout=60) == "check ok 1 launches, 0 bad blocks", f"{name}: short launch's blocks")
    c = app.conn()
    k = kern(c, "k_count_loop")
    check(k and k["twin_launches"] == 1 and k["timed"] == 1, f"{name}: the short launch ran as the block twin: {k}")
    check(app.cmd("launchw s 64 1000") == "launched s", f"{name}: long launch")
    time.sleep(0.05)
    p = c.req(cmd="quiesce", budget_ms=500)["result"].get("preempted", [])
    check(len(p) == 1 and p[0].get("mid_block") is True and p[0].get("stop") == "mid-block",
          f"{name}: a 1000x loop count did not get the mid-block twin: {p}")
    c.req(cmd="resume")
    check(app.cmd("check", timeout=60) == "check ok 2 launches, 0 bad blocks", f"{name}: blocks after the stop")
    c.close()
    ended_ok(name, app)
    shutil.rmtree(tmp, ignore_errors=True)


def t_mid_auto_one_wave_refused(name, env):
    """PTXMIG_MID_BLOCK=auto under --preempt auto: a grid that is one wave for the block twin but not
    for the mid-block twin (it fits fewer CTAs per SM), its blocks known to be long, gets the mid
    twin; with its save areas refused (over the limit, or no memory) the block twin could not stop
    it sooner than the original, so the original runs, with the one-wave reason."""
    full = dict({"APP_KERNEL": "loop", "PTXMIG_PREEMPT": "auto", "FAKE_CUDA_BLOCK_US_ARG": "1",
                 "FAKE_CUDA_BLOCK_US": "1000", "FAKE_CUDA_MID_OCC": "1"}, **env)
    tmp, app = with_app(name, full)
    check(app.cmd("launchw s 64 20") == "launched s", f"{name}: first launch")
    check(app.cmd("check", timeout=60) == "check ok 1 launches, 0 bad blocks", f"{name}: first launch's blocks")
    check(app.cmd("launchw s 8 20") == "launched s", f"{name}: one-wave launch")
    check(app.cmd("check", timeout=60) == "check ok 2 launches, 0 bad blocks", f"{name}: one-wave launch's blocks")
    c = app.conn()
    k = kern(c, "k_count_loop")
    check(k and k["twin_launches"] == 1 and k.get("original_reason", "").startswith("grid fits in one wave"),
          f"{name}: the one-wave launch did not run as the original: {k}")
    c.close()
    check(app.cmd("calls mid_twin_launches") == "calls 0", f"{name}: a mid twin ran")
    ended_ok(name, app)
    shutil.rmtree(tmp, ignore_errors=True)


def t_mid_block_off(name, env, want_refused, layout=False):
    """Mid-block stops off (PTXMIG_MID_BLOCK=0), without the module's layout,
    or over the save-area limit: the same kernel's twin stops between blocks only, and every block
    counts once."""
    full = dict({"APP_KERNEL": "loop", "PTXMIG_MID_BLOCK": "1"}, **env)
    mid_on = full["PTXMIG_MID_BLOCK"] == "1"
    tmp, app = with_app(name, full)
    c = app.conn()
    check(app.cmd("launch s 200") == "launched s", f"{name}: launch")
    time.sleep(0.05)
    k = kern(c, "k_count_loop")
    # Over the limit the layout is known (and shown), but the launch has no save areas.
    check(k and k["twin"] is True and (k.get("mid_block", {}).get("launches") == 0 if layout else "mid_block" not in k),
          f"{name}: kernels k_count_loop {k}")
    r = c.req(cmd="quiesce", budget_ms=500)["result"]
    p = r.get("preempted", [])
    check(len(p) == 1 and p[0]["mid_block"] is False and p[0]["stop"] == "block boundary" and p[0]["records"] == 0,
          f"{name}: preempted {p}")
    rs = c.req(cmd="resume")["result"]
    check(rs["relaunched"] == 1, f"{name}: resume {rs}")
    check(app.cmd("check", timeout=60) == "check ok 1 launches, 0 bad blocks", f"{name}: blocks")
    st = c.req(cmd="status")["result"]["preempt"]
    check(st["mid_block"] is mid_on and st["mid_block_launches"] == 0 and st["mid_block_refused"] == want_refused,
          f"{name}: status {st}")
    c.close()
    ended_ok(name, app)
    files = sorted(os.listdir(os.path.join(tmp, "cache")))
    want = "-v3-m-sm90.ptx" if mid_on else "-v3-sm90.ptx"
    check(any(f.endswith(want) for f in files), f"{name}: cache entries {files}, want one ending {want}")
    shutil.rmtree(tmp, ignore_errors=True)


CRIU_TIMEOUT = 60  # seconds one CRIU dump or restore of the test app may take


def t_criu(name, extra=None):
    """CRIU dump of a detached (quiesced) shimmed app, restore, then status and resume on the
    restored process's socket; the remainder runs and every block ran exactly once. With
    APP_KERNEL=loop the twin stopped inside a block: the restored process resumes its record."""
    criu = shutil.which("criu") or ("/usr/local/sbin/criu" if os.path.exists("/usr/local/sbin/criu") else None)
    if not criu:
        return skip("criu", name, "criu not installed")
    if os.geteuid() != 0:
        return skip("criu", name, "criu needs root")
    tmp = harness.scratch("ptxmig-criu-")
    sockdir = os.path.join(tmp, "sock")
    imgdir = os.path.join(tmp, "img")
    os.makedirs(imgdir)
    go = os.path.join(tmp, "go")
    outp = os.path.join(tmp, "app.out")
    env = dict(os.environ, LD_LIBRARY_PATH=os.path.join(OPTS.build, "fake"), PTXMIG_SOCKET_DIR=sockdir,
               PTXMIG_PTX_CACHE=os.path.join(tmp, "cache"), PTXMIG_PREEMPT="always", FAKE_CUDA_BLOCK_US="2000",
               LD_PRELOAD=" ".join(x for x in [OPTS.preload_first, OPTS.shim] if x), APP_GO_FILE=go, PTXMIG_PTX_CUBIN="0",
               PTXMIG_HELPER=os.path.abspath(os.path.join(OPTS.build, "ptxmig")), **(extra or {}))
    mid = (extra or {}).get("APP_KERNEL") == "loop"
    # stdio are regular files and the app has its own session: CRIU dumps it alone.
    log = open(outp, "w")
    p = subprocess.Popen([os.path.join(OPTS.build, "app_preempt")], stdin=subprocess.DEVNULL, stdout=log,
                         stderr=subprocess.STDOUT, env=env, start_new_session=True, close_fds=True)
    pid = p.pid
    restored = False
    try:
        for _ in range(200):
            if "launched s" in open(outp).read():
                break
            time.sleep(0.05)
        path = os.path.join(sockdir, f"{pid}.sock")
        a = Conn(path, 20)
        r = a.req(cmd="quiesce", budget_ms=500)["result"]
        check(len(r["preempted"]) == 1, f"{name}: preempted {r}")
        if mid:
            check(r["preempted"][0]["stop"] == "mid-block" and r["preempted"][0]["records"] == 1, f"{name}: stop {r}")
        check(a.req(cmd="detach")["ok"], f"{name}: detach")
        a.f.readline()
        a.close()
        # Bounded: a CRIU that hangs (4.1.1 where hardware breakpoints never fire) fails the case
        # instead of the suite; subprocess.run kills it on the timeout, `finally` kills the app.
        try:
            d = subprocess.run([criu, "dump", "-t", str(pid), "-D", imgdir, "-v4", "-o", "dump.log"],
                               capture_output=True, text=True, timeout=CRIU_TIMEOUT)
        except subprocess.TimeoutExpired:
            check(False, f"{name}: criu dump still running after {CRIU_TIMEOUT} s (killed): "
                  f"{open(os.path.join(imgdir, 'dump.log')).read()[-800:]}")
            return
        try:
            p.wait(10)  # dumped processes are killed (no --leave-running)
        except subprocess.TimeoutExpired:
            pass
        if not check(d.returncode == 0, f"{name}: criu dump failed: {d.stderr[-300:]} "
                     f"{open(os.path.join(imgdir, 'dump.log')).read()[-1500:]}"):
            return
        try:
            rs = subprocess.run([criu, "restore", "-D", imgdir, "-d", "-v4", "-o", "restore.log"],
                                capture_output=True, text=True, timeout=CRIU_TIMEOUT)
        except subprocess.TimeoutExpired:
            check(False, f"{name}: criu restore still running after {CRIU_TIMEOUT} s (killed): "
                  f"{open(os.path.join(imgdir, 'restore.log')).read()[-800:]}")
            return
        if not check(rs.returncode == 0, f"{name}: criu restore failed: {rs.stderr[-300:]} "
                     f"{open(os.path.join(imgdir, 'restore.log')).read()[-1500:]}"):
            return
        restored = True
        b = None
        for _ in range(50):
            try:
                b = Conn(path, 20)
                break
            except OSError:
                time.sleep(0.1)
        if not check(b is not None, f"{name}: no control socket after restore at {path}"):
            return
        st = b.req(cmd="status")["result"]
        check(st["pid"] == pid and st["preempt"]["state"] == "detached", f"{name}: status after restore {st['preempt']}")
        rr = b.req(cmd="resume")["result"]
        check(rr["was"] == "detached" and rr["relaunched"] == 1, f"{name}: resume after restore {rr}")
        b.close()
        open(go, "w").close()
        out = ""
        for _ in range(300):
            out = open(outp).read()
            if "check " in out:
                break
            time.sleep(0.1)
        check("check ok 1 launches, 0 bad blocks" in out, f"{name}: restored app: {out[-800:]}")
        for _ in range(300):  # the restored app exits by itself; its socket goes with it (slow under load)
            if not os.path.exists(f"/proc/{pid}") and not os.path.exists(path):
                break
            time.sleep(0.05)
        check(not os.path.exists(path), f"{name}: socket left behind by the restored app")
    finally:
        if os.path.exists(f"/proc/{pid}") and (restored or p.poll() is None):
            try:
                os.kill(pid, 9)
            except OSError:
                pass
        log.close()
        shutil.rmtree(tmp, ignore_errors=True)

def main():
    global OPTS
    ap = argparse.ArgumentParser()
    ap.add_argument("--shim", required=True)
    ap.add_argument("--build", required=True)
    ap.add_argument("--preload-first", default="")
    ap.add_argument("--only", default="")
    OPTS = ap.parse_args()
    harness.label = "preempt-san" if OPTS.preload_first else "preempt"
    cases = [
        ("mode-off", t_off, ()),
        ("helper-missing", lambda n: t_fallback(n, None, "cannot run", {"PTXMIG_HELPER": "/nonexistent/ptxmig"}), ()),
        ("helper-failing", lambda n: t_fallback(n, HELPER_FAIL, "helper exit 3: instrument: broken on purpose"), ()),
        ("helper-garbage", lambda n: t_fallback(n, HELPER_GARBAGE, "lacks the original kernels"), ()),
        ("protocol", t_protocol, ()),
        ("gate", t_gate, ()),
        ("socket-recreated", t_relisten, ()),
    ]
    helper_cases = [
        ("basic", lambda n: t_basic(n, {}), ()),
        ("basic-library", lambda n: t_basic(n, {"APP_MODULE": "library"}), ()),
        # CuPy and Numba: the module is loaded from a JIT link's cubin (a copy of it); its twins
        # come from the link's PTX input.
        ("basic-link", lambda n: t_basic(n, {"APP_MODULE": "link"}), ()),
        ("basic-link-5050", lambda n: t_basic(n, {"APP_MODULE": "link-5050"}), ()),
        # CuPy (NVRTC straight to a cubin) and cuda.core / numba-cuda (nvJitLink): the module is
        # loaded from a cubin; its twins come from the PTX the shim took from the compiler.
        ("basic-nvrtc", lambda n: t_basic(n, {"APP_MODULE": "nvrtc"}), ()),
        ("basic-nvjitlink", lambda n: t_basic(n, {"APP_MODULE": "nvjitlink"}), ()),
        # numba-cuda: NVVM's LTO-IR linked with -lto; the shim links it again with -ptx.
        ("basic-nvjitlink-lto", lambda n: t_basic(n, {"APP_MODULE": "nvjitlink-lto"}), ()),
        # The PTX given as a file of unspecified type (NVJITLINK_INPUT_ANY, a .ptx name).
        ("basic-nvjitlink-file", lambda n: t_basic(n, {"APP_MODULE": "nvjitlink", "APP_JIT_FILE": "1"}), ()),
        ("jit-cache", t_jit_cache, ()),
        ("jit-many", t_jit_many, ()),
        # An LTO link with a PTX input beside the LTO-IR: not linked again, no twins.
        ("jit-lto-mixed", lambda n: t_jit_no_twin(n, {"APP_MODULE": "nvjitlink-mixed"}, "no PTX"), ()),
        # NVRTC's PTX lacks one of the cubin's kernels: not used.
        ("jit-ptx-mismatch", lambda n: t_jit_no_twin(n, {"APP_MODULE": "nvrtc", "FAKE_NVRTC_PTX_DROP": "k_refused"}, "no PTX"), ()),
        # The other module loads take the instrumented PTX too (cuModuleLoad and
        # cuModuleLoadFatBinary through cuModuleLoadData).
        ("basic-dataex", lambda n: t_basic(n, {"APP_MODULE": "dataex"}), ()),
        ("basic-fatbinary", lambda n: t_basic(n, {"APP_MODULE": "fatbinary"}), ()),
        ("basic-file", lambda n: t_basic(n, {"APP_MODULE": "file"}), ()),
        ("legacy-stream-extra-args-no-paraminfo", t_legacy_extra, ()),
        ("driver-rejects-twins", lambda n: t_fallback(n, None, "the driver refused the instrumented PTX", {"FAKE_CUDA_REJECT_TWINS": "1", "PTXMIG_HELPER": os.path.abspath(os.path.join(OPTS.build, "ptxmig"))}), ()),
        ("cache", t_cache, ()),
        ("cubin", t_cubin, ()),
        ("tail-rule", t_tail, ()),
        ("hold", t_hold, ()),
        ("hold-not-started", t_hold_not_started, ()),
        ("free-waits-attributes-replayed", t_free_attrs, ()),
        ("sync-honest", t_sync, ()),
        ("stops-after-budget", t_late_stop, ()),
        ("batch-max", t_batch_max, ()),
        ("lease", t_lease, ()),
        ("detach-resume", t_detach, ()),
        ("auto-policy", t_auto, ()),
        ("auto-occupancy", t_auto_occupancy, ()),
        ("auto-grid", t_auto_grid, ()),
        ("auto-args", t_auto_args, ()),
        ("runtime-fatbin", t_runtime, ()),
        ("runtime-fatbin-sass-keep", t_sass_keep, ()),
        ("criu", t_criu, ()),
        ("mid-block", lambda n: t_mid_block(n), ()),
        ("mid-block-library", lambda n: t_mid_block(n, {"APP_MODULE": "library"}), ()),
        ("mid-block-extra-args", lambda n: t_mid_block(n, {"FAKE_CUDA_NO_PARAM_INFO": "1"}), ()),
        ("mid-block-off", lambda n: t_mid_block_off(n, {"PTXMIG_MID_BLOCK": "0"}, 0), ()),
        ("mid-block-no-layout", lambda n: t_mid_block_off(n, {"FAKE_CUDA_NO_GLOBALS": "1"}, 0), ()),
        ("mid-block-over-limit", lambda n: t_mid_block_off(n, {"PTXMIG_MID_BLOCK_MAX_MB": "0"}, 1, layout=True), ()),
        # auto (the default): one-wave grids and long blocks get the second, mid-block twin; other
        # launches the block twin.
        ("mid-block-auto", lambda n: t_mid_auto(n), ()),
        ("mid-block-default-auto", lambda n: t_mid_auto(n, {"PTXMIG_MID_BLOCK": None}), ()),
        ("mid-block-auto-learned", lambda n: t_mid_auto_learned(n), ()),
        ("mid-block-auto-learned-nvjitlink", lambda n: t_mid_auto_learned(n, {"APP_MODULE": "nvjitlink-lto"}), ()),
        ("mid-block-auto-learned-library", lambda n: t_mid_auto_learned(n, {"APP_MODULE": "library"}), ()),
        ("mid-block-auto-learned-over-limit", lambda n: t_mid_auto_learned(n, {"PTXMIG_MID_BLOCK_MAX_MB": "0"}, refused=True), ()),
        ("mid-block-auto-learned-no-memory", lambda n: t_mid_auto_learned(n, {"FAKE_CUDA_ALLOC_FAIL_KB": "1024"}, refused=True), ()),
        ("mid-block-auto-args", lambda n: t_mid_auto_args(n), ()),
        ("mid-block-auto-one-wave-over-limit", lambda n: t_mid_auto_one_wave_refused(n, {"PTXMIG_MID_BLOCK_MAX_MB": "0"}), ()),
        ("mid-block-auto-one-wave-no-memory", lambda n: t_mid_auto_one_wave_refused(n, {"FAKE_CUDA_ALLOC_FAIL_KB": "1024"}), ()),
        ("mid-block-auto-library", lambda n: t_mid_auto(n, {"APP_MODULE": "library"}), ()),
        ("mid-block-auto-mid-occupancy", lambda n: t_mid_auto(n, {"FAKE_CUDA_MID_OCC": "1"}), ()),
        ("mid-block-criu", lambda n: t_criu(n, {"APP_KERNEL": "loop", "PTXMIG_MID_BLOCK": "1"}), ()),
    ]
    for n, fn, _ in cases:
        if OPTS.only and OPTS.only != n:
            continue
        with case(n):
            fn(n)
    for n, fn, _ in helper_cases:
        if OPTS.only and OPTS.only != n:
            continue
        if not have_helper():
            skip("go", n, "no ptxmig helper: go missing, or `go build ./cmd/ptxmig` failed (see make's output)")
            continue
        if n.endswith("criu") and OPTS.preload_first:
            skip(None, n, "CRIU test runs with the plain shim only (ASan's shadow mappings)")
            continue
        with case(n):
            fn(n)
    summary = harness.summary(OPTS.shim)
    print(f"preempt.py: {summary}")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
