package store

import (
	"encoding/json"

	"golang.org/x/sys/unix"
)

func mkfifo(p string) error { return unix.Mkfifo(p, 0o600) }

// jsonEncodeRaw encodes m without validation.
func jsonEncodeRaw(m *Manifest) ([]byte, error) {
	c := *m
	c.ID = ""
	return json.Marshal(&c)
}
