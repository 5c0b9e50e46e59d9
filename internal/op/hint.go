package op

import (
	"path/filepath"
	"strings"
)

// DefaultStoreDir is where the image store lives unless --store (or $PTXMIG_STORE) says
// otherwise.
const DefaultStoreDir = "/var/lib/ptxmig"

// Command is a ptxmig command line to print as a hint ("remove it with `ptxmig image rm x`"). It
// carries --store storeDir unless storeDir is "" or the default store (or where a symlinked
// default leads): the command must act on the same store. Words are quoted for sh when needed.
func Command(storeDir string, args ...string) string {
	s := "ptxmig"
	if storeDir != "" && !isDefaultStore(storeDir) {
		s += " --store " + ShellQuote(storeDir)
	}
	for _, a := range args {
		s += " " + ShellQuote(a)
	}
	return s
}

func isDefaultStore(dir string) bool {
	if dir == DefaultStoreDir {
		return true
	}
	resolved, err := filepath.EvalSymlinks(DefaultStoreDir)
	return err == nil && resolved == dir
}

// ShellQuote quotes a word for sh when it holds anything beyond letters, digits and -_./=:@+,%.
func ShellQuote(s string) string {
	if s != "" && strings.Trim(s, "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_./=:@+,%") == "" {
		return s
	}
	return "'" + strings.ReplaceAll(s, "'", `'\''`) + "'"
}
