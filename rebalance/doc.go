// Package rebalance keeps a node's GPUs evenly loaded by moving live CUDA processes between GPUs
// of the same chip type. One call of Runner.Run is one cron pass:
//
//	lock → load state → observe (NVML, /proc) → plan (pure) → migrate one move at a time,
//	verifying each → save state → report (text, JSON, Prometheus textfile)
//
// The planner (MakePlan) is a pure function of an Observation, a Policy, the move history and
// the current time, so it is tested with synthetic fleets. Side effects go through small
// interfaces (Observer, Migrator, Clock) that tests replace with fakes. The policy file format,
// the scoring model and the metrics are documented in docs/REBALANCE.md.
package rebalance
