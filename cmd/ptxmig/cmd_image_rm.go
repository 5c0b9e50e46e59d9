package main

import (
	"fmt"

	"github.com/urfave/cli/v2"
)

// imageRmCommand is `ptxmig image rm`.
func imageRmCommand() *cli.Command {
	return &cli.Command{
		Name:      "rm",
		Usage:     "remove images (their chunks are freed by gc)",
		ArgsUsage: "NAME|ID...",
		Description: "Removes the manifests; `ptxmig image gc` frees the chunks no image uses. Every NAME|ID is\n" +
			"checked first: when one does not exist (exit 6) or is ambiguous (exit 2), nothing is removed.\n" +
			"A damaged image (by NAME) is removed too, also when its manifest is not a regular file: a\n" +
			"symlink is removed itself, never what it points to.\n\n" +
			"Examples:\n" +
			"   ptxmig image rm trainer-1\n" +
			"   ptxmig image rm trainer-1 trainer-2 && ptxmig image gc",
		Action: imageRm,
	}
}

func imageRm(c *cli.Context) error {
	if err := argsAtLeast(c, 1); err != nil {
		return err
	}
	s, err := openStoreModify(c)
	if err != nil {
		return err
	}
	refs := c.Args().Slice()
	if err := checkRefs(s, refs, true); err != nil {
		return fmt.Errorf("%w; nothing was removed", err)
	}
	removed := []string{}
	for _, ref := range refs {
		if err := s.Remove(ref); err != nil {
			return withResult(err, map[string]any{"removed": removed})
		}
		removed = append(removed, ref)
		if !env(c).JSON {
			fmt.Fprintf(env(c).Out, "removed %s\n", esc(ref))
		}
	}
	if env(c).JSON {
		return printJSON(c, map[string]any{"removed": removed})
	}
	fmt.Fprintf(env(c).Out, "free their chunks with: %s\n", hint(c, "image", "gc"))
	return nil
}
