package hostreq

import (
	"encoding/binary"
	"errors"
	"net/netip"
	"reflect"
	"testing"

	"github.com/checkpoint-restore/go-criu/v7/crit/images/fdinfo"
	fown "github.com/checkpoint-restore/go-criu/v7/crit/images/fown"
	skinet "github.com/checkpoint-restore/go-criu/v7/crit/images/sk-inet"
	skopts "github.com/checkpoint-restore/go-criu/v7/crit/images/sk-opts"
	"golang.org/x/sys/unix"
	"google.golang.org/protobuf/proto"
)

// inetEntry is a files.img entry of a TCP (or proto) socket bound to addr in state.
func inetEntry(id uint32, proto_, state uint32, addr netip.AddrPort, v6only bool) *fdinfo.FileEntry {
	fam := uint32(unix.AF_INET)
	raw := addr.Addr().AsSlice()
	if addr.Addr().Is6() {
		fam = unix.AF_INET6
	}
	var words []uint32
	for i := 0; i+4 <= len(raw); i += 4 {
		words = append(words, binary.NativeEndian.Uint32(raw[i:]))
	}
	z := uint32(0)
	return &fdinfo.FileEntry{Type: fdinfo.FdTypes_INETSK.Enum(), Id: proto.Uint32(id), Isk: &skinet.InetSkEntry{
		Id: proto.Uint32(id), Ino: proto.Uint32(id), Family: proto.Uint32(fam), Type: proto.Uint32(unix.SOCK_STREAM),
		Proto: proto.Uint32(proto_), State: proto.Uint32(state), SrcPort: proto.Uint32(uint32(addr.Port())), DstPort: &z,
		Flags: &z, Backlog: &z, SrcAddr: words, Fown: &fown.FownEntry{Uid: &z, Euid: &z, Signum: &z, PidType: &z, Pid: &z},
		Opts: &skopts.SkOptsEntry{SoSndbuf: &z, SoRcvbuf: &z, SoSndTmoSec: proto.Uint64(0), SoSndTmoUsec: proto.Uint64(0),
			SoRcvTmoSec: proto.Uint64(0), SoRcvTmoUsec: proto.Uint64(0)},
		V6Only: proto.Bool(v6only),
	}}
}

// TestListeners: the listening TCP sockets of files.img, each address once, with IPV6_V6ONLY;
// established TCP, UDP and regular files are not; a bad port or address is an error.
func TestListeners(t *testing.T) {
	v4 := netip.MustParseAddrPort("127.0.0.1:29500")
	v6 := netip.MustParseAddrPort("[::]:8080")
	img := image(magicFiles, regEntry(1, "/usr/bin/app"),
		inetEntry(2, unix.IPPROTO_TCP, tcpListen, v4, false),
		inetEntry(3, unix.IPPROTO_TCP, 1, netip.MustParseAddrPort("127.0.0.1:40000"), false), // established
		inetEntry(4, unix.IPPROTO_UDP, 7, netip.MustParseAddrPort("0.0.0.0:53"), false),
		inetEntry(5, unix.IPPROTO_TCP, tcpListen, v6, true),
		inetEntry(6, unix.IPPROTO_TCP, tcpListen, v4, false)) // a second descriptor of the same
	got, err := Listeners(img)
	if err != nil {
		t.Fatal(err)
	}
	want := []Listener{{Addr: v4}, {Addr: v6, V6Only: true}}
	if !reflect.DeepEqual(got, want) {
		t.Fatalf("Listeners = %+v, want %+v", got, want)
	}
	// Another descriptor of an address, not v6-only: the address takes the IPv4 port too.
	stricter := inetEntry(9, unix.IPPROTO_TCP, tcpListen, v6, false)
	if got, err := Listeners(image(magicFiles, inetEntry(5, unix.IPPROTO_TCP, tcpListen, v6, true), stricter)); err != nil ||
		!reflect.DeepEqual(got, []Listener{{Addr: v6}}) {
		t.Fatalf("two descriptors of [::]:8080, one not v6-only: %+v %v", got, err)
	}
	bad := inetEntry(7, unix.IPPROTO_TCP, tcpListen, v4, false)
	bad.Isk.SrcPort = proto.Uint32(70000)
	badAddr := inetEntry(8, unix.IPPROTO_TCP, tcpListen, v4, false)
	badAddr.Isk.SrcAddr = append(badAddr.Isk.SrcAddr, 1, 2, 3, 4)
	for name, b := range map[string][]byte{
		"port out of range":  image(magicFiles, bad),
		"address of 2 words": image(magicFiles, badAddr),
		"not files.img":      image(magicRemap),
		"garbage":            append(image(magicFiles), 3, 0, 0, 0, 0xff, 0xff, 0xff),
	} {
		if _, err := Listeners(b); !errors.Is(err, ErrInvalid) {
			t.Errorf("%s: err = %v, want ErrInvalid", name, err)
		}
	}
}

func TestListenerConflicts(t *testing.T) {
	ap := netip.MustParseAddrPort
	tests := []struct {
		l, b   string
		want   bool
		v6only bool
	}{
		{"[::]:80", "0.0.0.0:80", false, true},
		{"[::]:80", "[::1]:80", true, true},
		{"127.0.0.1:80", "127.0.0.1:80", true, false},
		{"127.0.0.1:80", "127.0.0.1:81", false, false},
		{"127.0.0.1:80", "10.0.0.1:80", false, false},
		{"0.0.0.0:80", "10.0.0.1:80", true, false},
		{"127.0.0.1:80", "0.0.0.0:80", true, false},
		{"[::]:80", "127.0.0.1:80", true, false},
		{"[::ffff:127.0.0.1]:80", "127.0.0.1:80", true, false},
		{"[::1]:80", "127.0.0.1:80", false, false},
	}
	for _, tt := range tests {
		if got := (Listener{Addr: ap(tt.l), V6Only: tt.v6only}).Conflicts(ap(tt.b)); got != tt.want {
			t.Errorf("%s conflicts with %s: %v, want %v", tt.l, tt.b, got, tt.want)
		}
	}
}
