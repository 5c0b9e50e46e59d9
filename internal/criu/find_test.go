package criu

import "testing"

func TestParseVersion(t *testing.T) {
	tests := []struct {
		in      string
		want    int
		text    string
		wantErr bool
	}{
		{"Version: 4.1.1\n", 40101, "4.1.1", false},
		{"Version: 3.17.1\n", 31701, "3.17.1", false},
		{"Version: 4.2\nGitID: v4.2-12-gabc\n", 40200, "4.2", false},
		{"criu: command not found", 0, "", true},
		{"", 0, "", true},
	}
	for _, tt := range tests {
		got, text, err := ParseVersion(tt.in)
		if (err != nil) != tt.wantErr || got != tt.want || text != tt.text {
			t.Errorf("ParseVersion(%q) = %d, %q, %v; want %d, %q, err=%v", tt.in, got, text, err, tt.want, tt.text, tt.wantErr)
		}
	}
}
