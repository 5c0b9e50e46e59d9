package restore

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"time"

	"github.com/ptxmig/ptxmig/internal/hostreq"
	"github.com/ptxmig/ptxmig/internal/op"
	"github.com/ptxmig/ptxmig/internal/tcpdiag"
	"github.com/ptxmig/ptxmig/store"
)

// Listening TCP ports. CRIU binds each listening socket of the image to its address again; the
// bind fails (EADDRINUSE: "Can't bind inet socket", the restore rolls back) when another socket
// listens there, or, for an application that did not set SO_REUSEADDR, while a connection of
// the process's past lingers in TIME_WAIT on the port: up to 60 s after it closed. A job
// checkpointed within a minute of its start hit that (2x H200, PyTorch DDP over NCCL sockets,
// 2026-11-29: its restore failed until the ranks' closed bootstrap connections had expired).

// timeWaitWait bounds how long a restore waits for TIME_WAIT connections to expire on a kernel
// that cannot end them (Linux keeps one 60 s).
const timeWaitWait = 61 * time.Second

// planPorts reads the image's listening TCP sockets and refuses a restore whose address another
// socket listens on here (nothing touched); TIME_WAIT connections are freePorts' business.
func (p *Plan) planPorts(ctx context.Context, env *op.Env, m *store.Manifest) error {
	got, err := readImageFiles(ctx, env, m, hostreq.FilesImage)
	if err != nil {
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
		p.Warnings = append(p.Warnings, fmt.Sprintf("cannot tell whether the image's %d listening TCP port(s) are free here: %v", len(ls), err))
		return nil
	}
	var taken []string
	for _, l := range ls {
		for _, s := range here {
			if !l.ReusePort && l.Conflicts(s.Local) {
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

// freePorts ends the connections in TIME_WAIT that stand in the way of binding the image's
// listening sockets that lack SO_REUSEADDR, and returns how many it ended. On a kernel that
// cannot end them it waits (at most timeWaitWait) for them to expire. What it could not free is
// left to CRIU, whose failure names the port.
func freePorts(ctx context.Context, log *slog.Logger, ls []hostreq.Listener) (int, error) {
	var need []hostreq.Listener
	for _, l := range ls {
		if !l.ReuseAddr {
			need = append(need, l)
		}
	}
	if len(need) == 0 {
		return 0, nil
	}
	blocking := func() ([]tcpdiag.Socket, error) {
		tw, err := tcpdiag.List(0, tcpdiag.StateTimeWait)
		if err != nil {
			return nil, err
		}
		var out []tcpdiag.Socket
		for _, s := range tw {
			for _, l := range need {
				if l.Conflicts(s.Local) {
					out = append(out, s)
					break
				}
			}
		}
		return out, nil
	}
	in, err := blocking()
	if err != nil || len(in) == 0 {
		return 0, err
	}
	ended := 0
	for _, s := range in {
		err := tcpdiag.Destroy(s)
		if errors.Is(err, tcpdiag.ErrNotSupported) {
			log.Warn("connections in TIME_WAIT hold ports the image listens on, and this kernel cannot end them: waiting for them to expire",
				"connections", len(in), "max_wait", timeWaitWait, "err", err)
			return ended, waitExpired(ctx, blocking)
		}
		if err != nil {
			return ended, err
		}
		ended++
		log.Info("ended a connection in TIME_WAIT on a port the image listens on", "connection", s.String())
	}
	return ended, nil
}

// waitExpired polls until blocking finds nothing, ctx ends, or timeWaitWait passes.
func waitExpired(ctx context.Context, blocking func() ([]tcpdiag.Socket, error)) error {
	deadline := time.Now().Add(timeWaitWait)
	for {
		left, err := blocking()
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
