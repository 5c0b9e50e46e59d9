package op

import (
	"errors"
	"fmt"
)

// ErrRefused marks preflight refusals: nothing was touched.
var ErrRefused = errors.New("refused")

// Refusal is a preflight failure; it wraps ErrRefused and the cause.
type Refusal struct{ Err error }

func (r *Refusal) Error() string   { return r.Err.Error() }
func (r *Refusal) Unwrap() []error { return []error{ErrRefused, r.Err} }

// Refusef makes a Refusal from a format, like fmt.Errorf (%w wraps).
func Refusef(format string, a ...any) error { return &Refusal{Err: fmt.Errorf(format, a...)} }

// Refuse marks err as a refusal (nil stays nil; a refusal stays as it is).
func Refuse(err error) error {
	if err == nil || errors.Is(err, ErrRefused) {
		return err
	}
	return &Refusal{Err: err}
}
