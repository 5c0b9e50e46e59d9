package op

import (
	"fmt"
	"strings"
)

// PIDList writes pids for people: "412, 413".
func PIDList(pids []int) string {
	s := make([]string, len(pids))
	for i, p := range pids {
		s[i] = fmt.Sprint(p)
	}
	return strings.Join(s, ", ")
}
