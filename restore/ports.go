package restore

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"github.com/ptxmig/ptxmig/internal/hostreq"
	"github.com/ptxmig/ptxmig/internal/op"
	"github.com/ptxmig/ptxmig/internal/tcpdiag"
	"github.com/ptxmig/ptxmig/store"
)

// Listening TCP ports. CRIU binds each listening socket of the image to its address again (with
// SO_REUSEADDR and SO_REUSEPORT set for the bind); the bind fails (EADDRINUSE: "Can't bind inet
// socket", the restore rolls back) when another socket listens there, or while a connection of the
// process's past is still closing on the port (TIME_WAIT and the other closing states, up to a
// minute after the close) unless the application had set SO_REUSEADDR on it. A job checkpointed
// within a minute of its start hit that (2x H200, PyTorch DDP over NCCL sockets, 2026-11-29: its
// restore failed until the ranks' closed connections had expired).

// closingWait bounds how long a restore waits for closing connections to expire on a kernel that
// cannot end them (Linux keeps a TIME_WAIT socket 60 s).
const closingWait = 61 * time.Second

// planPorts reads the image's listening TCP sockets and refuses a restore whose address another
// socket listens on here (nothing touched): a trial bind made as CRIU makes it fails, and a
// listening socket here explains why. Closing connections are freePorts' business.
func (p *Plan) planPorts(ctx context.Context, env *op.Env, m *store.Manifest) error {
	got, err := readImageFiles(ctx, env, m, hostreq.FilesImage)
	if err != nil {
		if errors.Is(err, store.ErrCorrupt) {
			return op.Refusef("image %s is corrupt, nothing was restored: %w", m.Name, err)
		}
		return op.Refusef("image %s: read %s: %w", m.Name, hostreq.FilesImage, err)
	}
	if got[0] == nil {
		return nil // not a CRIU image of files (planHost says so)
	}
	ls, err := hostreq.Listeners(got[0])
	if err != nil {
		return op.Refusef("image %s: %w", m.Name, err)
	}
	p.listeners = ls
	if len(ls) == 0 {
		return nil
	}
	here, err := tcpdiag.List(0, tcpdiag.StateListen)
	if err != nil {
		p.portsUnchecked = true
		p.Warnings = append(p.Warnings, fmt.Sprintf("cannot tell whether the image's %d listening TCP port(s) are free here: %v", len(ls), err))
		return nil
	}
	var taken []string
	for _, l := range ls {
		if !errors.Is(trialBind(l), unix.EADDRINUSE) {
			continue
		}
		for _, s := range here {
			if l.Conflicts(s.Local) {
				taken = append(taken, fmt.Sprintf("%s (a socket here listens on %s, inode %d)", l.Addr, s.Local, s.Inode))
				break
			}
		}
	}
	if len(taken) > 0 {
		return op.Refusef("image %s: its processes listened on TCP %s, which this host's sockets hold: CRIU could not bind "+
			"them (nothing was touched). Stop what listens there (`ss -ltnp` names it), or restore on another host",
			m.Name, strings.Join(taken, ", "))
	}
	return nil
}

// trialBind binds a TCP socket to l's address as CRIU does before it restores l (SO_REUSEADDR,
// SO_REUSEPORT, IPV6_V6ONLY as recorded) and closes it.
func trialBind(l hostreq.Listener) error {
	a := l.Addr.Addr()
	fam := unix.AF_INET6
	var sa unix.Sockaddr = &unix.SockaddrInet6{Port: int(l.Addr.Port()), Addr: a.As16()}
	if a.Is4() {
		fam, sa = unix.AF_INET, &unix.SockaddrInet4{Port: int(l.Addr.Port()), Addr: a.As4()}
	}
	fd, err := unix.Socket(fam, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, unix.IPPROTO_TCP)
	if err != nil {
		return err
	}
	defer unix.Close(fd)
	for _, o := range []int{unix.SO_REUSEADDR, unix.SO_REUSEPORT} {
		if err := unix.SetsockoptInt(fd, unix.SOL_SOCKET, o, 1); err != nil {
			return err
		}
	}
	if fam == unix.AF_INET6 {
		v := 0
		if l.V6Only {
			v = 1
		}
		if err := unix.SetsockoptInt(fd, unix.IPPROTO_IPV6, unix.IPV6_V6ONLY, v); err != nil {
			return err
		}
	}
	return unix.Bind(fd, sa)
}

// closingOn lists the connections no process holds any more (closing: TIME_WAIT and the states
// before it) on a port one of ls listened on: what stands in the way of CRIU's bind.
func closingOn(ls []hostreq.Listener) ([]tcpdiag.Socket, error) {
	all, err := tcpdiag.List(0, tcpdiag.Closing...)
	if err != nil {
		return nil, err
	}
	var out []tcpdiag.Socket
	for _, s := range all {
		if s.Inode != 0 {
			continue // a process still holds it: never ours to end
		}
		for _, l := range ls {
			if l.Conflicts(s.Local) {
				out = append(out, s)
				break
			}
		}
	}
	return out, nil
}

// freePorts ends the closing connections on the image's listening ports and returns how many it
// ended. On a kernel that cannot end them it waits (at most closingWait) for them to expire.
// What it could not free is left to CRIU, whose failure names the port.
func freePorts(ctx context.Context, log *slog.Logger, ls []hostreq.Listener) (int, error) {
	if len(ls) == 0 {
		return 0, nil
	}
	in, err := closingOn(ls)
	if err != nil || len(in) == 0 {
		return 0, err
	}
	ended := 0
	var errs []error
	for _, s := range in {
		err := tcpdiag.Destroy(s)
		if errors.Is(err, tcpdiag.ErrNotSupported) {
			log.Warn("closing connections hold ports the image listens on, and this kernel cannot end them: waiting for them to expire",
				"connections", len(in), "max_wait", closingWait, "err", err)
			return ended, waitExpired(ctx, ls)
		}
		if err != nil {
			errs = append(errs, err)
			continue
		}
		ended++
		log.Info("ended a closing connection on a port the image listens on", "connection", s.String())
	}
	return ended, errors.Join(errs...)
}

// waitExpired polls until no closing connection is left on ls's ports, ctx ends, or closingWait
// passes.
func waitExpired(ctx context.Context, ls []hostreq.Listener) error {
	deadline := time.Now().Add(closingWait)
	for {
		left, err := closingOn(ls)
		if err != nil || len(left) == 0 || time.Now().After(deadline) {
			return err
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(200 * time.Millisecond):
		}
	}
}

// portsText is the plan's note on the image's listening ports (at most five named).
func (p *Plan) portsText() string {
	if len(p.listeners) == 0 {
		return ""
	}
	var addrs []string
	for i, l := range p.listeners {
		if i == 5 {
			addrs = append(addrs, fmt.Sprintf("and %d more", len(p.listeners)-5))
			break
		}
		addrs = append(addrs, l.Addr.String())
	}
	state := "are free"
	if p.portsUnchecked {
		state = "could not be checked"
	}
	return fmt.Sprintf("; the listening TCP port(s) %s %s (connections still closing on them are ended before CRIU binds "+
		"them)", strings.Join(addrs, ", "), state)
}
