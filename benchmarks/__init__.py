"""The scripts behind docs/performance.md, each run from the repository root as
`python -m benchmarks.NAME`; `benchmarks.probes` holds one-off measurements that a figure in the
docs quotes but that no test or device check reruns."""
