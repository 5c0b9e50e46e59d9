package criu

import (
	"slices"
	"strings"
	"testing"

	"github.com/checkpoint-restore/go-criu/v7/rpc"
	"google.golang.org/protobuf/proto"
)

// TestCLIArgsRenderTheRPCOptions: a streamed dump or restore runs CRIU with the same options the
// RPC request carries, each rendered as its command-line flag, and any option without a
// rendering is refused rather than dropped.
func TestCLIArgsRenderTheRPCOptions(t *testing.T) {
	dump, err := BuildDumpOpts(DumpOptions{PID: 4242, ImagesDir: "/img", LeaveStopped: true, ShellJob: true,
		TCPEstablished: true, FileLocks: true, ExtUnixSk: true}, 7)
	if err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		name      string
		verb      string
		opts      *rpc.CriuOpts
		images    string
		work      string
		want      string
		wantError string
	}{
		{name: "dump", verb: "dump", opts: dump, images: "/img",
			want: "dump --stream -D /img -v4 -o dump.log -t 4242 --leave-stopped --shell-job --tcp-established --file-locks --ext-unix-sk --ghost-limit 1073741824"},
		{name: "dump leave running", verb: "dump", images: "/img",
			opts: must(BuildDumpOpts(DumpOptions{PID: 9, LeaveRunning: true}, 3)),
			want: "dump --stream -D /img -v4 -o dump.log -t 9 --leave-running --ghost-limit 1073741824"},
		{name: "restore", verb: "restore", images: "/proc/self/fd/3", work: "/w",
			opts: must(BuildRestoreOpts(RestoreOptions{ShellJob: true, CgroupDir: "/sys/fs/cgroup/x"}, 3, 4)),
			want: "restore --stream -D /proc/self/fd/3 -W /w -v4 -o restore.log --shell-job --manage-cgroups=ignore --restore-detached --pidfile /w/restore.pid"},
		{name: "dump tcp nftables", verb: "dump", images: "/img",
			opts: must(BuildDumpOpts(DumpOptions{PID: 9, TCPEstablished: true, NetworkLock: NetworkLockNftables}, 3)),
			want: "dump --stream -D /img -v4 -o dump.log -t 9 --tcp-established --ghost-limit 1073741824 --network-lock nftables"},
		{name: "restore tcp iptables", verb: "restore", images: "/img",
			opts: must(BuildRestoreOpts(RestoreOptions{TCPEstablished: true, NetworkLock: NetworkLockIptables}, 3, -1)),
			want: "restore --stream -D /img -v4 -o restore.log --tcp-established --network-lock iptables --restore-detached --pidfile /img/restore.pid"},
		{name: "network lock without a rendering", verb: "dump", images: "/img",
			opts:      &rpc.CriuOpts{LogLevel: proto.Int32(4), LogFile: proto.String("d.log"), NetworkLock: rpc.CriuNetworkLockMethod_SKIP.Enum()},
			wantError: "network lock SKIP"},
		{name: "option without a rendering", verb: "dump", images: "/img",
			opts:      func() *rpc.CriuOpts { o := proto.Clone(dump).(*rpc.CriuOpts); o.TrackMem = proto.Bool(true); return o }(),
			wantError: "without a command-line rendering"},
		{name: "cgroup mode without a rendering", verb: "restore", images: "/img",
			opts:      &rpc.CriuOpts{LogLevel: proto.Int32(4), LogFile: proto.String("r.log"), ManageCgroupsMode: rpc.CriuCgMode_FULL.Enum()},
			wantError: "cgroup mode FULL"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			args, err := cliArgs(tt.verb, tt.opts, tt.images, tt.work)
			if tt.wantError != "" {
				if err == nil || !strings.Contains(err.Error(), tt.wantError) {
					t.Fatalf("err = %v, want %q", err, tt.wantError)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if got := strings.Join(args, " "); got != tt.want {
				t.Errorf("args\n got %s\nwant %s", got, tt.want)
			}
			if slices.Contains(args, "swrk") {
				t.Error("swrk in a command line")
			}
		})
	}
}

func must(o *rpc.CriuOpts, err error) *rpc.CriuOpts {
	if err != nil {
		panic(err)
	}
	return o
}
