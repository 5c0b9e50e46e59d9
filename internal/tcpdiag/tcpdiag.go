// Package tcpdiag lists a host's TCP sockets and ends them through the kernel's sock_diag
// netlink interface (what `ss` and `ss -K` use). Restore needs it: CRIU binds a checkpointed
// listening socket to its port again, and a connection of the process's past that lingers in
// TIME_WAIT on that port (up to 60 s after it closed) makes the bind fail with EADDRINUSE unless
// the application had set SO_REUSEADDR.
package tcpdiag

import (
	"encoding/binary"
	"errors"
	"fmt"
	"net/netip"
	"syscall"

	"golang.org/x/sys/unix"
)

// TCP states as the kernel numbers them (include/net/tcp_states.h).
const (
	StateEstablished = 1
	StateFinWait1    = 4
	StateFinWait2    = 5 // also a timewait socket that is still waiting for the peer's FIN
	StateTimeWait    = 6
	StateLastAck     = 9
	StateListen      = 10
	StateClosing     = 11
)

// Closing are the states of a connection on its way out, which outlive the process that closed
// it (no inode then) and keep its port bound for up to a minute.
var Closing = []int{StateFinWait1, StateFinWait2, StateTimeWait, StateLastAck, StateClosing}

// errInterrupted: the socket tables changed during a dump, which may have missed some (List
// dumps again).
var errInterrupted = errors.New("netlink: the dump was interrupted by a change of the socket tables")

// ErrNotSupported: the kernel cannot end sockets through sock_diag (SOCK_DESTROY needs
// CONFIG_INET_DIAG_DESTROY; ending a TIME_WAIT socket, Linux 4.5 or later).
var ErrNotSupported = errors.New("this kernel cannot end TCP sockets (sock_diag SOCK_DESTROY: CONFIG_INET_DIAG_DESTROY)")

// Socket is one TCP socket as sock_diag reports it.
type Socket struct {
	State         int
	Local, Remote netip.AddrPort
	Inode         uint32 // 0 for a socket no process holds (TIME_WAIT)
	id            [sockIDLen]byte
	family        uint8
}

// String is "127.0.0.1:80 -> 127.0.0.1:5555 (TIME_WAIT)".
func (s Socket) String() string {
	names := map[int]string{StateEstablished: "ESTABLISHED", StateFinWait1: "FIN_WAIT1", StateFinWait2: "FIN_WAIT2",
		StateTimeWait: "TIME_WAIT", StateLastAck: "LAST_ACK", StateListen: "LISTEN", StateClosing: "CLOSING"}
	st, ok := names[s.State]
	if !ok {
		st = fmt.Sprintf("state %d", s.State)
	}
	return fmt.Sprintf("%s -> %s (%s)", s.Local, s.Remote, st)
}

const (
	sockDiagByFamily = 20 // SOCK_DIAG_BY_FAMILY
	sockDestroy      = 21 // SOCK_DESTROY
	sockIDLen        = 48 // struct inet_diag_sockid
	reqLen           = 8 + sockIDLen
	msgLen           = 4 + sockIDLen + 20 // struct inet_diag_msg
	maxReplies       = 256 << 20          // bytes of a dump read before giving up
)

// List returns the TCP sockets (IPv4 and IPv6) in any of states whose local port is port (every
// port when port is 0).
func List(port uint16, states ...int) ([]Socket, error) {
	var mask uint32
	for _, s := range states {
		if s <= 0 || s >= 32 {
			return nil, fmt.Errorf("tcpdiag: state %d out of range", s)
		}
		mask |= 1 << s
	}
	var out []Socket
	for _, fam := range []uint8{unix.AF_INET, unix.AF_INET6} {
		var got []Socket
		err := errInterrupted
		for try := 0; try < 3 && errors.Is(err, errInterrupted); try++ {
			got = got[:0]
			err = exchange(sockDiagByFamily, unix.NLM_F_DUMP, request(fam, mask, nil), func(b []byte) error {
				s, err := parse(b)
				if err != nil {
					return err
				}
				if port == 0 || s.Local.Port() == port {
					got = append(got, s)
				}
				return nil
			})
		}
		out = append(out, got...)
		// No IPv6 on this host. (tcp_diag serves both families: the same error for IPv4 means
		// sock_diag cannot list TCP sockets at all, which is an error.)
		if fam == unix.AF_INET6 && (errors.Is(err, unix.EAFNOSUPPORT) || errors.Is(err, unix.ENOENT)) {
			continue
		}
		if err != nil {
			return nil, fmt.Errorf("tcpdiag: list TCP sockets: %w", err)
		}
	}
	return out, nil
}

// Destroy ends s (a TIME_WAIT socket is forgotten at once; another is reset). A socket already
// gone is not an error, nor one whose address another socket has taken since it was listed (the
// kernel tells them apart by the listed socket's cookie and ends nothing then).
func Destroy(s Socket) error {
	err := exchange(sockDestroy, unix.NLM_F_ACK, request(s.family, 1<<uint(s.State), &s.id), nil)
	switch {
	case err == nil, errors.Is(err, unix.ENOENT), errors.Is(err, unix.ESTALE):
		return nil
	case errors.Is(err, unix.EOPNOTSUPP):
		return ErrNotSupported
	}
	return fmt.Errorf("tcpdiag: end %s: %w", s, err)
}

// request is a struct inet_diag_req_v2 for TCP.
func request(family uint8, states uint32, id *[sockIDLen]byte) []byte {
	b := make([]byte, reqLen)
	b[0], b[1] = family, unix.IPPROTO_TCP
	binary.NativeEndian.PutUint32(b[4:], states)
	if id != nil {
		copy(b[8:], id[:])
	} else {
		binary.NativeEndian.PutUint32(b[8+40:], 0xffffffff) // INET_DIAG_NOCOOKIE
		binary.NativeEndian.PutUint32(b[8+44:], 0xffffffff)
	}
	return b
}

// parse decodes a struct inet_diag_msg, validating its family.
func parse(b []byte) (Socket, error) {
	if len(b) < msgLen {
		return Socket{}, fmt.Errorf("tcpdiag: short inet_diag_msg (%d bytes)", len(b))
	}
	s := Socket{family: b[0], State: int(b[1])}
	copy(s.id[:], b[4:4+sockIDLen])
	sport := binary.BigEndian.Uint16(b[4:])
	dport := binary.BigEndian.Uint16(b[6:])
	addr := func(raw []byte) (netip.Addr, error) {
		switch s.family {
		case unix.AF_INET:
			return netip.AddrFrom4([4]byte(raw[:4])), nil
		case unix.AF_INET6:
			return netip.AddrFrom16([16]byte(raw[:16])), nil
		}
		return netip.Addr{}, fmt.Errorf("tcpdiag: socket of family %d", s.family)
	}
	src, err := addr(b[8:24])
	if err != nil {
		return Socket{}, err
	}
	dst, err := addr(b[24:40])
	if err != nil {
		return Socket{}, err
	}
	s.Local, s.Remote = netip.AddrPortFrom(src, sport), netip.AddrPortFrom(dst, dport)
	s.Inode = binary.NativeEndian.Uint32(b[4+sockIDLen+16:])
	return s, nil
}

// exchange sends one request of type typ and reads the replies to the end of a dump (flags has
// NLM_F_DUMP) or to the acknowledgement, passing each message's payload to each.
func exchange(typ uint16, flags uint16, payload []byte, each func([]byte) error) error {
	fd, err := unix.Socket(unix.AF_NETLINK, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, unix.NETLINK_SOCK_DIAG)
	if err != nil {
		return fmt.Errorf("netlink socket: %w", err)
	}
	defer unix.Close(fd)
	const seq = 1
	msg := make([]byte, unix.NLMSG_HDRLEN+len(payload))
	binary.NativeEndian.PutUint32(msg[0:], uint32(len(msg)))
	binary.NativeEndian.PutUint16(msg[4:], typ)
	binary.NativeEndian.PutUint16(msg[6:], unix.NLM_F_REQUEST|flags)
	binary.NativeEndian.PutUint32(msg[8:], seq)
	copy(msg[unix.NLMSG_HDRLEN:], payload)
	if err := unix.Sendto(fd, msg, 0, &unix.SockaddrNetlink{Family: unix.AF_NETLINK}); err != nil {
		return fmt.Errorf("netlink send: %w", err)
	}
	buf := make([]byte, 64<<10)
	total := 0
	for {
		n, from, err := unix.Recvfrom(fd, buf, 0)
		if err != nil {
			return fmt.Errorf("netlink receive: %w", err)
		}
		if nl, ok := from.(*unix.SockaddrNetlink); !ok || nl.Pid != 0 {
			continue // only the kernel's replies
		}
		if total += n; total > maxReplies {
			return fmt.Errorf("netlink: more than %d bytes of replies", maxReplies)
		}
		msgs, err := syscall.ParseNetlinkMessage(buf[:n])
		if err != nil {
			return fmt.Errorf("netlink: %w", err)
		}
		for _, m := range msgs {
			if m.Header.Seq != seq {
				continue
			}
			switch m.Header.Type {
			case unix.NLMSG_DONE: // its payload is the dump's error, if any
				if len(m.Data) >= 4 {
					if code := int32(binary.NativeEndian.Uint32(m.Data)); code != 0 {
						return unix.Errno(-code)
					}
				}
				if m.Header.Flags&unix.NLM_F_DUMP_INTR != 0 {
					return errInterrupted
				}
				return nil
			case unix.NLMSG_ERROR:
				if len(m.Data) < 4 {
					return errors.New("netlink: short error message")
				}
				if code := int32(binary.NativeEndian.Uint32(m.Data)); code != 0 {
					return unix.Errno(-code)
				}
				return nil // the acknowledgement
			default:
				if each != nil {
					if err := each(m.Data); err != nil {
						return err
					}
				}
			}
		}
	}
}
