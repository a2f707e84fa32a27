"""Benchmarking: the interleaved bench loop (`runner`), prompt-lookup decoding as a baseline
method (`pld`), and the tallies and report sections built from its results (`summary`).
`dflow bench` (dflow/commands/bench.py) is the entry point."""
