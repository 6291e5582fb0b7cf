"""`make bench`: ringserve side by side with vLLM CPU (see docs/benchmarks.md)."""
