package main

import (
	"fmt"

	"github.com/urfave/cli/v2"

	"github.com/ptxmig/ptxmig/internal/exitcode"
	"github.com/ptxmig/ptxmig/internal/op"
	"github.com/ptxmig/ptxmig/store"
)

// openStoreRead opens the existing store named by --store for reading. It never creates one: a
// missing store is an error naming the path (exit 6). A read-only store opens read-only.
func openStoreRead(c *cli.Context) (*store.Store, error) {
	return store.OpenWith(env(c).Store, store.OpenOptions{})
}

// openStoreWrite opens the store named by --store for writing, creating it (and saying so on
// stderr) when it does not exist; its parent directory must. A read-only store is refused.
func openStoreWrite(c *cli.Context) (*store.Store, error) { return openWritable(c, true) }

// openStoreModify opens the existing store for a command that changes what is in it (rm, gc):
// a missing store is not created (exit 6), a read-only one is refused.
func openStoreModify(c *cli.Context) (*store.Store, error) { return openWritable(c, false) }

func openWritable(c *cli.Context, create bool) (*store.Store, error) {
	s, err := store.OpenWith(env(c).Store, store.OpenOptions{Create: create})
	if err != nil {
		return nil, err
	}
	if s.ReadOnly() {
		return nil, exitcode.Refusedf("store %s is read-only (%s cannot write to it); reads work: images, image inspect, verify, extract, export, restore",
			env(c).Store, commandPath(c))
	}
	announceCreated(c, s)
	return s, nil
}

// announceCreated tells stderr that a command made a new store.
func announceCreated(c *cli.Context, s *store.Store) {
	if s.Created() {
		fmt.Fprintf(env(c).Err, "ptxmig: created a new image store in %s\n", esc(s.Dir()))
	}
}

// hint is a ptxmig command line to print for people: it names --store when the store is not the
// default one, so that it works as printed, e.g. "ptxmig --store /data/s restore job-1".
func hint(c *cli.Context, args ...string) string {
	s := "ptxmig"
	if st := env(c).Store; st != defaultStore {
		s += " --store " + shellQuote(st)
	}
	for _, a := range args {
		s += " " + shellQuote(a)
	}
	return s
}

// shellQuote quotes a word for sh when it holds anything beyond safe characters.
func shellQuote(s string) string { return op.ShellQuote(esc(s)) }
