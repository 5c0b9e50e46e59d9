package ptxstate

import (
	"bytes"
	"io"
)

// Print writes the module. An unmodified module prints exactly the bytes it was parsed from.
func (m *Module) Print(w io.Writer) error {
	var b bytes.Buffer
	for _, it := range m.Items {
		b.WriteString(it.Lead)
		if it.Func != nil {
			it.Func.print(&b)
		} else {
			b.WriteString(it.Text)
		}
	}
	b.WriteString(m.Trailer)
	_, err := w.Write(b.Bytes())
	return err
}

// Bytes returns the printed module.
func (m *Module) Bytes() []byte {
	var b bytes.Buffer
	_ = m.Print(&b)
	return b.Bytes()
}

func (f *Function) print(b *bytes.Buffer) {
	b.WriteString(f.Head)
	if f.Proto {
		return
	}
	for _, s := range f.Body {
		b.WriteString(s.Lead)
		b.WriteString(s.Text)
	}
	b.WriteString(f.Close)
}
