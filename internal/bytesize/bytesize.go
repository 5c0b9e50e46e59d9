// Package bytesize formats byte counts for people, in binary (IEC) units with one decimal:
// "512 B", "1.5 KiB", "141.0 GiB", up to EiB.
package bytesize

import "fmt"

// Format renders n: below 1 KiB (negative n included) as "N B", else as "X.Y KiB" … "X.Y EiB",
// with the largest unit that keeps X at least 1.
func Format(n int64) string {
	if n < 1024 {
		return fmt.Sprintf("%d B", n)
	}
	return FormatU(uint64(n))
}

// FormatU is Format for unsigned counts (NVML's memory sizes, free space).
func FormatU(n uint64) string {
	const unit = 1024
	if n < unit {
		return fmt.Sprintf("%d B", n)
	}
	div, exp := uint64(unit), 0
	for m := n / unit; m >= unit; m /= unit {
		div *= unit
		exp++
	}
	return fmt.Sprintf("%.1f %ciB", float64(n)/float64(div), "KMGTPE"[exp])
}
