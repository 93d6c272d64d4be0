"""One-off measurements behind a figure or an explanation in docs/performance.md (run as
`python -m benchmarks.probes.NAME`): kept to rerun by hand, not part of the device check."""
