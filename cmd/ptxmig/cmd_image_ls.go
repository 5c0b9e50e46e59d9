package main

import (
	"github.com/urfave/cli/v2"
)

// imageLsCommand is `ptxmig image ls`.
func imageLsCommand() *cli.Command {
	return &cli.Command{
		Name:    "ls",
		Aliases: []string{"list"},
		Usage:   "list the images in the store (same as `ptxmig images`)",
		Description: imagesDescription + "\n\n" +
			"Examples:\n" +
			"   ptxmig image ls\n" +
			"   ptxmig image ls -q                        # ids only, one a line\n" +
			"   ptxmig --store /mnt/shared/ptxmig image list --json",
		Flags:  imagesFlags(),
		Action: imagesList,
	}
}
