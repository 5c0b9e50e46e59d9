package hostreq

import (
	"encoding/binary"
	"fmt"
	"net/netip"

	"github.com/checkpoint-restore/go-criu/v7/crit/images/fdinfo"
	"golang.org/x/sys/unix"
	"google.golang.org/protobuf/proto"
)

// MaxListeners bounds the listening sockets decoded from one image.
const MaxListeners = 10_000

// Listener is a listening TCP socket the image's processes held: CRIU binds its address again
// at restore, so the port must be free on the target host. V6Only: IPV6_V6ONLY (an IPv6 socket
// that does not also take the IPv4 port). (CRIU binds with SO_REUSEADDR and SO_REUSEPORT set
// whatever the application had, so those are not kept.)
type Listener struct {
	Addr   netip.AddrPort
	V6Only bool
}

// Listeners reads the listening TCP sockets (IPv4 and IPv6) from CRIU's files.img, each
// address once, in image order.
func Listeners(files []byte) ([]Listener, error) {
	var out []Listener
	seen := map[netip.AddrPort]int{}
	err := entries(files, magicFiles, func(b []byte) error {
		var e fdinfo.FileEntry
		if err := proto.Unmarshal(b, &e); err != nil {
			return err
		}
		s := e.GetIsk()
		if e.GetType() != fdinfo.FdTypes_INETSK || s == nil || s.GetProto() != unix.IPPROTO_TCP || s.GetState() != tcpListen {
			return nil
		}
		if s.GetSrcPort() == 0 || s.GetSrcPort() > 65535 {
			return fmt.Errorf("listening socket %d: port %d", s.GetId(), s.GetSrcPort())
		}
		var raw [16]byte
		words := s.GetSrcAddr()
		for i, w := range words {
			if i >= 4 {
				break
			}
			binary.NativeEndian.PutUint32(raw[4*i:], w) // the kernel's bytes, in network order
		}
		var addr netip.Addr
		switch {
		case s.GetFamily() == unix.AF_INET && len(words) >= 1 && len(words) <= 4: // CRIU reads the first (old images had 4)
			addr = netip.AddrFrom4([4]byte(raw[:4]))
		case s.GetFamily() == unix.AF_INET6 && len(words) == 4:
			addr = netip.AddrFrom16(raw)
		default:
			return fmt.Errorf("listening socket %d: family %d with %d address words", s.GetId(), s.GetFamily(), len(words))
		}
		ap := netip.AddrPortFrom(addr, uint16(s.GetSrcPort()))
		l := Listener{Addr: ap, V6Only: s.GetV6Only()}
		if i, ok := seen[ap]; ok { // another descriptor of the address: the stricter (taking IPv4 too)
			out[i].V6Only = out[i].V6Only && l.V6Only
			return nil
		}
		seen[ap] = len(out)
		out = append(out, l)
		if len(out) > MaxListeners {
			return fmt.Errorf("more than %d listening sockets", MaxListeners)
		}
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("%w: %s: %v", ErrInvalid, FilesImage, err)
	}
	return out, nil
}

const tcpListen = 10 // TCP_LISTEN

// Conflicts reports whether a socket bound to b may stand in the way of binding l's address:
// the same port, and the same address or either one unspecified (an IPv6 wildcard takes the
// IPv4 port too unless it is IPV6_V6ONLY, which only l's side records). It can say yes where the
// kernel would allow the bind (SO_REUSEPORT, a v6-only socket here): restore confirms with a
// trial bind before it refuses.
func (l Listener) Conflicts(b netip.AddrPort) bool {
	if l.Addr.Port() != b.Port() {
		return false
	}
	la, ba := l.Addr.Addr().Unmap(), b.Addr().Unmap()
	if l.V6Only && la.Is6() && ba.Is4() {
		return false
	}
	return la == ba || la.IsUnspecified() || ba.IsUnspecified()
}
