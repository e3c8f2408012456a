"""Each experiment's report: from its raw run records to its tables, plots,
summary JSON and generated RESULTS.md section (`--report-only`).

An experiment module (`benchmarks.cifar_patches`, `benchmarks.lm`,
`benchmarks.grokking`, `benchmarks.speed`) defines its configurations, arms and data, trains and
calls its report; a report module reads records and never imports its
experiment (what it needs of it, e.g. the arms' order, is passed in). The
shared pieces, the paired statistics and the table and finding formats, are
`benchmarks.stats` and `benchmarks.harness`.
"""
