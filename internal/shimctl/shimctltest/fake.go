// Package shimctltest serves canned control-socket replies, standing in for the shim in tests of
// shimctl and of the commands that use it.
package shimctltest

import (
	"bufio"
	"net"
	"strings"
	"testing"
)

// Serve listens on the Unix socket path until the test ends and answers each request line with
// the reply whose key appears as the request's "cmd"; a request no key matches closes the
// connection. A reply without a trailing newline is sent and the connection closed, like a shim
// that went away mid-line; a reply ending in two newlines is sent with one and the connection
// closed, like the shim after "detach".
func Serve(t testing.TB, path string, replies map[string]string) {
	t.Helper()
	ServeFunc(t, path, func(line string) string {
		var reply string
		for k, v := range replies {
			if strings.Contains(line, `"cmd":"`+k+`"`) {
				reply = v
			}
		}
		return reply
	})
}

// ServeFunc is Serve with the reply to each request line computed by answer ("" closes the
// connection), for a fake whose answers depend on what it was asked before.
func ServeFunc(t testing.TB, path string, answer func(line string) string) {
	t.Helper()
	l, err := net.Listen("unix", path)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				sc := bufio.NewScanner(c)
				for sc.Scan() {
					reply := answer(sc.Text())
					if reply == "" {
						return
					}
					if strings.HasSuffix(reply, "\n\n") {
						c.Write([]byte(reply[:len(reply)-1]))
						return
					}
					c.Write([]byte(reply))
					if !strings.HasSuffix(reply, "\n") {
						return
					}
				}
			}()
		}
	}()
}
