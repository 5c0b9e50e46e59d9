// Package testreq makes a test's skip for a missing requirement honest: where the environment
// variable PTXMIG_REQUIRE lists the requirement (CI sets PTXMIG_REQUIRE=root,criu,ptxas), the
// test fails instead of skipping, so a broken installer or a lost privilege cannot turn a
// suite silently green.
//
// Requirement names in use: root (euid 0), criu (a usable CRIU >= 4.0), ptxas, cc (a C compiler),
// go (the go command), proc (a usable /proc), flock (flock(1)), sleep (sleep(1)), tmpfs (mounting
// a tmpfs), cgroup2 (a writable cgroup v2 hierarchy with cgroup.kill), sock-destroy (a kernel that
// ends TCP sockets through sock_diag, CONFIG_INET_DIAG_DESTROY), ipv6 (IPv6 on the loopback). Skips that are not about a
// missing requirement (-short, a fixture that does not apply here) stay plain t.Skip calls.
package testreq

import (
	"fmt"
	"os"
	"strings"
	"testing"
)

// Env is the environment variable listing the requirements that must be met (comma-separated;
// "all" requires every one).
const Env = "PTXMIG_REQUIRE"

// Required reports whether need is listed in PTXMIG_REQUIRE.
func Required(need string) bool {
	need = strings.TrimSpace(need)
	for _, r := range strings.Split(os.Getenv(Env), ",") {
		r = strings.TrimSpace(r)
		if r != "" && (r == need || r == "all") {
			return true
		}
	}
	return false
}

// Skip skips t because need is unavailable, giving the reason (format, args); if need is
// required (PTXMIG_REQUIRE), it fails t instead. Either way the test stops here.
func Skip(t testing.TB, need string, format string, args ...any) {
	t.Helper()
	reason := fmt.Sprintf(format, args...)
	if Required(need) {
		t.Fatalf("required %s unavailable: %s (%s=%s)", need, reason, Env, os.Getenv(Env))
		return
	}
	t.Skipf("%s unavailable: %s", need, reason)
}
