package op

// Test hooks for the recovery tests (package op_test: they use the operations' step kinds).

// Die abandons a Txn as if ptxmig had been killed: the journal stays, unlocked, unended.
func (t *Txn) Die() { t.w.Abandon() }

// JournalPath is the Txn's journal file.
func (t *Txn) JournalPath() string { return t.w.Path() }

// BeginStep journals the beginning of the planned step named name, as Execute does before its Do.
func (t *Txn) BeginStep(name string) error {
	for _, s := range t.steps {
		if s.Name == name {
			return t.begin(Step{Name: name, Kind: s.Kind})
		}
	}
	return t.begin(Step{Name: name})
}

// EndStep journals the end of a step (err nil: done), as Execute does after its Do.
func (t *Txn) EndStep(name string, err error) { t.end(name, err) }

// UndoStep journals the beginning of a step's undo, as a rollback does.
func (t *Txn) UndoStep(name string) { t.undo(name) }
